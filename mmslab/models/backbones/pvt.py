"""PVT v1 with pluggable normalization and attention (PRepBN-PVT, SLAB-PVT).

With LayerNorm and spatial-reduction softmax attention it computes what mmdet's
``PyramidVisionTransformer`` computes (same parameter names, same outputs; keyword arguments
as listed in :class:`ReparamPVT`). Attention runs on ``scaled_dot_product_attention`` instead
of ``nn.MultiheadAttention``.
"""
import copy
import functools
import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmcv.cnn import build_activation_layer
from mmcv.cnn.bricks.drop import DropPath
from mmengine.model import BaseModule
from mmengine.model.weight_init import constant_init, normal_init, trunc_normal_, \
    trunc_normal_init
from torch import Tensor

from mmslab.registry import register_model
from ..layers.affine import (FoldableNorm, fold_affine_into_next_conv,
                             fold_affine_into_next_linear, fold_affine_into_weight)
from ..layers.builder import (build_norm, build_window_attention, check_norm_cfg,
                              get_window_attention, is_foldable_norm, resolve_layer_type)
from ..layers.reparameterizable import Reparameterizable
from ..layers.linear_attention import SLA
from ..layers.patch import PatchEmbed
from .base import (SLAB_NORM_CFG, BackbonePreset, ReparamBackboneMixin, check_bn_stats,
                   freeze_module, init_cfg_from_pretrained, per_stage)

#: ``attn_types`` names of the PVT configs -> registered PVT attentions.
PVT_ATTENTION_ALIASES = {'softmax': 'SpatialReductionAttention', 'sla': 'GlobalSLA'}


class MHAProjections(nn.Module):
    """Holds ``in_proj_weight``/``in_proj_bias``/``out_proj`` under ``nn.MultiheadAttention``'s
    names (so mmdet PVT weights load) without its slow generic forward."""

    def __init__(self, embed_dims: int, bias: bool = True, in_proj_bias: Optional[bool] = None):
        super().__init__()
        # A folded norm gives the input projection a bias, never the output projection.
        in_proj_bias = bias if in_proj_bias is None else in_proj_bias
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dims, embed_dims))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dims)) if in_proj_bias else None
        self.out_proj = nn.Linear(embed_dims, embed_dims, bias=bias)
        nn.init.xavier_uniform_(self.in_proj_weight)


class PVTAttention(nn.Module):
    """Base of the attentions a PVT block holds (``attn_types``), built with one signature:
    ``(embed_dims, num_heads, sr_ratio, grid, qkv_bias, attn_drop, proj_drop, norm_cfg,
    deploy)``. ``absorb_input_affine`` folds the block's ``norm1`` into the input projections.

    Shape: ``[B, H*W, C]`` (normalized tokens) -> ``[B, H*W, C]`` (before the residual).
    """

    def absorb_input_affine(self, scale: Tensor, shift: Tensor) -> None:
        raise NotImplementedError


def get_pvt_attention(attn_type):
    """``'softmax'`` / ``'sla'`` / a registered :class:`PVTAttention` / a class -> the class;
    a window attention kernel (Swin's ``attn_types``) -> :class:`GlobalAttention` of it."""
    try:
        return resolve_layer_type(attn_type, PVTAttention, PVT_ATTENTION_ALIASES,
                                  'attention type')
    except ValueError as pvt_error:
        try:
            kernel = get_window_attention(attn_type)
        except ValueError:
            raise pvt_error from None
        return functools.partial(GlobalAttention, kernel=kernel)


@register_model()
class SpatialReductionAttention(Reparameterizable, PVTAttention):
    """PVT's attention: keys/values from a strided-conv reduced map, then a norm.

    ``grid`` is not used (the attention is global); deploy folds the norm of the reduced map
    into the k/v rows of the input projection.

    Args:
        embed_dims (int): The feature dimension.
        num_heads (int): Parallel attention heads.
        sr_ratio (int): The spatial reduction ratio of keys and values (a conv of this kernel
            size and stride); 1: no reduction. Default: 1.
        grid (tuple[int, int], optional): The pre-training token grid; unused (the common
            signature of :class:`PVTAttention`). Default: None.
        qkv_bias (bool): Bias in the q, k, v and output projections. Default: True.
        attn_drop (float): Dropout rate of the attention weights. Default: 0.0.
        proj_drop (float): Dropout rate after the output projection. Default: 0.0.
        norm_cfg (dict, optional): The norm of the reduced map, and the kind of the block's
            norm (a foldable one gives the input projection a bias in deploy form).
            Default: None (``dict(type='LN', eps=1e-6)``).
        deploy (bool): Build the fused structure (see :func:`mmslab.reparameterize`).
            Default: False.
    """

    @property
    def needs_eval_mode(self) -> bool:
        # the reduced map's norm folds with its running statistics
        return self.sr_ratio > 1 and isinstance(self.norm, FoldableNorm)

    def __init__(self, embed_dims: int, num_heads: int, sr_ratio: int = 1,
                 grid: Optional[Tuple[int, int]] = None, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0,
                 norm_cfg: Optional[dict] = None, deploy: bool = False):
        super().__init__()
        self.embed_dims, self.num_heads, self.sr_ratio = embed_dims, num_heads, sr_ratio
        self.attn_drop = attn_drop
        self.deploy = deploy
        norm_cfg = norm_cfg or dict(type='LN', eps=1e-6)
        # Folding a norm (the block's norm1, or the reduced map's) gives in_proj a bias.
        fold = deploy and is_foldable_norm(norm_cfg)
        self.attn = MHAProjections(embed_dims, bias=qkv_bias, in_proj_bias=qkv_bias or fold)
        if sr_ratio > 1:
            self.sr = nn.Conv2d(embed_dims, embed_dims, sr_ratio, stride=sr_ratio)
            self.norm = nn.Identity() if fold else build_norm(norm_cfg, embed_dims, deploy=deploy)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor, hw_shape: Tuple[int, int]) -> Tensor:
        b, n, c = x.shape
        w, bias = self.attn.in_proj_weight, self.attn.in_proj_bias
        q = F.linear(x, w[:c], None if bias is None else bias[:c])
        if self.sr_ratio > 1:
            kv_in = self.sr(x.transpose(1, 2).reshape(b, c, *hw_shape)).flatten(2).transpose(1, 2)
            kv_in = self.norm(kv_in)
        else:
            kv_in = x
        kv = F.linear(kv_in, w[c:], None if bias is None else bias[c:])
        h, d = self.num_heads, c // self.num_heads
        q = q.view(b, n, h, d).transpose(1, 2)
        k, v = kv.view(b, -1, 2, h, d).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v,
                                             dropout_p=self.attn_drop if self.training else 0.)
        out = self.attn.out_proj(out.transpose(1, 2).reshape(b, n, c))
        return self.proj_drop(out)

    @torch.no_grad()
    def absorb_input_affine(self, scale: Tensor, shift: Tensor) -> None:
        """Fold the block's ``norm1`` affine into q (and into sr or k/v)."""
        c = self.embed_dims
        w, b = self.attn.in_proj_weight, self.attn.in_proj_bias
        rows = slice(0, c) if self.sr_ratio > 1 else slice(0, 3 * c)
        new_w, new_b = fold_affine_into_weight(w[rows], None if b is None else b[rows], scale,
                                              shift)
        self._set_rows(rows, new_w, new_b)
        if self.sr_ratio > 1:
            self.sr = fold_affine_into_next_conv(self.sr, scale, shift)

    def _set_rows(self, rows: slice, new_w: Tensor, new_b: Tensor) -> None:
        if self.attn.in_proj_bias is None:
            self.attn.in_proj_bias = nn.Parameter(self.attn.in_proj_weight.new_zeros(
                3 * self.embed_dims))
        self.attn.in_proj_weight.data[rows] = new_w
        self.attn.in_proj_bias.data[rows] = new_b

    def _switch_to_deploy(self) -> None:
        if self.sr_ratio > 1 and isinstance(self.norm, FoldableNorm):
            c = self.embed_dims
            w, b = self.attn.in_proj_weight, self.attn.in_proj_bias
            new_w, new_b = fold_affine_into_weight(w[c:], None if b is None else b[c:],
                                                  *self.norm.fused_affine())
            self._set_rows(slice(c, 3 * c), new_w, new_b)
            self.norm = nn.Identity()


@register_model()
class GlobalAttention(Reparameterizable, PVTAttention):
    """A window attention kernel over the whole feature map, as one window (no spatial
    reduction): the PVT slot of every kernel Swin's windows take (``attn_types``).

    ``sr_ratio`` and ``attn_drop`` do not apply (no reduction; a softmax kernel keeps its own
    options); ``norm_cfg`` tells whether the block's norm is folded into ``qkv`` in deploy
    form (which then has a bias). That fold is the :class:`PVTBlock`'s.

    Args:
        embed_dims (int): The feature dimension.
        num_heads (int): Parallel attention heads.
        sr_ratio (int): Ignored (no spatial reduction). Default: 1.
        grid (tuple[int, int], optional): The pre-training token grid: the kernel's window
            (:class:`ReparamPVT` passes it). Required in fact: the default only completes the
            common signature. Default: None.
        qkv_bias (bool): Bias in the q, k, v projection. Default: True.
        attn_drop (float): Ignored. Default: 0.0.
        proj_drop (float): Dropout rate after the output projection. Default: 0.0.
        norm_cfg (dict, optional): The kind of the block's norm: a foldable one gives ``qkv``
            a bias in deploy form. Default: None (LayerNorm).
        deploy (bool): Build the fused structure (see :func:`mmslab.reparameterize`).
            Default: False.
        kernel (str | type): The window kernel, a registered
            :class:`~mmslab.models.layers.window_attention.WindowKernelBase`. Default: 'SLA'.
        kernel_cfg (dict, optional): Further arguments of the kernel. Default: None.
    """

    needs_eval_mode = False

    def __init__(self, embed_dims: int, num_heads: int, sr_ratio: int = 1,
                 grid: Optional[Tuple[int, int]] = None, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0,
                 norm_cfg: Optional[dict] = None, deploy: bool = False, kernel='SLA',
                 kernel_cfg: Optional[dict] = None):
        super().__init__()
        fold = deploy and is_foldable_norm(norm_cfg or dict(type='LN'))
        self.kernel = build_window_attention(
            kernel, embed_dims=embed_dims, num_heads=num_heads, window_size=grid,
            qkv_bias=qkv_bias or fold, proj_drop=proj_drop, deploy=deploy, **(kernel_cfg or {}))
        self.deploy = deploy

    def forward(self, x: Tensor, hw_shape: Tuple[int, int]) -> Tensor:
        out = self.kernel.attend(self.kernel.qkv(x), tuple(hw_shape)).reshape(x.shape)
        return self.kernel.proj_drop(self.kernel.proj(out))

    def absorb_input_affine(self, scale: Tensor, shift: Tensor) -> None:
        self.kernel.qkv = fold_affine_into_next_linear(self.kernel.qkv, scale, shift)

    def _switch_to_deploy(self) -> None:
        if hasattr(self.kernel, 'switch_to_deploy'):
            self.kernel.switch_to_deploy()


@register_model()
class GlobalSLA(GlobalAttention):
    """SLA over the whole feature map, for SLAB-PVT stages (:class:`GlobalAttention`): its
    positional encoding is learned for the pre-training ``grid`` and bilinearly resized to the
    input's grid whenever the two differ (smaller or larger, like PVT's absolute position
    embedding), as the SLAB authors' SLA-PVT stages do.

    Args:
        embed_dims (int): The feature dimension.
        num_heads (int): Parallel attention heads.
        sr_ratio (int): Ignored (no spatial reduction). Default: 1.
        grid (tuple[int, int], optional): The token grid the positional encoding is learned
            on (:class:`ReparamPVT` passes it). Default: None.
        qkv_bias (bool): Bias in the q, k, v projection. Default: True.
        attn_drop (float): Ignored (no softmax weights to drop). Default: 0.0.
        proj_drop (float): Dropout rate after the output projection. Default: 0.0.
        norm_cfg (dict, optional): The kind of the block's norm: a foldable one gives ``qkv``
            a bias in deploy form. Default: None (LayerNorm).
        deploy (bool): Build the fused structure (see :func:`mmslab.reparameterize`).
            Default: False.
    """

    def __init__(self, embed_dims: int, num_heads: int, sr_ratio: int = 1,
                 grid: Optional[Tuple[int, int]] = None, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0,
                 norm_cfg: Optional[dict] = None, deploy: bool = False):
        super().__init__(embed_dims, num_heads, sr_ratio, grid, qkv_bias, attn_drop, proj_drop,
                         norm_cfg, deploy, kernel=SLA, kernel_cfg=dict(resize_pos=True))


class MixFFN(nn.Module):
    """PVT FFN: 1x1 conv -> act -> 1x1 conv (names ``layers.0`` and ``layers.3`` as mmdet),
    computed as Linears on tokens. Shape: ``[B, N, C]`` -> ``[B, N, C]``."""

    def __init__(self, embed_dims: int, feedforward_channels: int,
                 act_cfg: Optional[dict] = None, ffn_drop: float = 0.0):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv2d(embed_dims, feedforward_channels, 1),
            build_activation_layer(act_cfg or dict(type='GELU')), nn.Dropout(ffn_drop),
            nn.Conv2d(feedforward_channels, embed_dims, 1), nn.Dropout(ffn_drop))

    def forward(self, x: Tensor) -> Tensor:
        fc1, act, drop1, fc2, drop2 = self.layers
        x = F.linear(x, fc1.weight.flatten(1), fc1.bias)
        x = drop1(act(x))
        return drop2(F.linear(x, fc2.weight.flatten(1), fc2.bias))

    def absorb_input_affine(self, scale: Tensor, shift: Tensor) -> None:
        self.layers[0] = fold_affine_into_next_conv(self.layers[0], scale, shift)


class PVTBlock(Reparameterizable, nn.Module):
    """``x + DropPath(attn(norm1(x)))``, ``x + DropPath(ffn(norm2(x)))``.

    ``norm1`` is the pre-norm of the attention, ``norm2`` the pre-norm of the FFN (mmdet's
    names). Inside a PRepBN pre-norm ``norm1`` is its LayerNorm branch and ``norm2`` its RepBN
    branch (``norm1.norm2.bn``: the attention pre-norm's BN). Deploy folds ``norm1`` into the
    attention's input projections and ``norm2`` into the FFN's first conv.
    """

    def __init__(self, embed_dims: int, num_heads: int, feedforward_channels: int,
                 sr_ratio: int, attn_type: str, grid: Tuple[int, int], qkv_bias: bool,
                 drop_rate: float, attn_drop_rate: float, drop_path_rate: float,
                 act_cfg: Optional[dict], norm_cfg: dict, deploy: bool = False):
        super().__init__()
        fold = deploy and is_foldable_norm(norm_cfg)
        self.norm1 = nn.Identity() if fold else build_norm(norm_cfg, embed_dims, deploy=deploy)
        self.attn = get_pvt_attention(attn_type)(
            embed_dims, num_heads, sr_ratio=sr_ratio, grid=grid, qkv_bias=qkv_bias,
            attn_drop=attn_drop_rate, proj_drop=drop_rate, norm_cfg=norm_cfg, deploy=deploy)
        self.norm2 = nn.Identity() if fold else build_norm(norm_cfg, embed_dims, deploy=deploy)
        self.ffn = MixFFN(embed_dims, feedforward_channels, act_cfg, drop_rate)
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0 else nn.Identity()
        self.deploy = deploy

    def forward(self, x: Tensor, hw_shape: Tuple[int, int]) -> Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), hw_shape))
        return x + self.drop_path(self.ffn(self.norm2(x)))

    def _switch_to_deploy(self) -> None:
        if isinstance(self.norm1, FoldableNorm):
            self.attn.absorb_input_affine(*self.norm1.fused_affine())
            self.norm1 = nn.Identity()
        if isinstance(self.norm2, FoldableNorm):
            self.ffn.absorb_input_affine(*self.norm2.fused_affine())
            self.norm2 = nn.Identity()


class AbsolutePositionEmbedding(nn.Module):
    """Learned position embedding, bilinearly resized to the input grid (mmdet's names)."""

    def __init__(self, pos_shape: Tuple[int, int], pos_dim: int, drop_rate: float = 0.0):
        super().__init__()
        self.pos_shape = pos_shape
        self.pos_embed = nn.Parameter(torch.zeros(1, pos_shape[0] * pos_shape[1], pos_dim))
        self.drop = nn.Dropout(drop_rate)

    def init_weights(self) -> None:
        trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, x: Tensor, hw_shape: Tuple[int, int]) -> Tensor:
        pos = self.pos_embed
        # traced sizes cannot be compared: resized always (a resize to the same grid is exact)
        if not all(isinstance(n, int) for n in hw_shape) or \
                tuple(hw_shape) != tuple(self.pos_shape):
            grid = pos.reshape(1, *self.pos_shape, -1).permute(0, 3, 1, 2)
            pos = F.interpolate(grid, size=hw_shape, mode='bilinear').flatten(2).transpose(1, 2)
        return self.drop(x + pos)


@register_model()
class ReparamPVT(ReparamBackboneMixin, BaseModule):
    """PVT v1 with pluggable norm (``norm_cfg``) and per-stage attention (``'softmax'``
    spatial-reduction attention or ``'sla'`` global simplified linear attention, sr=1).

    Keyword arguments mean what they mean in mmdet's ``PyramidVisionTransformer``, except that
    ``arch`` (``tiny``/``small``/``medium`` depths) comes first (mmdet's first positional
    argument is ``pretrain_img_size``: pass arguments by keyword), the number of stages is
    ``len(num_layers)`` (no ``num_stages``), and ``paddings`` / ``use_conv_ffn`` are not
    accepted (PVT v1: no padding, no convolutional FFN); ``convert_weights`` is ignored.
    Returns a tuple of NCHW maps (strides 4, 8, 16, 32).

    Args:
        arch (str): ``'tiny'``, ``'small'`` or ``'medium'``: the default ``num_layers``.
            Default: 'tiny'.
        pretrain_img_size (int | tuple[int, int]): The pre-training image size: the grid of
            the position embeddings and of global SLA's positional encodings, resized to
            other inputs. Default: 224.
        in_channels (int): The number of input channels. Default: 3.
        embed_dims (int): The feature dimension per head; stage i has
            ``embed_dims * num_heads[i]`` channels. Default: 64.
        num_layers (Sequence[int], optional): Blocks per stage. Default: None (``arch``'s).
        num_heads (Sequence[int]): Attention heads per stage. Default: (1, 2, 5, 8).
        patch_sizes (Sequence[int]): The patch size of each stage's patch embedding.
            Default: (4, 2, 2, 2).
        strides (Sequence[int]): The stride of each stage's patch embedding.
            Default: (4, 2, 2, 2).
        sr_ratios (Sequence[int]): The spatial reduction ratio of each stage's softmax
            attention. Default: (8, 4, 2, 1).
        out_indices (Sequence[int]): The stages whose outputs are returned.
            Default: (0, 1, 2, 3).
        mlp_ratios (Sequence[int]): The FFN's hidden dimension over the stage's channels,
            per stage. Default: (8, 8, 4, 4).
        qkv_bias (bool): Bias in the q, k, v projections. Default: True.
        drop_rate (float): Dropout rate after the attention, in the FFNs and after the
            position embeddings. Default: 0.0.
        attn_drop_rate (float): Dropout rate of the softmax attention weights. Default: 0.0.
        drop_path_rate (float): Stochastic depth rate, rising linearly over the blocks to
            this value. Default: 0.1.
        use_abs_pos_embed (bool): A learned position embedding per stage. Default: True.
        norm_after_stage (bool): A norm after each stage. Default: False.
        act_cfg (dict, optional): The FFNs' activation. Default: None (GELU).
        norm_cfg (dict, optional): Every norm (patch embeds, blocks, reductions, after the
            stages), as ``norm_cfg`` of :class:`ReparamSwinTransformer`.
            Default: None (``dict(type='LN', eps=1e-6)``).
        attn_types (str | Sequence[str]): Per stage, ``'softmax'`` (spatial-reduction
            attention), ``'sla'`` (global SLA) or a registered PVT attention.
            Default: ('softmax', 'softmax', 'softmax', 'softmax').
        bn_stats (str): ``'train'`` or ``'frozen'``, as in :class:`ReparamSwinTransformer`.
            Default: 'train'.
        frozen_stages (int): Stages to freeze (eval mode, no gradients): -1 none, i stages
            0..i. Default: -1.
        pretrained (str, optional): Deprecated, as in mmdet: the same as
            ``init_cfg=dict(type='Pretrained', checkpoint=pretrained)``. Default: None.
        convert_weights (bool): Accepted for mmdet configs and ignored (every checkpoint
            layout is converted on loading). Default: True.
        deploy (bool): Build the fused structure (see :func:`mmslab.reparameterize`).
            Default: False.
        init_cfg (dict, optional): Initialization config, as in
            :class:`ReparamSwinTransformer`. Default: None.
    """

    arch_zoo = {
        'tiny': dict(num_layers=(2, 2, 2, 2)),
        'small': dict(num_layers=(3, 4, 6, 3)),
        'medium': dict(num_layers=(3, 4, 18, 3)),
    }

    def __init__(self, arch: str = 'tiny', pretrain_img_size=224, in_channels: int = 3,
                 embed_dims: int = 64, num_layers: Optional[Sequence[int]] = None,
                 num_heads=(1, 2, 5, 8), patch_sizes=(4, 2, 2, 2), strides=(4, 2, 2, 2),
                 sr_ratios=(8, 4, 2, 1), out_indices=(0, 1, 2, 3), mlp_ratios=(8, 8, 4, 4),
                 qkv_bias: bool = True, drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
                 drop_path_rate: float = 0.1, use_abs_pos_embed: bool = True,
                 norm_after_stage: bool = False, act_cfg: Optional[dict] = None,
                 norm_cfg: Optional[dict] = None, attn_types=('softmax', ) * 4,
                 bn_stats: str = 'train', frozen_stages: int = -1, pretrained=None,
                 convert_weights: bool = True, deploy: bool = False, init_cfg=None):
        # Accepted so that configs written for mmdet's PVT build unchanged; every checkpoint
        # layout is converted on loading (see mmslab.models.converters).
        del convert_weights
        if arch not in self.arch_zoo:
            raise ValueError(f'unknown arch {arch!r}; valid: {tuple(self.arch_zoo)}')
        super().__init__(init_cfg=init_cfg_from_pretrained(pretrained, init_cfg))
        num_layers = tuple(num_layers or self.arch_zoo[arch]['num_layers'])
        n = len(num_layers)
        if not -1 <= frozen_stages < n:
            raise ValueError(f'frozen_stages must be in [-1, {n - 1}] for {n} stages (-1: none), '
                             f'got {frozen_stages}')
        attn_types = per_stage(attn_types, n, 'attn_types')
        for t in attn_types:
            get_pvt_attention(t)
        if not (len(num_heads) == len(patch_sizes) == len(strides) == len(sr_ratios) ==
                len(mlp_ratios) == len(attn_types) == n):
            raise ValueError('num_layers, num_heads, patch_sizes, strides, sr_ratios, '
                             'mlp_ratios and attn_types need one entry per stage')
        check_bn_stats(bn_stats)
        if not all(0 <= i < n for i in out_indices):
            raise ValueError(f'out_indices {out_indices} out of range for {n} stages')
        self.norm_cfg = check_norm_cfg(copy.deepcopy(norm_cfg or dict(type='LN', eps=1e-6)))
        img = (pretrain_img_size, ) * 2 if isinstance(pretrain_img_size, int) else tuple(
            pretrain_img_size)
        self.out_indices, self.bn_stats, self.frozen_stages = tuple(out_indices), bn_stats, \
            frozen_stages
        self.deploy, self.attn_types = deploy, attn_types
        dpr = torch.linspace(0, drop_path_rate, sum(num_layers)).tolist()
        self.layers = nn.ModuleList()
        self.num_features = []
        cur, stride_prod = 0, 1
        for i in range(n):
            dims = embed_dims * num_heads[i]
            stride_prod *= patch_sizes[i]
            grid = (img[0] // stride_prod, img[1] // stride_prod)
            patch_embed = PatchEmbed(in_channels, dims, patch_sizes[i], strides[i],
                                     self.norm_cfg, adaptive_padding=False, deploy=deploy)
            blocks = nn.ModuleList()
            if use_abs_pos_embed:
                blocks.append(AbsolutePositionEmbedding(grid, dims, drop_rate))
            blocks.extend(
                PVTBlock(dims, num_heads[i], mlp_ratios[i] * dims, sr_ratios[i], attn_types[i],
                         grid, qkv_bias, drop_rate, attn_drop_rate, dpr[cur + j], act_cfg,
                         self.norm_cfg, deploy) for j in range(num_layers[i]))
            norm = build_norm(self.norm_cfg, dims, deploy=deploy) if norm_after_stage else \
                nn.Identity()
            self.layers.append(nn.ModuleList([patch_embed, blocks, norm]))
            self.num_features.append(dims)
            in_channels, cur = dims, cur + num_layers[i]

    def train(self, mode: bool = True):
        super().train(mode)
        for i in range(self.frozen_stages + 1):
            freeze_module(self.layers[i])
        self._apply_bn_stats_policy(mode)
        return self

    def _init_default(self, m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            trunc_normal_init(m, std=.02, bias=0.)
        elif isinstance(m, nn.LayerNorm):
            constant_init(m, 1.0)
        elif isinstance(m, nn.Conv2d):
            fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels // m.groups
            normal_init(m, 0, math.sqrt(2.0 / fan_out))

    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        outs = []
        for i, (patch_embed, blocks, norm) in enumerate(self.layers):
            x, hw = patch_embed(x)
            for block in blocks:
                x = block(x, hw)
            x = norm(x)
            x = x.transpose(1, 2).reshape(x.shape[0], -1, *hw)
            if i in self.out_indices:
                outs.append(x)
        return tuple(outs)


@register_model()
class PRepBNPVT(BackbonePreset, ReparamPVT):
    """PVT v1 with every LayerNorm replaced by progressive PRepBN (SLAB).

    Default ``norm_cfg``: ``dict(type='PRepBN', step=300000)``, the authors' ImageNet decay
    (``base.SLAB_NORM_CFG``); fine-tuning configs pass their own ``step``.
    """

    preset = dict(norm_cfg=SLAB_NORM_CFG)


@register_model()
class SLABPVT(BackbonePreset, ReparamPVT):
    """SLAB-PVT: PRepBN everywhere and global SLA (no spatial reduction) in all four stages,
    as in the SLAB authors' released SLAB-PVT models (their ``ATTN_TYPE: LLLL``).

    Default ``norm_cfg``: ``dict(type='PRepBN', step=300000)``, the authors' ImageNet decay
    (``base.SLAB_NORM_CFG``); fine-tuning configs pass their own ``step``.
    """

    preset = dict(norm_cfg=SLAB_NORM_CFG, attn_types=('sla', ) * 4)
