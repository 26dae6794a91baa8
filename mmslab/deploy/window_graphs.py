"""The window attention kernels' ``split`` graph forms (q, k and v as three MatMuls), rewrites
(:mod:`.rewriters`) that ``tools/export_onnx.py`` applies unless ``--attention packed``;
measured (onnxruntime 1.32.0, OpenVINO 2026.4.1, NNCF 3.4.0) in docs/benchmarks.md."""
import functools
from typing import Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from mmslab.models.layers.linear_attention import SLA
from mmslab.models.layers.shift_window import ShiftWindowAttention
from mmslab.models.layers.window_attention import WindowKernelBase, WindowMSA
from .rewriters import register_rewriter

#: The head layout of each runtime's ``split`` graph: ``window_major``, the multi-head
#: transposes OpenVINO fuses into its attention; ``token_major``, windows as ``[N, B', C]``,
#: whose permutations onnxruntime folds into its products (``FusedMatMul``).
RUNTIME_HEAD_LAYOUTS = dict(onnxruntime='token_major', openvino='window_major')


def padded_token(kernel: WindowKernelBase) -> Optional[Tensor]:
    """``[C]``: the ``qkv`` input that gives the padded slot
    (:meth:`~mmslab.models.layers.window_attention.WindowKernelBase.padded_qkv`), so windows
    can be gathered before ``qkv``: zero, or with the norm folded in, the token it maps to
    zero (solved in float64); None where there is none (the ``packed`` form is used)."""
    if kernel.masks_padding or not isinstance(kernel, WindowMSA):
        return None
    weight = kernel.qkv.weight
    if kernel.qkv_pad is None:
        return weight.new_zeros(kernel.embed_dims)
    w = weight.detach().cpu().double().numpy()
    target = kernel.qkv_pad.detach().cpu().double().numpy()
    if kernel.qkv.bias is not None:
        target = target - kernel.qkv.bias.detach().cpu().double().numpy()
    token = np.linalg.lstsq(w, target, rcond=None)[0]
    error = np.abs(w @ token - target).max() / max(np.abs(target).max(), 1e-12)
    if not np.isfinite(token).all() or error > 1e-6:
        return None  # the norm had zero scales: no token maps to it
    return torch.from_numpy(token).to(weight)


def split_qkv(qkv: nn.Linear, windows: Tensor, n: int, num_heads: int, scale: float,
              head_layout: str) -> Tuple[Tensor, Tensor, Tensor]:
    """Three MatMuls in ``head_layout``: ``[B', N, C]`` window tokens -> ``q`` (scaled) and
    ``v`` ``[B', heads, N, d]``, ``k`` ``[B', heads, d, N]``."""
    d = qkv.out_features // (3 * num_heads)
    w_q, w_k, w_v = qkv.weight.chunk(3)
    b_q, b_k, b_v = qkv.bias.chunk(3) if qkv.bias is not None else (None, ) * 3
    if head_layout == 'token_major':
        x, head_shape = windows.transpose(0, 1), (n, -1, num_heads, d)  # x: [N, B', C]
        qv_perm, k_perm = (1, 2, 0, 3), (1, 2, 3, 0)
    else:
        x, head_shape = windows, (-1, n, num_heads, d)
        qv_perm, k_perm = (0, 2, 1, 3), (0, 2, 3, 1)
    q = F.linear(x, w_q * scale, None if b_q is None else b_q * scale)
    q = q.reshape(head_shape).permute(qv_perm)
    k = F.linear(x, w_k, b_k).reshape(head_shape).permute(k_perm)
    v = F.linear(x, w_v, b_v).reshape(head_shape).permute(qv_perm)
    return q, k, v


def _attend_padded_split(self: ShiftWindowAttention, x: Tensor, lay: dict,
                         head_layout: str) -> Tensor:
    """Window softmax attention's windows gathered from the ``C``-channel tokens (a third of
    ``qkv``'s output), then :func:`split_qkv`."""
    kernel = self.w_msa
    token = padded_token(kernel)
    if token is None:
        return ShiftWindowAttention._attend_padded(self, x, lay)
    b, c = x.shape[0], kernel.embed_dims
    n = self.window_size[0] * self.window_size[1]
    row = token.to(x.dtype).view(1, 1, -1).expand(b, 1, -1)
    windows = torch.cat([x, row], dim=1).index_select(1, lay['gather']).reshape(-1, n, c)
    q, k, v = split_qkv(kernel.qkv, windows, n, kernel.num_heads, kernel.scale, head_layout)
    attn = q @ k  # [B', heads, N, N]
    # one image: B' = nW, so the [nW, heads, N, N] bias adds with no reshape for runtimes
    # to fuse over (several images fail on the shapes, never silently)
    bias = kernel.attention_bias(lay.get('shift_mask'), attn.dtype)
    out = (attn + (bias[0] if 'shift_mask' not in lay else bias)).softmax(dim=-1) @ v
    out = out.transpose(1, 2).reshape(b, -1, c)
    return out.index_select(1, lay['slot'])


for _runtime, _layout in RUNTIME_HEAD_LAYOUTS.items():
    register_rewriter(ShiftWindowAttention, '_attend_padded', [_runtime], form='split')(
        functools.partial(_attend_padded_split, head_layout=_layout))


@register_rewriter(ShiftWindowAttention, '_attend_cropped', ['onnxruntime'], form='split')
def _attend_cropped_token_major(self: ShiftWindowAttention, x: Tensor, lay: dict) -> Tensor:
    """SLA's cropped windows gathered token-major (``[N, B', C]``, one image) through
    :func:`sla_token_major`; other kernels as in the model."""
    kernel = self.w_msa
    if not isinstance(kernel, SLA):
        return ShiftWindowAttention._attend_cropped(self, x, lay)
    c = kernel.embed_dims
    # qkv's weight transposed once: one initializer for the groups' MatMuls
    weight, bias = kernel.qkv.weight.t(), kernel.qkv.bias
    outs = []
    for group in lay['groups']:
        n = group['hw'][0] * group['hw'][1]
        valid = group['valid'] if self.shift_size else None
        index = group['gather'].view(-1, n).t().reshape(-1)  # token-major slots
        qkv = x.index_select(1, index) @ weight
        q, k, v = (t.reshape(n, -1, c) for t in
                   (qkv if bias is None else qkv + bias).split(c, dim=-1))
        if valid is not None:  # padded slots: V zero
            v = v * valid.t().unsqueeze(-1).to(v.dtype)
        out = sla_token_major(kernel, (q, k, v), group['hw'], valid, group['origin'])
        outs.append(out.reshape(x.shape[0], -1, c))
    return torch.cat(outs, dim=1).index_select(1, lay['slot'])


def sla_token_major(self: SLA, qkv: Tuple[Tensor, Tensor, Tensor], window_hw,
                    valid: Optional[Tensor] = None, origin=(0, 0)) -> Tensor:
    """SLA on token-major ``q``, ``k``, ``v`` ``[N, B', C]`` -> ``[B', N, C]``, its products
    transposed (``S^T = V^T K``, ``S^T q^T``, ``z^T q^T``) so that onnxruntime folds the
    permutations and the result comes out channels-first, as the DWC's."""
    q, k, v = qkv
    n, c = q.shape[0], self.embed_dims
    h, d = self.num_heads, self.head_dims
    wh, ww = window_hw
    q = F.relu(q)
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
    dwc = self.value_conv(v.permute(1, 2, 0).reshape(-1, d, wh, ww))  # [B'*h, d, wh, ww]
    out = num / den + dwc.reshape(-1, h, d, n)
    return out.reshape(-1, c, n).transpose(1, 2)


@register_rewriter(ShiftWindowAttention, '_attend_cropped', ['openvino'], form='split')
def _attend_cropped_three_products(self: ShiftWindowAttention, x: Tensor, lay: dict) -> Tensor:
    """Each group of cropped windows gathered from the ``C``-channel tokens and projected
    there by q, k and v's own MatMuls (no split of the ``3C`` channels)."""
    kernel = self.w_msa
    c = kernel.embed_dims
    weights = kernel.qkv.weight.t().split(c, dim=1)  # one initializer each, for every group
    biases = (None, ) * 3 if kernel.qkv.bias is None else kernel.qkv.bias.split(c)
    outs = []
    for group in lay['groups']:
        slots = x.index_select(1, group['gather'])
        qkv = [slots @ w if b is None else slots @ w + b for w, b in zip(weights, biases)]
        outs.append(self._attend_group(qkv, group, group['valid']).reshape(x.shape[0], -1, c))
    return torch.cat(outs, dim=1).index_select(1, lay['slot'])
