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


def bn_affine(bn: nn.modules.batchnorm._BatchNorm) -> Tuple[Tensor, Tensor]:
    """Eval-mode ``(scale, shift)`` of a BatchNorm, in float64."""
    inv_std = torch.rsqrt(bn.running_var.double() + bn.eps)
    weight = bn.weight.double() if bn.affine else torch.ones_like(inv_std)
    bias = bn.bias.double() if bn.affine else torch.zeros_like(inv_std)
    return weight * inv_std, bias - weight * bn.running_mean.double() * inv_std
