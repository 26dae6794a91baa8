"""Deployment: tools/export_onnx.py (ONNX, onnxruntime, OpenVINO, INT8) and tools/test.py
``--backend onnxruntime|openvino --export-dir DIR`` (the exported part in the runtime, the
rest in PyTorch).

Tiny models as in test_distributed.py: a PRepBN Swin (embed_dims 16, depths 1-1-1-1, window
4) in Mask R-CNN (96 px COCO demo) and in UperNet (64 px ADE20K demo), trained for 2
iterations with tools/train.py so the checkpoints have a trained, fusable structure.
"""
import json
import math
import os
import os.path as osp
import pickle
import sys

import pytest
import torch

from conftest import load_tool
from test_tools_e2e import (TOOLS, det_config, demo_data,  # noqa: F401
                            parse_metrics, run_tool, tiny_prepbn_swin_config, write_config)

ENV = dict(OMP_NUM_THREADS='1')
SHAPES = dict(det=(96, 96), seg=(64, 64))  # what the data preprocessors pad the demo data to
PARITY_TOL = 1e-4


def tiny_swin_config(task: str, data_root, work_dir) -> dict:
    return tiny_prepbn_swin_config(task, data_root, work_dir)


def export(config, out, shape, *extra, checkpoint=None, cwd=None):
    args = [sys.executable, osp.join(TOOLS, 'export_onnx.py'), config]
    if checkpoint:
        args.append(checkpoint)
    args += ['--out', out, '--shape', *shape, '--threads', '1', *extra]
    output = run_tool(args, cwd=cwd or osp.dirname(out), env=ENV)
    with open(osp.join(out, 'export.json')) as f:
        return json.load(f), output


def check_parity(report: dict, runtimes=('onnxruntime', 'openvino')):
    for runtime in runtimes:
        errors = report['runtimes'][runtime]['fp32_max_relative_error']
        assert errors and all(e <= PARITY_TOL for e in errors.values()), (runtime, errors)


# ----------------------------------------------------------------------------------------------
# fixtures: configs, 2-iteration checkpoints, exports of them
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def tiny(demo_data, tmp_path_factory):
    """{task: dict(root, config, checkpoint)}, trained lazily with tools/train.py."""
    cache = {}

    def get(task):
        if task not in cache:
            root = tmp_path_factory.mktemp(f'deploy_{task}')
            work_dir = root / 'work_dir'
            config = write_config(root / f'tiny_swin_{task}.py',
                                  tiny_swin_config(task, demo_data[task], work_dir))
            run_tool([sys.executable, osp.join(TOOLS, 'train.py'), config], cwd=root, env=ENV)
            ckpt = work_dir / 'iter_2.pth'
            assert ckpt.is_file()
            cache[task] = dict(root=root, config=config, checkpoint=str(ckpt))
        return cache[task]

    return get


@pytest.fixture(scope='module')
def exported(tiny):
    """The trained tiny models exported at the demo data's size: det 'features' (fp32),
    seg 'model' (fp32 + INT8 calibrated on 2 demo images), both runtimes."""
    cache = {}

    def get(task):
        if task not in cache:
            run = tiny(task)
            out = str(run['root'] / 'export')
            extra = ['--int8', '--calib-images', '2'] if task == 'seg' else []
            report, output = export(run['config'], out, map(str, SHAPES[task]), *extra,
                                    checkpoint=run['checkpoint'], cwd=run['root'])
            cache[task] = dict(run, export_dir=out, report=report, output=output)
        return cache[task]

    return get


# ----------------------------------------------------------------------------------------------
# export
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize('task', ['det', 'seg'])
def test_export_parts_parity(exported, task):
    ex = exported(task)
    report = ex['report']
    assert report['part'] == ('features' if task == 'det' else 'model')
    assert report['shape'] == list(SHAPES[task]) and report['dynamic'] is False
    n_out = 5 if task == 'det' else 1  # FPN levels / logits
    assert report['outputs'] == [f'out{i}' for i in range(n_out)]
    assert osp.isfile(osp.join(ex['export_dir'], 'model.onnx'))
    assert osp.isfile(osp.join(ex['export_dir'], 'openvino', 'model.xml'))
    check_parity(report)


def test_int8_export(exported):
    ex = exported('seg')
    for path in ('model_int8.onnx', osp.join('openvino', 'model_int8.xml'),
                 osp.join('openvino', 'model_int8.bin')):
        assert osp.isfile(osp.join(ex['export_dir'], path)), path
    for runtime in ('onnxruntime', 'openvino'):
        dev = ex['report']['runtimes'][runtime]['int8_max_relative_deviation']
        assert math.isfinite(dev) and dev > 0, (runtime, dev)
    assert 'INT8 deviates by' in ex['output']


def test_export_mmdet_swin_baseline(demo_data, tmp_path):
    """mmdet's own SwinTransformer (LayerNorm), random weights, through the same tool."""
    cfg = det_config(demo_data['det'], tmp_path / 'work_dir')
    cfg['model']['backbone'] = dict(
        type='SwinTransformer', embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
        window_size=4, out_indices=(0, 1, 2, 3), drop_path_rate=0.0, convert_weights=False)
    cfg['model']['neck']['in_channels'] = [16, 32, 64, 128]
    cfg['custom_imports'] = dict(imports=['mmslab'], allow_failed_imports=False)
    config = write_config(tmp_path / 'mmdet_swin.py', cfg)
    # in process (the same main() as the command line; saves a start-up)
    report = load_tool('export_onnx').main([config, '--out', str(tmp_path / 'bb'), '--shape',
                                            '96', '96', '--part', 'backbone', '--threads', '1'])
    assert report['part'] == 'backbone' and len(report['outputs']) == 4
    check_parity(report)


# ----------------------------------------------------------------------------------------------
# tools/test.py --backend
# ----------------------------------------------------------------------------------------------

def _test(run, tmp_path, name, *extra):
    out = tmp_path / (f'{name}.pkl' if run['config'].endswith('det.py') else name)
    output = run_tool([sys.executable, osp.join(TOOLS, 'test.py'), run['config'],
                       run['checkpoint'], '--work-dir', tmp_path / f'wd_{name}',
                       '--out', out, *extra], cwd=tmp_path, env=ENV)
    with open(tmp_path / f'wd_{name}' / 'latency.json') as f:
        latency = json.load(f)
    return parse_metrics(output), output, out, latency


@pytest.mark.parametrize('task', ['det', 'seg'])
def test_runtime_backend_metrics_match_pytorch(exported, tmp_path, task):
    ex = exported(task)
    ref, _, ref_out, _ = _test(ex, tmp_path, 'pytorch')
    got, output, got_out, latency = _test(ex, tmp_path, 'onnxruntime', '--backend',
                                          'onnxruntime', '--export-dir', ex['export_dir'])
    assert ref['backend'] == 'pytorch' and ref['int8'] is False
    assert got['backend'] == 'onnxruntime' and got['int8'] is False
    part = 'features' if task == 'det' else 'model'
    assert f"part '{part}' runs in onnxruntime (fp32" in output
    # fp32: ReparamEvalHook's check compared the runtime with the unfused PyTorch model
    assert latency['max_relative_difference'] is not None
    assert latency['max_relative_difference'] < 1e-3
    if task == 'det':
        for key in ('coco/bbox_mAP', 'coco/bbox_mAP_50', 'coco/segm_mAP'):
            assert got[key] == pytest.approx(ref[key], abs=1e-3), key
        with open(ref_out, 'rb') as f:
            ref_pred = pickle.load(f)
        with open(got_out, 'rb') as f:
            got_pred = pickle.load(f)
        assert len(ref_pred) == len(got_pred) == 4
        for a, b in zip(ref_pred, got_pred):
            a, b = a['pred_instances'], b['pred_instances']
            assert len(a['bboxes']) == len(b['bboxes']) > 0
            torch.testing.assert_close(b['bboxes'], a['bboxes'], atol=1e-3, rtol=0)
            torch.testing.assert_close(b['scores'], a['scores'], atol=1e-4, rtol=0)
    else:
        for key in ('mIoU', 'aAcc'):
            assert got[key] == pytest.approx(ref[key], abs=0.1), key
        import mmcv
        names = sorted(os.listdir(ref_out))
        assert names and names == sorted(os.listdir(got_out))
        for name in names:
            a = mmcv.imread(osp.join(ref_out, name), 'unchanged')
            b = mmcv.imread(osp.join(got_out, name), 'unchanged')
            assert a.shape == b.shape and (a != b).mean() < 0.01, name


def test_runtime_backend_int8(exported, tmp_path):
    ex = exported('seg')
    got, output, _, latency = _test(ex, tmp_path, 'ov_int8', '--backend', 'openvino',
                                    '--int8', '--export-dir', ex['export_dir'])
    assert got['backend'] == 'openvino' and got['int8'] is True
    assert "part 'model' runs in openvino (INT8" in output
    assert 0 <= got['mIoU'] <= 100
    # INT8 differs by design: the equivalence check is off
    assert latency['max_relative_difference'] is None


def test_backbone_export_and_hook_pads_crops_refuses_larger_inputs(exported, tmp_path):
    """Part 'backbone' of the trained detector exported at 128x128 (parity in both runtimes);
    then in process: a 96x96 batch through it is zero-padded, the outputs are cropped to the
    shapes the PyTorch model gives at 96x96 (and go through the PyTorch neck); a larger input
    is an error."""
    from types import SimpleNamespace

    from mmengine.logging import MMLogger
    from mmengine.runner import load_checkpoint

    import mmslab
    from mmslab.engine.hooks import RuntimeBackendHook
    from mmslab.utils.launch import build_model_from_config
    run = exported('det')
    report, _ = export(run['config'], str(tmp_path / 'ex128'), ['128', '128'], '--part',
                       'backbone', checkpoint=run['checkpoint'])
    assert report['part'] == 'backbone' and len(report['outputs']) == 4
    check_parity(report)
    _, model = build_model_from_config(run['config'])
    load_checkpoint(model, run['checkpoint'], map_location='cpu', logger='silent')
    model = mmslab.reparameterize(model.eval())
    hook = RuntimeBackendHook(str(tmp_path / 'ex128'), 'onnxruntime')
    runner = SimpleNamespace(model=model, logger=MMLogger.get_current_instance())
    inner = hook._load()
    calls = []

    class Counting:
        path = inner.path

        def __call__(self, image):
            calls.append(image.shape)
            return inner(image)

    hook._runtime_model = Counting()
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        ref = model.extract_feat(x)
        hook.before_test_epoch(runner)
        try:
            out = model.extract_feat(x)
            assert calls == [(1, 3, 128, 128)] * 2
            assert [o.shape for o in out] == [r.shape for r in ref]
            assert all(torch.isfinite(o).all() for o in out)
            with pytest.raises(RuntimeError, match='larger than the exported static shape'):
                model.extract_feat(torch.randn(1, 3, 160, 128))
        finally:
            hook.after_test_epoch(runner)
    assert 'extract_feat' not in vars(model)  # restored
    with torch.no_grad():
        torch.testing.assert_close(model.extract_feat(x), ref)


def test_crop_size():
    from mmslab.engine.hooks.runtime_backend_hook import _crop_size
    # FPN levels of an 800-row export (strides 4..64), cropped for a 768-row input
    assert [_crop_size(768, 800, n) for n in (200, 100, 50, 25, 13)] == [192, 96, 48, 24, 12]
    assert [_crop_size(64, 96, n) for n in (24, 12, 6, 3, 2)] == [16, 8, 4, 2, 1]
    assert _crop_size(64, 96, 7) == 7  # no power-of-2 stride explains it: kept


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------

def exit_message(capsys, fn, *args) -> str:
    """``fn(*args)`` must exit (argparse error or SystemExit('error: ...')): its message."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as err:
        fn(*args)
    code = err.value.code
    return (code if isinstance(code, str) else '') + capsys.readouterr().err


def test_backend_argument_errors(exported, tmp_path, capsys):
    from mmengine.config import Config
    det, seg = exported('det'), exported('seg')
    tool = load_tool('test')
    args = [det['config'], det['checkpoint']]
    msg = exit_message(capsys, tool.parse_args, args + ['--backend', 'onnxruntime'])
    assert '--backend onnxruntime needs --export-dir' in msg
    msg = exit_message(capsys, tool.parse_args, args + ['--int8'])
    assert '--int8 needs --backend' in msg
    msg = exit_message(capsys, tool.parse_args,
                       args + ['--backend', 'openvino', '--export-dir', str(tmp_path)])
    assert 'no export.json' in msg
    # a segmentor's logits for a detector
    parsed = tool.parse_args(args + ['--backend', 'onnxruntime', '--export-dir',
                                     seg['export_dir']])
    msg = exit_message(capsys, tool.setup_runtime_backend, Config(dict(custom_hooks=[])),
                       parsed, 'mmdet')
    assert "holds part 'model'" in msg
    # INT8 turns ReparamEvalHook's equivalence check off, fp32 keeps it
    for int8 in (False, True):
        cfg = Config(dict(custom_hooks=[dict(type='ReparamEvalHook')]))
        parsed = tool.parse_args(args + ['--backend', 'onnxruntime', '--export-dir',
                                         det['export_dir']] + ['--int8'] * int8)
        tool.setup_runtime_backend(cfg, parsed, 'mmdet')
        reparam, runtime = cfg.custom_hooks
        assert reparam.get('check_equivalence', True) is not int8
        assert runtime == dict(type='RuntimeBackendHook', export_dir=det['export_dir'],
                               runtime='onnxruntime', int8=int8, threads=0)


def test_export_errors(tiny, tmp_path, capsys):
    det = tiny('det')
    tool = load_tool('export_onnx')
    base = [det['config'], '--shape', '96', '96', '--runtime', 'onnxruntime']
    msg = exit_message(capsys, tool.main, base + ['--out', str(tmp_path / 'a'),
                                                  '--part', 'model'])
    assert "part 'model' is for segmentors" in msg
    msg = exit_message(capsys, tool.main, base + ['--out', str(tmp_path / 'b'), '--dynamic'])
    assert '--dynamic is not supported for Swin-type backbones' in msg
    msg = exit_message(capsys, tool.parse_args,
                       [det['config'], '--out', str(tmp_path / 'c'), '--shape', '100', '96'])
    assert 'must be multiples of 32' in msg
