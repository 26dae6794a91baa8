"""mmslab: efficient-transformer backbones for OpenMMLab with structural re-parameterization.

``import mmslab`` (or ``custom_imports=dict(imports=['mmslab'])`` in a config) makes the three
global changes a config that names mmslab needs, and no other:

* every model component is registered in mmdet's and mmseg's ``MODELS`` (``mmslab.models``),
* every hook in mmengine's ``HOOKS`` (``mmslab.engine.hooks``),
* mmengine's loader for local checkpoint files becomes the restricted, weights-only one
  (``mmslab.utils.checkpoint``, installed by ``mmslab.engine``), so ``load_from`` /
  ``--resume`` of Runner checkpoints and ``init_cfg=dict(type='Pretrained')`` work on
  torch >= 2.6 without executing pickled code.

The rest (``mmslab.deploy``, ``mmslab.utils``, ``mmslab.benchmark``, ``mmslab.datasets``)
is imported where it is used, or on first access as an attribute of this package.

Where PyTorch or OpenMMLab cannot be imported (a deployment machine), the package registers
nothing and only its torch-free part works: ``python -m mmslab.deploy.predict`` (the deployed
predictor) and ``mmslab.deploy.runtimes``; ``mmslab.reparameterize`` and the other PyTorch
parts then raise an ``ImportError`` naming what is missing. Silently so only where PyTorch is
not installed; any other requirement that does not import (a partial or broken install) is
reported with a ``RuntimeWarning``. Nothing depends on the command line: with PyTorch and
OpenMMLab installed, the predictor imports them too (and runs the same way).
"""
import importlib
import warnings

__version__ = '0.1.0'

#: What the OpenMMLab side imports at module level, in dependency order.
OPENMMLAB_REQUIREMENTS = ('torch', 'mmengine', 'mmcv', 'mmdet', 'mmseg')

#: Attributes resolved on first access: name -> (module, attribute or None for the module).
_LAZY = {
    'reparameterize': ('mmslab.models', 'reparameterize'),
    'set_progressive_iter': ('mmslab.engine.hooks', 'set_progressive_iter'),
    'run_code_path': ('mmslab.models.layers.code_path', 'run_code_path'),
    'benchmark': ('mmslab.benchmark', None),
    'datasets': ('mmslab.datasets', None),
    'deploy': ('mmslab.deploy', None),
    'engine': ('mmslab.engine', None),
    'models': ('mmslab.models', None),
    'registry': ('mmslab.registry', None),
    'utils': ('mmslab.utils', None),
}
#: Importable without PyTorch.
_TORCH_FREE = ('deploy', )


def _unavailable_requirement():
    """``None`` when every OpenMMLab requirement imports, else ``(name, error)`` for the first
    that does not."""
    for name in OPENMMLAB_REQUIREMENTS:
        try:
            importlib.import_module(name)
        except ImportError as err:
            return name, err
    return None


_UNAVAILABLE = _unavailable_requirement()

if _UNAVAILABLE is None:
    from . import engine  # noqa: E402,F401  (the restricted checkpoint loader)
    from . import models  # noqa: E402,F401  (registers the model components)
    from .engine import hooks  # noqa: E402,F401  (registers the hooks)
    from .engine.hooks import set_progressive_iter  # noqa: E402
    from .models import reparameterize  # noqa: E402
    from .models.layers.code_path import run_code_path  # noqa: E402
elif not (_UNAVAILABLE[0] == 'torch' and isinstance(_UNAVAILABLE[1], ModuleNotFoundError)
          and _UNAVAILABLE[1].name == 'torch'):
    # Not a machine without PyTorch: a partial or broken install, which a config naming
    # mmslab would otherwise only meet as "not in the registry".
    warnings.warn(f'mmslab: {_UNAVAILABLE[0]} cannot be imported ({_UNAVAILABLE[1]}): mmslab '
                  'registers nothing with OpenMMLab; only its torch-free part works',
                  RuntimeWarning, stacklevel=2)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    if _UNAVAILABLE is not None and name not in _TORCH_FREE:
        missing, err = _UNAVAILABLE
        raise ImportError(f'mmslab.{name} needs PyTorch and OpenMMLab; {missing} cannot be '
                          f'imported ({err})')
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value  # resolved once
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = ['reparameterize', 'run_code_path', 'set_progressive_iter', '__version__']
