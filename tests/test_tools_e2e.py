"""End-to-end tests of tools/train.py, tools/test.py and the safe loader (tools/dist_train.sh:
test_distributed.py).

Everything runs on tiny models (ResNet-18 with 16 base channels), tiny synthetic images
(96 px COCO, 64 px ADE20K) and 2-3 iterations, so the whole file takes a few minutes on 2 CPU
cores. The tools run as subprocesses of ``sys.executable`` from a temporary working directory.
"""
import json
import os
import os.path as osp
import pickle
import re
import sys

import numpy as np
import pytest
import torch

# re-exported: test_deploy and test_distributed import these from here
from tool_runs import (  # noqa: F401
    REPO_ROOT, TOOLS, METRICS_PREFIX, BN, MEAN, STD, run_tool, write_config, parse_metrics,
    free_port, runtime_cfg, det_config, seg_config, tiny_prepbn_swin_config, demo_data)


@pytest.fixture(scope='module')
def trained(demo_data, tmp_path_factory):  # noqa: F811
    """Configs trained for 2 iterations with tools/train.py, built lazily per task."""
    cache = {}

    def get(task):
        if task not in cache:
            root = tmp_path_factory.mktemp(f'{task}_run')
            work_dir = root / 'work_dir'
            make_cfg = det_config if task == 'det' else seg_config
            config = write_config(root / f'tiny_{task}.py',
                                  make_cfg(demo_data[task], work_dir))
            output = run_tool([sys.executable, osp.join(TOOLS, 'train.py'), config], cwd=root)
            cache[task] = dict(root=root, config=config, work_dir=work_dir, output=output)
        return cache[task]

    return get


# ----------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------

def test_compiled_ops_nms_and_roi_align():
    from mmcv.ops import nms, roi_align
    boxes = torch.tensor([[0., 0., 10., 10.], [1., 1., 11., 11.], [20., 20., 30., 30.]])
    scores = torch.tensor([0.9, 0.8, 0.7])
    dets, keep = nms(boxes, scores, iou_threshold=0.5)
    assert keep.tolist() == [0, 2], 'nms must suppress the box overlapping the best one'
    assert torch.allclose(dets[:, 4], torch.tensor([0.9, 0.7]))
    assert torch.allclose(dets[:, :4], boxes[[0, 2]])

    # a linear ramp is reproduced exactly by bilinear sampling: the bin average is the mean
    feat = torch.arange(16, dtype=torch.float32).reshape(1, 1, 4, 4)
    out = roi_align(feat, torch.tensor([[0., 0., 0., 4., 4.]]), (1, 1), 1.0, 2, 'avg', True)
    assert out.shape == (1, 1, 1, 1)
    assert out.item() == pytest.approx(7.5)

    # and agrees with torchvision's reference implementation on random input
    import torchvision
    gen = torch.Generator().manual_seed(0)
    feat = torch.rand(2, 3, 16, 16, generator=gen)
    rois = torch.tensor([[0, 1.0, 2.0, 20.0, 25.0], [1, 4.0, 0.0, 30.0, 12.0]])
    ours = roi_align(feat, rois, (5, 5), 0.5, 2, 'avg', True)
    ref = torchvision.ops.roi_align(feat, rois, (5, 5), spatial_scale=0.5, sampling_ratio=2,
                                    aligned=True)
    assert torch.allclose(ours, ref, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize('task', ['det', 'seg'])
def test_train_writes_checkpoint(trained, task):
    run = trained(task)
    work_dir = run['work_dir']
    ckpt = work_dir / 'iter_2.pth'
    assert ckpt.is_file(), f'no checkpoint in {work_dir}: {os.listdir(work_dir)}'
    assert (work_dir / 'last_checkpoint').read_text().strip() == str(ckpt)
    assert 'Iter(train) [2/2]' in run['output']
    # validation ran at the end of training
    key = 'coco/bbox_mAP' if task == 'det' else 'mIoU'
    assert re.search(r'(Iter|Epoch)\(val\).*' + re.escape(key), run['output'])


@pytest.mark.slow
@pytest.mark.parametrize('task', ['det', 'seg'])
def test_resume_continues_from_saved_state(trained, task):
    from mmslab.utils.checkpoint import load_checkpoint_file
    run = trained(task)
    work_dir = run['work_dir']
    first = load_checkpoint_file(str(work_dir / 'iter_2.pth'))
    assert first['meta']['iter'] == 2
    assert all(int(s['step']) == 2 for s in first['optimizer']['state'].values())

    output = run_tool([sys.executable, osp.join(TOOLS, 'train.py'), run['config'], '--resume',
                       '--cfg-options', 'train_cfg.max_iters=3'], cwd=run['root'])
    assert re.search(r'resumed epoch: \d+, iter: 2\b', output), output[-3000:]
    assert 'Iter(train) [3/3]' in output
    assert 'Iter(train) [1/3]' not in output, 'the resumed run restarted from iteration 0'

    ckpt = work_dir / 'iter_3.pth'
    assert (work_dir / 'last_checkpoint').read_text().strip() == str(ckpt)
    resumed = load_checkpoint_file(str(ckpt))
    assert resumed['meta']['iter'] == 3
    # AdamW's per-parameter step counts continue from the saved optimizer state (3, not 1)
    steps = {int(s['step']) for s in resumed['optimizer']['state'].values()}
    assert steps == {3}, steps
    assert len(resumed['optimizer']['state']) == len(first['optimizer']['state'])
    # so does the LR scheduler
    assert first['param_schedulers'][0]['_global_step'] == 2
    assert resumed['param_schedulers'][0]['_global_step'] == 3


def first_run_val_metrics(work_dir, key: str) -> dict:
    """The validation metrics that the first training run in ``work_dir`` logged (its one
    validation, at the end; mmengine's ``<timestamp>/vis_data/scalars.json``, unrounded),
    without the timing entries. Later runs (the resume test's) log in newer directories."""
    first = sorted(work_dir.glob('*/vis_data/scalars.json'))[0]
    found = [json.loads(line) for line in first.read_text().splitlines()]
    found = [{k: v for k, v in r.items() if k not in ('step', 'time', 'data_time')}
             for r in found if key in r]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.slow
@pytest.mark.parametrize('task', ['det', 'seg'])
def test_test_tool_reports_metrics(trained, task, tmp_path):
    """tools/test.py on the iteration-2 checkpoint reports exactly the metrics the training
    run's validation computed with the same weights on the same (val = test) split."""
    run = trained(task)
    ckpt = run['work_dir'] / 'iter_2.pth'
    output = run_tool([sys.executable, osp.join(TOOLS, 'test.py'), run['config'], str(ckpt),
                       '--work-dir', str(tmp_path / 'test_work_dir')], cwd=tmp_path)
    assert 'Load checkpoint from' in output
    metrics = parse_metrics(output)
    keys = ['coco/bbox_mAP', 'coco/segm_mAP'] if task == 'det' else ['mIoU', 'aAcc']
    validated = first_run_val_metrics(run['work_dir'], keys[0])
    assert set(keys) <= set(validated) <= set(metrics), (validated, metrics)
    assert {k: metrics[k] for k in validated} == validated
    # the rest of the line says what was evaluated
    assert {k: metrics[k] for k in set(metrics) - set(validated)} == dict(
        backend='pytorch', precision='fp32', precision_requested='fp32', bf16=False,
        int8=False)


@pytest.mark.slow  # trains for its checkpoint
def test_safe_loader_loads_runner_checkpoint(trained):
    from mmengine.logging import HistoryBuffer
    from mmengine.runner.checkpoint import CheckpointLoader, _load_checkpoint

    import mmslab.utils.checkpoint as safe
    safe.install()
    safe.install()  # idempotent
    assert CheckpointLoader._schemes[''] is safe.load_from_local

    ckpt = str(trained('det')['work_dir'] / 'iter_2.pth')
    # torch's plain weights-only load refuses a Runner checkpoint...
    with pytest.raises(pickle.UnpicklingError):
        torch.load(ckpt, map_location='cpu', weights_only=True)
    # ...the allow-listed loader reads it, directly and through mmengine
    for loaded in (safe.load_checkpoint_file(ckpt), _load_checkpoint(ckpt, map_location='cpu')):
        assert {'meta', 'state_dict', 'message_hub', 'optimizer'} <= set(loaded)
        buffers = loaded['message_hub']['log_scalars']
        assert buffers and all(isinstance(b, HistoryBuffer) for b in buffers.values())
        assert np.isfinite(buffers['train/loss'].mean())
    assert HistoryBuffer not in torch.serialization.get_safe_globals(), \
        'the allow-list must not leak out of the call'

    # init_cfg=dict(type='Pretrained') goes through the same loader
    from mmdet.models.backbones import ResNet
    backbone = ResNet(depth=18, base_channels=16, stem_channels=16, norm_eval=False,
                      init_cfg=dict(type='Pretrained', checkpoint=ckpt, prefix='backbone.'))
    backbone.init_weights()
    state = loaded['state_dict']
    for name, value in backbone.state_dict().items():
        assert torch.equal(value, state['backbone.' + name]), name


_CALLED = []


def _side_effect(*args):
    _CALLED.append(args)
    return 'executed'


class _Payload:
    """Unpickling this would call _side_effect: a stand-in for arbitrary code."""

    def __reduce__(self):
        return _side_effect, ('pwned', )


class _Plain:

    def __init__(self):
        self.x = 1


def test_safe_loader_refuses_pickled_objects(tmp_path):
    from mmengine.runner.checkpoint import _load_checkpoint

    from mmslab.utils.checkpoint import load_checkpoint_file

    cases = {
        'payload': ({'state_dict': {}, 'meta': _Payload()}, '_side_effect'),
        'instance': ({'state_dict': {}, 'meta': _Plain()}, '_Plain'),
        'object_array': ({'meta': np.array([_Plain()], dtype=object)}, 'ObjectDType'),
    }
    for name, (obj, type_name) in cases.items():
        path = tmp_path / f'{name}.pth'
        torch.save(obj, path)
        # strict: refused like torch's weights-only load
        with pytest.raises(pickle.UnpicklingError) as err:
            load_checkpoint_file(str(path), ignore_foreign=False)
        message = str(err.value)
        assert 'weights_only' in message.lower() or 'weights only' in message.lower()
        assert type_name in message, (name, message[-500:])
        # default (and mmengine's loader): the foreign entry is dropped, nothing is executed
        # (tests/test_foreign_checkpoints.py)
        for loader in (load_checkpoint_file, _load_checkpoint):
            assert 'meta' not in loader(str(path))
    assert _CALLED == [], 'the refused checkpoint executed code'

    # getattr is only allowed to fetch HistoryBuffer's statistics methods
    class _Getattr:

        def __reduce__(self):
            return getattr, (np.ndarray, 'tofile')

    path = tmp_path / 'getattr.pth'
    torch.save({'meta': _Getattr()}, path)
    with pytest.raises(pickle.UnpicklingError, match='tofile'):
        load_checkpoint_file(str(path))
    with pytest.raises(pickle.UnpicklingError, match='tofile'):
        _load_checkpoint(str(path))

    # a plain state dict still loads
    path = tmp_path / 'plain.pth'
    torch.save({'w': torch.ones(2), 'n': np.float64(2.5), 'a': np.arange(3)}, path)
    loaded = load_checkpoint_file(str(path))
    assert torch.equal(loaded['w'], torch.ones(2)) and loaded['n'] == 2.5
    assert loaded['a'].tolist() == [0, 1, 2]


def test_summarize_run_shows_the_deployed_forms(tmp_path, capsys):
    """tools/summarize_run.py on a work dir as tools/demo.sh fills it: the deployed model's
    metrics and demo-image latency (deployed_*/) and the export's whole-model latency
    (export/export.json) are printed, in summary.json and drawn in summary.png."""
    from conftest import load_tool
    work = tmp_path / 'work'
    run = work / '20250101_000000' / 'vis_data'
    run.mkdir(parents=True)
    records = [dict(iter=i, loss=2.0 - i / 100, lr=1e-4, step=i) for i in range(1, 4)] + [
        {'coco/bbox_mAP': 0.588, 'coco/segm_mAP': 0.694, 'step': 0}]
    (run / 'scalars.json').write_text('\n'.join(json.dumps(r) for r in records) + '\n')

    def latency(median, unfused=None, **extra):
        out = dict(fused=dict(count=50, median_ms=median, p90_ms=median * 1.1,
                              images_per_s=1000 / median), **extra)
        if unfused:
            out['unfused'] = dict(count=50, median_ms=unfused)
            out['speedup_median'] = unfused / median
        return out

    (work / 'latency.json').write_text(json.dumps(latency(150.0, 224.5, timed='fused')))
    (work / 'export').mkdir()
    ms = {'eager fp32': 2461.0, 'onnxruntime fp32': 1900.0, 'onnxruntime int8': 1300.0,
          'openvino fp32': 1500.0, 'openvino int8': 600.0}
    (work / 'export' / 'export.json').write_text(json.dumps(dict(
        schema_version=1, part='model', task='instance_segmentation',
        outputs=['dets', 'labels', 'masks'], shape=[800, 1344], dynamic=True,
        latency=dict(shape='800x1333', input=[800, 1344], repeat=3, median_ms=ms,
                     deploy=dict(runtime='openvino', precision='int8', median_ms=600.0,
                                 reason='openvino int8 600 ms runs 2.50x as fast as openvino '
                                        'fp32')))))
    deployed = work / 'deployed_openvino_int8'
    deployed.mkdir()
    (deployed / 'metrics.json').write_text(json.dumps(
        {'coco/bbox_mAP': 0.587, 'coco/segm_mAP': 0.691, 'backend': 'openvino'}))
    (deployed / 'latency.json').write_text(json.dumps(
        latency(65.2, 224.5, timed='deployed: openvino int8 whole model')))

    summary = load_tool('summarize_run').main([str(work), '--elapsed', '780'])
    out = capsys.readouterr().out
    assert 'deployed   whole model 800x1333: eager fp32 2461 ms, ' in out
    assert 'openvino int8 600 ms (4.10x)' in out
    assert ('deployed   chosen: openvino int8 (openvino int8 600 ms runs 2.50x as fast as '
            'openvino fp32)') in out
    assert ('deployed   openvino_int8      coco/bbox_mAP 0.587, coco/segm_mAP 0.691 '
            '(fused PyTorch 0.588, 0.694)') in out
    assert ('deployed   openvino_int8      latency per image: median 65.2 ms (deployed: '
            'openvino int8 whole model), unfused PyTorch 224.5 ms (3.44x)') in out
    assert summary['deployed']['latency']['median_ms'] == ms
    assert summary['deployed']['openvino_int8'] == {
        'coco/bbox_mAP': 0.587, 'coco/segm_mAP': 0.691,
        'latency': dict(timed='deployed: openvino int8 whole model', median_ms=65.2,
                        unfused_median_ms=224.5, images=50)}
    assert json.loads((work / 'summary.json').read_text())['deployed'] == summary['deployed']
    import matplotlib.image
    height, width = matplotlib.image.imread(str(work / 'summary.png')).shape[:2]
    # loss, demo-image latency (with the deployed model), the deployed whole model:
    # 3 panels of 5.5 x 4.5 inches at 100 dpi
    assert (width, height) == (1650, 450)
