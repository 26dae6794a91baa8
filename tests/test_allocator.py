"""``--malloc keep``: freed tensor memory stays in the process (checked by RSS, in a fresh
process each, since the setting is process-wide)."""
import subprocess
import sys

import pytest

from mmslab.utils import allocator
from mmslab.utils.allocator import allocator_info, set_allocator_mode

PROBE = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location('allocator', sys.argv[2])
allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)  # the module alone: the mmslab package is slow to import
def rss_mb():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * 4096 / 2**20
info = allocator.set_allocator_mode(sys.argv[1])
x = torch.ones(24 << 18)  # 24 MiB: above glibc's default mmap threshold
before = rss_mb()
del x
print(info['mode'], round(before - rss_mb()))
"""


def released_mb(mode):
    out = subprocess.run([sys.executable, '-c', PROBE, mode, allocator.__file__],
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], int(out[1])


def test_keep_mode_keeps_freed_tensor_memory():
    if not allocator_info()['allocator'].startswith('glibc'):
        pytest.skip('mallopt is glibc only')
    # default: glibc unmaps the block, so RSS drops by about its size (other allocations of
    # the interpreter may move a few MiB either way); keep: nearly nothing is returned.
    mode, released = released_mb('default')
    assert mode == 'default' and 20 <= released <= 28, released
    mode, released = released_mb('keep')
    assert mode == 'keep' and released <= 4, released


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match='valid: keep, default'):
        set_allocator_mode('jemalloc')
