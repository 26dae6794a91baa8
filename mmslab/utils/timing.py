"""Timing primitives shared by ``ReparamEvalHook`` and the benchmark tools."""
import statistics
import time
from typing import Callable, Sequence

import torch


def sync() -> None:
    """Wait for queued CUDA work, so that a timer measures it (nothing to do on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_ms(fn: Callable[[], object]):
    """``(fn(), milliseconds)``, synchronized before and after."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, (time.perf_counter() - t0) * 1000.0


def latency_stats(times_ms: Sequence[float]) -> dict:
    """``count``, ``mean_ms``, ``median_ms``, ``p90_ms``, ``min_ms``, ``max_ms`` of a non-empty
    sequence of times."""
    ordered = sorted(times_ms)
    return dict(count=len(ordered), mean_ms=statistics.fmean(ordered),
                median_ms=statistics.median(ordered),
                p90_ms=ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))],
                min_ms=ordered[0], max_ms=ordered[-1])
