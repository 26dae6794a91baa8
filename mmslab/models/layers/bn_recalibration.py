"""BatchNorm re-calibration: SLAB's end-of-training re-estimation of running statistics.

After training, SLAB freezes every parameter and re-estimates only the BatchNorm running
statistics with forward passes of train-mode BN, which undoes the variance shift that drop-path
(and, for PRepBN, the LayerNorm blend) leaves in statistics collected during training.
"""
import itertools
import warnings
from collections.abc import Iterator
from typing import Any, Callable, Iterable, List, Optional

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from .unified_norm import UN


def recalibratable_norms(model: nn.Module) -> List[nn.Module]:
    """BN-type modules whose running statistics :func:`recalibrate_bn` re-estimates.

    Every ``torch.nn.modules.batchnorm._BatchNorm`` with running statistics (BatchNorm1d/2d/3d,
    SyncBatchNorm, the ``bn`` inside RepBN/PRepBN) and every non-deployed :class:`UN`.
    """
    return [m for m in model.modules()
            if (isinstance(m, _BatchNorm) and m.track_running_stats)
            or (isinstance(m, UN) and not m.deploy)]


def default_forward(model: nn.Module, batch: Any) -> Any:
    """Run one re-calibration forward pass.

    * a tensor: ``model(batch)``;
    * a list/tuple starting with a tensor (``TensorDataset`` batches): ``model(batch[0])``;
    * a dict from an mmengine dataloader (mmdet/mmseg ``inputs`` + ``data_samples``):
      ``data = model.data_preprocessor(batch, False)`` then ``model(**data, mode='tensor')``,
      which is ``model._forward(inputs, data_samples)`` in both mmdet and mmseg (calling
      ``_forward(**data)`` directly would fail on mmdet, whose ``_forward`` names its arguments
      ``batch_inputs``/``batch_data_samples``). ``training=False`` in the preprocessor skips
      batch augmentations; the backbone, neck and heads all run.
    """
    if isinstance(batch, Tensor):
        return model(batch)
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], Tensor):
        return model(batch[0])
    inner = getattr(model, 'module', model)  # DDP-style wrappers
    if isinstance(batch, dict) and hasattr(inner, 'data_preprocessor'):
        data = inner.data_preprocessor(batch, False)
        return inner(**data, mode='tensor')
    raise TypeError(f'recalibrate_bn cannot feed a batch of type {type(batch).__name__} to '
                    f'{type(model).__name__}; pass forward_fn(model, batch).')


def _batches(data: Iterable, num_iters: int):
    """Yield up to ``num_iters`` batches; a re-iterable loader is restarted when exhausted."""
    if isinstance(data, Iterator):
        yield from itertools.islice(data, num_iters)
        return
    done = 0
    while done < num_iters:
        before = done
        for batch in data:
            yield batch
            done += 1
            if done == num_iters:
                return
        if done == before:
            return  # empty loader


def _log(msg: str, logger) -> None:
    try:
        from mmengine.logging import print_log
    except ImportError:
        print(msg)
    else:
        print_log(msg, logger=logger)


def recalibrate_bn(model: nn.Module, data_iter_or_loader: Iterable, num_iters: int,
                   forward_fn: Optional[Callable[[nn.Module, Any], Any]] = None,
                   logger=None) -> nn.Module:
    """Re-estimate BN/UN running statistics with ``num_iters`` no-grad forward passes.

    Every parameter is frozen and every module is put in eval mode except the modules of
    :func:`recalibratable_norms`, whose running statistics are reset and then accumulated as
    a cumulative (equal-weight) average over the batches (``momentum=None``; for BN this is
    PyTorch's cumulative moving average of per-batch mean and unbiased variance, for UN the
    average of the per-batch quadratic means). Afterwards ``requires_grad``, the train/eval
    flags and the momenta are restored, also if a forward pass raises (the statistics are then
    partially re-estimated).

    Args:
        model: the model; changed in place (only running statistics).
        data_iter_or_loader: a DataLoader or any re-iterable of batches (restarted when it runs
            out), or an iterator (used once; fewer batches than ``num_iters`` gives a warning).
        num_iters: number of batches (>= 1).
        forward_fn: ``forward_fn(model, batch)``; default :func:`default_forward`.
        logger: passed to ``mmengine.logging.print_log`` (``None`` prints).

    Returns:
        The model.
    """
    if int(num_iters) != num_iters or num_iters < 1:
        raise ValueError(f'num_iters must be a positive integer, got {num_iters!r}')
    num_iters = int(num_iters)
    forward_fn = forward_fn or default_forward
    norms = recalibratable_norms(model)
    if not norms:
        warnings.warn('recalibrate_bn: the model has no BatchNorm/UN running statistics; '
                      'nothing to do.')
        return model

    grad_flags = [(p, p.requires_grad) for p in model.parameters()]
    train_flags = [(m, m.training) for m in model.modules()]
    momenta = [(m, m.momentum) for m in norms]
    done = 0
    try:
        for p, _ in grad_flags:
            p.requires_grad_(False)
        model.eval()
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # cumulative average over the re-calibration batches
            m.train()
        bar = None
        if num_iters > 1:
            from mmengine.utils import ProgressBar
            bar = ProgressBar(num_iters)
        with torch.no_grad():
            for batch in _batches(data_iter_or_loader, num_iters):
                forward_fn(model, batch)
                done += 1
                if bar is not None:
                    bar.update()
        if bar is not None:
            bar.file.write('\n')  # ProgressBar leaves the cursor on its line
            bar.file.flush()
    finally:
        for m, momentum in momenta:
            m.momentum = momentum
        for m, flag in train_flags:
            m.training = flag
        for p, flag in grad_flags:
            p.requires_grad_(flag)
    if done < num_iters:
        warnings.warn(f'recalibrate_bn: the data ran out after {done} of {num_iters} batches.')
    _log(f'recalibrate_bn: re-estimated the running statistics of {len(norms)} normalization '
         f'layers over {done} batches.', logger)
    return model
