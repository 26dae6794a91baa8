"""The mmcv build decision (``mmslab/utils/cuda_build.py``): CPU or CUDA ops, for which torch,
CUDA and GPUs; the refusals that name a fix; the cache key; the device-code check.

The decisions are tested as a pure function of what the machine reports and, end to end, with
fake ``nvidia-smi`` / ``nvcc`` programs on PATH. No GPU is needed.
"""
import os
import os.path as osp
import stat
import subprocess
import sys

import pytest

from mmslab.utils import cuda_build
from mmslab.utils.cuda_build import BuildFacts, BuildPlanError, plan_build

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
SCRIPT = osp.join(REPO, 'mmslab', 'utils', 'cuda_build.py')

# nvidia-smi's banner, as printed by a 580 driver (abridged)
SMI_BANNER = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      CUDA Version: {cuda}     |
+-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
|   0  NVIDIA H100 80GB HBM3          On  |   00000000:19:00.0 Off |                    0 |
+-----------------------------------------+------------------------+----------------------+
"""


def toolkit(tmp_path, complete=True):
    """A directory shaped like a CUDA toolkit (headers present or not)."""
    root = tmp_path / ('cuda-13.0' if complete else 'cuda-13.0-partial')
    (root / 'include' / 'crt').mkdir(parents=True, exist_ok=True)
    (root / 'bin').mkdir(exist_ok=True)
    if complete:
        (root / 'include' / 'cuda_runtime.h').write_text('')
        (root / 'include' / 'crt' / 'host_defines.h').write_text('')
    return str(root)


def facts(tmp_path, **kw):
    base = dict(python='3.11', torch_version='2.14.1+cu130', torch_cuda='13.0',
                torch_sees_gpu=True, gpus=[('NVIDIA H100 80GB HBM3', '9.0')],
                driver='580.95.05', driver_cuda='13.0',
                nvccs=[('/opt/cuda/bin/nvcc', '13.0', toolkit(tmp_path))],
                nvcc_archs=['7.5', '8.0', '8.6', '8.9', '9.0', '10.0', '12.0'],
                wheel_include_dirs=['/venv/site-packages/nvidia/cu13/include',
                                    '/venv/site-packages/nvidia/cudnn/include'])
    base.update(kw)
    return BuildFacts(**base)


def refusal(f, mode='auto', archs=None) -> str:
    with pytest.raises(BuildPlanError) as err:
        plan_build(f, mode, archs)
    return str(err.value)


# -- decisions ---------------------------------------------------------------------------------
def test_no_gpu_builds_cpu_ops_with_a_cpu_key(tmp_path):
    plan = plan_build(facts(tmp_path, gpus=[], driver=None, driver_cuda=None,
                            torch_sees_gpu=False))
    assert plan.kind == 'cpu' and plan.env == {} and plan.archs is None
    assert plan.key == 'py3.11-torch2.14.1+cu130-cpu'
    assert any('MMSLAB_CUDA=1' in n for n in plan.notes)


def test_gpu_present_builds_cuda_ops_for_that_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv('NVCC_APPEND_FLAGS', '-lineinfo')
    monkeypatch.delenv('CPATH', raising=False)
    f = facts(tmp_path)
    plan = plan_build(f)
    assert plan.kind == 'cuda' and plan.archs == '9.0'
    assert plan.key == 'py3.11-torch2.14.1+cu130-cuda13.0-sm90'
    env = plan.env
    assert env['FORCE_CUDA'] == '1' and env['TORCH_CUDA_ARCH_LIST'] == '9.0'
    # CUDA_HOME is the toolkit nvcc belongs to (not a wrapper's prefix), first on PATH
    assert env['CUDA_HOME'] == f.nvccs[0][2]
    assert env['PATH'].split(os.pathsep)[0] == osp.join(f.nvccs[0][2], 'bin')
    # torch's wheels' headers are appended after what the user already passes
    assert env['NVCC_APPEND_FLAGS'] == ('-lineinfo -I/venv/site-packages/nvidia/cu13/include '
                                        '-I/venv/site-packages/nvidia/cudnn/include')
    assert env['CPATH'].split(os.pathsep) == f.wheel_include_dirs


def test_mixed_gpus_give_a_sorted_arch_list(tmp_path):
    plan = plan_build(facts(tmp_path, gpus=[('NVIDIA H100', '9.0'), ('NVIDIA A10', '8.6'),
                                            ('NVIDIA H100', '9.0')]))
    assert plan.archs == '8.6;9.0' and plan.key.endswith('-sm86-sm90')


def test_forced_cuda_without_gpu_uses_the_default_or_the_users_arch_list(tmp_path):
    f = facts(tmp_path, gpus=[], driver=None, driver_cuda=None, torch_sees_gpu=False)
    plan = plan_build(f, '1')
    assert plan.kind == 'cuda' and plan.archs == cuda_build.DEFAULT_ARCHS
    assert plan.key.endswith('-sm80-sm90+ptx')
    plan = plan_build(f, '1', '9.0 8.0+PTX')
    assert plan.archs == '8.0+PTX;9.0' and plan.key.endswith('-sm80+ptx-sm90')
    # without a GPU nothing about the driver is checked
    assert plan.env['FORCE_CUDA'] == '1'


def test_switch_off_builds_cpu_ops_on_a_gpu_machine_with_a_warning(tmp_path):
    plan = plan_build(facts(tmp_path), '0')
    assert plan.kind == 'cpu'
    assert any('RoIAlign' in n for n in plan.notes)


def test_unknown_switch_value_names_the_valid_ones(tmp_path):
    msg = refusal(facts(tmp_path), 'yes')
    assert "MMSLAB_CUDA='yes'" in msg and "('auto', '0', '1')" in msg


def test_cpu_torch_on_a_gpu_machine_is_refused(tmp_path):
    msg = refusal(facts(tmp_path, torch_version='2.14.1+cpu', torch_cuda=None,
                        torch_sees_gpu=False))
    assert 'CPU-only build' in msg and 'MMSLAB_CUDA=0' in msg


def test_driver_older_than_torchs_cuda_is_refused_with_both_ways_out(tmp_path):
    msg = refusal(facts(tmp_path, driver='550.54.15', driver_cuda='12.4',
                        torch_sees_gpu=False))
    assert 'supports CUDA up to 12.4' in msg and 'built for CUDA 13.0' in msg
    assert 'Upgrade the driver' in msg and 'CUDA 12.x' in msg and '/whl/cu12' in msg


def test_driver_of_the_same_major_but_older_minor_is_a_note(tmp_path):
    plan = plan_build(facts(tmp_path, torch_cuda='13.1', torch_version='2.15.0+cu131'))
    assert plan.kind == 'cuda' and any('minor-version' in n for n in plan.notes)


def test_gpu_invisible_to_torch_is_refused(tmp_path):
    msg = refusal(facts(tmp_path, torch_sees_gpu=False))
    assert 'torch.cuda.is_available() is False' in msg and 'CUDA_VISIBLE_DEVICES' in msg


def test_missing_nvcc_names_the_three_places_to_get_one(tmp_path):
    msg = refusal(facts(tmp_path, nvccs=[]))
    assert 'no nvcc found' in msg and 'CUDA_HOME' in msg
    assert 'nvidia-cuda-nvcc==13.*' in msg and 'nvidia-cuda-cccl==13.*' in msg


def test_nvcc_of_another_major_is_refused(tmp_path):
    msg = refusal(facts(tmp_path, nvccs=[('/usr/local/cuda-12.4/bin/nvcc', '12.4',
                                          toolkit(tmp_path))]))
    assert '/usr/local/cuda-12.4/bin/nvcc (12.4)' in msg and 'different CUDA major' in msg
    assert 'nvidia-cuda-nvcc==13.*' in msg and 'CUDA 12.x' in msg


def test_the_first_nvcc_of_torchs_major_is_chosen(tmp_path):
    root = toolkit(tmp_path)
    plan = plan_build(facts(tmp_path, nvccs=[('/old/bin/nvcc', '12.4', '/old'),
                                             ('/new/bin/nvcc', '13.0', root)]))
    assert plan.env['CUDA_HOME'] == root


def test_toolkit_without_runtime_headers_is_refused(tmp_path):
    root = toolkit(tmp_path, complete=False)
    msg = refusal(facts(tmp_path, nvccs=[('/x/bin/nvcc', '13.0', root)]))
    assert 'without the CUDA runtime headers' in msg and 'crt' in msg


@pytest.mark.parametrize('archs, expect', [('90', 'not a compute capability'),
                                           ('9.0;sm_86', 'not a compute capability'),
                                           (' ; ', 'empty')])
def test_malformed_arch_list_is_refused(tmp_path, archs, expect):
    assert expect in refusal(facts(tmp_path), 'auto', archs)


def test_arch_nvcc_cannot_target_is_refused(tmp_path):
    msg = refusal(facts(tmp_path), 'auto', '6.1;9.0')
    assert 'cannot compile for 6.1' in msg and '7.5' in msg


def test_cache_keys_separate_every_build_that_differs(tmp_path):
    f = facts(tmp_path)
    keys = {
        cuda_build.cache_key(f, 'cpu'),
        cuda_build.cache_key(f, 'cuda', '9.0'),
        cuda_build.cache_key(f, 'cuda', '8.0;9.0'),
        cuda_build.cache_key(f, 'cuda', '9.0+PTX'),
        cuda_build.cache_key(facts(tmp_path, torch_version='2.11.0+cu130'), 'cuda', '9.0'),
        cuda_build.cache_key(facts(tmp_path, python='3.12'), 'cuda', '9.0'),
        cuda_build.cache_key(facts(tmp_path, torch_cuda='12.6',
                                   torch_version='2.14.1+cu126'), 'cuda', '9.0'),
    }
    assert len(keys) == 7
    assert all('/' not in k and ';' not in k and ' ' not in k for k in keys)


# -- parsers -----------------------------------------------------------------------------------
def test_parsers_read_real_tool_output():
    assert cuda_build.parse_nvcc_version(
        'Cuda compilation tools, release 13.0, V13.0.88\n') == '13.0'
    assert cuda_build.parse_nvcc_version('command not found') is None
    driver, cuda, gpus = cuda_build.parse_nvidia_smi(
        SMI_BANNER.format(cuda='13.0'),
        'NVIDIA H100 80GB HBM3, 9.0\nNVIDIA RTX A6000, 8.6\n')
    assert (driver, cuda) == ('580.95.05', '13.0')
    assert gpus == [('NVIDIA H100 80GB HBM3', '9.0'), ('NVIDIA RTX A6000', '8.6')]


def test_device_code_listing_is_checked_against_the_arch_list():
    elf = ('ELF file    1: _ext.1.sm_80.cubin\nELF file    2: _ext.2.sm_90.cubin\n'
           'ELF file    3: _ext.3.sm_90.cubin\n')
    ptx = 'PTX file    1: _ext.1.sm_90.ptx\n'
    present = cuda_build.archs_in_binary(elf, ptx)
    assert present == ['8.0', '9.0', '9.0+PTX']
    assert cuda_build.missing_archs('8.0;9.0+PTX', present) == []
    assert cuda_build.missing_archs('8.6;9.0', present) == ['8.6']
    assert cuda_build.missing_archs('8.0+PTX', present) == ['8.0+PTX']
    assert cuda_build.missing_archs('9.0', cuda_build.archs_in_binary('', '')) == ['9.0']


# -- end to end: the script with fake nvidia-smi / nvcc on PATH ----------------------------------
def fake_program(path, body):
    path.write_text('#!/bin/sh\n' + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def parse_exports(text: str) -> dict:
    """``export NAME=value`` lines (values shell-quoted) as a dict, as bash's eval reads them."""
    import shlex
    out = {}
    for line in text.splitlines():
        name, value = line[len('export '):].split('=', 1)
        out[name] = ' '.join(shlex.split(value))
    return out


def run_plan(bin_dir=None, **env):
    """``cuda_build.py plan`` in a subprocess, ``bin_dir`` (fake programs) first on PATH and
    the user's TORCH_CUDA_ARCH_LIST replaced by ``env``'s."""
    full = dict(os.environ)
    if bin_dir is not None:
        full['PATH'] = f'{bin_dir}{os.pathsep}{full["PATH"]}'
    full.pop('TORCH_CUDA_ARCH_LIST', None)
    full.update(env)
    return subprocess.run([sys.executable, '-P', SCRIPT, 'plan'], env=full, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)


def fake_smi(bin_dir, cuda):
    banner = SMI_BANNER.format(cuda=cuda).replace('\n', '\\n')
    fake_program(bin_dir / 'nvidia-smi',
                 'case "$1" in --query-gpu*) echo "NVIDIA H100 80GB HBM3, 9.0";;\n'
                 f'*) printf "{banner}";; esac\n')


def test_script_refuses_an_old_driver_before_compiling(tmp_path):
    import torch
    if torch.version.cuda is None:
        pytest.skip('this torch is a CPU build (the driver check needs a CUDA torch)')
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    fake_smi(bin_dir, '12.2')
    proc = run_plan(bin_dir)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert 'supports CUDA up to 12.2' in proc.stderr and 'Upgrade the driver' in proc.stderr
    assert proc.stdout == ''  # nothing for install_deps.sh to eval


def test_script_reports_a_failing_nvidia_smi_and_builds_cpu_ops(tmp_path):
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    fake_program(bin_dir / 'nvidia-smi', 'echo "NVIDIA-SMI has failed because it couldn\'t '
                 'communicate with the NVIDIA driver."; exit 9\n')
    proc = run_plan(bin_dir)
    assert proc.returncode == 0, proc.stderr
    assert 'export MMSLAB_MMCV_KIND=cpu' in proc.stdout
    assert "couldn't communicate with the NVIDIA driver" in proc.stderr


def test_script_plans_a_forced_cuda_build_with_this_machines_nvcc(tmp_path):
    import torch
    facts_now = cuda_build.gather_facts()
    major = (torch.version.cuda or '').split('.')[0]
    if not major or not any(v and v.split('.')[0] == major for _, v, _ in facts_now.nvccs):
        pytest.skip('no nvcc of torch\'s CUDA major on this machine')
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    proc = run_plan(bin_dir, MMSLAB_CUDA='1', TORCH_CUDA_ARCH_LIST='9.0')
    assert proc.returncode == 0, proc.stderr
    exports = parse_exports(proc.stdout)
    assert exports['MMSLAB_MMCV_KIND'] == 'cuda'
    assert exports['MMSLAB_MMCV_KEY'].endswith(f'-cuda{torch.version.cuda}-sm90')
    home = exports['MMSLAB_BUILD_CUDA_HOME']
    assert osp.isfile(osp.join(home, 'include', 'crt', 'host_defines.h'))
    assert 'nvidia' in exports['MMSLAB_BUILD_CPATH']


def test_cuda_home_nvcc_is_found_first_and_its_version_decides(tmp_path):
    """``$CUDA_HOME/bin/nvcc`` comes before PATH; a CUDA 12.4 one there is read and refused
    for a CUDA 13 torch."""
    bin_dir = tmp_path / 'cuda-12.4' / 'bin'
    bin_dir.mkdir(parents=True)
    fake_program(bin_dir / 'nvcc', 'echo "Cuda compilation tools, release 12.4, V12.4.131"\n')
    found = cuda_build.nvcc_candidates(dict(CUDA_HOME=str(tmp_path / 'cuda-12.4'),
                                            PATH=str(bin_dir)), site_dirs=[])
    assert found[0] == str(bin_dir / 'nvcc')
    version = cuda_build.parse_nvcc_version(subprocess.run(
        [found[0], '--version'], stdout=subprocess.PIPE, text=True).stdout)
    f = BuildFacts(python='3.11', torch_version='2.14.1+cu130', torch_cuda='13.0',
                   nvccs=[(found[0], version, str(tmp_path / 'cuda-12.4'))])
    assert 'different CUDA major' in refusal(f, '1')


# -- the recipe itself, compiling CUDA code with the plan's environment --------------------------
def plan_exports(**env) -> dict:
    proc = run_plan(**env)
    if proc.returncode == 3 and 'no nvcc found' in proc.stderr:
        pytest.skip('no CUDA compiler on this machine: ' + proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr
    return parse_exports(proc.stdout)


@pytest.mark.slow
def test_cuda_recipe_compiles_cuda_code_with_the_plans_environment(tmp_path):
    """mmcv's own setup.py with the plan's FORCE_CUDA / CUDA_HOME / include directories,
    over two sources: the host-compiled ``info.cpp`` (it includes the CUDA runtime headers;
    it failed with the toolkit prefix torch detects) and ``nms_cuda.cu``. The extension must
    hold sm_90 machine code for the 9.0 asked for, and no code for an arch not asked for."""
    exports = plan_exports(MMSLAB_CUDA='1', TORCH_CUDA_ARCH_LIST='9.0')
    assert exports['MMSLAB_MMCV_KIND'] == 'cuda'
    env = dict(os.environ, MAX_JOBS='2')
    for var in exports['MMSLAB_BUILD_VARS'].split():
        env[var] = exports[f'MMSLAB_BUILD_{var}']
    proc = subprocess.run(['bash', osp.join(REPO, 'tools', 'mmcv_recipe.sh'), 'probe',
                           sys.executable, str(tmp_path)], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert 'FORCE_CUDA=1' in proc.stdout and 'TORCH_CUDA_ARCH_LIST=9.0' in proc.stdout
    import zipfile
    wheel = next(iter((tmp_path / 'dist').glob('mmcv-2.1.0-*.whl')))
    with zipfile.ZipFile(wheel) as z:
        ext = next(n for n in z.namelist() if n.startswith('mmcv/_ext') and n.endswith('.so'))
        z.extract(ext, tmp_path / 'whl')
    tool = cuda_build.cuobjdump(str(tmp_path / 'cuda-tools'), '/usr/local/cuda')
    present, cubins = cuda_build.device_code(str(tmp_path / 'whl' / ext), tool)
    assert cubins >= 1
    assert cuda_build.missing_archs('9.0', present) == [], present
    assert cuda_build.missing_archs('8.0', present) == ['8.0'], present


def test_focal_loss_reference_matches_mmdet():
    """The formula the GPU check compares mmcv's CUDA focal loss with is mmdet's pure-PyTorch
    focal loss, in mmcv's 'mean' (sum over elements / rows; measured on an H100: CUDA
    20.674881 vs this formula 20.674877)."""
    import torch
    from mmdet.models.losses.focal_loss import py_sigmoid_focal_loss
    from mmslab.utils.cuda_build import focal_loss_reference
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 80, generator=g)
    labels = torch.randint(0, 81, (300, ), generator=g)
    one_hot = torch.nn.functional.one_hot(labels, 81)[:, :80].float()
    ref = py_sigmoid_focal_loss(logits, one_hot, gamma=2.0, alpha=0.25, reduction='sum') / 300
    assert torch.allclose(focal_loss_reference(logits, labels, 2.0, 0.25), ref, rtol=1e-6)
