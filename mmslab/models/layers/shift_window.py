"""(Shifted-)window partitioning around any window attention kernel."""
from typing import Tuple

import torch
import torch.nn as nn
from torch import Tensor

from .linear_attention import SLA, BiNormAttention
from .window_attention import WindowMSA

#: Attention types a backbone stage can ask for.
ATTENTION_TYPES = {'window': WindowMSA, 'sla': SLA, 'binorm': BiNormAttention}


def build_window_kernel(attn_type: str, **kwargs) -> nn.Module:
    if attn_type not in ATTENTION_TYPES:
        raise ValueError(f'unknown attention type {attn_type!r}; valid types: '
                         f'{tuple(ATTENTION_TYPES)}')
    return ATTENTION_TYPES[attn_type](**kwargs)


def window_partition(x: Tensor, wh: int, ww: int) -> Tensor:
    """``[B, H, W, C]`` -> ``[B*nW, wh*ww, C]`` (H, W multiples of the window)."""
    b, h, w, c = x.shape
    x = x.view(b, h // wh, wh, w // ww, ww, c).transpose(2, 3)
    return x.reshape(-1, wh * ww, c)


def window_reverse(windows: Tensor, b: int, h: int, w: int, wh: int, ww: int) -> Tensor:
    """``[B*nW, wh*ww, C]`` -> ``[B, H, W, C]``."""
    c = windows.shape[-1]
    x = windows.view(b, h // wh, w // ww, wh, ww, c).transpose(2, 3)
    return x.reshape(b, h, w, c)


class ShiftWindowAttention(nn.Module):
    """Window attention with optional cyclic shift, as mmdet's ``ShiftWindowMSA``.

    ``qkv`` runs on the unpadded tokens (it is pointwise) and padded positions get the value a
    zero token would have after ``qkv`` (mmdet pads the normalized tokens with zeros); ``proj``
    runs after cropping. Kernels with ``masks_padding`` exclude padded tokens instead.
    Shift masks and padding masks are constants cached per padded size.

    Shape: ``[B, H*W, C]`` with ``hw_shape=(H, W)`` -> ``[B, H*W, C]``.
    """

    def __init__(self, embed_dims: int, num_heads: int, window_size: int, shift: bool = False,
                 attn_type: str = 'window', qkv_bias: bool = True, qk_scale=None,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, deploy: bool = False):
        super().__init__()
        kwargs = dict(embed_dims=embed_dims, num_heads=num_heads, window_size=window_size,
                      qkv_bias=qkv_bias, proj_drop=proj_drop, deploy=deploy)
        if attn_type == 'window':
            kwargs.update(qk_scale=qk_scale, attn_drop=attn_drop)
        self.attn_type = attn_type
        self.w_msa = build_window_kernel(attn_type, **kwargs)
        self.window_size = self.w_msa.window_size
        self.shift_size = window_size // 2 if shift else 0
        self._cache = {}

    def _window_for(self, h: int, w: int) -> Tuple[int, int]:
        wh, ww = self.window_size
        if self.w_msa.masks_padding and h <= wh and w <= ww:
            return h, w  # one window covers the map: crop it instead of padding (exact)
        return wh, ww

    def _masks(self, hp: int, wp: int, h: int, w: int, wh: int, ww: int, device):
        """Cached ``(shift_mask [nW, N, N] or None, valid [nW, N] or None)``."""
        key = (hp, wp, h, w, wh, ww, device)
        if key in self._cache:
            return self._cache[key]
        s = self.shift_size if (wh, ww) == self.window_size else 0
        shift_mask = valid = None
        if s and self.w_msa.uses_shift_mask:
            img = torch.zeros(1, hp, wp, 1, device=device)
            cnt = 0
            for hs in (slice(0, -wh), slice(-wh, -s), slice(-s, None)):
                for ws in (slice(0, -ww), slice(-ww, -s), slice(-s, None)):
                    img[:, hs, ws, :] = cnt
                    cnt += 1
            win = window_partition(img, wh, ww).squeeze(-1)  # [nW, N]
            diff = win.unsqueeze(1) - win.unsqueeze(2)
            shift_mask = diff.masked_fill(diff != 0, -100.0).masked_fill(diff == 0, 0.0)
        if self.w_msa.masks_padding and (hp != h or wp != w):
            keep = torch.zeros(1, hp, wp, 1, device=device)
            keep[:, :h, :w] = 1
            if s:
                keep = torch.roll(keep, shifts=(-s, -s), dims=(1, 2))
            valid = window_partition(keep, wh, ww).squeeze(-1) > 0
        if len(self._cache) > 16:
            self._cache.clear()
        self._cache[key] = (shift_mask, valid)
        return shift_mask, valid

    def forward(self, x: Tensor, hw_shape: Tuple[int, int]) -> Tensor:
        b, n, c = x.shape
        h, w = hw_shape
        if n != h * w:
            raise ValueError(f'input has {n} tokens but hw_shape {hw_shape} has {h * w}')
        kernel = self.w_msa
        qkv = kernel.qkv(x).view(b, h, w, 3 * c)
        wh, ww = self._window_for(h, w)
        hp, wp = -(-h // wh) * wh, -(-w // ww) * ww
        if (hp, wp) != (h, w):
            pad = kernel.pad_value()
            padded = qkv.new_zeros(b, hp, wp, 3 * c) if pad is None else \
                pad.to(qkv.dtype).expand(b, hp, wp, 3 * c).clone()
            padded[:, :h, :w] = qkv
            qkv = padded
        s = self.shift_size if (wh, ww) == self.window_size else 0
        if s:
            qkv = torch.roll(qkv, shifts=(-s, -s), dims=(1, 2))
        shift_mask, valid = self._masks(hp, wp, h, w, wh, ww, x.device)
        windows = window_partition(qkv, wh, ww)
        num_windows = (hp // wh) * (wp // ww)
        out = kernel.attend(windows, num_windows, (wh, ww), shift_mask=shift_mask, valid=valid,
                            cache_key=(hp, wp, wh, ww, s, str(x.device)))
        out = window_reverse(out, b, hp, wp, wh, ww)
        if s:
            out = torch.roll(out, shifts=(s, s), dims=(1, 2))
        if (hp, wp) != (h, w):
            out = out[:, :h, :w]
        out = kernel.proj(out.reshape(b, h * w, c))
        return kernel.proj_drop(out)
