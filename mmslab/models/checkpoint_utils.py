"""Loading pretrained backbone weights (``init_cfg=dict(type='Pretrained', ...)``)."""
from typing import Optional

import torch.nn as nn
from mmengine.logging import print_log


def extract_state_dict(ckpt) -> dict:
    """The tensor dict of a checkpoint saved as ``{'state_dict'}``, ``{'model'}`` or bare."""
    if not isinstance(ckpt, dict):
        raise TypeError(f'checkpoint is a {type(ckpt).__name__}, expected a dict')
    for key in ('state_dict', 'model', 'module'):
        if key in ckpt and isinstance(ckpt[key], dict):
            return ckpt[key]
    return ckpt


def load_pretrained_backbone(backbone: nn.Module, path: str, prefix: Optional[str] = None,
                             logger=None) -> dict:
    """Load ``path`` into ``backbone`` non-strictly, logging missing/unexpected key counts.

    A checkpoint of which no key fits the backbone is an error, not a silent random init.
    Returns ``{'missing': [...], 'unexpected': [...]}``.
    """
    from mmslab.engine.checkpoint import load_checkpoint_file
    state = extract_state_dict(load_checkpoint_file(path, map_location='cpu'))
    if prefix:
        prefix = prefix if prefix.endswith('.') else prefix + '.'
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    elif any(k.startswith('backbone.') for k in state):
        state = {k[9:]: v for k, v in state.items() if k.startswith('backbone.')}
    own = backbone.state_dict()
    matched = [k for k, v in state.items() if k in own and own[k].shape == v.shape]
    if not matched:
        raise ValueError(f'no key of {path} matches {type(backbone).__name__} '
                         f'(e.g. checkpoint has {list(state)[:3]}, model has {list(own)[:3]}); '
                         'wrong architecture or a layout that needs tools/convert_checkpoint.py')
    shape_mismatch = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
    for k in shape_mismatch:
        state.pop(k)
    result = backbone.load_state_dict(state, strict=False)
    print_log(f'loaded {len(matched)} tensors from {path}: {len(result.missing_keys)} missing, '
              f'{len(result.unexpected_keys)} unexpected, {len(shape_mismatch)} shape-mismatched '
              f'keys', logger=logger or 'current')
    for title, keys in (('missing', result.missing_keys),
                        ('unexpected', result.unexpected_keys),
                        ('shape mismatch', shape_mismatch)):
        if keys:
            print_log(f'{title} keys: {keys[:20]}{" ..." if len(keys) > 20 else ""}',
                      logger=logger or 'current')
    return dict(missing=result.missing_keys, unexpected=result.unexpected_keys)
