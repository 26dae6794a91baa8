"""Denormal floats flushed to zero on the calling thread, without PyTorch.

onnxruntime's ``session.set_denormal_as_zero`` option sets flush-to-zero (FTZ) and
denormals-are-zero (DAZ) on its intra-op worker threads only, but the thread that calls
``session.run`` computes a share of every parallel operator too, and an operator ends when its
slowest share does. Softmax is where it shows: onnxruntime's exponential clamps its input at
about -104 and returns a denormal for every masked score (any score more than about 87 below
its row's maximum, whatever the mask's fill), which the normalization then multiplies. A
shifted window's Softmax took several times as long as an unshifted one's; with both threads
flushed, the same.

:func:`flushed_denormals` sets FTZ and DAZ in the calling thread's MXCSR for a ``with`` block
and restores the previous state on exit. It needs x86-64 and glibc's ``fegetenv`` /
``fesetenv``, whose ``fenv_t`` holds the MXCSR; elsewhere it does nothing
(:func:`can_flush_denormals` says which).

Only values below 1.2e-38 change (to zero): a softmax probability that small, or a product
of one, is zero to float precision in any output.
"""
import ctypes
import ctypes.util
import platform
import struct
import sys
from contextlib import contextmanager
from typing import Iterator, Optional

#: MXCSR bits: flush-to-zero (15) and denormals-are-zero (6).
MXCSR_FTZ_DAZ = 0x8040
#: Byte offset of ``__mxcsr`` in glibc's x86-64 ``fenv_t`` (28 bytes of x87 state first).
_MXCSR_OFFSET = 28
_FENV_BYTES = 64  # glibc's fenv_t is 32 bytes; room to spare

_libm = None  # the loaded libm, False where flushing is not available


def _load_libm() -> Optional[ctypes.CDLL]:
    global _libm
    if _libm is None:
        _libm = False
        if sys.platform.startswith('linux') and platform.machine() in ('x86_64', 'AMD64') \
                and platform.libc_ver()[0] == 'glibc':
            try:
                libm = ctypes.CDLL(ctypes.util.find_library('m') or 'libm.so.6')
                if _flushes(libm):
                    _libm = libm
            except (OSError, AttributeError):  # no libm, or no fegetenv / fesetenv in it
                pass
    return _libm or None


def _get_env(libm) -> ctypes.Array:
    env = ctypes.create_string_buffer(_FENV_BYTES)
    if libm.fegetenv(env) != 0:
        raise OSError('fegetenv failed')
    return env


def _mxcsr(env) -> int:
    return struct.unpack_from('<I', env.raw, _MXCSR_OFFSET)[0]


def _with_mxcsr(env, value: int) -> ctypes.Array:
    raw = bytearray(env.raw)
    struct.pack_into('<I', raw, _MXCSR_OFFSET, value)
    return ctypes.create_string_buffer(bytes(raw), _FENV_BYTES)


def _flushes(libm) -> bool:
    """Whether setting the bits through ``fesetenv`` makes this thread flush a denormal
    product (checked once, the previous state restored)."""
    import numpy as np
    before = _get_env(libm)
    try:
        if libm.fesetenv(_with_mxcsr(before, _mxcsr(before) | MXCSR_FTZ_DAZ)) != 0:
            return False
        tiny = np.full(4, 1e-39, np.float32) * np.float32(1.0)
        return bool((tiny == 0).all()) and _mxcsr(_get_env(libm)) & MXCSR_FTZ_DAZ == \
            MXCSR_FTZ_DAZ
    finally:
        libm.fesetenv(before)


def can_flush_denormals() -> bool:
    """Whether :func:`flushed_denormals` flushes on this machine (x86-64 with glibc)."""
    return _load_libm() is not None


@contextmanager
def flushed_denormals(enabled: bool = True) -> Iterator[None]:
    """FTZ + DAZ on the calling thread inside the block (nothing if ``enabled`` is False or
    the machine cannot, see :func:`can_flush_denormals`); the previous state is restored on
    every exit path."""
    libm = _load_libm() if enabled else None
    if libm is None:
        yield
        return
    before = _get_env(libm)
    libm.fesetenv(_with_mxcsr(before, _mxcsr(before) | MXCSR_FTZ_DAZ))
    try:
        yield
    finally:
        libm.fesetenv(before)
