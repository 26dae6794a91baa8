"""Fixtures of the tiny trained and exported models, registered once for the whole session
(``pytest_plugins`` in conftest.py), so test_deploy.py and test_precision.py share one
training and one export per task instead of one per module.

A PRepBN Swin (embed_dims 16, depths 1-1-1-1, window 4) in Mask R-CNN (96 px COCO demo) and
in UperNet (64 px ADE20K demo), trained for 2 iterations with tools/train.py so the
checkpoints have a trained, fusable structure, then exported whole with
tools/export_onnx.py's defaults. Built lazily: a test asks for the task it needs.
"""
import json
import os.path as osp
import sys

import pytest

from conftest import TOOLS
from tool_runs import make_demo_sets, run_tool, tiny_prepbn_swin_config, write_config

#: One thread a tool process: the test processes share 2 cores.
ENV = dict(OMP_NUM_THREADS='1')


def export(config, out, *extra, checkpoint=None, cwd=None):
    """tools/export_onnx.py on ``config`` (``--random-weights`` without ``checkpoint``), 2
    evaluation images; returns (export.json, the tool's output)."""
    args = [sys.executable, osp.join(TOOLS, 'export_onnx.py'), config]
    args += [checkpoint] if checkpoint else ['--random-weights']
    args += ['--out', out, '--threads', '1', '--eval-images', '2', *extra]
    output = run_tool(args, cwd=cwd or osp.dirname(out), env=ENV)
    with open(osp.join(out, 'export.json')) as f:
        return json.load(f), output


@pytest.fixture(scope='session')
def deploy_demo_data(tmp_path_factory):
    """The demo sets of the deployed models (their own: no other test writes beside them)."""
    return make_demo_sets(tmp_path_factory.mktemp('deploy_demo_data'))


@pytest.fixture(scope='session')
def tiny_config(deploy_demo_data, tmp_path_factory):
    """{task: dict(root, config, cfg, work_dir)}: the configs, written lazily (no training)."""
    cache = {}

    def get(task):
        if task not in cache:
            root = tmp_path_factory.mktemp(f'deploy_{task}')
            work_dir = root / 'work_dir'
            cfg = tiny_prepbn_swin_config(task, deploy_demo_data[task], work_dir)
            if task == 'det':  # detections to compare, from a 2-iteration model
                cfg['model']['test_cfg']['rcnn']['score_thr'] = 0.0
            config = write_config(root / f'tiny_swin_{task}.py', cfg)
            cache[task] = dict(root=root, config=config, cfg=cfg, work_dir=work_dir)
        return cache[task]

    return get


@pytest.fixture(scope='session')
def tiny(tiny_config):
    """{task: dict(root, config, checkpoint)}, trained lazily with tools/train.py."""
    cache = {}

    def get(task):
        if task not in cache:
            run = tiny_config(task)
            run_tool([sys.executable, osp.join(TOOLS, 'train.py'), run['config']],
                     cwd=run['root'], env=ENV)
            ckpt = run['work_dir'] / 'iter_2.pth'
            assert ckpt.is_file()
            cache[task] = dict(root=run['root'], config=run['config'], checkpoint=str(ckpt),
                               cfg=run['cfg'])
        return cache[task]

    return get


@pytest.fixture(scope='session')
def exported(tiny):
    """The trained tiny models exported whole with the defaults (dynamic H, W), fp32 + INT8
    calibrated on 2 training images, both runtimes."""
    cache = {}

    def get(task):
        if task not in cache:
            run = tiny(task)
            out = str(run['root'] / 'export')
            report, output = export(run['config'], out, '--int8', '--calib-images', '2',
                                    checkpoint=run['checkpoint'], cwd=run['root'])
            cache[task] = dict(run, export_dir=out, report=report, output=output)
        return cache[task]

    return get
