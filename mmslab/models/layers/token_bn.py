"""BatchNorm over the channel axis of token tensors."""
from typing import Tuple

import torch
import torch.nn as nn
from torch import Tensor

from mmslab.registry import register_model
from .affine import FoldableNorm


@register_model()
class TokenBN(FoldableNorm):
    """``nn.BatchNorm1d`` applied to ``[..., C]`` tokens (or ``[B, C, *]`` maps) without transposes.

    The sub-module is named ``bn``; at inference this is the affine
    ``w / sqrt(var + eps) * x + (b - w * mean / sqrt(var + eps))``.

    Args:
        num_features (int): Channels C.
        eps (float): ``eps`` of the BatchNorm. Default: 1e-5.
        momentum (float): ``momentum`` of the BatchNorm. Default: 0.1.
        data_format (str): ``'channels_last'`` for ``[..., C]``, ``'channels_first'`` for
            ``[B, C, *]``. Default: 'channels_last'.
        deploy (bool): Build the fused affine form directly. Default: False.
    """

    _stat_attrs = ('bn',)

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 data_format: str = 'channels_last', deploy: bool = False):
        super().__init__(num_features, data_format, deploy)
        if not deploy:
            self.bn = nn.BatchNorm1d(num_features, eps=eps, momentum=momentum)

    def forward_train(self, x: Tensor) -> Tensor:
        if self.data_format == 'channels_last':
            return self.bn(x.reshape(-1, self.num_features)).view_as(x)
        return self.bn(x.flatten(2)).view_as(x)

    def _fused_affine(self) -> Tuple[Tensor, Tensor]:
        return bn_affine(self.bn)


def bn_scale_shift(bn: nn.modules.batchnorm._BatchNorm, x: Tensor) -> Tuple[Tensor, Tensor]:
    """``(scale, shift)`` with ``bn(x) == x * scale + shift`` for ``[M, C]`` ``x``, as ``bn``
    computes in its current mode: batch statistics in training mode (then the running
    statistics are updated as ``nn.BatchNorm1d`` updates them), running ones in eval mode.

    For a BatchNorm followed by a linear layer (RePa's channel-idle FFN): the affine folds
    into the layer's weight and bias, so no pass over the tokens writes the BatchNorm's
    output, forward or backward. The statistics are float32 (at least)."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:  # cumulative average
            factor = 1.0 / float(bn.num_batches_tracked)
    batch_stats = bn.training or bn.running_mean is None
    if batch_stats:
        stats_x = x if x.dtype in (torch.float32, torch.float64) else x.float()
        var, mean = torch.var_mean(stats_x, dim=0, correction=0)
        if bn.training and bn.track_running_stats:
            count = x.shape[0]
            with torch.no_grad():
                bn.running_mean.lerp_(mean.detach().to(bn.running_mean), factor)
                unbiased = var.detach() * (count / max(count - 1, 1))
                bn.running_var.lerp_(unbiased.to(bn.running_var), factor)
    else:
        mean, var = bn.running_mean, bn.running_var
    scale = torch.rsqrt(var + bn.eps)
    if bn.weight is not None:
        scale = bn.weight * scale
    shift = -mean * scale if bn.bias is None else bn.bias - mean * scale
    return scale, shift


def bn_affine(bn: nn.modules.batchnorm._BatchNorm) -> Tuple[Tensor, Tensor]:
    """Eval-mode ``(scale, shift)`` of a BatchNorm, in float64."""
    inv_std = torch.rsqrt(bn.running_var.double() + bn.eps)
    weight = bn.weight.double() if bn.affine else torch.ones_like(inv_std)
    bias = bn.bias.double() if bn.affine else torch.zeros_like(inv_std)
    return weight * inv_std, bias - weight * bn.running_mean.double() * inv_std
