"""Which device's code path a layer runs.

Where a layer has a form per kind of device (cropped windows where time is arithmetic, padded
ones where it is kernel launches: :class:`~mmslab.models.layers.shift_window.ShiftWindowAttention`),
it asks :func:`code_path` rather than its input's device. By default that is the input's
device type; inside :func:`run_code_path` it is the one named, whatever the tensors' device,
so a CPU can run (and count the kernels of) exactly the code a CUDA tensor runs::

    with mmslab.run_code_path('cuda'):
        loss = model(x.cpu()).sum()  # the GPU's layer forms, computed on the CPU

The setting is global to the process (not per thread), as ``torch.backends`` flags are.
"""
import contextlib
from typing import Iterator, Optional

from torch import Tensor

#: Device types :func:`run_code_path` accepts: ``'cpu'`` (the CPU forms) or ``'cuda'``
#: (the GPU forms; also what any other accelerator runs).
CODE_PATHS = ('cpu', 'cuda')

_forced: Optional[str] = None


def code_path(x: Tensor) -> str:
    """``'cpu'`` or ``'cuda'``: the forms a layer given ``x`` runs (:func:`run_code_path`'s
    setting, else ``'cpu'`` for CPU tensors and ``'cuda'`` for any other device)."""
    if _forced is not None:
        return _forced
    return 'cpu' if x.device.type == 'cpu' else 'cuda'


@contextlib.contextmanager
def run_code_path(device_type: str) -> Iterator[None]:
    """Run the layers' forms of ``device_type`` (one of :data:`CODE_PATHS`) inside the
    block, whatever device their tensors are on."""
    global _forced
    if device_type not in CODE_PATHS:
        raise ValueError(f'code path {device_type!r}; valid: {", ".join(CODE_PATHS)}')
    previous, _forced = _forced, device_type
    try:
        yield
    finally:
        _forced = previous
