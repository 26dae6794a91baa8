"""The arithmetic precision a model is evaluated in: fp32, bf16 (where the CPU has it), INT8,
or ``auto`` (the faster of fp32 and bf16, measured on the machine at hand).

* eager PyTorch bf16 (:class:`Bf16Regions`) and, for timing on a GPU, fp16
  (:class:`AutocastRegions`): the network parts of a detector / segmentor (backbone, neck,
  dense heads, the RoI heads' box and mask heads, decode heads) run under
  ``torch.autocast(device, dtype)`` and hand float32 tensors back, so everything between
  and after them (box decoding, NMS, RoIAlign, mask pasting, the resize of the logits)
  computes in float32, as in an fp32 run;
* runtimes: see :mod:`mmslab.deploy.runtimes` (OpenVINO ``INFERENCE_PRECISION_HINT``), whose
  ``resolve_precision`` reads the precision arguments of the tools (this module imports
  nothing of ``mmslab.deploy`` or ``mmslab.benchmark``: the engine's hooks import it);
* ``auto`` (:func:`auto_precision`) times fp32 and, where the CPU computes bf16 natively,
  bf16 on a real preprocessed batch and keeps bf16 only if it is at least
  ``AUTO_MARGIN`` times faster. It never chooses INT8: INT8 changes the model (its
  accuracy is the user's call, ``--precision int8``), bf16 only rounds its arithmetic.
"""
import contextlib
from typing import Callable, Dict, Iterator, Optional

import torch
import torch.nn as nn

#: Autocast precisions of eager PyTorch timing (``tools/benchmark.py --precisions``,
#: ``benchmarks/backbone_speed.py``, ``ReparamEvalHook(precision=...)``): name -> dtype.
PRECISION_DTYPES = dict(fp32=None, fp16=torch.float16, bf16=torch.bfloat16)
#: bf16 must be this many times faster than fp32 for ``auto`` to choose it (timer noise of a
#: few warm runs on a shared machine is a few per cent).
AUTO_MARGIN = 1.05
AUTO_WARMUP = 1
AUTO_REPEAT = 3


# ----------------------------------------------------------------------------------------------
# IEEE float32
# ----------------------------------------------------------------------------------------------

#: ``torch.backends`` objects with an ``fp32_precision``, parents before children; the
#: dotted ones are the operators' own settings
_FP32_PRECISION_NODES = ('', 'cuda.matmul', 'cudnn', 'cudnn.conv', 'cudnn.rnn', 'mkldnn',
                         'mkldnn.matmul', 'mkldnn.conv', 'mkldnn.rnn')


def _float32_precision_settings():
    """``(object, attribute, leaf)`` of each float32-precision setting this torch has: the
    per-backend ``fp32_precision`` strings (parents before children, so restoring them in this
    order ends with the children's own values), or the legacy ``allow_tf32`` flags on a torch
    without them."""
    backends = torch.backends
    if hasattr(getattr(backends.cuda, 'matmul', None), 'fp32_precision'):
        settings = []
        for name in _FP32_PRECISION_NODES:
            obj = backends
            for part in filter(None, name.split('.')):
                obj = getattr(obj, part, None)
            if obj is not None and hasattr(obj, 'fp32_precision'):
                settings.append((obj, 'fp32_precision', '.' in name))
        return settings
    return [(backends.cuda.matmul, 'allow_tf32', True), (backends.cudnn, 'allow_tf32', True)]


@contextlib.contextmanager
def ieee_float32():
    """Compute float32 as float32 inside, whatever the process chose: no TF32 in CUDA matmuls
    or cuDNN convolutions (PyTorch's default for cuDNN on Ampere and newer GPUs), no reduced
    precision in oneDNN, ``torch.get_float32_matmul_precision() == 'highest'``, autocast off.
    Every setting is restored on exit, by an exception too.

    A comparison of two float32 computations (a fused model against its unfused source) is
    only meaningful at full precision: TF32 rounds the inputs of each product to 10 mantissa
    bits, a relative error near 1e-3 after a deep network, the size of a wrong fold."""
    settings = _float32_precision_settings()
    saved = [getattr(obj, attr) for obj, attr, _ in settings]
    saved_matmul = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision('highest')
        for obj, attr, leaf in settings:
            if leaf:  # the operators' own settings (a parent's 'none' defers to them)
                setattr(obj, attr, False if attr == 'allow_tf32' else 'ieee')
        with contextlib.ExitStack() as stack:
            for device_type in ('cpu', 'cuda'):
                if device_type == 'cpu' or torch.cuda.is_available():
                    stack.enter_context(torch.autocast(device_type, enabled=False))
            yield
    finally:
        torch.set_float32_matmul_precision(saved_matmul)
        for (obj, attr, _), value in zip(settings, saved):
            setattr(obj, attr, value)


# ----------------------------------------------------------------------------------------------
# eager autocast (bf16, fp16)
# ----------------------------------------------------------------------------------------------

def float32_outputs(obj):
    """Low-precision floating tensors of a nested output back to float32."""
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in (torch.bfloat16, torch.float16) else obj
    if isinstance(obj, tuple) and hasattr(obj, '_fields'):  # namedtuple
        return type(obj)(*(float32_outputs(o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(float32_outputs(o) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, float32_outputs(v)) for k, v in obj.items())
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


class AutocastRegions:
    """Run ``model``'s network parts (:func:`network_parts`) under ``torch.autocast`` during
    its ``predict``.

    Each part's ``forward`` is wrapped: inside ``predict`` (the test step's path, and
    ``model(..., mode='predict')``) it runs under ``torch.autocast(device_type, dtype)`` and
    its floating outputs are cast back to float32, so everything between and after the parts
    (box decoding, NMS, RoIAlign, mask pasting, resizing) computes in float32; elsewhere
    (``extract_feat`` / ``_forward`` called directly, as ``ReparamEvalHook``'s fused-vs-
    unfused check does) it runs in float32 as before.

    Args:
        model: a detector or segmentor.
        dtype: ``torch.bfloat16`` or ``torch.float16``; ``None``: off (float32). It may be
            changed between calls (the timing tools switch one model between precisions).
        device_type: of ``torch.autocast``; default: where ``model``'s parameters are.

    A model has at most one set of regions (:meth:`of` finds it): a second is refused, as
    ``PrecisionHook`` (``tools/test.py --precision``) and ``ReparamEvalHook(precision=...)``
    on the same model would nest. :meth:`remove` restores the model.
    """

    _ATTR = '_mmslab_autocast_regions'

    def __init__(self, model: nn.Module, dtype: Optional[torch.dtype] = torch.bfloat16,
                 device_type: Optional[str] = None):
        existing = AutocastRegions.of(model)
        if existing is not None:
            raise RuntimeError(
                f'{type(model).__name__} already runs its network parts under autocast '
                f'({existing.precision}); one precision at a time: ReparamEvalHook(precision=) '
                'and PrecisionHook (tools/test.py --precision) exclude each other')
        if dtype == torch.float32:
            dtype = None
        if dtype not in PRECISION_DTYPES.values():
            raise ValueError(f'autocast dtype {dtype}; valid: torch.float16, torch.bfloat16, '
                             'None (float32)')
        from mmslab.utils.timing import module_device
        self.model = model
        self.dtype = dtype
        self.device_type = device_type or module_device(model).type
        self._active = 0
        self._patched = []
        for part in network_parts(model):
            self._wrap(part, 'forward', self._autocast)
        self._wrap(model, 'predict', self._region)
        if len(self._patched) < 2:
            self.remove()
            raise RuntimeError(f'autocast: found no network parts in {type(model).__name__} '
                               '(expected a detector or segmentor with a backbone)')
        setattr(model, self._ATTR, self)

    @classmethod
    def of(cls, model: nn.Module) -> Optional['AutocastRegions']:
        """The regions set on ``model``, or None."""
        return vars(model).get(cls._ATTR)

    @property
    def precision(self) -> str:
        """What the parts compute in now: ``'fp32'``, ``'fp16'`` or ``'bf16'``."""
        return precision_name(self.dtype)

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

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
            if self.dtype is None or not self._active:
                return fn(*args, **kwargs)
            with torch.autocast(self.device_type, dtype=self.dtype):
                out = fn(*args, **kwargs)
            return float32_outputs(out)
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
        if AutocastRegions.of(self.model) is self:
            delattr(self.model, self._ATTR)


class Bf16Regions(AutocastRegions):
    """:class:`AutocastRegions` in bf16 that ``enabled`` switches on and off (``auto`` times
    both): the eager bf16 evaluation of ``PrecisionHook``."""

    def __init__(self, model: nn.Module, enabled: bool = True):
        super().__init__(model, torch.bfloat16 if enabled else None)

    @AutocastRegions.enabled.setter
    def enabled(self, value: bool) -> None:
        self.dtype = torch.bfloat16 if value else None


# ----------------------------------------------------------------------------------------------
# autocast precisions of the timing tools and ReparamEvalHook
# ----------------------------------------------------------------------------------------------

def precision_name(dtype: Optional[torch.dtype]) -> str:
    """``None`` / ``torch.float32`` -> ``'fp32'``, ``torch.float16`` -> ``'fp16'``,
    ``torch.bfloat16`` -> ``'bf16'``."""
    for name, value in PRECISION_DTYPES.items():
        if value == dtype:
            return name
    if dtype == torch.float32:
        return 'fp32'
    raise ValueError(f'no precision name for {dtype}; valid: {", ".join(PRECISION_DTYPES)}')


def autocast_dtype(precision: str) -> Optional[torch.dtype]:
    """The autocast dtype of ``precision`` (``'fp32'``: None, no autocast)."""
    if precision not in PRECISION_DTYPES:
        raise ValueError(f'precision {precision!r}; valid: {", ".join(PRECISION_DTYPES)}')
    return PRECISION_DTYPES[precision]


def check_autocast_precision(precision: str, device, what: str = 'eager PyTorch') -> None:
    """Refuse an autocast ``precision`` that ``device`` does not compute natively.

    * fp16 on the CPU: refused (PyTorch's CPU fp16 kernels are not faster than fp32 and the
      timing would mean nothing); fp16 is a GPU precision;
    * bf16 on the CPU: :func:`mmslab.utils.machine.require_bf16` (avx512_bf16 / amx_bf16);
    * bf16 on a CUDA device: compute capability 8.0+ (:func:`no_cuda_bf16_reason`).

    Raises ``ValueError`` (unknown precision, fp16 on the CPU) or ``RuntimeError`` (no bf16
    units), naming what is valid.
    """
    autocast_dtype(precision)  # a known name
    device = torch.device(device)
    if precision == 'fp16' and device.type == 'cpu':
        raise ValueError(f'{what} fp16 on the CPU: PyTorch has no fast CPU fp16 path, so the '
                         'figure would mean nothing. Valid on cpu: fp32, bf16 (CPUs with '
                         'avx512_bf16 / amx_bf16); fp16 needs a CUDA device (--device cuda)')
    if precision == 'bf16':
        if device.type == 'cpu':
            from mmslab.utils.machine import require_bf16
            require_bf16(f'{what} bf16')
        elif device.type == 'cuda':
            why_not = no_cuda_bf16_reason(device)
            if why_not:
                raise RuntimeError(f'{what} bf16 on {device}: {why_not}. Valid: fp32, fp16')


def no_cuda_bf16_reason(device) -> Optional[str]:
    """Why the CUDA ``device`` has no native bf16 (compute capability below 8.0), or None.
    (``torch.cuda.is_bf16_supported()`` also accepts emulated bf16, which is slow.)"""
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 8:
        return None
    return (f'this GPU ({torch.cuda.get_device_name(device)}, compute capability '
            f'{major}.{minor}) has no bf16 support (8.0+ needed)')


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
    from mmslab.utils.timing import latency_stats, measure_interleaved
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
