"""(Shifted-)window partitioning around any window attention kernel."""
from typing import Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .builder import build_window_attention
from .export_mode import (compiling, exporting, head_layout_setting, linear_attention_form,
                          linear_attention_setting, masked_windows_setting, split_layout_token,
                          symbolic_shapes_enabled)
from .shift_mask import (SHIFT_MASK_FILL, shift_mask_by_type,  # noqa: F401 (re-exported)
                         shift_window_mask)
from .symbolic import Size, as_size, ceil_div, graph_size, size_max


def takes_token_major_windows(kernel) -> bool:
    """Whether graphs traced now gather ``kernel``'s cropped windows token-major
    (``SLA.attend_token_major``): in the ``token_major`` head layout, where its products take
    the per-head form."""
    return kernel.has_token_major_form and head_layout_setting() == 'token_major' and \
        linear_attention_form(kernel, token_major=True) == 'heads'


def window_partition(x: Tensor, wh: int, ww: int) -> Tensor:
    """``[B, H, W, C]`` -> ``[B*nW, wh*ww, C]`` (H, W multiples of the window)."""
    b, h, w, c = x.shape
    x = x.view(b, h // wh, wh, w // ww, ww, c).transpose(2, 3)
    return x.reshape(-1, wh * ww, c)


def _axis_window_extents(size: int, win: int, shift: int) -> list:
    """Along one axis of ``size`` tokens, padded to a multiple of ``win`` and cyclically
    shifted by ``shift``: for each window that holds a valid token, ``(lo, hi, src)``, the
    smallest span ``[lo, hi)`` of window positions holding all its valid tokens and the
    source coordinate of each position in it (``>= size`` where padding lies inside the
    span: a wrapped window whose two valid parts are not adjacent)."""
    padded = -(-size // win) * win
    extents = []
    for start in range(0, padded, win):
        src = (np.arange(start, start + win) + shift) % padded
        valid = np.flatnonzero(src < size)
        if valid.size:
            lo, hi = int(valid[0]), int(valid[-1]) + 1
            extents.append((lo, hi, src[lo:hi]))
    return extents


def compact_window_groups(h: int, w: int, wh: int, ww: int, shift: int) -> dict:
    """The (shifted) windows of an ``h x w`` map, each cropped to the span of its valid
    tokens and grouped by span, so that windows of one group stack into one batch.

    For kernels that exclude padded tokens (``masks_padding``) this computes exactly what
    the padded windows compute, without the padded slots: a padded slot holds a zero ``V``
    and adds nothing to the kernel sums, and the window's zero border is what a convolution
    over the cropped span pads with. Only a wrapped window whose valid parts are not
    adjacent keeps the padded rows between them (marked in ``valid``).

    Returns ``gather`` (``[S]`` source token of every slot, groups concatenated, windows
    row-major inside a group; ``h*w`` for a padded slot), ``slot`` (``[h*w]`` the slot of
    every token), ``pad_slots`` and ``groups``: per group ``start``, ``count`` (windows),
    ``hw`` (the span's size), ``origin`` (its first window position, for position-dependent
    kernels) and ``valid`` (``[count, hw]`` bool, or None without padded slots).
    """
    rows, cols = _axis_window_extents(h, wh, shift), _axis_window_extents(w, ww, shift)
    spans = {}
    for r_lo, r_hi, r_src in rows:
        for c_lo, c_hi, c_src in cols:
            index = np.where((r_src[:, None] < h) & (c_src[None, :] < w),
                             r_src[:, None] * w + c_src[None, :], h * w)
            spans.setdefault((r_lo, r_hi, c_lo, c_hi), []).append(index.reshape(-1))
    gather, groups, start = [], [], 0
    for (r_lo, r_hi, c_lo, c_hi), windows in sorted(spans.items()):
        index = np.stack(windows)  # [count, hw]
        valid = index < h * w
        groups.append(dict(start=start, count=len(windows), hw=(r_hi - r_lo, c_hi - c_lo),
                           origin=(r_lo, c_lo), valid=None if valid.all() else valid))
        gather.append(index.reshape(-1))
        start += index.size
    gather = np.concatenate(gather)
    slots = np.arange(gather.size)
    slot = np.empty(h * w, dtype=np.int64)
    slot[gather[gather < h * w]] = slots[gather < h * w]
    return dict(gather=gather, slot=slot, pad_slots=slots[gather >= h * w], groups=groups)


def _axis_window_classes(size: Size, win: Size, shift: Size) -> dict:
    """The (shifted, padded) windows along one axis of a shape-generic graph, in two classes
    whose sizes come from the runtime ``size`` (tensors or ints; ``shift`` 0 or ``win // 2``),
    each cropped of the padding it can lose exactly:

    * ``full``: windows ``0 .. n-2`` of the padded frame, ``win`` positions each (with
      a shift, the last of them may end in padded positions, which stay: masked);
    * ``tail``: the span ``[tail_start, tail_start + tail_len)`` of the last window that holds
      its valid tokens. Unshifted, the valid prefix of the window. Shifted, the window wraps
      the map's first ``shift`` tokens behind its last ones: the whole window (padding
      between its two parts kept, for SLA's convolution) when the padding is shorter than
      ``win - shift`` (valid tokens precede it), else only the wrapped ``shift`` tokens.

    No class is ever empty, so no graph holds a zero-size tensor (OpenVINO's shape-fixed
    compile mis-infers those): a map of one window has one ``full`` window anyway, the
    whole padded frame, whose outputs no token reads back (its tokens read the tail's).

    Returns ``full_src`` ``[full_count, win]`` and ``tail_src`` ``[tail_len]``: the source
    coordinate of every position (``>= size``: padding), and for every coordinate of the axis
    its class (``tail``: bool), window in the class and position in that window.
    """
    size = as_size(size)
    dev = size.device
    # Python ints as tensors that follow the traced size (torch.tensor would be a constant)
    win, shift = (v if isinstance(v, Tensor) else torch.full_like(size, v) for v in (win, shift))
    n = ceil_div(size, win)
    padded = n * win
    last = (n - 1) * win  # start of the last window
    # shifted: the whole wrapped window if a valid token precedes its padding (the padding
    # is shorter than win - shift), else only its wrapped part
    tail_len = torch.where(shift == 0, size - last,
                           torch.where(padded - size < win - shift, win, shift))
    tail_start = torch.where(shift == 0, last, padded - tail_len)
    full_count = size_max(n - 1, 1)
    full_pos = (torch.arange(full_count, device=dev).view(-1, 1) * win +
                torch.arange(win, device=dev).view(1, -1))
    tail_pos = tail_start + torch.arange(tail_len, device=dev)
    # where the shift moved each coordinate of the map, and which window holds it
    frame = (torch.arange(size, device=dev) - shift + padded) % padded
    tail = frame >= tail_start
    window = torch.where(tail, 0, frame // win)
    return dict(full_src=(full_pos + shift) % padded, full_count=full_count,
                tail_src=(tail_pos + shift) % padded, tail_len=tail_len,
                tail_origin=tail_start - last, tail=tail, window=window,
                position=torch.where(tail, frame - tail_start, frame - window * win))


#: The suffix of a form computed in chunks of windows (``compact_chunked``: see
#: :meth:`ShiftWindowAttention._forward_in_chunks`).
CHUNKED = '_chunked'


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the layers' products on ``x`` run in: autocast's where it is on for ``x``'s
    device, else ``x``'s."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def choose_masked_windows(attn: 'ShiftWindowAttention', x: Tensor, lay: dict) -> str:
    """How ``attn`` computes the windows of ``lay`` (see ``masked_windows`` in
    :mod:`~mmslab.models.layers.export_mode`): ``padded`` (every window) on a map the
    windows tile; on one they do not, the set form, else by where the time goes:

    * on a CPU, arithmetic: ``compact``, the windows cropped to their valid spans, computes
      no padded slot (SLAB-Swin-T's first stage at 512x512 has 16384 tokens in 28224 padded
      window slots), and in eager inference runs in chunks of windows where the kernel has
      that form (:meth:`ShiftWindowAttention._chunked_dtype`);
    * on a GPU, kernel launches: ``padded``, one call for every window where the cropped
      groups take up to four.

    Traced graphs take ``compact``. A rule, never a timing: the same input gives the same
    output in every run."""
    tiled = lay.get('compact') is None
    if exporting() or compiling():
        return 'padded' if tiled else 'compact'
    setting = masked_windows_setting()
    if tiled:
        form = 'padded'
    elif setting == 'auto':
        form = 'compact' if x.device.type == 'cpu' else 'padded'
    else:
        form = setting.split(CHUNKED)[0]
    chunked = setting == 'auto' or setting.endswith(CHUNKED)
    return form + CHUNKED if chunked and attn._chunked_dtype(x) is not None else form


class ShiftWindowAttention(nn.Module):
    """Window attention with optional cyclic shift, as mmdet's ``ShiftWindowMSA``.

    ``w_msa`` holds the window kernel (softmax ``WindowMSA``, ``SLA``, ``BiNormAttention``,
    any :class:`~mmslab.models.layers.window_attention.WindowKernelBase`); the attribute keeps
    mmdet's name so that mmdet Swin state dicts load with their keys unchanged.

    One forward serves every path; they differ only in where the window layout comes from
    and in how window slots are filled:

    * layout: eager and fixed-size exports use index maps cached per input size
      (:meth:`_layout`, sizes as Python ints: constants of a traced graph); the shape-generic
      path (dynamic-size export, ``torch.compile``; see
      :mod:`~mmslab.models.layers.export_mode`) computes the same maps from the runtime size
      in the graph (:meth:`_graph_layout`);
    * slots: ``qkv`` is pointwise, so eager runs it on the gathered ``C``-channel window slots
      and padded slots get the value a zero token would have after ``qkv`` (mmdet pads the
      normalized tokens with zeros); graphs run ``qkv`` on the tokens and gather the windows
      from its output plus one appended padded row (``packed`` layout), or gather the
      ``C``-channel tokens plus a padded token and let the kernel run q, k, v as three
      MatMuls (``split`` layout, :meth:`WindowKernelBase.attend_tokens`). Kernels with
      ``masks_padding`` exclude padded tokens, whatever their value; their graphs gather
      each group of cropped windows from the tokens and project it there
      (:meth:`_project_slots`).

    Pad + roll + partition is one gather, and so is its inverse; ``proj`` runs after it.

    Shape: ``[B, H*W, C]`` with ``hw_shape=(H, W)`` -> ``[B, H*W, C]``.
    """

    def __init__(self, embed_dims: int, num_heads: int, window_size: int, shift: bool = False,
                 attn_type: str = 'window', qkv_bias: bool = True, qk_scale=None,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, deploy: bool = False):
        super().__init__()
        self.attn_type = attn_type
        self.w_msa = build_window_attention(
            attn_type, qk_scale=qk_scale, attn_drop=attn_drop, embed_dims=embed_dims,
            num_heads=num_heads, window_size=window_size, qkv_bias=qkv_bias,
            proj_drop=proj_drop, deploy=deploy)
        self.window_size = self.w_msa.window_size
        self.shift_size = window_size // 2 if shift else 0
        self._cache = {}

    def _window_for(self, h: int, w: int) -> Tuple[int, int]:
        wh, ww = self.window_size
        if self.w_msa.masks_padding and h <= wh and w <= ww:
            return h, w  # one window covers the map: crop it instead of padding (exact)
        return wh, ww

    def _layout(self, h: int, w: int, device) -> dict:
        """Cached index maps between the ``h x w`` tokens and the (shifted, padded) windows.

        ``gather_or_pad``: for every window slot (windows row-major, tokens row-major inside),
        the source token, or ``h*w`` for a padded slot (``gather``, ``gather_any``: the same,
        clamped to a real token). ``bidx``/``pidx``: for every token, its window (batch 0)
        and position in it, used to scatter the attention output back. Roll, pad, partition
        and their inverses become one gather each way. ``compact``: for kernels that mask
        padding, the windows cropped to their valid span (:meth:`_compact_layout`), what eager
        runs and fixed-size graphs compute when the map is padded.
        """
        key = (h, w, str(device))
        layout = self._cache.get(key)
        if layout is not None:
            return layout
        # Plain tensors even when first made in inference mode: a model evaluated under
        # torch.inference_mode and trained afterwards reuses them, and autograd cannot save
        # inference tensors (index_select's index) for the backward pass.
        with torch.inference_mode(False):
            layout = self._make_layout(h, w, device)
        if len(self._cache) > 16:
            self._cache.clear()
        self._cache[key] = layout
        return layout

    def _make_layout(self, h: int, w: int, device) -> dict:
        """:meth:`_layout`'s maps, made."""
        wh, ww = self._window_for(h, w)
        hp, wp = -(-h // wh) * wh, -(-w // ww) * ww
        s = self.shift_size if (wh, ww) == self.window_size else 0
        nwh, nww = hp // wh, wp // ww
        i = torch.arange(hp, device=device).view(nwh, wh, 1, 1)
        j = torch.arange(wp, device=device).view(1, 1, nww, ww)
        src_i = ((i + s) % hp).expand(nwh, wh, nww, ww)
        src_j = ((j + s) % wp).expand(nwh, wh, nww, ww)
        # [nWh, wh, nWw, ww] -> [nWh, nWw, wh, ww]: window-major slot order
        src_i = src_i.permute(0, 2, 1, 3).reshape(-1)
        src_j = src_j.permute(0, 2, 1, 3).reshape(-1)
        valid = (src_i < h) & (src_j < w)
        gather = torch.where(valid, src_i * w + src_j, torch.full_like(src_i, h * w))
        n = wh * ww
        slot_of_token = torch.empty(h * w, dtype=torch.long, device=device)
        slots = torch.arange(gather.numel(), device=device)
        slot_of_token[gather[valid]] = slots[valid]
        pad_slots = slots[~valid]
        clamped = gather.clamp(max=h * w - 1)
        compact = None
        if self.w_msa.masks_padding and pad_slots.numel():
            compact = self._compact_layout(h, w, wh, ww, s, device)
        layout = dict(wh=wh, ww=ww, num_windows=nwh * nww, compact=compact,
                      identity=(wh, ww) == (h, w) and s == 0,
                      gather=clamped, gather_or_pad=gather, gather_any=clamped,
                      padded=bool(pad_slots.numel()), pad_slots=pad_slots,
                      bidx=slot_of_token // n, pidx=slot_of_token % n,
                      valid=valid.view(-1, n) if pad_slots.numel() else None,
                      cache_key=(hp, wp, wh, ww, s, str(device)),
                      shift_mask=shift_window_mask(hp, wp, wh, ww, s, device)
                      if s and self.w_msa.uses_shift_mask else None)
        return layout

    @staticmethod
    def _compact_layout(h: int, w: int, wh: int, ww: int, s: int, device) -> dict:
        """:func:`compact_window_groups` as tensors on ``device``."""
        groups = compact_window_groups(h, w, wh, ww, s)
        gather = torch.from_numpy(groups['gather']).to(device)
        clamped = gather.clamp(max=h * w - 1)
        for group in groups['groups']:
            if group['valid'] is not None:
                group['valid'] = torch.from_numpy(group['valid']).to(device)
            span = slice(group['start'], group['start'] + group['count'] * np.prod(group['hw']))
            # (graphs gather each group by its own index, eager writes its outputs back by it)
            group.update(gather_or_pad=gather[span], gather_any=clamped[span])
        # (the keys _qkv_windows reads, as in _layout)
        return dict(groups=groups['groups'], gather=clamped, identity=False,
                    slot=torch.from_numpy(groups['slot']).to(device),
                    pad_slots=torch.from_numpy(groups['pad_slots']).to(device),
                    padded=bool(groups['pad_slots'].size))

    def _attend_compact(self, x: Tensor, compact: dict) -> Tensor:
        """``[B, H*W, C]`` -> ``[B, H*W, C]`` before ``proj``: the kernel on the windows of
        :func:`compact_window_groups`, one call per group (no padded slots to compute)."""
        kernel = self.w_msa
        b, c = x.shape[0], kernel.embed_dims
        # graph form when traced, and on the shape-generic layout (no gather: as
        # _graph_layout), which eager runs under export_mode(symbolic=True)
        graph = exporting() or compact['gather'] is None
        # token-major windows ([N, B', C]) for a kernel with that form, in a graph traced so
        # (see export_mode's head_layout): the same gather, its index in another order
        token_major = graph and takes_token_major_windows(kernel)
        # Unshifted, every window read back holds valid tokens only (a window along an axis
        # the map does not fill, the padded frame, is computed but never read: see
        # _axis_window_classes), so graphs need neither V's mask nor the key mask there.
        masked = self.shift_size != 0
        if graph:
            weights = kernel.qkv_weights()
        else:
            # eager: every group's slots in one gather, split into the groups (a split's
            # backward is one concatenation, where a slice per group would zero-fill a
            # gradient of all the slots for each)
            sizes = [g['count'] * g['hw'][0] * g['hw'][1] for g in compact['groups']]
            slots = self._qkv_windows(x, compact).split(sizes, dim=1)
        outs = []
        for i, group in enumerate(compact['groups']):
            n = group['hw'][0] * group['hw'][1]
            valid = group['valid'] if masked or not graph else None
            if token_major:
                # (one image: a batch of several fails on the reshape to `count` windows)
                index = group['gather_any'].view(-1, n).t().reshape(-1)
                parts = self._project_slots(x, index, None if valid is None else valid.t(),
                                            weights)
                out = kernel.attend_token_major(tuple(p.reshape(n, -1, c) for p in parts),
                                                group['hw'], valid=valid,
                                                origin=group['origin'])
                outs.append(out.reshape(b, -1, c))
                continue
            if graph:
                parts = self._project_slots(x, group['gather_any'], valid, weights)
                windows = tuple(part.reshape(-1, n, c) for part in parts)
            else:
                windows = slots[i].reshape(-1, n, 3 * c)
            outs.append(kernel.attend(windows, group['count'], group['hw'], valid=valid,
                                      origin=group['origin']).reshape(b, -1, c))
        # back to token order: one gather (its backward one scatter into zeros)
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        return out.index_select(1, compact['slot'])

    #: Eager CPU inference of kernels with ``attend_windows`` runs ``qkv``, the kernel and
    #: ``proj`` on chunks of windows of about this many input values (tokens x channels,
    #: 4.8 MB in float32), whose intermediates stay in cache between those steps. Measured
    #: with SLAB-Swin-T at 512x512 and 800x1344 on a CPU: stage 1 (96 channels) fastest at
    #: 12544 tokens a chunk, stage 2 (192) at 3136-6272; the whole map at once slower.
    chunk_values = 12544 * 96

    def _chunked_dtype(self, x: Tensor) -> Optional[torch.dtype]:
        """The dtype :meth:`_forward_in_chunks` computes in, or None where it does not apply:
        only eager inference on the CPU (no gradients, no tracing) of a kernel with
        ``attend_windows`` under the ``auto`` linear-attention form, in float32 / float64 or
        bf16 (autocast's dtype where it is on; float16 autocast keeps :meth:`attend`'s
        float32 sums)."""
        if not self.w_msa.attends_windows or x.device.type != 'cpu' or \
                torch.is_grad_enabled() or exporting() or compiling() or \
                symbolic_shapes_enabled() or linear_attention_setting() != 'auto':
            return None
        dtype = compute_dtype(x)
        return dtype if dtype in (torch.float32, torch.float64, torch.bfloat16) else None

    def _forward_in_chunks(self, x: Tensor, groups: list, dtype: torch.dtype) -> Tensor:
        """``[B, H*W, C]`` -> ``[B, H*W, C]``, ``proj`` included: each group of windows
        (``compact`` groups or all padded windows as one) in chunks of about
        :attr:`chunk_values` input values, each gathered from ``x``, attended by the
        kernel's ``attend_windows`` (``qkv`` included), projected and written to its tokens
        (padded slots to a spare row).

        SLA's unfused steps each read and write the whole map; per chunk, they work on what
        the previous step left in cache, which makes its blocks faster (docs/benchmarks.md)."""
        kernel = self.w_msa
        b, c = x.shape[0], kernel.embed_dims
        x = x.to(dtype)
        proj_weight = kernel.proj.weight.to(dtype)
        proj_bias = None if kernel.proj.bias is None else kernel.proj.bias.to(dtype)
        tokens = x.new_empty(b, x.shape[1] + 1, c)
        with torch.autocast('cpu', enabled=False):
            for group in groups:
                n = group['hw'][0] * group['hw'][1]
                per_chunk = max(1, self.chunk_values // (n * b * c))
                for first in range(0, group['count'], per_chunk):
                    span = slice(first * n, (first + per_chunk) * n)
                    index = group['gather_any'][span]
                    count = index.numel() // n
                    valid = group['valid']
                    if valid is not None:  # [count, N] per image
                        valid = valid[first:first + count].repeat(b, 1)
                    out = kernel.attend_windows(
                        x.index_select(1, index).view(b * count, n, c), group['hw'],
                        valid=valid, origin=group['origin'])
                    out = F.linear(out.view(b, count * n, c), proj_weight, proj_bias)
                    tokens.index_copy_(1, group['gather_or_pad'][span], out)
        return kernel.proj_drop(tokens[:, :-1])

    def _graph_layout(self, x: Tensor, hw_shape) -> dict:
        """:meth:`_layout` for the shape-generic path: every size-dependent quantity computed
        from ``hw_shape`` in the graph (the same slots, masks and order). Sizes are tensors
        when traced for export, dynamo's symbolic ints under ``torch.compile`` (no per-size
        cache, no ``int()``: one graph for every size). ``slot``: for every token, its flat
        window slot (the inverse gather)."""
        kernel = self.w_msa
        dev = x.device
        h, w = graph_size(hw_shape[0], dev), graph_size(hw_shape[1], dev)
        wh, ww, s = self._graph_window(h, w)
        nwh, nww = ceil_div(h, wh), ceil_div(w, ww)
        hp, wp = nwh * wh, nww * ww
        n = wh * ww
        # padded-frame coordinates of every window slot, window-major: [nWh, nWw, wh, ww]
        row = (torch.arange(nwh, device=dev).view(-1, 1, 1, 1) * wh +
               torch.arange(wh, device=dev).view(1, 1, -1, 1))
        col = (torch.arange(nww, device=dev).view(1, -1, 1, 1) * ww +
               torch.arange(ww, device=dev).view(1, 1, 1, -1))
        src_i, src_j = (row + s) % hp, (col + s) % wp
        valid = (src_i < h) & (src_j < w)
        # back to token order: the slot of token (r, c) is where the shift moved it
        r = (torch.arange(h, device=dev).view(-1, 1) - s + hp) % hp
        q = (torch.arange(w, device=dev).view(1, -1) - s + wp) % wp
        slot = ((r // wh) * nww + q // ww) * n + (r % wh) * ww + q % ww
        shift_mask = None
        if self.shift_size and kernel.uses_shift_mask:
            # window and shift are ints here (only kernels that mask padding resize windows)
            shift_mask = shift_mask_by_type(hp, wp, wh, ww, s, x.dtype, dev)
        # (whether any slot is padded is not known in the graph: taken as padded)
        return dict(wh=wh, ww=ww, num_windows=nwh * nww, identity=False, padded=True,
                    gather=None,
                    gather_any=torch.where(valid, src_i * w + src_j, 0).reshape(-1),
                    gather_or_pad=torch.where(valid, src_i * w + src_j, h * w).reshape(-1),
                    valid_slots=valid, slot=slot.reshape(-1),
                    valid=valid.reshape(-1, n) if kernel.masks_padding else None,
                    cache_key=None, shift_mask=shift_mask)

    def _graph_window(self, h: Size, w: Size):
        """``(wh, ww, shift)`` for an ``h x w`` map on the shape-generic path: sizes as
        :meth:`_layout` chooses them (:meth:`_window_for`), from tensors or symbolic ints."""
        wh, ww = self.window_size
        s = self.shift_size
        if not self.w_msa.masks_padding:
            return wh, ww, s
        if not isinstance(h, Tensor):
            # torch.compile: symbolic ints; the comparison is a guard, as in _window_for
            wh, ww = self._window_for(h, w)
            return wh, ww, s if (wh, ww) == self.window_size else 0
        # as _window_for: a map that fits in one window becomes the (unshifted) window
        fits = (h <= wh) & (w <= ww)
        shrunk = fits & ((h != wh) | (w != ww))  # the shift stays on a full window
        return torch.where(fits, h, wh), torch.where(fits, w, ww), torch.where(shrunk, 0, s)

    def _graph_compact_layout(self, x: Tensor, hw_shape) -> dict:
        """:meth:`_compact_layout` for graphs with a free height and width, kernels that mask
        padding: each axis's windows in two classes of runtime size
        (:func:`_axis_window_classes`), so four groups of windows (full x full, full x
        tail, tail x full, tail x tail), each cropped of the padding it can lose exactly. At
        512x512, stage 1 computes 16384 (unshifted) and 19600 (shifted) window slots where the
        padded windows take 28224."""
        dev = x.device
        h, w = as_size(hw_shape[0], dev), as_size(hw_shape[1], dev)
        wh, ww, s = self._graph_window(h, w)
        axes = (_axis_window_classes(h, wh, s), _axis_window_classes(w, ww, s))
        wins = (wh, ww)

        def axis_class(a: int, tail: bool):
            """(source coordinates [count, length], count, length, origin) of a class."""
            cls = axes[a]
            if tail:
                return cls['tail_src'].view(1, -1), 1, cls['tail_len'], cls['tail_origin']
            return cls['full_src'], cls['full_count'], wins[a], 0

        groups, start, starts = [], h * 0, []
        for tail_r in (False, True):
            for tail_c in (False, True):
                src_r, count_r, len_r, origin_r = axis_class(0, tail_r)
                src_c, count_c, len_c, origin_c = axis_class(1, tail_c)
                # [count_r, count_c, len_r, len_c]: windows row-major, tokens row-major
                src_r, src_c = src_r.view(count_r, 1, -1, 1), src_c.view(1, count_c, 1, -1)
                valid = (src_r < h) & (src_c < w)
                index = src_r * w + src_c
                count = count_r * count_c
                groups.append(dict(count=count, hw=(len_r, len_c),
                                   origin=(origin_r, origin_c),
                                   valid=valid.reshape(count, -1),
                                   gather_or_pad=torch.where(valid, index, h * w).reshape(-1),
                                   gather_any=torch.where(valid, index, 0).reshape(-1)))
                starts.append(start)
                start = start + count * len_r * len_c
        # the slot of every token: its group's start + its place there
        rows, cols = axes
        tail_r, tail_c = rows['tail'].view(-1, 1), cols['tail'].view(1, -1)
        count_c = torch.where(tail_c, 1, cols['full_count'])
        len_r = torch.where(tail_r, rows['tail_len'], wh)
        len_c = torch.where(tail_c, cols['tail_len'], ww)
        group = tail_r.long() * 2 + tail_c.long()
        slot = (torch.stack(starts)[group] +
                ((rows['window'].view(-1, 1) * count_c + cols['window'].view(1, -1)) * len_r +
                 rows['position'].view(-1, 1)) * len_c + cols['position'].view(1, -1))
        return dict(groups=groups, gather=None, slot=slot.reshape(-1))

    def _project_slots(self, x: Tensor, index: Tensor, valid: Optional[Tensor], weights):
        """Graphs: window slots (a group of cropped windows, or every window) gathered from
        the tokens ``x`` ``[B, T, C]`` at ``index`` ``[S]`` and projected there: q, k, v
        ``[B, S, C]`` (:meth:`WindowKernelBase.qkv_parts`). One gather of the ``C`` input
        channels where gathering the three projections took three, which made SLAB-Swin-T's
        backbone faster in every runtime and precision. ``valid``:
        the slots' mask in ``index``'s order (any shape of ``S`` elements), or None where
        no slot is padded: a padded slot gathers any real token, and only its V must be
        zero (masked kernels mask its key and never read its output back). ``weights``:
        the kernel's :meth:`WindowKernelBase.qkv_weights`."""
        q, k, v = self.w_msa.qkv_parts(x.index_select(1, index), weights)
        if valid is not None:
            v = v * valid.reshape(1, -1, 1).to(v.dtype)
        return q, k, v

    @staticmethod
    def _gather_padded(rows: Tensor, pad: Tensor, index: Tensor) -> Tensor:
        """``rows [B, T, D]`` with ``pad`` (``D`` values) appended as row ``T``, gathered
        along the tokens at ``index``: ``[B, len(index), D]``. One Concat + Gather in an
        exported graph; a masked select or index_put of the padded slots costs runtimes a
        slow broadcast Where (8 % of onnxruntime's time at 512x512) or an unsupported
        Reshape."""
        pad = pad.to(rows.dtype).view(1, 1, -1).expand(rows.shape[0], 1, rows.shape[-1])
        return torch.cat([rows, pad], dim=1).index_select(1, index)

    def _padded_qkv(self, like: Tensor) -> Tensor:
        """``[3C]`` padded token after ``qkv`` (zeros where the kernel masks padding)."""
        pad = self.w_msa.padded_qkv()
        return like.new_zeros(like.shape[-1]) if pad is None else pad.to(like.dtype)

    def _qkv_windows(self, x: Tensor, lay: dict):
        """``[B, nW*N, 3C]`` window slots after ``qkv`` (graphs of kernels that mask padding:
        its three ``[B, nW*N, C]`` parts)."""
        kernel = self.w_msa
        graph = exporting() or lay['gather'] is None
        if graph and kernel.masks_padding:
            # Graphs of kernels that mask padding: three [B, nW*N, C] parts, so no graph
            # splits the 3C channels (WindowKernelBase.qkv_parts), projected on the gathered
            # window slots (_project_slots)
            if lay['identity']:
                return kernel.qkv_parts(x)
            # (lay['valid'] is None exactly where no slot is padded)
            return self._project_slots(x, lay['gather_any'], lay['valid'], kernel.qkv_weights())
        if lay['identity']:
            return kernel.qkv(x)
        if not lay['padded']:
            return kernel.qkv(x.index_select(1, lay['gather']))
        # the value padded slots must hold where a zero row's qkv output (the bias) is not it
        pad = kernel.qkv.weight.new_zeros(kernel.qkv.out_features) if kernel.masks_padding \
            else kernel.qkv_pad
        if compiling():
            # One graph for every size: a padded slot gathers a zero row, whose qkv output is
            # the bias, then takes the padded value where that differs.
            windows = kernel.qkv(self._gather_padded(x, x.new_zeros(x.shape[-1]),
                                                     lay['gather_or_pad']))
            if pad is not None:
                windows = torch.where(lay['valid_slots'].reshape(1, -1, 1), windows,
                                      pad.to(windows.dtype))
            return windows
        if graph:
            # Graphs: qkv on the tokens, the padded row appended, one gather (index h*w)
            tokens = kernel.qkv(x)  # [B, H*W, 3C]
            return self._gather_padded(tokens, self._padded_qkv(tokens), lay['gather_or_pad'])
        # Eager: gather the C-channel tokens (a third of the data of qkv's output), then qkv
        # per slot; padded slots then take the padded value (a scatter over them only).
        windows = kernel.qkv(x.index_select(1, lay['gather']))
        windows[:, lay['pad_slots']] = self._padded_qkv(windows)
        return windows

    def forward(self, x: Tensor, hw_shape: Tuple[int, int]) -> Tensor:
        """``[B, H*W, C]`` -> ``[B, H*W, C]``."""
        kernel = self.w_msa
        if symbolic_shapes_enabled() and kernel.masks_padding and not compiling():
            # free-size graphs: windows cropped to runtime-sized groups (torch.compile keeps
            # _graph_layout's padded windows: group sizes taken from sizes would be
            # data-dependent shapes to dynamo)
            compact = self._graph_compact_layout(x, hw_shape)
            return kernel.proj_drop(kernel.proj(self._attend_compact(x, compact)))
        if symbolic_shapes_enabled():
            lay = self._graph_layout(x, hw_shape)
        else:
            # Plain ints even under tracing (ONNX export): the layout and masks are constants
            # of the input size and are cached by it; traced size tensors would be hashed by id.
            h, w = int(hw_shape[0]), int(hw_shape[1])
            if int(x.shape[1]) != h * w:
                raise ValueError(f'input has {int(x.shape[1])} tokens but hw_shape {hw_shape} '
                                 f'has {h * w}')
            lay = self._layout(h, w, x.device)
        return self._windows_forward(x, lay, choose_masked_windows(self, x, lay))

    def _windows_forward(self, x: Tensor, lay: dict, form: str) -> Tensor:
        """The attention on the windows of ``lay`` (:meth:`_layout` or :meth:`_graph_layout`),
        ``proj`` included: ``compact`` (the cropped groups of ``lay['compact']``) or
        ``padded`` (every window, padded slots masked or filled), either suffixed
        ``_chunked``: in chunks of windows (:meth:`_forward_in_chunks`)."""
        kernel = self.w_msa
        form, chunked = form.split(CHUNKED)[0], form.endswith(CHUNKED)
        if chunked:
            dtype = self._chunked_dtype(x)
            if dtype is None:
                raise ValueError('windows in chunks need eager CPU inference in float32, '
                                 'float64 or bf16, a kernel with attend_windows and the auto '
                                 'linear-attention form')
            groups = lay['compact']['groups'] if form == 'compact' else [dict(
                count=lay['num_windows'], hw=(lay['wh'], lay['ww']), origin=(0, 0),
                valid=lay['valid'], gather_any=lay['gather'],
                gather_or_pad=lay['gather_or_pad'])]
            return self._forward_in_chunks(x, groups, dtype)
        if form == 'compact':
            return kernel.proj_drop(kernel.proj(self._attend_compact(x, lay['compact'])))
        c = kernel.embed_dims
        b, tokens = x.shape[0], x.shape[1]
        if not symbolic_shapes_enabled():
            b, tokens = int(b), int(tokens)  # constants of a traced fixed-size graph
        nw, wh, ww = lay['num_windows'], lay['wh'], lay['ww']
        n = wh * ww
        token_pad = split_layout_token(kernel)
        if token_pad is not None:
            # exported 'split' layout: windows gathered from the C-channel tokens
            if lay['identity']:
                rows = x
            elif not lay['padded']:
                rows = x.index_select(1, lay['gather'])
            else:
                rows = self._gather_padded(x, token_pad, lay['gather_or_pad'])
            out = kernel.attend_tokens(rows.reshape(-1, n, c), lay['shift_mask'])
        else:
            windows = self._qkv_windows(x, lay)
            windows = windows.reshape(-1, n, 3 * c) if isinstance(windows, Tensor) else \
                tuple(part.reshape(-1, n, c) for part in windows)
            out = kernel.attend(windows, nw, (wh, ww), shift_mask=lay['shift_mask'],
                                valid=lay['valid'], cache_key=lay['cache_key'])
        # out: [B*nW, N, C] or [B*nW, N, heads, d] (a view): one gather back to token order.
        if lay['identity']:
            out = out.reshape(b, tokens, c)
        elif 'slot' in lay:
            out = out.reshape(b, -1, c).index_select(1, lay['slot'])
        else:
            bidx = lay['bidx']
            if b > 1:
                bidx = (bidx + nw * torch.arange(b, device=x.device).view(b, 1)).view(-1)
                pidx = lay['pidx'].repeat(b)
            else:
                pidx = lay['pidx']
            out = out[bidx, pidx].view(b, tokens, c)
        return kernel.proj_drop(kernel.proj(out))
