"""Multi-process training of progressive-norm models through ``tools/dist_train.sh``.

Two CPU processes over gloo, a tiny PRepBN Swin in Mask R-CNN and in an FCN segmentor. The
backbone's norms decay LN -> RepBN over 2 iterations (g = 1, 0.5, 0 in iterations 1-3), so
the three training iterations cross every point of the schedule where a branch is idle; the
output norms run a longer schedule (6 iterations) that is still under way when the run ends,
so the resumed run must continue it. DDP runs with mmengine's default
``find_unused_parameters=False``: a parameter without a gradient aborts the second iteration.

One run (and its resume) per task, shared by the tests through the module-scoped
``dist_run`` fixture; the whole module is ``slow`` (minutes of 2-process training).
"""
import json
import os.path as osp
import re
import sys

import pytest

from tool_runs import (TOOLS, demo_data, free_port, run_tool,  # noqa: F401
                       tiny_prepbn_swin_config, write_config)

pytestmark = pytest.mark.slow

BODY_STEP, OUT_STEP = 2, 6


def progressive_config(task: str, data_root, work_dir, max_iters: int) -> dict:
    cfg = tiny_prepbn_swin_config(task, data_root, work_dir, BODY_STEP, OUT_STEP)
    cfg['train_cfg'] = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=3)
    cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', by_epoch=False,
                                              interval=3)
    cfg['param_scheduler'] = []
    if cfg['train_dataloader']['sampler']['type'] == 'DefaultSampler':
        cfg['train_dataloader']['sampler'] = dict(type='InfiniteSampler', shuffle=True)
    return cfg


def logged_ratios(output: str):
    """{iteration: (min g, max g)} from the training log lines of rank 0."""
    found = {}
    for m in re.finditer(r'Iter\(train\) \[\s*(\d+)/\d+\].*?prepbn_ratio_min: ([\d.]+)\s+'
                         r'prepbn_ratio_max: ([\d.]+)', output):
        found[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    return found


@pytest.fixture(scope='module', params=['det', 'seg'])
def dist_run(request, demo_data, tmp_path_factory):  # noqa: F811
    """One 2-process training of 3 iterations per task, then its 2-process resume to 5; the
    tests below check their logs and files (the fused validation's latency.json as the first
    run left it: the resumed run's validation overwrites it)."""
    task = request.param
    root = tmp_path_factory.mktemp(f'dist_{task}')
    work_dir = root / 'work_dir'
    config = write_config(root / f'prepbn_{task}.py',
                          progressive_config(task, demo_data[task], work_dir, max_iters=3))
    env = dict(PORT=str(free_port()), PYTHON=sys.executable, OMP_NUM_THREADS='1')
    output = run_tool(['bash', osp.join(TOOLS, 'dist_train.sh'), config, 2], cwd=root,
                      env=env, timeout=600)
    latency = json.loads((work_dir / 'latency.json').read_text())
    resumed = run_tool(['bash', osp.join(TOOLS, 'dist_train.sh'), config, 2, '--resume',
                        '--cfg-options', 'train_cfg.max_iters=5'], cwd=root,
                       env=dict(env, PORT=str(free_port())), timeout=600)
    return dict(task=task, work_dir=work_dir, output=output, latency=latency,
                resumed=resumed)


def test_two_processes_over_gloo(dist_run):
    """``tools/dist_train.sh CONFIG 2``: two ranks over gloo (the config asks for nccl, the
    tools switch on a machine without CUDA), 3 iterations, a checkpoint of the unwrapped
    model."""
    from mmslab.utils.checkpoint import load_checkpoint_file
    output = dist_run['output']
    assert 'Iter(train) [3/3]' in output, output[-3000:]
    # mmengine logs the world size ("GPU number") and the dist config
    assert re.search(r'Distributed training: True', output), output[-3000:]
    assert re.search(r'GPU number: 2\b', output), output[-3000:]
    assert "'backend': 'gloo'" in output
    saved = load_checkpoint_file(str(dist_run['work_dir'] / 'iter_3.pth'))['state_dict']
    # saved from the unwrapped model, not DistributedDataParallel's "module." names
    assert not any(k.startswith('module.') for k in saved)


def test_training_crosses_the_schedule(dist_run):
    from mmslab.utils.checkpoint import load_checkpoint_file
    # g of the body norms crosses 1 -> 0.5 -> 0; the output norms are at 1, 5/6, 4/6
    ratios = logged_ratios(dist_run['output'])
    assert ratios.get(1) == pytest.approx((1.0, 1.0), abs=1e-4), ratios
    assert ratios.get(2) == pytest.approx((0.5, 1 - 1 / OUT_STEP), abs=1e-4), ratios
    assert ratios.get(3) == pytest.approx((0.0, 1 - 2 / OUT_STEP), abs=1e-4), ratios

    saved = load_checkpoint_file(str(dist_run['work_dir'] / 'iter_3.pth'))['state_dict']
    # a training checkpoint holds the unfused structure: LN and BN branches of every PRepBN
    assert any(k.endswith('norm1.weight') for k in saved)
    assert any(k.endswith('norm2.bn.running_var') for k in saved)
    iters = {int(v) for k, v in saved.items() if k.endswith('cur_iter')}
    assert iters == {2}, iters  # the iteration the last step ran at


def test_fused_validation_on_both_ranks(dist_run):
    """Validation of the fused copy on both ranks, latency gathered from both."""
    latency = dist_run['latency']
    assert latency['reparameterized'] is True
    assert latency['world_size'] == 2
    assert latency['images_per_rank'] == [2, 2]
    assert latency['images'] == 4 == latency['fused']['count']
    assert latency['max_relative_difference'] is not None
    assert latency['max_relative_difference'] < 1e-3
    metric = 'coco/bbox_mAP' if dist_run['task'] == 'det' else 'mIoU'
    assert re.search(r'Iter\(val\).*' + re.escape(metric), dist_run['output']), \
        dist_run['output'][-3000:]


def test_resume_continues_the_schedule(dist_run):
    from mmslab.utils.checkpoint import load_checkpoint_file
    resumed = dist_run['resumed']
    assert re.search(r'resumed epoch: \d+, iter: 3\b', resumed), resumed[-3000:]
    assert 'Iter(train) [1/5]' not in resumed
    ratios = logged_ratios(resumed)
    assert ratios.get(4) == pytest.approx((0.0, 1 - 3 / OUT_STEP), abs=1e-4), ratios
    assert ratios.get(5) == pytest.approx((0.0, 1 - 4 / OUT_STEP), abs=1e-4), ratios
    final = load_checkpoint_file(str(dist_run['work_dir'] / 'iter_5.pth'))['state_dict']
    assert {int(v) for k, v in final.items() if k.endswith('cur_iter')} == {4}
