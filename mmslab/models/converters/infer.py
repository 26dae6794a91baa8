"""Which mmslab backbone a converted state dict fits: its config from the keys and shapes."""
import re
from typing import Collection, Dict, List, Optional, Tuple

from torch import Tensor

from mmslab.registry import MODELS
from .common import MODEL_BUFFERS, isqrt, max_index
from .norms import norm_cfg, norm_form

#: Named architectures for ``arch=``: the mmslab class (registry name), its ``family``, its
#: ``arch`` preset (whose geometry the checkpoint must have) and the norm form the class
#: expects (``None`` = LayerNorm).
ARCHS: Dict[str, dict] = {}


def _register_archs():
    swin = {'t': 'tiny', 's': 'small', 'b': 'base'}
    pvt = {'t': 'tiny', 's': 'small', 'm': 'medium'}
    for s, a in swin.items():
        ARCHS[f'swin_{s}'] = dict(type='ReparamSwinTransformer', family='swin', arch=a, norm=None)
        ARCHS[f'repa_swin_{s}'] = dict(type='RePaSwin', family='swin', arch=a, norm=None)
        ARCHS[f'prepbn_swin_{s}'] = dict(type='PRepBNSwin', family='swin', arch=a, norm='PRepBN')
        ARCHS[f'slab_swin_{s}'] = dict(type='SLABSwin', family='swin', arch=a, norm='PRepBN')
    for s, a in pvt.items():
        ARCHS[f'pvt_{s}'] = dict(type='ReparamPVT', family='pvt', arch=a, norm=None)
        ARCHS[f'prepbn_pvt_{s}'] = dict(type='PRepBNPVT', family='pvt', arch=a, norm='PRepBN')
        ARCHS[f'slab_pvt_{s}'] = dict(type='SLABPVT', family='pvt', arch=a, norm='PRepBN')


_register_archs()


def _infer_swin(sd: Dict[str, Tensor]) -> Tuple[str, dict]:
    pe = sd['patch_embed.projection.weight']
    embed, in_ch, patch = pe.shape[0], pe.shape[1], pe.shape[-1]
    n = max_index(sd, r'stages\.(\d+)\.') + 1
    depths, heads, windows, attn_types = [], [], [], []
    for i in range(n):
        depths.append(max_index(sd, rf'stages\.{i}\.blocks\.(\d+)\.') + 1)
        dims = embed * 2 ** i
        b = f'stages.{i}.blocks.0.attn.w_msa.'
        if b + 'dwc.weight' in sd:
            attn_types.append('sla')
            heads.append(dims // sd[b + 'dwc.weight'].shape[0])
            windows.append(isqrt(sd[b + 'positional_encoding'].shape[1], b +
                                  'positional_encoding'))
        elif b + 'relative_position_bias_table' in sd:
            attn_types.append('window')
            table = sd[b + 'relative_position_bias_table']
            heads.append(table.shape[1])
            windows.append((isqrt(table.shape[0], b + 'relative_position_bias_table') + 1) // 2)
        else:
            raise ValueError(f'cannot infer the attention of stage {i}: no {b}dwc.weight or '
                             f'{b}relative_position_bias_table')
    b0 = 'stages.0.blocks.0.'
    channel_idle = b0 + 'ffn.fc1.weight' in sd
    hidden = sd[b0 + ('ffn.fc1.weight' if channel_idle else 'ffn.layers.0.0.weight')].shape[0]
    form = norm_form(sd, b0 + 'norm1') or 'LN'
    kwargs = dict(in_channels=in_ch, embed_dims=embed, patch_size=patch,
                  strides=(patch, ) + (2, ) * (n - 1), depths=tuple(depths),
                  num_heads=tuple(heads), window_size=tuple(windows),
                  attn_types=tuple(attn_types), mlp_ratio=hidden / embed,
                  qkv_bias=b0 + 'attn.w_msa.qkv.bias' in sd,
                  patch_norm=any(k.startswith('patch_embed.norm.') for k in sd),
                  ffn_type='channel_idle' if channel_idle else 'mlp',
                  norm_cfg=norm_cfg(form), drop_path_rate=0.0)
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
    n = max_index(sd, r'layers\.(\d+)\.0\.projection\.weight') + 1
    use_pos = 'layers.0.1.0.pos_embed' in sd
    off = 1 if use_pos else 0
    dims, patches, depths, attn_types, srs, ratios = [], [], [], [], [], []
    head_dim = None
    for i in range(n):
        w = sd[f'layers.{i}.0.projection.weight']
        dims.append(w.shape[0])
        patches.append(w.shape[-1])
        depths.append(max_index(sd, rf'layers\.{i}\.1\.(\d+)\.') + 1 - off)
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
        grid = isqrt(sd['layers.0.1.0.pos_embed'].shape[1], 'pos_embed of stage 1')
    elif b + 'attn.kernel.positional_encoding' in sd:
        grid = isqrt(sd[b + 'attn.kernel.positional_encoding'].shape[1], 'stage-1 encoding')
    form = norm_form(sd, b + 'norm1') or 'LN'
    kwargs = dict(in_channels=sd['layers.0.0.projection.weight'].shape[1], embed_dims=head_dim,
                  num_layers=tuple(depths), num_heads=tuple(d // head_dim for d in dims),
                  patch_sizes=tuple(patches), strides=tuple(patches), sr_ratios=tuple(srs),
                  mlp_ratios=tuple(ratios), qkv_bias=qkv_bias, use_abs_pos_embed=use_pos,
                  attn_types=tuple(attn_types), norm_cfg=norm_cfg(form, eps=1e-6),
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
    if spec['family'] != family:
        names = dict(swin='Swin', pvt='PVT')
        raise ValueError(f'--arch {arch} is a {names[spec["family"]]} but the checkpoint is a '
                         f'{names[family]}')
    zoo = MODELS.get(spec['type']).arch_zoo[spec['arch']]  # the preset, by registry name
    if family == 'swin':
        want = dict(embed_dims=zoo['embed_dims'], depths=tuple(zoo['depths']))
        got = dict(embed_dims=kwargs['embed_dims'], depths=kwargs['depths'])
    else:
        want = dict(num_layers=tuple(zoo['num_layers']),
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
        kwargs['norm_cfg'] = norm_cfg('LN', eps=1e-6 if family == 'pvt' else None)
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
        if k.endswith(MODEL_BUFFERS) or (not src_has_out_norms and re.match(r'norm\d+\.', k)):
            owned.append(k)
    return owned

