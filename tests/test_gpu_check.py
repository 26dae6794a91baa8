"""The GPU acceptance command refuses clearly without a GPU, and its table reads the benchmark
JSON the way the benchmark writes it."""
import os
import os.path as osp
import subprocess
import sys

import pytest

from conftest import REPO, TOOLS, load_tool


def test_gpu_check_refuses_without_a_gpu(tmp_path):
    # no nvidia-smi on PATH (this CI machine has none; a PATH without it makes sure)
    env = dict(os.environ, PATH=f'{tmp_path}{os.pathsep}/usr/bin{os.pathsep}/bin')
    proc = subprocess.run(['bash', osp.join(TOOLS, 'gpu_check.sh')], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    assert proc.returncode == 2
    assert 'no NVIDIA GPU found' in proc.stderr and 'tools/demo.sh' in proc.stderr
    assert '[install_deps' not in proc.stdout  # refused before installing anything


def test_gpu_check_refuses_when_torch_sees_no_gpu(tmp_path):
    """With a GPU listed but torch blind to it (an old driver), the Python part stops with
    what torch reports instead of timing on the CPU."""
    import torch
    if torch.cuda.is_available():
        pytest.skip('this machine has a GPU')
    proc = subprocess.run([sys.executable, osp.join(TOOLS, 'gpu_check.py'), '--out',
                           str(tmp_path)], cwd=REPO, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=120)
    assert proc.returncode != 0
    assert 'torch.cuda.is_available() is False' in proc.stderr
    assert 'cuda_build.py facts' in proc.stderr


def test_gpu_check_table_reads_the_benchmark_json(tmp_path, monkeypatch, capsys):
    """The table's medians and speed-ups are those of tools/benchmark.py's JSON (run here on
    the CPU with a tiny model, fp32 and bf16), and the targets are judged from them."""
    from test_benchmark_tools import NO_BF16_FLAGS, TINY_BASELINES, TINY_CFG
    from conftest import load_script
    from mmslab.utils import machine
    monkeypatch.setattr(machine, 'cpu_flags', lambda: NO_BF16_FLAGS + ['amx_bf16'])
    cfg = tmp_path / 'mask_rcnn_prepbn_swin_t_1x.py'  # named as a config with a target
    cfg.write_text(TINY_CFG)
    bench = load_script('tools/benchmark.py')
    for name, backbone in TINY_BASELINES.items():
        monkeypatch.setitem(bench.BASELINES, name, backbone)
    report = bench.main([str(cfg), '--shapes', '64x64', '--repeat', '1', '--warmup', '0',
                         '--device', 'cpu', '--precisions', 'fp32', 'bf16',
                         '--baseline-backbone', 'swin_t', 'ln_swin_t', '--out',
                         str(tmp_path / 'bench')])
    check = load_tool('gpu_check')
    timing = dict(name='mask_rcnn_prepbn_swin_t_1x', report=report)
    rows = check.speed_rows(timing, ('fp32', 'bf16'))
    assert {(r['part'], r['precision']) for r in rows} == {
        (p, d) for p in ('model', 'backbone') for d in ('fp32', 'bf16')}
    median = {(r['variant'], r['part'], r['precision']): r['median_ms']
              for r in report['results']}
    name = 'mask_rcnn_prepbn_swin_t_1x'
    for row in rows:
        key = (row['part'], row['precision'])
        fused = median[(f'{name} (fused)', *key)]
        mmdet = median[(f'{name} with swin_t backbone (LN)', *key)]
        control = median[(f'{name} with ln_swin_t backbone (LN control, fused)', *key)]
        assert row['fused_ms'] == fused and row['unfused_ms'] == median[(f'{name} (unfused)',
                                                                           *key)]
        assert row['vs_mmdet'] == pytest.approx(mmdet / fused)
        assert row['vs_control'] == pytest.approx(control / fused)
        if row['part'] == 'model':
            assert row['targets'] == dict(vs_mmdet=1.19, vs_control=1.0)
            assert row['met'] == (mmdet / fused >= 1.19 and control / fused >= 1.0)
        else:
            assert 'met' not in row
    check.print_table(rows, 'test machine')
    out = capsys.readouterr().out
    assert 'prepbn_swin_t' in out and ('met' in out) and 'x mmdet' in out


def test_gpu_check_rows_without_a_report_are_empty():
    check = load_tool('gpu_check')
    assert check.speed_rows(dict(name='x', report=None)) == []


def test_gpu_check_step_timeout_stops_a_hung_step(tmp_path):
    """A step past --step-timeout is killed with its children and reported as failed, so the
    steps after it still run; a step within it keeps its exit code and log."""
    gpu_check = load_tool('gpu_check')
    hung = [sys.executable, '-c',
            'import subprocess, sys, time; print("started", flush=True); '
            'subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]); '
            'time.sleep(60)']
    code, seconds = gpu_check.run(hung, str(tmp_path / 'hung.log'), timeout=2)
    assert code == 'timeout' and seconds < 30
    assert 'started' in (tmp_path / 'hung.log').read_text()
    code, _ = gpu_check.run([sys.executable, '-c', 'import sys; print("ok"); sys.exit(3)'],
                            str(tmp_path / 'ok.log'), timeout=30)
    assert code == 3 and (tmp_path / 'ok.log').read_text() == 'ok\n'


def test_gpu_check_trains_the_real_configs_on_the_synthetic_sets(tmp_path):
    """Step 3's configs: every family of the README, each against its LayerNorm control; the
    written config keeps the real one's model and input size, trains a few iterations with
    the synthetic classes, progressive norms mid-decay, and builds."""
    from mmengine.config import Config
    from mmengine.registry import DefaultScope
    from mmslab.utils.launch import model_registry
    import mmslab  # noqa: F401
    check = load_tool('gpu_check')
    families = check.REAL_CONFIGS
    assert set(families) == {'mask_rcnn', 'retinanet', 'upernet'}
    for family, (control, methods) in families.items():
        assert 'swin_t' in control and osp.isfile(osp.join(REPO, control))
        for config in [control] + methods:
            assert osp.isfile(osp.join(REPO, config)), config
    assert {m.split('_1x')[0].split('_160k')[0].split('/')[-1]
            for _, ms in families.values() for m in ms} == {
        'mask_rcnn_prepbn_swin_t', 'mask_rcnn_slab_swin_t', 'mask_rcnn_repa_swin_t',
        'mask_rcnn_prepbn_pvt_t', 'retinanet_prepbn_swin_t', 'retinanet_slab_swin_t',
        'retinanet_repa_swin_t', 'retinanet_prepbn_pvt_t', 'upernet_slab_swin_t'}
    for config in ('configs/mask_rcnn_slab_swin_t_1x.py', 'configs/retinanet_repa_swin_t_1x.py',
                   'configs/upernet_slab_swin_t_160k_ade20k.py'):
        real = Config.fromfile(osp.join(REPO, config))
        path = check.synthetic_config(config, 7, str(tmp_path / osp.basename(config)))
        cfg = Config.fromfile(path)
        assert cfg.train_cfg.max_iters == cfg.train_cfg.val_interval == 7
        assert cfg.train_cfg.type == 'IterBasedTrainLoop'
        assert cfg.model.backbone.init_cfg is None
        assert cfg.train_pipeline == real.train_pipeline  # the real input size
        classes = cfg.train_dataloader.dataset.metainfo.classes
        assert classes == cfg.val_dataloader.dataset.metainfo.classes and len(classes) > 3
        norm = cfg.model.backbone.get('norm_cfg') or {}
        assert norm.get('type') != 'PRepBN' or norm['step'] == 14
        assert ('slab' in config) == (norm.get('type') == 'PRepBN')
        with DefaultScope.overwrite_default_scope(cfg.default_scope):
            model = model_registry(cfg.default_scope).build(cfg.model)
        heads = [m for m in (getattr(model, 'roi_head', None), getattr(model, 'bbox_head', None),
                             getattr(model, 'decode_head', None)) if m is not None]
        head = heads[0].bbox_head if hasattr(heads[0], 'bbox_head') else heads[0]
        assert head.num_classes == len(classes)
        assert any(h.get('type') == 'ReparamEvalHook' for h in cfg.custom_hooks)


def test_gpu_check_reads_a_training_run(tmp_path):
    """s/iter (after the first two logged iterations), peak memory and the fusion check are
    read from the files a training run writes."""
    import json
    check = load_tool('gpu_check')
    run_dir = tmp_path / '20261128_000000' / 'vis_data'
    run_dir.mkdir(parents=True)
    records = [dict(loss=3.0 - i, time=t, memory=m, step=i + 1)
               for i, (t, m) in enumerate([(5.0, 900), (0.9, 1800), (0.5, 2048), (0.7, 1900),
                                            (0.6, 1000)])]
    records.append({'coco/bbox_mAP': 0.0, 'step': 5})
    (run_dir / 'scalars.json').write_text('\n'.join(json.dumps(r) for r in records))
    (tmp_path / 'latency.json').write_text(json.dumps(dict(
        max_relative_difference=2e-6, fusion_check=dict(result='passed'), timed='fused')))
    figures = check.training_figures(str(tmp_path))
    assert figures['s_per_iter'] == 0.6 and figures['peak_memory_gib'] == 2.0
    assert figures['iterations'] == 5 and figures['last_loss'] == -1.0
    assert figures['fusion_difference'] == 2e-6 and figures['fusion_check'] == 'passed'
