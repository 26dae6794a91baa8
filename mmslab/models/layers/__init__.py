from .affine import (FoldableNorm, fold_affine_into_next_conv, fold_affine_into_next_linear,
                     fold_affine_into_prev, fold_affine_into_weight)
from .ffn import ChannelIdleFFN, SwinFFN
from .linear_attention import SLA, BiNormAttention
from .norm import NORM_TYPES, build_norm, is_foldable_norm
from .patch import PatchEmbed, PatchMerging
from .repbn import PRepBN, RepBN
from .shift_window import ATTENTION_TYPES, ShiftWindowAttention
from .token_bn import TokenBN
from .unified_norm import UN
from .window_attention import WindowMSA

__all__ = [
    'FoldableNorm', 'fold_affine_into_next_conv', 'fold_affine_into_weight',
    'fold_affine_into_next_linear', 'fold_affine_into_prev', 'ChannelIdleFFN', 'SwinFFN', 'SLA',
    'BiNormAttention', 'NORM_TYPES', 'build_norm', 'is_foldable_norm', 'PatchEmbed',
    'PatchMerging', 'PRepBN', 'RepBN', 'ATTENTION_TYPES', 'ShiftWindowAttention', 'TokenBN',
    'UN', 'WindowMSA'
]
