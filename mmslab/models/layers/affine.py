"""Per-channel affine maps and the exact algebra that folds them into neighbouring layers.

Every normalization in mmslab is, at inference, a per-channel affine ``y = x * scale + shift``.
The helpers here move such an affine into the Linear/Conv before or after it, so the deployed
model has no normalization left.
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from .reparameterizable import Reparameterizable

DATA_FORMATS = ('channels_last', 'channels_first')


def check_data_format(data_format: str) -> str:
    if data_format not in DATA_FORMATS:
        raise ValueError(f'data_format must be one of {DATA_FORMATS}, got {data_format!r}')
    return data_format


def _broadcast(v: Tensor, x: Tensor, data_format: str) -> Tensor:
    """Shape a ``[C]`` vector to broadcast against ``x`` along its channel axis."""
    if data_format == 'channels_last':
        return v
    return v.view(-1, *([1] * (x.dim() - 2)))


class FoldableNorm(Reparameterizable, nn.Module):
    """Base class of normalizations that are a per-channel affine at inference.

    Subclasses implement ``forward_train`` (the training-time computation, also used in eval
    mode before deployment) and ``_fused_affine`` (the eval-mode ``(scale, shift)``, which the
    public ``fused_affine`` returns before deployment), and list
    the sub-modules/parameters/buffers to drop in ``_stat_attrs``. ``switch_to_deploy`` turns
    the module into the affine form in place; ``deploy=True`` builds that form directly so a
    fused checkpoint loads.
    """

    _stat_attrs: Tuple[str, ...] = ()

    def __init__(self, num_features: int, data_format: str = 'channels_last',
                 deploy: bool = False):
        super().__init__()
        self.num_features = num_features
        self.data_format = check_data_format(data_format)
        self.deploy = deploy
        if deploy:
            self._make_deploy_params()

    def _make_deploy_params(self) -> None:
        self.weight = nn.Parameter(torch.ones(self.num_features))
        self.bias = nn.Parameter(torch.zeros(self.num_features))

    def fused_affine(self) -> Tuple[Tensor, Tensor]:
        """Return ``(scale, shift)``, each ``[C]``, of the eval-mode computation."""
        if self.deploy:
            return self.weight.detach(), self.bias.detach()
        return self._fused_affine()

    def _fused_affine(self) -> Tuple[Tensor, Tensor]:
        raise NotImplementedError

    def forward_train(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        if self.deploy:
            return torch.addcmul(_broadcast(self.bias, x, self.data_format), x,
                                 _broadcast(self.weight, x, self.data_format))
        return self.forward_train(x)

    def _switch_to_deploy(self) -> None:
        """Replace the statistics by their per-channel affine."""
        scale, shift = self._fused_affine()
        ref = next(iter(self.parameters()), None)
        if ref is None:
            ref = next(iter(self.buffers()))
        for name in self._stat_attrs:
            delattr(self, name)
        self._make_deploy_params()
        self.weight.data = scale.to(ref)
        self.bias.data = shift.to(ref)


@torch.no_grad()
def fold_affine_into_weight(weight: Tensor, bias: Optional[Tensor], scale: Tensor,
                            shift: Tensor) -> Tuple[Tensor, Tensor]:
    """``W (s*x + t) + b = (W diag(s)) x + (W t + b)`` for a raw ``[out, in]`` weight.

    Computed in float64, returned in the weight's dtype; ``bias`` may be None.
    """
    w = weight.double()
    new_bias = w @ shift.double()
    if bias is not None:
        new_bias = new_bias + bias.double()
    return (w * scale.double()[None, :]).to(weight), new_bias.to(weight)


@torch.no_grad()
def fold_affine_into_next_linear(linear: nn.Linear, scale: Tensor, shift: Tensor) -> nn.Linear:
    """Fold ``x -> x * scale + shift`` into the Linear that consumes it (gains a bias)."""
    new = nn.Linear(linear.in_features, linear.out_features, bias=True).to(linear.weight)
    weight, bias = fold_affine_into_weight(linear.weight, linear.bias, scale, shift)
    new.weight.copy_(weight)
    new.bias.copy_(bias)
    return new


@torch.no_grad()
def fold_affine_into_prev(layer: nn.Module, scale: Tensor, shift: Tensor) -> nn.Module:
    """Fold ``y -> y * scale + shift`` into the Linear or Conv that produced ``y``.

    ``s (W x + b) + t = (diag(s) W) x + (s b + t)``: the bias term ``s*b`` is kept (the SLAB
    authors' patch-embed fold drops it). Returns a new layer of the same type with a bias.
    """
    if isinstance(layer, nn.Linear):
        new = nn.Linear(layer.in_features, layer.out_features, bias=True)
    elif isinstance(layer, nn.modules.conv._ConvNd):
        new = type(layer)(layer.in_channels, layer.out_channels, layer.kernel_size,
                          stride=layer.stride, padding=layer.padding, dilation=layer.dilation,
                          groups=layer.groups, bias=True, padding_mode=layer.padding_mode)
    else:
        raise TypeError(f'cannot fold an affine into {type(layer).__name__}; '
                        'expected nn.Linear or nn.ConvNd')
    new = new.to(layer.weight)
    s = scale.double()
    shape = (-1, *([1] * (layer.weight.dim() - 1)))
    new.weight.copy_(layer.weight.double() * s.view(shape))
    bias = shift.double().clone()
    if layer.bias is not None:
        bias = bias + s * layer.bias.double()
    new.bias.copy_(bias)
    return new


@torch.no_grad()
def fold_affine_into_next_conv(conv: nn.Conv2d, scale: Tensor, shift: Tensor) -> nn.Conv2d:
    """Fold ``x -> x * scale + shift`` into the Conv2d that follows it.

    Exact only without zero padding (padding would see ``0`` instead of ``shift``) and with
    ``groups=1``: ``conv(s*x + t) = (W * s) x + (sum_{c,kh,kw} W t + b)``. Covers 1x1 convs
    and PVT's spatial-reduction convs (kernel = stride, no padding).
    """
    padding = conv.padding if isinstance(conv.padding, tuple) else (conv.padding, )
    if conv.groups != 1 or any(p != 0 for p in padding) or conv.padding_mode != 'zeros':
        raise ValueError('only a convolution with groups=1 and no padding can absorb the '
                         f'affine before it exactly (a 1x1 conv for instance); got {conv}')
    weight = conv.weight.double()
    new = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                    dilation=conv.dilation, bias=True).to(conv.weight)
    new.weight.copy_(weight * scale.double().view(1, -1, 1, 1))
    bias = torch.einsum('oikl,i->o', weight, shift.double())
    if conv.bias is not None:
        bias = bias + conv.bias.double()
    new.bias.copy_(bias)
    return new
