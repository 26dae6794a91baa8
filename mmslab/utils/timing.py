"""Timing primitives shared by ``ReparamEvalHook`` and the benchmark tools.

On the CPU a call is timed with ``time.perf_counter``. On a CUDA device kernels run
asynchronously, so a host clock read after the call returns measures the launches, not the
work: :func:`timed_ms` then waits for the device's queued work, records CUDA events around
the call on the current stream, waits for them and reads ``elapsed_time``. The events are
recorded when the host reaches them, so the figure covers host-side work inside the call
(Python, post-processing, device-to-host copies) as well as the kernels: the call's latency.
"""
import statistics
import time
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Union

import torch

#: Device types the timing tools accept (``--device``).
DEVICE_TYPES = ('cpu', 'cuda')

DeviceLike = Union[str, torch.device, None]


def sync(device: DeviceLike = None) -> None:
    """Wait for queued CUDA work, so that a timer measures it (nothing to do on CPU).

    ``device=None``: any CUDA device, if CUDA is available (the behaviour of callers that do
    not say where their model runs); a CPU device: nothing.
    """
    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif torch.device(device).type == 'cuda':
        torch.cuda.synchronize(torch.device(device))


def resolve_device(name: DeviceLike = None) -> torch.device:
    """The device a tool times on: ``name`` checked, or ``cuda`` where CUDA is available and
    ``cpu`` elsewhere when ``name`` is None. ``'cuda'`` becomes the current CUDA device
    (``cuda:0`` unless set otherwise).

    Raises:
        ValueError: ``name`` is not a CPU or CUDA device (the message names the valid ones).
        RuntimeError: a CUDA device was asked for on a machine (or a torch build) without
            CUDA, or its index is out of range.
    """
    if name is None:
        return resolve_device('cuda' if torch.cuda.is_available() else 'cpu')
    valid = 'cpu, cuda, cuda:N'
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f'device {name!r} is not a device; valid: {valid}') from err
    if device.type not in DEVICE_TYPES:
        raise ValueError(f'device {name!r}: the timing tools run on one of these; valid: '
                         f'{valid}')
    if device.type == 'cpu':
        return torch.device('cpu')
    if not torch.cuda.is_available():
        built = (f'built with CUDA {torch.version.cuda}, but no GPU is visible'
                 if torch.version.cuda else 'a build without CUDA')
        raise RuntimeError(f'device {name!r}: CUDA is not available here (torch '
                           f'{torch.__version__}, {built}); valid on this machine: cpu')
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise RuntimeError(f'device {name!r}: this machine has {count} CUDA device(s); '
                           f'valid: cuda:0 ... cuda:{count - 1}')
    return torch.device('cuda', index)


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (or buffer); the CPU for an empty one."""
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device('cpu')


def timed_ms(fn: Callable[[], object], device: DeviceLike = None):
    """``(fn(), milliseconds)`` of one call.

    Args:
        fn: the call.
        device: where ``fn`` computes. A CUDA device: CUDA events recorded around the call
            (after waiting for work queued before it; the end event is waited for).
            A CPU device: ``time.perf_counter``. None: ``perf_counter``, with every CUDA
            device synchronized before and after when CUDA is available.
    """
    if device is not None and torch.device(device).type == 'cuda':
        return _cuda_timed_ms(fn, torch.device(device))
    if device is None:
        sync()
    t0 = time.perf_counter()
    out = fn()
    if device is None:
        sync()
    return out, (time.perf_counter() - t0) * 1000.0


def _cuda_timed_ms(fn: Callable[[], object], device: torch.device):
    with torch.cuda.device(device):
        torch.cuda.synchronize(device)  # work queued before the call does not count
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize(device)  # the end event and any other stream's work
        return out, start.elapsed_time(end)


def latency_stats(times_ms: Sequence[float]) -> dict:
    """``count``, ``mean_ms``, ``median_ms``, ``p90_ms``, ``min_ms``, ``max_ms`` of a non-empty
    sequence of times."""
    ordered = sorted(times_ms)
    return dict(count=len(ordered), mean_ms=statistics.fmean(ordered),
                median_ms=statistics.median(ordered),
                p90_ms=ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))],
                min_ms=ordered[0], max_ms=ordered[-1])


def timing_method(device: DeviceLike) -> str:
    """How :func:`timed_ms` times on ``device``, for reports: ``'cuda_events'`` or
    ``'perf_counter'``."""
    if device is not None and torch.device(device).type == 'cuda':
        return 'cuda_events'
    return 'perf_counter'


def measure_interleaved(fns: Dict[Hashable, Callable[[], object]], repeat: int, warmup: int,
                        progress: Optional[Callable[[], None]] = None,
                        device: DeviceLike = None, burst: int = 1,
                        grad: bool = False) -> Dict[Hashable, List[float]]:
    """Run each callable ``warmup`` times, then ``repeat`` rounds in rotating order.

    Interleaving spreads the machine's noise (other processes, frequency changes, GPU clocks)
    over all variants instead of biasing whichever ran first. Returns milliseconds per call,
    timed by :func:`mmslab.utils.timing.timed_ms` on ``device`` (CUDA events on a GPU).

    ``burst``: in each round a callable runs ``burst - 1`` untimed calls right before its
    timed one. With 1, every timed call follows the other variants' calls (caches, and the
    runtimes' thread pools, left by another model); with more, it is the steady state of a
    model that serves a stream of inputs, still interleaved round by round.

    ``grad``: run with autograd enabled (training steps); otherwise under ``inference_mode``.
    """
    if burst < 1:
        raise ValueError(f'burst={burst}: must be >= 1 (1: no untimed calls before each)')
    names = list(fns)
    times = {n: [] for n in names}
    with torch.enable_grad() if grad else torch.inference_mode():
        for _ in range(warmup):
            for n in names:
                fns[n]()
        for r in range(repeat):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                for _ in range(burst - 1):
                    fns[n]()
                times[n].append(timed_ms(fns[n], device)[1])
                if progress is not None:
                    progress()
    return times

