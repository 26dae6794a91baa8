"""The shift mask of Swin's shifted windows: which tokens of a window may attend to which.

A cyclic shift by ``s`` wraps the bottom and right strips of the padded map into the last
window row and column, so tokens that were not neighbours share those windows; an additive
mask keeps them apart. Only the last window row and column hold wrapped strips, so there are
four kinds of window (:data:`WINDOW_TYPES`): interior, last column, last row, corner; each
kind has one ``[N, N]`` mask that does not depend on the map size (:func:`shift_mask_table`).

:func:`shift_window_mask` gives the ``[nW, N, N]`` mask of Swin (mmdet's ``img_mask``) from
them, gathered by window kind (:class:`ShiftMaskByType`) rather than built by comparing every
pair of tokens.
"""
from typing import NamedTuple, Optional

import numpy as np
import torch
from torch import Tensor

from .symbolic import Size

#: Additive shift-mask value between regions. Swin's (mmdet's) -100 leaves the masked
#: softmax probabilities near exp(-100) ~ 4e-44, denormal floats, which x86 CPUs process
#: many times slower: onnxruntime's product of those probabilities with V made every shifted
#: block several times slower than an unshifted one.
#: At -1e4 they are exactly 0, which -100's are to float precision (the same outputs);
#: fp16 holds it.
SHIFT_MASK_FILL = -1e4

#: Window kinds, as the index of :func:`shift_mask_table`: 2 * (in the last window row) +
#: (in the last window column).
WINDOW_TYPES = ('interior', 'last column', 'last row', 'corner')


def _regions(last: bool, win: int, s: int) -> np.ndarray:
    """Region (0, 1, 2 as in Swin's ``img_mask`` slices) of each offset of a window along
    one axis: 0 before the last window; in the last one 1 before the wrapped strip, 2 in it."""
    offsets = np.arange(win)
    return 1 + (offsets >= win - s) if last else np.zeros(win, dtype=np.int64)


def shift_mask_table(wh: int, ww: int, s: int) -> np.ndarray:
    """``[4, N, N]`` float32 additive masks (0 / :data:`SHIFT_MASK_FILL`) of the window kinds
    of :data:`WINDOW_TYPES`, tokens row-major in the ``wh x ww`` window, shift ``s``."""
    if not 0 <= s < min(wh, ww):
        raise ValueError(f'shift {s} must lie in [0, {min(wh, ww)}) for a {wh}x{ww} window')
    table = []
    for kind in range(len(WINDOW_TYPES)):
        rows, cols = _regions(kind >= 2, wh, s), _regions(kind % 2 == 1, ww, s)
        region = (rows[:, None] * 3 + cols[None, :]).reshape(-1)
        table.append(np.where(region[:, None] != region[None, :], SHIFT_MASK_FILL, 0.0))
    return np.stack(table).astype(np.float32)


def window_types(nwh: Size, nww: Size, device=None) -> Tensor:
    """``[nWh * nWw]`` int64 kind (:data:`WINDOW_TYPES`) of every window, row-major."""
    last_row = (torch.arange(nwh, device=device) == nwh - 1).long() * 2
    last_col = (torch.arange(nww, device=device) == nww - 1).long()
    return (last_row.view(-1, 1) + last_col.view(1, -1)).reshape(-1)


class ShiftMaskByType(NamedTuple):
    """The ``[nW, N, N]`` shift mask as ``table[window_type]``: ``table`` ``[4, N, N]``
    (:func:`shift_mask_table`, a constant of the window and shift) and ``window_type``
    ``[nW]`` (:func:`window_types`, from the map size). A kernel adds its own per-kind terms
    before the gather (``WindowMSA`` gathers position bias + mask per kind): one gather
    where a mask built from token regions takes a comparison and a select over
    ``nW * N * N`` elements. ``key``: the padded map's ``(hp, wp)`` where they are Python
    ints (what a kernel may cache the gathered terms under), else None."""
    table: Tensor
    window_type: Tensor
    key: Optional[tuple] = None

    def dense(self) -> Tensor:
        """``[nW, N, N]``."""
        return self.table.index_select(0, self.window_type)

    def gather(self, per_type: Tensor) -> Tensor:
        """``per_type`` ``[4, ...]`` (terms of each window kind) -> ``[nW, ...]``."""
        return per_type.index_select(0, self.window_type)


def shift_mask_by_type(hp: Size, wp: Size, wh: int, ww: int, s: int, dtype=torch.float32,
                       device=None) -> ShiftMaskByType:
    """The shift mask of a cyclic shift by ``s`` on a ``hp x wp`` padded map (multiples of
    the ``wh x ww`` window) as a :class:`ShiftMaskByType`; window and shift are ints."""
    if not all(isinstance(v, int) for v in (wh, ww, s)):
        raise TypeError(f'shift mask: window ({wh}, {ww}) and shift {s} must be Python ints; '
                        'only the map size (hp, wp) may be traced')
    table = torch.from_numpy(shift_mask_table(wh, ww, s)).to(device=device, dtype=dtype)
    key = (hp, wp) if isinstance(hp, int) and isinstance(wp, int) else None
    return ShiftMaskByType(table, window_types(hp // wh, wp // ww, device), key)


def shift_window_mask(hp: Size, wp: Size, wh: int, ww: int, s: int, device=None) -> Tensor:
    """``[nW, N, N]`` additive mask (0 / :data:`SHIFT_MASK_FILL`) that keeps the regions a
    cyclic shift by ``s`` wrapped around a padded ``hp x wp`` map from attending to each
    other (Swin's ``img_mask``), windows row-major."""
    return shift_mask_by_type(hp, wp, wh, ww, s, device=device).dense()
