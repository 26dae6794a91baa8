"""Keep freed memory inside the process (glibc), so eager CPU inference stops re-faulting it.

PyTorch's CPU tensors come straight from ``malloc``. glibc hands large freed blocks back to
the kernel (blocks above the mmap threshold, and heap tops above the trim threshold), so each
forward pass page-faults its activation memory in again. Keeping freed memory helps most the
models with the most temporaries (fused SLAB-Swin-T), little or not measurably the others
(A/B pairs of processes, eager: docs/benchmarks.md).
The effect depends on the kernel and the VM, so benchmark tools apply it to every model alike
and record it in their JSON. onnxruntime and OpenVINO use their own memory arenas.

The same effect without code: ``MALLOC_TRIM_THRESHOLD_=-1 MALLOC_MMAP_THRESHOLD_=33554432``
in the environment, or a caching allocator (jemalloc, tcmalloc) via ``LD_PRELOAD``.
"""
import ctypes
import ctypes.util

# (name, mallopt() parameter code from malloc.h, value). glibc refuses mmap thresholds above
# half its 64 MiB heap size (64-bit); mallopt() takes an int: "never trim" is the largest one.
KEEP_SETTINGS = (('M_MMAP_THRESHOLD', -3, 32 << 20), ('M_TRIM_THRESHOLD', -1, 2**31 - 1),
                 ('M_TOP_PAD', -2, 64 << 20))
MODES = ('keep', 'default')

_mode = 'default'


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None, None
    version.restype = ctypes.c_char_p
    return libc, version().decode()


def set_allocator_mode(mode: str) -> dict:
    """``'keep'``: keep freed memory in the process (glibc ``mallopt``); ``'default'``: leave
    the allocator as it is. Returns :func:`allocator_info`. Other C libraries: a warning-free
    no-op, recorded as such."""
    global _mode
    if mode not in MODES:
        raise ValueError(f'unknown allocator mode {mode!r}; valid: {", ".join(MODES)}')
    libc, _ = _glibc()
    if mode == 'keep' and libc is not None:
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        for name, code, value in KEEP_SETTINGS:
            if not libc.mallopt(code, value):
                raise RuntimeError(f'glibc refused mallopt({name}, {value})')
        _mode = 'keep'
    return allocator_info()


def allocator_info() -> dict:
    """What benchmark JSONs record: ``{'allocator': 'glibc 2.36', 'mode': 'keep'}``."""
    _, version = _glibc()
    return dict(allocator=f'glibc {version}' if version else 'not glibc', mode=_mode)


def add_allocator_argument(parser) -> None:
    """``--malloc keep|default`` for the benchmark tools (default ``keep``)."""
    parser.add_argument(
        '--malloc', choices=MODES, default='keep',
        help="'keep': freed memory stays in the process (glibc mallopt), so eager PyTorch "
             "does not page-fault its activations in again on every call; applies to every "
             "model alike and is recorded in the JSON. 'default': the allocator as it is")
