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
  string, void and datetime dtypes are *not* allowed, so object arrays are refused here (and
  dropped as foreign objects below);
* the numpy 1.x spellings ``numpy.core.multiarray._reconstruct`` and
  ``numpy.core.multiarray.scalar`` of the same two functions, for checkpoints written with
  numpy < 2.

Plain state dicts need none of this and load as before.

Foreign objects
---------------
Checkpoints written by other training scripts hold more than tensors: the SLAB authors' files
keep their yacs ``CfgNode`` under ``config``, RePaViT's keep an ``argparse.Namespace`` under
``args``. torch's weights-only load refuses them. When it does, :func:`load_checkpoint_file` reads
the file a second time with :class:`_RestrictedUnpickler` (through torch's own zip/legacy readers,
so tensor storages come from the archive exactly as in a normal load). Its ``find_class`` returns
only what the weights-only load allows (torch's default allow-list plus the globals above) and
turns *every* other global into a fresh subclass of :class:`ForeignObject`: an inert placeholder
whose construction, ``__setstate__``, item assignment and ``append``/``extend`` accept anything
and store nothing, so a ``__reduce__`` that names ``os.system`` or ``builtins.eval`` builds a
placeholder instead of calling anything. No name from the file is ever imported. The loaded
object is then cleaned: dict entries (at any depth of nested dicts) whose key or value is, or
contains, a placeholder or a numpy object array are removed and reported with
``print_log(..., logger='current')``, e.g. ``ignored config (yacs.config.CfgNode)``. The state
dict itself comes back as real tensors. If even the restricted read fails (e.g. a pickled
``getattr`` on anything but ``HistoryBuffer``'s statistics methods), or the file is nothing but a
foreign object, the error is a ``pickle.UnpicklingError`` that carries torch's message and the
reason. Pass ``ignore_foreign=False`` to refuse such files outright, as torch does.

This second read uses torch internals (``torch.serialization._load``/``_legacy_load`` with a
``pickle_module``, ``torch._weights_only_unpickler._get_allowed_globals``), checked against the
pinned torch 2.14; ``tests/test_foreign_checkpoints.py`` exercises them.

Because all of mmengine's local loading funnels through ``CheckpointLoader``, this covers
``Runner.resume`` (``--resume``), ``Runner.load_checkpoint`` (``load_from`` and the test tools),
``mmengine.runner.load_checkpoint`` and ``init_cfg=dict(type='Pretrained', checkpoint=...)``.
URL and model-zoo schemes (``http://``, ``open-mmlab://`` ...) are left untouched.

:func:`install` is idempotent and runs when :mod:`mmslab.engine` is imported. Other mmslab code
should call :func:`load_checkpoint_file` instead of ``torch.load``.
"""
import _compat_pickle
import builtins
import inspect
import os.path as osp
import pickle
import types
from typing import Any, Callable, Dict, List, Tuple, Union

import numpy as np
import torch
from mmengine.logging import HistoryBuffer, print_log
from mmengine.runner.checkpoint import CheckpointLoader

__all__ = ['ForeignObject', 'install', 'is_installed', 'load_checkpoint_file', 'load_from_local',
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


class ForeignObject:
    """Inert stand-in for a pickled class or function that mmslab does not load.

    :class:`_RestrictedUnpickler` makes one subclass per unknown global (``foreign_name`` is its
    ``module.qualname`` as written in the file). Whatever the pickle does with it (construct it
    through ``REDUCE``/``NEWOBJ``, ``BUILD`` it with a state, fill it through ``SETITEMS`` or
    ``APPENDS``) is accepted and discarded: instances keep no state at all.
    """
    __slots__ = ()
    foreign_name = '?'

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, item):
        pass

    def extend(self, items):
        pass

    def add(self, item):
        pass

    def __repr__(self):
        return f'<ignored {self.foreign_name} object>'


def _is_foreign(obj: Any) -> bool:
    return isinstance(obj, ForeignObject) or (isinstance(obj, type)
                                              and issubclass(obj, ForeignObject))


# Never handed to a pickle, whatever an allow-list says (torch blocks these modules too).
_BLOCKED_MODULES = ('os', 'posix', 'nt', 'sys', 'subprocess', 'importlib', 'runpy',
                    'shutil', 'pickle', '_pickle', 'marshal', 'ctypes', 'types', 'code',
                    'codeop', 'pty', 'socket', 'webbrowser')
_BLOCKED_BUILTINS = {id(getattr(builtins, n)) for n in (
    'eval', 'exec', 'compile', 'getattr', 'setattr', 'delattr', '__import__', 'open',
    'globals', 'locals', 'vars', 'input', 'breakpoint', 'exit', 'quit', 'help')
    if hasattr(builtins, n)}


def _allowed_globals() -> Dict[str, Any]:
    """What torch's weights-only unpickler would return for a ``GLOBAL`` (default allow-list and
    the globals allowed by ``add_safe_globals``/``safe_globals``, including ours in
    :func:`load_checkpoint_file`), minus anything from :data:`_BLOCKED_MODULES` or a dangerous
    builtin. ``builtins`` names allowed by torch (``set``, ``bytearray``, ``complex``) and our
    restricted ``getattr`` stand-in stay."""
    from torch import _weights_only_unpickler as wou
    allowed = dict(wou._get_allowed_globals())
    allowed.update(wou._get_user_allowed_globals())
    safe = {}
    for name, obj in allowed.items():
        module = name.split('.', 1)[0]
        if id(obj) in _BLOCKED_BUILTINS:
            continue
        if module in _BLOCKED_MODULES or module in wou._blocklisted_modules:
            continue
        safe[name] = obj
    return safe


class _RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` only returns allow-listed globals.

    Every other ``module.name`` becomes a :class:`ForeignObject` subclass (one per name and load,
    recorded in ``foreign``); nothing is imported. Used through :func:`_restricted_pickle_module`
    so that torch's readers add their storage ``persistent_load``.
    """
    allowed: Dict[str, Any] = {}
    foreign: Dict[str, type] = {}

    def find_class(self, module, name):
        # Python 2 names, as pickle protocol 2 writes them (``__builtin__``): mapped like torch's
        # weights-only unpickler does. Nothing is imported either way.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        full = f'{module}.{name}'
        obj = self.allowed.get(full)
        if obj is not None:
            return obj
        if full not in self.foreign:
            short = str(name).rsplit('.', 1)[-1] or 'Foreign'
            self.foreign[full] = type(f'Foreign_{short}', (ForeignObject, ),
                                      dict(__slots__=(), foreign_name=full,
                                           __module__=__name__))
        return self.foreign[full]


def _restricted_pickle_module(foreign: Dict[str, type]) -> types.SimpleNamespace:
    """A ``pickle_module`` for torch's readers built on a fresh :class:`_RestrictedUnpickler`."""
    unpickler = type('RestrictedUnpickler', (_RestrictedUnpickler, ),
                     dict(allowed=_allowed_globals(), foreign=foreign))

    def load(file, **kwargs):
        return unpickler(file, **kwargs).load()

    def loads(data, **kwargs):
        import io
        return load(io.BytesIO(data), **kwargs)

    return types.SimpleNamespace(__name__='mmslab_restricted_pickle', Unpickler=unpickler,
                                 load=load, loads=loads, UnpicklingError=pickle.UnpicklingError)


def _load_restricted(filename: str, map_location: Any, foreign: Dict[str, type]) -> Any:
    """Read a ``torch.save`` file (zip or legacy format) with :class:`_RestrictedUnpickler`.

    Follows ``torch.load``'s own dispatch (``torch.serialization._load`` for zip archives,
    ``_legacy_load`` otherwise) but never hands a TorchScript archive to ``torch.jit.load``.
    """
    ser = torch.serialization
    module = _restricted_pickle_module(foreign)
    with ser._open_file_like(filename, 'rb') as opened:
        if ser._is_zipfile(opened):
            with ser._open_zipfile_reader(opened) as archive:
                if ser._is_torchscript_zip(archive):
                    raise pickle.UnpicklingError(
                        f'{filename} is a TorchScript archive, not a checkpoint')
                return ser._load(archive, map_location, module, weights_only=True,
                                 encoding='utf-8')
        return ser._legacy_load(opened, map_location, module, weights_only=True,
                                encoding='utf-8')


def _foreign_names(obj: Any, seen=None) -> List[str]:
    """Names of the placeholders in ``obj`` (searched through dicts, lists, tuples, sets).

    A numpy array of Python objects counts as foreign as a whole (torch's weights-only load
    refuses object dtypes; the restricted unpickler cannot, its elements may be placeholders).
    """
    if _is_foreign(obj):
        return [obj.foreign_name]
    if isinstance(obj, np.ndarray) and obj.dtype.hasobject:
        return ['numpy object array']
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    if isinstance(obj, dict):
        seen.add(id(obj))
        items = [x for kv in obj.items() for x in kv]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        seen.add(id(obj))
        items = list(obj)
    else:
        return []
    names = []
    for item in items:
        for n in _foreign_names(item, seen):
            if n not in names:
                names.append(n)
    return names


def _drop_foreign(obj: dict, prefix: str, ignored: List[Tuple[str, List[str]]]) -> None:
    """Delete, in place, the entries of ``obj`` (and of the dicts nested in it) whose key or
    value is or contains a placeholder; record ``(dotted key, names)`` in ``ignored``."""
    for key in list(obj):
        value = obj[key]
        path = f'{prefix}{key}'
        if isinstance(value, dict) and not _is_foreign(key):
            _drop_foreign(value, f'{path}.', ignored)
            continue
        names = _foreign_names(key) + _foreign_names(value)
        if names:
            del obj[key]
            ignored.append((path, sorted(set(names))))


def _strip_foreign(obj: Any, filename: str, foreign: Dict[str, type]) -> Any:
    """Remove the placeholders :func:`_load_restricted` left and log what was ignored."""
    ignored: List[Tuple[str, List[str]]] = []
    if isinstance(obj, dict):
        _drop_foreign(obj, '', ignored)
    names = _foreign_names(obj)
    if names:
        what = 'is a pickled object' if _is_foreign(obj) else \
            f'is a {type(obj).__name__} of pickled objects'
        raise pickle.UnpicklingError(
            f'{filename} {what} mmslab does not load ({", ".join(names)}), not a checkpoint; '
            'nothing from it was executed.')
    if ignored:
        print_log(f'{filename}: ignored ' + ', '.join(f'{k} ({", ".join(n)})' for k, n in ignored)
                  + ': pickled objects that are not weights (not loaded, nothing from them was '
                  'executed)', logger='current')
    hidden = sorted(set(foreign) - {n for _, names in ignored for n in names})
    if hidden:  # e.g. in a tensor's Python state: inert, but say so
        print_log(f'{filename}: inert placeholders left for pickled globals {hidden}',
                  logger='current')
    return obj


def load_checkpoint_file(path: str, map_location: Any = 'cpu', ignore_foreign: bool = True) -> Any:
    """Load a local checkpoint with ``weights_only=True`` and mmslab's allow-list.

    A file that this refuses because it holds other pickled objects (the SLAB authors'
    ``config``, RePaViT's ``args`` ...) is read again by the restricted unpickler described in the
    module docstring, which never executes code from the file: the entries holding such objects
    are dropped (and logged), the tensors come back.

    Args:
        path (str): Local file path (``~`` is expanded).
        map_location: Same as for :func:`torch.load`. Defaults to ``'cpu'``.
        ignore_foreign (bool): Drop foreign objects instead of refusing the file. Defaults to
            True.

    Returns:
        The loaded object (usually a dict with ``state_dict``, ``meta``, ``optimizer``...).

    Raises:
        FileNotFoundError: If ``path`` is not a file.
        pickle.UnpicklingError: If the file contains a global outside the allow-list and
            ``ignore_foreign`` is False, or if even the restricted read fails.
    """
    filename = osp.expanduser(str(path))
    if not osp.isfile(filename):
        raise FileNotFoundError(f'{filename} can not be found.')
    already = torch.serialization.get_safe_globals()
    extra = [g for g in safe_globals_for_checkpoints() if g not in already]
    with torch.serialization.safe_globals(extra):
        try:
            return torch.load(filename, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            if not ignore_foreign:
                raise
            refused = err
        foreign: Dict[str, type] = {}
        try:
            obj = _load_restricted(filename, map_location, foreign)
        except Exception as err:  # noqa: BLE001 - reported with torch's message
            raise pickle.UnpicklingError(
                f'{refused}\n\nmmslab could not read {filename} with foreign objects replaced '
                f'by inert placeholders either ({type(err).__name__}: {err}); the file is '
                'refused, nothing from it was executed.') from err
    return _strip_foreign(obj, filename, foreign)


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
