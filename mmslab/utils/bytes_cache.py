"""A least-recently-used cache bounded by the bytes of the tensors it holds.

Layers keep per-input-size constants (index maps of window layouts) between eager calls.
Evaluation on COCO or ADE20K meets a new input size for almost every image, so a cache
bounded by a count of entries grows with the sizes; this one evicts the least recently used
entries once its tensors pass ``max_bytes``.
"""
from collections import OrderedDict
from typing import Any, Hashable

import torch


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (nested dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


class BytesCache(OrderedDict):
    """A dict whose entries' tensors take at most ``max_bytes``: setting an entry evicts the
    least recently used ones (:meth:`get` counts as a use); an entry larger than the bound
    alone is not kept.

    Args:
        max_bytes (int): The bound on the bytes of all entries' tensors.
    """

    def __init__(self, max_bytes: int):
        super().__init__()
        self.max_bytes = max_bytes
        self.nbytes = 0

    def get(self, key: Hashable, default=None):
        if key not in self:
            return default
        self.move_to_end(key)
        return self[key]

    def __setitem__(self, key: Hashable, value: Any) -> None:
        if key in self:
            del self[key]
        size = tensor_bytes(value)
        if size > self.max_bytes:
            return
        while self and self.nbytes + size > self.max_bytes:
            del self[next(iter(self))]
        super().__setitem__(key, value)
        self.nbytes += size

    def __delitem__(self, key: Hashable) -> None:
        self.nbytes -= tensor_bytes(self[key])
        super().__delitem__(key)

    def clear(self) -> None:
        super().clear()
        self.nbytes = 0

    def __reduce__(self):  # deepcopy / pickle: an empty cache of the same bound
        return type(self), (self.max_bytes, )
