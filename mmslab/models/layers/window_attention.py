"""Window multi-head self-attention with relative position bias (Swin), on fused SDPA.

Parameter names follow mmdet's ``WindowMSA`` (``qkv``, ``proj``,
``relative_position_bias_table``, ``relative_position_index``) so mmdet Swin weights load.
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model.weight_init import trunc_normal_
from torch import Tensor

from mmslab.registry import register_model


def relative_position_index(window_size: Tuple[int, int]) -> Tensor:
    """``[Wh*Ww, Wh*Ww]`` index into a ``[(2Wh-1)*(2Ww-1), heads]`` relative-position table."""
    wh, ww = window_size
    coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing='ij'))
    coords = coords.flatten(1)  # [2, N]
    rel = coords[:, :, None] - coords[:, None, :]  # [2, N, N]
    return (rel[0] + wh - 1) * (2 * ww - 1) + (rel[1] + ww - 1)


class WindowKernelBase(nn.Module):
    """Common interface of the attention computed inside windows.

    The surrounding :class:`ShiftWindowAttention` applies ``qkv`` to unpadded tokens, pads,
    shifts and partitions, calls :meth:`attend` on ``[B*nW, N, 3C]`` windows and applies
    ``proj`` to the unpadded result.

    Class attributes: ``uses_shift_mask`` (mask the cyclic-shift seams, Swin style) and
    ``masks_padding`` (padded tokens are excluded from the attention; otherwise they take the
    value a zero token has after ``qkv``, as in mmdet's Swin).
    """

    uses_shift_mask = True
    masks_padding = False

    def __init__(self, embed_dims: int, num_heads: int, window_size, qkv_bias: bool = True,
                 proj_drop: float = 0.0):
        super().__init__()
        if embed_dims % num_heads:
            raise ValueError(f'embed_dims {embed_dims} is not divisible by num_heads {num_heads}')
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.head_dims = embed_dims // num_heads
        self.window_size = tuple(window_size) if isinstance(window_size, (tuple, list)) else (
            int(window_size), int(window_size))
        self.qkv = nn.Linear(embed_dims, embed_dims * 3, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop)

    def pad_value(self) -> Optional[Tensor]:
        """``[3C]`` value of a padded token after ``qkv`` (None means zeros)."""
        if self.masks_padding:
            return None
        # After a norm is folded into qkv, qkv_pad keeps the pre-fold bias.
        return getattr(self, 'qkv_pad', self.qkv.bias)

    def attend(self, qkv: Tensor, num_windows: int, window_hw: Tuple[int, int],
               shift_mask: Optional[Tensor] = None, valid: Optional[Tensor] = None,
               cache_key=None) -> Tensor:
        """``[B*nW, N, 3C]`` -> ``[B*nW, N, C]`` or ``[B*nW, N, heads, C/heads]`` (before
        ``proj``; the 4-D form may be a strided view).

        ``cache_key`` identifies the padded layout (constant masks may be cached under it).
        """
        raise NotImplementedError


@register_model()
class WindowMSA(WindowKernelBase):
    """Softmax attention in a window with a learned relative position bias (Swin).

    In deploy mode the bias table is gathered once into a ``[heads, N, N]`` buffer and masked
    biases are cached per padded input size, so a forward pass does no index gathering.
    """

    def __init__(self, embed_dims: int, num_heads: int, window_size, qkv_bias: bool = True,
                 qk_scale: Optional[float] = None, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, deploy: bool = False):
        super().__init__(embed_dims, num_heads, window_size, qkv_bias, proj_drop)
        self.scale = qk_scale or self.head_dims ** -0.5
        self.attn_drop = attn_drop
        self.deploy = deploy
        wh, ww = self.window_size
        if deploy:
            self.register_buffer('relative_position_bias',
                                 torch.zeros(num_heads, wh * ww, wh * ww))
        else:
            self.relative_position_bias_table = nn.Parameter(
                torch.zeros((2 * wh - 1) * (2 * ww - 1), num_heads))
            self.register_buffer('relative_position_index', relative_position_index((wh, ww)))
        self._mask_cache = {}

    def init_weights(self) -> None:
        if not self.deploy:
            trunc_normal_(self.relative_position_bias_table, std=0.02)

    def position_bias(self) -> Tensor:
        """``[heads, N, N]`` relative position bias."""
        if self.deploy:
            return self.relative_position_bias
        n = self.window_size[0] * self.window_size[1]
        table = self.relative_position_bias_table
        return table[self.relative_position_index.view(-1)].view(n, n, -1).permute(2, 0, 1)

    @torch.no_grad()
    def switch_to_deploy(self) -> None:
        if self.deploy:
            return
        bias = self.position_bias().detach().clone()
        del self.relative_position_bias_table
        del self.relative_position_index
        self.register_buffer('relative_position_bias', bias)
        self._mask_cache = {}
        self.deploy = True

    def _attn_mask(self, shift_mask: Optional[Tensor], bw: int, num_windows: int,
                   dtype: torch.dtype, cache_key=None) -> Tensor:
        """``[B*nW, heads, N, N]`` additive mask: position bias (+ shift mask).

        A materialized contiguous 4-D mask keeps PyTorch's fused CPU attention kernel (a 3-D
        or broadcast 5-D mask falls back to the slow math path). In deploy mode the mask is
        a constant and cached per batch and padded size.
        """
        key = None
        if self.deploy and (cache_key is not None or shift_mask is None):
            key = (bw, num_windows, cache_key, dtype)
            mask = self._mask_cache.get(key)
            if mask is not None:
                return mask
        bias = self.position_bias().to(dtype)
        n = bias.shape[-1]
        if shift_mask is None:
            mask = bias.unsqueeze(0).expand(bw, -1, -1, -1)
        else:
            mask = (bias.unsqueeze(0) + shift_mask.to(dtype).unsqueeze(1))  # [nW, h, N, N]
            mask = mask.unsqueeze(0).expand(bw // num_windows, -1, -1, -1, -1).reshape(
                bw, self.num_heads, n, n)
        if key is not None:
            if len(self._mask_cache) > 8:
                self._mask_cache.clear()
            mask = mask.contiguous()
            self._mask_cache[key] = mask
        return mask

    def attend(self, qkv: Tensor, num_windows: int, window_hw: Tuple[int, int],
               shift_mask: Optional[Tensor] = None, valid: Optional[Tensor] = None,
               cache_key=None) -> Tensor:
        bw, n, _ = qkv.shape
        if window_hw != self.window_size:
            raise ValueError(f'WindowMSA with window {self.window_size} got windows {window_hw}')
        q, k, v = qkv.view(bw, n, 3, self.num_heads, self.head_dims).permute(2, 0, 3, 1, 4)
        mask = self._attn_mask(shift_mask, bw, num_windows, q.dtype, cache_key)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.attn_drop if self.training else 0.0,
            scale=self.scale)
        return out.transpose(1, 2)  # [B', N, heads, d] view; the caller gathers it
