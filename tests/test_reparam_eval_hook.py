"""ReparamEvalHook inside a real mmengine Runner: fused evaluation, latency, safe checkpoints."""
import copy
import glob
import json
import uuid
import os.path as osp

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook

import mmslab  # noqa: F401 (registers the models)
from conftest import wrong_fold
from mmslab.datasets.demo_data import make_ade_demo, make_coco_demo
from mmslab.engine.hooks import ReparamEvalHook
from mmslab.models import statistic_modules
from mmslab.models.layers import PRepBN

BACKBONE = dict(type='PRepBNSwin', embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                window_size=4, drop_path_rate=0.0, norm_cfg=dict(type='PRepBN', step=3))


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp('hookdata')
    make_ade_demo(str(root / 'ade'), num_train=4, num_val=3, img_size=64, seed=1, progress=False)
    make_coco_demo(str(root / 'coco'), num_train=4, num_val=3, img_size=64, seed=1,
                   progress=False)
    return root


def seg_cfg(data_dir, work_dir, hook=None):
    data_root = str(data_dir / 'ade' / 'ADEChallengeData2016')
    train_pipeline = [
        dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', reduce_zero_label=True),
        dict(type='Resize', scale=(64, 64), keep_ratio=False), dict(type='PackSegInputs')]
    test_pipeline = train_pipeline

    def loader(split, pipeline, shuffle):
        return dict(batch_size=2, num_workers=0, sampler=dict(type='DefaultSampler',
                                                              shuffle=shuffle),
                    dataset=dict(type='ADE20KDataset', data_root=data_root,
                                 data_prefix=dict(img_path=f'images/{split}',
                                                  seg_map_path=f'annotations/{split}'),
                                 pipeline=pipeline))

    return dict(
        default_scope='mmseg', work_dir=str(work_dir), randomness=dict(seed=0),
        # unique: mmengine keys the default scope by experiment name (second resolution)
        experiment_name=f'seg_{uuid.uuid4().hex}',
        model=dict(
            type='EncoderDecoder',
            data_preprocessor=dict(type='SegDataPreProcessor', mean=[123.675, 116.28, 103.53],
                                   std=[58.395, 57.12, 57.375], bgr_to_rgb=True, pad_val=0,
                                   seg_pad_val=255, size=(64, 64)),
            backbone=BACKBONE,
            decode_head=dict(type='FCNHead', in_channels=128, in_index=3, channels=16,
                             num_convs=1, num_classes=150, norm_cfg=dict(type='BN'),
                             align_corners=False,
                             loss_decode=dict(type='CrossEntropyLoss', loss_weight=1.0)),
            test_cfg=dict(mode='whole')),
        train_dataloader=loader('training', train_pipeline, True),
        val_dataloader=loader('validation', test_pipeline, False),
        val_evaluator=dict(type='IoUMetric', iou_metrics=['mIoU']),
        train_cfg=dict(type='IterBasedTrainLoop', max_iters=2, val_interval=2),
        val_cfg=dict(type='ValLoop'),
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-3)),
        default_hooks=dict(checkpoint=dict(type='CheckpointHook', interval=2, by_epoch=False,
                                           save_best='aAcc', rule='greater'),
                           logger=dict(type='LoggerHook', interval=1)),
        custom_hooks=[dict(type='ProgressiveNormHook')] + ([hook] if hook else []),
        log_level='WARNING')


def test_hook_fuses_a_copy_and_saves_unfused_best_checkpoint(data_dir, tmp_path):
    from mmengine.runner import Runner
    from mmslab.utils.checkpoint import load_checkpoint_file
    cfg = seg_cfg(data_dir, tmp_path / 'run',
                  dict(type='ReparamEvalHook', compare_unfused=True, warmup=0))
    runner = Runner.from_cfg(Config(cfg))
    model_before = runner.model
    runner.train()
    assert runner.model is model_before  # the training model is back in place
    norms = [m for m in runner.model.modules() if isinstance(m, PRepBN)]
    assert norms and not any(m.deploy for m in norms)
    hook = next(h for h in runner.hooks if isinstance(h, ReparamEvalHook))
    assert hook.last_result['max_relative_difference'] < 1e-3
    with open(osp.join(runner.work_dir, 'latency.json')) as f:
        lat = json.load(f)
    for key in ('count', 'mean_ms', 'median_ms', 'p90_ms', 'images_per_s'):
        assert lat['fused'][key] > 0 and lat['unfused'][key] > 0
    assert lat['speedup_median'] > 0 and lat['mode'] == 'val'
    best = [p for p in (tmp_path / 'run').iterdir() if p.name.startswith('best_')]
    assert best, list((tmp_path / 'run').iterdir())
    state = load_checkpoint_file(str(best[0]))['state_dict']
    assert any(k.endswith('norm1.norm2.bn.running_mean') for k in state)
    from mmseg.registry import MODELS
    fresh = MODELS.build(cfg['model'])
    fresh.load_state_dict(state, strict=True)  # an unfused checkpoint


def test_a_validation_shorter_than_the_warmup_times_its_last_batch(data_dir, tmp_path):
    """3 validation images in batches of 2 and 1, default warmup 2: the second batch (one
    image) is timed, not none."""
    from mmengine.runner import Runner
    cfg = seg_cfg(data_dir, tmp_path / 'run', dict(type='ReparamEvalHook'))
    runner = Runner.from_cfg(Config(cfg))
    runner.train()
    with open(osp.join(runner.work_dir, 'latency.json')) as f:
        lat = json.load(f)
    assert lat['warmup_batches'] == 1 and lat['images'] == 1
    assert lat['fused']['count'] == 1 and lat['fused']['median_ms'] > 0
    with open(osp.join(runner.log_dir, f'{runner.timestamp}.log')) as f:
        assert 'warmup=2 batches, but this val has 2: the latency is of its last batch' \
            in f.read()


class EvaluatedModelProbe(Hook):
    """Records the model every validation batch ran on, and counts (by a forward hook) the
    calls of that model's backbone."""

    def __init__(self):
        self.models = []
        self.backbone_calls = 0

    def before_val_iter(self, runner, batch_idx, data_batch=None):
        if not self.models or self.models[-1] is not runner.model:
            runner.model.backbone.register_forward_hook(self._count)
        self.models.append(runner.model)

    def _count(self, module, inputs, output):
        self.backbone_calls += 1


def test_fused_and_unfused_metrics_are_equal(data_dir, tmp_path):
    from mmengine.runner import Runner
    results, probes, trained = {}, {}, {}
    for reparam in (True, False):
        cfg = seg_cfg(data_dir, tmp_path / f'r{reparam}',
                      dict(type='ReparamEvalHook', reparam=reparam, warmup=0))
        cfg['train_cfg'] = None
        cfg['optim_wrapper'] = None
        cfg['train_dataloader'] = None
        cfg['default_hooks'] = dict(logger=dict(type='LoggerHook', interval=1))
        runner = Runner.from_cfg(Config(cfg))
        probes[reparam] = EvaluatedModelProbe()
        runner.register_hook(probes[reparam], priority='LOW')
        trained[reparam] = runner.model
        with torch.no_grad():  # favour the demo's background classes so pixels score
            runner.model.decode_head.conv_seg.bias[[0, 2, 3, 9]] += 3.0
        results[reparam] = runner.val()
    assert results[True] == pytest.approx(results[False])
    assert results[True]['aAcc'] > 0
    # The fused run evaluated one fused copy on every batch: not the training model, no
    # normalization statistics left in its backbone, and its backbone ran for every batch.
    fused_runs, plain_runs = probes[True].models, probes[False].models
    assert len(fused_runs) == len(plain_runs) == 2  # 3 images, batches of 2
    assert all(m is fused_runs[0] for m in fused_runs) and fused_runs[0] is not trained[True]
    assert statistic_modules(fused_runs[0].backbone) == []
    fused_norms = [m for m in fused_runs[0].modules() if isinstance(m, PRepBN)]
    assert all(m.deploy for m in fused_norms)  # the unfolded output norm: an affine
    assert probes[True].backbone_calls >= len(fused_runs)
    # The reference run evaluated the training model itself, PRepBN and all.
    assert all(m is trained[False] for m in plain_runs)
    assert any(isinstance(m, PRepBN) and not m.deploy for m in plain_runs[0].modules())


def break_a_fused_linear(monkeypatch):
    import mmslab.engine.hooks.reparam_eval_hook as hook_mod
    # (the name the hook calls)
    monkeypatch.setattr(hook_mod, 'reparameterize', wrong_fold(hook_mod.reparameterize, 1, 1.5))


def test_equivalence_check_names_the_divergent_module(data_dir, tmp_path, monkeypatch):
    from mmengine.runner import Runner
    break_a_fused_linear(monkeypatch)
    cfg = seg_cfg(data_dir, tmp_path / 'bad', dict(type='ReparamEvalHook', on_mismatch='raise'))
    cfg.update(train_cfg=None, optim_wrapper=None, train_dataloader=None,
               default_hooks=dict(logger=dict(type='LoggerHook', interval=1)))
    runner = Runner.from_cfg(Config(cfg))
    with pytest.raises(RuntimeError, match='differs') as err:
        runner.val()
    assert 'Linear' in str(err.value) and 'stages.1.blocks.0.attn' in str(err.value)


def test_a_failed_fusion_check_does_not_stop_training(data_dir, tmp_path, monkeypatch):
    """In a training run's validation a wrong fold is logged as an error naming the module;
    the validation evaluates the unfused model (the metrics of a run without fusion), and
    training goes on to its end and saves its checkpoints. A test run still fails."""
    from mmengine.runner import Runner
    metrics = {}

    class Metrics(Hook):
        def __init__(self):
            self.metrics = []

        def after_val_epoch(self, runner, metrics=None):
            self.metrics.append(metrics)

    for name, hook in (('plain', dict(type='ReparamEvalHook', reparam=False, warmup=0)),
                       ('broken', dict(type='ReparamEvalHook', warmup=0))):
        if name == 'broken':
            break_a_fused_linear(monkeypatch)
        cfg = seg_cfg(data_dir, tmp_path / name, hook)
        cfg['train_cfg'] = dict(type='IterBasedTrainLoop', max_iters=4, val_interval=2)
        cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=2,
                                                  by_epoch=False)
        runner = Runner.from_cfg(Config(cfg))
        probe = Metrics()
        runner.register_hook(probe, priority='LOWEST')
        runner.train()
        metrics[name] = probe.metrics
        assert runner.iter == 4
        assert (tmp_path / name / 'iter_4.pth').exists()
    logs = glob.glob(str(tmp_path / 'broken' / '*' / '*.log'))
    with open(logs[0]) as f:
        errors = [line for line in f if ' - ERROR - ' in line]
    assert len(errors) == 2  # each validation checks again
    assert all('stages.1.blocks.0.attn' in e and 'training goes on' in e for e in errors)
    # the unfused model evaluated: the same metrics as the run that never fused, at both
    # validations (fusing draws no random numbers from the training's stream)
    assert len(metrics['broken']) == 2
    for broken, plain in zip(metrics['broken'], metrics['plain']):
        assert broken == pytest.approx(plain)
    with open(tmp_path / 'broken' / 'latency.json') as f:
        lat = json.load(f)
    assert lat['fusion_check']['result'] == 'failed'
    assert lat['timed'].startswith('unfused') and lat['max_relative_difference'] > 1e-3
    # a test run (tools/test.py's path) fails on the same fold
    cfg = _eval_only(seg_cfg(data_dir, tmp_path / 'test', dict(type='ReparamEvalHook')))
    cfg.update(test_dataloader=cfg['val_dataloader'], test_evaluator=cfg['val_evaluator'],
               test_cfg=dict(type='TestLoop'))
    with pytest.raises(RuntimeError, match='differs'):
        Runner.from_cfg(Config(cfg)).test()


def test_the_fusion_check_computes_in_ieee_float32(data_dir, tmp_path, monkeypatch):
    """A process that lets float32 products run in lower precision (PyTorch's default TF32
    for cuDNN convolutions on a GPU, ``set_float32_matmul_precision('high')``) still gets a
    float32 comparison, and its settings are as they were afterwards, after an error inside
    too. The CPU has no TF32: a fused copy whose output moves by 2e-3 while a TF32 setting
    is on stands in for it (a correct fold that TF32 makes look wrong)."""
    from mmengine.runner import Runner
    import mmslab.engine.hooks.reparam_eval_hook as hook_mod
    from mmslab.utils.precision import ieee_float32
    backends = torch.backends
    if not hasattr(backends.cudnn.conv, 'fp32_precision'):
        pytest.skip('this torch has no per-backend float32 precision')

    def settings():
        return (backends.cuda.matmul.fp32_precision, backends.cudnn.conv.fp32_precision,
                backends.mkldnn.matmul.fp32_precision, torch.get_float32_matmul_precision())

    def reduced_precision_on() -> bool:
        return 'tf32' in settings() or torch.get_float32_matmul_precision() != 'highest'

    original = hook_mod.reparameterize

    def fold_under_tf32(model):
        model = original(model)
        proj = model.backbone.stages[1].blocks[0].attn.w_msa.proj
        proj.register_forward_hook(
            lambda m, i, out: out * (1 + 2e-3) if reduced_precision_on() else out)
        return model

    monkeypatch.setattr(hook_mod, 'reparameterize', fold_under_tf32)
    before = settings()
    try:
        torch.set_float32_matmul_precision('high')
        backends.cudnn.conv.fp32_precision = 'tf32'  # PyTorch's default
        reduced = settings()
        assert reduced_precision_on()
        with pytest.raises(ZeroDivisionError):
            with ieee_float32():
                assert not reduced_precision_on() and not torch.is_autocast_enabled('cpu')
                1 / 0
        assert settings() == reduced
        cfg = _eval_only(seg_cfg(data_dir, tmp_path / 'reduced',
                                 dict(type='ReparamEvalHook', on_mismatch='raise')))
        runner = Runner.from_cfg(Config(cfg))
        runner.val()  # the check compares in float32: the fold passes
        hook = next(h for h in runner.hooks if isinstance(h, ReparamEvalHook))
        assert hook.last_result['max_relative_difference'] < 1e-4
        assert hook.last_result['fusion_check']['result'] == 'passed'
        assert settings() == reduced
        # outside the check the stand-in does move the output: what the check is kept from
        data = runner.model.data_preprocessor(next(iter(runner.val_dataloader)), False)
        fused = fold_under_tf32(copy.deepcopy(runner.model).eval())
        with torch.no_grad():
            diff = hook_mod.max_relative_difference(
                hook_mod.comparable_outputs(runner.model.eval(), data),
                hook_mod.comparable_outputs(fused, data))
        assert diff > 1e-3
    finally:
        torch.set_float32_matmul_precision(before[3])
        (backends.cuda.matmul.fp32_precision, backends.cudnn.conv.fp32_precision,
         backends.mkldnn.matmul.fp32_precision) = before[:3]


def test_detector_test_loop_reports_coco_metrics_and_latency(data_dir, tmp_path):
    from mmengine.runner import Runner
    data_root = str(data_dir / 'coco') + '/'
    pipeline = [dict(type='LoadImageFromFile'),
                dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
                dict(type='Resize', scale=(64, 64), keep_ratio=True),
                dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape',
                                                      'img_shape', 'scale_factor'))]
    from mmslab.datasets.demo_data import COCO_DEMO_CLASSES
    cfg = dict(
        default_scope='mmdet', work_dir=str(tmp_path / 'det'),
        experiment_name=f'det_{uuid.uuid4().hex}',
        model=dict(
            type='RetinaNet',
            data_preprocessor=dict(type='DetDataPreprocessor', mean=[123.675, 116.28, 103.53],
                                   std=[58.395, 57.12, 57.375], bgr_to_rgb=True,
                                   pad_size_divisor=32),
            backbone=dict(BACKBONE, out_indices=(1, 2, 3)),
            neck=dict(type='FPN', in_channels=[32, 64, 128], out_channels=16, start_level=0,
                      add_extra_convs='on_output', num_outs=4),
            bbox_head=dict(type='RetinaHead', num_classes=len(COCO_DEMO_CLASSES),
                           in_channels=16, stacked_convs=1, feat_channels=16,
                           anchor_generator=dict(type='AnchorGenerator', octave_base_scale=4,
                                                 scales_per_octave=3, ratios=[0.5, 1.0, 2.0],
                                                 strides=[8, 16, 32, 64]),
                           bbox_coder=dict(type='DeltaXYWHBBoxCoder',
                                           target_means=[.0, .0, .0, .0],
                                           target_stds=[1.0, 1.0, 1.0, 1.0]),
                           loss_cls=dict(type='FocalLoss', use_sigmoid=True, gamma=2.0,
                                         alpha=0.25, loss_weight=1.0),
                           loss_bbox=dict(type='L1Loss', loss_weight=1.0)),
            test_cfg=dict(nms_pre=100, min_bbox_size=0, score_thr=0.0,
                          nms=dict(type='nms', iou_threshold=0.5), max_per_img=20)),
        test_dataloader=dict(batch_size=1, num_workers=0,
                             sampler=dict(type='DefaultSampler', shuffle=False),
                             dataset=dict(type='CocoDataset', data_root=data_root,
                                          metainfo=dict(classes=COCO_DEMO_CLASSES),
                                          ann_file='annotations/instances_val2017.json',
                                          data_prefix=dict(img='val2017/'), test_mode=True,
                                          pipeline=pipeline)),
        test_evaluator=dict(type='CocoMetric',
                            ann_file=data_root + 'annotations/instances_val2017.json',
                            metric='bbox'),
        test_cfg=dict(type='TestLoop'),
        custom_hooks=[dict(type='ReparamEvalHook', warmup=1, compare_unfused=True)],
        default_hooks=dict(logger=dict(type='LoggerHook', interval=1)), log_level='WARNING')
    runner = Runner.from_cfg(Config(cfg))
    metrics = runner.test()
    assert 'coco/bbox_mAP' in metrics
    with open(tmp_path / 'det' / 'latency.json') as f:
        lat = json.load(f)
    assert lat['mode'] == 'test' and lat['fused']['count'] == 2  # 3 images, 1 warm-up
    assert lat['unfused']['count'] == 2


def test_hook_validates_options():
    with pytest.raises(ValueError, match='warmup'):
        ReparamEvalHook(warmup=-1)
    with pytest.raises(TypeError):
        ReparamEvalHook(warmpu=3)
    with pytest.raises(ValueError, match="on_mismatch='warn'; valid: 'auto', 'raise', 'log'"):
        ReparamEvalHook(on_mismatch='warn')


def _eval_only(cfg):
    cfg.update(train_cfg=None, optim_wrapper=None, train_dataloader=None,
               default_hooks=dict(logger=dict(type='LoggerHook', interval=1)))
    return cfg


def test_hook_precision_times_fused_and_unfused_in_it(data_dir, tmp_path, monkeypatch):
    """precision='bf16': the fused copy and, for the ratio, the unfused model run their
    network parts in bf16 inside predict; the equivalence check stays float32; the training
    model is left without autocast regions; latency.json records device and precision."""
    from mmengine.runner import Runner
    from mmslab.utils import machine
    from mmslab.utils.precision import AutocastRegions
    monkeypatch.setattr(machine, 'cpu_flags', lambda: ['avx512f', 'amx_bf16'])
    cfg = _eval_only(seg_cfg(data_dir, tmp_path / 'bf16', dict(
        type='ReparamEvalHook', precision='bf16', compare_unfused=True, warmup=0)))
    runner = Runner.from_cfg(Config(cfg))
    model = runner.model
    seen = []  # the unfused (training) model's first conv (the fused copy inherits the hook)
    conv = next(m for m in model.backbone.modules() if isinstance(m, torch.nn.Conv2d))
    conv.register_forward_hook(lambda m, i, o: seen.append(o.dtype) if m is conv else None)
    runner.val()
    assert seen[0] == torch.float32  # the equivalence check
    assert set(seen[1:]) == {torch.bfloat16}  # the unfused model timed in bf16 too
    assert AutocastRegions.of(model) is None
    assert not any('forward' in vars(m) for m in model.modules())
    with open(tmp_path / 'bf16' / 'latency.json') as f:
        lat = json.load(f)
    assert lat['precision'] == 'bf16' and lat['device'] == 'cpu'
    assert lat['timing'] == 'perf_counter' and lat['max_relative_difference'] < 1e-3
    assert lat['machine']['cpu'] and 'gpu' not in lat['machine']
    assert lat['fused']['count'] == lat['unfused']['count'] == 3


def test_hook_times_with_cuda_events_and_records_the_gpu(data_dir, tmp_path, monkeypatch):
    """Where the model is on a CUDA device the hook times with the device (CUDA events) and
    latency.json records the GPU. The model stays on the CPU here: where it is and how a
    step is timed are faked, everything else runs."""
    from mmengine.runner import Runner
    import mmslab.engine.hooks.reparam_eval_hook as hook_mod
    from test_timing_devices import fake_gpu
    fake_gpu(monkeypatch)  # what torch.cuda says about the GPU ...
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)  # ... mmengine stays on CPU
    cuda0 = torch.device('cuda', 0)
    monkeypatch.setattr(hook_mod, 'module_device', lambda module: cuda0)
    devices = []

    def timed_ms(fn, device=None):
        devices.append(device)
        return fn(), 2.0

    monkeypatch.setattr(hook_mod, 'timed_ms', timed_ms)
    cfg = _eval_only(seg_cfg(data_dir, tmp_path / 'gpu', dict(
        type='ReparamEvalHook', compare_unfused=True, warmup=0)))
    Runner.from_cfg(Config(cfg)).val()
    assert devices == [cuda0] * 4  # 2 batches, fused and unfused
    with open(tmp_path / 'gpu' / 'latency.json') as f:
        lat = json.load(f)
    assert lat['device'] == 'cuda:0' and lat['timing'] == 'cuda_events'
    assert lat['precision'] == 'fp32'
    gpu = lat['machine']['gpu']
    assert gpu['name'] == 'NVIDIA H100 80GB HBM3' and gpu['driver'] == '570.124.06'
    assert gpu['cuda'] == '12.8' and gpu['cudnn'] == 91002
    assert gpu['compute_capability'] == '9.0' and gpu['memory_gib'] == 79.1
    assert lat['fused']['median_ms'] == 1.0  # 2 ms per batch of 2 images


def test_hook_precision_is_checked_against_the_device(monkeypatch):
    from types import SimpleNamespace
    from mmslab.utils import machine
    with pytest.raises(ValueError, match='ReparamEvalHook: precision .fp8.; valid: fp32, '
                       'fp16, bf16'):
        ReparamEvalHook(precision='fp8')
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match='ReparamEvalHook fp16 on the CPU'):
        ReparamEvalHook(precision='fp16').before_val_epoch(SimpleNamespace(model=model))
    monkeypatch.setattr(machine, 'cpu_flags', lambda: ['avx512f'])
    with pytest.raises(RuntimeError, match='ReparamEvalHook bf16: bf16 needs a CPU'):
        ReparamEvalHook(precision='bf16').before_test_epoch(SimpleNamespace(model=model))
    assert model.training  # refused before anything changed
