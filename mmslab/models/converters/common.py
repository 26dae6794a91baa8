"""Small helpers shared by the state-dict transforms (no model, no file)."""
import math
import re
from collections import OrderedDict
from typing import Dict, Tuple

from torch import Tensor

#: Buffers every model recomputes itself: never taken from a checkpoint.
MODEL_BUFFERS = ('relative_position_index', 'attn_mask')


def strip_wrappers(state_dict: Dict[str, Tensor]) -> 'OrderedDict[str, Tensor]':
    """Drop a ``module.`` (DDP) prefix and, for detector/segmentor checkpoints, keep only the
    ``backbone.`` entries without their prefix."""
    sd = OrderedDict(state_dict)
    if sd and all(k.startswith('module.') for k in sd):
        sd = OrderedDict((k[7:], v) for k, v in sd.items())
    if any(k.startswith('backbone.') for k in sd):
        sd = OrderedDict((k[9:], v) for k, v in sd.items() if k.startswith('backbone.'))
    return sd



def any_key_matches(keys, pattern: str) -> bool:
    rx = re.compile(pattern)
    return any(rx.search(k) for k in keys)


def max_index(sd, pattern: str) -> int:
    """The largest integer captured by ``pattern``'s first group over the keys (-1: none)."""
    rx = re.compile(pattern)
    idx = [int(m.group(1)) for k in sd for m in [rx.match(k)] if m]
    return max(idx) if idx else -1


def is_square(n: int) -> bool:
    return n > 0 and int(round(math.sqrt(n))) ** 2 == n


def isqrt(n: int, what: str) -> int:
    if not is_square(n):
        raise ValueError(f'{what} has {n} entries, not a square grid')
    return int(round(math.sqrt(n)))


def pair(x) -> Tuple[int, int]:
    return (int(x[0]), int(x[1])) if isinstance(x, (tuple, list)) else (int(x), int(x))
