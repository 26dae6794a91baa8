"""Key maps of the Swin family (SLAB authors', RePaViT, official and timm Swin) to mmslab's
(= mmdet's) names: stages, blocks, FFN layers, and the patch-merging channel order."""
import re
from collections import OrderedDict
from typing import Dict, List

from torch import Tensor

from .common import MODEL_BUFFERS, any_key_matches

# Official patch merging concatenates the 2x2 offsets (dh, dw) in the order
# (0,0), (1,0), (0,1), (1,1), channel-minor; mmslab/mmdet use nn.Unfold's channel-major order
# with offsets (0,0), (0,1), (1,0), (1,1). Our offset j comes from official offset _UNFOLD[j].
_UNFOLD = [0, 2, 1, 3]


def _unfold_reduction(w: Tensor) -> Tensor:
    """Columns of a patch-merging ``reduction`` weight from official to unfold order."""
    out, c4 = w.shape
    return w.reshape(out, 4, c4 // 4)[:, _UNFOLD].transpose(1, 2).reshape(out, c4)


def _unfold_vector(v: Tensor) -> Tensor:
    """A per-channel vector of the patch-merging norm from official to unfold order.

    Scalars (``alpha``, counters, ``num_batches_tracked``) are returned unchanged.
    """
    if v.dim() != 1 or v.numel() <= 1:
        return v
    if v.numel() % 4:
        raise ValueError(f'patch-merging norm vector of length {v.numel()} is not 4*C')
    return v.reshape(4, -1)[_UNFOLD].t().reshape(-1)


def _swin_block_key(sub: str, channel_idle: bool) -> str:
    if sub.startswith('attn.'):
        return 'attn.w_msa.' + sub[5:]
    if sub.startswith('mlp.'):
        rest = sub[4:]
        if rest.startswith('norm1.') or rest.startswith('norm2.'):
            return 'ffn.' + rest  # RePaViT: BatchNorms inside the FFN
        if rest.startswith('norm.'):
            return 'norm2.' + rest[5:]  # RePaViT LayerNorm variant: the block's pre-FFN norm
        if channel_idle:
            return 'ffn.' + rest
        if rest.startswith('fc1.'):
            return 'ffn.layers.0.0.' + rest[4:]
        if rest.startswith('fc2.'):
            return 'ffn.layers.1.' + rest[4:]
    return sub


def convert_swin_keys(sd: Dict[str, Tensor], fmt: str, dropped: List[str]) -> 'OrderedDict':
    """Map a Swin-family ``sd`` in layout ``fmt`` to mmslab names; appends the source keys
    the backbone has no place for to ``dropped``."""
    channel_idle = any_key_matches(sd, r'\.mlp\.norm[12]\.')
    new = OrderedDict()
    for k, v in sd.items():
        if k.startswith('head.') or k.startswith('norm.') or k.endswith(MODEL_BUFFERS):
            dropped.append(k)  # classifier, final classification norm, recomputed buffers
            continue
        nk = k
        if k.startswith('patch_embed.proj.'):
            nk = 'patch_embed.projection.' + k[len('patch_embed.proj.'):]
        elif k.startswith('layers.'):
            m = re.match(r'layers\.(\d+)\.(.*)$', k)
            i, rest = int(m.group(1)), m.group(2)
            if rest.startswith('blocks.'):
                bm = re.match(r'blocks\.(\d+)\.(.*)$', rest)
                nk = f'stages.{i}.blocks.{bm.group(1)}.' + _swin_block_key(bm.group(2),
                                                                             channel_idle)
            elif rest.startswith('downsample.'):
                if fmt == 'timm':  # timm merges at the start of the next stage
                    if i == 0:
                        raise ValueError(f'timm layout with a downsample in stage 0: {k}')
                    i -= 1
                nk = f'stages.{i}.{rest}'
                if rest == 'downsample.reduction.weight':
                    v = _unfold_reduction(v)
                elif rest.startswith('downsample.norm.'):
                    v = _unfold_vector(v)
            else:
                nk = f'stages.{i}.{rest}'
        new[nk] = v
    return new

