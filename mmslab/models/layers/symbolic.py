"""Shape-generic forward paths, for exports whose height and width are free.

Eager mmslab layers read sizes as Python ints and cache what depends only on them (window
layouts, shift masks, gathered biases): fast, and a traced graph then holds those as
constants of one input size. Inside ``export_mode(symbolic=True)``
(:mod:`~mmslab.models.layers.export_mode`) the same layers compute the
size-dependent parts from the runtime shape instead (padding, window partition and reverse,
the shift mask, pooling bins), so a graph traced there serves any input size. The two paths
give the same numbers; ``tests/test_dynamic_export.py`` checks exported graphs against the
unfused model at sizes other than the traced one.

Under tracing ``x.shape[i]`` is a 0-d tensor, so arithmetic on sizes is recorded. Sizes are
non-negative, where ONNX ``Div`` (truncating) and Python's ``//`` (flooring) agree; ceilings
are written ``(n + d - 1) // d`` for that reason.

``torch.compile`` takes the same path (``symbolic_shapes_enabled()`` is true while dynamo
traces): the eager path's ``int(size)`` conversions and per-size caches would make dynamo
specialize every stage's graph on its size and recompile at every new one. There sizes stay
dynamo's (symbolic) ints rather than tensors (:func:`graph_size`), so a graph compiled with
dynamic shapes serves every input size (``tests/test_compile.py`` counts the compilations).
"""
from typing import Union

import torch
from torch import Tensor

from .export_mode import compiling

Size = Union[int, Tensor]


def as_size(n: Size, device=None) -> Tensor:
    """A size as a 0-d int64 tensor (traced sizes already are)."""
    if isinstance(n, Tensor):
        return n.to(torch.long)
    return torch.tensor(n, dtype=torch.long, device=device)


def graph_size(n: Size, device=None) -> Size:
    """A size on the shape-generic path: dynamo's (symbolic) int itself under
    ``torch.compile`` (it records arithmetic on it; a tensor would make the size
    data-dependent), a 0-d tensor (:func:`as_size`) under tracing."""
    if compiling() and not isinstance(n, Tensor):
        return n
    return as_size(n, device)


def size_max(n: Size, m: int) -> Size:
    """``max(n, m)`` for a tensor or a (symbolic) int size, without a branch on ``n``."""
    if isinstance(n, Tensor):
        return n.clamp(min=m)
    return torch.sym_max(n, m)


def ceil_div(n: Size, d: int) -> Size:
    """``ceil(n / d)`` for ``n >= 0``."""
    return (n + d - 1) // d
