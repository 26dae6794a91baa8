"""Weights-only loading of local checkpoints for mmengine 0.10.7 on torch >= 2.6.

The problem
-----------
mmengine 0.10.7 reads local checkpoints with ``torch.load(filename, map_location=...)`` and no
``weights_only`` argument. Since torch 2.6 that argument defaults to ``True``, and the restricted
unpickler rejects what a Runner checkpoint holds besides tensors: the message hub's
:class:`~mmengine.logging.HistoryBuffer` objects (whose pickled state refers to their statistics
methods through ``getattr(HistoryBuffer, 'mean')``) and the numpy arrays, scalars and dtypes kept
in them and in the runtime information. ``--resume``, ``load_from`` and ``tools/test.py`` (which
goes through ``Runner.load_checkpoint``) then fail with "Weights only load failed".

The fix
-------
:func:`install` replaces the loader mmengine's :class:`~mmengine.runner.CheckpointLoader` uses for
local paths (the scheme with the empty prefix, the fallback for every path no other scheme claims)
by :func:`load_from_local`. It keeps ``weights_only=True`` and allow-lists, only for the duration of
the call (``torch.serialization.safe_globals``), exactly these extra globals:

* ``mmengine.logging.history_buffer.HistoryBuffer``;
* ``builtins.getattr``, resolved to a restricted stand-in that only returns the statistics
  methods defined on ``HistoryBuffer`` (``min``, ``max``, ``current``, ``mean`` and any other
  function of that class) and raises for every other object or name;
* ``numpy.ndarray`` and ``numpy._core.multiarray._reconstruct`` (arrays);
* ``numpy._core.multiarray.scalar`` (numpy scalars such as ``np.float64``);
* ``numpy.dtype`` and the concrete dtype classes of bool, the signed and unsigned integers of
  8 to 64 bits, float16/32/64 and complex64/128 (``numpy.dtypes.Float64DType`` etc.). Object,
  string, void and datetime dtypes are *not* allowed, so object arrays are refused;
* the numpy 1.x spellings ``numpy.core.multiarray._reconstruct`` and
  ``numpy.core.multiarray.scalar`` of the same two functions, for checkpoints written with
  numpy < 2.

Everything else (a pickled instance of any other class, any other callable) is refused with
torch's own ``UnpicklingError``. Plain state dicts need none of this and load as before.

Because all of mmengine's local loading funnels through ``CheckpointLoader``, this covers
``Runner.resume`` (``--resume``), ``Runner.load_checkpoint`` (``load_from`` and the test tools),
``mmengine.runner.load_checkpoint`` and ``init_cfg=dict(type='Pretrained', checkpoint=...)``.
URL and model-zoo schemes (``http://``, ``open-mmlab://`` ...) are left untouched.

:func:`install` is idempotent and runs when :mod:`mmslab.engine` is imported. Other mmslab code
should call :func:`load_checkpoint_file` instead of ``torch.load``.
"""
import inspect
import os.path as osp
import pickle
from typing import Any, Callable, List, Tuple, Union

import numpy as np
import torch
from mmengine.logging import HistoryBuffer
from mmengine.runner.checkpoint import CheckpointLoader

__all__ = ['install', 'is_installed', 'load_checkpoint_file', 'load_from_local',
           'safe_globals_for_checkpoints']

# numpy dtypes whose classes may be rebuilt: plain numeric data only.
_NUMPY_DTYPES = ('bool', 'int8', 'int16', 'int32', 'int64', 'uint8', 'uint16', 'uint32',
                 'uint64', 'float16', 'float32', 'float64', 'complex64', 'complex128')


def _numpy_multiarray():
    """numpy's ``multiarray`` module (``numpy._core`` in numpy 2, ``numpy.core`` before)."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray
    return multiarray


def _history_buffer_getattr(obj: Any, name: str) -> Any:
    """Restricted ``getattr`` for the weights-only unpickler.

    A pickled :class:`HistoryBuffer` stores its ``statistics_methods`` dict, whose values (functions
    defined on the class) pickle as ``getattr(HistoryBuffer, '<name>')``. Only that is allowed.
    """
    if obj is HistoryBuffer and isinstance(name, str) and not name.startswith('_'):
        attr = HistoryBuffer.__dict__.get(name)
        if inspect.isfunction(attr):
            return attr
    raise pickle.UnpicklingError(
        f'Weights only load refused getattr({obj!r}, {name!r}): mmslab only allows the statistics '
        'methods of mmengine.logging.HistoryBuffer.')


def safe_globals_for_checkpoints() -> List[Union[Callable, Tuple[Callable, str]]]:
    """The exact extra globals allowed when loading a checkpoint (see the module docstring)."""
    multiarray = _numpy_multiarray()
    allowed: List[Union[Callable, Tuple[Callable, str]]] = [
        HistoryBuffer,
        (_history_buffer_getattr, 'builtins.getattr'),
        np.ndarray,
        np.dtype,
        (multiarray._reconstruct, 'numpy._core.multiarray._reconstruct'),
        (multiarray.scalar, 'numpy._core.multiarray.scalar'),
        (multiarray._reconstruct, 'numpy.core.multiarray._reconstruct'),
        (multiarray.scalar, 'numpy.core.multiarray.scalar'),
    ]
    for name in _NUMPY_DTYPES:
        dtype_cls = type(np.dtype(name))
        if dtype_cls not in allowed:
            allowed.append(dtype_cls)
    return allowed


def load_checkpoint_file(path: str, map_location: Any = 'cpu') -> Any:
    """Load a local checkpoint with ``weights_only=True`` and mmslab's allow-list.

    Args:
        path (str): Local file path (``~`` is expanded).
        map_location: Same as for :func:`torch.load`. Defaults to ``'cpu'``.

    Returns:
        The loaded object (usually a dict with ``state_dict``, ``meta``, ``optimizer``...).

    Raises:
        FileNotFoundError: If ``path`` is not a file.
        pickle.UnpicklingError: If the file contains a global outside the allow-list.
    """
    filename = osp.expanduser(str(path))
    if not osp.isfile(filename):
        raise FileNotFoundError(f'{filename} can not be found.')
    already = torch.serialization.get_safe_globals()
    extra = [g for g in safe_globals_for_checkpoints() if g not in already]
    with torch.serialization.safe_globals(extra):
        return torch.load(filename, map_location=map_location, weights_only=True)


def load_from_local(filename: str, map_location: Any = None) -> Any:
    """mmengine ``CheckpointLoader`` scheme for local paths (registered by :func:`install`).

    Its name matters: mmengine logs ``Loads checkpoint by local backend``.
    """
    return load_checkpoint_file(filename, map_location=map_location)


def is_installed() -> bool:
    """Whether :func:`load_from_local` is mmengine's loader for local paths."""
    return CheckpointLoader._schemes.get('') is load_from_local


def install() -> None:
    """Register :func:`load_from_local` for local paths in mmengine's ``CheckpointLoader``.

    Safe to call any number of times.
    """
    if not is_installed():
        CheckpointLoader.register_scheme(prefixes='', loader=load_from_local, force=True)
