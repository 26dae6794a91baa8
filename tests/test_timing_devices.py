"""Where and how a latency is timed: the device choice, CUDA-event timing, the GPU record of
the machine and the autocast precisions a device computes.

No GPU is needed: the CUDA branches run against monkeypatched ``torch.cuda`` functions that
record what would be called on a GPU.
"""
import subprocess
from types import SimpleNamespace

import pytest
import torch

from mmslab.utils import machine, timing
from mmslab.utils.precision import check_autocast_precision

NO_BF16_FLAGS = ['fpu', 'avx2', 'fma', 'avx512f']


class FakeCudaEvents:
    """Stands in for ``torch.cuda.Event`` / ``synchronize`` / ``device``; ``log`` is the order
    of what happened."""

    def __init__(self, monkeypatch, elapsed_ms=12.5):
        self.log = []
        fake = self

        class Event:
            count = 0

            def __init__(self, enable_timing=False):
                assert enable_timing, 'a timing event needs enable_timing=True'
                self.name = ('start', 'end')[Event.count % 2]
                Event.count += 1

            def record(self, stream=None):
                fake.log.append(f'{self.name}.record')

            def elapsed_time(self, other):
                fake.log.append('elapsed_time')
                return elapsed_ms

        class DeviceContext:
            def __init__(self, device):
                fake.log.append(f'device {device}')

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        monkeypatch.setattr(torch.cuda, 'Event', Event)
        monkeypatch.setattr(torch.cuda, 'device', DeviceContext)
        monkeypatch.setattr(torch.cuda, 'synchronize',
                            lambda device=None: fake.log.append(f'synchronize {device}'))


def fake_gpu(monkeypatch, capability=(9, 0), count=1):
    """One NVIDIA H100 as ``torch.cuda`` would describe it, driver 570.124.06 from a faked
    ``nvidia-smi``. Returns the commands that were run."""
    props = SimpleNamespace(total_memory=int(79.1 * 2**30), multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: count)
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 0)
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda index=None: 'NVIDIA H100 80GB HBM3')
    monkeypatch.setattr(torch.cuda, 'get_device_properties', lambda index: props)
    monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda index=None: capability)
    monkeypatch.setattr(torch.version, 'cuda', '12.8')
    monkeypatch.setattr(torch.backends.cudnn, 'version', lambda: 91002)
    commands = []
    real_run = subprocess.run

    def run(cmd, *args, **kwargs):
        if cmd[0] != 'nvidia-smi':
            return real_run(cmd, *args, **kwargs)  # e.g. platform's uname
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout='570.124.06\n570.124.06\n', stderr='')

    monkeypatch.setattr(subprocess, 'run', run)
    return commands


# ----------------------------------------------------------------------------------------------
# the device
# ----------------------------------------------------------------------------------------------

def test_resolve_device_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    assert timing.resolve_device() == torch.device('cpu')  # the default where CUDA is absent
    assert timing.resolve_device('cpu') == torch.device('cpu')
    for name in ('cuda', 'cuda:0'):
        with pytest.raises(RuntimeError, match='CUDA is not available') as err:
            timing.resolve_device(name)
        assert 'valid on this machine: cpu' in str(err.value)
    with pytest.raises(ValueError, match='valid: cpu, cuda, cuda:N'):
        timing.resolve_device('meta')
    with pytest.raises(ValueError, match='valid: cpu, cuda, cuda:N'):
        timing.resolve_device('gpu')  # not a torch device at all


def test_resolve_device_with_cuda(monkeypatch):
    fake_gpu(monkeypatch, count=2)
    assert timing.resolve_device() == torch.device('cuda', 0)
    assert timing.resolve_device('cuda') == torch.device('cuda', 0)
    assert timing.resolve_device('cuda:1') == torch.device('cuda', 1)
    assert timing.resolve_device('cpu') == torch.device('cpu')
    with pytest.raises(RuntimeError, match=r'2 CUDA device\(s\); valid: cuda:0 ... cuda:1'):
        timing.resolve_device('cuda:2')


def test_module_device():
    assert timing.module_device(torch.nn.Linear(2, 2)) == torch.device('cpu')
    assert timing.module_device(torch.nn.ReLU()) == torch.device('cpu')  # no tensors
    meta = torch.nn.Linear(2, 2, device='meta')
    assert timing.module_device(meta) == torch.device('meta')


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------

def test_timed_ms_on_cuda_records_events_around_the_call(monkeypatch):
    fake = FakeCudaEvents(monkeypatch, elapsed_ms=12.5)
    out, ms = timing.timed_ms(lambda: fake.log.append('call') or 'result', 'cuda:0')
    assert (out, ms) == ('result', 12.5)  # the events' elapsed time, not the host clock
    cuda0 = torch.device('cuda', 0)
    assert fake.log == [f'device {cuda0}', f'synchronize {cuda0}', 'start.record', 'call',
                        'end.record', f'synchronize {cuda0}', 'elapsed_time']
    assert timing.timing_method('cuda') == 'cuda_events'


def test_timed_ms_on_cpu_uses_the_host_clock(monkeypatch):
    fake = FakeCudaEvents(monkeypatch)
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)  # a GPU machine
    monkeypatch.setattr(timing.time, 'perf_counter', iter([1.0, 1.25]).__next__)
    out, ms = timing.timed_ms(lambda: 'x', 'cpu')
    assert (out, ms) == ('x', 250.0)
    assert fake.log == []  # a CPU model: no CUDA call at all
    # no device given: the host clock, every CUDA device synchronized around the call
    monkeypatch.setattr(timing.time, 'perf_counter', iter([2.0, 2.5]).__next__)
    assert timing.timed_ms(lambda: None)[1] == 500.0
    assert fake.log == ['synchronize None', 'synchronize None']
    assert timing.timing_method('cpu') == timing.timing_method(None) == 'perf_counter'


# ----------------------------------------------------------------------------------------------
# the machine record
# ----------------------------------------------------------------------------------------------

def test_machine_info_records_the_gpu_of_a_cuda_timing(monkeypatch):
    commands = fake_gpu(monkeypatch)
    info = machine.machine_info(device='cuda')
    assert info['gpu'] == dict(name='NVIDIA H100 80GB HBM3', index=0, compute_capability='9.0',
                               memory_gib=79.1, multiprocessors=132, driver='570.124.06',
                               cuda='12.8', cudnn=91002, device_count=1)
    assert commands == [['nvidia-smi', '--query-gpu=driver_version', '--format=csv,noheader']]
    assert info['cpu'] and info['blas']  # the host is still recorded
    line = machine.machine_line(info)
    assert line.startswith('NVIDIA H100 80GB HBM3 (sm 9.0, 79.1 GiB; CUDA 12.8, cuDNN 91002, '
                           'driver 570.124.06); host '), line
    assert info['cpu'] in line
    # a CPU timing on the same machine: no gpu entry, the line names the CPU only
    for device in (None, 'cpu', torch.device('cpu')):
        assert 'gpu' not in machine.machine_info(device)
    assert machine.machine_line(machine.machine_info('cpu')).startswith(info['cpu'])


def test_driver_version_without_nvidia_smi(monkeypatch):
    fake_gpu(monkeypatch)

    real_run = subprocess.run

    def missing(cmd, *args, **kwargs):
        if cmd[0] != 'nvidia-smi':
            return real_run(cmd, *args, **kwargs)
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(subprocess, 'run', missing)
    assert machine.nvidia_driver_version() is None
    info = machine.machine_info(torch.device('cuda', 0))
    assert info['gpu']['driver'] is None
    assert 'driver unknown' in machine.machine_line(info)
    with pytest.raises(ValueError, match='not a CUDA device'):
        machine.gpu_info('cpu')


# ----------------------------------------------------------------------------------------------
# what each device computes
# ----------------------------------------------------------------------------------------------

def test_autocast_precisions_each_device_computes(monkeypatch):
    check_autocast_precision('fp32', 'cpu')
    with pytest.raises(ValueError, match='fp16 on the CPU') as err:
        check_autocast_precision('fp16', 'cpu', 'tools/benchmark.py')
    assert 'Valid on cpu: fp32, bf16' in str(err.value) and '--device cuda' in str(err.value)
    with pytest.raises(ValueError, match='valid: fp32, fp16, bf16'):
        check_autocast_precision('int8', 'cpu')
    monkeypatch.setattr(machine, 'cpu_flags', lambda: list(NO_BF16_FLAGS))
    with pytest.raises(RuntimeError, match='tools/benchmark.py bf16: bf16 needs a CPU with '
                       'avx512_bf16 or amx_bf16'):
        check_autocast_precision('bf16', 'cpu', 'tools/benchmark.py')
    monkeypatch.setattr(machine, 'cpu_flags', lambda: NO_BF16_FLAGS + ['amx_bf16'])
    check_autocast_precision('bf16', 'cpu')
    # a GPU: fp16 always, bf16 from compute capability 8.0 (a V100 would emulate it)
    fake_gpu(monkeypatch, capability=(7, 0))
    check_autocast_precision('fp16', 'cuda:0')
    with pytest.raises(RuntimeError, match=r'compute capability 7.0\) has no bf16') as err:
        check_autocast_precision('bf16', 'cuda:0')
    assert 'Valid: fp32, fp16' in str(err.value)
    fake_gpu(monkeypatch, capability=(8, 0))
    check_autocast_precision('bf16', 'cuda:0')
