"""Checkpoint files and models: reading, loading pretrained backbone weights
(``init_cfg=dict(type='Pretrained', ...)``) and converting whole files.

Any supported layout is accepted (see :mod:`mmslab.models.converters`, the pure state-dict
transforms this module applies): the authors' SLAB and RePaViT ImageNet files, official/timm
Swin, official PVT v1 and mmslab/mmdet checkpoints (bare, ``{'state_dict'}``/``{'model'}``,
detector checkpoints with ``backbone.`` keys).
"""
from collections import OrderedDict
from typing import Optional

import torch
import torch.nn as nn
from mmengine.logging import print_log
from torch import Tensor

from mmslab.utils.checkpoint import load_checkpoint_file
from mmslab.registry import MODELS
from .converters import (adapt_to_model, convert, detect_format, infer_backbone_cfg,
                         model_owned_keys, progressive_schedule_info, strip_wrappers)
from .converters.common import MODEL_BUFFERS

#: A checkpoint must provide at least this fraction of the backbone's parameter elements.
MIN_MATCHED_FRACTION = 0.5


def extract_state_dict(ckpt) -> dict:
    """The tensor dict of a checkpoint saved as ``{'state_dict'}``, ``{'model'}`` or bare."""
    if not isinstance(ckpt, dict):
        raise TypeError(f'checkpoint is a {type(ckpt).__name__}, expected a dict')
    for key in ('state_dict', 'model', 'module'):
        if key in ckpt and isinstance(ckpt[key], dict):
            return ckpt[key]
    return ckpt


def read_checkpoint(path: str):
    """Load a checkpoint file with ``weights_only=True`` (mmslab's allow-list if available).

    Foreign pickled objects (the SLAB authors' yacs ``config``, RePaViT's ``args``) are dropped
    without executing anything: see :func:`mmslab.utils.checkpoint.load_checkpoint_file`.
    """
    return load_checkpoint_file(path, map_location='cpu')


def _log_keys(title: str, keys, logger) -> None:
    if keys:
        print_log(f'{title} ({len(keys)}): {keys[:20]}{" ..." if len(keys) > 20 else ""}',
                  logger=logger)


def uninitialized_core_parameters(backbone: nn.Module, loaded_keys) -> list:
    """Attention and FFN parameters of ``backbone`` that ``loaded_keys`` does not provide."""
    core = ('.attn.', '.ffn.', '.mlp.')
    return [k for k, _ in backbone.named_parameters()
            if any(c in f'.{k}' for c in core) and k not in loaded_keys]


def load_pretrained_backbone(backbone: nn.Module, path: str, prefix: Optional[str] = None,
                             logger=None, reset_schedule: bool = False,
                             allow_uninitialized: bool = False) -> dict:
    """Load ``path`` into ``backbone``: detect the layout, convert it, resize windows, load.

    Relative-position tables, SLA positional encodings and PVT position embeddings whose
    window/grid differs from the backbone's are resized; ``relative_position_index`` buffers
    are always the model's own. Loading is non-strict, with the missing/unexpected keys
    logged, but a checkpoint that provides less than half of the backbone's parameters (by
    element count) is an error, not a silent random init, and so is one that leaves any
    attention or FFN parameter uninitialized (e.g. a SLAB-PVT file with SLA in all stages
    loaded into a backbone with softmax attention in one), unless ``allow_uninitialized``
    (``init_cfg=dict(..., allow_uninitialized=True)``).

    Returns ``dict(format, missing, unexpected, shape_mismatch, dropped, resized)``.
    """
    logger = logger or 'current'
    state = extract_state_dict(read_checkpoint(path))
    if prefix:
        prefix = prefix if prefix.endswith('.') else prefix + '.'
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if not state:
            raise ValueError(f'no key of {path} starts with prefix {prefix!r}')
    state = strip_wrappers(state)
    state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    try:
        fmt = detect_format(state)
    except ValueError as err:
        raise ValueError(f'{path}: {err}') from err
    own = backbone.state_dict()
    state, dropped = convert(state, fmt, reset_schedule=reset_schedule, target_norm=set(own))
    state, resized = adapt_to_model(state, backbone)
    shape_mismatch = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
    for k in shape_mismatch:
        state.pop(k)
    params = dict(backbone.named_parameters())
    total = sum(p.numel() for p in params.values())
    loaded = sum(p.numel() for k, p in params.items() if k in state)
    if total == 0 or loaded < MIN_MATCHED_FRACTION * total:
        raise ValueError(
            f'{path} ({fmt} layout) provides {loaded}/{total} parameter elements of '
            f'{type(backbone).__name__}: wrong architecture? (checkpoint keys after conversion '
            f'e.g. {list(state)[:3]}, model keys e.g. {list(own)[:3]}; shape mismatches: '
            f'{shape_mismatch[:5]})')
    uninitialized = uninitialized_core_parameters(backbone, state)
    if uninitialized and not allow_uninitialized:
        raise ValueError(
            f'{path} ({fmt} layout) leaves {len(uninitialized)} attention/FFN parameters of '
            f'{type(backbone).__name__} uninitialized, e.g. {uninitialized[:4]} (shape '
            f'mismatches: {shape_mismatch[:4]}). The backbone does not match the checkpoint '
            '(attention types per stage? FFN type?); fix the config, or pass '
            "init_cfg=dict(type='Pretrained', ..., allow_uninitialized=True) to train them "
            'from scratch.')
    result = backbone.load_state_dict(state, strict=False)
    # The model's own relative_position_index buffers are right by construction.
    missing = [k for k in result.missing_keys if not k.endswith('relative_position_index')]
    print_log(f'loaded {path} ({fmt} layout): {loaded}/{total} parameter elements, '
              f'{len(missing)} missing, {len(result.unexpected_keys)} unexpected, '
              f'{len(shape_mismatch)} shape-mismatched, {len(dropped)} dropped, '
              f'{len(resized)} resized keys', logger=logger)
    _log_keys('missing keys', missing, logger)
    _log_keys('unexpected keys', result.unexpected_keys, logger)
    _log_keys('shape-mismatched keys (not loaded)', shape_mismatch, logger)
    _log_keys('resized keys', resized, logger)
    return dict(format=fmt, missing=missing, unexpected=result.unexpected_keys,
                shape_mismatch=shape_mismatch, dropped=dropped, resized=resized)


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
    raw = extract_state_dict(read_checkpoint(src))
    sd = strip_wrappers({k: v for k, v in raw.items() if isinstance(v, Tensor)})
    if fmt == 'auto':
        fmt = detect_format(sd)
    schedule = progressive_schedule_info(sd)
    new, dropped = convert(sd, fmt, arch=arch, reset_schedule=reset_schedule)
    cfg = infer_backbone_cfg(new, arch)
    model = MODELS.build(cfg)
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
        _log_conversion(log, meta, model, len(sd), len(state), dst)
    return meta


def _log_conversion(log, meta: dict, model: nn.Module, n_source: int, n_written: int,
                    dst: str) -> None:
    """What :func:`convert_checkpoint_file` did, for the command-line tool."""
    src, fmt, arch, cfg = meta['source'], meta['source_format'], meta['arch'], meta['backbone_cfg']
    dropped, initialized = meta['dropped_keys'], meta['initialized_keys']
    kwargs = {k: v for k, v in cfg.items() if k != 'type'}
    n_params = sum(p.numel() for p in model.parameters())
    log(f'source: {src} ({fmt} layout, {n_source} tensors)')
    log(f'backbone: {cfg["type"]} ({arch or "inferred"}), {n_params / 1e6:.2f}M params; '
        f'cfg: {kwargs}')
    buffers = [k for k in dropped if k.endswith(MODEL_BUFFERS)]
    log(f'dropped {len(dropped) - len(buffers)} source keys the backbone has no place for: '
        f'{[k for k in dropped if k not in buffers]}')
    if buffers:
        log(f'dropped {len(buffers)} relative_position_index/attn_mask buffers (the model '
            'computes its own)')
    fresh = [k for k in initialized if not k.endswith(MODEL_BUFFERS)]
    if fresh:
        log(f'{len(fresh)} backbone keys have no source and keep their initial values '
            f'(output norms): {fresh[:12]}{" ..." if len(fresh) > 12 else ""}')
    for s in meta['source_schedule']:
        log(f'progressive norms: {s["count"]} with iter={s["iter"]}/{s["total_step"]} '
            f'(warm={s["warm"]}) -> schedule_offset '
            f'{0.0 if meta["reset_schedule"] else s["schedule_offset"]:.4f}')
    log(f'wrote {n_written} tensors to {dst}')
