"""Evaluate the re-parameterized (fused) model and measure per-image latency."""
import copy
import json
import logging
import os.path as osp
from typing import Optional

import torch
import torch.nn as nn
from mmdet.models.detectors import BaseDetector
from mmengine.dist import all_gather_object, get_world_size, is_main_process
from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.model import is_model_wrapper

from mmslab.models.layers.reparameterizable import Reparameterizable
from mmslab.models.reparam import reparameterize
from mmslab.registry import register_hook
from mmslab.utils.machine import machine_info
from mmslab.utils.precision import (AutocastRegions, autocast_dtype,
                                    check_autocast_precision, ieee_float32)
from mmslab.utils.timing import latency_stats, module_device, timed_ms, timing_method


def _flatten_tensors(obj, out=None):
    """Tensors of a nested output (tuples, lists, dicts, data samples) in a stable order."""
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _flatten_tensors(o, out)
    elif isinstance(obj, dict):
        for k in sorted(obj):
            _flatten_tensors(obj[k], out)
    return out


def max_relative_difference(a, b) -> float:
    """Largest ``|a - b| / max|a|`` over matching tensors of two nested outputs."""
    ta, tb = _flatten_tensors(a), _flatten_tensors(b)
    if len(ta) != len(tb):
        raise RuntimeError(f'fused model returned {len(tb)} tensors, unfused {len(ta)}')
    worst = 0.0
    for x, y in zip(ta, tb):
        if x.shape != y.shape:
            raise RuntimeError(f'fused output shape {tuple(y.shape)} != unfused {tuple(x.shape)}')
        if x.numel() == 0 or not x.is_floating_point():
            continue
        scale = x.abs().max().clamp_min(1e-6)
        worst = max(worst, ((x - y).abs().max() / scale).item())
    return worst


def comparable_outputs(model: nn.Module, data: dict):
    """Outputs that are continuous functions of the input, for the equivalence check.

    Detectors: the neck features (``extract_feat``); their raw head outputs go through
    proposal NMS, where a 1e-7 change may pick other boxes. Segmentors: the logits.
    """
    if isinstance(model, BaseDetector):
        return model.extract_feat(data['inputs'])
    return model(**data, mode='tensor')


def first_divergent_module(unfused: nn.Module, fused: nn.Module, data: dict, tol: float):
    """Run both models with forward hooks; return ``(name, type, diff)`` of the first module
    (in execution order, innermost first) whose output differs by more than ``tol``.

    Only modules whose output fusion preserves are compared: same name and type in both
    models, and not one whose output fusion changes by design (named by the
    ``fusion_changed_outputs()`` of a module above it).
    """
    records = {'u': {}, 'f': {}}
    order = []
    names_f = dict(fused.named_modules())
    changed = fusion_changed_modules(fused)
    handles = []
    for name, m in unfused.named_modules():
        if not name or name not in names_f:
            continue
        other = names_f[name]
        if type(other) is not type(m) or name in changed:
            continue

        def hook_u(mod, inp, out, name=name):
            if name not in records['u']:
                order.append(name)
                records['u'][name] = (type(mod).__name__, out)

        def hook_f(mod, inp, out, name=name):
            records['f'].setdefault(name, out)

        handles.append(m.register_forward_hook(hook_u))
        handles.append(names_f[name].register_forward_hook(hook_f))
    try:
        with torch.no_grad():
            comparable_outputs(unfused, data)
            comparable_outputs(fused, data)
    finally:
        for h in handles:
            h.remove()
    for name in order:
        if name not in records['f']:
            continue
        mod_type, out_u = records['u'][name]
        try:
            diff = max_relative_difference(out_u, records['f'][name])
        except RuntimeError:
            continue
        if diff > tol:
            return name, mod_type, diff
    return None


def fusion_changed_modules(model: nn.Module) -> set:
    """Qualified names of the modules of a fused ``model`` whose output differs from the
    unfused model's by design (see ``Reparameterizable.fusion_changed_outputs``)."""
    changed = set()
    for prefix, m in model.named_modules():
        if isinstance(m, Reparameterizable):
            changed.update('.'.join(p for p in (prefix, child) if p)
                           for child in m.fusion_changed_outputs())
    return changed


def fusion_difference(unfused: nn.Module, fused: nn.Module, data: dict, tolerance: float):
    """Compare a fused model with its unfused source on one preprocessed batch ``data``, in
    IEEE float32 whatever the process's TF32 / reduced-precision settings
    (:func:`mmslab.utils.precision.ieee_float32`).

    Returns ``(diff, where)``: the largest relative difference of :func:`comparable_outputs`
    and, when it exceeds ``tolerance``, ``(name, type, diff)`` of the first module that
    diverged (:func:`first_divergent_module`), else None."""
    with ieee_float32(), torch.no_grad():
        diff = max_relative_difference(comparable_outputs(unfused, data),
                                       comparable_outputs(fused, data))
        where = first_divergent_module(unfused, fused, data, tolerance) \
            if diff > tolerance else None
    return diff, where


def fusion_mismatch_message(diff: float, tolerance: float, where) -> str:
    detail = f' first at {where[0]} ({where[1]}, diff {where[2]:.3g})' if where else ''
    return (f'the fused model differs from the unfused one by {diff:.3g} (relative, float32 '
            f'tolerance {tolerance}):{detail}')


def verify_fusion(unfused: nn.Module, fused: nn.Module, images, tolerance: float = 1e-3) -> float:
    """Raise ``RuntimeError`` naming the first diverging module where ``fused`` differs from
    ``unfused`` by more than ``tolerance`` on any of ``images`` (preprocessed ``[1, 3, H, W]``
    arrays or tensors); returns the largest difference. For the tools that write a fused
    model (``tools/reparameterize.py``, ``tools/export_onnx.py``): they fail loudly."""
    worst = 0.0
    for image in images:
        data = dict(inputs=torch.as_tensor(image))
        diff, where = fusion_difference(unfused, fused, data, tolerance)
        if diff > tolerance:
            raise RuntimeError(fusion_mismatch_message(diff, tolerance, where))
        worst = max(worst, diff)
    return worst


#: What a failed fusion check does: ``'raise'``; ``'log'``: log an error and evaluate the
#: unfused model; ``'auto'``: ``'log'`` in the validation of a training run, ``'raise'`` in
#: a test run (``tools/test.py``).
ON_MISMATCH = ('auto', 'raise', 'log')


def _summary(times_ms):
    """Per-image latency figures of latency.json."""
    if not times_ms:
        return dict(count=0)
    s = latency_stats(times_ms)
    mean = s['mean_ms']
    return dict(count=s['count'], mean_ms=mean, median_ms=s['median_ms'], p90_ms=s['p90_ms'],
                images_per_s=1000.0 / mean if mean > 0 else float('inf'))


@register_hook()
class ReparamEvalHook(Hook):
    """Validate and test on a fused deep copy of the model, and time it per image.

    Before the val/test loop a deep copy of the (unwrapped) model is re-parameterized with
    :func:`mmslab.reparameterize` and swapped in; the training model itself is never
    modified and is swapped back in ``after_val_epoch``/``after_test_epoch`` before any other
    hook (such as ``CheckpointHook``'s save-best) runs, so saved checkpoints never hold fused
    weights. With a DDP-wrapped model each rank fuses its own inner module.

    Args:
        reparam (bool): evaluate the fused copy (False: evaluate the model as is, still
            timed). Default: True.
        check_equivalence (bool): on the first batch of each run compare the fused and
            unfused models' neck features (detectors) or logits (segmentors) in IEEE float32,
            with TF32 and reduced-precision float32 turned off for the comparison and
            restored after it (:func:`fusion_difference`). A difference above ``tolerance``
            names the first module that diverged and is handled as ``on_mismatch`` says.
            Default: True.
        tolerance (float): relative tolerance of that check (to the largest output), a
            float32 tolerance whatever ``precision`` the evaluation runs in: a correct fold
            differs by float32 rounding, TF32 rounding alone by about as much as this.
            Default: 1e-3.
        on_mismatch (str): what a failed check does: ``'raise'`` an error; ``'log'`` an
            error in the log, then evaluate (and time) the unfused model, so that the
            metrics are those of the trained model and training goes on; ``'auto'``:
            ``'log'`` in a validation, ``'raise'`` in a test run (``tools/test.py``). Every
            rank takes the same decision. Default: 'auto'.
        measure_latency (bool): time preprocessing + forward + post-processing per image
            (data loading excluded), after ``warmup`` batches: on a CUDA device with CUDA
            events, on the CPU with ``time.perf_counter``
            (:func:`mmslab.utils.timing.timed_ms`). Default: True.
        warmup (int): batches not timed; an evaluation of no more batches than this times
            its last one (and says so in the log). Default: 2.
        compare_unfused (bool): also time the unfused model on the same batches,
            alternating which runs first, and report the ratio. The unfused model runs in the
            fused model's precision (this hook's ``precision`` or ``PrecisionHook``'s).
            Default: False.
        precision (str): 'fp32', 'fp16' or 'bf16': the evaluated model's network parts
            (backbone, neck, heads) run under ``torch.autocast`` inside ``predict``, float32
            in between and after (:class:`mmslab.utils.precision.AutocastRegions`). fp16
            needs a CUDA device, bf16 a GPU of compute capability 8.0+ or a CPU with
            avx512_bf16 / amx_bf16 (checked when the evaluation starts). Excludes
            ``PrecisionHook``. Default: 'fp32'.
        out_file (str): name of the JSON written to the work dir: the latency figures with
            the ``device``, ``precision``, ``timing`` method and ``machine``
            (:func:`mmslab.utils.machine.machine_info`), the ``fusion_check`` (its
            ``result``: passed, failed or not run, and ``tolerance``), and ``timed``: what
            the ``fused`` figures timed: ``'fused'``, ``'as is'``, ``'unfused: the fusion
            check failed'`` or, when ``RuntimeBackendHook`` runs an export in the test loop,
            the deployed form (``'deployed: openvino int8 whole model'``).
            Default: 'latency.json'.
    """

    priority = 'VERY_HIGH'  # runs before CheckpointHook (VERY_LOW) in after_val_epoch

    def __init__(self, reparam: bool = True, check_equivalence: bool = True,
                 tolerance: float = 1e-3, on_mismatch: str = 'auto',
                 measure_latency: bool = True, warmup: int = 2,
                 compare_unfused: bool = False, precision: str = 'fp32',
                 out_file: str = 'latency.json'):
        if on_mismatch not in ON_MISMATCH:
            raise ValueError(f'ReparamEvalHook: on_mismatch={on_mismatch!r}; valid: '
                             + ', '.join(repr(c) for c in ON_MISMATCH))
        if warmup < 0:
            raise ValueError(f'warmup must be >= 0, got {warmup}')
        try:
            autocast_dtype(precision)
        except ValueError as err:
            raise ValueError(f'ReparamEvalHook: {err}') from None
        if tolerance <= 0:
            raise ValueError(f'tolerance must be > 0, got {tolerance}')
        self.reparam = reparam
        self.check_equivalence = check_equivalence
        self.tolerance = tolerance
        self.on_mismatch = on_mismatch
        self.measure_latency = measure_latency
        self.warmup = warmup
        self.compare_unfused = compare_unfused
        self.precision = precision
        self.out_file = out_file
        self._checked = False
        self._saved_model = None
        self._active = None
        self.last_result: Optional[dict] = None

    # -- swapping --------------------------------------------------------------------------
    @staticmethod
    def _inner(model):
        return model.module if is_model_wrapper(model) else model

    def _enter(self, runner, mode: str) -> None:
        original = runner.model
        inner = self._inner(original)
        device = module_device(inner)
        if self.precision != 'fp32':  # before anything changes
            check_autocast_precision(self.precision, device, 'ReparamEvalHook')
        was_training = inner.training
        inner.eval()
        if self.reparam:
            # building the fused layers draws initial weights: not from the training's stream
            cuda = [device.index or 0] if device.type == 'cuda' and torch.cuda.is_available() \
                else []
            with torch.random.fork_rng(devices=cuda):
                fused = reparameterize(copy.deepcopy(inner))
        else:
            fused = inner
        self._saved_model = (original, was_training)
        self._active = dict(mode=mode, inner=inner, fused=fused, fused_ms=[], unfused_ms=[],
                            batches=0, max_diff=None, device=device, precision='fp32',
                            regions=[], unfused_fallback=False, check=None,
                            warmup=self._warmup_batches(runner, mode))
        if self.precision != 'fp32':
            self._active['regions'].append(
                AutocastRegions(fused, autocast_dtype(self.precision), device.type))
        self._wrap_step(fused, mode)
        runner.model = fused  # the loop calls runner.model.val_step/test_step on the copy

    def _warmup_batches(self, runner, mode: str) -> int:
        """``warmup``, or where this rank's evaluation has no more batches than that, all
        but its last: a short evaluation is timed on one batch rather than on none."""
        loop = getattr(runner, f'{mode}_loop', None)
        try:
            batches = len(loop.dataloader)
        except (AttributeError, TypeError):  # no loop, or a loader of unknown length
            return self.warmup
        if not self.measure_latency or batches > self.warmup:
            return self.warmup
        warmup = max(batches - 1, 0)
        print_log(f'ReparamEvalHook: warmup={self.warmup} batches, but this {mode} has '
                  f'{batches}: the latency is of its last batch, after {warmup} of warm-up',
                  logger='current', level=logging.WARNING)
        return warmup

    def _exit(self, runner) -> None:
        if self._saved_model is None:
            return
        original, was_training = self._saved_model
        runner.model = original
        self._inner(original).train(was_training)
        active = self._active
        fused = active['fused']
        step_name = 'val_step' if active['mode'] == 'val' else 'test_step'
        if step_name in vars(fused):
            delattr(fused, step_name)  # drop the timing wrapper (matters when not fused)
        for regions in reversed(active['regions']):  # this hook's: the training model's too
            regions.remove()
        self._saved_model = None
        if self.measure_latency:
            self._report(runner)
        self._active = None

    def _wrap_step(self, fused: nn.Module, mode: str) -> None:
        step_name = 'val_step' if mode == 'val' else 'test_step'
        fused_step = getattr(fused, step_name)
        active = self._active
        inner = active['inner']
        unfused_step = getattr(inner, step_name)
        compare = self.compare_unfused and self.reparam

        def timed(data_batch):
            if self.reparam and self.check_equivalence and not self._checked and \
                    active['check'] is None:  # once per run, until one passes
                self._check(inner, fused, data_batch)
            fallback = active['unfused_fallback']
            n_img = len(data_batch['inputs']) if isinstance(data_batch, dict) else 1
            timed_run = self.measure_latency and active['batches'] >= active['warmup']
            fused_regions = AutocastRegions.of(fused)  # this hook's or PrecisionHook's
            active['precision'] = fused_regions.precision if fused_regions else 'fp32'
            # 'fused': the evaluated model, the unfused one after a failed check
            order = [('fused', unfused_step if fallback else fused_step)]
            if compare and not fallback:
                self._match_precision(inner, fused_regions)
                order.append(('unfused', unfused_step))
                if active['batches'] % 2:
                    order.reverse()
            result = None
            for label, fn in order:
                out, dt = timed_ms(lambda: fn(data_batch), active['device'])
                dt /= max(n_img, 1)
                if label == 'fused':
                    result = out
                if timed_run:
                    active[f'{label}_ms'].extend([dt] * n_img)
            active['batches'] += 1
            return result

        setattr(fused, step_name, timed)

    def _match_precision(self, inner: nn.Module, fused_regions) -> None:
        """Run the unfused model in the fused model's current precision (for a fair ratio):
        autocast regions on it, created on first need and removed in ``_exit``."""
        regions = AutocastRegions.of(inner)
        if regions is None:
            if fused_regions is None or fused_regions.dtype is None:
                return
            regions = AutocastRegions(inner, fused_regions.dtype, fused_regions.device_type)
            self._active['regions'].append(regions)
        regions.dtype = fused_regions.dtype if fused_regions is not None else None

    def _check(self, inner: nn.Module, fused: nn.Module, data_batch) -> None:
        with torch.no_grad():
            data = inner.data_preprocessor(data_batch, False)
        diff, where = fusion_difference(inner, fused, data, self.tolerance)
        self._active['max_diff'] = diff
        failed = diff > self.tolerance
        if get_world_size() > 1:  # one decision for every rank: no rank waits on another
            failed = any(all_gather_object(failed))
        self._active['check'] = 'failed' if failed else 'passed'
        if not failed:
            self._checked = True
            return
        message = fusion_mismatch_message(diff, self.tolerance, where)
        action = self.on_mismatch
        if action == 'auto':
            action = 'log' if self._active['mode'] == 'val' else 'raise'
        if action == 'raise':
            raise RuntimeError(message)
        # checked again at the next validation: a wrong fold stays visible in every one
        print_log(f'ReparamEvalHook: {message}. This validation evaluates the unfused '
                  'model; training goes on.', logger='current', level=logging.ERROR)
        self._active['unfused_fallback'] = True
        self._match_precision(inner, AutocastRegions.of(fused))

    def _report(self, runner) -> None:
        active = self._active
        # Each rank timed its own share of the images: gather them so the figures (and the
        # JSON rank 0 writes) cover the whole evaluation set.
        world_size = get_world_size()
        per_rank = all_gather_object(dict(fused=active['fused_ms'], unfused=active['unfused_ms'],
                                          max_diff=active['max_diff']))
        fused_ms = [t for r in per_rank for t in r['fused']]
        unfused_ms = [t for r in per_rank for t in r['unfused']]
        diffs = [r['max_diff'] for r in per_rank if r['max_diff'] is not None]
        fused = _summary(fused_ms)
        device = active['device']
        result = dict(mode=active['mode'], reparameterized=self.reparam, device=str(device),
                      precision=active['precision'], timing=timing_method(device),
                      threads=torch.get_num_threads(), warmup_batches=active['warmup'],
                      world_size=world_size, images=len(fused_ms),
                      images_per_rank=[len(r['fused']) for r in per_rank],
                      fused=fused, max_relative_difference=max(diffs) if diffs else None)
        if fused['count'] == 0 and active['batches']:
            runner.logger.warning(
                f"ReparamEvalHook: no batch was timed: the {active['batches']} that ran were "
                f"all warm-up (warmup={active['warmup']})")
            result['fused'] = dict(count=0, note='all batches were warm-up')
        if self.compare_unfused and self.reparam:
            unfused = _summary(unfused_ms)
            result['unfused'] = unfused
            if unfused.get('count') and fused.get('count'):
                result['speedup_median'] = unfused['median_ms'] / fused['median_ms']
        result['machine'] = machine_info(device)
        deployed = self._deployed_form(runner)
        result['timed'] = deployed or ('fused' if self.reparam else 'as is')
        if active['unfused_fallback']:
            result['timed'] = 'unfused: the fusion check failed'
        result['fusion_check'] = dict(result=active['check'] or 'not run',
                                      tolerance=self.tolerance)
        self.last_result = result
        what = deployed or f"{result['timed']}, {device} {active['precision']}"
        lines = [f"{active['mode']} latency per image ({what}): "
                 f"median {fused.get('median_ms', float('nan')):.1f} ms, "
                 f"mean {fused.get('mean_ms', float('nan')):.1f} ms, "
                 f"p90 {fused.get('p90_ms', float('nan')):.1f} ms, "
                 f"{fused.get('images_per_s', float('nan')):.2f} img/s over {fused['count']} images"
                 + (f' of {world_size} ranks' if world_size > 1 else '')]
        if 'unfused' in result:
            lines.append(f"unfused{' PyTorch model' if deployed else ''}: median "
                         f"{result['unfused'].get('median_ms', float('nan')):.1f} ms; speedup "
                         f"{result.get('speedup_median', float('nan')):.2f}x")
        for line in lines:
            runner.logger.info(line)
        scalars = {f"latency/{active['mode']}_fused_median_ms": fused.get('median_ms', 0.0)}
        if 'speedup_median' in result:
            scalars[f"latency/{active['mode']}_speedup"] = result['speedup_median']
        runner.visualizer.add_scalars(scalars, step=runner.iter)
        if is_main_process():
            with open(osp.join(runner.work_dir, self.out_file), 'w') as f:
                json.dump(result, f, indent=2)

    @staticmethod
    def _deployed_form(runner) -> Optional[str]:
        """What the timed steps ran when another hook swapped an exported form into the fused
        copy (``RuntimeBackendHook.deployed_form``, e.g. ``'deployed: openvino int8 whole
        model'``); ``None`` when the fused (or as-is) PyTorch model ran. Asked in
        ``after_*_epoch``, where that hook (priority HIGH, after this one) still holds it."""
        for hook in getattr(runner, 'hooks', ()):
            form = getattr(hook, 'deployed_form', None)
            if callable(form) and form() is not None:
                return f'deployed: {form()}'
        return None

    # -- mmengine hook points --------------------------------------------------------------
    def before_val_epoch(self, runner) -> None:
        self._enter(runner, 'val')

    def after_val_epoch(self, runner, metrics=None) -> None:
        self._exit(runner)

    def before_test_epoch(self, runner) -> None:
        self._enter(runner, 'test')

    def after_test_epoch(self, runner, metrics=None) -> None:
        self._exit(runner)

