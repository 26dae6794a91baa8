"""The window attention kernels' graph forms: rewrites (:mod:`.rewriters`) of the ``split``
form, the default of ``tools/export_onnx.py`` (``--attention packed`` turns them off), in
which q, k and v are three MatMuls.

* Window softmax attention (onnxruntime, OpenVINO) gathers its windows from the
  ``C``-channel tokens (a third of ``qkv``'s output) and projects q, k, v there, the scale
  folded into q's weights, in the runtime's head layout (:data:`RUNTIME_HEAD_LAYOUTS`):
  ``window_major``, the multi-head transposes OpenVINO fuses into its attention kernel;
  ``token_major``, one transpose of the windows to ``[N, B', C]`` and permutations that
  onnxruntime folds into its products (``FusedMatMul`` with ``transBatch``).
* SLA (onnxruntime) gathers its cropped windows token-major, its per-head products
  transposed so that onnxruntime folds the permutations.
* Kernels that mask padding (OpenVINO) project each group of cropped windows by q, k and
  v's own MatMuls, with no split of the ``3C`` channels.

What each pays, side by side on whole backbones (onnxruntime 1.32.0, OpenVINO 2026.4.1,
NNCF 3.4.0), is in docs/benchmarks.md; ``export.json`` records the form of each export
(:func:`attention_layout_report`).
"""
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

ATTENTION_LAYOUTS = ('packed', 'split')
#: The head layout of each runtime's ``split`` graph.
RUNTIME_HEAD_LAYOUTS = dict(onnxruntime='token_major', openvino='window_major')


def check_attention_layout(layout: str) -> str:
    """``layout`` if it is one of :data:`ATTENTION_LAYOUTS`, else a ``ValueError`` naming them."""
    if layout not in ATTENTION_LAYOUTS:
        raise ValueError(f'unknown attention layout {layout!r}; valid: {ATTENTION_LAYOUTS}')
    return layout


def bias_by_kind(kernel: WindowMSA, shift_mask, dtype: torch.dtype) -> Tensor:
    """``[1 | nW, heads, N, N]``: the position bias (+ the shift mask), each of the four
    kinds of window taking bias + mask in one gather: where a mask built from the map is a
    comparison and a select over ``nW * N * N`` elements and one more pass to add the bias,
    a sizeable share of a shifted block's time in onnxruntime."""
    bias = kernel.position_bias().to(dtype).unsqueeze(0)
    if shift_mask is None:
        return bias
    return shift_mask.gather(bias + shift_mask.table.to(dtype).unsqueeze(1))


def padded_token(kernel: WindowKernelBase) -> Optional[Tensor]:
    """``[C]``: the ``qkv`` *input* whose output is the kernel's padded slot
    (:meth:`~mmslab.models.layers.window_attention.WindowKernelBase.padded_qkv`), so windows
    can be gathered before ``qkv``; None where there is none (the ``packed`` form is used).

    Unfolded: the zero token (padding happens after the norm). Folded into ``qkv``: the raw
    token the folded norm maps to zero, solved from the weights in float64 (a constant of
    the graph).
    """
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
    """The ``split`` form's projections: ``[B', N, C]`` window tokens -> ``q`` (scaled) and
    ``v`` ``[B', heads, N, d]``, ``k`` ``[B', heads, d, N]``, as three MatMuls in
    ``head_layout``."""
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
    # Exports take one image, so B' = nW and the [nW, heads, N, N] bias adds as is:
    # MatMul -> Add -> Softmax -> MatMul, with no reshape for runtimes to fuse over (a batch
    # of several images fails on the shapes, never silently).
    bias = bias_by_kind(kernel, lay.get('shift_mask'), attn.dtype)
    out = (attn + (bias[0] if 'shift_mask' not in lay else bias)).softmax(dim=-1) @ v
    out = out.transpose(1, 2).reshape(b, -1, c)
    return out.index_select(1, lay['slot'])


@register_rewriter(ShiftWindowAttention, '_attend_padded', ['onnxruntime'], form='split')
def _attend_padded_token_major(self, x: Tensor, lay: dict) -> Tensor:
    return _attend_padded_split(self, x, lay, 'token_major')


@register_rewriter(ShiftWindowAttention, '_attend_padded', ['openvino'], form='split')
def _attend_padded_window_major(self, x: Tensor, lay: dict) -> Tensor:
    return _attend_padded_split(self, x, lay, 'window_major')


@register_rewriter(ShiftWindowAttention, '_attend_cropped', ['onnxruntime'], form='split')
def _attend_cropped_token_major(self: ShiftWindowAttention, x: Tensor, lay: dict) -> Tensor:
    """SLA's cropped windows gathered token-major (``[N, B', C]``, one image), each group
    through :func:`sla_token_major`; other kernels as in the model."""
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
    """SLA on windows gathered token-major: ``q``, ``k``, ``v`` ``[N, B', C]`` ->
    ``[B', N, C]``, in per-head products whose operand permutations onnxruntime folds into
    them, transposed: ``S^T = V^T K`` ``[B', h, d, d]``, the numerator ``S^T q^T`` and the
    normalizer ``z^T q^T`` ``[B', h, 1, N]`` come out channels-first, as the DWC's output, so
    one transpose takes their sum to the window tokens."""
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
    dwc = self.value_conv(v.permute(1, 2, 0).reshape(-1, c, wh, ww))  # [B', C, wh, ww]
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


def foreign_window_msa_classes() -> tuple:
    """mmdet's and mmseg's own ``WindowMSA`` classes, those installed."""
    classes = []
    for module in ('mmdet.models.backbones.swin', 'mmseg.models.backbones.swin'):
        try:
            classes.append(__import__(module, fromlist=['WindowMSA']).WindowMSA)
        except ImportError:
            pass
    return tuple(classes)


def attention_layout_report(model: nn.Module, layout: str) -> dict:
    """What an export in ``layout`` does with each window attention of ``model`` (for
    ``export.json``): ``{'layout', 'split', 'packed'}``, the counts of mmslab window kernels
    in each form (kernels without the split form, or whose folded norm no token maps to
    zero, stay packed), ``mmdet_window_msa``: mmdet's / mmseg's own ``WindowMSA`` modules
    (in the chosen layout), and ``cropped``: the kernels that mask padding, whose windows
    are cropped to their valid tokens."""
    check_attention_layout(layout)
    foreign_classes = foreign_window_msa_classes()
    split = packed = foreign = cropped = 0
    for m in model.modules():
        if isinstance(m, ShiftWindowAttention):
            if m.w_msa.masks_padding:
                cropped += 1
            elif layout == 'split' and padded_token(m.w_msa) is not None:
                split += 1
            else:
                packed += 1
        elif foreign_classes and isinstance(m, foreign_classes):
            foreign += 1
    return dict(layout=layout, split=split, packed=packed, mmdet_window_msa=foreign,
                cropped=cropped)
