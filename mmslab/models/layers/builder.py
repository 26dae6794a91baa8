"""Registry-backed builders for the three pluggable slots of a block: norm, attention, FFN.

Each slot accepts a registered name (mmslab's ``MODELS``, so a layer a user registers with
:func:`mmslab.registry.register_model` works), a short alias the configs use (``'window'``,
``'mlp'``...), a class, or a ``functools.partial`` of one, like timm's ``get_norm_layer`` and
mmcv's ``build_norm_layer``. A type that is unknown, or that does not fit the slot, is an
error that lists every type the registry has for it.
"""
import functools
from typing import Callable, Dict, Optional, Tuple, Union

import torch.nn as nn
from mmengine.registry import Registry

from mmslab.registry import MODELS
from .affine import FoldableNorm
from .ffn import BlockFFN
from .window_attention import WindowKernelBase

LayerType = Union[str, type, functools.partial]


def layer_class(layer_type) -> Optional[type]:
    """The class behind a class or a (nested) partial of one (None for anything else)."""
    while isinstance(layer_type, functools.partial):
        layer_type = layer_type.func
    return layer_type if isinstance(layer_type, type) else None


def registered_types(fits: Callable[[type], bool], registry: Registry = MODELS) -> Tuple[str]:
    """Names in ``registry`` and its parents whose class ``fits`` the slot, sorted."""
    names = set()
    while registry is not None:
        names.update(name for name, cls in registry.module_dict.items() if fits(cls))
        registry = registry.parent
    return tuple(sorted(names))


def resolve_layer_type(layer_type: LayerType, base: Union[type, Tuple[type, ...]],
                       aliases: Optional[Dict[str, str]] = None,
                       what: str = 'layer type') -> Union[type, functools.partial]:
    """The class (or partial) ``layer_type`` names for a slot whose layers subclass ``base``.

    Raises ValueError listing the aliases and registered names that fit the slot.
    """
    aliases = aliases or {}

    def fits(cls) -> bool:
        return isinstance(cls, type) and issubclass(cls, base)

    if isinstance(layer_type, str):
        found = MODELS.get(aliases.get(layer_type, layer_type))
    else:
        found = layer_type
    if found is None or not fits(layer_class(found)):
        others = tuple(n for n in registered_types(fits) if n not in aliases.values())
        raise ValueError(f'unknown {what} {layer_type!r}; valid types: '
                         f'{tuple(aliases) + others}')
    return found


# -- norm ------------------------------------------------------------------------------------
#: A norm slot holds a FoldableNorm (``cls(C, data_format=, deploy=, **cfg)``) or LayerNorm.
NORM_BASES = (FoldableNorm, nn.LayerNorm)
_LN_KEYS = {'eps', 'requires_grad', 'elementwise_affine'}


def get_norm_layer(norm_type: LayerType, what: str = 'norm_cfg') -> Union[type, Callable]:
    """``'PRepBN'`` / ``'LN'`` / a class / a partial -> the norm class (or partial)."""
    return resolve_layer_type(norm_type, NORM_BASES, what=f'{what} type')


def check_norm_cfg(cfg: Optional[dict], what: str = 'norm_cfg') -> dict:
    """Validate a ``norm_cfg`` dict (its ``type`` must name a norm); returns it."""
    if not isinstance(cfg, dict) or 'type' not in cfg:
        raise ValueError(f'{what} must be a dict with a "type" key, one of '
                         f'{registered_types(_fits_norm)}; got {cfg!r}')
    get_norm_layer(cfg['type'], what)
    return cfg


def _fits_norm(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, NORM_BASES)


def is_foldable_norm(cfg: dict) -> bool:
    """True when the norm is a per-channel affine at inference (everything but LayerNorm)."""
    return issubclass(layer_class(get_norm_layer(check_norm_cfg(cfg)['type'])), FoldableNorm)


def build_norm(cfg: dict, num_features: int, data_format: str = 'channels_last',
               deploy: bool = False, what: str = 'norm_cfg') -> nn.Module:
    """Build a normalization over the channel axis from ``cfg`` (``dict(type=..., **args)``).

    ``LN`` is ``nn.LayerNorm`` (channels-last only, unchanged by deploy; keys ``eps``,
    ``elementwise_affine`` and, as in mmcv, ``requires_grad``); every other type is a
    :class:`~mmslab.models.layers.affine.FoldableNorm` whose ``deploy=True`` form is a
    per-channel affine.
    """
    cfg = dict(check_norm_cfg(cfg, what))
    norm_type = cfg.pop('type')
    cls = get_norm_layer(norm_type, what)
    if issubclass(layer_class(cls), nn.LayerNorm):
        if data_format != 'channels_last':
            raise ValueError('LN normalizes channels-last tokens only')
        unknown = set(cfg) - _LN_KEYS
        if unknown:
            raise ValueError(f'unknown {what} keys for LN: {sorted(unknown)}; valid: '
                             f'{sorted(_LN_KEYS)}')
        # mmcv's meaning: requires_grad=False freezes the affine parameters
        requires_grad = cfg.pop('requires_grad', True)
        norm = cls(num_features, **cfg)
        for p in norm.parameters():
            p.requires_grad = requires_grad
        return norm
    try:
        return cls(num_features, data_format=data_format, deploy=deploy, **cfg)
    except TypeError as err:
        raise ValueError(f'invalid {what} for {norm_type}: {err}') from err


# -- window attention ------------------------------------------------------------------------
#: ``attn_types`` names of the configs -> registered window kernels.
WINDOW_ATTENTION_ALIASES = {'window': 'WindowMSA', 'sla': 'SLA', 'binorm': 'BiNormAttention'}


def get_window_attention(attn_type: LayerType) -> Union[type, Callable]:
    """``'window'`` / ``'sla'`` / ``'binorm'`` / a registered kernel / a class -> the class."""
    return resolve_layer_type(attn_type, WindowKernelBase, WINDOW_ATTENTION_ALIASES,
                              'attention type')


def build_window_attention(attn_type: LayerType, qk_scale=None, attn_drop: float = 0.0,
                           **kwargs) -> WindowKernelBase:
    """Build a window kernel; the softmax-only options go to kernels that take them."""
    cls = get_window_attention(attn_type)
    if layer_class(cls).softmax_options:
        kwargs.update(qk_scale=qk_scale, attn_drop=attn_drop)
    return cls(**kwargs)


# -- FFN ---------------------------------------------------------------------------------------
#: ``ffn_type`` names of the configs -> registered FFNs.
FFN_ALIASES = {'mlp': 'SwinFFN', 'channel_idle': 'ChannelIdleFFN'}


def get_ffn(ffn_type: LayerType) -> Union[type, Callable]:
    """``'mlp'`` / ``'channel_idle'`` / a registered FFN / a class -> the class."""
    return resolve_layer_type(ffn_type, BlockFFN, FFN_ALIASES, 'ffn_type')
