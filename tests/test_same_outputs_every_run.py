"""The same input and weights give bit-identical outputs in two processes: no layer chooses
its computation by timing (a choice that flips between runs changes the rounding, which
deep random-weight networks amplify)."""
import hashlib
import subprocess
import sys

from conftest import REPO

SCRIPT = r'''
import hashlib, sys
import torch
sys.path.insert(0, {tests!r})
import mmslab
from conftest import randomize_bn_statistics
from presets import build_preset
torch.manual_seed(0)
digest = hashlib.sha256()
for name in ('SLABSwin', 'RePaSwin', 'BiNormSwin'):
    model = build_preset(name)
    model.init_weights()
    randomize_bn_statistics(model)
    model.eval()
    with torch.no_grad():
        for fused in (False, True):
            if fused:
                mmslab.reparameterize(model)
            # sizes the windows do not tile, each new to the process, some twice
            for hw in ((61, 83), (45, 70), (61, 83), (90, 37)):
                x = torch.randn(1, 3, *hw, generator=torch.Generator().manual_seed(hw[0]))
                for out in model(x):
                    digest.update(out.numpy().tobytes())
print(digest.hexdigest())
'''


def test_two_processes_give_bit_identical_outputs():
    script = SCRIPT.format(tests=f'{REPO}/tests')
    runs = [subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                           cwd=REPO, timeout=600) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    first, second = (run.stdout.strip().splitlines()[-1] for run in runs)
    assert len(first) == len(hashlib.sha256().hexdigest())
    assert first == second
