"""(Shifted) windows around any window attention kernel, as mmdet's ``ShiftWindowMSA``.

Pad + cyclic shift + window partition is one gather of the tokens and its inverse one gather
back. The index maps come from the map size, given as Python ints (eager: cached per size),
symbolic ints (``torch.compile``) or traced sizes (export: any input size).

Padding follows what the kernel computes. Softmax ``WindowMSA`` attends to padded tokens
(zero *normalized* tokens, as in mmdet's Swin): padded windows. Kernels that exclude them
(``masks_padding``: SLA, BiNorm) give the same numbers on padded windows, whose padded
slots hold a ``qkv`` that takes no part, and on windows cropped to their valid spans (the
padded slots of shifted ones masked by ``valid``), in four groups of equal span
(interior, last column, last row, corner). Cropped on the CPU and in exports, where time is
arithmetic (SLAB-Swin-T's first stage at 512x512: 16384 tokens in 28224 padded slots); padded
on a GPU, where time is kernel launches, and under ``torch.compile``, which would recompile
for spans of size 1. A cropped span's offset in its window is passed as ``origin``.
"""
import itertools
from typing import Tuple

import torch
import torch.nn as nn
from torch import Tensor

from mmslab.utils.bytes_cache import BytesCache
from .builder import build_window_attention
from .code_path import code_path
from .shift_mask import shift_mask_by_type
from .symbolic import Size, ceil_div, is_traced, select, size_max


def padded_windows(h: Size, w: Size, wh: int, ww: int, s: int, device=None) -> dict:
    """The ``wh x ww`` windows of an ``h x w`` map, padded to whole windows and shifted by
    ``s``: ``gather`` (``[nW*N]``, each slot's source token, ``h*w`` where padded; windows and
    tokens row-major), ``slot`` (``[h*w]``, each token's slot), ``valid`` (``[nW, N]``),
    ``num_windows`` and the padded size ``padded``."""
    nwh, nww = ceil_div(h, wh), ceil_div(w, ww)
    hp, wp = nwh * wh, nww * ww
    # each padded row's / column's source; [nWh, nWw, wh, ww] slots by broadcasting
    src_i = (torch.arange(hp, device=device) + s) % hp
    src_j = (torch.arange(wp, device=device) + s) % wp
    valid = (src_i < h).view(nwh, 1, wh, 1) & (src_j < w).view(1, nww, 1, ww)
    gather = torch.where(valid, (src_i * w).view(nwh, 1, wh, 1) + src_j.view(1, nww, 1, ww),
                         h * w)
    # the slot of token (r, c): where the shift moved it
    r = (torch.arange(h, device=device) - s + hp) % hp
    c = (torch.arange(w, device=device) - s + wp) % wp
    slot = ((r // wh) * (nww * wh * ww) + (r % wh) * ww).view(-1, 1) + \
        ((c // ww) * (wh * ww) + c % ww).view(1, -1)
    return dict(gather=gather.reshape(-1), slot=slot.reshape(-1),
                valid=valid.reshape(-1, wh * ww), num_windows=nwh * nww, padded=(hp, wp))


def _axis_spans(size: Size, win: int, shift: Size) -> dict:
    """The (shifted, padded) windows along one axis, in two classes of span: ``full``,
    windows ``0 .. n-2`` of ``win`` positions; ``tail``, the span of the last window that
    holds valid tokens (unshifted its valid prefix; shifted, where it wraps the map's first
    ``shift`` tokens, the whole window if valid tokens precede its padding, which SLA's
    convolution must see, else the ``shift`` wrapped tokens). Neither class is empty: a graph
    holds no zero-size tensor (a one-window map's ``full`` window is never read back).

    Returns ``full_src`` ``[full_count, win]`` and ``tail_src`` ``[tail_len]`` (source
    coordinates, ``>= size`` where padded) and each coordinate's class, window and position.
    """
    n = ceil_div(size, win)
    padded = n * win
    last = (n - 1) * win  # start of the last window
    tail_len = select(shift == 0, size - last, select(padded - size < win - shift, win, shift))
    tail_start = select(shift == 0, last, padded - tail_len)
    full_count = size_max(n - 1, 1)
    device = size.device if is_traced(size) else None
    full_pos = ((torch.arange(full_count, device=device) * win).view(-1, 1) +
                torch.arange(win, device=device).view(1, -1))
    tail_pos = tail_start + torch.arange(tail_len, device=device)
    frame = (torch.arange(size, device=device) - shift + padded) % padded
    tail = frame >= tail_start
    window = torch.where(tail, 0, frame // win)
    return dict(full_src=(full_pos + shift) % padded, full_count=full_count,
                tail_src=(tail_pos + shift) % padded, tail_len=tail_len,
                tail_origin=tail_start - last, tail=tail, window=window,
                position=torch.where(tail, frame - tail_start, frame - window * win))


def cropped_windows(h: Size, w: Size, wh: int, ww: int, s: Size, device=None) -> dict:
    """The windows of an ``h x w`` map (shift ``s``) cropped to their valid spans, in four
    groups (full / tail rows x full / tail columns: :func:`_axis_spans`).

    Returns ``groups``, each with ``count``, ``hw`` (span), ``origin``, ``gather``
    (``[count * span]`` source tokens; a valid one for a padded slot) and ``valid``
    (``[count, span]``), and ``slot`` (``[h*w]``: each token's slot in the groups in turn)."""
    if is_traced(h):
        device = h.device
    axes = (_axis_spans(h, wh, s), _axis_spans(w, ww, s))

    def axis_class(axis: dict, tail: bool, win: int):
        """(source coordinates [count, span], count, span, origin) of a class."""
        if tail:
            return axis['tail_src'].view(1, -1), 1, axis['tail_len'], axis['tail_origin']
        return axis['full_src'], axis['full_count'], win, 0

    groups, starts, start = [], [], h * 0  # (traced: a size that follows h)
    for tail_r in (False, True):
        for tail_c in (False, True):
            src_r, count_r, len_r, origin_r = axis_class(axes[0], tail_r, wh)
            src_c, count_c, len_c, origin_c = axis_class(axes[1], tail_c, ww)
            # [count_r, count_c, len_r, len_c]: windows row-major, tokens row-major
            rows, cols = (count_r, 1, -1, 1), (1, count_c, 1, -1)
            valid = (src_r < h).view(rows) & (src_c < w).view(cols)
            count = count_r * count_c
            index = (src_r * w).view(rows) + src_c.view(cols)
            groups.append(dict(count=count, hw=(len_r, len_c), origin=(origin_r, origin_c),
                               gather=torch.where(valid, index, 0).reshape(-1),
                               valid=valid.reshape(count, -1)))
            starts.append(start)
            start = start + count * len_r * len_c
    rows, cols = axes
    tail_r, tail_c = rows['tail'].view(-1, 1), cols['tail'].view(1, -1)
    count_c = torch.where(tail_c, 1, cols['full_count'])
    len_r = torch.where(tail_r, rows['tail_len'], wh)
    len_c = torch.where(tail_c, cols['tail_len'], ww)
    group = (rows['tail'].long() * 2).view(-1, 1) + cols['tail'].long().view(1, -1)
    first = torch.stack(starts) if is_traced(h) else torch.tensor(starts, device=device)
    slot = (first[group] +
            ((rows['window'].view(-1, 1) * count_c + cols['window'].view(1, -1)) * len_r +
             rows['position'].view(-1, 1)) * len_c + cols['position'].view(1, -1))
    return dict(groups=groups, slot=slot.reshape(-1))


def split_slots(t: Tensor, sizes: list) -> Tuple[Tensor, ...]:
    """``t`` split along dim 1 into ``sizes``: one split for ints (its backward is one
    concatenation), slices for traced or symbolic sizes."""
    if all(isinstance(n, int) for n in sizes):
        return t.split(sizes, dim=1)
    starts = [0, *itertools.accumulate(sizes[:-1])]
    return tuple(t[:, a:a + n] for a, n in zip(starts, sizes))


def check_shift_mask_use(kernel: nn.Module, shift: int) -> None:
    """Refuse, at build time, a kernel for shifted windows that does not say what it does
    with the shift mask (``uses_shift_mask``), that says it applies the mask on cropped
    windows (which carry none), or that says it applies it and does not: its output on a
    window of the corner kind, which the mask splits into four regions, must change with
    the mask."""
    name = type(kernel).__name__
    if kernel.uses_shift_mask not in (True, False):
        raise ValueError(
            f'{name}.uses_shift_mask is {kernel.uses_shift_mask!r}; a kernel in shifted '
            'windows must set it: True (attend() applies the shift mask it is given) or False '
            "(it is given none: its windows attend across the cyclic shift's seams)")
    if not kernel.uses_shift_mask:
        return
    if kernel.masks_padding:
        raise ValueError(f'{name} sets masks_padding and uses_shift_mask: kernels that mask '
                         'padding attend windows cropped to their valid tokens, which carry no '
                         'shift mask; set uses_shift_mask = False or masks_padding = False')
    wh, ww = kernel.window_size
    mask = shift_mask_by_type(2 * wh, 2 * ww, wh, ww, shift)  # one window of each kind
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(4, wh * ww, kernel.qkv.out_features, generator=gen)
    training = kernel.training
    try:
        kernel.eval()
        with torch.no_grad():
            masked, unmasked = (kernel.attend(qkv.to(kernel.qkv.weight), (wh, ww), shift_mask=m)
                                for m in (mask, None))
    finally:
        kernel.train(training)
    if torch.equal(masked[-1], unmasked[-1]):
        raise ValueError(f'{name} sets uses_shift_mask = True but its attend() ignores the '
                         'shift mask (its output on a corner window does not change with it); '
                         'apply the mask, or set uses_shift_mask = False to attend across the '
                         "cyclic shift's seams")


class ShiftWindowAttention(nn.Module):
    """Window attention with optional cyclic shift, as mmdet's ``ShiftWindowMSA``.

    ``w_msa`` (mmdet's name, so mmdet Swin state dicts load) holds the kernel, any
    :class:`~mmslab.models.layers.window_attention.WindowKernelBase`. For kernels that mask
    padding a map within one window takes no shift (Swin's window shrinks to such a map).

    Shape: ``[B, H*W, C]`` with ``hw_shape=(H, W)`` -> ``[B, H*W, C]``.
    """

    #: Input values (tokens x channels) per chunk of cropped windows in eager CPU inference:
    #: ``qkv``, kernel and ``proj`` of a chunk stay in cache (docs/benchmarks.md).
    chunk_values = 12544 * 96
    #: Bytes of window layouts (index maps) kept per module for the eager input sizes met
    #: last: a layout costs index arithmetic, and on a GPU kernels, to rebuild.
    layout_cache_bytes = 4 << 20

    def __init__(self, embed_dims: int, num_heads: int, window_size: int, shift: bool = False,
                 attn_type: str = 'window', qkv_bias: bool = True, qk_scale=None,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, deploy: bool = False):
        super().__init__()
        self.w_msa = build_window_attention(
            attn_type, qk_scale=qk_scale, attn_drop=attn_drop, embed_dims=embed_dims,
            num_heads=num_heads, window_size=window_size, qkv_bias=qkv_bias,
            proj_drop=proj_drop, deploy=deploy)
        self.window_size = self.w_msa.window_size
        self.shift_size = window_size // 2 if shift else 0
        if self.shift_size:
            check_shift_mask_use(self.w_msa, self.shift_size)
        self._layouts = BytesCache(self.layout_cache_bytes)  # per eager input size

    def _layout(self, h: Size, w: Size, device, cropped: bool = False) -> dict:
        """:func:`cropped_windows` or :func:`padded_windows` (+ shift mask) of an ``h x w``
        map; eager runs keep the latest within :attr:`layout_cache_bytes`."""
        eager = isinstance(h, int) and isinstance(w, int) and \
            not torch.compiler.is_compiling()
        key = (h, w, str(device), cropped)
        if eager and key in self._layouts:
            return self._layouts.get(key)
        wh, ww = self.window_size
        s = self.shift_size
        if self.w_msa.masks_padding and s:  # a map within one window (not a full one)
            s = select((h <= wh) & (w <= ww) & ((h != wh) | (w != ww)), 0, s)
        # plain tensors: a model evaluated in inference mode is trained with them afterwards
        with torch.inference_mode(False):
            lay = (cropped_windows if cropped else padded_windows)(h, w, wh, ww, s, device)
            if not self.w_msa.masks_padding and s and self.w_msa.uses_shift_mask:
                hp, wp = lay['padded']
                lay['shift_mask'] = shift_mask_by_type(hp, wp, wh, ww, s, device=device)
            if eager and 'valid' in lay:
                # padded slots, known where the size is: an in-place fill of those only
                valid = lay['valid'].reshape(-1)
                lay['pad_slots'] = valid.logical_not().nonzero().view(-1)
                lay['gather_any'] = torch.where(valid, lay['gather'], 0)
        if eager:
            self._layouts[key] = lay
        return lay

    def forward(self, x: Tensor, hw_shape: Tuple[Size, Size]) -> Tensor:
        """``[B, H*W, C]`` -> ``[B, H*W, C]``."""
        h, w = hw_shape
        if not torch.compiler.is_compiling() and isinstance(h, int) and isinstance(w, int) \
                and x.shape[1] != h * w:
            raise ValueError(f'input has {x.shape[1]} tokens, hw_shape {hw_shape} means {h * w}')
        kernel = self.w_msa
        # cropped windows where time is arithmetic (the module docstring)
        cropped = kernel.masks_padding and code_path(x) == 'cpu' and \
            not torch.compiler.is_compiling()
        lay = self._layout(h, w, x.device, cropped)
        if not cropped:
            out = self._attend_padded(x, lay)
        elif self.runs_in_chunks(hw_shape):
            return self._forward_in_chunks(x, lay['groups'])
        else:
            out = self._attend_cropped(x, lay)
        return kernel.proj_drop(kernel.proj(out))

    def _attend_padded(self, x: Tensor, lay: dict) -> Tensor:
        """The kernel on every padded window, whose padded slots hold
        :meth:`~mmslab.models.layers.window_attention.WindowKernelBase.padded_qkv`."""
        kernel = self.w_msa
        b, c = x.shape[0], kernel.embed_dims
        n = self.window_size[0] * self.window_size[1]
        if 'pad_slots' in lay:
            # eager: gather the C-channel tokens (a third of qkv's output), qkv per slot
            windows = kernel.qkv(x.index_select(1, lay['gather_any']))
            if lay['pad_slots'].numel():
                windows[:, lay['pad_slots']] = kernel.padded_qkv().to(windows.dtype)
        else:
            # graphs: qkv on the tokens, the padded row appended, one gather (index h*w)
            tokens = kernel.qkv(x)
            row = kernel.padded_qkv().to(tokens.dtype).view(1, 1, -1).expand(b, 1, -1)
            windows = torch.cat([tokens, row], dim=1).index_select(1, lay['gather'])
        # a padded slot's qkv takes no part in a kernel that masks padding: no valid mask
        out = kernel.attend(windows.view(-1, n, 3 * c), self.window_size,
                            shift_mask=lay.get('shift_mask'))
        return out.reshape(b, -1, c).index_select(1, lay['slot'])

    def _attend_cropped(self, x: Tensor, lay: dict) -> Tensor:
        """The kernel on each group of :func:`cropped_windows`: one gather and ``qkv`` for
        all groups (one weight in a graph), a call per group, one gather back."""
        kernel = self.w_msa
        b, c = x.shape[0], kernel.embed_dims
        groups = lay['groups']
        slots = kernel.qkv(x.index_select(1, torch.cat([g['gather'] for g in groups])))
        sizes = [g['count'] * g['hw'][0] * g['hw'][1] for g in groups]
        outs = []
        for group, part in zip(groups, split_slots(slots, sizes)):
            out = self._attend_group(part.split(c, dim=-1), group, group['valid'])
            outs.append(out.reshape(b, -1, c))
        return torch.cat(outs, dim=1).index_select(1, lay['slot'])

    def _attend_group(self, qkv, group: dict, valid: Tensor) -> Tensor:
        """q, k, v ``[B, S, C]`` of ``valid`` ``[count, span]`` windows -> ``[B*count, span,
        C]``, padded slots' ``V`` zeroed (unshifted, none is read back: no mask)."""
        c = self.w_msa.embed_dims
        n = group['hw'][0] * group['hw'][1]
        q, k, v = qkv
        if self.shift_size:
            v = v * valid.reshape(1, -1, 1).to(v.dtype)
        else:
            valid = None
        parts = tuple(t.reshape(-1, n, c) for t in (q, k, v))
        return self.w_msa.attend(parts, group['hw'], valid=valid, origin=group['origin'])

    def runs_in_chunks(self, hw_shape) -> bool:
        """Whether cropped windows run in chunks (:meth:`_forward_in_chunks`): in eager
        inference (no gradients, sizes known)."""
        return not torch.is_grad_enabled() and all(isinstance(n, int) for n in hw_shape) \
            and not torch.jit.is_tracing()

    def _forward_in_chunks(self, x: Tensor, groups: list) -> Tensor:
        """:meth:`_attend_cropped` and ``proj``, :attr:`chunk_values` input values of windows
        at a time, each chunk written to its tokens."""
        kernel = self.w_msa
        b, c = x.shape[0], kernel.embed_dims
        tokens = None
        for group in groups:
            n = group['hw'][0] * group['hw'][1]
            per_chunk = max(1, self.chunk_values // (n * b * c))
            for first in range(0, group['count'], per_chunk):
                span = slice(first * n, (first + per_chunk) * n)
                index = group['gather'][span]
                valid = group['valid'][first:first + index.numel() // n]
                qkv = kernel.qkv(x.index_select(1, index)).split(c, dim=-1)
                out = self._attend_group(qkv, group, valid)
                out = kernel.proj(out.reshape(b, -1, c))
                if tokens is None:
                    tokens = out.new_empty(b, x.shape[1] + 1, c)
                # padded slots to the spare row h*w
                tokens.index_copy_(1, torch.where(valid.reshape(-1), index, x.shape[1]), out)
        return kernel.proj_drop(tokens[:, :-1])
