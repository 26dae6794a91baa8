"""Linear window attentions: simplified linear attention (SLA) and BiNorm.

Both compute ``K^T V`` first (linear in the tokens per window) and exclude padded tokens
exactly (``masks_padding``): a padded slot's ``V`` is zero, so it adds nothing to ``K^T V``
or SLA's DWC; only SLA's normalizer sees its key, which in a padded window is ``-inf``
(:attr:`SLA.padded_key`: ``relu`` zeroes it) and in a cropped one is masked (``valid``); no
padded slot's output is read.
Neither has a structure to fuse (the block folds its norm into ``qkv``): their
``switch_to_deploy()`` is a no-op, kept so that every module taking ``deploy`` has it.
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model.weight_init import trunc_normal_
from torch import Tensor

from mmslab.registry import register_model
from .reparameterizable import Reparameterizable
from .symbolic import is_traced
from .window_attention import WindowKernelBase


def key_sum(k: Tensor, valid: Optional[Tensor], out: Optional[Tensor] = None) -> Tensor:
    """``[B', heads, N, d]`` keys -> ``[B', heads, 1, d]`` (into ``out`` if given): their sum
    over the valid tokens (a padded key of a cropped window is ``relu(k + p)`` of a token's).
    A masked sum, not a product with the mask: OpenVINO then keeps ``K^T V`` of an INT8
    graph in int8."""
    if valid is None:
        return torch.sum(k, dim=-2, keepdim=True, out=out)
    nw, h, n, d = valid.shape[0], *k.shape[1:]
    keep = valid.to(k.dtype).view(nw, 1, n, 1)
    masked = k.reshape(-1, nw, h, n, d) * keep
    if out is None:
        return masked.sum(dim=-2, keepdim=True).reshape(-1, h, 1, d)
    return torch.sum(masked, dim=-2, keepdim=True, out=out.view(-1, nw, h, 1, d))


def kv_and_key_sum(k: Tensor, v: Tensor, valid: Optional[Tensor], inference: bool) -> Tensor:
    """``[S | z]`` ``[B', heads, d, d + 1]``: ``S = K^T V`` and the key sum ``z`` (see
    :func:`key_sum`) as its last column; in inference each written into its part of one
    tensor, with no concatenation."""
    if not inference:
        return torch.cat([k.transpose(-2, -1) @ v, key_sum(k, valid).transpose(-2, -1)],
                         dim=-1)
    bw, h, n, d = k.shape
    s_z = k.new_empty((bw, h, d, d + 1))
    torch.bmm(k.view(-1, n, d).transpose(1, 2), v.reshape(-1, n, d),
              out=s_z.view(-1, d, d + 1)[..., :d])
    key_sum(k, valid, out=s_z[..., d:].transpose(-2, -1))
    return s_z


def sla_dtype(q: Tensor) -> torch.dtype:
    """The dtype of SLA's sums: at least float32 (over a 56 x 56 window they pass fp16's
    65504), except in bf16 inference: bf16 has float32's range, accumulates in float32 and
    rounds as the control's bf16 attention and OpenVINO's bf16 graphs do."""
    if q.dtype == torch.bfloat16 and not torch.is_grad_enabled():
        return q.dtype
    return torch.promote_types(q.dtype, torch.float32)


def _inference_form() -> bool:
    """Whether SLA runs its inference form, the same sums in fewer kernels: without
    gradients and outside a trace (it writes through ``out=``, which autograd and the ONNX
    exporter do not take, and uses ``addcdiv``, which the exporter lacks)."""
    return not torch.is_grad_enabled() and not torch.jit.is_tracing() and \
        not torch.compiler.is_compiling()


def _split_heads(t: Tensor, num_heads: int) -> Tensor:
    """``[B, N, C]`` -> ``[B, heads, N, C/heads]``."""
    b, n, c = t.shape
    return t.view(b, n, num_heads, c // num_heads).transpose(1, 2)


@register_model()
class SLA(Reparameterizable, WindowKernelBase):
    """Simplified linear attention (SLAB, eq. 9) inside windows.

    Per head ``O_i = relu(q_i) S / (relu(q_i) z + 1e-6) + DWC(V)_i`` with
    ``S = sum_j relu(k_j + p_j)^T v_j`` and ``z = sum_j relu(k_j + p_j)``; ``p`` is a learned
    positional encoding on K (``[1, window_tokens, C]``) and DWC a depth-wise conv over the
    head channels of V on the window grid, shared by all heads. No softmax, scale or shift
    mask; computed in :func:`sla_dtype` even under autocast.

    Args:
        embed_dims (int): The feature dimension.
        num_heads (int): Parallel attention heads.
        window_size (int | tuple[int, int]): The window (height, width) the positional
            encoding is learned for.
        qkv_bias (bool): Bias in the q, k, v projection. Default: True.
        kernel_size (int): Kernel size of the depth-wise conv over V. Default: 5.
        proj_drop (float): Dropout rate after the output projection. Default: 0.0.
        resize_pos (bool): For global attention over a whole feature map (SLAB-PVT): the
            positional encoding is learned on the pre-training grid and bilinearly resized to
            any other grid, smaller or larger. False (windows): cropped to a window's span.
            Default: False.
        deploy (bool): The fused form; SLA has no structure to fuse, so both forms are the
            same. Default: False.
        **kwargs: ``qk_scale`` and ``attn_drop``, accepted at their neutral values only.
    """

    uses_shift_mask = False
    masks_padding = True
    #: ``relu(k + p)`` maps it to zero whatever ``p``: padded windows need no mask
    padded_key = float('-inf')
    needs_eval_mode = False
    eps = 1e-6

    def __init__(self, embed_dims: int, num_heads: int, window_size, qkv_bias: bool = True,
                 kernel_size: int = 5, proj_drop: float = 0.0, resize_pos: bool = False,
                 deploy: bool = False, **kwargs):
        _reject_unused(kwargs, 'SLA')
        super().__init__(embed_dims, num_heads, window_size, qkv_bias, proj_drop)
        self.deploy = deploy
        self.resize_pos = resize_pos
        self.dwc = nn.Conv2d(self.head_dims, self.head_dims, kernel_size,
                             padding=kernel_size // 2, groups=self.head_dims)
        wh, ww = self.window_size
        self.positional_encoding = nn.Parameter(torch.zeros(1, wh * ww, embed_dims))

    def init_weights(self) -> None:
        """The positional encoding as the authors' (truncated normal), the DWC as PyTorch's
        conv default (what the authors' Swin leaves it at), in any backbone."""
        trunc_normal_(self.positional_encoding, std=0.02)
        self.dwc.reset_parameters()

    def _switch_to_deploy(self) -> None:
        pass  # structure-free (see the module docstring)

    def _positional_encoding(self, window_hw, origin=(0, 0)) -> Tensor:
        """``[1, wh*ww, C]`` encoding of a ``window_hw`` span at ``origin`` of the window, or
        (``resize_pos``) of the whole map, bilinearly resized."""
        c = self.embed_dims
        wh, ww = window_hw
        pos = self.positional_encoding
        same = not any(map(is_traced, (wh, ww, *origin))) and (wh, ww) == self.window_size
        if same and (self.resize_pos or tuple(origin) == (0, 0)):
            return pos
        grid = pos.view(1, *self.window_size, c)
        if self.resize_pos:
            return F.interpolate(grid.permute(0, 3, 1, 2), size=(wh, ww), mode='bilinear',
                                 align_corners=False).flatten(2).transpose(1, 2)
        r0, c0 = origin
        return grid[:, r0:r0 + wh, c0:c0 + ww].reshape(1, -1, c)

    def attend(self, qkv, window_hw: Tuple[int, int], shift_mask=None,
               valid: Optional[Tensor] = None, origin: Tuple[int, int] = (0, 0)) -> Tensor:
        """Eq. 9 of the SLAB paper per head (see
        :meth:`~mmslab.models.layers.window_attention.WindowKernelBase.attend`). Without
        gradients (:func:`_inference_form`) the same sums take fewer kernels: writes through
        ``out=`` replace the copies and the concatenation."""
        inference = _inference_form()
        first = qkv if isinstance(qkv, Tensor) else qkv[0]
        in_dtype, dtype = first.dtype, sla_dtype(first)
        q, k, v = self._heads(qkv, self._positional_encoding(window_hw, origin), dtype,
                              inference)  # relu(q), relu(k + p), v: [B', h, N, d]
        bw, h, n, d = q.shape
        with torch.autocast(device_type=q.device.type, enabled=False):
            # numerator and normalizer from one product: q [S | z]
            num = q @ kv_and_key_sum(k, v, valid, inference)  # [B', h, N, d + 1]
            # the DWC on the heads' layout: [B'*h, d, wh, ww]
            dwc = self.value_conv(v.reshape(-1, *window_hw, d).permute(0, 3, 1, 2))
            dwc = dwc.permute(0, 2, 3, 1).reshape(bw, h, n, d)
            # (eps onto [B', h, N, 1]: runtimes broadcast a scalar onto a unit axis slowly)
            den = num[..., d:] + self.eps
            if not inference:
                out = dwc + num[..., :d] / den
                return _dense(out.transpose(1, 2), in_dtype).view(bw, n, h * d)
            out = q.new_empty((bw, n, h, d), dtype=in_dtype)  # written in token layout
            torch.addcdiv(dwc, num[..., :d], den, out=out.transpose(1, 2))
        return out.view(bw, n, h * d)

    def _heads(self, qkv, pos: Tensor, dtype: torch.dtype,
               inference: bool) -> Tuple[Tensor, Tensor, Tensor]:
        """``relu(q)``, ``relu(k + p)`` and ``v`` in the heads' layout ``[B', h, N, d]`` and in
        ``dtype``, from ``qkv`` ``[B', N, 3C]`` (one copy; in inference an add that puts
        ``p`` on the keys' slots and one ``relu`` of q and k) or its three parts."""
        h, d = self.num_heads, self.head_dims
        if not isinstance(qkv, Tensor):
            q, k, v = (_dense(_split_heads(t, h), dtype) for t in qkv)
        elif inference:
            bw, n = qkv.shape[:2]
            slots = F.pad(pos, (self.embed_dims, self.embed_dims)).view(1, n, 3, h, d)
            heads = qkv.new_empty((3, bw, h, n, d), dtype=dtype)
            torch.add(qkv.view(bw, n, 3, h, d).permute(2, 0, 3, 1, 4),
                      slots.permute(2, 0, 3, 1, 4), out=heads)
            heads[:2].relu_()
            return heads.unbind(0)
        else:
            bw, n = qkv.shape[:2]
            q, k, v = _dense(qkv.view(bw, n, 3, h, d).permute(2, 0, 3, 1, 4), dtype).unbind(0)
        with torch.autocast(device_type=q.device.type, enabled=False):
            return F.relu(q), F.relu(k + _split_heads(pos, h).to(dtype)), v

    def value_conv(self, v_map: Tensor) -> Tensor:
        """The DWC of each head, its weight shared: ``[B'*heads, d, wh, ww]`` -> same, in
        ``v_map``'s dtype."""
        dwc = self.dwc
        return F.conv2d(v_map, dwc.weight.to(v_map.dtype), _to(dwc.bias, v_map.dtype),
                        padding=dwc.padding, groups=self.head_dims)


@register_model()
class BiNormAttention(Reparameterizable, WindowKernelBase):
    """BiNorm attention (ViBid, eq. 5) inside windows.

    Per head ``O = L2norm_channels(Q) @ L2norm_keychannels(K^T V)``: ``K^T V`` first (linear
    in tokens), no softmax or scale; in float32 even under autocast (as SLA).

    Args:
        embed_dims (int): The feature dimension.
        num_heads (int): Parallel attention heads.
        window_size (int | tuple[int, int]): The window (height, width) it attends within.
        qkv_bias (bool): Bias in the q, k, v projection. Default: True.
        proj_drop (float): Dropout rate after the output projection. Default: 0.0.
        deploy (bool): The fused form; BiNorm has no structure to fuse, so both forms are the
            same. Default: False.
        **kwargs: ``qk_scale`` and ``attn_drop``, accepted at their neutral values only.
    """

    uses_shift_mask = False
    masks_padding = True
    needs_eval_mode = False
    eps = 1e-12

    def __init__(self, embed_dims: int, num_heads: int, window_size, qkv_bias: bool = True,
                 proj_drop: float = 0.0, deploy: bool = False, **kwargs):
        _reject_unused(kwargs, 'BiNormAttention')
        super().__init__(embed_dims, num_heads, window_size, qkv_bias, proj_drop)
        self.deploy = deploy

    def _switch_to_deploy(self) -> None:
        pass  # structure-free (see the module docstring)

    def attend(self, qkv, window_hw: Tuple[int, int], shift_mask=None,
               valid: Optional[Tensor] = None, origin: Tuple[int, int] = (0, 0)) -> Tensor:
        # position-free: ignores origin. K^T V over a 56 x 56 window overflows float16;
        # casts only where the dtype differs (fp32 graphs have none)
        parts = qkv.split(self.embed_dims, dim=-1) if isinstance(qkv, Tensor) else qkv
        in_dtype = parts[0].dtype
        dtype = torch.promote_types(in_dtype, torch.float32)
        low = in_dtype != dtype
        with torch.autocast(device_type=parts[0].device.type, enabled=False):
            q, k, v = (_split_heads(t.to(dtype) if low else t, self.num_heads) for t in parts)
            kv = F.normalize(k.transpose(-2, -1) @ v, dim=-2, eps=self.eps)  # key channels
            out = F.normalize(q, dim=-1, eps=self.eps) @ kv
        out = out.transpose(1, 2).reshape(out.shape[0], -1, self.embed_dims)
        return out.to(in_dtype) if low else out


def _to(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    return None if t is None else t.to(dtype)


def _dense(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype`` and contiguous: one copy (a cast with the layout change)."""
    if t.dtype == dtype:
        return t.contiguous()
    return t.to(dtype, memory_format=torch.contiguous_format)


def _reject_unused(kwargs: dict, name: str) -> None:
    allowed = {'qk_scale': None, 'attn_drop': 0.0}
    bad = {k: v for k, v in kwargs.items() if k not in allowed or v != allowed[k]}
    if bad:
        raise ValueError(f'{name} does not support {sorted(bad)} (softmax-attention options)')
