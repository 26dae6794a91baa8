"""Linear-complexity window attentions: simplified linear attention (SLA) and BiNorm.

Both compute ``K^T V`` first, so time and memory grow linearly with the tokens per window,
and both exclude padded tokens exactly (padding never changes the valid tokens' outputs):
``V`` is zero in padded slots (``masks_padding``, see
:class:`~mmslab.models.layers.window_attention.WindowKernelBase`), so they add nothing to
``K^T V`` or to SLA's DWC, only SLA's normalizer ``sum relu(k + p)`` needs the mask, and a
padded slot's output is never read back (its ``q`` and ``k`` may hold anything finite).

Neither has anything of its own to fuse: ``deploy`` only matters to the block, which folds
its norm into ``qkv`` (giving it a bias). Their ``switch_to_deploy()`` is therefore a no-op
that any mode allows, kept so that every module taking ``deploy`` has the switch.
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model.weight_init import trunc_normal_
from torch import Tensor

from mmslab.registry import register_model
from mmslab.utils.tensor_state import tensor_state
from .reparameterizable import Reparameterizable
from .export_mode import (compiling, exporting, linear_attention_form,
                          symbolic_shapes_enabled)
from .window_attention import WindowKernelBase


def _key_sum(k: Tensor, valid: Optional[Tensor]) -> Tensor:
    """``[B*nW, N, C]`` keys -> ``[B*nW, 1, C]``, their sum over the window's valid tokens
    (a padded slot's key is ``relu(0 + p)``, not 0, so padding needs the mask).

    A masked sum, not a ``[nW, 1, N] @ [B, nW, N, C]`` product with the valid mask: in an
    INT8 graph OpenVINO then runs ``K^T V`` on the quantized keys in int8; a second MatMul
    on the keys, with a float operand, made it dequantize them and run ``K^T V`` in fp32.
    """
    if valid is None:
        return k.sum(dim=-2, keepdim=True)
    nw, n, c = valid.shape[0], k.shape[-2], k.shape[-1]
    keep = valid.to(k.dtype).view(nw, n, 1)
    return (k.reshape(-1, nw, n, c) * keep).sum(dim=-2, keepdim=True).reshape(-1, 1, c)


_HEAD_MASKS = {}


def _head_masks(c: int, h: int, dtype, device) -> Tuple[Tensor, Tensor]:
    """``[C, C]`` ones where two channels belong to one of ``h`` heads, and ``[C, h]`` ones
    where a channel belongs to a head, in ``dtype``. Constants of ``(C, h)``: kept per
    dtype and device outside traced graphs (each is five small kernel launches to make)."""
    traced = exporting() or compiling()
    key = (c, h, dtype, device)
    if not traced and key in _HEAD_MASKS:
        return _HEAD_MASKS[key]
    # (plain tensors even when made in inference mode: training may use them later)
    with torch.inference_mode(False):
        head = torch.arange(c, device=device) // (c // h)
        masks = ((head.view(-1, 1) == head.view(1, -1)).to(dtype),
                 (head.view(-1, 1) == torch.arange(h, device=device)).to(dtype))
    if not traced:
        _HEAD_MASKS[key] = masks
    return masks


def sla_dtype(q: Tensor) -> torch.dtype:
    """What SLA's kernel sums compute in, given its ``q``: float32 (at least), except bf16
    inference, which stays in bf16. The sums over a 56 x 56 window pass fp16's 65504, but bf16
    has float32's range, its matmuls and sums accumulate in float32, and its rounding (2^-9)
    is what the control's bf16 attention and OpenVINO's bf16 graphs have; casting to float32
    and back cost SLAB-Swin-T's eager bf16 inference 10 % against the control. Training keeps
    float32 (its gradients sum over the same windows)."""
    if q.dtype == torch.bfloat16 and not torch.is_grad_enabled():
        return q.dtype
    return torch.promote_types(q.dtype, torch.float32)


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
    head channels of V on the window grid, shared by all heads. No softmax, no scale, no
    shift mask. Computed in float32 even under autocast (the kernel sums are large), except in
    bf16 inference (:func:`sla_dtype`).
    When a feature map fits inside one window the window shrinks to the map (the positional
    encoding is cropped), which is exact because padding is masked.

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
            any other grid, smaller or larger. False (windows): crop for smaller windows,
            resize only when the window is larger than the learned one. Default: False.
        deploy (bool): The fused form; SLA has no structure to fuse, so both forms are the
            same. Default: False.
        **kwargs: The softmax options ``qk_scale`` and ``attn_drop``, accepted only at their
            neutral values (None, 0.0) so that configs may pass them to every kernel.
    """

    uses_shift_mask = False
    masks_padding = True
    needs_eval_mode = False
    has_blockdiag_form = True
    has_token_major_form = True
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
        self._tiled_cache = None  # DWC weight, bias, versions, tiled: _tiled_dwc_params
        self._bias_cache = {}  # attend_windows' biases (_window_biases)

    def init_weights(self) -> None:
        trunc_normal_(self.positional_encoding, std=0.02)

    def _switch_to_deploy(self) -> None:
        pass  # structure-free (see the module docstring)

    def _positional_encoding(self, window_hw, origin=(0, 0)) -> Tensor:
        """``[1, wh*ww, C]`` encoding of a ``window_hw`` window (cropped or resized); a window
        cropped to a span of a larger one (``origin``: the span's first position) takes the
        encoding of its positions there."""
        c = self.embed_dims
        wh, ww = window_hw
        pos = self.positional_encoding
        if symbolic_shapes_enabled():  # window sizes are tensors: no Python comparison
            grid = pos.view(1, *self.window_size, c)
            if self.resize_pos:  # (a resize to the same grid is exact)
                return F.interpolate(grid.permute(0, 3, 1, 2), size=(wh, ww), mode='bilinear',
                                     align_corners=False).flatten(2).transpose(1, 2)
            # the window never exceeds the learned one there (see ShiftWindowAttention)
            r0, c0 = origin
            return grid[:, r0:r0 + wh, c0:c0 + ww].reshape(1, -1, c)
        if (wh, ww) == self.window_size:
            return pos
        grid = pos.view(1, *self.window_size, c)
        r0, c0 = origin
        if not self.resize_pos and r0 + wh <= self.window_size[0] and \
                c0 + ww <= self.window_size[1]:
            # A window cropped to a smaller feature map: positions keep their encoding.
            return grid[:, r0:r0 + wh, c0:c0 + ww].reshape(1, wh * ww, c)
        if origin != (0, 0):
            raise ValueError(f'a {window_hw} span at {origin} does not fit the '
                             f'{self.window_size} window')
        # global attention (PVT) or a larger window: resize the learned encoding
        return F.interpolate(grid.permute(0, 3, 1, 2), size=(wh, ww), mode='bilinear',
                             align_corners=False).flatten(2).transpose(1, 2)

    def attend(self, qkv, num_windows: int, window_hw: Tuple[int, int],
               shift_mask: Optional[Tensor] = None, valid: Optional[Tensor] = None,
               cache_key=None, origin: Tuple[int, int] = (0, 0)) -> Tensor:
        """``qkv``: ``[B', N, 3C]``, or its three ``[B', N, C]`` parts as :meth:`qkv_parts`
        gives them, ``q`` after its ReLU (exported graphs gather them separately: no split of
        the ``3C`` channels). ``origin``: where a window cropped to its valid span starts in
        the full window (its positional encoding)."""
        packed = isinstance(qkv, Tensor)
        q, k, v = qkv.split(self.embed_dims, dim=-1) if packed else qkv
        bw, n, c = q.shape
        wh, ww = window_hw
        h, d = self.num_heads, self.head_dims
        pos = self._positional_encoding(window_hw, origin)
        dtype = sla_dtype(q)
        with torch.autocast(device_type=q.device.type, enabled=False):
            q = F.relu(q.to(dtype)) if packed else q.to(dtype)
            k = (k.to(dtype) + pos.to(dtype)).relu_()
            v = v.to(dtype)  # zero in padded slots (the caller's contract, see WindowKernelBase)
            # on a channels-last view of V: no head split, no copy
            dwc = self._tiled_dwc(v.reshape(bw, wh, ww, c).permute(0, 3, 1, 2))
            dwc = dwc.permute(0, 2, 3, 1).reshape(bw, n, h, d)
            z = _key_sum(k, valid)  # [B', 1, C]; padded slots add nothing to K^T V (v = 0)
            if linear_attention_form(self) == 'blockdiag':
                num, den = self._heads_blockdiag(q, k, v, z)
            else:
                num, den = self._heads_split(q, k, v, z)
            # eps on [B', N*h], the unit axis after: onnxruntime broadcasts a scalar onto
            # [..., 1] one element at a time (far slower than onto [..., h])
            den = (den.reshape(bw, n * h) + self.eps).view(bw, n, h, 1)
            if exporting() or compiling():
                out = num / den + dwc
            else:  # one pass instead of two
                out = torch.addcdiv(dwc, num, den)
            out = out.reshape(bw, n, c)
        return out.to(qkv.dtype if packed else qkv[0].dtype)

    def attend_token_major(self, qkv: Tuple[Tensor, Tensor, Tensor], window_hw,
                           valid: Optional[Tensor] = None, origin=(0, 0)) -> Tensor:
        """Exported graphs in the ``token_major`` head layout: ``q`` (after its ReLU), ``k``,
        ``v`` ``[N, B', C]`` (the windows' tokens first) -> ``[B', N, C]``, in per-head products
        whose operand permutations onnxruntime folds into them (``FusedMatMul`` with
        ``transBatch``), transposed: ``S^T = V^T K`` ``[B', h, d, d]``, the numerator
        ``S^T q^T`` and the normalizer ``z^T q^T`` ``[B', h, 1, N]`` come out channels-first,
        as the DWC's output, so one transpose takes their sum to the window tokens. A third
        (3 heads) or a sixth (6 heads) of the block-diagonal form's multiply-adds."""
        q, k, v = qkv
        n, c = q.shape[0], self.embed_dims
        h, d = self.num_heads, self.head_dims
        wh, ww = window_hw
        k = (k + self._positional_encoding(window_hw, origin).transpose(0, 1)).relu()
        if valid is None:
            z = k.sum(dim=0)  # [B', C]
        else:  # padded slots' keys are relu(0 + p): a product with the [B', 1, N] mask
            z = valid.unsqueeze(1).to(k.dtype) @ k.transpose(0, 1)  # [B', 1, C]
        q_t = q.reshape(n, -1, h, d).permute(1, 2, 3, 0)  # [B', h, d, N]
        s_t = v.reshape(n, -1, h, d).permute(1, 2, 3, 0) @ \
            k.reshape(n, -1, h, d).permute(1, 2, 0, 3)  # [B', h, d, d]
        num = s_t @ q_t  # [B', h, d, N]
        den = z.reshape(-1, h, 1, d) @ q_t + self.eps  # [B', h, 1, N]
        dwc = self._tiled_dwc(v.permute(1, 2, 0).reshape(-1, c, wh, ww))  # [B', C, wh, ww]
        out = num / den + dwc.reshape(-1, h, d, n)
        return out.reshape(-1, c, n).transpose(1, 2)

    attends_windows = True

    def attend_windows(self, x: Tensor, window_hw: Tuple[int, int],
                       valid: Optional[Tensor] = None, origin=(0, 0)) -> Tensor:
        """Eager inference on the window tokens *before* ``qkv``: ``[B', N, C]`` -> ``[B', N, C]``
        before ``proj``, all in ``x``'s dtype (float32, or bf16: see :func:`sla_dtype`).

        The same numbers as :meth:`attend`, in fewer passes over memory, for
        :class:`~mmslab.models.layers.shift_window.ShiftWindowAttention`'s chunks of windows
        (small enough to stay in cache): q and k come out of one product with their biases
        and the positional encoding already added (``baddbmm`` adds a ``[N, 2C]`` bias for
        what a ``[2C]`` one costs) and take one in-place ReLU; ``v`` comes out contiguous,
        so the DWC reads it as a channels-last map without a copy; the per-head products
        run on strided per-head views (no transposed copies, a third or a sixth of the
        block-diagonal form's multiply-adds: per head, a chunk's products are small enough
        that the block-diagonal form's fewer, larger ones do not make up for them),
        numerator and normalizer from one product ``q_h [S_h | z_h]``, and the quotient is
        added in place to the DWC's output.
        ``valid``: ``[B', N]`` (padded slots: any finite token; their outputs are not read)."""
        bw, n, c = x.shape
        wh, ww = window_hw
        w_qk, w_v = self.qkv.weight.to(x.dtype).split((2 * c, c))
        bias_qk, bias_v = self._window_biases(window_hw, origin, x.dtype)
        qk = torch.baddbmm(bias_qk, x, w_qk.t().expand(bw, c, 2 * c)).relu_()  # [B', N, 2C]
        v = torch.baddbmm(bias_v, x, w_v.t().expand(bw, c, c))  # [B', N, C]
        k = qk[..., c:]
        if valid is None:
            keep = x.new_ones(bw, n)
        else:  # padded slots: V zero (they add nothing to K^T V or the DWC), keys masked
            keep = valid.to(x.dtype)
            v.mul_(keep.unsqueeze(-1))
        z = torch.bmm(keep.unsqueeze(1), k)  # [B', 1, C] (a product: faster than a strided sum)
        out = self._tiled_dwc(v.view(bw, wh, ww, c).permute(0, 3, 1, 2))
        out = out.permute(0, 2, 3, 1).reshape(bw, n, c)  # (a view: the DWC is channels-last)
        self._add_heads_split(qk[..., :c], k, v, z, out)
        return out

    def _add_heads_split(self, q: Tensor, k: Tensor, v: Tensor, z: Tensor,
                         out: Tensor) -> None:
        """:meth:`attend_windows`' kernel in per-head products on ``[B', h, N, d]`` views (no
        copies; numerator and normalizer from one ``q_h [S_h | z_h]``), batched over the
        windows, one head at a time, or over the heads, one window at a time, whichever
        takes fewer calls (small maps: many groups of one window each); each quotient added
        to ``out`` ``[B', N, C]`` in place."""
        bw = q.shape[0]
        h, d = self.num_heads, self.head_dims
        q4, k4, v4, out4 = (t.unflatten(-1, (h, d)).transpose(1, 2) for t in (q, k, v, out))
        z4 = z.view(bw, h, d)
        axis = 0 if bw < h else 1
        for i in range(q4.shape[axis]):
            q_i, k_i, v_i, z_i, out_i = (t.select(axis, i) for t in (q4, k4, v4, z4, out4))
            s_z = torch.cat([k_i.transpose(-2, -1) @ v_i, z_i.unsqueeze(-1)], dim=-1)
            num = q_i @ s_z  # [.., N, d + 1]: the numerator and the normalizer
            out_i.addcdiv_(num[..., :d], num[..., d:] + self.eps)

    def _window_biases(self, window_hw, origin, dtype) -> Tuple[Tensor, Tensor]:
        """:meth:`attend_windows`' biases in ``dtype``: ``[N, 2C]`` q's bias and k's bias plus
        the window's positional encoding, ``[C]`` v's bias. Kept per window, origin and dtype
        while the parameters are unchanged (:func:`tensor_state`), up to 16 entries."""
        c = self.embed_dims
        bias, pos = self.qkv.bias, self.positional_encoding
        key = (tuple(window_hw), tuple(origin), dtype, tensor_state(bias, pos))
        cache = self._bias_cache
        if key not in cache:
            n = window_hw[0] * window_hw[1]
            # plain tensors even when made in inference mode (see _head_masks)
            with torch.inference_mode(False), torch.no_grad():
                if bias is None:
                    bias = pos.new_zeros(3 * c)
                b_q, b_k, b_v = bias.to(dtype).split(c)
                pos = self._positional_encoding(window_hw, origin)[0].to(dtype)
                biases = (torch.cat([b_q.expand(n, c), b_k + pos], dim=1), b_v.clone())
            # (full windows share entries across input sizes; cropped spans add up to nine
            # per size: a bound on memory, 2.4 MB an entry at 56 x 56 x 192 in float32)
            if len(cache) >= 16:
                cache.clear()
            cache[key] = biases
        return cache[key]

    def _tiled_dwc(self, v_map: Tensor) -> Tensor:
        """The DWC shared by all heads as one depth-wise conv over all ``C`` channels (its
        weights tiled over the heads), in ``v_map``'s dtype: ``[B', C, wh, ww]`` -> same."""
        weight, bias = self._tiled_dwc_params(v_map.dtype)
        return F.conv2d(v_map, weight, bias, padding=self.dwc.padding, groups=v_map.shape[1])

    def _tiled_dwc_params(self, dtype) -> Tuple[Tensor, Optional[Tensor]]:
        """The DWC's weight and bias tiled over the heads, in ``dtype``. Kept between calls
        in inference (a GPU at batch 1 waits on each small kernel launch) while the
        parameters are the same tensors with the same storage, unchanged (their version
        counters), made anew in training and in traced graphs."""
        h, w, b = self.num_heads, self.dwc.weight, self.dwc.bias
        cacheable = not (torch.is_grad_enabled() and w.requires_grad) and \
            not (exporting() or compiling())
        key = (dtype, w.device, tensor_state(w, b))
        cache = self._tiled_cache
        if cacheable and cache is not None and cache[0] is w and cache[1] is b and \
                cache[2] == key:
            return cache[3]
        def tiled():
            return w.repeat(h, 1, 1, 1).to(dtype), None if b is None else b.repeat(h).to(dtype)
        if not cacheable:  # (training: the tiled copies carry the gradients back)
            self._tiled_cache = None
            return tiled()
        # plain tensors (see _head_masks) outside any autograd graph: inference_mode(False)
        # turns grad mode back on, and a kept graph would hold memory and make the module
        # impossible to deepcopy
        with torch.inference_mode(False), torch.no_grad():
            params = tiled()
        self._tiled_cache = (w, b, key, params)
        return params

    def qkv_parts(self, x: Tensor, weights=None) -> Tuple[Tensor, Tensor, Tensor]:
        """:meth:`WindowKernelBase.qkv_parts` with ``q`` after its ReLU feature map: graphs
        apply it on the tokens, where runtimes fuse it into the ``q`` MatMul (and where
        there are no padded slots)."""
        q, k, v = super().qkv_parts(x, weights)
        return F.relu(q), k, v

    def _heads_split(self, q: Tensor, k: Tensor, v: Tensor, z: Tensor) -> Tuple[Tensor, Tensor]:
        """Per-head products on ``[B', h, N, d]`` views: ``S = K^T V`` ``[B', h, d, d]`` and
        ``q [S | z]`` (numerator and normalizer from one product). Returns the numerator
        ``[B', N, h, d]`` and the normalizer ``[B', N, h]`` (views)."""
        bw, n, c = q.shape
        h, d = self.num_heads, self.head_dims
        qh, kh, vh = (_split_heads(t, h) for t in (q, k, v))
        kv = kh.transpose(-2, -1) @ vh  # [B', h, d, d]
        num = qh @ torch.cat([kv, z.view(bw, 1, h, d).permute(0, 2, 3, 1)], dim=-1)
        num = num.transpose(1, 2)  # [B', N, h, d + 1]
        return num[..., :d], num[..., d]

    def _heads_blockdiag(self, q: Tensor, k: Tensor, v: Tensor,
                         z: Tensor) -> Tuple[Tensor, Tensor]:
        """The same products on all channels at once: ``K^T V`` ``[B', C, C]`` masked to its
        per-head diagonal blocks, ``q S`` ``[B', N, h, d]`` and the normalizer ``q Z``
        ``[B', N, h, 1]`` (``Z``: ``z`` on each head's block of rows): no head transposes
        (runtimes pay for those more than for the ``h``-fold multiply-adds), exact (the
        masked blocks are zeros). Two products rather than one on ``[S | Z]``: slicing the
        ``C + h`` columns apart costs two copies of the output. Returns the numerator
        ``[B', N, h, d]`` and the normalizer ``[B', N, h]``."""
        bw, n, c = q.shape
        h, d = self.num_heads, self.head_dims
        same_head, of_head = _head_masks(c, h, q.dtype, q.device)
        kv = (k.transpose(1, 2) @ v) * same_head  # [B', C, C]
        den = q @ (z.transpose(1, 2) * of_head)  # [B', N, h]
        return (q @ kv).view(bw, n, h, d), den


@register_model()
class BiNormAttention(Reparameterizable, WindowKernelBase):
    """BiNorm attention (ViBid, eq. 5) inside windows.

    Per head ``O = L2norm_channels(Q) @ L2norm_keychannels(K^T V)``: ``K^T V`` first (linear
    in tokens), no softmax, no scale. Computed in float32 even under autocast, as SLA.

    Args:
        embed_dims (int): The feature dimension.
        num_heads (int): Parallel attention heads.
        window_size (int | tuple[int, int]): The window (height, width) it attends within.
        qkv_bias (bool): Bias in the q, k, v projection. Default: True.
        proj_drop (float): Dropout rate after the output projection. Default: 0.0.
        deploy (bool): The fused form; BiNorm has no structure to fuse, so both forms are the
            same. Default: False.
        **kwargs: The softmax options ``qk_scale`` and ``attn_drop``, accepted only at their
            neutral values (None, 0.0) so that configs may pass them to every kernel.
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

    def attend(self, qkv: Tensor, num_windows: int, window_hw: Tuple[int, int],
               shift_mask: Optional[Tensor] = None, valid: Optional[Tensor] = None,
               cache_key=None, origin: Tuple[int, int] = (0, 0)) -> Tensor:
        # (origin: position-free, a cropped window computes as any other)
        # K^T V sums over every token of the window (3136 in a 56 x 56 one): in float16 it
        # overflows, and the L2 norms after it lose precision; float32 even under autocast.
        # (Casts only where the dtype differs: fp32 graphs stay as they were.)
        # qkv: [B', N, 3C] or its three [B', N, C] parts (as SLA.attend)
        parts = qkv.split(self.embed_dims, dim=-1) if isinstance(qkv, Tensor) else qkv
        in_dtype = parts[0].dtype
        dtype = torch.promote_types(in_dtype, torch.float32)
        low = in_dtype != dtype
        with torch.autocast(device_type=parts[0].device.type, enabled=False):
            # padded slots hold zeros (the caller's contract): they add nothing to K^T V
            q, k, v = (_split_heads(t.to(dtype) if low else t, self.num_heads) for t in parts)
            kv = F.normalize(k.transpose(-2, -1) @ v, dim=-2, eps=self.eps)  # key channels
            out = F.normalize(q, dim=-1, eps=self.eps) @ kv
        out = out.transpose(1, 2)
        return out.to(in_dtype) if low else out


def _reject_unused(kwargs: dict, name: str) -> None:
    # Softmax-only options are accepted only at their neutral values.
    allowed = {'qk_scale': None, 'attn_drop': 0.0}
    bad = {k: v for k, v in kwargs.items() if k not in allowed or v != allowed[k]}
    if bad:
        raise ValueError(f'{name} does not support {sorted(bad)} (softmax-attention options)')
