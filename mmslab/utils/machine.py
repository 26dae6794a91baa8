"""What machine a timing was taken on: CPU model, vector ISA level, BLAS, threads.

Speed ratios differ between CPUs (a kernel that wins on one loses on another), so every
benchmark JSON records this next to its figures.
"""
import platform
import re
from typing import Dict, List

from .allocator import allocator_info

# torch is imported where it is used: the CPU feature checks (``has_bf16``, ``require_bf16``)
# serve the torch-free predictor too (``python -m mmslab.deploy.predict``).

# The ISA extensions that decide which CPU kernels PyTorch / onnxruntime / OpenVINO pick.
_ISA_FLAGS = ('avx2', 'fma', 'avx512f', 'avx512_vnni', 'avx512_bf16', 'amx_tile', 'amx_int8',
              'amx_bf16', 'avx_vnni')


def _cpuinfo() -> Dict[str, str]:
    info = {}
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if ':' in line:
                    key, value = (s.strip() for s in line.split(':', 1))
                    info.setdefault(key, value)
    except OSError:
        pass
    return info


def isa_level(flags: List[str]) -> str:
    """A one-word summary: ``amx`` > ``avx512`` > ``avx2`` > ``baseline``."""
    if 'amx_tile' in flags:
        return 'amx'
    if 'avx512f' in flags:
        return 'avx512'
    if 'avx2' in flags:
        return 'avx2'
    return 'baseline'


def blas_backend() -> str:
    """The BLAS PyTorch was built with (MKL, OpenBLAS, ...), from its build configuration."""
    import torch
    config = torch.__config__.show()
    m = re.search(r'BLAS_INFO=(\w+)', config)
    if m:
        return m.group(1)
    return 'mkl' if torch.backends.mkl.is_available() else 'unknown'


def cpu_flags() -> List[str]:
    return _cpuinfo().get('flags', '').split()


def has_bf16() -> bool:
    """Whether the CPU computes bf16 natively (AVX-512 BF16 or AMX BF16)."""
    return bool({'avx512_bf16', 'amx_bf16'} & set(cpu_flags()))


def require_bf16(what: str) -> None:
    """Refuse ``what`` in bf16 on a CPU without bf16 units (it would run emulated, slower)."""
    if not has_bf16():
        cpu = _cpuinfo().get('model name', 'unknown')
        raise RuntimeError(f'{what}: bf16 needs a CPU with avx512_bf16 or amx_bf16; this one '
                           f'({cpu}) has neither. Use fp32 or int8.')


def machine_info() -> dict:
    import torch
    info = _cpuinfo()
    flags = [f for f in info.get('flags', '').split() if f in _ISA_FLAGS]
    return dict(cpu=info.get('model name', platform.processor() or 'unknown'),
                isa=isa_level(flags), isa_flags=flags, blas=blas_backend(),
                torch_threads=torch.get_num_threads(), torch=torch.__version__,
                python=platform.python_version(), memory_allocator=allocator_info())


def machine_line(info: dict = None) -> str:
    """``'AMD EPYC (avx512, mkl), 2 threads'`` for tables and logs."""
    info = info or machine_info()
    line = f"{info['cpu']} ({info['isa']}, {info['blas']}), {info['torch_threads']} threads"
    alloc = info.get('memory_allocator')
    return line + (f", malloc {alloc['mode']}" if alloc else '')
