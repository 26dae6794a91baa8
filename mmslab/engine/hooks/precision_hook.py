"""Evaluate the PyTorch model in bf16, or in the faster of fp32 and bf16 (``auto``)."""
from typing import Optional

from mmengine.dist import broadcast_object_list
from mmengine.hooks import Hook

from mmslab.registry import register_hook
from mmslab.utils.precision import (AUTO_MARGIN, AUTO_REPEAT, AUTO_WARMUP, Bf16Regions,
                                    auto_precision, first_test_batch)

#: What eager PyTorch runs in (INT8 is a runtime artifact: ``--backend ... --precision int8``).
EAGER_PRECISIONS = ('fp32', 'bf16', 'auto')


def eval_device() -> str:
    """Where the runner evaluates: mmengine's ``get_device()`` (``'cuda'`` where available)."""
    from mmengine.device import get_device
    return get_device()


def _no_bf16_reason(device='cpu') -> Optional[str]:
    """Why ``device`` cannot compute bf16 natively, or None if it can."""
    import torch
    device = torch.device(device)
    if device.type == 'cuda':
        from mmslab.utils.precision import no_cuda_bf16_reason
        return no_cuda_bf16_reason(device)
    if device.type != 'cpu':
        return None
    from mmslab.utils.machine import _cpuinfo, has_bf16
    if has_bf16():
        return None
    return (f"this CPU ({_cpuinfo().get('model name', 'unknown')}) has neither avx512_bf16 nor "
            'amx_bf16')


@register_hook()
class PrecisionHook(Hook):
    """Run the test loop's PyTorch model in ``precision``.

    Args:
        precision (str): 'bf16': the network parts (backbone, neck, heads) under
            ``torch.autocast('cpu', torch.bfloat16)``, float32 in between and after
            (:class:`mmslab.utils.precision.Bf16Regions`; ``torch.autocast('cuda', ...)``
            where the model is on a GPU); refused on CPUs without avx512_bf16 / amx_bf16 and
            on GPUs below compute capability 8.0. 'auto': time fp32 and, where the device has
            bf16, bf16 on the first test batch (``warmup`` + ``repeat`` interleaved test steps
            each) and evaluate in bf16 only if it is at least ``margin`` times faster.
            'fp32': nothing. Default: 'bf16'.
        warmup (int): untimed test steps per precision of the ``auto`` measurement.
            Default: :data:`~mmslab.utils.precision.AUTO_WARMUP`.
        repeat (int): timed test steps per precision of the ``auto`` measurement.
            Default: :data:`~mmslab.utils.precision.AUTO_REPEAT`.
        margin (float): how many times faster bf16 must be for ``auto`` to take it.
            Default: :data:`~mmslab.utils.precision.AUTO_MARGIN`.

    Its priority (HIGH) is below ``ReparamEvalHook`` (VERY_HIGH): the bf16 regions are set
    on the fused copy that hook swaps in, and only inside ``predict``, so its fused-vs-
    unfused check still compares float32 features. After the test, :attr:`result` holds
    ``precision`` (what ran) and, for ``auto``, the measurement (``auto``).
    """

    priority = 'HIGH'

    def __init__(self, precision: str = 'bf16', warmup: int = AUTO_WARMUP,
                 repeat: int = AUTO_REPEAT, margin: float = AUTO_MARGIN):
        if precision not in EAGER_PRECISIONS:
            raise ValueError(f'PrecisionHook: precision {precision!r}; valid: '
                             f'{", ".join(EAGER_PRECISIONS)} (int8 runs an exported INT8 model '
                             'in onnxruntime / OpenVINO: tools/test.py --backend ...)')
        if precision == 'bf16':
            from mmslab.utils.precision import check_autocast_precision
            check_autocast_precision('bf16', eval_device())
        if repeat < 1 or warmup < 0:
            raise ValueError(f'PrecisionHook: repeat >= 1 and warmup >= 0, got {repeat}, '
                             f'{warmup}')
        self.requested = precision
        self.warmup, self.repeat, self.margin = warmup, repeat, margin
        self.result: Optional[dict] = None
        self._regions: Optional[Bf16Regions] = None

    def _enter(self, runner) -> None:
        from .runtime_backend_hook import _unwrap
        self.result = dict(precision=self.requested)
        if self.requested == 'fp32':
            return
        from mmslab.utils.timing import module_device
        model = _unwrap(runner.model)
        why_not = _no_bf16_reason(module_device(model)) if self.requested == 'auto' else None
        if why_not is None:
            self._regions = Bf16Regions(model, enabled=self.requested == 'bf16')
        if self.requested == 'auto':
            record = self._measure(runner, why_not)
            self.result.update(precision=record['choice'], auto=record)
            if self._regions is not None:
                self._regions.enabled = record['choice'] == 'bf16'
            runner.logger.info(f"PrecisionHook: auto chose {record['choice']}: "
                               f"{record['reason']}")
        if self.result['precision'] == 'bf16':
            runner.logger.info(
                f'PrecisionHook: {type(model).__name__} evaluated in bf16 (torch.autocast '
                f'on {self._regions.num_parts} network parts, float32 post-processing)')

    def _measure(self, runner, why_not: Optional[str]) -> dict:
        if why_not is not None:
            record = auto_precision({}, False, why_not)
        else:
            batch = first_test_batch(runner)
            step_owner = runner.model
            regions = self._regions

            def step(bf16: bool):
                def run():
                    regions.enabled = bf16
                    # the class's test_step: ReparamEvalHook's timing wrapper (an instance
                    # attribute) must not count these runs
                    return type(step_owner).test_step(step_owner, batch)
                return run

            record = auto_precision(dict(fp32=step(False), bf16=step(True)), True,
                                    warmup=self.warmup, repeat=self.repeat, margin=self.margin)
        record['what'] = 'test_step on the first test batch (pre-processing, model, ' \
                         'post-processing)'
        shared = [record]
        broadcast_object_list(shared, src=0)  # every rank evaluates in rank 0's choice
        return shared[0]

    def _exit(self) -> None:
        if self._regions is not None:
            self._regions.remove()
            self._regions = None

    def before_test_epoch(self, runner) -> None:
        self._enter(runner)

    def after_test_epoch(self, runner, metrics=None) -> None:
        self._exit()
