"""Interleaved latency measurement of fused, unfused and baseline models on the CPU or a CUDA
device, in fp32 or under autocast (fp16, bf16); the timing itself (CUDA events, statistics)
is :mod:`mmslab.utils.timing`, shared with ``ReparamEvalHook``, the autocast regions of whole
models :class:`mmslab.utils.precision.AutocastRegions`, shared with eager bf16 evaluation.

The timing tools (``tools/benchmark.py``, ``benchmarks/backbone_speed.py``) share their
``--device``, ``--precisions`` and ``--batch-size`` options through
:func:`add_device_arguments`
and :func:`check_device_arguments`.
"""
import argparse
import copy
import json
import os
import os.path as osp
from typing import Callable, Sequence, Tuple

import torch
import torch.nn as nn
from mmdet.structures import DetDataSample
from mmseg.models.segmentors import BaseSegmentor
from mmseg.structures import SegDataSample

from mmslab.models.reparam import reparameterize
from mmslab.utils.precision import (PRECISION_DTYPES, AutocastRegions, autocast_dtype,
                                    check_autocast_precision)
from mmslab.utils.timing import (DeviceLike, latency_stats, measure_interleaved,  # noqa: F401
                                 module_device, resolve_device, timed_ms)


# ----------------------------------------------------------------------------------------------
# command-line options shared by the timing tools
# ----------------------------------------------------------------------------------------------

def add_device_arguments(parser: argparse.ArgumentParser, config_batch: bool = False) -> None:
    """``--device``, ``--precisions`` (aliases ``--precision``, ``--dtypes``) and
    ``--batch-size``.

    ``config_batch``: ``--batch-size`` also takes ``config`` (the config's
    ``test_dataloader.batch_size``; the tool resolves it).
    """
    parser.add_argument('--device', default=None,
                        help='where to time: cpu, cuda or cuda:N (default: cuda if available, '
                        'else cpu)')
    parser.add_argument('--precisions', '--precision', '--dtypes', dest='precisions',
                        nargs='+', default=['fp32'],
                        choices=list(PRECISION_DTYPES),
                        help='precisions, each timed as its own variant in the same '
                        'interleaved rotation: fp32, fp16 (CUDA only) and bf16 (GPUs of '
                        'compute capability 8.0+, CPUs with avx512_bf16 / amx_bf16), by '
                        'torch.autocast on the network parts; post-processing stays float32')
    parser.add_argument('--batch-size', nargs='+', default=[1],
                        type=_batch_size_arg if config_batch else _positive_int,
                        help='images per call, one run each (default 1)' +
                        ("; 'config': the config's test_dataloader.batch_size"
                         if config_batch else ''))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'{text!r} is not an integer') from None
    if value < 1:
        raise argparse.ArgumentTypeError(f'{value} must be >= 1')
    return value


def _batch_size_arg(text: str):
    return 'config' if text == 'config' else _positive_int(text)


def check_device_arguments(parser: argparse.ArgumentParser, args, what: str) -> None:
    """Resolve ``args.device`` (a ``torch.device``), refuse ``args.precisions`` the device does
    not compute (:func:`mmslab.utils.precision.check_autocast_precision`) and drop repeated
    precisions / batch sizes; errors exit through ``parser.error`` naming the valid choices."""
    try:
        args.device = resolve_device(args.device)
        args.precisions = list(dict.fromkeys(args.precisions))
        for precision in args.precisions:
            check_autocast_precision(precision, args.device, what)
    except (ValueError, RuntimeError) as err:
        parser.error(str(err))
    args.batch_size = list(dict.fromkeys(args.batch_size))


def move_to(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` on ``device`` in eval mode (mmdet's Swin returns None from ``eval()``)."""
    model.to(device)
    model.eval()
    return model


def parse_shape(text: str) -> Tuple[int, int]:
    """``'800x1344'`` -> ``(800, 1344)`` (height x width)."""
    try:
        h, w = (int(v) for v in text.lower().split('x'))
    except ValueError as err:
        raise ValueError(f'shape {text!r} is not HEIGHTxWIDTH, e.g. 800x1344') from err
    if h <= 0 or w <= 0:
        raise ValueError(f'shape {text!r} must be positive')
    return h, w


def fake_batch(model: nn.Module, shape: Tuple[int, int], batch_size: int = 1,
               device: DeviceLike = None):
    """``(inputs, data_samples)`` of ``batch_size`` images for ``model(..., mode='predict')``.

    Inputs are already normalized float32 tensors (what the data preprocessor produces) on
    ``device`` (default: where ``model``'s parameters are); sizes are padded to a multiple of
    32 like mmdet/mmseg test pipelines do.
    """
    h, w = shape
    ph, pw = -(-h // 32) * 32, -(-w // 32) * 32
    device = module_device(model) if device is None else torch.device(device)
    inputs = torch.randn(batch_size, 3, ph, pw, device=device)
    meta = dict(img_shape=(h, w), ori_shape=(h, w), pad_shape=(ph, pw),
                batch_input_shape=(ph, pw), scale_factor=(1.0, 1.0),
                flip=False, flip_direction=None)
    sample_type = SegDataSample if isinstance(model, BaseSegmentor) else DetDataSample
    return inputs, [sample_type(metainfo=dict(meta, img_id=i)) for i in range(batch_size)]


def autocast_call(fn: Callable[[], object], precision: str,
                  device_type: str) -> Callable[[], object]:
    """``fn`` run under ``torch.autocast(device_type, <precision's dtype>)``; ``'fp32'``:
    ``fn`` itself."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return fn

    def run():
        with torch.autocast(device_type, dtype=dtype):
            return fn()
    return run


def make_runners(model: nn.Module, shape: Tuple[int, int], part: str, batch_size: int = 1,
                 precision: str = 'fp32') -> Callable[[], object]:
    """A zero-argument callable running ``part`` ('backbone' or 'model') once on a
    :func:`fake_batch` on the model's device, in ``precision`` ('fp32', 'fp16', 'bf16').

    The backbone runs under ``torch.autocast`` as a whole. The whole model (``mode=
    'predict'``) runs its network parts under autocast and its post-processing in float32
    (:class:`~mmslab.utils.precision.AutocastRegions`): the first non-fp32 runner of a model
    sets the regions on it, and every whole-model runner of that model sets their dtype
    before it calls, so runners of several precisions share one model. Whether the device
    computes ``precision`` natively is the caller's check
    (:func:`~mmslab.utils.precision.check_autocast_precision`).
    """
    dtype = autocast_dtype(precision)
    inputs, samples = fake_batch(model, shape, batch_size)
    device_type = inputs.device.type
    if part == 'backbone':
        backbone = model.backbone if hasattr(model, 'backbone') else model
        return autocast_call(lambda: backbone(inputs), precision, device_type)
    if part == 'model':
        if dtype is not None and AutocastRegions.of(model) is None:
            AutocastRegions(model, None, device_type)

        def run():
            regions = AutocastRegions.of(model)
            if regions is not None:
                regions.dtype = dtype
            return model(inputs, samples, mode='predict')
        return run
    raise ValueError(f"part must be 'backbone' or 'model', got {part!r}")


def first_call_timed(fn: Callable, *args, device: DeviceLike = None) -> dict:
    """Seconds of the first call ``fn(*args)`` of a ``torch.compile``-d function (the
    compilation, if one happens there) and the number of graphs dynamo compiled during it.
    Runs under ``inference_mode`` like :func:`measure_interleaved` (the grad mode is part of
    a compiled graph's guards)."""
    from torch._dynamo.utils import counters
    before = counters['stats']['unique_graphs']
    with torch.inference_mode():
        seconds = timed_ms(lambda: fn(*args), device)[1] / 1000.0
    return dict(first_call_s=seconds, graphs_compiled=counters['stats']['unique_graphs'] - before)


def summarize(ms: Sequence[float]) -> dict:
    """The benchmark tools' summary of repeated runs."""
    s = latency_stats(ms)
    return dict(median_ms=s['median_ms'], mean_ms=s['mean_ms'], min_ms=s['min_ms'],
                max_ms=s['max_ms'], repeats=s['count'])


def trained_like_parameters(model: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Give every parameter that initialization left constant (zero biases, unit norm
    scales) a small random offset (normal, ``std``), as trained weights have; returns
    ``model``. Runtimes fold constant parameters away (OpenVINO drops an ``Add`` of zeros
    and a ``Multiply`` by ones), so random-init weights would hand a LayerNorm Swin's zero
    biases and unit norm scales a speed no trained model has, while the fused models, whose
    folded norms give every layer a bias, pay for theirs. Parameters named ``alpha``
    (PRepBN's mixing weight, which the callers set) and scalars are left as they are."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            if name.split('.')[-1] == 'alpha' or flat.numel() < 2 or \
                    not bool((flat == flat[0]).all()):
                continue
            p.add_(torch.randn(p.shape, generator=g).to(p) * std)
    return model


def save_report(report: dict, out_dir: str, stem: str,
                plot: Callable[[dict, str], None]) -> None:
    """Write ``out_dir/<stem>.json`` and the picture ``plot(report, out_dir/<stem>.png)``
    draws, and say so."""
    os.makedirs(out_dir, exist_ok=True)
    path = osp.join(out_dir, stem)
    with open(path + '.json', 'w') as f:
        json.dump(report, f, indent=2)
    plot(report, path + '.png')
    print(f'wrote {path}.json and {stem}.png')


def fused_copy(model: nn.Module) -> nn.Module:
    return reparameterize(copy.deepcopy(model).eval())
