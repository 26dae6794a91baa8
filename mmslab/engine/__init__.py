"""Runtime support for running mmslab with mmengine (the weights-only checkpoint loader made
mmengine's, CPU mixed precision)."""
from ..utils import checkpoint
from .optim_wrapper import CPUAmpOptimWrapper, amp_optim_wrapper_cfg, cpu_autocast

checkpoint.install()

__all__ = ['CPUAmpOptimWrapper', 'amp_optim_wrapper_cfg', 'cpu_autocast']
