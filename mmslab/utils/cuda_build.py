"""How to build mmcv's compiled ops on this machine: CPU only, or with CUDA for which GPUs.

``tools/install_deps.sh`` runs this file as a script (before mmslab itself is installed, so
it imports nothing but the standard library and, lazily, torch)::

    python -P mmslab/utils/cuda_build.py plan     # shell 'export' lines, or an error (exit 3)
    python -P mmslab/utils/cuda_build.py verify   # the installed mmcv has what the plan asked

The decision is a pure function, :func:`plan_build`, of :class:`BuildFacts` (what torch,
``nvidia-smi`` and ``nvcc`` report) and the switch ``MMSLAB_CUDA``:

* ``auto`` (default): CUDA ops when ``nvidia-smi`` lists a GPU, CPU ops otherwise;
* ``1``: CUDA ops even without a GPU (to build a wheel for another machine); the arch list is
  ``TORCH_CUDA_ARCH_LIST`` or :data:`DEFAULT_ARCHS`;
* ``0``: CPU ops only, even on a GPU machine.

A CUDA build is refused before compiling, with the fix named, when torch is a CPU build,
the driver is too old for torch's CUDA, no ``nvcc`` of torch's CUDA major is found
(``CUDA_HOME``, ``PATH``, the ``nvidia-cuda-nvcc`` package in site-packages), or an arch is
one that nvcc cannot target. The plan's cache key names torch, its CUDA and the arch list,
so a CPU-only wheel or a wheel for other GPUs is never reused where it does not fit.
"""
import dataclasses
import glob
import os
import os.path as osp
import re
import shlex
import shutil
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

MMCV_VERSION = '2.1.0'
#: Arch list of a CUDA build without a GPU to read it from (``MMSLAB_CUDA=1``): Ampere (sm_80)
#: and Hopper (sm_90) machine code, plus Hopper PTX that newer GPUs compile at load time.
DEFAULT_ARCHS = '8.0;9.0+PTX'
MODES = ('auto', '0', '1')
_ARCH_RE = re.compile(r'^(\d+)\.(\d+)([a-z]?)(\+PTX)?$')


class BuildPlanError(RuntimeError):
    """A CUDA build that would fail or produce something unusable; the message names the fix."""


@dataclasses.dataclass
class BuildFacts:
    """What the machine reports; every field may be missing (None / empty)."""
    python: str                                   # '3.11'
    torch_version: str                            # '2.14.1+cu130'
    torch_cuda: Optional[str] = None              # '13.0'; None for a CPU build of torch
    torch_sees_gpu: bool = False                  # torch.cuda.is_available()
    gpus: List[Tuple[str, str]] = dataclasses.field(default_factory=list)  # (name, '9.0')
    driver: Optional[str] = None                  # '580.95.05'
    driver_cuda: Optional[str] = None             # highest CUDA the driver supports, '13.0'
    nvidia_smi_error: Optional[str] = None        # nvidia-smi exists but failed
    nvccs: List[Tuple[str, Optional[str], Optional[str]]] = dataclasses.field(
        default_factory=list)                     # (path, version, toolkit root) candidates
    nvcc_archs: List[str] = dataclasses.field(default_factory=list)  # ['7.5', '8.0', ...]
    wheel_include_dirs: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class BuildPlan:
    kind: str                    # 'cpu' or 'cuda'
    key: str                     # wheel cache key
    env: Dict[str, str]          # variables for the mmcv build
    notes: List[str]
    archs: Optional[str] = None  # normalized TORCH_CUDA_ARCH_LIST of a CUDA build
    torch_cuda: Optional[str] = None  # torch's CUDA version ('13.0'), None for a CPU torch


def _major_minor(version: Optional[str]) -> Optional[Tuple[int, int]]:
    m = re.match(r'^(\d+)\.(\d+)', version or '')
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_nvcc_version(text: str) -> Optional[str]:
    """``'13.0'`` from ``nvcc --version`` output (``... release 13.0, V13.0.88``)."""
    m = re.search(r'release (\d+\.\d+)', text)
    return m.group(1) if m else None


def parse_nvidia_smi(header: str, query: str):
    """``(driver, driver_cuda, gpus)`` from plain ``nvidia-smi`` output (its banner names the
    driver and the highest CUDA it supports) and from ``nvidia-smi
    --query-gpu=name,compute_cap --format=csv,noheader``."""
    driver = re.search(r'Driver Version:\s*([\d.]+)', header)
    cuda = re.search(r'CUDA Version:\s*([\d.]+)', header)
    gpus = []
    for line in query.splitlines():
        parts = [p.strip() for p in line.rsplit(',', 1)]
        if len(parts) == 2 and re.match(r'^\d+\.\d+$', parts[1]):
            gpus.append((parts[0], parts[1]))
    return (driver.group(1) if driver else None, cuda.group(1) if cuda else None, gpus)


def normalize_archs(text: str) -> str:
    """``'9.0 8.0+PTX'`` / ``'8.0;9.0'`` -> ``'8.0;9.0+PTX'`` (sorted, ';'-separated); raises
    :class:`BuildPlanError` for an entry that is not ``MAJOR.MINOR[a][+PTX]``."""
    entries = [e for e in re.split(r'[;\s]+', text.strip()) if e]
    if not entries:
        raise BuildPlanError('TORCH_CUDA_ARCH_LIST is empty; give compute capabilities such '
                             "as '9.0' or '8.0;9.0+PTX'")
    for e in entries:
        if not _ARCH_RE.match(e):
            raise BuildPlanError(
                f'TORCH_CUDA_ARCH_LIST entry {e!r} is not a compute capability; use '
                "MAJOR.MINOR with an optional +PTX, e.g. '8.6' or '9.0+PTX' (separated by ';')")

    def order(e):
        m = _ARCH_RE.match(e)
        return int(m.group(1)), int(m.group(2)), m.group(3), bool(m.group(4))
    return ';'.join(sorted(dict.fromkeys(entries), key=order))


def _capability(entry: str) -> str:
    """``'9.0+PTX'`` -> ``'9.0'``: the compute capability of an arch list entry."""
    m = _ARCH_RE.match(entry)
    return f'{m.group(1)}.{m.group(2)}'


def arch_tag(archs: str) -> str:
    """``'8.0;9.0+PTX'`` -> ``'sm80-sm90+ptx'``: the arch list as a path component."""
    out = []
    for e in archs.split(';'):
        m = _ARCH_RE.match(e)
        out.append(f'sm{m.group(1)}{m.group(2)}{m.group(3)}' + ('+ptx' if m.group(4) else ''))
    return '-'.join(out)


def cache_key(facts: BuildFacts, kind: str, archs: Optional[str] = None) -> str:
    """The wheel cache's folder name: Python, torch (its version names its CUDA build), the
    kind of ops and, for CUDA, the CUDA version and arch list."""
    base = f'py{facts.python}-torch{facts.torch_version}'
    if kind == 'cpu':
        return f'{base}-cpu'
    return f'{base}-cuda{facts.torch_cuda}-{arch_tag(archs)}'


def _torch_for_cuda_hint(cuda_major: int) -> str:
    return (f'or install a torch built for CUDA {cuda_major}.x (pytorch.org lists the pip '
            f'command, e.g. pip install torch torchvision --index-url '
            f'https://download.pytorch.org/whl/cu{cuda_major}<minor>)')


def plan_build(facts: BuildFacts, mode: str = 'auto',
               arch_list: Optional[str] = None) -> BuildPlan:
    """Decide the mmcv build. ``arch_list`` is ``TORCH_CUDA_ARCH_LIST`` if the user set it.

    Raises :class:`BuildPlanError` (message naming the fix) for a CUDA build that cannot work.
    """
    if mode not in MODES:
        raise BuildPlanError(f'MMSLAB_CUDA={mode!r} is not valid; use one of {MODES}: auto '
                             '(CUDA ops when a GPU is present), 1 (always), 0 (CPU ops only)')
    notes = []
    if mode == '0' or (mode == 'auto' and not facts.gpus):
        if mode == 'auto':
            why = (f'nvidia-smi failed ({facts.nvidia_smi_error})' if facts.nvidia_smi_error
                   else 'no NVIDIA GPU found')
            notes.append(f'{why}: building mmcv with its CPU ops only '
                         '(MMSLAB_CUDA=1 builds the CUDA ops anyway)')
        elif facts.gpus:
            notes.append(f'MMSLAB_CUDA=0 on a machine with {len(facts.gpus)} GPU(s): mmcv gets '
                         "CPU ops only, so mmdet's RoIAlign / NMS fail on CUDA tensors")
        return BuildPlan('cpu', cache_key(facts, 'cpu'), {}, notes, None, facts.torch_cuda)

    # -- CUDA build: refuse early what would fail late (or silently run on the CPU) ----------
    if facts.torch_cuda is None:
        raise BuildPlanError(
            f'torch {facts.torch_version} is a CPU-only build, so mmcv cannot be built with '
            'CUDA ops against it. Install a CUDA build of torch (on x86_64, PyPI\'s '
            'torch==2.14.1 is built for CUDA 13.0), or set MMSLAB_CUDA=0 for the CPU ops only.')
    torch_mm = _major_minor(facts.torch_cuda)
    if facts.gpus:
        driver_mm = _major_minor(facts.driver_cuda)
        if driver_mm is None:
            raise BuildPlanError(
                'nvidia-smi lists GPUs but does not say which CUDA its driver supports '
                "('CUDA Version' in its banner); update the NVIDIA driver.")
        if driver_mm[0] < torch_mm[0]:
            raise BuildPlanError(
                f'the NVIDIA driver {facts.driver or "?"} supports CUDA up to '
                f'{facts.driver_cuda}, but torch {facts.torch_version} is built for CUDA '
                f'{facts.torch_cuda}: torch would not see the GPU and everything would run on '
                f'the CPU. Upgrade the driver to one that supports CUDA {torch_mm[0]} '
                f"(nvidia-smi then shows 'CUDA Version: {torch_mm[0]}.x'), "
                + _torch_for_cuda_hint(driver_mm[0]) + '.')
        if driver_mm < torch_mm:
            notes.append(f'driver supports CUDA {facts.driver_cuda} < torch\'s '
                         f'{facts.torch_cuda}: minor-version compatibility applies (PTX '
                         'compiled at load time may fail)')
        if not facts.torch_sees_gpu:
            raise BuildPlanError(
                f'nvidia-smi lists {len(facts.gpus)} GPU(s) and the driver supports CUDA '
                f'{facts.driver_cuda}, but torch.cuda.is_available() is False: check '
                'CUDA_VISIBLE_DEVICES and that the container runs with the NVIDIA runtime '
                '(--gpus all).')
    elif mode == '1':
        notes.append('MMSLAB_CUDA=1 without a GPU: compiling only (nothing can run the CUDA '
                     'ops here); the device code is checked with cuobjdump afterwards')

    matching = [n for n in facts.nvccs
                if _major_minor(n[1]) and _major_minor(n[1])[0] == torch_mm[0]]
    pip_fix = (f'pip install "nvidia-cuda-nvcc=={torch_mm[0]}.*" '
               f'"nvidia-cuda-cccl=={torch_mm[0]}.*" "nvidia-cuda-runtime=={torch_mm[0]}.*" '
               'into this environment')
    if not matching:
        if not facts.nvccs:
            raise BuildPlanError(
                f'no nvcc found (looked at $CUDA_HOME/bin, PATH, /usr/local/cuda and the '
                f'nvidia-cuda-nvcc package in site-packages); torch needs CUDA '
                f'{facts.torch_cuda}: install the CUDA {torch_mm[0]}.x toolkit and set '
                f'CUDA_HOME to it, or {pip_fix}.')
        found = ', '.join(f'{p} ({v or "unknown version"})' for p, v, _ in facts.nvccs)
        raise BuildPlanError(
            f'torch {facts.torch_version} is built for CUDA {facts.torch_cuda}, but the nvcc '
            f'found is {found}; torch\'s extension builder refuses a different CUDA major. '
            f'Point CUDA_HOME at a CUDA {torch_mm[0]}.x toolkit, or {pip_fix}, '
            + _torch_for_cuda_hint(_major_minor(facts.nvccs[0][1])[0]
                                   if _major_minor(facts.nvccs[0][1]) else torch_mm[0]) + '.')
    nvcc, nvcc_version, toolkit = matching[0]
    if not toolkit or not osp.isfile(osp.join(toolkit, 'include', 'cuda_runtime.h')) \
            or not osp.isfile(osp.join(toolkit, 'include', 'crt', 'host_defines.h')):
        raise BuildPlanError(
            f'nvcc {nvcc} ({nvcc_version}) belongs to a toolkit at {toolkit or "?"} without '
            "the CUDA runtime headers (include/cuda_runtime.h, include/crt/); set CUDA_HOME "
            f'to a complete CUDA {torch_mm[0]}.x toolkit, or {pip_fix}.')

    if arch_list:
        archs = normalize_archs(arch_list)
        notes.append(f'arch list from TORCH_CUDA_ARCH_LIST: {archs}')
    elif facts.gpus:
        archs = normalize_archs(';'.join(cap for _, cap in facts.gpus))
        notes.append(f'arch list from the GPUs present: {archs} '
                     f'({", ".join(sorted({n for n, _ in facts.gpus}))})')
    else:
        archs = DEFAULT_ARCHS
        notes.append(f'arch list: the default {archs} (set TORCH_CUDA_ARCH_LIST for others)')
    if facts.nvcc_archs:
        unsupported = [a for a in archs.split(';') if _capability(a) not in facts.nvcc_archs]
        if unsupported:
            raise BuildPlanError(
                f'nvcc {nvcc_version} cannot compile for {", ".join(unsupported)}; it targets '
                f'{", ".join(facts.nvcc_archs)}. Change TORCH_CUDA_ARCH_LIST, or use a CUDA '
                'toolkit that supports these GPUs.')

    def appended(name, values, sep):
        old = os.environ.get(name, '')
        return sep.join([old] + values if old else values)
    includes = list(facts.wheel_include_dirs)
    env = dict(FORCE_CUDA='1', CUDA_HOME=toolkit, TORCH_CUDA_ARCH_LIST=archs,
               PATH=osp.join(toolkit, 'bin') + os.pathsep + os.environ.get('PATH', ''))
    if includes:
        # torch's own headers include cuBLAS / cuSPARSE / cuDNN headers that a minimal toolkit
        # lacks and torch's wheels bring: -I after the toolkit's own include dir for nvcc,
        # CPATH for the host compiler.
        env['NVCC_APPEND_FLAGS'] = appended('NVCC_APPEND_FLAGS',
                                            [f'-I{d}' for d in includes], ' ')
        env['CPATH'] = appended('CPATH', includes, os.pathsep)
    notes.append(f'CUDA build: nvcc {nvcc_version} ({nvcc}), CUDA_HOME={toolkit}')
    return BuildPlan('cuda', cache_key(facts, 'cuda', archs), env, notes, archs,
                     facts.torch_cuda)


# -- gathering the facts -----------------------------------------------------------------------
def _run(args: Sequence[str], timeout: float = 60) -> Tuple[int, str]:
    try:
        proc = subprocess.run(list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        return 127, str(err)
    return proc.returncode, proc.stdout


def site_packages_dirs() -> List[str]:
    import site
    dirs = list(getattr(site, 'getsitepackages', lambda: [])())
    return [d for d in dict.fromkeys(dirs + [p for p in sys.path if 'site-packages' in p])
            if osp.isdir(d)]


def nvcc_candidates(env: Optional[Dict[str, str]] = None,
                    site_dirs: Optional[List[str]] = None) -> List[str]:
    """nvcc executables in the order a build looks for them: ``$CUDA_HOME/bin``, ``PATH``,
    ``/usr/local/cuda/bin``, then the ``nvidia-cuda-nvcc`` wheels in site-packages."""
    env = os.environ if env is None else env
    found = []
    for home in (env.get('CUDA_HOME'), env.get('CUDA_PATH')):
        if home:
            found.append(osp.join(home, 'bin', 'nvcc'))
    which = shutil.which('nvcc', path=env.get('PATH'))
    if which:
        found.append(which)
    found.append('/usr/local/cuda/bin/nvcc')
    for d in site_dirs if site_dirs is not None else site_packages_dirs():
        found += sorted(glob.glob(osp.join(d, 'nvidia', '*', 'bin', 'nvcc')))
    out = []
    for path in found:
        if osp.isfile(path) and os.access(path, os.X_OK):
            real = osp.realpath(path)
            if real not in [osp.realpath(p) for p in out]:
                out.append(path)
    return out


def nvcc_toolkit_root(nvcc: str) -> Optional[str]:
    """The toolkit an nvcc belongs to (its ``TOP``, from ``nvcc --dryrun``), also when the
    nvcc on PATH is a wrapper script that calls a toolkit installed elsewhere."""
    code, out = _run([nvcc, '--dryrun', '-x', 'cu', '-c', os.devnull, '-o', os.devnull])
    m = re.search(r'^#\$ TOP=(.+)$', out, re.M)
    if m:
        return osp.realpath(m.group(1).strip())
    return osp.dirname(osp.dirname(osp.realpath(nvcc)))


def gather_facts() -> BuildFacts:
    import torch
    facts = BuildFacts(python='%d.%d' % sys.version_info[:2], torch_version=torch.__version__,
                       torch_cuda=torch.version.cuda)
    if facts.torch_cuda:
        facts.torch_sees_gpu = torch.cuda.is_available()
    if shutil.which('nvidia-smi'):
        code, header = _run(['nvidia-smi'])
        code2, query = _run(['nvidia-smi', '--query-gpu=name,compute_cap',
                             '--format=csv,noheader'])
        if code or code2:
            facts.nvidia_smi_error = (header if code else query).strip().splitlines()[-1:]
            facts.nvidia_smi_error = facts.nvidia_smi_error[0] if facts.nvidia_smi_error \
                else f'exit code {code or code2}'
        else:
            facts.driver, facts.driver_cuda, facts.gpus = parse_nvidia_smi(header, query)
    site_dirs = site_packages_dirs()
    for nvcc in nvcc_candidates(site_dirs=site_dirs):
        code, out = _run([nvcc, '--version'])
        facts.nvccs.append((nvcc, parse_nvcc_version(out) if code == 0 else None,
                            nvcc_toolkit_root(nvcc) if code == 0 else None))
    # the archs of the nvcc plan_build will pick: the first one of torch's CUDA major
    torch_major = (facts.torch_cuda or '').split('.')[0]
    usable = [n for n in facts.nvccs if n[1] and n[1].split('.')[0] == torch_major]
    if usable:
        code, out = _run([usable[0][0], '--list-gpu-arch'])
        if code == 0:
            facts.nvcc_archs = ['%s.%s' % (m[:-1], m[-1]) for m in
                                re.findall(r'compute_(\d+)', out)]
    for d in site_dirs:
        facts.wheel_include_dirs += sorted(glob.glob(osp.join(d, 'nvidia', '*', 'include')))
    return facts


def shell_exports(plan: BuildPlan) -> str:
    """The plan as ``export NAME=value`` lines for ``eval`` in bash."""
    lines = [f'export MMSLAB_MMCV_KIND={plan.kind}',
             f'export MMSLAB_TORCH_CUDA={shlex.quote(plan.torch_cuda or "")}',
             f'export MMSLAB_MMCV_KEY={shlex.quote(plan.key)}',
             f'export MMSLAB_MMCV_ARCHS={shlex.quote(plan.archs or "")}']
    lines += [f'export MMSLAB_BUILD_{k}={shlex.quote(v)}' for k, v in plan.env.items()]
    lines.append('export MMSLAB_BUILD_VARS=' + shlex.quote(' '.join(plan.env)))
    return '\n'.join(lines)


# -- verification of the installed mmcv --------------------------------------------------------
def find_tool(name: str, toolkit: Optional[str] = None,
              extra_dirs: Sequence[str] = ()) -> Optional[str]:
    """``name`` (e.g. cuobjdump) from a toolkit, PATH, the nvidia-* wheels in site-packages or
    in ``extra_dirs`` (folders pip installed wheels into with ``--target``)."""
    candidates = [osp.join(toolkit, 'bin', name)] if toolkit else []
    which = shutil.which(name)
    if which:
        candidates.append(which)
    for d in [*site_packages_dirs(), *extra_dirs]:
        candidates += sorted(glob.glob(osp.join(d, 'nvidia', '*', 'bin', name)))
    return next((c for c in candidates if osp.isfile(c) and os.access(c, os.X_OK)), None)


def cuobjdump(tools_dir: str, toolkit: Optional[str] = None) -> str:
    """A cuobjdump: the toolkit's, PATH's or site-packages', else the one of the
    ``nvidia-cuda-cuobjdump`` wheel (0.3 MB) of torch's CUDA major, installed into
    ``tools_dir`` (kept there for the next call)."""
    found = find_tool('cuobjdump', toolkit, [tools_dir])
    if found:
        return found
    import torch
    major = (torch.version.cuda or '13').split('.')[0]
    code, out = _run([sys.executable, '-m', 'pip', 'install', '-q', '--disable-pip-version-check',
                      '--no-deps', '--target', tools_dir, f'nvidia-cuda-cuobjdump=={major}.*'],
                     timeout=600)
    found = find_tool('cuobjdump', None, [tools_dir])
    if found is None:
        raise BuildPlanError(
            f'no GPU to run the CUDA ops on and no cuobjdump to list their device code '
            f'(pip install "nvidia-cuda-cuobjdump=={major}.*" failed: {out.strip()[-300:]}); '
            'check on a GPU machine')
    return found


def device_code(binary: str, tool: str) -> Tuple[List[str], int]:
    """``(archs, cubins)`` of a binary: its arch list (:func:`archs_in_binary`) and the
    number of machine-code images, read with the cuobjdump ``tool``."""
    code_elf, elf = _run([tool, '--list-elf', binary], timeout=300)
    code_ptx, ptx = _run([tool, '--list-ptx', binary], timeout=300)
    elf, ptx = (elf if code_elf == 0 else ''), (ptx if code_ptx == 0 else '')
    return archs_in_binary(elf, ptx), len(re.findall(r'\.cubin', elf))


def archs_in_binary(listing_elf: str, listing_ptx: str) -> List[str]:
    """The arch list a binary holds, from ``cuobjdump --list-elf`` / ``--list-ptx``:
    ``['9.0', '9.0+PTX']`` style entries (machine code ``sm_90``, PTX ``compute_90``)."""
    elf = {f'{m[:-1]}.{m[-1]}' for m in re.findall(r'\.sm_(\d+)[a-z]?\.cubin', listing_elf)}
    ptx = {f'{m[:-1]}.{m[-1]}+PTX' for m in re.findall(r'\.sm_(\d+)[a-z]?\.ptx', listing_ptx)}
    return sorted(elf | ptx)


def missing_archs(requested: str, present: Sequence[str]) -> List[str]:
    """Entries of a requested arch list without their device code in the binary: ``9.0``
    needs sm_90 machine code; ``9.0+PTX`` needs sm_90 machine code and compute_90 PTX."""
    missing = []
    for e in requested.split(';'):
        cc = _capability(e)
        if cc not in present or (e.endswith('+PTX') and f'{cc}+PTX' not in present):
            missing.append(e)
    return missing


def focal_loss_reference(logits, labels, gamma: float, alpha: float):
    """mmcv's ``sigmoid_focal_loss(logits, labels, gamma, alpha, None, 'mean')`` written out:
    ``labels == num_classes`` is background, and mmcv's 'mean' divides the sum over all
    elements by the number of rows (samples), not of elements."""
    import torch
    num_classes = logits.size(1)
    one_hot = torch.nn.functional.one_hot(labels, num_classes + 1)[:, :num_classes].float()
    p = logits.sigmoid()
    pt = (1 - p) * one_hot + p * (1 - one_hot)
    weight = (alpha * one_hot + (1 - alpha) * (1 - one_hot)) * pt.pow(gamma)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, one_hot, reduction='none')
    return (bce * weight).sum() / logits.size(0)


def verify_cuda_ops_on_gpu() -> List[str]:
    """Run mmcv's ``nms``, ``roi_align`` and ``sigmoid_focal_loss`` on CUDA against their CPU
    results (focal loss: mmdet's pure-PyTorch formula, as mmcv has no CPU kernel for it).
    Returns one line per op; raises ``AssertionError`` on a mismatch."""
    import torch
    from mmcv.ops import nms, roi_align, sigmoid_focal_loss
    g = torch.Generator().manual_seed(0)
    lines = []
    xy = torch.rand(200, 2, generator=g) * 200
    wh = torch.rand(200, 2, generator=g) * 60 + 4
    boxes, scores = torch.cat([xy, xy + wh], 1), torch.rand(200, generator=g)
    _, keep_cpu = nms(boxes, scores, 0.5)
    _, keep_gpu = nms(boxes.cuda(), scores.cuda(), 0.5)
    assert keep_gpu.cpu().tolist() == keep_cpu.tolist(), 'nms: CUDA keeps other boxes than CPU'
    lines.append(f'nms: {len(keep_cpu)} of 200 boxes kept, CUDA == CPU')
    feat = torch.randn(2, 16, 50, 60, generator=g)
    rois = torch.cat([torch.randint(0, 2, (64, 1), generator=g).float(),
                      boxes[:64] / 4], 1)
    ref = roi_align(feat, rois, (7, 7), 1.0, 2, 'avg', True)
    out = roi_align(feat.cuda(), rois.cuda(), (7, 7), 1.0, 2, 'avg', True).cpu()
    diff = (out - ref).abs().max().item()
    assert diff < 1e-4, f'roi_align: CUDA differs from CPU by {diff}'
    lines.append(f'roi_align: 64 RoIs, max |CUDA - CPU| {diff:.2e}')
    logits = torch.randn(300, 80, generator=g)
    labels = torch.randint(0, 81, (300, ), generator=g)  # 80 = background
    loss = sigmoid_focal_loss(logits.cuda(), labels.cuda(), 2.0, 0.25, None, 'mean').cpu()
    ref_loss = focal_loss_reference(logits, labels, 2.0, 0.25)
    diff = abs(loss.item() - ref_loss.item()) / ref_loss.item()
    assert diff < 1e-4, f'sigmoid_focal_loss: CUDA {loss.item()} vs formula {ref_loss.item()}'
    lines.append(f'sigmoid_focal_loss: CUDA {loss.item():.6f} vs formula {ref_loss.item():.6f}')
    return lines


def verify(kind: str, archs: str) -> List[str]:
    """Check the installed mmcv against the plan; returns report lines, raises
    :class:`BuildPlanError` when it does not hold what was asked."""
    import importlib.util
    import torch
    import mmcv.ops  # noqa: F401  (fails when the ops are missing)
    from mmcv.ops import get_compiling_cuda_version
    compiled_cuda = get_compiling_cuda_version()
    lines = [f'mmcv {MMCV_VERSION} ops import; compiled with CUDA: {compiled_cuda}']
    if kind != 'cuda':
        return lines
    if compiled_cuda in (None, 'not available'):
        raise BuildPlanError('mmcv was asked for with CUDA ops but was compiled without CUDA '
                             '(was a CPU-only wheel reused?)')
    if torch.cuda.is_available():
        return lines + verify_cuda_ops_on_gpu()
    ext = importlib.util.find_spec('mmcv._ext').origin
    tools_dir = os.environ.get('MMSLAB_CUDA_TOOLS') or osp.join(
        osp.expanduser('~'), '.cache', 'mmslab', 'wheels', 'cuda-tools')  # the installer's
    tool = cuobjdump(tools_dir, os.environ.get('MMSLAB_BUILD_CUDA_HOME'))
    present, n_elf = device_code(ext, tool)
    missing = missing_archs(archs, present)
    if missing:
        raise BuildPlanError(f'{ext} lacks device code for {", ".join(missing)} (it holds '
                             f'{", ".join(present) or "none"})')
    return lines + [f'{osp.basename(ext)}: {n_elf} cubins, device code for '
                    f'{", ".join(present)} (cuobjdump)']


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[0] if argv else ''
    try:
        if cmd == 'plan':
            plan = plan_build(gather_facts(), os.environ.get('MMSLAB_CUDA', 'auto') or 'auto',
                              os.environ.get('TORCH_CUDA_ARCH_LIST') or None)
            for note in plan.notes:
                print(f'[cuda_build] {note}', file=sys.stderr)
            print(shell_exports(plan))
        elif cmd == 'verify':
            kind = argv[1] if len(argv) > 1 else os.environ.get('MMSLAB_MMCV_KIND', 'cpu')
            archs = argv[2] if len(argv) > 2 else os.environ.get('MMSLAB_MMCV_ARCHS', '')
            for line in verify(kind, archs):
                print(f'[cuda_build] {line}')
        elif cmd == 'facts':
            print(dataclasses.asdict(gather_facts()))
        else:
            print('usage: cuda_build.py plan | verify [KIND ARCHS] | facts', file=sys.stderr)
            return 2
    except BuildPlanError as err:
        print(f'error: {err}', file=sys.stderr)
        return 3
    return 0


if __name__ == '__main__':
    sys.exit(main())
