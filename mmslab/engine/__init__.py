"""Runtime support for running mmslab with mmengine (safe checkpoint loading, CPU mixed
precision)."""
from . import checkpoint
from .checkpoint import load_checkpoint_file
from .optim_wrapper import CPUAmpOptimWrapper, amp_optim_wrapper_cfg, cpu_autocast

checkpoint.install()

__all__ = ['CPUAmpOptimWrapper', 'amp_optim_wrapper_cfg', 'checkpoint', 'cpu_autocast',
           'load_checkpoint_file']
