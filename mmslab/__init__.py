"""mmslab: efficient-transformer backbones for OpenMMLab with structural re-parameterization.

``import mmslab`` (or ``custom_imports=dict(imports=['mmslab'])``) registers every model
component in mmdet's and mmseg's ``MODELS`` and every hook in mmengine's ``HOOKS``.
"""
__version__ = '0.1.0'

from . import engine  # noqa: E402,F401  (safe checkpoint loading, hooks)
from . import models  # noqa: E402,F401
from .engine import hooks  # noqa: E402,F401
from .engine.hooks import set_progressive_iter  # noqa: E402
from .models import reparameterize  # noqa: E402

__all__ = ['reparameterize', 'set_progressive_iter', '__version__']
