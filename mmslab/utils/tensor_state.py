"""When a copy derived from a tensor (tiled weights, a gathered bias, a permuted weight, a
captured CUDA graph) is still valid: the key the caches of mmslab's layers compare."""
from typing import Optional, Tuple

from torch import Tensor


def tensor_state(*tensors: Optional[Tensor]) -> Tuple:
    """Per tensor, ``(data_ptr, version counter)`` (None for an absent tensor, e.g. a bias
    that is None): equal keys mean the values cannot have changed. The storage changes when
    ``Module.to()`` or ``load_state_dict(assign=True)`` swap it (same tensor object); the
    version counter moves on every in-place write (``load_state_dict``'s ``copy_``,
    optimizer steps). Writes through ``.data`` bypass the counter and are not seen."""
    return tuple(None if t is None else (t.data_ptr(), t._version) for t in tensors)
