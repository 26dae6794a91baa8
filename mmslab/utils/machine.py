"""What machine a timing was taken on: CPU model, vector ISA level, BLAS, threads, and the
GPU when the timing ran on one (name, driver, CUDA and cuDNN versions, compute capability,
memory).

Speed ratios differ between CPUs and GPUs (a kernel that wins on one loses on another), so
every benchmark JSON records this next to its figures.
"""
import platform
import re
import subprocess
from typing import Dict, List, Optional

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


def has_int8_dot_product() -> bool:
    """Whether the CPU sums 8-bit products into 32 bits in one instruction (VNNI or AMX).
    Without it, x86 kernels add pairs of u8 x s8 products in 16 bits, which 8-bit weights
    can saturate (onnxruntime's INT8 weights then take 7 bits:
    :func:`mmslab.deploy.runtimes.int8_weight_bits`)."""
    return bool({'avx512_vnni', 'avx_vnni', 'amx_int8'} & set(cpu_flags()))


def require_bf16(what: str) -> None:
    """Refuse ``what`` in bf16 on a CPU without bf16 units (it would run emulated, slower)."""
    if not has_bf16():
        cpu = _cpuinfo().get('model name', 'unknown')
        raise RuntimeError(f'{what}: bf16 needs a CPU with avx512_bf16 or amx_bf16; this one '
                           f'({cpu}) has neither. Use fp32 or int8.')


def nvidia_driver_version() -> Optional[str]:
    """The NVIDIA driver version (``nvidia-smi --query-gpu=driver_version``), or None where
    ``nvidia-smi`` is missing or fails."""
    try:
        proc = subprocess.run(['nvidia-smi', '--query-gpu=driver_version',
                               '--format=csv,noheader'], capture_output=True, text=True,
                              timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    return lines[0] if lines else None  # one driver serves every GPU of a machine


def gpu_info(device='cuda') -> dict:
    """The CUDA device ``device`` (``'cuda'``: the current one): ``name``, ``index``,
    ``compute_capability`` (``'9.0'``), ``memory_gib``, ``multiprocessors``, ``driver``
    (:func:`nvidia_driver_version`), ``cuda`` (``torch.version.cuda``), ``cudnn``
    (``torch.backends.cudnn.version()``) and ``device_count``."""
    import torch
    device = torch.device(device)
    if device.type != 'cuda':
        raise ValueError(f'gpu_info: {device} is not a CUDA device')
    index = torch.cuda.current_device() if device.index is None else device.index
    props = torch.cuda.get_device_properties(index)
    major, minor = torch.cuda.get_device_capability(index)
    return dict(name=torch.cuda.get_device_name(index), index=index,
                compute_capability=f'{major}.{minor}',
                memory_gib=round(props.total_memory / 2**30, 1),
                multiprocessors=getattr(props, 'multi_processor_count', None),
                driver=nvidia_driver_version(), cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version(), device_count=torch.cuda.device_count())


def machine_info(device=None) -> dict:
    """The CPU, its ISA level and flags, BLAS, torch threads, torch / Python versions and the
    memory allocator mode; with a CUDA ``device`` (where the timing runs) also ``gpu``
    (:func:`gpu_info`). ``device`` None or a CPU device: no ``gpu`` entry."""
    import torch
    info = _cpuinfo()
    flags = [f for f in info.get('flags', '').split() if f in _ISA_FLAGS]
    out = dict(cpu=info.get('model name', platform.processor() or 'unknown'),
               isa=isa_level(flags), isa_flags=flags, blas=blas_backend(),
               torch_threads=torch.get_num_threads(), torch=torch.__version__,
               python=platform.python_version(), memory_allocator=allocator_info())
    if device is not None and torch.device(device).type == 'cuda':
        out['gpu'] = gpu_info(device)
    return out


def gpu_line(gpu: dict) -> str:
    """``'<GPU name> (sm 9.0, 79.1 GiB; CUDA 12.8, cuDNN 90100, driver 570.1)'``."""
    return (f"{gpu['name']} (sm {gpu['compute_capability']}, {gpu['memory_gib']:g} GiB; "
            f"CUDA {gpu['cuda']}, cuDNN {gpu['cudnn']}, driver {gpu['driver'] or 'unknown'})")


def machine_line(info: dict = None) -> str:
    """``'<CPU model> (avx512, mkl), 2 threads'`` for tables and logs; a timing on a GPU names
    it first: ``'<GPU name> (sm 9.0, ...); host <CPU model> (avx512, mkl), 2 threads'``."""
    info = info or machine_info()
    line = f"{info['cpu']} ({info['isa']}, {info['blas']}), {info['torch_threads']} threads"
    alloc = info.get('memory_allocator')
    line += f", malloc {alloc['mode']}" if alloc else ''
    if info.get('gpu'):
        return f"{gpu_line(info['gpu'])}; host {line}"
    return line


def machine_slug(info: dict = None) -> str:
    """The prefix of a results file ``benchmarks/results/<machine>-<tool>.json``: vendor and
    product family of the GPU where the figures ran on one, else of the CPU (``+ '-amx'``
    where it has AMX), lower case, words joined by ``-``."""
    info = info or machine_info()
    gpu = info.get('gpu')
    name = gpu['name'] if gpu else info.get('cpu', 'unknown')
    words = re.sub(r'\((R|TM|tm)\)|\b(CPU|Processor)\b|[^\w\s-]', ' ', name).split()
    slug = '-'.join(w.lower() for w in words[:2]) or 'unknown'
    return slug + ('-amx' if not gpu and info.get('isa') == 'amx' else '')
