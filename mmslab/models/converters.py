"""Converters from published checkpoints to mmslab backbone state dicts.

Source layouts (``FORMATS``):

``slab``
    The SLAB authors' ImageNet checkpoints (``{'model': ...}``), Swin style
    (PRepBN-Swin, SLAB-Swin: ``layers.{i}.blocks.{j}...``) or PVT style (PRepBN-PVT, SLAB-PVT:
    ``patch_embed{s}``, ``pos_embed{s}``, ``block{s}.{j}``). Their progressive norm at prefix
    ``p`` holds ``p.norm1.*`` (LayerNorm), ``p.norm2.{alpha,bn.*}`` (RepBN) and the counters
    ``p.iter`` (remaining decay steps), ``p.total_step`` and ``p.warm``; a pure RepBN holds
    ``p.alpha`` and ``p.bn.*``.
``repavit``
    RePaViT's RePa-Swin (``mlp.{norm1,fc1,norm2,fc2}``: BatchNorms inside the FFN).
``swin``
    Microsoft's official Swin (downsample at the end of stages ``0..n-2``).
``timm``
    timm's ``SwinTransformer`` (downsample at the start of stages ``1..n-1``, ``head.fc``).
``pvt``
    The official PVT v1 (``cls_token``, stage-4 position embedding with the class token).
``mmslab``
    Already in mmslab's (= mmdet's) names; only the norm forms and schedule are adapted.

:func:`convert` maps any of them to the names of :class:`ReparamSwinTransformer` /
:class:`ReparamPVT` (and their presets). The progressive-norm schedule of the authors counts
*down*: ``iter`` is the number of decay steps left out of ``total_step``, so the fraction done is
``1 - iter / total_step``; it becomes mmslab's ``schedule_offset`` (``cur_iter`` restarts at 0).
"""
import math
import re
from collections import OrderedDict
from typing import Collection, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = ['FORMATS', 'ARCHS', 'detect_format', 'convert', 'strip_wrappers',
           'resize_relative_position_bias_table', 'resize_positional_encoding',
           'adapt_to_model', 'infer_backbone_cfg', 'progressive_schedule_info',
           'model_owned_keys', 'drop_model_owned_buffers']

FORMATS = ('slab', 'repavit', 'swin', 'timm', 'pvt', 'mmslab')

_FORMAT_HELP = ("slab (SLAB authors' PRepBN/SLAB Swin and PVT), repavit (RePaViT RePa-Swin), "
                "swin (official Microsoft Swin), timm (timm SwinTransformer), pvt (official PVT "
                "v1), mmslab (already converted / mmdet names)")

#: Named architectures for ``arch=``: the mmslab class, its ``arch`` preset, the norm form the
#: class expects (``None`` = LayerNorm) and the geometry the checkpoint must have.
ARCHS: Dict[str, dict] = {}


def _register_archs():
    swin = {'t': 'tiny', 's': 'small', 'b': 'base'}
    pvt = {'t': 'tiny', 's': 'small', 'm': 'medium'}
    for s, a in swin.items():
        ARCHS[f'swin_{s}'] = dict(type='ReparamSwinTransformer', arch=a, norm=None)
        ARCHS[f'repa_swin_{s}'] = dict(type='RePaSwin', arch=a, norm=None)
        ARCHS[f'prepbn_swin_{s}'] = dict(type='PRepBNSwin', arch=a, norm='PRepBN')
        ARCHS[f'slab_swin_{s}'] = dict(type='SLABSwin', arch=a, norm='PRepBN')
    for s, a in pvt.items():
        ARCHS[f'pvt_{s}'] = dict(type='ReparamPVT', arch=a, norm=None)
        ARCHS[f'prepbn_pvt_{s}'] = dict(type='PRepBNPVT', arch=a, norm='PRepBN')
        ARCHS[f'slab_pvt_{s}'] = dict(type='SLABPVT', arch=a, norm='PRepBN')


_register_archs()

_SWIN_FORMATS = ('slab', 'repavit', 'swin', 'timm')
# Buffers every model recomputes itself: never taken from a checkpoint.
_MODEL_BUFFERS = ('relative_position_index', 'attn_mask')
# Official patch merging concatenates the 2x2 offsets (dh, dw) in the order
# (0,0), (1,0), (0,1), (1,1), channel-minor; mmslab/mmdet use nn.Unfold's channel-major order
# with offsets (0,0), (0,1), (1,0), (1,1). Our offset j comes from official offset _UNFOLD[j].
_UNFOLD = [0, 2, 1, 3]


# ------------------------------------------------------------------------------------------
# Small helpers
# ------------------------------------------------------------------------------------------
def strip_wrappers(state_dict: Dict[str, Tensor]) -> 'OrderedDict[str, Tensor]':
    """Drop a ``module.`` (DDP) prefix and, for detector/segmentor checkpoints, keep only the
    ``backbone.`` entries without their prefix."""
    sd = OrderedDict(state_dict)
    if sd and all(k.startswith('module.') for k in sd):
        sd = OrderedDict((k[7:], v) for k, v in sd.items())
    if any(k.startswith('backbone.') for k in sd):
        sd = OrderedDict((k[9:], v) for k, v in sd.items() if k.startswith('backbone.'))
    return sd


def _any(keys, pattern: str) -> bool:
    rx = re.compile(pattern)
    return any(rx.search(k) for k in keys)


def _is_square(n: int) -> bool:
    return n > 0 and int(round(math.sqrt(n))) ** 2 == n


def _isqrt(n: int, what: str) -> int:
    if not _is_square(n):
        raise ValueError(f'{what} has {n} entries, not a square grid')
    return int(round(math.sqrt(n)))


def _pair(x) -> Tuple[int, int]:
    return (int(x[0]), int(x[1])) if isinstance(x, (tuple, list)) else (int(x), int(x))


# ------------------------------------------------------------------------------------------
# Format detection
# ------------------------------------------------------------------------------------------
def detect_format(state_dict: Dict[str, Tensor]) -> str:
    """Which layout ``state_dict`` (a plain tensor dict) is in: one of :data:`FORMATS`.

    Raises ValueError (listing the known formats) for any other layout.
    """
    keys = list(strip_wrappers(state_dict))
    if not keys:
        raise ValueError(f'empty state dict; known formats: {_FORMAT_HELP}')
    if _any(keys, r'^(stages\.\d+\.blocks\.\d+\.|patch_embed\.projection\.|'
                  r'layers\.\d+\.0\.projection\.|layers\.\d+\.1\.\d+\.)'):
        return 'mmslab'
    authors = (_any(keys, r'\.(total_step|alpha)$') or
               _any(keys, r'\.attn\.(dwc\.|positional_encoding$)'))
    if _any(keys, r'^(patch_embed\d+\.proj\.|block\d+\.\d+\.)'):
        return 'slab' if authors else 'pvt'
    if _any(keys, r'^layers\.\d+\.blocks\.\d+\.') and 'patch_embed.proj.weight' in keys:
        if _any(keys, r'\.mlp\.norm[12]?\.'):
            return 'repavit'
        if authors:
            return 'slab'
        if _any(keys, r'^layers\.0\.downsample\.'):
            return 'swin'
        if _any(keys, r'^layers\.[1-9]\d*\.downsample\.') or 'head.fc.weight' in keys:
            return 'timm'
        return 'swin'  # no patch merging at all: both layouts coincide
    raise ValueError(f'unknown checkpoint layout (first keys: {keys[:4]}); known formats: '
                     f'{_FORMAT_HELP}')


# ------------------------------------------------------------------------------------------
# Swin family (slab / repavit / swin / timm)
# ------------------------------------------------------------------------------------------
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


def _convert_swin(sd: Dict[str, Tensor], fmt: str, dropped: List[str]) -> 'OrderedDict':
    channel_idle = _any(sd, r'\.mlp\.norm[12]\.')
    new = OrderedDict()
    for k, v in sd.items():
        if k.startswith('head.') or k.startswith('norm.') or k.endswith(_MODEL_BUFFERS):
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


# ------------------------------------------------------------------------------------------
# PVT family (official PVT v1 / SLAB PVT)
# ------------------------------------------------------------------------------------------
def _convert_pvt(sd: Dict[str, Tensor], dropped: List[str]) -> 'OrderedDict':
    if _any(sd, r'\.mlp\.dwconv\.'):
        raise ValueError('PVT v2 checkpoints (mlp.dwconv) are not supported: mmslab has PVT v1')
    offset = 1 if _any(sd, r'^pos_embed\d+$') else 0  # blocks follow the position embedding
    sla_blocks = set()
    for k in sd:
        m = re.match(r'block(\d+)\.(\d+)\.attn\.(dwc\.|positional_encoding$)', k)
        if m:
            sla_blocks.add((m.group(1), m.group(2)))
    new = OrderedDict()
    for k, v in sd.items():
        if k == 'cls_token' or k.startswith('head.') or k.startswith('norm.'):
            dropped.append(k)
            continue
        m = re.match(r'patch_embed(\d+)\.(proj|norm)\.(.*)$', k)
        if m:
            name = 'projection' if m.group(2) == 'proj' else 'norm'
            new[f'layers.{int(m.group(1)) - 1}.0.{name}.{m.group(3)}'] = v
            continue
        m = re.match(r'pos_embed(\d+)$', k)
        if m:
            n = v.shape[1]
            if not _is_square(n) and _is_square(n - 1):
                v = v[:, 1:]  # PVT v1 stage 4: drop the class token's embedding
            new[f'layers.{int(m.group(1)) - 1}.1.0.pos_embed'] = v
            continue
        m = re.match(r'block(\d+)\.(\d+)\.(.*)$', k)
        if not m:
            new[k] = v  # unknown: reported as unexpected when loading
            continue
        s, j, sub = m.group(1), m.group(2), m.group(3)
        base = f'layers.{int(s) - 1}.1.{int(j) + offset}.'
        sla = (s, j) in sla_blocks
        if sub.startswith('attn.kv.'):
            if f'block{s}.{j}.attn.q.{sub[8:]}' not in sd:
                raise ValueError(f'{k} has no matching attn.q entry')
            continue  # consumed together with attn.q
        if sub.startswith('attn.q.'):
            what = sub[7:]
            kv = sd.get(f'block{s}.{j}.attn.kv.{what}')
            if kv is None:
                raise ValueError(f'{k} has no matching attn.kv entry')
            qkv = torch.cat([v, kv], dim=0)
            if sla:
                new[base + f'attn.kernel.qkv.{what}'] = qkv
            else:
                new[base + f'attn.attn.in_proj_{what}'] = qkv
        elif sub.startswith('attn.proj.'):
            new[base + ('attn.kernel.proj.' if sla else 'attn.attn.out_proj.') + sub[10:]] = v
        elif sub.startswith('attn.dwc.') or sub == 'attn.positional_encoding':
            new[base + 'attn.kernel.' + sub[5:]] = v
        elif sub.startswith('attn.sr.') or sub.startswith('attn.norm.'):
            if sla:
                raise ValueError(f'{k}: SLA with spatial reduction (sr_ratio > 1) is not '
                                 'supported (mmslab SLA-PVT stages use sr=1)')
            new[base + sub] = v
        elif sub.startswith('mlp.fc1.') or sub.startswith('mlp.fc2.'):
            idx = 0 if sub.startswith('mlp.fc1.') else 3
            if sub.endswith('.weight'):
                v = v.reshape(*v.shape, 1, 1)  # 1x1 convs in mmdet's FFN
            new[base + f'ffn.layers.{idx}.' + sub[8:]] = v
        else:
            new[base + sub] = v  # norm1 / norm2
    return new


# ------------------------------------------------------------------------------------------
# Norm forms and schedule
# ------------------------------------------------------------------------------------------
def _target_form(prefix: str, target_norm) -> Optional[str]:
    if target_norm is None or isinstance(target_norm, str):
        return target_norm
    if f'{prefix}.norm2.alpha' in target_norm:
        return 'PRepBN'
    if f'{prefix}.alpha' in target_norm:
        return 'RepBN'
    return None


def _move(sd: Dict[str, Tensor], src: str, dst: str) -> None:
    for k in [k for k in sd if k.startswith(src + '.')]:
        sd[dst + k[len(src):]] = sd.pop(k)


def _convert_norms(sd: 'OrderedDict', dropped: List[str], reset_schedule: bool,
                   target_norm) -> 'OrderedDict':
    """Authors' progressive norms -> PRepBN buffers; RepBN <-> PRepBN as the target asks."""
    def is_progressive_half(p: str) -> bool:
        parent = p[:-len('.norm2')]
        return p.endswith('.norm2') and (f'{parent}.total_step' in sd or
                                         f'{parent}.schedule_offset' in sd)

    pure = [k[:-6] for k in sd if k.endswith('.alpha') and f'{k[:-6]}.bn.running_mean' in sd
            and not is_progressive_half(k[:-6])]
    progressive = [k[:-11] for k in sd if k.endswith('.total_step')]
    for p in progressive:
        total = float(sd.pop(f'{p}.total_step'))
        remaining = float(sd.pop(f'{p}.iter', torch.tensor(total)))
        sd.pop(f'{p}.warm', None)
        done = 0.0 if reset_schedule or total <= 0 else min(max(1.0 - remaining / total, 0.0),
                                                             1.0)
        alpha = f'{p}.norm2.alpha'
        if alpha in sd:
            sd[alpha] = sd[alpha].reshape(())
        if _target_form(p, target_norm) == 'RepBN':
            for k in [k for k in sd if k.startswith(f'{p}.norm1.')]:
                dropped.append(k)
                del sd[k]
            _move(sd, f'{p}.norm2', p)
        else:
            sd[f'{p}.cur_iter'] = torch.tensor(0, dtype=torch.long)
            sd[f'{p}.schedule_offset'] = torch.tensor(done, dtype=torch.float64)
    if reset_schedule:  # progressive norms already in mmslab form
        for k in [k for k in sd if k.endswith('.schedule_offset')]:
            sd[k] = torch.tensor(0.0, dtype=torch.float64)
            sd[k[:-16] + '.cur_iter'] = torch.tensor(0, dtype=torch.long)
    for p in pure:
        sd[f'{p}.alpha'] = sd[f'{p}.alpha'].reshape(())
        if _target_form(p, target_norm) != 'PRepBN':
            continue
        # A finished schedule: RepBN in norm2, an identity LayerNorm that eval never uses.
        c = sd[f'{p}.bn.running_mean'].numel()
        ref = sd[f'{p}.bn.running_mean']
        _move(sd, p, f'{p}.norm2')
        sd[f'{p}.norm1.weight'] = torch.ones(c, dtype=ref.dtype)
        sd[f'{p}.norm1.bias'] = torch.zeros(c, dtype=ref.dtype)
        sd[f'{p}.cur_iter'] = torch.tensor(0, dtype=torch.long)
        sd[f'{p}.schedule_offset'] = torch.tensor(0.0 if reset_schedule else 1.0,
                                                  dtype=torch.float64)
    return sd


def progressive_schedule_info(state_dict: Dict[str, Tensor]) -> List[dict]:
    """The distinct ``(iter, total_step, warm)`` states of the authors' progressive norms, with
    the number of norms in each and the fraction of the decay already done."""
    groups: Dict[tuple, int] = {}
    sd = strip_wrappers(state_dict)
    for k in sd:
        if k.endswith('.total_step'):
            p = k[:-11]
            total = int(sd[k])
            remaining = int(sd.get(f'{p}.iter', sd[k]))
            warm = int(sd[f'{p}.warm']) if f'{p}.warm' in sd else None
            key = (remaining, total, warm)
            groups[key] = groups.get(key, 0) + 1
    return [dict(iter=r, total_step=t, warm=w, count=n,
                 schedule_offset=0.0 if t <= 0 else min(max(1 - r / t, 0.0), 1.0))
            for (r, t, w), n in sorted(groups.items(), key=lambda kv: kv[0][:2])]


# ------------------------------------------------------------------------------------------
# Public conversion
# ------------------------------------------------------------------------------------------
def convert(state_dict: Dict[str, Tensor], fmt: str, arch: Optional[str] = None,
            reset_schedule: bool = False,
            target_norm: Union[None, str, Collection[str]] = None
            ) -> Tuple['OrderedDict[str, Tensor]', List[str]]:
    """Map ``state_dict`` in layout ``fmt`` to mmslab backbone names.

    Args:
        state_dict: tensor dict (``module.``/``backbone.`` prefixes are removed).
        fmt: one of :data:`FORMATS` (see :func:`detect_format`).
        arch: optional name from :data:`ARCHS`; its norm form becomes the default
            ``target_norm`` (``prepbn_*``/``slab_*`` -> ``'PRepBN'``).
        reset_schedule: start progressive norms from scratch (``schedule_offset = 0``)
            instead of carrying the authors' counters over.
        target_norm: what the authors' RepBN-family norms should become: ``None`` keeps the
            checkpoint's form; ``'PRepBN'`` turns pure RepBN into a finished progressive norm
            (RepBN in ``norm2``, identity LayerNorm ``norm1``, ``schedule_offset = 1``);
            ``'RepBN'`` keeps only the RepBN part of progressive norms; or the state-dict keys
            of the target model, to decide per norm.

    Returns:
        ``(new_state_dict, dropped_keys)``: ``dropped_keys`` are source keys the backbone has no
        place for by design (classification ``head.*`` and final ``norm.*``, PVT ``cls_token``,
        recomputed ``relative_position_index``/``attn_mask`` buffers, the LayerNorm half of a
        progressive norm converted to RepBN).
    """
    if fmt not in FORMATS:
        raise ValueError(f'unknown format {fmt!r}; known formats: {_FORMAT_HELP}')
    if arch is not None:
        if arch not in ARCHS:
            raise ValueError(f'unknown arch {arch!r}; known: {sorted(ARCHS)}')
        if target_norm is None:
            target_norm = ARCHS[arch]['norm']
    sd = strip_wrappers(state_dict)
    dropped: List[str] = []
    if fmt == 'mmslab':
        new = OrderedDict(sd)
    elif fmt in ('pvt', 'slab') and _any(sd, r'^(patch_embed\d+\.|block\d+\.)'):
        new = _convert_pvt(sd, dropped)
    elif fmt in _SWIN_FORMATS:
        new = _convert_swin(sd, fmt, dropped)
    else:
        raise ValueError(f'state dict does not look like format {fmt!r} '
                         f'(first keys: {list(sd)[:4]})')
    new = _convert_norms(new, dropped, reset_schedule, target_norm)
    return new, dropped


# ------------------------------------------------------------------------------------------
# Resizing to the target model
# ------------------------------------------------------------------------------------------
def resize_relative_position_bias_table(table: Tensor, window_size) -> Tensor:
    """Bicubically resize a ``[(2Wh-1)*(2Ww-1), heads]`` table (square source) to a window."""
    wh, ww = _pair(window_size)
    n, heads = table.shape
    s = _isqrt(n, 'relative_position_bias_table')
    size = (2 * wh - 1, 2 * ww - 1)
    if (s, s) == size:
        return table
    grid = table.t().reshape(1, heads, s, s).float()
    out = F.interpolate(grid, size=size, mode='bicubic', align_corners=False)
    return out.reshape(heads, -1).t().contiguous().to(table.dtype)


def resize_positional_encoding(pos: Tensor, hw) -> Tensor:
    """Bilinearly resize a ``[1, S*S, C]`` token-grid encoding to ``[1, H*W, C]``."""
    h, w = _pair(hw)
    _, n, c = pos.shape
    s = _isqrt(n, 'positional encoding')
    if (s, s) == (h, w):
        return pos
    grid = pos.reshape(1, s, s, c).permute(0, 3, 1, 2).float()
    out = F.interpolate(grid, size=(h, w), mode='bilinear', align_corners=False)
    return out.flatten(2).transpose(1, 2).contiguous().to(pos.dtype)


def drop_model_owned_buffers(sd: Dict[str, Tensor]) -> List[str]:
    """Remove ``relative_position_index``/``attn_mask`` entries in place; returns their keys."""
    keys = [k for k in sd if k.endswith(_MODEL_BUFFERS)]
    for k in keys:
        del sd[k]
    return keys


def adapt_to_model(state_dict: Dict[str, Tensor], model: nn.Module
                   ) -> Tuple['OrderedDict[str, Tensor]', List[str]]:
    """Resize relative-position tables, SLA positional encodings and PVT position embeddings
    whose window/grid differs from ``model``'s, and drop the model-owned buffers.

    Returns ``(state_dict, resized_keys)``.
    """
    sd = OrderedDict(state_dict)
    drop_model_owned_buffers(sd)
    own = model.state_dict()
    resized = []
    for k, v in list(sd.items()):
        if k not in own or own[k].shape == v.shape:
            continue
        owner_name = k.rsplit('.', 1)[0]
        try:
            owner = model.get_submodule(owner_name)
        except AttributeError:
            continue
        if k.endswith('relative_position_bias_table') and v.dim() == 2:
            new = resize_relative_position_bias_table(v, owner.window_size)
        elif k.endswith('positional_encoding') and v.dim() == 3 and _is_square(v.shape[1]):
            new = resize_positional_encoding(v, owner.window_size)
        elif k.endswith('pos_embed') and v.dim() == 3 and _is_square(v.shape[1]):
            new = resize_positional_encoding(v, owner.pos_shape)
        else:
            continue
        if new.shape == own[k].shape:
            sd[k] = new
            resized.append(k)
    return sd, resized


# ------------------------------------------------------------------------------------------
# Building the matching backbone
# ------------------------------------------------------------------------------------------
def _norm_form(sd: Dict[str, Tensor], prefix: str) -> Optional[str]:
    if f'{prefix}.schedule_offset' in sd or f'{prefix}.norm2.alpha' in sd:
        return 'PRepBN'
    if f'{prefix}.alpha' in sd:
        return 'RepBN'
    if f'{prefix}.weight' in sd:
        return 'LN'
    return None


def _norm_cfg(form: str, eps: Optional[float] = None) -> dict:
    if form == 'PRepBN':
        return dict(type='PRepBN', step=300000)
    if form == 'RepBN':
        return dict(type='RepBN')
    return dict(type='LN') if eps is None else dict(type='LN', eps=eps)


def _max_index(sd, pattern: str) -> int:
    rx = re.compile(pattern)
    idx = [int(m.group(1)) for k in sd for m in [rx.match(k)] if m]
    return max(idx) if idx else -1


def _infer_swin(sd: Dict[str, Tensor]) -> Tuple[str, dict]:
    pe = sd['patch_embed.projection.weight']
    embed, in_ch, patch = pe.shape[0], pe.shape[1], pe.shape[-1]
    n = _max_index(sd, r'stages\.(\d+)\.') + 1
    depths, heads, windows, attn_types = [], [], [], []
    for i in range(n):
        depths.append(_max_index(sd, rf'stages\.{i}\.blocks\.(\d+)\.') + 1)
        dims = embed * 2 ** i
        b = f'stages.{i}.blocks.0.attn.w_msa.'
        if b + 'dwc.weight' in sd:
            attn_types.append('sla')
            heads.append(dims // sd[b + 'dwc.weight'].shape[0])
            windows.append(_isqrt(sd[b + 'positional_encoding'].shape[1], b +
                                  'positional_encoding'))
        elif b + 'relative_position_bias_table' in sd:
            attn_types.append('window')
            table = sd[b + 'relative_position_bias_table']
            heads.append(table.shape[1])
            windows.append((_isqrt(table.shape[0], b + 'relative_position_bias_table') + 1) // 2)
        else:
            raise ValueError(f'cannot infer the attention of stage {i}: no {b}dwc.weight or '
                             f'{b}relative_position_bias_table')
    b0 = 'stages.0.blocks.0.'
    channel_idle = b0 + 'ffn.fc1.weight' in sd
    hidden = sd[b0 + ('ffn.fc1.weight' if channel_idle else 'ffn.layers.0.0.weight')].shape[0]
    form = _norm_form(sd, b0 + 'norm1') or 'LN'
    kwargs = dict(in_channels=in_ch, embed_dims=embed, patch_size=patch,
                  strides=(patch, ) + (2, ) * (n - 1), depths=tuple(depths),
                  num_heads=tuple(heads), window_size=tuple(windows),
                  attn_types=tuple(attn_types), mlp_ratio=hidden / embed,
                  qkv_bias=b0 + 'attn.w_msa.qkv.bias' in sd,
                  patch_norm=any(k.startswith('patch_embed.norm.') for k in sd),
                  ffn_type='channel_idle' if channel_idle else 'mlp',
                  norm_cfg=_norm_cfg(form), drop_path_rate=0.0)
    outs = tuple(i for i in range(n) if any(k.startswith(f'norm{i}.') for k in sd))
    kwargs['out_indices'] = outs or tuple(range(n))
    if channel_idle:
        cls = 'RePaSwin'
    elif form == 'PRepBN':
        cls = 'SLABSwin' if 'sla' in attn_types else 'PRepBNSwin'
    else:
        cls = 'ReparamSwinTransformer'
    return cls, kwargs


def _infer_pvt(sd: Dict[str, Tensor]) -> Tuple[str, dict]:
    n = _max_index(sd, r'layers\.(\d+)\.0\.projection\.weight') + 1
    use_pos = 'layers.0.1.0.pos_embed' in sd
    off = 1 if use_pos else 0
    dims, patches, depths, attn_types, srs, ratios = [], [], [], [], [], []
    head_dim = None
    for i in range(n):
        w = sd[f'layers.{i}.0.projection.weight']
        dims.append(w.shape[0])
        patches.append(w.shape[-1])
        depths.append(_max_index(sd, rf'layers\.{i}\.1\.(\d+)\.') + 1 - off)
        b = f'layers.{i}.1.{off}.'
        if b + 'attn.kernel.dwc.weight' in sd:
            attn_types.append('sla')
            head_dim = sd[b + 'attn.kernel.dwc.weight'].shape[0]
            srs.append(1)
        else:
            attn_types.append('softmax')
            sr = sd.get(b + 'attn.sr.weight')
            srs.append(1 if sr is None else sr.shape[-1])
        hidden = sd[b + 'ffn.layers.0.weight'].shape[0]
        ratios.append(hidden // dims[-1])
    head_dim = head_dim or dims[0]  # PVT v1: one head in stage 1, fixed head width
    if any(d % head_dim for d in dims):
        raise ValueError(f'stage widths {dims} are not multiples of the head width {head_dim}')
    b = f'layers.0.1.{off}.'
    qkv_bias = (b + 'attn.attn.in_proj_bias' in sd) or (b + 'attn.kernel.qkv.bias' in sd)
    grid = None
    if use_pos:
        grid = _isqrt(sd['layers.0.1.0.pos_embed'].shape[1], 'pos_embed of stage 1')
    elif b + 'attn.kernel.positional_encoding' in sd:
        grid = _isqrt(sd[b + 'attn.kernel.positional_encoding'].shape[1], 'stage-1 encoding')
    form = _norm_form(sd, b + 'norm1') or 'LN'
    kwargs = dict(in_channels=sd['layers.0.0.projection.weight'].shape[1], embed_dims=head_dim,
                  num_layers=tuple(depths), num_heads=tuple(d // head_dim for d in dims),
                  patch_sizes=tuple(patches), strides=tuple(patches), sr_ratios=tuple(srs),
                  mlp_ratios=tuple(ratios), qkv_bias=qkv_bias, use_abs_pos_embed=use_pos,
                  attn_types=tuple(attn_types), norm_cfg=_norm_cfg(form, eps=1e-6),
                  drop_path_rate=0.0)
    if grid is not None:
        kwargs['pretrain_img_size'] = grid * patches[0]
    if form == 'PRepBN':
        cls = 'SLABPVT' if 'sla' in attn_types else 'PRepBNPVT'
    else:
        cls = 'ReparamPVT'
    return cls, kwargs


def infer_backbone_cfg(state_dict: Dict[str, Tensor], arch: Optional[str] = None) -> dict:
    """``dict(type=..., **kwargs)`` of the mmslab backbone a converted state dict fits.

    Depths from the largest block index, widths from the patch embedding, heads from the
    relative-position tables / SLA DWC kernels, windows from tables / encodings. With ``arch``
    the class comes from :data:`ARCHS` and its preset depths and width must match.
    """
    sd = state_dict
    if 'patch_embed.projection.weight' in sd:
        family, (cls, kwargs) = 'swin', _infer_swin(sd)
    elif 'layers.0.0.projection.weight' in sd:
        family, (cls, kwargs) = 'pvt', _infer_pvt(sd)
    else:
        raise ValueError('not an mmslab Swin/PVT state dict (convert it first)')
    if arch is None:
        return dict(type=cls, **kwargs)
    if arch not in ARCHS:
        raise ValueError(f'unknown arch {arch!r}; known: {sorted(ARCHS)}')
    spec = ARCHS[arch]
    from mmslab.models.backbones import ReparamPVT, ReparamSwinTransformer
    if family == 'swin':
        if spec['type'] not in ('ReparamSwinTransformer', 'RePaSwin', 'PRepBNSwin', 'SLABSwin'):
            raise ValueError(f'--arch {arch} is a PVT but the checkpoint is a Swin')
        zoo = ReparamSwinTransformer.arch_zoo[spec['arch']]
        want = dict(embed_dims=zoo['embed_dims'], depths=tuple(zoo['depths']))
        got = dict(embed_dims=kwargs['embed_dims'], depths=kwargs['depths'])
    else:
        if spec['type'] not in ('ReparamPVT', 'PRepBNPVT', 'SLABPVT'):
            raise ValueError(f'--arch {arch} is a Swin but the checkpoint is a PVT')
        want = dict(num_layers=tuple(ReparamPVT.arch_zoo[spec['arch']]),
                    widths=(64, 128, 320, 512))
        got = dict(num_layers=kwargs['num_layers'],
                   widths=tuple(kwargs['embed_dims'] * h for h in kwargs['num_heads']))
    if want != got:
        raise ValueError(f'checkpoint does not match --arch {arch}: expected {want}, '
                         f'checkpoint has {got}')
    kwargs['arch'] = spec['arch']
    if spec['norm'] == 'PRepBN':
        kwargs.pop('norm_cfg')  # the preset's PRepBN (schedule length is configuration)
    elif spec['norm'] is None:
        kwargs['norm_cfg'] = _norm_cfg('LN', eps=1e-6 if family == 'pvt' else None)
    return dict(type=spec['type'], **kwargs)


def model_owned_keys(model_keys: Collection[str], source_keys: Collection[str]) -> List[str]:
    """Keys of a backbone that a classification checkpoint cannot provide and the model keeps
    from its own initialization: ``relative_position_index`` buffers and, when the source has
    none of them, the Swin output norms ``norm{i}.*``."""
    src_has_out_norms = any(re.match(r'norm\d+\.', k) for k in source_keys)
    owned = []
    for k in model_keys:
        if k in source_keys:
            continue
        if k.endswith(_MODEL_BUFFERS) or (not src_has_out_norms and re.match(r'norm\d+\.', k)):
            owned.append(k)
    return owned


# ------------------------------------------------------------------------------------------
# Whole-file conversion (tools/convert_checkpoint.py)
# ------------------------------------------------------------------------------------------
def convert_checkpoint_file(src: str, dst: str, fmt: str = 'auto', arch: Optional[str] = None,
                            reset_schedule: bool = False, log=print) -> dict:
    """Convert ``src`` into an mmslab backbone checkpoint at ``dst``.

    Reads ``src`` with mmslab's loader (tensors and plain data only; foreign objects such as a
    yacs config are dropped, never executed), converts it, builds
    the matching backbone (from ``arch`` or inferred from the keys) and loads the result
    strictly: the only keys allowed to be absent are the model-owned ones of
    :func:`model_owned_keys`, kept at their initial values. Writes
    ``{'state_dict': ..., 'meta': {...}}`` and returns the meta dict.
    """
    from mmslab.models import backbones
    from .checkpoint_utils import extract_state_dict, read_checkpoint
    raw = extract_state_dict(read_checkpoint(src))
    sd = strip_wrappers({k: v for k, v in raw.items() if isinstance(v, Tensor)})
    if fmt == 'auto':
        fmt = detect_format(sd)
    schedule = progressive_schedule_info(sd)
    new, dropped = convert(sd, fmt, arch=arch, reset_schedule=reset_schedule)
    cfg = infer_backbone_cfg(new, arch)
    kwargs = {k: v for k, v in cfg.items() if k != 'type'}
    model = getattr(backbones, cfg['type'])(**kwargs)
    own = model.state_dict()
    initialized = model_owned_keys(own, new)
    missing = [k for k in own if k not in new and k not in initialized]
    unexpected = [k for k in new if k not in own]
    mismatched = [k for k in new if k in own and own[k].shape != new[k].shape]
    if missing or unexpected or mismatched:
        raise ValueError(
            f'{src} ({fmt}) does not fit {cfg["type"]}: missing {missing[:10]}, unexpected '
            f'{unexpected[:10]}, shape-mismatched {mismatched[:10]} '
            f'({len(missing)}/{len(unexpected)}/{len(mismatched)} in all)')
    full = OrderedDict((k, new[k] if k in new else own[k]) for k in own)
    model.load_state_dict(full, strict=True)
    state = OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())
    meta = dict(source_format=fmt, arch=arch, backbone_cfg=cfg, dropped_keys=list(dropped),
                initialized_keys=list(initialized), reset_schedule=bool(reset_schedule),
                source_schedule=schedule, source=str(src))
    torch.save(dict(state_dict=state, meta=meta), dst)
    if log is not None:
        n_params = sum(p.numel() for p in model.parameters())
        log(f'source: {src} ({fmt} layout, {len(sd)} tensors)')
        log(f'backbone: {cfg["type"]} ({arch or "inferred"}), {n_params / 1e6:.2f}M params; '
            f'cfg: {kwargs}')
        buffers = [k for k in dropped if k.endswith(_MODEL_BUFFERS)]
        log(f'dropped {len(dropped) - len(buffers)} source keys the backbone has no place for: '
            f'{[k for k in dropped if k not in buffers]}')
        if buffers:
            log(f'dropped {len(buffers)} relative_position_index/attn_mask buffers (the model '
                'computes its own)')
        fresh = [k for k in initialized if not k.endswith(_MODEL_BUFFERS)]
        if fresh:
            log(f'{len(fresh)} backbone keys have no source and keep their initial values '
                f'(output norms): {fresh[:12]}{" ..." if len(fresh) > 12 else ""}')
        for s in schedule:
            log(f'progressive norms: {s["count"]} with iter={s["iter"]}/{s["total_step"]} '
                f'(warm={s["warm"]}) -> schedule_offset '
                f'{0.0 if reset_schedule else s["schedule_offset"]:.4f}')
        log(f'wrote {len(state)} tensors to {dst}')
    return meta
