"""(Shifted-)window partitioning around any window attention kernel."""
from typing import Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
from torch import Tensor

from .builder import build_window_attention
from .symbolic import ceil_div, compiling, graph_size, symbolic_shapes_enabled
from .window_attention import attention_layout


def window_partition(x: Tensor, wh: int, ww: int) -> Tensor:
    """``[B, H, W, C]`` -> ``[B*nW, wh*ww, C]`` (H, W multiples of the window)."""
    b, h, w, c = x.shape
    x = x.view(b, h // wh, wh, w // ww, ww, c).transpose(2, 3)
    return x.reshape(-1, wh * ww, c)


class ShiftWindowAttention(nn.Module):
    """Window attention with optional cyclic shift, as mmdet's ``ShiftWindowMSA``.

    ``qkv`` is pointwise, so it runs on the gathered window slots and padded slots get the
    value a zero token would have after ``qkv`` (mmdet pads the normalized tokens with zeros);
    ``proj`` runs after cropping. Kernels with ``masks_padding`` exclude padded tokens instead.
    Pad + roll + partition is a single cached-index gather, and so is its inverse; shift and
    padding masks are constants cached per input size. Exported graphs run ``qkv`` on the
    tokens instead and gather the windows from them plus one appended padded row; inside
    :func:`~mmslab.models.layers.symbolic.symbolic_shapes` (dynamic-size export) the gather
    indices and the shift mask are computed from the runtime size in the graph, and so they
    are under ``torch.compile`` (one graph for every input size; windows gathered before
    ``qkv`` there, as eager).

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

        ``gather``: for every window slot (windows row-major, tokens row-major inside), the
        source token, or ``h*w`` for a padded slot. ``bidx``/``pidx``: for every token, its
        window (batch 0) and position in it, used to scatter the attention output back.
        Roll, pad, partition and their inverses become one gather each way.
        """
        key = (h, w, str(device))
        layout = self._cache.get(key)
        if layout is not None:
            return layout
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
        layout = dict(wh=wh, ww=ww, hp=hp, wp=wp, shift=s, num_windows=nwh * nww,
                      identity=(wh, ww) == (h, w) and s == 0,
                      gather=gather.clamp(max=h * w - 1), gather_or_pad=gather,
                      pad_slots=slots[~valid],
                      bidx=slot_of_token // n, pidx=slot_of_token % n,
                      valid=valid.view(-1, n) if not bool(valid.all()) else None)
        layout['shift_mask'] = self._shift_mask(hp, wp, wh, ww, s, device)
        if len(self._cache) > 16:
            self._cache.clear()
        self._cache[key] = layout
        return layout

    def _shift_mask(self, hp: int, wp: int, wh: int, ww: int, s: int, device):
        """``[nW, N, N]`` additive mask (0 / -100) separating regions the shift wrapped."""
        if not (s and self.w_msa.uses_shift_mask):
            return None
        # Built in numpy: a constant, so an exported graph holds it as one initializer
        # (traced tensor ops would record the empty region slices of small maps).
        img = np.zeros((1, hp, wp, 1), dtype=np.float32)
        cnt = 0
        for hs in (slice(0, -wh), slice(-wh, -s), slice(-s, None)):
            for ws in (slice(0, -ww), slice(-ww, -s), slice(-s, None)):
                img[:, hs, ws, :] = cnt
                cnt += 1
        win = window_partition(torch.from_numpy(img), wh, ww).squeeze(-1).numpy()  # [nW, N]
        diff = win[:, None, :] - win[:, :, None]
        return torch.from_numpy(np.where(diff != 0, -100.0, 0.0).astype(np.float32)).to(device)

    def _export_token_pad(self) -> Optional[Tensor]:
        """``[C]`` padded token of the ``split`` exported attention layout, or None for the
        ``packed`` one (eager, compiled, another layout, kernels without the split form, or
        a folded norm no token maps to zero)."""
        kernel = self.w_msa
        if not (torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()) or \
                attention_layout() != 'split' or not kernel.attends_tokens:
            return None
        return kernel.token_pad_value()

    @staticmethod
    def _gather_padded(rows: Tensor, pad: Tensor, index: Tensor) -> Tensor:
        """``rows [B, T, D]`` with ``pad`` (``D`` values) appended as row ``T``, gathered
        along the tokens at ``index``: ``[B, len(index), D]``. One Concat + Gather in an
        exported graph; a masked select or index_put of the padded slots costs runtimes a
        slow broadcast Where (8 % of onnxruntime's time at 512x512) or an unsupported
        Reshape."""
        pad = pad.to(rows.dtype).view(1, 1, -1).expand(rows.shape[0], 1, rows.shape[-1])
        return torch.cat([rows, pad], dim=1).index_select(1, index)

    @staticmethod
    def _pad_row(kernel, like: Tensor) -> Tensor:
        """``[1, 1, 3C]``: what a padded token is after ``qkv``."""
        pad = kernel.pad_value()
        if pad is None:
            return like.new_zeros(1, 1, like.shape[-1])
        return pad.to(like.dtype).view(1, 1, -1)

    def forward(self, x: Tensor, hw_shape: Tuple[int, int]) -> Tensor:
        if symbolic_shapes_enabled():
            return self._forward_symbolic(x, hw_shape)
        b, n, c = x.shape
        # Plain ints even under tracing (ONNX export): the layout and masks are constants of
        # the input size and are cached by it; traced size tensors would be hashed by id.
        h, w = int(hw_shape[0]), int(hw_shape[1])
        b, n, c = int(b), int(n), int(c)
        if n != h * w:
            raise ValueError(f'input has {n} tokens but hw_shape {hw_shape} has {h * w}')
        kernel = self.w_msa
        lay = self._layout(h, w, x.device)
        nw, wh, ww = lay['num_windows'], lay['wh'], lay['ww']
        token_pad = self._export_token_pad()
        if token_pad is not None:
            # exported 'split' layout: windows gathered from the C-channel tokens
            if lay['identity']:
                rows = x
            elif not lay['pad_slots'].numel():
                rows = x.index_select(1, lay['gather'])
            else:
                rows = self._gather_padded(x, token_pad, lay['gather_or_pad'])
            out = kernel.attend_tokens(rows.reshape(b * nw, wh * ww, c), lay['shift_mask'])
        elif lay['identity']:
            windows = kernel.qkv(x)
        elif not lay['pad_slots'].numel():
            windows = kernel.qkv(x.index_select(1, lay['gather']))
        elif torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
            # Exported graphs: qkv on the tokens, one padded row appended, one gather (index
            # h*w is the padded row).
            tokens = kernel.qkv(x)  # [B, H*W, 3C]
            windows = self._gather_padded(tokens, self._pad_row(kernel, tokens),
                                          lay['gather_or_pad'])
        else:
            # Gather the C-channel tokens (a third of the data of qkv), then qkv per slot;
            # padded slots are overwritten with the value a padded token has after qkv.
            windows = kernel.qkv(x.index_select(1, lay['gather']))  # [B, nW*N, 3C]
            windows[:, lay['pad_slots']] = self._pad_row(kernel, windows)
        if token_pad is None:
            if not lay['identity']:
                windows = windows.view(b * nw, wh * ww, 3 * c)
            out = kernel.attend(windows, nw, (wh, ww), shift_mask=lay['shift_mask'],
                                valid=lay['valid'],
                                cache_key=(lay['hp'], lay['wp'], wh, ww, lay['shift'],
                                           str(x.device)))
        # out: [B*nW, N, C] or [B*nW, N, heads, d] (a view): one gather back to token order.
        if lay['identity']:
            out = out.reshape(b, n, c)
        else:
            bidx = lay['bidx']
            if b > 1:
                bidx = (bidx + nw * torch.arange(b, device=x.device).view(b, 1)).view(-1)
                pidx = lay['pidx'].repeat(b)
            else:
                pidx = lay['pidx']
            out = out[bidx, pidx].view(b, n, c)
        return kernel.proj_drop(kernel.proj(out))

    def _compiled_windows(self, x: Tensor, gather: Tensor, valid: Tensor) -> Tensor:
        """``[B, nW*N, 3C]`` window slots under ``torch.compile``, in eager's order: the
        ``C``-channel tokens gathered (a third of the data of ``qkv``'s output), then ``qkv``.
        A padded slot gathers a zero row, whose ``qkv`` output is the qkv bias: the padded
        value, except after a folded norm (``qkv_pad``, put in place here) or for kernels that
        mask padding (any value)."""
        kernel = self.w_msa
        windows = kernel.qkv(self._gather_padded(x, x.new_zeros(x.shape[-1]), gather))
        if kernel.qkv_pad is not None and not kernel.masks_padding:
            windows = torch.where(valid.reshape(1, -1, 1), windows,
                                  kernel.qkv_pad.to(windows.dtype))
        return windows

    # -- shape-generic path (dynamic-size export, torch.compile) -------------------------------
    def _forward_symbolic(self, x: Tensor, hw_shape) -> Tensor:
        """:meth:`forward` with every size-dependent quantity computed from ``hw_shape`` in
        the graph: the same slots, padding values, masks and order as the cached layout.
        Sizes are tensors when traced for export, dynamo's symbolic ints under
        ``torch.compile`` (no per-size cache, no ``int()``: one graph for every size)."""
        kernel = self.w_msa
        c = kernel.embed_dims
        dev = x.device
        h, w = graph_size(hw_shape[0], dev), graph_size(hw_shape[1], dev)
        wh, ww = self.window_size
        s = self.shift_size
        if kernel.masks_padding and not isinstance(h, Tensor):
            # torch.compile: symbolic ints; the comparison is a guard, as in _window_for
            wh, ww = self._window_for(h, w)
            s = s if (wh, ww) == self.window_size else 0
        elif kernel.masks_padding:
            # as _window_for: a map that fits in one window becomes the (unshifted) window
            fits = (h <= wh) & (w <= ww)
            shrunk = fits & ((h != wh) | (w != ww))  # the shift stays on a full window
            wh, ww = torch.where(fits, h, wh), torch.where(fits, w, ww)
            s = torch.where(shrunk, 0, s)
        nwh, nww = ceil_div(h, wh), ceil_div(w, ww)
        hp, wp = nwh * wh, nww * ww
        # padded-frame coordinates of every window slot, window-major: [nWh, nWw, wh, ww]
        row = (torch.arange(nwh, device=dev).view(-1, 1, 1, 1) * wh +
               torch.arange(wh, device=dev).view(1, 1, -1, 1))
        col = (torch.arange(nww, device=dev).view(1, -1, 1, 1) * ww +
               torch.arange(ww, device=dev).view(1, 1, 1, -1))
        src_i, src_j = (row + s) % hp, (col + s) % wp
        valid = (src_i < h) & (src_j < w)
        n = wh * ww
        gather = torch.where(valid, src_i * w + src_j, h * w).reshape(-1)
        shift_mask = None
        if self.shift_size and kernel.uses_shift_mask:
            # regions the cyclic shift wrapped, by padded coordinate (as _shift_mask)
            region = (((row >= hp - wh).long() + (row >= hp - s).long()) * 3 +
                      (col >= wp - ww).long() + (col >= wp - s).long())
            region = region.reshape(-1, n)  # [nW, N]
            shift_mask = torch.where(region.unsqueeze(1) != region.unsqueeze(2),
                                     torch.tensor(-100.0, device=dev),
                                     torch.tensor(0.0, device=dev)).to(x.dtype)
        token_pad = self._export_token_pad()
        if token_pad is not None:  # exported 'split' layout: gather the C-channel tokens
            windows = self._gather_padded(x, token_pad, gather).reshape(-1, n, c)
            out = kernel.attend_tokens(windows, shift_mask)
        else:
            if compiling():
                windows = self._compiled_windows(x, gather, valid)
            else:
                tokens = kernel.qkv(x)  # [B, H*W, 3C]
                windows = self._gather_padded(tokens, self._pad_row(kernel, tokens), gather)
            out = kernel.attend(windows.reshape(-1, n, 3 * c), nwh * nww, (wh, ww),
                                shift_mask=shift_mask,
                                valid=valid.reshape(-1, n) if kernel.masks_padding else None)
        # back to token order: the slot of token (r, c) is where the shift moved it
        r = (torch.arange(h, device=dev).view(-1, 1) - s + hp) % hp
        q = (torch.arange(w, device=dev).view(1, -1) - s + wp) % wp
        slot = ((r // wh) * nww + q // ww) * n + (r % wh) * ww + q % ww
        out = out.reshape(x.shape[0], -1, c).index_select(1, slot.reshape(-1))
        return kernel.proj_drop(kernel.proj(out))
