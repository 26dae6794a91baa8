"""Interleaved latency measurement of fused, unfused and baseline models (batch 1); the timing
itself (CUDA synchronization, statistics) is :mod:`mmslab.utils.timing`, shared with
``ReparamEvalHook``."""
import copy
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from mmdet.structures import DetDataSample
from mmseg.models.segmentors import BaseSegmentor
from mmseg.structures import SegDataSample

from mmslab.models.reparam import reparameterize
from mmslab.utils.timing import latency_stats, timed_ms


def parse_shape(text: str) -> Tuple[int, int]:
    """``'800x1344'`` -> ``(800, 1344)`` (height x width)."""
    try:
        h, w = (int(v) for v in text.lower().split('x'))
    except ValueError as err:
        raise ValueError(f'shape {text!r} is not HEIGHTxWIDTH, e.g. 800x1344') from err
    if h <= 0 or w <= 0:
        raise ValueError(f'shape {text!r} must be positive')
    return h, w


def fake_batch(model: nn.Module, shape: Tuple[int, int]):
    """A batch-1 ``(inputs, data_samples)`` for ``model(..., mode='predict')``.

    Inputs are already normalized tensors (what the data preprocessor produces); sizes are
    padded to a multiple of 32 like mmdet/mmseg test pipelines do.
    """
    h, w = shape
    ph, pw = -(-h // 32) * 32, -(-w // 32) * 32
    inputs = torch.randn(1, 3, ph, pw)
    meta = dict(img_shape=(h, w), ori_shape=(h, w), pad_shape=(ph, pw),
                batch_input_shape=(ph, pw), scale_factor=(1.0, 1.0), img_id=0,
                flip=False, flip_direction=None)
    sample_type = SegDataSample if isinstance(model, BaseSegmentor) else DetDataSample
    return inputs, [sample_type(metainfo=meta)]


def make_runners(model: nn.Module, shape: Tuple[int, int], part: str) -> Callable[[], object]:
    """A zero-argument callable running ``part`` ('backbone' or 'model') once."""
    inputs, samples = fake_batch(model, shape)
    if part == 'backbone':
        backbone = model.backbone if hasattr(model, 'backbone') else model
        return lambda: backbone(inputs)
    if part == 'model':
        return lambda: model(inputs, samples, mode='predict')
    raise ValueError(f"part must be 'backbone' or 'model', got {part!r}")


def measure_interleaved(fns: Dict[str, Callable[[], object]], repeat: int, warmup: int,
                        progress: Optional[Callable[[], None]] = None) -> Dict[str, List[float]]:
    """Run each callable ``warmup`` times, then ``repeat`` rounds in rotating order.

    Interleaving spreads the machine's noise (other processes, frequency changes) over all
    variants instead of biasing whichever ran first. Returns milliseconds per call.
    """
    names = list(fns)
    times = {n: [] for n in names}
    with torch.inference_mode():
        for _ in range(warmup):
            for n in names:
                fns[n]()
        for r in range(repeat):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                times[n].append(timed_ms(fns[n])[1])
                if progress is not None:
                    progress()
    return times


def first_call_timed(fn: Callable, x: torch.Tensor) -> dict:
    """Seconds of the first call of a ``torch.compile``-d function at this input (the
    compilation, if one happens there) and the number of graphs dynamo compiled during it.
    Runs under ``inference_mode`` like :func:`measure_interleaved` (the grad mode is part of
    a compiled graph's guards)."""
    from torch._dynamo.utils import counters
    before = counters['stats']['unique_graphs']
    with torch.inference_mode():
        seconds = timed_ms(lambda: fn(x))[1] / 1000.0
    return dict(first_call_s=seconds, graphs_compiled=counters['stats']['unique_graphs'] - before)


def summarize(ms: Sequence[float]) -> dict:
    """The benchmark tools' summary of repeated runs."""
    s = latency_stats(ms)
    return dict(median_ms=s['median_ms'], mean_ms=s['mean_ms'], min_ms=s['min_ms'],
                max_ms=s['max_ms'], repeats=s['count'])


def fused_copy(model: nn.Module) -> nn.Module:
    return reparameterize(copy.deepcopy(model).eval())
