"""Building normalization layers from config dicts, with validation."""
from typing import Optional

import torch.nn as nn

from mmslab.registry import MODELS

#: Normalization types mmslab backbones accept in ``norm_cfg``.
NORM_TYPES = ('LN', 'TokenBN', 'RepBN', 'PRepBN', 'UN')


def check_norm_cfg(cfg: Optional[dict], what: str = 'norm_cfg') -> dict:
    if not isinstance(cfg, dict) or 'type' not in cfg:
        raise ValueError(f'{what} must be a dict with a "type" key, one of {NORM_TYPES}; '
                         f'got {cfg!r}')
    if cfg['type'] not in NORM_TYPES:
        raise ValueError(f'unknown {what} type {cfg["type"]!r}; valid types: {NORM_TYPES}')
    return cfg


def is_foldable_norm(cfg: dict) -> bool:
    """True when the norm is a per-channel affine at inference (everything but LayerNorm)."""
    return check_norm_cfg(cfg)['type'] != 'LN'


def build_norm(cfg: dict, num_features: int, data_format: str = 'channels_last',
               deploy: bool = False, what: str = 'norm_cfg') -> nn.Module:
    """Build a normalization over the channel axis.

    ``LN`` is ``nn.LayerNorm`` (channels-last only, unchanged by deploy); every other type is a
    :class:`~mmslab.models.layers.affine.FoldableNorm` whose ``deploy=True`` form is a
    per-channel affine.
    """
    cfg = dict(check_norm_cfg(cfg, what))
    norm_type = cfg.pop('type')
    if norm_type == 'LN':
        if data_format != 'channels_last':
            raise ValueError('LN normalizes channels-last tokens only')
        unknown = set(cfg) - {'eps', 'requires_grad', 'elementwise_affine'}
        if unknown:
            raise ValueError(f'unknown {what} keys for LN: {sorted(unknown)}; valid: eps')
        cfg.pop('requires_grad', None)
        return nn.LayerNorm(num_features, **cfg)
    cls = MODELS.get(norm_type)
    try:
        return cls(num_features, data_format=data_format, deploy=deploy, **cfg)
    except TypeError as err:
        raise ValueError(f'invalid {what} for {norm_type}: {err}') from err
