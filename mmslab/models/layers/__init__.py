from .affine import (FoldableNorm, fold_affine_into_next_conv, fold_affine_into_next_linear,
                     fold_affine_into_prev, fold_affine_into_weight)
from .builder import (build_norm, build_window_attention, check_norm_cfg, get_ffn,
                      get_norm_layer, get_window_attention, is_foldable_norm, layer_class)
from .reparameterizable import Reparameterizable, deploy_children
from .ffn import BlockFFN, ChannelIdleFFN, SwinFFN
from .linear_attention import SLA, BiNormAttention
from .patch import PatchEmbed, PatchMerging
from .repbn import PRepBN, RepBN
from .shift_window import ShiftWindowAttention
from .token_bn import TokenBN
from .unified_norm import UN
from .window_attention import WindowKernelBase, WindowMSA

__all__ = [
    'FoldableNorm', 'fold_affine_into_next_conv', 'fold_affine_into_weight',
    'fold_affine_into_next_linear', 'fold_affine_into_prev', 'build_norm',
    'build_window_attention', 'check_norm_cfg', 'get_ffn', 'get_norm_layer',
    'get_window_attention', 'is_foldable_norm', 'layer_class', 'Reparameterizable',
    'deploy_children',
    'BlockFFN', 'ChannelIdleFFN', 'SwinFFN', 'SLA', 'BiNormAttention', 'PatchEmbed',
    'PatchMerging', 'PRepBN', 'RepBN', 'ShiftWindowAttention', 'TokenBN', 'UN',
    'WindowKernelBase', 'WindowMSA'
]
