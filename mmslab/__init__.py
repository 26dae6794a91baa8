"""mmslab: efficient-transformer backbones for OpenMMLab with structural re-parameterization.

``import mmslab`` (or ``custom_imports=dict(imports=['mmslab'])``) registers every model
component in mmdet's and mmseg's ``MODELS`` and every hook in mmengine's ``HOOKS``.

Exception: ``python -m mmslab.deploy.predict`` (the deployed predictor, see
``mmslab/deploy/predict.py``) runs without PyTorch and OpenMMLab, so the package skips those
imports when it is imported as that entry point's parent.
"""
import sys

__version__ = '0.1.0'

#: ``python -m`` entry points that must not import torch / mmdet / mmseg / mmengine / mmcv.
_TORCH_FREE_MAINS = ('mmslab.deploy.predict', )


def _is_torch_free_main() -> bool:
    """Whether this import is runpy importing the parents of a torch-free ``-m`` module.

    runpy imports the parent packages of ``python -m pkg.mod`` while ``sys.argv[0]`` is still
    ``'-m'`` (it is set to the module's path afterwards); the module name is in
    ``sys.orig_argv``. Any other import (scripts, tests, ``python -c``) registers as always.
    """
    if sys.argv[:1] != ['-m']:
        return False
    argv = sys.orig_argv
    for i, arg in enumerate(argv[1:], 1):
        if arg == '-m':
            return i + 1 < len(argv) and argv[i + 1] in _TORCH_FREE_MAINS
        if arg.startswith('-m'):  # '-mpkg.mod'
            return arg[2:] in _TORCH_FREE_MAINS
    return False


if not _is_torch_free_main():
    from . import engine  # noqa: E402,F401  (safe checkpoint loading, hooks)
    from . import models  # noqa: E402,F401
    from .engine import hooks  # noqa: E402,F401
    from .engine.hooks import set_progressive_iter  # noqa: E402
    from .models import reparameterize  # noqa: E402

__all__ = ['reparameterize', 'set_progressive_iter', '__version__']
