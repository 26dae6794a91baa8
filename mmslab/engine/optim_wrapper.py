"""Mixed-precision training: bf16 autocast on CPU, and the choice of wrapper for ``--amp``.

mmengine's ``AmpOptimWrapper`` runs only where there is a GPU (or NPU / MLU / MUSA): its
constructor asserts one. :class:`CPUAmpOptimWrapper` is its CPU counterpart: the model's
network parts run under :func:`cpu_autocast` (``torch.autocast('cpu', dtype=torch.bfloat16)``
with LayerNorm in float32, see there), post-processing and losses in float32. bf16 keeps
fp32's exponent range, so the loss needs no scaling (no ``GradScaler``); parameters,
gradients and optimizer state stay float32.

:func:`amp_optim_wrapper_cfg` decides what ``tools/train.py --amp`` does on the machine at
hand (device, bf16 units, requested dtype, the config's wrapper); it is pure, so every branch
is tested without a GPU.
"""
import copy
import threading
from contextlib import contextmanager
from typing import Iterator, Optional, Union

import torch
import torch.nn as nn
from mmengine.optim import OptimWrapper

from mmslab.registry import register_optim_wrapper

#: What ``--amp-dtype`` accepts.
AMP_DTYPES = ('float16', 'bfloat16')
#: Devices where mmengine's ``AmpOptimWrapper`` runs (its constructor asserts one of them).
AMP_ACCELERATORS = ('cuda', 'npu', 'mlu', 'musa')
#: Optimizer wrappers ``--amp`` turns into an AMP wrapper, or keeps.
PLAIN_WRAPPER, GPU_AMP_WRAPPER, CPU_AMP_WRAPPER = ('OptimWrapper', 'AmpOptimWrapper',
                                                   'CPUAmpOptimWrapper')
AMP_INPUT_WRAPPERS = (PLAIN_WRAPPER, GPU_AMP_WRAPPER, CPU_AMP_WRAPPER)


def _dtype_name(dtype: Union[str, torch.dtype, None]) -> Optional[str]:
    """``torch.bfloat16`` / ``'bfloat16'`` -> ``'bfloat16'``; None stays None."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).replace('torch.', '')
    return dtype


# ----------------------------------------------------------------------------------------------
# CPU autocast with LayerNorm in float32
# ----------------------------------------------------------------------------------------------

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_state = threading.local()  # .depth: cpu_autocast contexts open in this thread
_layer_norm_library = None  # the torch.library registration, made once per process


def _layer_norm_autocast_cpu(input: torch.Tensor, normalized_shape, weight=None, bias=None,
                             eps: float = 1e-5, cudnn_enable: bool = True) -> torch.Tensor:
    """``aten::layer_norm`` at the AutocastCPU dispatch key: float32 inside
    :func:`cpu_autocast`, unchanged elsewhere (what the dispatcher did without this kernel:
    the op in its inputs' dtype)."""
    upcast = getattr(_state, 'depth', 0) > 0 and input.dtype in _LOW_PRECISION
    with torch.autocast('cpu', enabled=False):  # re-dispatch below the autocast key
        if not upcast:
            return torch.ops.aten.layer_norm(input, normalized_shape, weight, bias, eps,
                                             cudnn_enable)
        out = torch.ops.aten.layer_norm(input.float(), normalized_shape,
                                        None if weight is None else weight.float(),
                                        None if bias is None else bias.float(), eps,
                                        cudnn_enable)
    return out.to(input.dtype)  # the next layers get the dtype they got before


def _install_layer_norm_kernel() -> None:
    global _layer_norm_library
    if _layer_norm_library is None:
        library = torch.library.Library('aten', 'IMPL')
        library.impl('layer_norm', _layer_norm_autocast_cpu, 'AutocastCPU')
        _layer_norm_library = library


@contextmanager
def cpu_autocast(dtype: torch.dtype = torch.bfloat16) -> Iterator[None]:
    """``torch.autocast('cpu', dtype)`` for training, with LayerNorm in float32.

    PyTorch's CPU LayerNorm backward sums the weight and bias gradients in the input's
    dtype: with bf16 inputs they are off by ~10 % at 8k tokens and ~40 % at 32k (torch 2.14,
    measured in tests/test_amp.py; BatchNorm, GroupNorm, softmax, SDPA, linear and conv
    gradients accumulate in float32). Inside this context every ``layer_norm`` (``nn.LayerNorm``,
    ``F.layer_norm``: PRepBN's LayerNorm branch, ``norm_cfg=dict(type='LN')``, heads) computes
    in float32 and hands its output on in the input's dtype, as CUDA autocast runs
    ``layer_norm`` in float32. Outside it (e.g. bf16 evaluation with ``torch.autocast``)
    nothing changes.

    Args:
        dtype: ``torch.bfloat16`` (``--amp`` on CPU); ``torch.float16`` reproduces CUDA fp16
            autocast's numerics on a CPU (tests).
    """
    if dtype not in _LOW_PRECISION:
        raise ValueError(f'cpu_autocast: dtype {dtype}; valid: torch.bfloat16, torch.float16')
    _install_layer_norm_kernel()
    _state.depth = getattr(_state, 'depth', 0) + 1
    try:
        with torch.autocast('cpu', dtype=dtype):
            yield
    finally:
        _state.depth -= 1


@register_optim_wrapper()
class CPUAmpOptimWrapper(OptimWrapper):
    """:class:`~mmengine.optim.OptimWrapper` that trains in bf16 mixed precision on a CPU.

    Inside :meth:`optim_context` (the model's ``train_step`` runs forward and loss there)
    the model's network parts (``mmslab.utils.precision.network_parts``: backbone, neck,
    dense heads, the RoI heads' box and mask heads, decode heads) run under
    :func:`cpu_autocast` and hand float32 outputs on, so what lies between and after them
    (proposals, NMS, RoIAlign, target assignment, losses) computes in float32: mmcv's CPU NMS
    and RoIAlign take float32 only, and the losses keep full precision. Within the parts
    matmuls and convolutions compute in bf16, LayerNorm in float32 (:func:`cpu_autocast`),
    and mmslab's norms and linear attentions keep their statistics and sums in float32
    (docs/methods.md, "Precision map").

    The backward runs outside the context, on the dtypes the forward recorded. There is no
    loss scaling: bf16 has fp32's exponent range, so gradients do not underflow the way
    fp16's do. Parameters, gradients and the optimizer state stay float32, so a checkpoint
    resumes with or without AMP, and a GPU ``AmpOptimWrapper`` checkpoint resumes here (its
    loss-scaler state is dropped). Outside :meth:`optim_context` (validation, checkpoints,
    copies of the model) the model is untouched.

    Args:
        dtype (str | torch.dtype): the autocast dtype; only ``'bfloat16'`` (CPU autocast has
            no fast float16). Default: 'bfloat16'.
        autocast_parts (bool): autocast the network parts only (above). False: the whole
            training step, as ``AmpOptimWrapper`` does on a GPU (for models whose
            post-processing and losses accept bf16; an mmdet detector's NMS does not).
            Default: True.
        allow_emulated (bool): run on a CPU without bf16 units (avx512_bf16 / amx_bf16),
            where bf16 is emulated and slower than float32. Off: such a CPU is refused.
            Default: False.
        **kwargs: :class:`~mmengine.optim.OptimWrapper`'s (``optimizer``,
            ``accumulative_counts``, ``clip_grad``).

    Example::

        optim_wrapper = dict(type='CPUAmpOptimWrapper', dtype='bfloat16',
                             optimizer=dict(type='AdamW', lr=1e-4, weight_decay=0.05))
    """

    valid_dtypes = ('bfloat16', )

    def __init__(self, dtype: Union[str, torch.dtype] = 'bfloat16',
                 autocast_parts: bool = True, allow_emulated: bool = False, **kwargs):
        name = _dtype_name(dtype)
        if name not in self.valid_dtypes:
            raise ValueError(f'CPUAmpOptimWrapper: dtype {dtype!r}; valid: '
                             f'{", ".join(self.valid_dtypes)} (float16 mixed precision needs '
                             f'a GPU: AmpOptimWrapper)')
        if not allow_emulated:
            from mmslab.utils.machine import require_bf16  # tool support, not an engine layer
            try:
                require_bf16('CPUAmpOptimWrapper')
            except RuntimeError as err:
                raise RuntimeError(f'{err} Train in float32 (OptimWrapper, or drop --amp), or '
                                   'pass allow_emulated=True to run bf16 emulated.') from None
        super().__init__(**kwargs)
        self.cast_dtype = getattr(torch, name)
        self.autocast_parts = bool(autocast_parts)
        self.allow_emulated = bool(allow_emulated)
        self._device_checked = False

    def _check_device(self, model: nn.Module) -> None:
        # CPU autocast leaves CUDA tensors alone: a model on a GPU would silently train fp32.
        if self._device_checked:
            return
        param = next(model.parameters(), None)
        if param is not None and param.device.type != 'cpu':
            raise RuntimeError(f'CPUAmpOptimWrapper autocasts CPU computation, but the model '
                               f'is on {param.device}; use AmpOptimWrapper there '
                               '(tools/train.py --amp picks it).')
        self._device_checked = True

    def _autocast_forward(self, forward):
        from mmslab.utils.precision import float32_outputs  # tool support, not an engine layer

        def autocast_forward(*args, **kwargs):
            with cpu_autocast(self.cast_dtype):
                out = forward(*args, **kwargs)
            return float32_outputs(out)
        return autocast_forward

    @contextmanager
    def optim_context(self, model: nn.Module):
        """Gradient-accumulation context of :class:`OptimWrapper`, with the network parts'
        ``forward`` under :func:`cpu_autocast` (or the whole step: ``autocast_parts=False``).
        The parts' forwards are wrapped on entry and restored on exit, so nothing outside the
        training step (a deep copy for evaluation included) sees them."""
        from mmengine.model import is_model_wrapper

        from mmslab.utils.precision import network_parts  # tool support, not an engine layer
        self._check_device(model)
        module = model.module if is_model_wrapper(model) else model
        parts = list(network_parts(module)) if self.autocast_parts else []
        with super().optim_context(model):
            if not parts:
                with cpu_autocast(self.cast_dtype):
                    yield
                return
            patched = []
            try:
                for part in parts:
                    patched.append((part, 'forward' in vars(part), part.forward))
                    part.forward = self._autocast_forward(part.forward)
                yield
            finally:
                for part, had, original in reversed(patched):
                    if had:
                        part.forward = original
                    else:
                        del part.forward

    def load_state_dict(self, state_dict: dict) -> None:
        """Load the optimizer state (and ``base_param_settings``); a GPU ``AmpOptimWrapper``
        checkpoint's ``loss_scaler`` is dropped (bf16 trains without loss scaling)."""
        state_dict = dict(state_dict)
        state_dict.pop('loss_scaler', None)
        super().load_state_dict(state_dict)


class AmpConfigError(ValueError):
    """``--amp`` cannot run with this device, dtype or optimizer wrapper (the message says
    why and what to do instead)."""


def amp_optim_wrapper_cfg(optim_wrapper: dict, device: str, has_bf16: bool,
                          dtype: Optional[str] = None) -> dict:
    """The ``optim_wrapper`` config that mixed-precision training uses on ``device``.

    Args:
        optim_wrapper: the config's ``optim_wrapper`` (not modified). Its ``type`` must be
            ``OptimWrapper`` (the default when absent) or already an AMP wrapper
            (``AmpOptimWrapper`` / ``CPUAmpOptimWrapper``, kept and moved to the device).
        device: where training runs (``mmengine.device.get_device()``): ``'cuda'`` (or
            ``'npu'``, ``'mlu'``, ``'musa'``) or ``'cpu'``.
        has_bf16: whether the CPU has bf16 units (``mmslab.utils.machine.has_bf16()``).
        dtype: ``'float16'`` / ``'bfloat16'``, or None: the AMP wrapper's own ``dtype`` if the
            config has one, else float16 on a GPU and bfloat16 on a CPU.

    Returns:
        A new dict: on a GPU ``type='AmpOptimWrapper'`` with ``loss_scale='dynamic'`` (unless
        the config set one) and ``dtype``; on a CPU ``type='CPUAmpOptimWrapper'`` with
        ``dtype='bfloat16'``. Other keys (optimizer, clip_grad, paramwise_cfg...) are kept.

    Raises:
        AmpConfigError: an unknown dtype, another wrapper type, float16 on a CPU, a CPU
            without bf16 units, or a device without mixed precision.
    """
    if dtype is not None and dtype not in AMP_DTYPES:
        raise AmpConfigError(f'--amp-dtype {dtype!r}; valid: {", ".join(AMP_DTYPES)}')
    cfg = copy.deepcopy(dict(optim_wrapper))
    kind = cfg.get('type', PLAIN_WRAPPER)
    kind = getattr(kind, '__name__', kind)  # a class in a new-style (Python) config
    if kind not in AMP_INPUT_WRAPPERS:
        raise AmpConfigError(f'--amp works with optim_wrapper.type OptimWrapper (or an AMP '
                             f'wrapper: {GPU_AMP_WRAPPER}, {CPU_AMP_WRAPPER}); the config has '
                             f'{kind}. Set optim_wrapper.type=OptimWrapper or drop --amp.')
    config_dtype = _dtype_name(cfg.pop('dtype', None)) if kind != PLAIN_WRAPPER else None
    chosen = dtype or config_dtype
    if device in AMP_ACCELERATORS:
        if kind != GPU_AMP_WRAPPER:
            cfg.pop('allow_emulated', None)  # CPUAmpOptimWrapper's option
        cfg['type'] = GPU_AMP_WRAPPER
        cfg.setdefault('loss_scale', 'dynamic')
        cfg['dtype'] = chosen or 'float16'
        if cfg['dtype'] not in AMP_DTYPES:
            raise AmpConfigError(f'the config asks AmpOptimWrapper for dtype {cfg["dtype"]!r}; '
                                 f'--amp trains in one of {", ".join(AMP_DTYPES)}')
        return cfg
    if device != 'cpu':
        raise AmpConfigError(f'--amp trains on {", ".join(AMP_ACCELERATORS)} '
                             f"(mmengine's AmpOptimWrapper) or on a CPU with bf16 units; this "
                             f'run is on {device!r}. Drop --amp.')
    chosen = chosen or 'bfloat16'
    if chosen != 'bfloat16':
        raise AmpConfigError(f'--amp on a CPU computes in bfloat16; {chosen} autocast needs a '
                             'GPU (CPU float16 matmuls are emulated, slower than float32, and '
                             'need loss scaling). Use --amp-dtype bfloat16 or drop --amp.')
    if not (has_bf16 or cfg.get('allow_emulated')):
        raise AmpConfigError('--amp on a CPU computes in bfloat16, and this CPU has no bf16 '
                             'units (neither avx512_bf16 nor amx_bf16): bf16 would be emulated, '
                             'slower than float32. Drop --amp to train in float32.')
    for key in ('loss_scale', 'use_fsdp'):  # AmpOptimWrapper's options: no loss scaling
        cfg.pop(key, None)
    cfg['type'] = CPU_AMP_WRAPPER
    cfg['dtype'] = 'bfloat16'
    return cfg
