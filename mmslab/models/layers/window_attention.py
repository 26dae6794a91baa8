"""Window multi-head self-attention with relative position bias (Swin).

At inference the softmax attention runs on PyTorch's fused SDPA or on batched matmul +
softmax, whichever a one-time measurement finds faster for the shape on this CPU.

Parameter names follow mmdet's ``WindowMSA`` (``qkv``, ``proj``,
``relative_position_bias_table``, ``relative_position_index``) so mmdet Swin weights load.
"""
from typing import Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model.weight_init import trunc_normal_
from torch import Tensor

from mmslab.registry import register_model
from mmslab.utils.tensor_state import tensor_state
from .affine import fold_affine_into_next_linear
from .reparameterizable import Reparameterizable
from .shift_mask import ShiftMaskByType
from .export_mode import (ATTENTION_LAYOUTS, check_attention_layout,  # noqa: F401 (re-exported)
                          compiling, export_mode, exporting, head_layout_setting,
                          linear_attention_form,
                          symbolic_shapes_enabled, takes_split_layout, window_softmax_setting)


def foreign_window_msa_classes() -> tuple:
    """mmdet's and mmseg's own ``WindowMSA`` classes, those installed."""
    classes = []
    for module in ('mmdet.models.backbones.swin', 'mmseg.models.backbones.swin'):
        try:
            classes.append(__import__(module, fromlist=['WindowMSA']).WindowMSA)
        except ImportError:
            pass
    return tuple(classes)


def attention_layout_report(model: nn.Module, layout: str, dynamic: bool = True,
                            head_layout: str = 'window_major') -> dict:
    """What an export in ``layout`` (:mod:`~mmslab.models.layers.export_mode`) does with each
    window attention of ``model`` (for ``export.json``): ``{'layout', 'split', 'packed'}``,
    the counts of mmslab kernels in each form (kernels without the split form, or whose
    folded norm no token maps to zero, stay packed), ``mmdet_window_msa``, mmdet's /
    mmseg's own ``WindowMSA`` modules (in the chosen layout), ``linear_attention`` (SLA's
    product forms) and ``linear_windows``: how the windows of kernels that mask padding
    (SLA, BiNorm) meet a padded map: ``cropped`` of the padding, grouped in four groups
    of runtime size (``groups='runtime'``) in a graph of free size (``dynamic``), by the
    span of their valid tokens (``groups='span'``) in a fixed-size one. ``head_layout``: of
    the graph (SLA's windows are token-major in a ``token_major`` one, where they are
    cropped: always in a free-size graph, where the map is padded in a fixed-size one)."""
    # (shift_window imports this module)
    from .shift_window import ShiftWindowAttention, takes_token_major_windows
    check_attention_layout(layout)
    foreign_classes = foreign_window_msa_classes()
    split = packed = foreign = 0
    linear = dict(heads=0, blockdiag=0)
    masked = 0  # windowed kernels that mask padding
    windowed = {id(m.w_msa) for m in model.modules() if isinstance(m, ShiftWindowAttention)}
    with export_mode(head_layout=head_layout):
        for m in model.modules():
            if isinstance(m, ShiftWindowAttention):
                masked += m.w_msa.masks_padding
            elif isinstance(m, WindowKernelBase):
                if takes_split_layout(m, layout):
                    split += 1
                else:
                    packed += 1
                if m.has_blockdiag_form:
                    token_major = id(m) in windowed and takes_token_major_windows(m)
                    linear[linear_attention_form(m, token_major)] += 1
            elif foreign_classes and isinstance(m, foreign_classes):
                foreign += 1
    return dict(layout=layout, split=split, packed=packed, mmdet_window_msa=foreign,
                linear_attention=linear,
                linear_windows=dict(form='cropped', groups='runtime' if dynamic else 'span',
                                    kernels=masked))


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

    Class attributes: ``uses_shift_mask`` (mask the cyclic-shift seams, Swin style),
    ``masks_padding`` (padded tokens are excluded from the attention: their slots reach
    :meth:`attend` with a zero ``V`` (``q`` and ``k`` finite, their outputs never read), and
    ``valid`` marks them; otherwise they take the value a zero
    token has after ``qkv``, as in mmdet's Swin) and ``softmax_options`` (the
    constructor takes ``qk_scale`` and ``attn_drop``).

    The padded token: a slot of a padded window holds what a zero *normalized* token gives
    (padding happens after the norm, as in mmdet's Swin). :meth:`padded_qkv` is that slot
    after ``qkv`` (``[3C]``) and :meth:`padded_token` the raw input token that ``qkv`` maps
    there (``[C]``). Buffer ``qkv_pad`` (``[3C]``, the state-dict name; only once the block's
    norm is folded into ``qkv`` and padding is not masked) stores :meth:`padded_qkv`: the
    pre-fold bias, which the folded ``qkv`` would not give for a zero token.
    """

    uses_shift_mask = True
    masks_padding = False
    softmax_options = False

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
        self.register_buffer('qkv_pad', None)  # see the class docstring

    def padded_qkv(self) -> Optional[Tensor]:
        """``[3C]`` value of a padded token after ``qkv``; None for kernels that mask padding
        (their padded slots hold zeros)."""
        if self.masks_padding:
            return None
        return self.qkv.bias if self.qkv_pad is None else self.qkv_pad

    def expect_folded_input_norm(self) -> None:
        """Declare the state of a kernel whose input norm is folded into ``qkv`` (the
        ``deploy=True`` form), so a fused checkpoint's ``qkv_pad`` loads."""
        if not self.masks_padding:
            self.qkv_pad = self.qkv.weight.new_zeros(self.qkv.out_features)

    def qkv_parts(self, x: Tensor, weights=None) -> Tuple[Tensor, Tensor, Tensor]:
        """``qkv`` as three MatMuls: ``[..., C]`` -> q, k, v ``[..., C]`` each. What exported
        graphs of kernels that mask padding compute, so no graph splits the ``3C`` channels
        (OpenVINO's split of the innermost axis is a slow reference kernel). ``weights``:
        :meth:`qkv_weights`, taken once by a caller projecting several groups of windows
        (one weight initializer each in the graph, not one per group)."""
        parts = []
        for w, b in weights or self.qkv_weights():
            out = x @ w
            # (the bias in the product's dtype, as F.linear has it under autocast)
            parts.append(out if b is None else out + b.to(out.dtype))
        return tuple(parts)

    def qkv_weights(self) -> Tuple[Tuple[Tensor, Optional[Tensor]], ...]:
        """``qkv``'s weight and bias as the three ``(weight [C_in, C], bias [C])`` of q, k
        and v, the weights transposed: a graph folds each transpose into one initializer
        however many MatMuls read it (``F.linear`` folds it once per call)."""
        bias = self.qkv.bias.chunk(3) if self.qkv.bias is not None else (None, ) * 3
        return tuple((w.t(), b) for w, b in zip(self.qkv.weight.chunk(3), bias))

    @torch.no_grad()
    def absorb_input_affine(self, scale: Tensor, shift: Tensor) -> None:
        """Fold the preceding norm's ``x * scale + shift`` into ``qkv``."""
        if not self.masks_padding:
            qkv = self.qkv
            self.qkv_pad = qkv.bias.detach().clone() if qkv.bias is not None else \
                qkv.weight.new_zeros(qkv.out_features)
        self.qkv = fold_affine_into_next_linear(self.qkv, scale, shift)

    def attend(self, qkv: Tensor, num_windows: int, window_hw: Tuple[int, int],
               shift_mask: Optional[Tensor] = None, valid: Optional[Tensor] = None,
               cache_key=None) -> Tensor:
        """``[B*nW, N, 3C]`` -> ``[B*nW, N, C]`` or ``[B*nW, N, heads, C/heads]`` (before
        ``proj``; the 4-D form may be a strided view).

        ``cache_key`` identifies the padded layout (constant masks may be cached under it).
        """
        raise NotImplementedError

    #: Whether the kernel has SLA's two forms of its per-head products (``linear_attention``
    #: of :mod:`~mmslab.models.layers.export_mode`).
    has_blockdiag_form = False
    #: ``attend_token_major``: windows ``[N, B', C]`` (exported graphs, ``token_major`` heads)
    has_token_major_form = False

    #: Whether ``attend_windows`` exists: eager inference on window tokens before ``qkv``,
    #: run by :class:`~mmslab.models.layers.shift_window.ShiftWindowAttention` in chunks of
    #: windows (see :meth:`~mmslab.models.layers.linear_attention.SLA.attend_windows`).
    attends_windows = False

    #: Whether :meth:`attend_tokens` exists (the ``split`` exported layout, see
    #: :mod:`~mmslab.models.layers.export_mode`).
    attends_tokens = False

    def padded_token(self) -> Optional[Tensor]:
        """``[C]``: the ``qkv`` *input* whose output is :meth:`padded_qkv`, so windows can be
        gathered before ``qkv``; None if there is none (then the ``packed`` form is used).

        Unfolded: the zero token (padding happens after the norm). Folded into ``qkv``: the
        raw token the folded norm maps to zero, solved from the weights in float64.
        """
        if self.masks_padding:
            return None
        weight = self.qkv.weight
        if self.qkv_pad is None:
            return weight.new_zeros(self.embed_dims)
        # numpy: a constant of the exported graph, not traced linear algebra
        w = weight.detach().cpu().double().numpy()
        target = self.qkv_pad.detach().cpu().double().numpy()
        if self.qkv.bias is not None:
            target = target - self.qkv.bias.detach().cpu().double().numpy()
        token = np.linalg.lstsq(w, target, rcond=None)[0]
        error = np.abs(w @ token - target).max() / max(np.abs(target).max(), 1e-12)
        if not np.isfinite(token).all() or error > 1e-6:
            return None  # the norm had zero scales: no token maps to it
        return torch.from_numpy(token).to(weight)


@register_model()
class WindowMSA(Reparameterizable, WindowKernelBase):
    """Softmax attention in a window with a learned relative position bias (Swin).

    In deploy mode the bias table is gathered once into a ``[heads, N, N]`` buffer and masked
    biases are cached per padded input size, so a forward pass does no index gathering.

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

    def _switch_to_deploy(self) -> None:
        bias = self.position_bias().detach().clone()
        del self.relative_position_bias_table
        del self.relative_position_index
        self.register_buffer('relative_position_bias', bias)
        self._mask_cache = {}

    def _bias(self, shift_mask, dtype: torch.dtype) -> Tensor:
        """``[1 | nW, heads, N, N]``: the position bias (+ each window's shift mask, a
        ``[nW, N, N]`` tensor or a :class:`~mmslab.models.layers.shift_mask.ShiftMaskByType`,
        whose four kinds of window take bias + mask in one gather)."""
        bias = self.position_bias().to(dtype).unsqueeze(0)
        if isinstance(shift_mask, ShiftMaskByType):
            return shift_mask.gather(bias + shift_mask.table.to(dtype).unsqueeze(1))
        if shift_mask is not None:
            bias = bias + shift_mask.to(dtype).unsqueeze(1)
        return bias

    def _heads(self, qkv: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``[B', N, 3C]`` -> q, k, v ``[B', heads, N, d]`` (views of one 5-D transpose)."""
        n = self.window_size[0] * self.window_size[1]
        return qkv.reshape(-1, n, 3, self.num_heads, self.head_dims).permute(2, 0, 3, 1, 4)

    def _attn_mask(self, shift_mask: Optional[Tensor], bw: int, dtype: torch.dtype,
                   cache_key=None) -> Tensor:
        """``[B*nW, heads, N, N]`` additive mask: position bias (+ shift mask).

        A materialized contiguous 4-D mask keeps PyTorch's fused CPU attention kernel (a 3-D
        or broadcast 5-D mask falls back to the slow math path). In eager deploy mode the mask
        is a constant and cached per batch, padded size and bias (storage, version).
        """
        key = None
        if self.deploy and not compiling() and (cache_key is not None or shift_mask is None):
            # (a load_state_dict after a call changes the bias)
            key = (bw, cache_key, dtype, tensor_state(self.relative_position_bias))
            mask = self._mask_cache.get(key)
            if mask is not None:
                return mask
        bias = self._bias(shift_mask, dtype)
        n = bias.shape[-1]
        mask = bias.unsqueeze(0).expand(bw // bias.shape[0], -1, -1, -1, -1).reshape(
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
        q, k, v = self._heads(qkv)
        if symbolic_shapes_enabled() and not compiling():
            return self._attend_broadcast(q, k, v, shift_mask)
        if not compiling() and window_hw != self.window_size:
            raise ValueError(f'WindowMSA with window {self.window_size} got windows {window_hw}')
        # Eager and compiled: PyTorch's fused attention on a materialized 4-D mask (compiled
        # graphs compute it for any number of windows; eager caches it per size).
        mask = self._attn_mask(shift_mask, q.shape[0], q.dtype, cache_key)
        if self.training or compiling():
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale,
                dropout_p=self.attn_drop if self.training else 0.0)
        else:
            impl = choose_window_softmax()
            out = WINDOW_SOFTMAX_IMPLS[impl](q, k, v, mask, self.scale)
        return out.transpose(1, 2)  # [B', N, heads, d] view; the caller gathers it

    def _attend_broadcast(self, q: Tensor, k: Tensor, v: Tensor,
                          shift_mask: Optional[Tensor]) -> Tensor:
        """Dynamic-size export, any number of windows: matmul + softmax with the bias
        (+ the ``[nW, N, N]`` shift mask) broadcast over the images, never materialized."""
        n = q.shape[-2]
        attn = (q * self.scale) @ k.transpose(-2, -1)  # [B*nW, heads, N, N]
        bias = self._bias(shift_mask, attn.dtype)
        if shift_mask is None:
            attn = attn + bias[0]
        else:
            attn = (attn.reshape(-1, bias.shape[0], self.num_heads, n, n) + bias)
            attn = attn.reshape(-1, self.num_heads, n, n)
        return (attn.softmax(dim=-1) @ v).transpose(1, 2)

    attends_tokens = True

    def attend_tokens(self, windows: Tensor, shift_mask: Optional[Tensor] = None) -> Tensor:
        """The ``split`` exported layout (:mod:`~mmslab.models.layers.export_mode`): window
        tokens *before* ``qkv`` ``[nW, N, C]`` -> ``[nW, N, C]`` (one image), any number of
        windows."""
        n = self.window_size[0] * self.window_size[1]
        q, k, v = split_qkv(self.qkv, windows, n, self.num_heads, self.scale)
        attn = q @ k  # [B', heads, N, N]
        # Exports take one image, so B' = nW and the [nW, heads, N, N] bias adds as is:
        # MatMul -> Add -> Softmax -> MatMul, with no reshape for runtimes to fuse over
        # (a batch of several images fails on the shapes, never silently).
        bias = self._bias(shift_mask, attn.dtype)
        out = (attn + (bias[0] if shift_mask is None else bias)).softmax(dim=-1) @ v
        return out.transpose(1, 2).reshape(-1, n, self.embed_dims)


def split_qkv(qkv: nn.Linear, windows: Tensor, n: int, num_heads: int,
              scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """The ``split`` layout's projections: ``[B', N, C]`` window tokens -> ``q`` (scaled)
    and ``v`` ``[B', heads, N, d]``, ``k`` ``[B', heads, d, N]``, as three MatMuls with the
    scale folded into q's weights, in the current ``head_layout``
    (:mod:`~mmslab.models.layers.export_mode`): the standard multi-head transposes of each
    output (``window_major``), or one transpose of the windows to ``[N, B', C]`` and
    permutations of the outputs that onnxruntime folds into the attention products
    (``token_major``)."""
    d = qkv.out_features // (3 * num_heads)
    w_q, w_k, w_v = qkv.weight.chunk(3)
    b_q, b_k, b_v = qkv.bias.chunk(3) if qkv.bias is not None else (None, ) * 3
    if head_layout_setting() == 'token_major':
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


def _softmax_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """PyTorch's fused attention (flash kernel on CPU with a materialized 4-D mask)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _softmax_matmul(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Batched matmul + softmax, as mmdet's ``WindowMSA`` computes it (plain ONNX ops)."""
    attn = (q * scale) @ k.transpose(-2, -1) + mask  # [B', heads, N, N]
    return attn.softmax(dim=-1) @ v


#: The two ways of computing eager window softmax attention (the same numbers up to rounding).
WINDOW_SOFTMAX_IMPLS = {'sdpa': _softmax_sdpa, 'matmul': _softmax_matmul}


def choose_window_softmax() -> str:
    """``export_mode(window_softmax='sdpa'|'matmul')`` where one is set; otherwise ``sdpa``,
    PyTorch's fused attention, which training uses too (its backward is fused); ``matmul``
    (plain ops every runtime fuses its own way) while exporting or compiling. Never timed:
    the same input gives the same output in every run."""
    forced = window_softmax_setting()
    if forced != 'auto':
        return forced
    return 'matmul' if exporting() or compiling() else 'sdpa'
