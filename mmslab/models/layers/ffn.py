"""Feed-forward networks: the Swin MLP and RePaFormer's channel-idle FFN."""
import math
from typing import Optional

import torch
import torch.nn as nn
from mmcv.cnn import build_activation_layer
from mmcv.cnn.bricks.drop import DropPath
from torch import Tensor

from mmslab.registry import register_model
from .affine import fold_affine_into_next_linear
from .reparameterizable import Reparameterizable
from .token_bn import bn_affine


class BlockFFN(nn.Module):
    """Base of the FFNs a transformer block holds (``ffn_type``), ``[..., C]`` -> ``[..., C]``.

    Attributes:
        includes_residual: the FFN applies its own input handling, DropPath and residual
            (RePaFormer's channel-idle FFN has BatchNorms inside instead of a pre-norm), so
            the block has no ``norm2`` and returns the FFN's output as is.
    """

    includes_residual = False


@register_model()
class SwinFFN(BlockFFN):
    """Linear -> act -> dropout -> Linear -> dropout, without the residual.

    Layout and names match mmcv's ``FFN`` (``layers.0.0`` is fc1, ``layers.1`` is fc2) so mmdet
    Swin weights load. :meth:`absorb_input_affine` folds the preceding norm into fc1.

    Shape: ``[..., C]`` -> ``[..., C]``.

    Args:
        embed_dims (int): The feature dimension.
        feedforward_channels (int): The hidden dimension.
        act_cfg (dict, optional): The activation. Default: None (``dict(type='GELU')``).
        ffn_drop (float): Dropout rate after the activation and after fc2. Default: 0.0.
    """

    def __init__(self, embed_dims: int, feedforward_channels: int,
                 act_cfg: Optional[dict] = None, ffn_drop: float = 0.0):
        super().__init__()
        act_cfg = act_cfg or dict(type='GELU')
        self.layers = nn.Sequential(
            nn.Sequential(nn.Linear(embed_dims, feedforward_channels),
                          build_activation_layer(act_cfg), nn.Dropout(ffn_drop)),
            nn.Linear(feedforward_channels, embed_dims), nn.Dropout(ffn_drop))

    def absorb_input_affine(self, scale: Tensor, shift: Tensor) -> None:
        self.layers[0][0] = fold_affine_into_next_linear(self.layers[0][0], scale, shift)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


@register_model()
class ChannelIdleFFN(Reparameterizable, BlockFFN):
    """Channel-idle FFN (RePaFormer) *including* its residual connection.

    Training form: ``x + DropPath(fc2(BN2(idle_act(fc1(BN1(x))))))`` where ``idle_act`` applies
    the activation to the first ``k = ceil(hidden * (1 - idle_ratio))`` hidden channels only
    and passes the rest linearly. Everything outside the activation is linear, so at
    inference it folds into three linears (RePaFormer, eqs. 4-7)::

        out = skip(x) + fc2(act(fc1(x)))
        skip = (W2'[:, k:] W1'[k:] + I) x + (W2'[:, k:] b1'[k:] + b2')   # C x C, bias
        fc1  = W1'[:k], b1'[:k]                                          # C -> k, bias
        fc2  = W2'[:, :k]                                                # k -> C, no bias

    with ``W1', b1'`` fc1 with BN1 folded in and ``W2', b2'`` fc2 with BN2 folded in.
    Names of the training form follow the RePaViT checkpoints: ``norm1`` is BN1, the
    BatchNorm of the FFN's input (in place of the block's pre-norm), ``norm2`` is BN2, the
    BatchNorm of the hidden channels, both ``nn.BatchNorm1d`` over the channel axis of the
    tokens; ``fc1``, ``fc2`` the two linears. In a Swin block the keys read
    ``blocks.0.ffn.norm1.running_mean``: not the block's ``norm1``.

    Shape: ``[..., C]`` -> ``[..., C]``.

    Args:
        embed_dims (int): The feature dimension.
        feedforward_channels (int): The hidden dimension.
        idle_ratio (float): The fraction of hidden channels that pass the activation by
            (linear), in [0, 1]. Default: 0.75.
        act_cfg (dict, optional): The activation of the active channels.
            Default: None (``dict(type='GELU')``).
        ffn_drop (float): Dropout rate after the activation and after fc2. Default: 0.0.
        drop_path_rate (float): Stochastic depth rate of the FFN branch. Default: 0.0.
        deploy (bool): Build the fused structure (``skip``, ``fc1``, ``fc2``; see
            :func:`mmslab.reparameterize`). Default: False.
    """

    includes_residual = True

    def __init__(self, embed_dims: int, feedforward_channels: int, idle_ratio: float = 0.75,
                 act_cfg: Optional[dict] = None, ffn_drop: float = 0.0,
                 drop_path_rate: float = 0.0, deploy: bool = False):
        super().__init__()
        if not 0.0 <= idle_ratio <= 1.0:
            raise ValueError(f'idle_ratio must lie in [0, 1], got {idle_ratio}')
        self.embed_dims = embed_dims
        self.hidden = feedforward_channels
        self.idle_ratio = idle_ratio
        self.active = math.ceil(feedforward_channels * (1.0 - idle_ratio))
        self.act = build_activation_layer(act_cfg or dict(type='GELU'))
        self.deploy = deploy
        k = self.active
        if deploy:
            self.skip = nn.Linear(embed_dims, embed_dims)
            if k:
                self.fc1 = nn.Linear(embed_dims, k)
                self.fc2 = nn.Linear(k, embed_dims, bias=False)
            return
        self.norm1 = nn.BatchNorm1d(embed_dims)
        self.fc1 = nn.Linear(embed_dims, feedforward_channels)
        self.norm2 = nn.BatchNorm1d(feedforward_channels)
        self.fc2 = nn.Linear(feedforward_channels, embed_dims)
        self.drop = nn.Dropout(ffn_drop)
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        if self.deploy:
            out = self.skip(x)
            if self.active:
                out = out + self.fc2(self.act(self.fc1(x)))
            return out
        # the BatchNorm modules themselves: SyncBatchNorm conversion reaches them, and under
        # autocast they normalize before the linears round their tokens
        h = self.fc1(self.norm1(x.reshape(-1, self.embed_dims)))
        k = self.active
        if 0 < k < self.hidden:
            h = torch.cat([self.act(h[:, :k]), h[:, k:]], dim=1)
        elif k == self.hidden:
            h = self.act(h)
        y = self.drop(self.fc2(self.drop(self.norm2(h)))).view_as(x)
        return x + self.drop_path(y)

    @torch.no_grad()
    def fused_weights(self) -> dict:
        """The deploy-form weights (float64) of the current eval-mode computation:
        ``skip_weight`` ``[C, C]``, ``skip_bias`` ``[C]``, ``fc1_weight`` ``[k, C]``,
        ``fc1_bias`` ``[k]``, ``fc2_weight`` ``[C, k]``."""
        s1, t1 = bn_affine(self.norm1)
        s2, t2 = bn_affine(self.norm2)
        w1 = self.fc1.weight.double() * s1[None, :]
        b1 = self.fc1.weight.double() @ t1 + self.fc1.bias.double()
        w2 = self.fc2.weight.double() * s2[None, :]
        b2 = self.fc2.weight.double() @ t2 + self.fc2.bias.double()
        k = self.active
        eye = torch.eye(self.embed_dims, dtype=torch.float64, device=w1.device)
        return dict(skip_weight=w2[:, k:] @ w1[k:] + eye, skip_bias=w2[:, k:] @ b1[k:] + b2,
                    fc1_weight=w1[:k], fc1_bias=b1[:k], fc2_weight=w2[:, :k])

    def _switch_to_deploy(self) -> None:
        fused = self.fused_weights()
        k = self.active
        ref = self.fc1.weight
        skip = nn.Linear(self.embed_dims, self.embed_dims).to(ref)
        skip.weight.copy_(fused['skip_weight'])
        skip.bias.copy_(fused['skip_bias'])
        for name in ('norm1', 'fc1', 'norm2', 'fc2', 'drop', 'drop_path'):
            delattr(self, name)
        self.skip = skip
        if k:
            self.fc1 = nn.Linear(self.embed_dims, k).to(ref)
            self.fc1.weight.copy_(fused['fc1_weight'])
            self.fc1.bias.copy_(fused['fc1_bias'])
            self.fc2 = nn.Linear(k, self.embed_dims, bias=False).to(ref)
            self.fc2.weight.copy_(fused['fc2_weight'])

    def extra_repr(self) -> str:
        return (f'embed_dims={self.embed_dims}, hidden={self.hidden}, active={self.active}, '
                f'deploy={self.deploy}')
