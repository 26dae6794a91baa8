"""Runtime support for running mmslab with mmengine (safe checkpoint loading)."""
from . import checkpoint
from .checkpoint import load_checkpoint_file

checkpoint.install()

__all__ = ['checkpoint', 'load_checkpoint_file']
