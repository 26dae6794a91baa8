"""The arithmetic precision a model is evaluated in: fp32, bf16 (where the CPU has it), INT8,
or ``auto`` (the faster of fp32 and bf16, measured on the machine at hand).

* eager PyTorch bf16 (:class:`Bf16Regions`): the network parts of a detector / segmentor
  (backbone, neck, dense heads, the RoI heads' box and mask heads, decode heads) run under
  ``torch.autocast('cpu', torch.bfloat16)`` and hand float32 tensors back, so everything
  between and after them (box decoding, NMS, RoIAlign, mask pasting, the resize of the
  logits) computes in float32, as in an fp32 run;
* runtimes: see :mod:`mmslab.deploy.runtimes` (OpenVINO ``INFERENCE_PRECISION_HINT``);
* ``auto`` (:func:`auto_precision`) times fp32 and, where the CPU computes bf16 natively,
  bf16 on a real preprocessed batch and keeps bf16 only if it is at least
  ``AUTO_MARGIN`` times faster. It never chooses INT8: INT8 changes the model (its
  accuracy is the user's call, ``--precision int8``), bf16 only rounds its arithmetic.
"""
from typing import Callable, Dict, Iterator, Optional

import torch
import torch.nn as nn

from mmslab.deploy.runtimes import PRECISIONS  # ('fp32', 'bf16', 'int8')

#: What a model can be evaluated in; ``auto`` chooses between fp32 and bf16.
CHOICES = PRECISIONS + ('auto', )
#: bf16 must be this many times faster than fp32 for ``auto`` to choose it (timer noise of a
#: few warm runs on a shared machine is a few per cent).
AUTO_MARGIN = 1.05
AUTO_WARMUP = 1
AUTO_REPEAT = 3


# ----------------------------------------------------------------------------------------------
# eager bf16
# ----------------------------------------------------------------------------------------------

def _to_float32(obj):
    """Low-precision floating tensors of a nested output back to float32."""
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in (torch.bfloat16, torch.float16) else obj
    if isinstance(obj, tuple) and hasattr(obj, '_fields'):  # namedtuple
        return type(obj)(*(_to_float32(o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_float32(o) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _to_float32(v)) for k, v in obj.items())
    return obj


def _is_roi_head(module: nn.Module) -> bool:
    """mmdet's RoI heads: ``predict`` calls their box / mask heads, never their ``forward``."""
    try:
        from mmdet.models.roi_heads import BaseRoIHead
    except ImportError:  # mmseg only
        return False
    return isinstance(module, BaseRoIHead)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def network_parts(model: nn.Module) -> Iterator[nn.Module]:
    """The modules whose ``forward`` the test step calls and which hold the computation:
    the model's children except the data preprocessor (backbone, neck, RPN / dense heads,
    decode / auxiliary heads), with a RoI head replaced by its children (box and mask heads;
    the parameter-free RoI extractors stay float32) and module lists by their items."""
    def expand(module):
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):  # never called themselves
            for child in module.children():
                yield from expand(child)
        elif _is_roi_head(module):
            for child in module.children():
                yield from expand(child)
        elif _has_parameters(module):
            yield module

    for name, child in model.named_children():
        if name != 'data_preprocessor':
            yield from expand(child)


class Bf16Regions:
    """Run ``model``'s network parts (:func:`network_parts`) in bf16 during its ``predict``.

    Each part's ``forward`` is wrapped: inside ``predict`` (the test step's path) it runs
    under ``torch.autocast('cpu', dtype=torch.bfloat16)`` and its floating outputs are cast
    back to float32; elsewhere (``extract_feat`` / ``_forward`` called directly, as
    ``ReparamEvalHook``'s fused-vs-unfused check does) it runs in float32 as before.
    ``enabled`` switches bf16 off and on (``auto`` times both); :meth:`remove` restores
    the model.
    """

    def __init__(self, model: nn.Module, enabled: bool = True):
        self.model = model
        self.enabled = enabled
        self._active = 0
        self._patched = []
        for part in network_parts(model):
            self._wrap(part, 'forward', self._autocast)
        self._wrap(model, 'predict', self._region)
        if len(self._patched) < 2:
            self.remove()
            raise RuntimeError(f'bf16: found no network parts in {type(model).__name__} '
                               '(expected a detector or segmentor with a backbone)')

    def _wrap(self, module: nn.Module, name: str, make):
        if not hasattr(module, name):
            return
        had = name in vars(module)
        original = getattr(module, name)
        setattr(module, name, make(original))
        self._patched.append((module, name, had, original))

    def _region(self, fn: Callable) -> Callable:
        def predict(*args, **kwargs):
            self._active += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._active -= 1
        return predict

    def _autocast(self, fn: Callable) -> Callable:
        def forward(*args, **kwargs):
            if not (self.enabled and self._active):
                return fn(*args, **kwargs)
            with torch.autocast('cpu', dtype=torch.bfloat16):
                out = fn(*args, **kwargs)
            return _to_float32(out)
        return forward

    @property
    def num_parts(self) -> int:
        return len(self._patched) - 1

    def remove(self) -> None:
        for module, name, had, original in reversed(self._patched):
            if had:
                setattr(module, name, original)
            elif name in vars(module):
                delattr(module, name)
        self._patched = []


# ----------------------------------------------------------------------------------------------
# auto
# ----------------------------------------------------------------------------------------------

def auto_precision(candidates: Dict[str, Callable[[], object]], bf16_available: bool,
                   why_not_bf16: Optional[str] = None, warmup: int = AUTO_WARMUP,
                   repeat: int = AUTO_REPEAT, margin: float = AUTO_MARGIN) -> dict:
    """Time ``candidates`` ({'fp32': fn, 'bf16': fn}, interleaved, medians) and choose.

    bf16 is a candidate only if ``bf16_available`` (``why_not_bf16`` says why not, e.g. a
    CPU without bf16 units or onnxruntime); with fp32 alone nothing is timed. Returns the
    record written to ``metrics.json``: ``choice``, ``times_ms`` (medians), ``candidates``,
    ``warmup``, ``repeat``, ``margin`` and ``reason``."""
    from mmslab.benchmark import measure_interleaved
    from mmslab.utils.timing import latency_stats
    names = ['fp32'] + (['bf16'] if bf16_available and 'bf16' in candidates else [])
    record = dict(candidates=names, warmup=warmup, repeat=repeat, margin=margin, times_ms={})
    if names == ['fp32']:
        record.update(choice='fp32', reason=f"fp32 only: {why_not_bf16 or 'no bf16 candidate'}")
        return record
    times = measure_interleaved({n: candidates[n] for n in names}, repeat, warmup)
    medians = {n: latency_stats(t)['median_ms'] for n, t in times.items()}
    record['times_ms'] = medians
    faster = medians['bf16'] * margin < medians['fp32']
    record['choice'] = 'bf16' if faster else 'fp32'
    record['reason'] = (f"bf16 {medians['bf16']:.1f} ms vs fp32 {medians['fp32']:.1f} ms "
                        f"(median of {repeat}): bf16 " +
                        ('is' if faster else 'is not') + f' at least {margin:g}x faster')
    return record


def first_test_batch(runner):
    """The first batch of the runner's test dataloader (a real image, as the loop sees it)."""
    return next(iter(runner.test_dataloader))
