"""The shift mask of Swin's shifted windows.

A cyclic shift wraps the padded map's bottom and right strips into the last window row and
column, where an additive mask keeps tokens that were not neighbours apart. So there are
four kinds of window (:data:`WINDOW_TYPES`), each with one ``[N, N]`` mask whatever the map
size; Swin's ``[nW, N, N]`` mask is a gather of them by window kind.
"""
from typing import NamedTuple, Optional

import numpy as np
import torch
from torch import Tensor

from .symbolic import Size

#: Additive mask value between regions. Swin's -100 leaves masked probabilities near
#: exp(-100), denormal floats that x86 CPUs process many times slower; at -1e4 they are
#: exactly 0 (what -100's are to float precision), and fp16 holds it.
SHIFT_MASK_FILL = -1e4

#: Window kinds, as the index of :func:`shift_mask_table`: 2 * (in the last window row) +
#: (in the last window column).
WINDOW_TYPES = ('interior', 'last column', 'last row', 'corner')


def shift_mask_table(wh: int, ww: int, s: int) -> np.ndarray:
    """``[4, N, N]`` float32 additive masks (0 / :data:`SHIFT_MASK_FILL`) of the window kinds
    of :data:`WINDOW_TYPES`, tokens row-major in the ``wh x ww`` window, shift ``s``."""
    if not 0 <= s < min(wh, ww):
        raise ValueError(f'shift {s} must lie in [0, {min(wh, ww)}) for a {wh}x{ww} window')
    def regions(last: bool, win: int) -> np.ndarray:
        # Swin's img_mask regions along one axis: 0 outside the last window; in it 1, and 2
        # in the wrapped strip
        return 1 + (np.arange(win) >= win - s) if last else np.zeros(win, dtype=np.int64)

    table = []
    for kind in range(len(WINDOW_TYPES)):
        rows, cols = regions(kind >= 2, wh), regions(kind % 2 == 1, ww)
        region = (rows[:, None] * 3 + cols[None, :]).reshape(-1)
        table.append(np.where(region[:, None] != region[None, :], SHIFT_MASK_FILL, 0.0))
    return np.stack(table).astype(np.float32)


class ShiftMaskByType(NamedTuple):
    """The ``[nW, N, N]`` shift mask (Swin's ``img_mask``, :meth:`dense`) as
    ``table[window_type]`` (``[4, N, N]``: :func:`shift_mask_table`; ``[nW]``: each
    window's kind, row-major), so a kernel can gather its own per-kind terms with it.
    ``key``: the padded map's ``(hp, wp)`` where they are Python ints, else None."""
    table: Tensor
    window_type: Tensor
    key: Optional[tuple] = None

    def dense(self) -> Tensor:
        """``[nW, N, N]``."""
        return self.gather(self.table)

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
    nwh, nww = hp // wh, wp // ww
    last_row = (torch.arange(nwh, device=device) == nwh - 1).long() * 2
    last_col = (torch.arange(nww, device=device) == nww - 1).long()
    window_type = (last_row.view(-1, 1) + last_col.view(1, -1)).reshape(-1)
    key = (hp, wp) if isinstance(hp, int) and isinstance(wp, int) else None
    return ShiftMaskByType(table, window_type, key)
