"""The authors' checkpoint layouts written out from mmslab state dicts (independently of the
converters, from docs/checkpoint_formats.md), the tiny backbones they are tried on, and the
comparisons: shared by the converter and loading tests (import them from here)."""
import re
from collections import OrderedDict

import torch

from conftest import randomize_weights, rel_err
from mmslab.models import SLABSwin

SWIN = dict(embed_dims=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), drop_path_rate=0.0)
PVT = dict(embed_dims=16, num_layers=(2, 1, 1, 1), num_heads=(1, 2, 2, 4), pretrain_img_size=64,
           drop_path_rate=0.0)


def outputs(model, x):
    with torch.no_grad():
        return model(x)


def assert_same_outputs(a, b, tol=1e-5):
    assert len(a) == len(b)
    for ya, yb in zip(a, b):
        assert ya.shape == yb.shape
        assert rel_err(ya, yb) <= tol


def official_merge_index(c: int) -> torch.Tensor:
    """``official[i] = ours[idx[i]]`` for a merged token of 4*c channels.

    Official Swin concatenates x[0::2, 0::2], x[1::2, 0::2], x[0::2, 1::2], x[1::2, 1::2]
    (offset-major); mmdet/mmslab order channels like nn.Unfold (channel-major, then dh, dw).
    """
    official_slot = {(0, 0): 0, (1, 0): 1, (0, 1): 2, (1, 1): 3}
    idx = torch.empty(4 * c, dtype=torch.long)
    for ch in range(c):
        for dh in (0, 1):
            for dw in (0, 1):
                idx[official_slot[(dh, dw)] * c + ch] = ch * 4 + dh * 2 + dw
    return idx


def authors_counters(out, prefix, schedule):
    remaining, total, warm = schedule
    out[f'{prefix}.iter'] = torch.tensor(remaining)
    out[f'{prefix}.total_step'] = torch.tensor(total)
    out[f'{prefix}.warm'] = torch.tensor(warm)


def authors_norm_entry(out, nk, v, schedule):
    """A progressive norm's entry ``nk`` in the authors' form: None for the schedule state
    (written into ``out`` as their counters, or dropped), ``alpha`` as a 1-element tensor
    (``nn.Parameter(torch.ones(1))`` in the authors' RepBN), anything else as is."""
    if nk.endswith('.schedule_offset'):
        return None
    if nk.endswith('.cur_iter'):
        authors_counters(out, nk[:-len('.cur_iter')], schedule)
        return None
    return v.reshape(1) if nk.endswith('.alpha') else v


def to_authors_swin(sd, schedule=(0, 60000, 0), with_buffers=True):
    """mmslab Swin (PRepBN/RepBN/LN, SLA or window, MLP or channel-idle) -> SLAB / RePaViT
    / official Swin names, with a classifier head and final norm like ImageNet checkpoints."""
    out = OrderedDict()
    for k, v in sd.items():
        if re.match(r'norm\d+\.', k):
            continue  # output norms exist only in the dense-prediction backbone
        nk = k.replace('patch_embed.projection.', 'patch_embed.proj.')
        nk = re.sub(r'^stages\.', 'layers.', nk)
        nk = nk.replace('.attn.w_msa.', '.attn.')
        nk = nk.replace('.ffn.layers.0.0.', '.mlp.fc1.').replace('.ffn.layers.1.', '.mlp.fc2.')
        nk = nk.replace('.ffn.', '.mlp.')  # RePaViT: norm1/fc1/norm2/fc2 inside the mlp
        v = authors_norm_entry(out, nk, v, schedule)
        if v is None:
            continue
        if '.downsample.' in nk:
            if nk.endswith('reduction.weight'):
                v = v[:, official_merge_index(v.shape[1] // 4)]
            elif v.dim() == 1 and v.numel() > 1:
                v = v[official_merge_index(v.numel() // 4)]
        if nk.endswith('relative_position_index') and not with_buffers:
            continue
        out[nk] = v.clone()
    last = max(int(m.group(1)) for k in sd for m in [re.match(r'stages\.(\d+)\.', k)] if m)
    for k, v in sd.items():  # the final classification norm: same form as the last stage's
        m = re.match(rf'stages\.{last}\.blocks\.0\.norm1\.(.*)$', k)
        if m and not k.endswith('schedule_offset'):
            if k.endswith('cur_iter'):
                authors_counters(out, 'norm', schedule)
            else:
                out['norm.' + m.group(1)] = v.clone().reshape(1) if k.endswith('alpha') \
                    else v.clone()
    c = out['layers.%d.blocks.0.attn.proj.weight' % last].shape[0]
    out['head.weight'] = torch.randn(10, c)
    out['head.bias'] = torch.randn(10)
    if with_buffers:
        out['layers.%d.blocks.1.attn_mask' % (last - 1)] = torch.zeros(4, 16, 16)
    return out


def to_authors_pvt(sd, schedule=(0, 300000, 0), official=False):
    """mmslab PVT -> SLAB PVT (q/kv split, SLA keys) or official PVT v1 names."""
    out = OrderedDict()
    for k, v in sd.items():
        m = re.match(r'layers\.(\d+)\.0\.(projection|norm)\.(.*)$', k)
        if m:
            nk = f'patch_embed{int(m.group(1)) + 1}.' + \
                ('proj.' if m.group(2) == 'projection' else 'norm.') + m.group(3)
        elif re.match(r'layers\.(\d+)\.1\.0\.pos_embed$', k):
            s = int(k.split('.')[1]) + 1
            nk = f'pos_embed{s}'
            if official and s == 4:  # PVT v1 keeps the class token's embedding in stage 4
                v = torch.cat([torch.randn(1, 1, v.shape[-1]), v], dim=1)
        else:
            m = re.match(r'layers\.(\d+)\.1\.(\d+)\.(.*)$', k)
            assert m, k
            pre = f'block{int(m.group(1)) + 1}.{int(m.group(2)) - 1}.'
            sub = m.group(3)
            if sub in ('attn.attn.in_proj_weight', 'attn.attn.in_proj_bias') or \
                    sub.startswith('attn.kernel.qkv.'):
                what = 'weight' if sub.endswith('weight') else 'bias'
                c = v.shape[0] // 3
                out[pre + f'attn.q.{what}'] = v[:c].clone()
                out[pre + f'attn.kv.{what}'] = v[c:].clone()
                continue
            sub = sub.replace('attn.attn.out_proj.', 'attn.proj.').replace('attn.kernel.', 'attn.')
            if sub.startswith('ffn.layers.'):
                idx, rest = sub[len('ffn.layers.'):].split('.', 1)
                sub = ('mlp.fc1.' if idx == '0' else 'mlp.fc2.') + rest
                if rest == 'weight':
                    v = v.flatten(1)
            nk = pre + sub
        v = authors_norm_entry(out, nk, v, schedule)
        if v is not None:
            out[nk] = v.clone()
    if official:
        c = out['pos_embed4'].shape[-1]
        out['cls_token'] = torch.randn(1, 1, c)
        out['norm.weight'] = torch.ones(c)
        out['norm.bias'] = torch.zeros(c)
        out['head.weight'] = torch.randn(10, c)
        out['head.bias'] = torch.randn(10)
    return out


def load_converted(model, converted, source=None):
    """Load strictly apart from the output norms (copied from ``source`` when given) and the
    relative-position indices the model computes itself."""
    own = model.state_dict()
    full = OrderedDict()
    for k in own:
        if k in converted:
            full[k] = converted[k]
        elif re.match(r'norm\d+\.', k) or k.endswith('relative_position_index'):
            full[k] = (source.state_dict() if source is not None else own)[k]
        else:
            raise AssertionError(f'converted state dict lacks {k}')
    extra = set(converted) - set(own)
    assert not extra, sorted(extra)[:5]
    model.load_state_dict(full, strict=True)
    return model.eval()


def slab_swin(norm_cfg=None, window_size=(8, 4, 4, 4), seed=0, cls=SLABSwin):
    kwargs = dict(SWIN, window_size=window_size)
    if norm_cfg is not None:
        kwargs['norm_cfg'] = norm_cfg
    return randomize_weights(cls(**kwargs), seed=seed)
