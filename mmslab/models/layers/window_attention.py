"""Window multi-head self-attention with relative position bias (Swin), on PyTorch's fused
attention; parameter names as mmdet's ``WindowMSA``, so mmdet Swin weights load."""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model.weight_init import trunc_normal_
from mmengine.utils import to_2tuple
from torch import Tensor

from mmslab.registry import register_model
from .affine import fold_affine_into_next_linear
from .reparameterizable import Reparameterizable


def relative_position_index(window_size: Tuple[int, int]) -> Tensor:
    """``[Wh*Ww, Wh*Ww]`` index into a ``[(2Wh-1)*(2Ww-1), heads]`` relative-position table."""
    wh, ww = window_size
    coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing='ij'))
    coords = coords.flatten(1)  # [2, N]
    rel = coords[:, :, None] - coords[:, None, :]  # [2, N, N]
    return (rel[0] + wh - 1) * (2 * ww - 1) + (rel[1] + ww - 1)


class WindowKernelBase(nn.Module):
    """A window attention kernel: ``qkv`` and ``proj`` Linears around :meth:`attend`, which
    :class:`~mmslab.models.layers.shift_window.ShiftWindowAttention` calls on the windows.

    Class attributes: ``uses_shift_mask``, which every kernel sets (a shifted block refuses
    one that does not): True, :meth:`attend` applies the shift mask it is given (keeps apart
    the tokens the cyclic shift brought together, as Swin); False, it is given none and its
    windows attend across the shift's seams (SLA and BiNorm, as the SLAB authors' models).
    ``masks_padding`` (padded tokens take no part: their ``V`` is zero and ``valid`` marks
    them; otherwise they are zero normalized tokens, as in mmdet's Swin) and
    ``softmax_options`` (the constructor takes ``qk_scale`` and ``attn_drop``).

    Buffer ``qkv_pad`` (``[3C]``): :meth:`padded_qkv` once the block's norm is folded into
    ``qkv``, which then no longer maps a zero token to it.
    """

    uses_shift_mask: Optional[bool] = None  # see the class docstring: each kernel says
    masks_padding = False
    #: (``masks_padding``) the key of a padded slot, whose ``q`` and ``V`` are zero
    padded_key = 0.0
    softmax_options = False

    def __init__(self, embed_dims: int, num_heads: int, window_size, qkv_bias: bool = True,
                 proj_drop: float = 0.0):
        super().__init__()
        if embed_dims % num_heads:
            raise ValueError(f'embed_dims {embed_dims} is not divisible by num_heads {num_heads}')
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.head_dims = embed_dims // num_heads
        self.window_size = tuple(to_2tuple(window_size))
        self.qkv = nn.Linear(embed_dims, embed_dims * 3, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop)
        self.register_buffer('qkv_pad', None)  # see the class docstring
        self._masked_slot: Optional[Tensor] = None  # padded_qkv() of masks_padding, kept

    def attend(self, qkv, window_hw: Tuple[int, int], shift_mask=None,
               valid: Optional[Tensor] = None, origin: Tuple[int, int] = (0, 0)) -> Tensor:
        """``qkv`` ``[B', N, 3C]`` (or its three ``[B', N, C]`` parts) of windows of
        ``window_hw`` -> ``[B', N, C]`` before ``proj``. ``shift_mask``:
        :class:`~mmslab.models.layers.shift_mask.ShiftMaskByType` (``uses_shift_mask``);
        ``valid`` ``[nW, N]``: each window's unpadded slots, repeated over the images
        (``masks_padding``; None: all); ``origin``: a cropped span's offset in its window.
        """
        raise NotImplementedError

    def padded_qkv(self) -> Tensor:
        """``[3C]``: a padded slot after ``qkv``: a zero token's (the unfolded bias); for
        kernels that mask padding, values that take no part in :meth:`attend` (zero ``q``
        and ``V``, :attr:`padded_key`), so padded windows carry no ``valid`` mask."""
        if self.qkv_pad is not None:
            return self.qkv_pad
        weight = self.qkv.weight
        if self.masks_padding:  # a constant: built once per device and dtype
            slot = self._masked_slot
            if slot is None or (slot.device, slot.dtype) != (weight.device, weight.dtype):
                with torch.inference_mode(False):  # usable in training afterwards
                    slot = torch.zeros(3, self.embed_dims, device=weight.device,
                                       dtype=weight.dtype)
                    slot[1] = self.padded_key
                self._masked_slot = slot = slot.view(-1)
            return slot
        if self.qkv.bias is None:
            return weight.new_zeros(self.qkv.out_features)
        return self.qkv.bias

    def expect_folded_input_norm(self) -> None:
        """Make room for a fused checkpoint's ``qkv_pad`` (``deploy=True``)."""
        if not self.masks_padding:
            self.qkv_pad = self.qkv.weight.new_zeros(self.qkv.out_features)

    @torch.no_grad()
    def absorb_input_affine(self, scale: Tensor, shift: Tensor) -> None:
        """Fold the preceding norm's ``x * scale + shift`` into ``qkv``."""
        if not self.masks_padding:  # what a zero normalized token gave before the fold
            self.qkv_pad = self.padded_qkv().detach().clone()
        self.qkv = fold_affine_into_next_linear(self.qkv, scale, shift)


@register_model()
class WindowMSA(Reparameterizable, WindowKernelBase):
    """Softmax attention in a window with a learned relative position bias (Swin).

    In deploy mode the bias table is gathered once into a ``[heads, N, N]`` buffer.

    Args:
        embed_dims (int): The feature dimension.
        num_heads (int): Parallel attention heads.
        window_size (int | tuple[int, int]): The window (height, width).
        qkv_bias (bool): Bias in the q, k, v projection. Default: True.
        qk_scale (float, optional): Scale of ``q k^T``. Default: None (``head_dims ** -0.5``).
        attn_drop (float): Dropout rate of the attention weights. Default: 0.0.
        proj_drop (float): Dropout rate after the output projection. Default: 0.0.
        deploy (bool): Build the fused structure: the gathered ``[heads, N, N]`` bias
            buffer instead of the bias table and index (see :func:`mmslab.reparameterize`).
            Default: False.
    """

    uses_shift_mask = True
    softmax_options = True
    needs_eval_mode = False  # the gathered bias is the same in both modes

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

    def _switch_to_deploy(self) -> None:
        bias = self.position_bias().detach().clone()
        del self.relative_position_bias_table
        del self.relative_position_index
        self.register_buffer('relative_position_bias', bias)

    def attention_bias(self, shift_mask, dtype: torch.dtype) -> Tensor:
        """``[1 | nW, heads, N, N]``: the position bias (+ each window's shift mask, in one
        gather of the bias of each window kind)."""
        bias = self.position_bias().to(dtype).unsqueeze(0)
        if shift_mask is None:
            return bias
        return shift_mask.gather(bias + shift_mask.table.to(dtype).unsqueeze(1))

    def _attn_mask(self, shift_mask, bw: int, dtype: torch.dtype) -> Tensor:
        """``[B*nW, heads, N, N]`` additive mask, built per call and kept by no one (a mask
        per input size grows with every size evaluated): unshifted a broadcast view of the
        position bias, shifted each window's by kind in one gather, copied over the batch
        only where it has more than one image."""
        bias = self.attention_bias(shift_mask, dtype)
        n = bias.shape[-1]
        return bias.unsqueeze(0).expand(bw // bias.shape[0], -1, -1, -1, -1).reshape(
            bw, self.num_heads, n, n)

    def attend(self, qkv: Tensor, window_hw: Tuple[int, int], shift_mask=None,
               valid: Optional[Tensor] = None, origin: Tuple[int, int] = (0, 0)) -> Tensor:
        """``softmax(q k^T * scale + B (+ M)) v`` per head (Swin, eq. 4), on PyTorch's fused
        attention."""
        if tuple(window_hw) != self.window_size:
            raise ValueError(f'WindowMSA with window {self.window_size} got windows {window_hw}')
        n = window_hw[0] * window_hw[1]
        q, k, v = qkv.reshape(-1, n, 3, self.num_heads, self.head_dims).permute(
            2, 0, 3, 1, 4).unbind(0)
        mask = self._attn_mask(shift_mask, q.shape[0], q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                             dropout_p=self.attn_drop if self.training else 0.)
        return out.transpose(1, 2).reshape(-1, n, self.embed_dims)
