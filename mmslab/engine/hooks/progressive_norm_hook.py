"""Drives iteration-based normalization schedules (PRepBN's LN -> RepBN decay, UN's steps)."""
from typing import Optional, Tuple, Union

import torch
import torch.nn as nn
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper

from mmslab.models.layers.repbn import PRepBN
from mmslab.registry import register_hook


def set_progressive_iter(model: nn.Module, cur_iter: int) -> int:
    """Set the training iteration on every module with a ``set_iter`` method.

    Returns the number of modules set. Use it in a plain PyTorch loop before each iteration.
    """
    if is_model_wrapper(model):
        model = model.module
    count = 0
    for m in model.modules():
        if hasattr(m, 'set_iter') and callable(m.set_iter):
            m.set_iter(cur_iter)
            count += 1
    return count


def optim_loss_scale(optim_wrapper) -> Union[float, torch.Tensor]:
    """The factor this iteration's gradients carry: the ``GradScaler`` scale of an fp16
    ``AmpOptimWrapper``, 1 for any other wrapper. The scale is the 0-d tensor the scaler
    keeps on the device (``_get_scale_async``, which its ``get_scale`` reads back: a host
    sync), updated in place after the step; a number before the first scaled loss."""
    scaler = getattr(optim_wrapper, 'loss_scaler', None)
    if scaler is None or not getattr(scaler, 'is_enabled', lambda: True)():
        return 1.0
    scale = getattr(scaler, '_get_scale_async', lambda: None)()
    return float(scaler.get_scale()) if scale is None else scale


def set_loss_scale(model: nn.Module, scale) -> int:
    """Tell every module with a ``set_loss_scale`` method (UN) the loss scale of the coming
    backward; returns the number of modules set."""
    if is_model_wrapper(model):
        model = model.module
    count = 0
    for m in model.modules():
        if callable(getattr(m, 'set_loss_scale', None)):
            m.set_loss_scale(scale)
            count += 1
    return count


def progressive_ratio(model: nn.Module) -> Optional[Tuple[float, float]]:
    """``(min, max)`` of the LayerNorm weight ``g`` over every PRepBN in ``model`` (None if
    there is none). Loaded norms of a converted release sit at 0 while norms that are new
    in detection (the output norms) run their own schedule, so one layer does not tell."""
    if is_model_wrapper(model):
        model = model.module
    ratios = [m.ratio for m in model.modules() if isinstance(m, PRepBN) and not m.deploy]
    if not ratios:
        return None
    return min(ratios), max(ratios)


@register_hook()
class ProgressiveNormHook(Hook):
    """Sets the training iteration on PRepBN/UN layers before every training iteration (and,
    for UN's gradient statistics, the loss scale of fp16 mixed precision).

    The schedule is a function of ``runner.iter`` (so gradient accumulation or extra forward
    passes do not move it) and the iteration is also stored in each layer's buffers, so a
    resumed run continues the schedule exactly. The smallest and largest ``g`` over all
    PRepBN layers are logged as ``prepbn_ratio_min`` / ``prepbn_ratio_max``.

    Args:
        log_ratio (bool): log ``g`` with the training scalars. Default: True.
    """

    priority = 'VERY_HIGH'

    def __init__(self, log_ratio: bool = True):
        self.log_ratio = log_ratio

    def before_train(self, runner) -> None:
        count = set_progressive_iter(runner.model, runner.iter)
        runner.logger.info(f'ProgressiveNormHook drives {count} norm layers from iteration '
                           f'{runner.iter}')

    def before_train_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        set_progressive_iter(runner.model, runner.iter)
        # fp16 AMP scales the gradients; UN keeps its gradient statistics unscaled
        set_loss_scale(runner.model, optim_loss_scale(runner.optim_wrapper))
        if self.log_ratio:
            g = progressive_ratio(runner.model)
            if g is not None:
                runner.message_hub.update_scalar('train/prepbn_ratio_min', g[0])
                runner.message_hub.update_scalar('train/prepbn_ratio_max', g[1])
