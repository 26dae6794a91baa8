"""Deployment through the tools: tools/export_onnx.py (the whole model by default, free
height and width, onnxruntime and OpenVINO, INT8) and tools/test.py ``--backend
onnxruntime|openvino --export-dir DIR`` (the deployed model evaluated).

The tiny trained models and their exports are the session's fixtures of
deployed_models.py (shared with test_precision.py); real photographs (matplotlib's sample
photograph, its crops and transposes) for sizes and orientations the square demo images do
not have. What trains, exports or runs a tool is marked ``slow`` (``bash tools/run_tests.sh
--fast`` leaves it out).
"""
import copy
import json
import os.path as osp
import pickle
import shutil
import sys
import warnings

import numpy as np
import pytest
import torch

from conftest import load_tool, make_photo_coco
from deployed_models import ENV, export
from tool_runs import exit_message
from test_tools_e2e import (TOOLS, det_config, demo_data,  # noqa: F401
                            parse_metrics, run_tool, tiny_prepbn_swin_config, write_config)


def assert_parity(report: dict, runtimes=('onnxruntime', 'openvino'), min_images=5):
    from mmslab.deploy.compare import within_fp32_tolerance
    for runtime in runtimes:
        records = report['runtimes'][runtime]['fp32']
        assert len(records) >= min_images, records  # dynamic: other sizes, both orientations
        assert all(within_fp32_tolerance(r) for r in records.values()), (runtime, records)


# ----------------------------------------------------------------------------------------------
# export
# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('task', ['det', 'seg'])
def test_whole_model_export_report_and_parity(exported, task):
    from mmslab.deploy.export_info import SCHEMA_VERSION, file_sha256, read_export_info
    ex = exported(task)
    report = ex['report']
    assert report['part'] == 'model' and report['dynamic'] is True
    assert report['outputs'] == (['dets', 'labels', 'masks'] if task == 'det' else
                                 ['seg_logits'])
    assert report['task'] == ('instance_segmentation' if task == 'det' else
                              'semantic_segmentation')
    assert report['checkpoint_sha256'] == file_sha256(ex['checkpoint'])
    assert report['random_weights'] is False and report['precisions'] == ['fp32', 'int8']
    # written by export.json's owner, and valid to its reader as a whole model
    assert report['schema_version'] == SCHEMA_VERSION
    assert read_export_info(ex['export_dir'], whole_model=True)['outputs'] == report['outputs']
    # the default attention layout, taken by every softmax window block of the tiny PRepBN Swin
    assert report['attention']['layout'] == 'split' and report['attention']['split'] > 0
    assert report['attention']['packed'] == 0 and report['attention']['mmdet_window_msa'] == 0
    assert report['versions']['onnxruntime'] and report['versions']['openvino']
    assert report['pipeline']['resize'] == dict(scale=[96, 96] if task == 'det' else [64, 64],
                                                keep_ratio=True)
    for path in ('model.onnx', 'model_int8.onnx', osp.join('openvino', 'model.xml'),
                 osp.join('openvino', 'model_int8.xml')):
        assert osp.isfile(osp.join(ex['export_dir'], path)), path
    assert_parity(report)
    if task == 'det':  # the comparison had detections to compare
        records = report['runtimes']['onnxruntime']['fp32'].values()
        assert sum(r['num_ref'] for r in records) >= 20
    # the exporter's expected warnings and the calibration's overflow are not shown (mmseg's
    # own deprecation notices from building the model and its test pipeline are mmseg's)
    for shown in ('TracerWarning', 'torch/onnx', 'overflow encountered'):
        assert shown not in ex['output'], ex['output'][-3000:]


@pytest.mark.slow
@pytest.mark.parametrize('task', ['det', 'seg'])
def test_int8_graphs_are_quantized_and_deviation_is_measured(exported, task):
    import onnx
    ex = exported(task)
    graph = onnx.load(osp.join(ex['export_dir'], 'model_int8.onnx')).graph
    ops = [n.op_type for n in graph.node]
    float_graph = onnx.load(osp.join(ex['export_dir'], 'model.onnx')).graph
    layers = sum(n.op_type in ('MatMul', 'Gemm', 'Conv') for n in float_graph.node)
    # every weight layer got a dequantized int8 weight (depth-wise convs stay float)
    assert ops.count('DequantizeLinear') >= layers // 2 and 'QuantizeLinear' in ops
    with open(osp.join(ex['export_dir'], 'openvino', 'model_int8.xml')) as f:
        assert 'FakeQuantize' in f.read()
    for runtime in ('onnxruntime', 'openvino'):
        records = ex['report']['runtimes'][runtime]['int8_on_test_images']
        assert records  # test images, not the calibration ones (calibration_set: train)
    assert ex['report']['int8']['calibration_set'] == 'train'
    # the weight bits this CPU computes exactly, in the report and in the file
    from mmslab.deploy.runtimes import INT8_WEIGHT_BITS_KEY, int8_weight_bits
    bits = ex['report']['int8']['onnxruntime_weight_bits']
    assert bits == int8_weight_bits()
    props = onnx.load(osp.join(ex['export_dir'], 'model_int8.onnx')).metadata_props
    assert {p.key: p.value for p in props}[INT8_WEIGHT_BITS_KEY] == str(bits)


def test_export_refuses_random_weights_without_the_flag(tiny_config, tmp_path, capsys):
    det = tiny_config('det')
    tool = load_tool('export_onnx')
    with pytest.raises(SystemExit):
        tool.parse_args([det['config'], '--out', str(tmp_path / 'a')])
    assert '--random-weights' in capsys.readouterr().err


@pytest.mark.slow
def test_export_mmdet_swin_mask_rcnn_whole(demo_data, tmp_path):  # noqa: F811
    """mmdet's own SwinTransformer (LayerNorm) in Mask R-CNN, through the same exporter:
    the whole detector, free H, W, parity in both runtimes."""
    cfg = det_config(demo_data['det'], tmp_path / 'work_dir')
    cfg['model']['backbone'] = dict(
        type='SwinTransformer', embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
        window_size=4, out_indices=(0, 1, 2, 3), drop_path_rate=0.0, convert_weights=False)
    cfg['model']['neck']['in_channels'] = [16, 32, 64, 128]
    cfg['model']['test_cfg']['rcnn']['score_thr'] = 0.0
    cfg['custom_imports'] = dict(imports=['mmslab'], allow_failed_imports=False)
    config = write_config(tmp_path / 'mmdet_swin.py', cfg)
    report = load_tool('export_onnx').main([config, '--random-weights', '--out',
                                            str(tmp_path / 'ex'), '--threads', '1',
                                            '--eval-images', '2'])
    assert report['part'] == 'model' and report['outputs'] == ['dets', 'labels', 'masks']
    assert_parity(report)


@pytest.mark.slow
def test_openvino_int8_of_a_fresh_mask_rcnn_compiles(demo_data, tmp_path):  # noqa: F811
    """A freshly initialized Mask R-CNN (random weights; its mask head's class-logit conv
    has a zero bias, which the runtimes fold away) exported whole to OpenVINO INT8 compiles
    and runs. OpenVINO's INT8 transformations failed on it while the per-detection class
    selection reshaped (detection, class) into rows: they tried to move the conv's
    per-class dequantization through that reshape."""
    cfg = det_config(demo_data['det'], tmp_path / 'work_dir')
    config = write_config(tmp_path / 'fresh.py', cfg)
    report = load_tool('export_onnx').main([
        config, '--random-weights', '--out', str(tmp_path / 'ex'), '--threads', '1',
        '--eval-images', '1', '--runtime', 'openvino', '--int8', '--calib-images', '2'])
    records = report['runtimes']['openvino']['int8_on_test_images']
    assert records and all(r['num_out'] > 0 for r in records.values()), records


# ----------------------------------------------------------------------------------------------
# tools/test.py --backend
# ----------------------------------------------------------------------------------------------

def _test(run, tmp_path, name, *extra, config=None):
    out = tmp_path / (name if run['config'].endswith('seg.py') else f'{name}.pkl')
    output = run_tool([sys.executable, osp.join(TOOLS, 'test.py'), config or run['config'],
                       run['checkpoint'], '--work-dir', tmp_path / f'wd_{name}',
                       '--out', out, *extra], cwd=tmp_path, env=ENV)
    return parse_metrics(output), output, out


def load_predictions(path):
    with open(path, 'rb') as f:
        return [p['pred_instances'] for p in pickle.load(f)]


def assert_same_detections(ref_pkl, got_pkl, min_matched=1.0, min_total=10):
    """Per image: as many detections, each reference detection matched by one of the same
    label (IoU >= 0.5) with its box within 1 px and its score within 1e-3. ``min_matched`` <
    1 allows a few near-tie NMS decisions to flip (untrained tiny models score many
    overlapping boxes alike, so a 1e-6 difference can change which one NMS keeps)."""
    from mmslab.deploy.compare import compare_detections
    ref, got = load_predictions(ref_pkl), load_predictions(got_pkl)
    assert len(ref) == len(got)
    total = 0
    for a, b in zip(ref, got):
        rec = compare_detections(
            dict(dets=torch.cat([a['bboxes'], a['scores'][:, None]], 1).numpy(),
                 labels=a['labels'].numpy()),
            dict(dets=torch.cat([b['bboxes'], b['scores'][:, None]], 1).numpy(),
                 labels=b['labels'].numpy()))
        assert rec['num_ref'] == rec['num_out'], rec
        assert rec['matched'] >= min_matched, rec
        assert rec['max_box_px'] <= 1.0 and rec['max_score'] <= 1e-3, rec
        total += rec['num_ref']
    assert total >= min_total  # something was compared


@pytest.mark.slow
@pytest.mark.parametrize('task', ['det', 'seg'])
def test_runtime_backend_metrics_match_pytorch(exported, tmp_path, task):
    ex = exported(task)
    ref, _, ref_out = _test(ex, tmp_path, 'pytorch')
    got, output, got_out = _test(ex, tmp_path, 'onnxruntime', '--backend', 'onnxruntime',
                                 '--export-dir', ex['export_dir'])
    assert ref['backend'] == 'pytorch' and got['backend'] == 'onnxruntime'
    assert "part 'model' runs in onnxruntime (fp32" in output
    if task == 'det':
        for key in ('coco/bbox_mAP', 'coco/bbox_mAP_50', 'coco/segm_mAP'):
            assert got[key] == pytest.approx(ref[key], abs=0.002), key
        assert_same_detections(ref_out, got_out)
    else:
        for key in ('mIoU', 'aAcc'):
            assert got[key] == pytest.approx(ref[key], abs=0.01), key
        import mmcv
        names = sorted(p.name for p in ref_out.iterdir())
        assert names and names == sorted(p.name for p in got_out.iterdir())
        for name in names:
            a = mmcv.imread(str(ref_out / name), 'unchanged')
            b = mmcv.imread(str(got_out / name), 'unchanged')
            assert a.shape == b.shape and (a != b).mean() < 0.001, name


@pytest.mark.slow
def test_runtime_backend_int8_detector_is_bounded(exported, tmp_path):
    """The INT8 detector in OpenVINO through tools/test.py, as the deployed form the export
    records: mAP within 0.02 of fp32, and its detections match the fp32 ones (IoU-matched,
    same labels)."""
    from mmslab.deploy.compare import compare_detections
    ex = exported('det')
    ref, _, ref_out = _test(ex, tmp_path, 'pytorch')
    # the export recording OpenVINO INT8 as its deployed form (tools/export_onnx.py
    # --latency): --export-dir alone evaluates that, says so and records it
    deployed = tmp_path / 'deployed_export'
    shutil.copytree(ex['export_dir'], deployed)
    info = json.loads((deployed / 'export.json').read_text())
    info['latency'] = dict(shape='96x96', median_ms={'openvino int8': 1.0},
                           deploy=dict(runtime='openvino', precision='int8', median_ms=1.0,
                                       reason='measured'))
    (deployed / 'export.json').write_text(json.dumps(info))
    got, output, got_out = _test(ex, tmp_path, 'ov_int8', '--export-dir', str(deployed))
    assert got['backend'] == 'openvino' and got['int8'] is True
    assert got['form_source'] == 'export.json'
    assert got['deployed_form'] == dict(runtime='openvino', precision='int8')
    assert ('deployed form from export.json: openvino int8 (chosen by tools/export_onnx.py '
            '--latency 96x96); --backend/--precision choose another') in output
    assert "part 'model' runs in openvino (INT8" in output
    assert 'the deployed form export.json records' in output
    for key in ('coco/bbox_mAP', 'coco/segm_mAP'):
        assert abs(got[key] - ref[key]) <= 0.02, key
    matched = []
    for a, b in zip(load_predictions(ref_out), load_predictions(got_out)):
        top = a['scores'] >= 0.5 * float(a['scores'].max())  # the confident detections
        rec = compare_detections(
            dict(dets=torch.cat([a['bboxes'], a['scores'][:, None]], 1)[top].numpy(),
                 labels=a['labels'][top].numpy()),
            dict(dets=torch.cat([b['bboxes'], b['scores'][:, None]], 1).numpy(),
                 labels=b['labels'].numpy()))
        matched.append(rec['matched'])
    assert np.mean(matched) >= 0.7, matched


@pytest.mark.slow
def test_real_photographs_match_pytorch(tiny, tmp_path):
    """Portrait, landscape and panorama photographs (not the square demo images) through the
    deployed detector: the same detections as the fused PyTorch model.

    Both sides get the images unpadded (``pad_size_divisor=1``: sizes such as 82x96 that are
    no multiple of 32 reach the graph): mmdet clips boxes to the unpadded image size from
    the metadata, the graph to its input, so with padding the two differ inside the padded
    band by design (as mmdeploy's end-to-end models do)."""
    from mmslab.datasets import COCO_DEMO_CLASSES
    run = tiny('det')
    root = make_photo_coco(str(tmp_path / 'photos'), COCO_DEMO_CLASSES)
    cfg = dict(run['cfg'])
    for key in ('test_dataloader', 'val_dataloader'):
        loader = copy.deepcopy(cfg[key])
        loader['dataset']['data_root'] = root
        loader['dataset']['data_prefix'] = dict(img='val2017/')
        loader['dataset']['ann_file'] = 'annotations/instances_val2017.json'
        cfg[key] = loader
    for key in ('test_evaluator', 'val_evaluator'):
        cfg[key] = dict(cfg[key], ann_file=osp.join(root, 'annotations/instances_val2017.json'))
    config = write_config(tmp_path / 'photos.py', cfg)
    out = str(tmp_path / 'export')
    unpadded = ['--cfg-options', 'model.data_preprocessor.pad_size_divisor=1']
    report, _ = export(config, out, '--runtime', 'onnxruntime', *unpadded,
                       checkpoint=run['checkpoint'], cwd=tmp_path)
    sizes = report['parity_images']['sizes']
    assert len(set(sizes)) >= 3 and report['parity_images']['source'] == 'test set'
    assert any(int(s.split('x')[0]) % 32 for s in sizes)
    runs = dict(run, config=config)
    _, _, ref_out = _test(runs, tmp_path, 'pytorch', *unpadded, config=config)
    _, _, got_out = _test(runs, tmp_path, 'ort', '--backend', 'onnxruntime', '--export-dir',
                          out, *unpadded, config=config)
    assert_same_detections(ref_out, got_out, min_matched=0.9)


@pytest.mark.slow
def test_static_export_pads_and_refuses_larger_inputs(exported, tmp_path):
    """A static whole-detector export at 128x128: 96x96 inputs are zero-padded to it (the
    detections stay in the input's pixels), a larger input is an error."""
    from types import SimpleNamespace

    from mmengine.logging import MMLogger
    from mmengine.runner import load_checkpoint
    from mmdet.structures import DetDataSample

    import mmslab
    from mmslab.engine.hooks import RuntimeBackendHook
    from mmslab.utils.launch import build_model_from_config
    run = exported('det')
    report, _ = export(run['config'], str(tmp_path / 'ex128'), '--no-dynamic', '--shape',
                       '128', '128', '--runtime', 'onnxruntime', checkpoint=run['checkpoint'])
    assert report['dynamic'] is False and report['pipeline']['size'] == [128, 128]
    assert_parity(report, ('onnxruntime', ), min_images=2)
    _, model = build_model_from_config(run['config'])
    load_checkpoint(model, run['checkpoint'], map_location='cpu', logger='silent')
    model = mmslab.reparameterize(model.eval())
    hook = RuntimeBackendHook(str(tmp_path / 'ex128'), 'onnxruntime')
    runner = SimpleNamespace(model=model, logger=MMLogger.get_current_instance())
    meta = dict(img_shape=(96, 96), ori_shape=(96, 96), scale_factor=(1.0, 1.0),
                batch_input_shape=(96, 96), pad_shape=(96, 96))
    x = torch.randn(1, 3, 96, 96)
    hook.before_test_epoch(runner)
    try:
        out = model.predict(x, [DetDataSample(metainfo=meta)])[0].pred_instances
        assert len(out.bboxes) > 0 and out.masks.shape[-2:] == (96, 96)
        with pytest.raises(RuntimeError, match='larger than the exported static shape'):
            model.predict(torch.randn(1, 3, 160, 128), [DetDataSample(metainfo=meta)])
    finally:
        hook.after_test_epoch(runner)
    assert 'predict' not in vars(model)  # restored


# ----------------------------------------------------------------------------------------------
# errors and trust
# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_backend_refuses_other_checkpoints_and_random_exports(exported, tmp_path, capsys):
    from mmengine.config import Config
    det, seg = exported('det'), exported('seg')
    tool = load_tool('test')
    cfg = Config.fromfile(det['config'])
    args = [det['config'], det['checkpoint']]
    msg = exit_message(capsys, tool.parse_args, args + ['--backend', 'onnxruntime'])
    assert '--backend onnxruntime needs --export-dir' in msg
    msg = exit_message(capsys, tool.parse_args, args + ['--int8'])
    assert '--precision int8 needs --backend onnxruntime or openvino' in msg
    msg = exit_message(capsys, tool.parse_args,
                       args + ['--backend', 'openvino', '--export-dir', str(tmp_path)])
    assert 'no export.json' in msg
    # another checkpoint than the exported one (same weights, other bytes)
    other = tmp_path / 'other.pth'
    state = torch.load(det['checkpoint'], map_location='cpu', weights_only=False)
    state['meta'] = dict(state.get('meta') or {}, note='changed')
    torch.save(state, other)
    parsed = tool.parse_args([det['config'], str(other), '--backend', 'onnxruntime',
                              '--export-dir', det['export_dir']])
    msg = exit_message(capsys, tool.setup_runtime_backend, cfg, parsed, 'mmdet')
    assert 'is not the checkpoint exported to' in msg
    # a segmentor export for a detector
    parsed = tool.parse_args([det['config'], seg['checkpoint'], '--backend', 'onnxruntime',
                              '--export-dir', seg['export_dir']])
    msg = exit_message(capsys, tool.setup_runtime_backend, cfg, parsed, 'mmdet')
    assert 'differs from the one exported' in msg or 'holds a segmentor' in msg
    # a random-weights export
    rand = tmp_path / 'random'
    shutil.copytree(det['export_dir'], rand)
    with open(rand / 'export.json') as f:
        info = json.load(f)
    info.update(random_weights=True, checkpoint=None, checkpoint_sha256=None)
    with open(rand / 'export.json', 'w') as f:
        json.dump(info, f)
    parsed = tool.parse_args(args + ['--backend', 'onnxruntime', '--export-dir', str(rand)])
    msg = exit_message(capsys, tool.setup_runtime_backend, cfg, parsed, 'mmdet')
    assert 'random weights' in msg
    # INT8 keeps the check on for a whole detector (it compares PyTorch features)
    for int8 in (False, True):
        c = Config(dict(cfg.to_dict(), custom_hooks=[dict(type='ReparamEvalHook')]))
        parsed = tool.parse_args(args + ['--backend', 'onnxruntime', '--export-dir',
                                         det['export_dir']] + ['--int8'] * int8)
        tool.setup_runtime_backend(c, parsed, 'mmdet')
        reparam, runtime = c.custom_hooks
        assert reparam.get('check_equivalence', True) is True
        assert runtime == dict(type='RuntimeBackendHook', export_dir=det['export_dir'],
                               runtime='onnxruntime', precision='int8' if int8 else 'fp32',
                               threads=0)


def test_export_errors(tiny_config, tmp_path, capsys):
    det = tiny_config('det')
    tool = load_tool('export_onnx')
    msg = exit_message(capsys, tool.parse_args, [det['config'], '--random-weights', '--out',
                                                 str(tmp_path / 'c'), '--shape', '100', '96'])
    assert 'must be multiples of 32' in msg
    msg = exit_message(capsys, tool.main, [det['config'], '--random-weights', '--out',
                                           str(tmp_path / 'd'), '--seg-argmax'])
    assert 'seg_argmax applies to' in msg
    msg = exit_message(capsys, tool.parse_args, [det['config'], str(tmp_path / 'none.pth'),
                                                 '--out', str(tmp_path / 'e')])
    assert 'not found' in msg


@pytest.mark.slow
def test_retinanet_whole_model_through_the_tools(demo_data, tmp_path):  # noqa: F811
    """RetinaNet (a tiny PRepBN Swin, random weights) exported whole with the defaults and
    evaluated through tools/test.py in onnxruntime: PyTorch's detections."""
    from mmengine.runner import save_checkpoint
    from mmslab.datasets import COCO_DEMO_CLASSES
    from mmslab.utils.launch import build_model_from_config
    from conftest import randomize_weights
    cfg = tiny_prepbn_swin_config('det', demo_data['det'], tmp_path / 'work_dir')
    cfg['model'] = dict(
        type='RetinaNet', data_preprocessor=cfg['model']['data_preprocessor'],
        backbone=dict(cfg['model']['backbone'], out_indices=(1, 2, 3)),
        neck=dict(type='FPN', in_channels=[32, 64, 128], out_channels=16, start_level=0,
                  add_extra_convs='on_input', num_outs=5),
        bbox_head=dict(
            type='RetinaHead', num_classes=len(COCO_DEMO_CLASSES), in_channels=16,
            stacked_convs=1, feat_channels=16,
            anchor_generator=dict(type='AnchorGenerator', octave_base_scale=4,
                                  scales_per_octave=3, ratios=[0.5, 1.0, 2.0],
                                  strides=[8, 16, 32, 64, 128]),
            bbox_coder=dict(type='DeltaXYWHBBoxCoder', target_means=[0.0] * 4,
                            target_stds=[1.0] * 4),
            loss_cls=dict(type='FocalLoss', use_sigmoid=True, gamma=2.0, alpha=0.25),
            loss_bbox=dict(type='L1Loss')),
        test_cfg=dict(nms_pre=1000, min_bbox_size=0, score_thr=0.3,
                      nms=dict(type='nms', iou_threshold=0.5), max_per_img=50))
    for key in ('val_evaluator', 'test_evaluator'):
        cfg[key] = dict(cfg[key], metric='bbox')
    config = write_config(tmp_path / 'tiny_retinanet.py', cfg)
    _, model = build_model_from_config(config)
    randomize_weights(model)
    ckpt = str(tmp_path / 'retinanet.pth')
    save_checkpoint(model.state_dict(), ckpt)
    report, _ = export(config, str(tmp_path / 'export'), '--runtime', 'onnxruntime',
                       checkpoint=ckpt, cwd=tmp_path)
    assert report['task'] == 'detection' and report['outputs'] == ['dets', 'labels']
    assert_parity(report, ('onnxruntime', ))
    run = dict(config=config, checkpoint=ckpt)
    _, _, ref_out = _test(run, tmp_path, 'pytorch')
    _, output, got_out = _test(run, tmp_path, 'ort', '--backend', 'onnxruntime',
                               '--export-dir', str(tmp_path / 'export'))
    assert "part 'model' runs in onnxruntime" in output
    assert_same_detections(ref_out, got_out)


@pytest.mark.slow
def test_openvino_bf16_where_the_cpu_has_it(exported, monkeypatch):
    """bf16 runs the fp32 export in OpenVINO on CPUs with bf16 units (close to fp32) and is
    refused with a clear error elsewhere, and for onnxruntime / INT8."""
    from mmslab.deploy.compare import compare_outputs
    from mmslab.deploy.quantize import preprocessed_images
    from mmslab.deploy.runtimes import load_runtime_model
    from mmslab.engine.hooks import RuntimeBackendHook
    from mmslab.utils import machine
    ex = exported('det')
    with pytest.raises(ValueError, match='bf16 runs the fp32 export in OpenVINO'):
        load_runtime_model(ex['export_dir'], 'onnxruntime', 'bf16')
    with pytest.raises(ValueError, match='INT8 is its own precision'):
        RuntimeBackendHook(ex['export_dir'], 'openvino', int8=True, bf16=True)
    if machine.has_bf16():
        from mmslab.utils.launch import build_model_from_config
        cfg, model = build_model_from_config(ex['config'])
        image = preprocessed_images(cfg, model, 1, 'test')[0]
        names = ex['report']['outputs']
        fp32 = load_runtime_model(ex['export_dir'], 'openvino')(image)
        bf16 = load_runtime_model(ex['export_dir'], 'openvino', 'bf16')(image)
        record = compare_outputs(names, fp32, bf16)
        assert record['num_ref'] > 0 and record['mean_iou'] > 0.8, record
    monkeypatch.setattr(machine, 'cpu_flags', lambda: ['avx2', 'avx512f'])
    with pytest.raises(RuntimeError, match='avx512_bf16 or amx_bf16'):
        load_runtime_model(ex['export_dir'], 'openvino', 'bf16')


@pytest.mark.slow
def test_backbone_export_and_hook_pads_crops_refuses_larger_inputs(exported, tmp_path):
    """Part 'backbone' of the trained detector exported static at 128x128: a 96x96 batch is
    zero-padded per image, the outputs are cropped to the shapes the PyTorch model gives at
    96x96 (and go through the PyTorch neck); a larger input is an error."""
    from types import SimpleNamespace

    from mmengine.logging import MMLogger
    from mmengine.runner import load_checkpoint

    import mmslab
    from mmslab.engine.hooks import RuntimeBackendHook
    from mmslab.utils.launch import build_model_from_config
    run = exported('det')
    report, _ = export(run['config'], str(tmp_path / 'ex128'), '--part', 'backbone',
                       '--no-dynamic', '--shape', '128', '128', '--runtime', 'onnxruntime',
                       checkpoint=run['checkpoint'])
    assert report['part'] == 'backbone' and len(report['outputs']) == 4
    assert_parity(report, ('onnxruntime', ), min_images=2)
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


def test_runtime_backend_hook_restores_the_model_on_every_exit(tmp_path):
    """The hook's swap of the model's methods is undone however the test ends: under
    ``runner.test()`` an exception in the second test step propagates and the model's own
    ``extract_feat`` is back (after the first step ran the runtime); the context manager
    restores an instance attribute that was there before, also on an exception. A test that
    completes with ``ReparamEvalHook`` timing it: its log and ``latency.json`` name the
    deployed form, not "fused". A fake runtime model and a hand-written ``export.json`` (part
    'features'): no export needed."""
    from types import SimpleNamespace

    from mmengine.evaluator import BaseMetric
    from mmengine.logging import MMLogger
    from mmengine.model import BaseModel
    from mmengine.runner import Runner

    from mmslab.engine.hooks import RuntimeBackendHook

    export_dir = tmp_path / 'export'
    export_dir.mkdir()
    (export_dir / 'export.json').write_text(json.dumps(
        dict(schema_version=1, part='features', task='detection', shape=[8, 8], dynamic=True,
             outputs=['p0'])))

    class Tiny(BaseModel):

        def __init__(self, fail_at=2):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 1)
            self.steps, self.fail_at = 0, fail_at

        def extract_feat(self, x):
            return (self.conv(x), )

        def forward(self, inputs, data_samples=None, mode='tensor'):
            self.steps += 1
            if self.steps == self.fail_at:
                raise ValueError('the second test step fails')
            return [dict(feat=f) for f in self.extract_feat(torch.stack(inputs))[0]]

    class Count(BaseMetric):

        def process(self, data_batch, data_samples):
            self.results.append(len(data_samples))

        def compute_metrics(self, results):
            return dict(images=sum(results))

    calls = []

    class FakeRuntime:
        path = str(export_dir / 'model.onnx')

        def __call__(self, image):
            calls.append(image.shape)
            return [np.zeros((1, 4, *image.shape[-2:]), np.float32)]

    def hook_with_fake_runtime():
        hook = RuntimeBackendHook(str(export_dir), 'onnxruntime')
        hook._runtime_model = FakeRuntime()
        return hook

    def make_runner(model, hooks, name):
        return Runner(
            model=model, work_dir=str(tmp_path / name), default_scope=None,
            test_dataloader=dict(dataset=[dict(inputs=torch.rand(3, 8, 8)) for _ in range(3)],
                                 sampler=dict(type='DefaultSampler', shuffle=False),
                                 batch_size=1, num_workers=0,
                                 collate_fn=dict(type='pseudo_collate')),
            test_cfg=dict(type='TestLoop'), test_evaluator=[Count()], custom_hooks=hooks,
            env_cfg=dict(dist_cfg=dict(backend='gloo')), log_level='INFO',
            experiment_name=name)

    # a complete test, timed by ReparamEvalHook
    from mmslab.engine.hooks import ReparamEvalHook
    model = Tiny(fail_at=None)
    timing = ReparamEvalHook(reparam=False, warmup=0)
    runner = make_runner(model, [timing, hook_with_fake_runtime()], 'complete')
    runner.test()
    form = 'deployed: onnxruntime fp32 backbone + neck (the rest in PyTorch)'
    assert timing.last_result['timed'] == form and timing.last_result['fused']['count'] == 3
    assert json.loads((tmp_path / 'complete' / 'latency.json').read_text())['timed'] == form
    log = next((tmp_path / 'complete').glob('*/*.log')).read_text()
    assert f'test latency per image ({form}): median' in log, log[-2000:]
    assert 'input dynamic; export.json records no deployed form)' in log, log[-2000:]
    assert calls == [(1, 3, 8, 8)] * 3 and 'extract_feat' not in vars(model)
    calls.clear()

    # an exception in the second step
    model = Tiny()
    hook = hook_with_fake_runtime()
    runner = make_runner(model, [hook], 'failing')
    with pytest.raises(ValueError, match='second test step'):
        runner.test()
    assert model.steps == 2 and calls == [(1, 3, 8, 8)]  # step 1 ran in the "runtime"
    assert 'extract_feat' not in vars(model)  # restored: the class's method again
    assert hook._patched is None and 'run' not in vars(runner.test_loop)  # the guard left
    x = torch.rand(1, 3, 8, 8)
    torch.testing.assert_close(model.extract_feat(x)[0], model.conv(x))

    # the context manager, with an instance attribute to restore
    own = model.extract_feat = lambda x: ('own', )
    plain = SimpleNamespace(model=model, logger=MMLogger.get_current_instance())
    hook = hook_with_fake_runtime()
    with pytest.raises(KeyError):
        with hook.runs_in_runtime(plain) as patched:
            assert patched is model and model.extract_feat is not own
            assert model.extract_feat(x)[0].shape == (1, 4, 8, 8)
            raise KeyError('inside the block')
    assert vars(model)['extract_feat'] is own and hook._patched is None


def whole_detector_info(**changes) -> dict:
    """A valid ``export.json`` of a whole instance-segmentation model, with ``changes``."""
    info = dict(schema_version=1, part='model', task='instance_segmentation',
                outputs=['dets', 'labels', 'masks'], shape=[96, 96], dynamic=True,
                pipeline=dict(resize=dict(scale=[96, 96], keep_ratio=True),
                              mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375],
                              bgr_to_rgb=True, pad_size_divisor=32, pad_value=0.0, size=None),
                classes=['person', 'car'], palette=None, mask_thr_binary=0.5,
                checkpoint_sha256='ab' * 32)
    info.update(changes)
    return info


def test_export_info_owner_writes_and_validates(tmp_path, capsys):
    """``export.json`` has one owner: what it writes its reader takes back; a missing key, a
    stale or absent ``schema_version``, a part that is not a whole model are errors naming
    the key and the command to export again, for the writer (nothing is written), the
    reader, ``RuntimeBackendHook`` and ``tools/test.py --backend``."""
    from mmslab.deploy.export_info import (SCHEMA_VERSION, ExportInfoError, read_export_info,
                                           write_export_info)
    from mmslab.engine.hooks import RuntimeBackendHook
    assert SCHEMA_VERSION == 1

    good = tmp_path / 'good'
    good.mkdir()
    path = write_export_info(str(good), whole_detector_info(pipeline=dict(
        whole_detector_info()['pipeline'], resize=dict(scale=96, keep_ratio=True))))
    info = read_export_info(str(good), whole_model=True)
    assert info['outputs'] == ['dets', 'labels', 'masks'] and info['schema_version'] == 1
    assert info['pipeline']['resize']['scale'] == [96, 96]  # mmcv's Resize: s means (s, s)
    with open(path) as f:
        assert json.load(f)['schema_version'] == 1

    def refused(info: dict, whole_model: bool = False, name: str = 'bad') -> str:
        """The reader's message for ``info`` written by hand to ``tmp_path / name``, after
        the writer refused it."""
        bad = tmp_path / name
        bad.mkdir(exist_ok=True)
        (bad / 'export.json').unlink(missing_ok=True)
        if info.get('schema_version') == SCHEMA_VERSION:  # the writer checks its schema
            with pytest.raises(ExportInfoError):
                write_export_info(str(bad), dict(info, part='model'))
            assert not (bad / 'export.json').exists()
        (bad / 'export.json').write_text(json.dumps(info))
        with pytest.raises(ExportInfoError) as err:
            read_export_info(str(bad), whole_model)
        return str(err.value)

    info = whole_detector_info()
    del info['dynamic']
    msg = refused(info)
    assert "lacks the key 'dynamic'" in msg and 'export again with tools/export_onnx.py' in msg
    info = whole_detector_info()
    del info['pipeline']['size']
    assert "lacks the key 'pipeline.size'" in refused(info, whole_model=True)
    assert "lack masks" in refused(whole_detector_info(outputs=['dets', 'labels']))
    assert 'classes must be a non-empty list' in refused(whole_detector_info(classes=[]), True)

    old = whole_detector_info()
    del old['schema_version']  # an export of the version before export.json had one
    msg = refused(old, name='old')
    assert 'records no schema_version' in msg and 'export again' in msg
    msg = refused(whole_detector_info(schema_version=0))
    assert 'schema_version 0; this mmslab reads 1' in msg and 'export again' in msg
    assert 'update mmslab' not in msg
    assert 'update mmslab' in refused(whole_detector_info(schema_version=2))
    msg = refused(whole_detector_info(part='features', outputs=['p0']), True, 'features')
    assert 'not a whole model' in msg and '--part model' in msg
    # a part needs no pipeline: valid for the hook, which runs parts
    assert read_export_info(str(tmp_path / 'features'))['part'] == 'features'
    with pytest.raises(ExportInfoError, match='does not exist'):
        read_export_info(str(tmp_path / 'nowhere'))

    # the hook and tools/test.py --backend read through the owner
    stale = str(tmp_path / 'old')
    with pytest.raises(ExportInfoError, match='records no schema_version'):
        RuntimeBackendHook(stale)
    tool = load_tool('test')
    args = tool.parse_args(['cfg.py', 'ckpt.pth', '--backend', 'onnxruntime', '--export-dir',
                            stale])
    from mmengine.config import Config
    msg = exit_message(capsys, tool.setup_runtime_backend, Config(dict()), args, 'mmdet')
    assert 'records no schema_version' in msg and 'export again' in msg


def timed_export(root, name: str, deploy=None, int8: bool = True) -> str:
    """A hand-written whole-detector export directory: ``export.json`` whose ``latency``
    records ``deploy`` (``(runtime, precision)``; None: not timed) as
    ``tools/export_onnx.py --latency`` writes it, and empty artifact files (choosing the form
    checks that they exist; nothing here opens them)."""
    out = root / name
    (out / 'openvino').mkdir(parents=True)
    for path in ('model.onnx', 'openvino/model.xml') + (
            ('model_int8.onnx', 'openvino/model_int8.xml') if int8 else ()):
        (out / path).write_bytes(b'')
    info = whole_detector_info()
    if deploy is not None:
        runtime, precision = deploy
        info['latency'] = dict(shape='800x1333', median_ms={f'{runtime} {precision}': 300.0},
                               deploy=dict(runtime=runtime, precision=precision,
                                           median_ms=300.0, reason='measured'))
    (out / 'export.json').write_text(json.dumps(info))
    return str(out)


def test_backend_defaults_to_the_deployed_form(tmp_path, capsys):
    """tools/test.py --export-dir DIR evaluates the deployed form export.json records (no
    --backend, or --backend deployed), says so and records it for metrics.json; --backend
    and --precision choose another; an export that was not timed runs onnxruntime fp32, or
    is an error for --backend deployed; a deployed INT8 form whose artifact is missing falls
    back to fp32. Command-line parsing only: nothing runs."""
    tool = load_tool('test')
    base = ['cfg.py', 'ckpt.pth']
    timed = timed_export(tmp_path, 'timed', ('openvino', 'int8'))
    untimed = timed_export(tmp_path, 'untimed')

    def form(*extra):
        args = tool.parse_args(base + list(extra))
        return args.backend, args.precision, args.form.source

    line = ('deployed form from export.json: openvino int8 (chosen by tools/export_onnx.py '
            '--latency 800x1333); --backend/--precision choose another')
    for extra in ([], ['--backend', 'deployed']):
        args = tool.parse_args(base + ['--export-dir', timed] + extra)
        assert (args.backend, args.precision, args.int8) == ('openvino', 'int8', True)
        assert args.form.note == line
        assert tool.form_report(args) == dict(
            form_source='export.json', deployed_form=dict(runtime='openvino', precision='int8'))
    assert form('--export-dir', timed, '--backend', 'openvino') == \
        ('openvino', 'int8', 'export.json')
    assert form('--export-dir', timed, '--backend', 'onnxruntime') == \
        ('onnxruntime', 'fp32', 'command line')
    assert form('--export-dir', timed, '--precision', 'fp32') == \
        ('openvino', 'fp32', 'command line')
    assert form('--export-dir', timed, '--backend', 'onnxruntime', '--int8') == \
        ('onnxruntime', 'int8', 'command line')
    assert tool.parse_args(base + ['--export-dir', timed, '--backend', 'onnxruntime']
                           ).form.note == (
        'running onnxruntime fp32 as --backend says; the deployed form in export.json is '
        'openvino int8 (chosen by tools/export_onnx.py --latency 800x1333)')
    assert tool.form_report(tool.parse_args(base)) == {}  # PyTorch

    # not timed: onnxruntime fp32 by default, an error where the deployed form is asked for
    args = tool.parse_args(base + ['--export-dir', untimed])
    assert (args.backend, args.precision, args.form.source) == ('onnxruntime', 'fp32', 'default')
    assert 'export.json records no deployed form' in args.form.note
    assert tool.form_report(args) == dict(form_source='default', deployed_form=None)
    msg = exit_message(capsys, tool.parse_args,
                       base + ['--backend', 'deployed', '--export-dir', untimed])
    assert 'records no deployed form (latency.deploy' in msg and '--latency HxW' in msg
    assert 'name the runtime instead: --backend onnxruntime or openvino' in msg

    # the deployed INT8 artifact missing: fp32 of the deployed runtime, said
    no_int8 = timed_export(tmp_path, 'no_int8', ('openvino', 'int8'), int8=False)
    args = tool.parse_args(base + ['--export-dir', no_int8])
    assert (args.backend, args.precision, args.form.source) == ('openvino', 'fp32', 'fallback')
    assert 'model_int8.xml does not exist (exported without --int8): running openvino fp32' \
        in args.form.note

    # bad input names the valid choices
    msg = exit_message(capsys, tool.parse_args, base + ['--backend', 'deployed'])
    assert '--backend deployed needs --export-dir' in msg
    msg = exit_message(capsys, tool.parse_args,
                       base + ['--backend', 'pytorch', '--export-dir', timed])
    assert '--export-dir needs a runtime backend: --backend deployed, onnxruntime, openvino' \
        in msg
    msg = exit_message(capsys, tool.parse_args, base + ['--backend', 'tensorrt'])
    assert "invalid choice: 'tensorrt'" in msg and "'deployed'" in msg
    msg = exit_message(capsys, tool.parse_args,
                       base + ['--export-dir', timed, '--backend', 'onnxruntime', '--bf16'])
    assert 'Valid with onnxruntime: fp32, int8, auto' in msg
    bad = timed_export(tmp_path, 'bad', ('tensorrt', 'fp16'))
    msg = exit_message(capsys, tool.parse_args, base + ['--export-dir', bad])
    assert 'latency.deploy must name a runtime and a precision it computes' in msg
    assert 'openvino: fp32, bf16, int8' in msg


def test_quantizer_ranges_must_be_finite():
    """``quantize_openvino`` hides NNCF's overflow warning (an empty tensor's statistics) and
    checks instead that every FakeQuantize range it produced is finite."""
    import openvino as ov
    import openvino.opset13 as ops

    from mmslab.deploy.quantize import check_quantizer_ranges

    def model(high):
        x = ops.parameter([1, 4], np.float32)
        low, high = ops.constant(np.float32(-1.0)), ops.constant(np.float32(high))
        return ov.Model([ops.fake_quantize(x, low, high, low, high, 256)], [x])

    assert check_quantizer_ranges(model(1.0)) == 1
    with pytest.raises(RuntimeError, match='not finite'):
        check_quantizer_ranges(model(np.inf))


class TokenMLP(torch.nn.Module):
    """A token MLP with a residual, as in a transformer block (``[1, 32, 8, 8]`` image ->
    ``[1, 64, 32]`` tokens); ``extra``: two bias-free layers after it, one of whose products
    is read twice."""

    def __init__(self, extra: bool = False):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
        self.extra = extra
        if extra:
            self.no_bias = torch.nn.Linear(32, 32, bias=False)
            self.shared = torch.nn.Linear(32, 32, bias=False)

    def forward(self, image):
        x = image.flatten(2).transpose(1, 2)
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        if not self.extra:
            return x
        y = self.shared(x)
        return self.no_bias(x) + y * (y + 0.5)


def quantized_token_mlp(tmp_path, extra: bool = False):
    """``run(name) -> (INT8 graph, its output, float reference output)``: :class:`TokenMLP`
    exported, quantized for onnxruntime (calibrated on 4 random images) and run on a fifth."""
    import onnx
    import onnxruntime as ort
    from mmslab.deploy import quantize
    torch.manual_seed(0)
    net = TokenMLP(extra).eval()
    path = str(tmp_path / 'block.onnx')
    torch.onnx.export(net, (torch.randn(1, 32, 8, 8), ), path, input_names=['image'],
                      dynamo=False, opset_version=18)
    calib = [np.random.RandomState(i).randn(1, 32, 8, 8).astype(np.float32) for i in range(4)]
    image = np.random.RandomState(9).randn(1, 32, 8, 8).astype(np.float32)
    with torch.no_grad():
        ref = net(torch.from_numpy(image)).numpy()

    def run(name, **kwargs):
        q = quantize.quantize_onnxruntime(path, str(tmp_path / name), calib, **kwargs)
        out = ort.InferenceSession(q, providers=['CPUExecutionProvider']).run(
            None, {'image': image})[0]
        return onnx.load(q).graph, out, ref
    return run


def relative_rms(out, ref) -> float:
    return float(np.sqrt(((out - ref) ** 2).mean() / (ref ** 2).mean()))


def test_onnxruntime_int8_keeps_weight_layer_outputs_float(tmp_path, monkeypatch):
    """INT8 for onnxruntime quantizes the inputs and weights of MatMul / Gemm layers but not
    their outputs (the kernel dequantizes them, ``MatMulIntegerToFloat``): on inputs it was
    not calibrated on, within INT8 error of the float graph and no further from it than
    with quantized outputs (one rounding fewer)."""
    from mmslab.deploy import quantize
    run = quantized_token_mlp(tmp_path)
    graph, out, ref = run('float_outputs.onnx')
    error = relative_rms(out, ref)
    producer = {o: n.op_type for n in graph.node for o in n.output}
    quantized_inputs = [producer.get(n.input[0]) for n in graph.node
                        if n.op_type == 'QuantizeLinear']
    assert quantized_inputs and not {'MatMul', 'Gemm'} & set(quantized_inputs)
    # both weight layers read a dequantized activation and a dequantized weight
    layers = [n for n in graph.node if n.op_type == 'MatMul']
    assert len(layers) == 2 and all(producer.get(i) == 'DequantizeLinear'
                                    for n in layers for i in n.input[:2])
    monkeypatch.setattr(quantize, 'FLOAT_OUTPUT_OPS', ())
    graph, out, _ = run('quantized_outputs.onnx')
    producer = {o: n.op_type for n in graph.node for o in n.output}
    assert any(producer.get(n.input[0]) == 'MatMul' for n in graph.node
               if n.op_type == 'QuantizeLinear')
    assert error < 0.02 and error <= relative_rms(out, ref)


@pytest.mark.parametrize('weight_bits', [None, 7])
def test_onnxruntime_int8_computes_what_its_graph_states(tmp_path, weight_bits):
    """The INT8 file onnxruntime runs gives the values its QDQ graph defines (onnx's
    reference evaluator, numpy), on this CPU whatever its ISA: x86 kernels without VNNI pair
    u8 x s8 products in 16 bits, which saturate (percent-level errors, 16 % on a backbone)
    with 8-bit weights, where an exact product is within float rounding. The quantization's
    own error, against the float graph, is far larger than that allowance. None: the bits
    this CPU needs; 7: the bits every x86 CPU computes exactly."""
    import onnx
    from onnx.reference import ReferenceEvaluator
    run = quantized_token_mlp(tmp_path, extra=True)
    graph, out, ref = run('int8.onnx', weight_bits=weight_bits)
    image = np.random.RandomState(9).randn(1, 32, 8, 8).astype(np.float32)
    model = onnx.load(str(tmp_path / 'int8.onnx'))
    for opset in model.opset_import:  # the evaluator implements (De)QuantizeLinear from 19 on,
        if opset.domain in ('', 'ai.onnx'):  # the same operators for these types
            opset.version = max(opset.version, 19)
    stated = ReferenceEvaluator(model).run(None, {'image': image})[0]
    quantization_error = relative_rms(stated, ref)
    assert 1e-3 < quantization_error < 0.03
    assert relative_rms(out, stated) < 1e-3, relative_rms(out, stated)


@pytest.mark.parametrize('dot_product', [True, False])
def test_onnxruntime_int8_weight_bits_follow_the_cpu(tmp_path, monkeypatch, dot_product):
    """INT8 weights for onnxruntime take 8 bits on a CPU with 8-bit dot products (VNNI,
    AMX) and 7 on one without (no pair of u8 x s8 products can saturate 16 bits); the file
    records them, and a file with 8-bit weights warns when opened on a CPU without."""
    import onnx
    from onnx import numpy_helper
    from mmslab.deploy.runtimes import INT8_WEIGHT_BITS_KEY, OnnxRuntimeModel
    from mmslab.utils import machine
    monkeypatch.setattr(machine, 'has_int8_dot_product', lambda: dot_product)
    run = quantized_token_mlp(tmp_path, extra=True)
    graph, _, _ = run('auto.onnx')
    weights = [numpy_helper.to_array(t) for t in graph.initializer
               if t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 2]
    assert len(weights) == 4  # fc1, fc2, shared, no_bias: symmetric per channel
    peak = max(int(np.abs(w.astype(np.int32)).max()) for w in weights)
    assert peak == (127 if dot_product else 64)
    props = {p.key: p.value for p in onnx.load(str(tmp_path / 'auto.onnx')).metadata_props}
    assert props[INT8_WEIGHT_BITS_KEY] == ('8' if dot_product else '7')
    run('eight.onnx', weight_bits=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        OnnxRuntimeModel(str(tmp_path / 'eight.onnx'))
        OnnxRuntimeModel(str(tmp_path / 'auto.onnx'))
    saturating = [w for w in caught if 'saturate' in str(w.message)]
    assert len(saturating) == (0 if dot_product else 1)
    if saturating:
        assert 'eight.onnx' in str(saturating[0].message)
    with pytest.raises(ValueError, match='valid: 7, 8'):
        run('six.onnx', weight_bits=6)


def test_onnxruntime_int8_residual_reads_the_float_stream(tmp_path, monkeypatch):
    """The residual Add of :class:`TokenMLP` reads the float tokens, not the 8-bit copy made for
    ``fc1`` (no ``DequantizeLinear`` pass for it, one rounding fewer): closer to the float
    graph than onnxruntime's own QDQ form of the same quantization."""
    from mmslab.deploy import quantize
    run = quantized_token_mlp(tmp_path)
    graph, out, ref = run('float_residual.onnx')
    producer = {o: n for n in graph.node for o in n.output}
    adds = [n for n in graph.node if n.op_type == 'Add']
    assert adds and all(producer[i].op_type != 'DequantizeLinear' for n in adds
                        for i in n.input if i in producer)
    # what is dequantized feeds the weight layers only
    dequantized = {n.output[0] for n in graph.node if n.op_type == 'DequantizeLinear'}
    assert dequantized and {n.op_type for n in graph.node
                            if dequantized & set(n.input)} == {'MatMul'}
    monkeypatch.setattr(quantize, 'read_float_where_float', lambda model: 0)
    graph, rounded_out, _ = run('rounded_residual.onnx')
    producer = {o: n for n in graph.node for o in n.output}
    assert any(producer[i].op_type == 'DequantizeLinear' for n in graph.node
               if n.op_type == 'Add' for i in n.input if i in producer)
    assert relative_rms(out, ref) < relative_rms(rounded_out, ref) < 0.02
    # graph_passes=False: the quantizer's file as it wrote it, the same numbers as without
    # this pass (and the other, which changes no number)
    monkeypatch.undo()
    graph, plain_out, _ = run('plain.onnx', graph_passes=False)
    assert np.array_equal(plain_out, rounded_out)
    producer = {o: n for n in graph.node for o in n.output}
    assert any(producer[i].op_type == 'DequantizeLinear' for n in graph.node
               if n.op_type == 'Add' for i in n.input if i in producer)


def test_onnxruntime_int8_moves_windows_as_8_bit_data(tmp_path, monkeypatch):
    """A tiny fused Swin (padded, shifted windows) quantized for onnxruntime: the window
    partition (append the padded token, gather) and the way back (heads to channels, token
    order) move 8-bit values, the quantizer reading the unpadded tokens; the outputs are
    bit-identical to onnxruntime's own placement of the same quantization (rounding commutes
    with moving values), on inputs of two other sizes too."""
    import onnx
    import onnxruntime as ort
    import mmslab
    from mmslab.deploy import quantize
    from mmslab.deploy.onnx_export import export_onnx
    from presets import build_swin
    torch.manual_seed(0)
    model = mmslab.reparameterize(build_swin('ReparamSwinTransformer', depths=(2, 2, 2, 2)).eval())
    path = str(tmp_path / 'swin.onnx')
    export_onnx(model, 'backbone', (40, 56), path, dynamic=True)  # 10x14 tokens: padded
    calib = [np.random.RandomState(i).randn(1, 3, 40, 56).astype(np.float32) for i in range(3)]
    images = [np.random.RandomState(9).randn(1, 3, *hw).astype(np.float32)
              for hw in ((40, 56), (52, 36), (64, 64))]

    def run(name):
        q = quantize.quantize_onnxruntime(path, str(tmp_path / name), calib)
        sess = ort.InferenceSession(q, providers=['CPUExecutionProvider'])
        return onnx.load(q).graph, [sess.run(None, {'image': x}) for x in images]

    graph, moved = run('moved.onnx')
    producer = {o: n for n in graph.node for o in n.output}
    elem = {v.name: v.type.tensor_type.elem_type for v in onnx.shape_inference.infer_shapes(
        onnx.load(str(tmp_path / 'moved.onnx'))).graph.value_info}
    quantized_from = [producer[n.input[0]].op_type for n in graph.node
                      if n.op_type == 'QuantizeLinear' and n.input[0] in producer]
    assert not set(quantized_from) & set(quantize.MOVE_OPS)
    u8 = onnx.TensorProto.UINT8
    gathers = [n for n in graph.node if n.op_type == 'Gather' and elem.get(n.output[0]) == u8]
    # each of the 8 blocks gathers its windows and its tokens back as 8-bit values
    assert len(gathers) >= 16
    monkeypatch.setattr(quantize, 'quantize_before_moves', lambda model: 0)
    graph, placed = run('placed.onnx')
    producer = {o: n for n in graph.node for o in n.output}
    assert any(producer[n.input[0]].op_type == 'Gather' for n in graph.node
               if n.op_type == 'QuantizeLinear' and n.input[0] in producer)
    for a, b in zip(moved, placed):
        for x, y in zip(a, b):
            assert np.array_equal(x, y)

def test_crop_size():
    from mmslab.engine.hooks.runtime_backend_hook import _crop_size
    # FPN levels of an 800-row export (strides 4..64), cropped for a 768-row input
    assert [_crop_size(768, 800, n) for n in (200, 100, 50, 25, 13)] == [192, 96, 48, 24, 12]
    assert [_crop_size(64, 96, n) for n in (24, 12, 6, 3, 2)] == [16, 8, 4, 2, 1]
    assert _crop_size(64, 96, 7) == 7  # no power-of-2 stride explains it: kept


def test_openvino_compiles_a_free_size_model_for_each_input_shape(tmp_path):
    """A free-size model runs fixed-size compiles of itself, the most recent kept, with the
    free-size model's outputs; a fixed-size model and ``sizes_kept=0`` run as exported."""
    pytest.importorskip('openvino')
    from mmslab.deploy.runtimes import OpenVINOModel, convert_to_openvino, open_model
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(8, 4, 3, stride=2, padding=1)).eval()
    paths = {}
    for kind, axes in (('free', {'image': {2: 'h', 3: 'w'}}), ('fixed', None)):
        onnx_path = str(tmp_path / f'{kind}.onnx')
        torch.onnx.export(net, (torch.randn(1, 3, 16, 24), ), onnx_path, input_names=['image'],
                          dynamic_axes=axes, dynamo=False, opset_version=18)
        paths[kind] = convert_to_openvino(onnx_path, str(tmp_path / kind))
    model = open_model(paths['free'], 'openvino', sizes_kept=2)
    free = OpenVINOModel(paths['free'], sizes_kept=0)
    images = [np.random.rand(1, 3, *hw).astype(np.float32)
              for hw in ((16, 24), (20, 12), (16, 24), (8, 8), (16, 24))]
    compiles = []
    for image in images:
        out = model(image)[0]
        with torch.no_grad():
            ref = net(torch.from_numpy(image)).numpy()
        assert out.shape == ref.shape and np.abs(out - ref).max() <= 1e-4
        assert np.abs(out - free(image)[0]).max() <= 1e-5
        assert model.run(image, model.output_names)[model.output_names[0]].shape == ref.shape
        compiles.append(model.compiles)
    # (16, 24) and (20, 12) compiled once each; (8, 8) pushes out (20, 12), not the
    # more recently used (16, 24)
    assert compiles == [1, 2, 2, 3, 3]
    assert list(model._fixed) == [(1, 3, 8, 8), (1, 3, 16, 24)]
    assert free.compiles == 0
    fixed = open_model(paths['fixed'], 'openvino')
    fixed(images[0])
    assert fixed.sizes_kept == 0 and fixed.compiles == 0 and fixed.input_hw == (16, 24)
    with pytest.raises(ValueError, match='sizes_kept=-1'):
        OpenVINOModel(paths['free'], sizes_kept=-1)


def test_openvino_int8_runs_the_linear_attention_key_value_product_in_int8(tmp_path):
    """SLA's ``K^T V`` reaches OpenVINO's integer kernels. The keys feed MatMuls only (the
    normalizer sums them with a masked ``ReduceSum``): with the keys also in a product with
    the float valid mask, OpenVINO dequantized them and ran ``K^T V`` in fp32. And V feeds
    ``K^T V`` and the float depth-wise conv only (NNCF leaves group convolutions alone):
    with the DWC quantized too, V's one quantizer had to suit an integer convolution and
    ``K^T V``, and both ran in fp32. What mmslab's graph decides (both operands of ``K^T V``
    quantized, V's quantizer read by no convolution) is checked on every CPU, and so is the
    output against the float model; the kernel OpenVINO then picks is checked where the CPU
    has 8-bit dot products (VNNI, AMX): without them OpenVINO may compute in float."""
    pytest.importorskip('nncf')
    import mmslab
    from presets import build_preset
    from mmslab.deploy import export_onnx
    from mmslab.deploy.quantize import quantize_openvino
    from mmslab.deploy.runtimes import convert_to_openvino, import_openvino, openvino_config
    from mmslab.utils.machine import has_int8_dot_product
    torch.manual_seed(0)
    model = build_preset('SLABSwin', depths=(2, 1, 1, 1))  # stage 1: SLA, then shifted SLA
    model.init_weights()
    mmslab.reparameterize(model)
    model.eval()
    shape = (64, 72)  # stage 1: 16 x 18 tokens, windows of 8: cropped and padded groups
    onnx_path = str(tmp_path / 'slab.onnx')
    export_onnx(model, 'backbone', shape, onnx_path, dynamic=True, runtime='openvino')
    xml = convert_to_openvino(onnx_path, str(tmp_path / 'ov'))
    calibration = [np.random.RandomState(i).randn(1, 3, *shape).astype(np.float32)
                   for i in range(2)]
    int8 = quantize_openvino(xml, str(tmp_path / 'ov' / 'model_int8.xml'), calibration)
    ov = import_openvino()
    core = ov.Core()
    net = core.read_model(int8)

    def quantizer_behind(output):
        node = output.get_node()
        while node.get_type_name() in ('Reshape', 'Transpose', 'Squeeze', 'Unsqueeze'):
            node = node.input_value(0).get_node()
        return node if node.get_type_name() == 'FakeQuantize' else None

    products = [op for op in net.get_ordered_ops() if op.get_type_name() == 'MatMul' and
                all(quantizer_behind(op.input_value(i)) is not None for i in range(2))]
    key_value_quantizers = [quantizer_behind(op.input_value(1)) for op in products
                            if op.get_input_partial_shape(0) == op.get_input_partial_shape(1)
                            or op.get_attributes().get('transpose_a')]
    assert key_value_quantizers, 'no K^T V product with both operands quantized'
    for fq in key_value_quantizers:  # V's quantizer reaches no convolution
        pending = list(fq.output(0).get_target_inputs())
        while pending:
            node = pending.pop().get_node()
            assert 'Convolution' not in node.get_type_name(), node.get_friendly_name()
            if node.get_type_name() in ('Reshape', 'Transpose', 'Squeeze', 'Unsqueeze'):
                pending.extend(node.output(0).get_target_inputs())
    net.reshape([1, 3, *shape])  # as OpenVINOModel compiles a free-size model
    compiled = core.compile_model(net, 'CPU', openvino_config(threads=1))
    image = np.random.RandomState(7).randn(1, 3, *shape).astype(np.float32)
    with torch.no_grad():  # stage 1's output: SLA's (a random model amplifies the INT8
        ref = model(torch.from_numpy(image))[0].numpy()  # error stage by stage)
    out = compiled([image])[compiled.outputs[0]]
    assert out.shape == ref.shape and relative_rms(out, ref) < 0.1
    if not has_int8_dot_product():
        return
    key_value = []
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if info['layerType'].astype(str) == 'MatMul' and op.get_input_size() == 2 and \
                op.input(0).get_partial_shape() == op.input(1).get_partial_shape():
            key_value.append(info['runtimePrecision'].astype(str))
    assert key_value and all(p in ('u8', 'i8') for p in key_value), key_value
