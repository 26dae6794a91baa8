"""One configurable Swin Transformer with pluggable norm, attention and FFN.

With LayerNorm, window attention and the MLP it computes what mmdet's ``SwinTransformer``
computes (same parameter names, same outputs; mmdet's keyword arguments mean the same, with
the differences listed in :class:`ReparamSwinTransformer`); PRepBN-Swin, SLAB-Swin and
RePa-Swin are presets.
"""
import copy
from typing import Optional, Sequence, Tuple

import torch
import torch.nn as nn
from mmcv.cnn.bricks.drop import DropPath
from mmengine.model import BaseModule
from mmengine.model.weight_init import constant_init, trunc_normal_init
from torch import Tensor

from mmslab.registry import register_model
from ..layers.activation_checkpoint import checkpoint_block
from ..layers.affine import FoldableNorm
from ..layers.builder import (build_norm, check_norm_cfg, get_ffn, get_window_attention,
                              is_foldable_norm, layer_class)
from ..layers.reparameterizable import Reparameterizable
from ..layers.patch import PatchEmbed, PatchMerging
from ..layers.shift_window import ShiftWindowAttention
from .base import (SLAB_NORM_CFG, BackbonePreset, ReparamBackboneMixin, check_bn_stats,
                   freeze_module, init_cfg_from_pretrained, per_stage)


class SwinBlock(Reparameterizable, nn.Module):
    """``x + DropPath(attn(norm1(x)))`` then the FFN with its residual.

    ``ffn_type='mlp'``: ``x + DropPath(ffn(norm2(x)))``. An FFN that ``includes_residual``
    (``'channel_idle'``, RePaFormer) carries its own BatchNorms and residual, so there is no
    ``norm2``. In deploy form ``norm1`` lives in the attention's qkv and ``norm2`` in the FFN's
    fc1.

    Names (kept from mmdet's and the authors' checkpoints, so keys nest): ``norm1`` is the
    pre-norm of the attention, ``norm2`` the pre-norm of the FFN. Inside a PRepBN pre-norm,
    ``norm1`` is its LayerNorm branch and ``norm2`` its RepBN branch, so
    ``blocks.0.norm1.norm2.bn.running_mean`` is the BN statistic of the attention pre-norm's
    RepBN branch; inside the channel-idle FFN (``ffn.norm1``, ``ffn.norm2``) they are its two
    BatchNorms.

    Shape: ``[B, H*W, C]`` -> ``[B, H*W, C]``.
    """

    def __init__(self, embed_dims: int, num_heads: int, feedforward_channels: int,
                 window_size: int = 7, shift: bool = False, attn_type: str = 'window',
                 ffn_type: str = 'mlp', idle_ratio: float = 0.75, qkv_bias: bool = True,
                 qk_scale=None, drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
                 drop_path_rate: float = 0.0, act_cfg: Optional[dict] = None,
                 norm_cfg: Optional[dict] = None, with_cp: bool = False, deploy: bool = False):
        super().__init__()
        norm_cfg = norm_cfg or dict(type='LN')
        ffn_cls = get_ffn(ffn_type)
        self.with_cp = with_cp
        self.ffn_type = ffn_type
        self.deploy = deploy
        fold = deploy and is_foldable_norm(norm_cfg)
        self.norm1 = nn.Identity() if fold else build_norm(norm_cfg, embed_dims, deploy=deploy)
        self.attn = ShiftWindowAttention(
            embed_dims, num_heads, window_size, shift=shift, attn_type=attn_type,
            qkv_bias=qkv_bias or fold, qk_scale=qk_scale, attn_drop=attn_drop_rate,
            proj_drop=drop_rate, deploy=deploy)
        if fold:
            self.attn.w_msa.expect_folded_input_norm()
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0 else nn.Identity()
        if layer_class(ffn_cls).includes_residual:
            self.norm2 = None  # the FFN normalizes its own input
            self.ffn = ffn_cls(embed_dims, feedforward_channels, idle_ratio, act_cfg,
                               drop_rate, drop_path_rate, deploy=deploy)
        else:
            self.norm2 = nn.Identity() if fold else build_norm(norm_cfg, embed_dims,
                                                               deploy=deploy)
            self.ffn = ffn_cls(embed_dims, feedforward_channels, act_cfg, drop_rate)

    def _forward(self, x: Tensor, hw_shape: Tuple[int, int]) -> Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), hw_shape))
        if self.ffn.includes_residual:
            return self.ffn(x)
        return x + self.drop_path(self.ffn(self.norm2(x)))

    def forward(self, x: Tensor, hw_shape: Tuple[int, int]) -> Tensor:
        if self.with_cp and x.requires_grad and self.training:
            return checkpoint_block(self, self._forward, x, hw_shape)
        return self._forward(x, hw_shape)

    def _switch_to_deploy(self) -> None:
        kernel = self.attn.w_msa
        if isinstance(self.norm1, FoldableNorm):
            kernel.absorb_input_affine(*self.norm1.fused_affine())
            self.norm1 = nn.Identity()
        if isinstance(self.norm2, FoldableNorm):
            self.ffn.absorb_input_affine(*self.norm2.fused_affine())
            self.norm2 = nn.Identity()
        for m in (kernel, self.ffn):
            if hasattr(m, 'switch_to_deploy'):
                m.switch_to_deploy()


class SwinStage(nn.Module):
    """Blocks of one stage (shift on odd blocks), then optional patch merging.

    ``deploy`` is handed to the blocks and the patch merging; the stage has nothing of its
    own to fuse, so it has no switch (``deploy_children`` reaches its children)."""

    def __init__(self, depth: int, downsample_channels: Optional[int], block_kwargs: dict,
                 drop_path_rates: Sequence[float], norm_cfg: dict, deploy: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([
            SwinBlock(shift=i % 2 == 1, drop_path_rate=drop_path_rates[i], norm_cfg=norm_cfg,
                      deploy=deploy, **block_kwargs) for i in range(depth)])
        self.downsample = None if downsample_channels is None else PatchMerging(
            block_kwargs['embed_dims'], downsample_channels, norm_cfg=norm_cfg, deploy=deploy)

    def forward(self, x: Tensor, hw_shape: Tuple[int, int]):
        for block in self.blocks:
            x = block(x, hw_shape)
        if self.downsample is None:
            return x, hw_shape, x, hw_shape
        x_down, down_hw = self.downsample(x, hw_shape)
        return x_down, down_hw, x, hw_shape


@register_model()
class ReparamSwinTransformer(ReparamBackboneMixin, BaseModule):
    """Swin Transformer with pluggable normalization, attention and FFN per stage.

    Keyword arguments mean what they mean in mmdet's ``SwinTransformer``, except that
    ``arch`` comes first (mmdet's first positional argument is ``pretrain_img_size``: pass
    arguments by keyword), ``use_abs_pos_embed=True`` raises (no Swin detector uses it), and
    ``pretrain_img_size`` / ``convert_weights`` are accepted and ignored.

    Args:
        arch (str): ``'tiny'``, ``'small'`` or ``'base'``: defaults for ``embed_dims``,
            ``depths`` and ``num_heads`` (each overridable). Default: 'tiny'.
        pretrain_img_size (int | tuple[int, int]): Accepted for mmdet configs and ignored
            (no absolute position embedding). Default: 224.
        in_channels (int): The number of input channels. Default: 3.
        embed_dims (int, optional): The feature dimension of the first stage.
            Default: None (``arch``'s).
        patch_size (int): The patch size of the patch embedding. Default: 4.
        window_size (int | Sequence[int]): The window size, or one per stage. Default: 7.
        mlp_ratio (float): The FFN's hidden dimension over ``embed_dims``. Default: 4.
        depths (Sequence[int], optional): Blocks per stage. Default: None (``arch``'s).
        num_heads (Sequence[int], optional): Attention heads per stage.
            Default: None (``arch``'s).
        strides (Sequence[int]): The patch embedding's stride, then the patch mergings'
            (2 each). Default: (4, 2, 2, 2).
        out_indices (Sequence[int]): The stages whose outputs are returned.
            Default: (0, 1, 2, 3).
        qkv_bias (bool): Bias in the q, k, v projections. Default: True.
        qk_scale (float, optional): Scale of ``q k^T`` in softmax window attention.
            Default: None (``head_dims ** -0.5``).
        patch_norm (bool): A norm after the patch embedding. Default: True.
        drop_rate (float): Dropout rate after the attention and in the FFNs. Default: 0.0.
        attn_drop_rate (float): Dropout rate of the softmax attention weights. Default: 0.0.
        drop_path_rate (float): Stochastic depth rate, rising linearly over the blocks to
            this value. Default: 0.1.
        use_abs_pos_embed (bool): Not supported: True raises (no Swin detector uses it).
            Default: False.
        act_cfg (dict, optional): The FFNs' activation. Default: None (GELU).
        norm_cfg (dict, optional): Every norm (patch embed, blocks, patch merging, outputs):
            ``LN``, ``RepBN``, ``PRepBN``, ``UN``, ``TokenBN`` or any registered norm
            (``layers/builder.py``). Default: None (``dict(type='LN')``).
        out_norm_cfg (dict, optional): The output norms. Default: None (``norm_cfg``).
        attn_types (str | Sequence[str]): Per stage, ``'window'``, ``'sla'``, ``'binorm'`` or
            a registered kernel. Default: ('window', 'window', 'window', 'window').
        ffn_type (str): ``'mlp'``, ``'channel_idle'`` (RePaFormer; BN inside the FFN) or a
            registered FFN. Default: 'mlp'.
        idle_ratio (float): Fraction of idle hidden channels of the channel-idle FFN.
            Default: 0.75.
        bn_stats (str): ``'train'`` updates BatchNorm running statistics while training;
            ``'frozen'`` keeps every BatchNorm-type layer (BN, RepBN's BN, channel-idle FFN BN,
            UN) of the body in eval mode, as the SLAB authors did when fine-tuning detectors
            with small per-GPU batches; their affine weights and ``alpha`` still train.
            Default: 'train'.
        out_bn_stats (str, optional): The same for the output norms ``norm{i}``; ``None``
            follows ``bn_stats``. ``'train'``: the output norms are new in detection and
            segmentation (classification checkpoints have none), so their statistics start at
            mean 0 / variance 1; frozen there, a BN-based output norm would never normalize
            and, once its LayerNorm share has decayed, would hand the neck raw stage outputs.
            Their statistics come from every token of the batch (thousands per image), so small
            per-GPU batches estimate them well; at deployment they fold like any other.
            Default: 'train'.
        with_cp (bool): Activation checkpointing of each block while training (less memory,
            slower). Default: False.
        pretrained (str, optional): Deprecated, as in mmdet: the same as
            ``init_cfg=dict(type='Pretrained', checkpoint=pretrained)``. Default: None.
        convert_weights (bool): Accepted for mmdet configs and ignored (every checkpoint
            layout is converted on loading). Default: False.
        frozen_stages (int): Stages to freeze (eval mode, no gradients): -1 none, 0 the patch
            embedding, i also stages 1..i. Default: -1.
        deploy (bool): Build the fused structure (see :func:`mmslab.reparameterize`).
            Default: False.
        folded_out_norms (Sequence[int]): (deploy only) output indices whose norm was folded
            into the detector's neck; written into deploy configs by
            ``tools/reparameterize.py``. Default: ().
        init_cfg (dict, optional): Initialization config; ``dict(type='Pretrained',
            checkpoint=..., prefix=...)`` loads a checkpoint of any supported layout.
            Default: None.

    Returns a tuple of NCHW maps for ``out_indices`` (strides 4, 8, 16, 32).
    """

    arch_zoo = {
        'tiny': dict(embed_dims=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)),
        'small': dict(embed_dims=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)),
        'base': dict(embed_dims=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)),
    }

    def __init__(self, arch: str = 'tiny', pretrain_img_size=224, in_channels: int = 3,
                 embed_dims: Optional[int] = None, patch_size: int = 4, window_size=7,
                 mlp_ratio: float = 4, depths: Optional[Sequence[int]] = None,
                 num_heads: Optional[Sequence[int]] = None, strides=(4, 2, 2, 2),
                 out_indices=(0, 1, 2, 3), qkv_bias: bool = True, qk_scale=None,
                 patch_norm: bool = True, drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
                 drop_path_rate: float = 0.1, use_abs_pos_embed: bool = False,
                 act_cfg: Optional[dict] = None, norm_cfg: Optional[dict] = None,
                 out_norm_cfg: Optional[dict] = None, attn_types=('window', ) * 4,
                 ffn_type: str = 'mlp', idle_ratio: float = 0.75, bn_stats: str = 'train',
                 out_bn_stats: Optional[str] = 'train',
                 with_cp: bool = False, pretrained=None, convert_weights: bool = False,
                 frozen_stages: int = -1, deploy: bool = False, folded_out_norms=(),
                 init_cfg=None):
        # pretrain_img_size and convert_weights are accepted so that configs written for
        # mmdet's SwinTransformer build unchanged; neither matters here: no absolute position
        # embedding depends on the image size, and every checkpoint layout is converted on
        # loading (see mmslab.models.converters).
        del pretrain_img_size, convert_weights
        if arch not in self.arch_zoo:
            raise ValueError(f'unknown arch {arch!r}; valid: {tuple(self.arch_zoo)}')
        super().__init__(init_cfg=init_cfg_from_pretrained(pretrained, init_cfg))
        preset = self.arch_zoo[arch]
        embed_dims = embed_dims or preset['embed_dims']
        depths = tuple(depths or preset['depths'])
        num_heads = tuple(num_heads or preset['num_heads'])
        num_stages = len(depths)
        if len(num_heads) != num_stages or len(strides) != num_stages:
            raise ValueError(f'depths {depths}, num_heads {num_heads} and strides {strides} '
                             'must have one entry per stage')
        window_sizes = per_stage(window_size, num_stages, 'window_size')
        attn_types = per_stage(attn_types, num_stages, 'attn_types')
        for t in attn_types:
            get_window_attention(t)
        check_bn_stats(bn_stats)
        if use_abs_pos_embed:
            raise ValueError('use_abs_pos_embed is not supported (Swin detectors do not use it)')
        if not all(0 <= i < num_stages for i in out_indices):
            raise ValueError(f'out_indices {out_indices} out of range for {num_stages} stages')
        if not -1 <= frozen_stages <= num_stages:
            raise ValueError(f'frozen_stages must be in [-1, {num_stages}] for {num_stages} '
                             f'stages (-1: none, 0: patch embedding, i: also stages 1..i), '
                             f'got {frozen_stages}')
        if strides[0] != patch_size:
            raise ValueError('the first stride must equal patch_size')
        if any(s != 2 for s in strides[1:]):
            raise ValueError('patch merging downsamples by 2: strides[1:] must be 2')
        self.norm_cfg = check_norm_cfg(copy.deepcopy(norm_cfg or dict(type='LN')))
        self.out_norm_cfg = check_norm_cfg(copy.deepcopy(out_norm_cfg or self.norm_cfg),
                                           'out_norm_cfg')
        self.arch, self.embed_dims, self.depths, self.num_heads = arch, embed_dims, depths, \
            num_heads
        self.window_sizes, self.attn_types = window_sizes, attn_types
        self.out_indices = tuple(out_indices)
        self.frozen_stages = frozen_stages
        self.bn_stats = bn_stats
        self.out_bn_stats = None if out_bn_stats is None else check_bn_stats(out_bn_stats)
        self.deploy = deploy

        self.patch_embed = PatchEmbed(in_channels, embed_dims, patch_size, strides[0],
                                      self.norm_cfg if patch_norm else None, deploy=deploy)
        self.drop_after_pos = nn.Dropout(drop_rate)
        block_kwargs = dict(
            mlp_ratio=mlp_ratio, ffn_type=ffn_type, idle_ratio=idle_ratio, qkv_bias=qkv_bias,
            qk_scale=qk_scale, drop_rate=drop_rate, attn_drop_rate=attn_drop_rate,
            act_cfg=act_cfg, with_cp=with_cp)
        self._build_stages(block_kwargs, drop_path_rate)
        self._build_out_norms(folded_out_norms)

    def _build_stages(self, block_kwargs: dict, drop_path_rate: float) -> None:
        """``stages`` (blocks + patch merging) and ``num_features``, the width per stage."""
        depths = self.depths
        mlp_ratio = block_kwargs.pop('mlp_ratio')
        dpr = torch.linspace(0, drop_path_rate, sum(depths)).tolist()
        self.stages = nn.ModuleList()
        self.num_features = []
        in_ch = self.embed_dims
        for i, depth in enumerate(depths):
            out_ch = in_ch * 2 if i < len(depths) - 1 else None
            stage_kwargs = dict(
                block_kwargs, embed_dims=in_ch, num_heads=self.num_heads[i],
                feedforward_channels=int(mlp_ratio * in_ch), window_size=self.window_sizes[i],
                attn_type=self.attn_types[i])
            self.stages.append(SwinStage(depth, out_ch, stage_kwargs,
                                         dpr[sum(depths[:i]):sum(depths[:i + 1])],
                                         self.norm_cfg, deploy=self.deploy))
            self.num_features.append(in_ch)
            in_ch = out_ch or in_ch

    def _build_out_norms(self, folded_out_norms) -> None:
        """``norm{i}`` for every output; ``folded_out_norms``: those that
        :func:`mmslab.reparameterize` folded into the neck's lateral convs (Identity here)."""
        self.folded_out_norms = tuple(folded_out_norms)
        if self.folded_out_norms and not self.deploy:
            raise ValueError('folded_out_norms is only meaningful with deploy=True')
        for i in self.out_indices:
            norm = nn.Identity() if i in self.folded_out_norms else build_norm(
                self.out_norm_cfg, self.num_features[i], deploy=self.deploy,
                what='out_norm_cfg')
            self.add_module(f'norm{i}', norm)

    def output_affines(self):
        """Output position -> attribute name of its deployed per-channel output affine (what
        :func:`mmslab.reparameterize` may fold into a neck)."""
        return {pos: f'norm{i}' for pos, i in enumerate(self.out_indices)
                if isinstance(getattr(self, f'norm{i}'), FoldableNorm)
                and getattr(self, f'norm{i}').deploy}

    # -- training-mode policy -------------------------------------------------------------
    def train(self, mode: bool = True):
        super().train(mode)
        self._freeze_stages()
        self._apply_bn_stats_policy(mode)
        return self

    def _freeze_stages(self) -> None:
        if self.frozen_stages >= 0:
            freeze_module(self.patch_embed)
        for i in range(1, self.frozen_stages + 1):
            if (i - 1) in self.out_indices:
                freeze_module(getattr(self, f'norm{i - 1}'))
            freeze_module(self.stages[i - 1])

    def _output_norms(self):
        return [getattr(self, f'norm{i}') for i in self.out_indices]

    # -- weights --------------------------------------------------------------------------
    def _init_default(self, m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            trunc_normal_init(m, std=.02, bias=0.)
        elif isinstance(m, nn.LayerNorm):
            constant_init(m, val=1.0, bias=0.)

    # -- forward --------------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        x, hw_shape = self.patch_embed(x)
        x = self.drop_after_pos(x)
        outs = []
        for i, stage in enumerate(self.stages):
            x, hw_shape, out, out_hw = stage(x, hw_shape)
            if i in self.out_indices:
                out = getattr(self, f'norm{i}')(out)
                outs.append(out.view(-1, *out_hw, self.num_features[i]).permute(0, 3, 1, 2)
                            .contiguous())
        return tuple(outs)


@register_model()
class PRepBNSwin(BackbonePreset, ReparamSwinTransformer):
    """Swin with every LayerNorm replaced by progressive PRepBN (the SLAB detection setting).

    Default ``norm_cfg``: ``dict(type='PRepBN', step=300000)``, the authors' ImageNet decay
    (``base.SLAB_NORM_CFG``); fine-tuning configs pass their own ``step``.
    """

    preset = dict(norm_cfg=SLAB_NORM_CFG)


@register_model()
class SLABSwin(BackbonePreset, ReparamSwinTransformer):
    """SLAB-Swin: PRepBN everywhere, SLA in stages 1-2 (windows 56 and 28, shifted on odd
    blocks), shifted-window softmax attention in stages 3-4 (window 7).

    Default ``norm_cfg``: ``dict(type='PRepBN', step=300000)``, the authors' ImageNet decay
    (``base.SLAB_NORM_CFG``); fine-tuning configs pass their own ``step``.
    """

    preset = dict(norm_cfg=SLAB_NORM_CFG, window_size=(56, 28, 7, 7),
                  attn_types=('sla', 'sla', 'window', 'window'))


@register_model()
class RePaSwin(BackbonePreset, ReparamSwinTransformer):
    """RePa-Swin: channel-idle FFN (BN inside, ``idle_ratio`` 0.75) with LayerNorm before
    attention, as in the authors' model. Pass ``norm_cfg=dict(type='PRepBN', ...)`` for the
    fully fusable variant."""

    preset = dict(ffn_type='channel_idle', idle_ratio=0.75, norm_cfg=dict(type='LN'))
