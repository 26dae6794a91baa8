"""Format detection and the conversion of any known layout to mmslab names."""
from collections import OrderedDict
from typing import Collection, Dict, List, Optional, Tuple, Union

from torch import Tensor

from .common import any_key_matches, strip_wrappers
from .infer import ARCHS
from .norms import convert_norms
from .pvt_keys import convert_pvt_keys
from .swin_keys import convert_swin_keys

FORMATS = ('slab', 'repavit', 'swin', 'timm', 'pvt', 'mmslab')

_FORMAT_HELP = ("slab (SLAB authors' PRepBN/SLAB Swin and PVT), repavit (RePaViT RePa-Swin), "
                "swin (official Microsoft Swin), timm (timm SwinTransformer), pvt (official PVT "
                "v1), mmslab (already converted / mmdet names)")

_SWIN_FORMATS = ('slab', 'repavit', 'swin', 'timm')


def detect_format(state_dict: Dict[str, Tensor]) -> str:
    """Which layout ``state_dict`` (a plain tensor dict) is in: one of :data:`FORMATS`.

    Raises ValueError (listing the known formats) for any other layout.
    """
    keys = list(strip_wrappers(state_dict))
    if not keys:
        raise ValueError(f'empty state dict; known formats: {_FORMAT_HELP}')
    if any_key_matches(keys, r'^(stages\.\d+\.blocks\.\d+\.|patch_embed\.projection\.|'
                  r'layers\.\d+\.0\.projection\.|layers\.\d+\.1\.\d+\.)'):
        return 'mmslab'
    authors = (any_key_matches(keys, r'\.(total_step|alpha)$') or
               any_key_matches(keys, r'\.attn\.(dwc\.|positional_encoding$)'))
    if any_key_matches(keys, r'^(patch_embed\d+\.proj\.|block\d+\.\d+\.)'):
        return 'slab' if authors else 'pvt'
    if any_key_matches(keys, r'^layers\.\d+\.blocks\.\d+\.') and 'patch_embed.proj.weight' in keys:
        if any_key_matches(keys, r'\.mlp\.norm[12]?\.'):
            return 'repavit'
        if authors:
            return 'slab'
        if any_key_matches(keys, r'^layers\.0\.downsample\.'):
            return 'swin'
        if any_key_matches(keys, r'^layers\.[1-9]\d*\.downsample\.') or 'head.fc.weight' in keys:
            return 'timm'
        return 'swin'  # no patch merging at all: both layouts coincide
    raise ValueError(f'unknown checkpoint layout (first keys: {keys[:4]}); known formats: '
                     f'{_FORMAT_HELP}')



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
    elif fmt in ('pvt', 'slab') and any_key_matches(sd, r'^(patch_embed\d+\.|block\d+\.)'):
        new = convert_pvt_keys(sd, dropped)
    elif fmt in _SWIN_FORMATS:
        new = convert_swin_keys(sd, fmt, dropped)
    else:
        raise ValueError(f'state dict does not look like format {fmt!r} '
                         f'(first keys: {list(sd)[:4]})')
    new = convert_norms(new, dropped, reset_schedule, target_norm)
    return new, dropped
