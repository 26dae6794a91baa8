"""Size arithmetic for Python ints (eager), symbolic ints (``torch.compile``) and 0-d tensors
(traced for export), so that one forward gives constants eagerly and a free-size graph when
traced. Sizes are non-negative, where ONNX ``Div`` and Python's ``//`` agree.
"""
from typing import Union

import torch
from torch import Tensor

Size = Union[int, torch.SymInt, Tensor]


def is_traced(n: Size) -> bool:
    """Whether a size is a traced tensor (an ONNX export's graph computes it)."""
    return isinstance(n, Tensor)


def ceil_div(n: Size, d: Size) -> Size:
    """``ceil(n / d)`` for ``n >= 0``."""
    return (n + d - 1) // d


def size_max(n: Size, m: int) -> Size:
    """``max(n, m)`` without a Python branch on a traced or symbolic ``n``."""
    if isinstance(n, Tensor):
        return n.clamp(min=m)
    if isinstance(n, int):
        return max(n, m)
    return torch.sym_max(n, m)


def select(cond, a: Size, b: Size) -> Size:
    """``a if cond else b`` without a Python branch on a traced (``Where``) or symbolic
    (``sym_ite``: no guard, so no recompilation when it flips) ``cond``."""
    if isinstance(cond, Tensor):
        return torch.where(cond, a, b)
    if isinstance(cond, torch.SymBool):
        return torch.sym_ite(cond, a, b)
    return a if cond else b
