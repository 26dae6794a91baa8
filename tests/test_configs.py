"""Every config in configs/ (and configs/demo/): it loads, its model (shrunk to a tiny size)
trains one step, predicts and fuses; its schedule, norm schedule, hooks and data checks are
the documented ones.

New configs are picked up automatically (glob). Models are shrunk by overriding widths and
depths (the config's structure is kept: backbone type, norm, attention types, FFN type, heads);
inputs are 64x64, so the whole file takes about a minute on 2 CPU cores.
"""
import copy
import glob
import math
import os
import os.path as osp
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from mmengine.model import revert_sync_batchnorm
from mmengine.optim import build_optim_wrapper
from torch.nn.modules.batchnorm import _BatchNorm

import mmslab
from mmslab.engine.hooks.reparam_eval_hook import max_relative_difference
from mmslab.models.backbones.pvt import ReparamPVT
from mmslab.models.backbones.swin import ReparamSwinTransformer
from mmslab.models.layers import UN, FoldableNorm, PRepBN
from mmslab.utils import DataNotFoundError, check_data_root

from config_helpers import CONFIG_DIR, SIZE, load, registry, tiny_backbone_cfg

REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))

CONFIGS = sorted(glob.glob(osp.join(CONFIG_DIR, '*.py')) +
                 glob.glob(osp.join(CONFIG_DIR, 'demo', '*.py')))
DEMO_CONFIGS = [c for c in CONFIGS if osp.basename(osp.dirname(c)) == 'demo']
FULL_CONFIGS = [c for c in CONFIGS if c not in DEMO_CONFIGS]
VARIANTS = ('prepbn_swin_t', 'prepbn_swin_s', 'slab_swin_t', 'slab_swin_s', 'repa_swin_t',
            'repa_swin_s', 'repa_swin_b', 'prepbn_pvt_t', 'prepbn_pvt_s', 'un_swin_t', 'swin_t')
TASK_FILES = ('mask_rcnn_{}_1x.py', 'retinanet_{}_1x.py', 'upernet_{}_160k_ade20k.py')

# COCO train2017 images mmdet keeps with filter_empty_gt=True (118,287 in all).
COCO_TRAIN_IMAGES = 117266
NO_DECAY_KEYS = ('absolute_pos_embed', 'relative_position_bias_table', 'positional_encoding',
                 'pos_embed', 'alpha')
CH = 16  # neck / head channels of the tiny models


@pytest.fixture(scope='module', autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is much faster than two on a busy 2-core machine
    (two spin-waiting OpenMP threads made each model step ~20x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cid(path):
    return osp.relpath(path, CONFIG_DIR)


def task(cfg) -> str:
    return {'MaskRCNN': 'mask_rcnn', 'RetinaNet': 'retinanet',
            'EncoderDecoder': 'upernet'}[cfg.model.type]


def output_widths(backbone: nn.Module):
    with torch.no_grad():
        was_training = backbone.training
        outs = backbone.eval()(torch.zeros(1, 3, SIZE, SIZE))
        backbone.train(was_training)
    return [o.shape[1] for o in outs]


def tiny_model_cfg(cfg, models) -> dict:
    model = copy.deepcopy(cfg.model)
    model.backbone = tiny_backbone_cfg(model.backbone, models)
    widths = output_widths(models.build(copy.deepcopy(model.backbone)))
    kind = task(cfg)
    if kind in ('mask_rcnn', 'retinanet'):
        model.neck.update(in_channels=widths, out_channels=CH)
    if kind == 'mask_rcnn':
        model.rpn_head.update(in_channels=CH, feat_channels=CH)
        roi = model.roi_head
        roi.bbox_roi_extractor.out_channels = CH
        roi.mask_roi_extractor.out_channels = CH
        roi.bbox_head.update(in_channels=CH, fc_out_channels=32)
        roi.mask_head.update(in_channels=CH, conv_out_channels=CH, num_convs=1)
    elif kind == 'retinanet':
        model.bbox_head.update(in_channels=CH, feat_channels=CH, stacked_convs=1)
    else:
        model.data_preprocessor.size = (SIZE, SIZE)
        model.decode_head.update(in_channels=widths, channels=CH)
        model.auxiliary_head.update(in_channels=widths[model.auxiliary_head.in_index],
                                    channels=CH)
    return model


def num_classes(cfg) -> int:
    kind = task(cfg)
    if kind == 'mask_rcnn':
        return cfg.model.roi_head.bbox_head.num_classes
    if kind == 'retinanet':
        return cfg.model.bbox_head.num_classes
    return cfg.model.decode_head.num_classes


def fake_batch(cfg, n=2):
    """A training batch of ``n`` SIZE x SIZE images: mmdet's own demo batch (two boxes with
    masks per image) for detectors, random labels with ignored pixels for segmentors."""
    k = num_classes(cfg)
    if cfg.default_scope == 'mmdet':
        from mmdet.testing import demo_mm_inputs
        return demo_mm_inputs(batch_size=n, image_shapes=[(3, SIZE, SIZE)] * n,
                              num_items=[2] * n, num_classes=k, with_mask=True)
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, 256, (3, SIZE, SIZE), dtype=torch.uint8, generator=g)
              for _ in range(n)]
    samples = []
    for i in range(n):
        s = SegDataSample(metainfo=dict(img_shape=(SIZE, SIZE), ori_shape=(SIZE, SIZE),
                                        pad_shape=(SIZE, SIZE)))
        seg = torch.randint(0, k, (1, SIZE, SIZE), generator=g)
        seg[:, :4] = 255  # some ignored pixels
        s.gt_sem_seg = PixelData(data=seg)
        samples.append(s)
    return dict(inputs=inputs, data_samples=samples)


def variant_of(path) -> str:
    name = osp.basename(path)[:-3]
    for prefix in ('mask_rcnn_', 'retinanet_', 'upernet_'):
        if name.startswith(prefix):
            name = name[len(prefix):]
    for suffix in ('_1x', '_160k_ade20k'):
        if name.endswith(suffix):
            name = name[:-len(suffix)]
    return name


def hook_cfgs(cfg, name):
    return [h for h in cfg.get('custom_hooks', []) if h['type'] == name]


def total_train_iters(cfg) -> int:
    loop = cfg.train_cfg
    if loop.get('type', 'EpochBasedTrainLoop') == 'IterBasedTrainLoop':
        return loop.max_iters
    assert cfg.default_scope == 'mmdet', 'epoch-based schedules are COCO-only here'
    return loop.max_epochs * math.ceil(COCO_TRAIN_IMAGES / cfg.auto_scale_lr.base_batch_size)


# ----------------------------------------------------------------------------------------------
# the set of configs
# ----------------------------------------------------------------------------------------------

def test_every_variant_has_all_three_configs():
    names = {osp.basename(c) for c in FULL_CONFIGS}
    expected = {t.format(v) for t in TASK_FILES for v in VARIANTS}
    assert not expected - names, f'missing configs: {sorted(expected - names)}'
    for v in VARIANTS:
        assert osp.isfile(osp.join(CONFIG_DIR, '_base_', 'backbones', f'{v}.py'))
    assert {osp.basename(c) for c in DEMO_CONFIGS} >= {'mask_rcnn_slab_swin_t_demo.py',
                                                       'upernet_slab_swin_t_demo.py'}


# ----------------------------------------------------------------------------------------------
# build, one training step, one prediction, fusion (every config)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize('path', CONFIGS, ids=cid)
def test_tiny_model_trains_predicts_and_fuses(path):
    torch.manual_seed(0)
    cfg = load(path)
    models = registry(cfg)
    model = revert_sync_batchnorm(models.build(tiny_model_cfg(cfg, models)))
    model.init_weights()
    optim_wrapper = build_optim_wrapper(model, copy.deepcopy(cfg.optim_wrapper))
    check_weight_decay(model, optim_wrapper, cfg.optim_wrapper.optimizer.weight_decay)

    data = fake_batch(cfg)
    model.train()
    assert mmslab.set_progressive_iter(model, 1) >= 0
    log_vars = model.train_step(data, optim_wrapper)
    assert log_vars, 'no losses'
    for key, value in log_vars.items():
        assert torch.isfinite(torch.as_tensor(value)).all(), f'{key} = {value}'

    model.eval()
    with torch.no_grad():
        preds = model.test_step(data)
    assert len(preds) == len(data['inputs'])
    if task(cfg) == 'upernet':
        assert preds[0].pred_sem_seg.data.shape[-2:] == (SIZE, SIZE)
    else:
        assert 'pred_instances' in preds[0]
        if task(cfg) == 'mask_rcnn':
            assert 'masks' in preds[0].pred_instances

    # The fused model (what ReparamEvalHook evaluates) computes the same thing: the neck
    # features of a detector (its heads' outputs go through NMS, which amplifies rounding),
    # the logits of a segmentor (backbone output norms may fold into the decode head).
    hook = hook_cfgs(cfg, 'ReparamEvalHook')[0]
    inputs = model.data_preprocessor(data, False)['inputs']
    fused = mmslab.reparameterize(copy.deepcopy(model))
    run = (lambda m: m.extract_feat(inputs)) if cfg.default_scope == 'mmdet' else \
        (lambda m: m._forward(inputs))
    with torch.no_grad():
        diff = max_relative_difference(run(model), run(fused))
    assert diff <= hook.get('tolerance', 1e-3), f'the fused model differs by {diff:.3g}'


def check_weight_decay(model, optim_wrapper, base_wd):
    """No weight decay on norm parameters, RepBN alpha and position tables; decay elsewhere."""
    wd = {}
    for group in optim_wrapper.optimizer.param_groups:
        for p in group['params']:
            wd[id(p)] = group.get('weight_decay', base_wd)
    backbone = model.backbone
    norm_types = (nn.LayerNorm, _BatchNorm, nn.GroupNorm, FoldableNorm)
    checked = 0
    for name, m in backbone.named_modules():
        if isinstance(m, norm_types):
            for pname, p in m.named_parameters():
                assert wd[id(p)] == 0, f'backbone.{name}.{pname} ({type(m).__name__}) decays'
                checked += 1
    assert checked, 'the backbone has no normalization parameters?'
    for name, p in backbone.named_parameters():
        if name.rsplit('.', 1)[-1] in NO_DECAY_KEYS:
            assert wd[id(p)] == 0, f'backbone.{name} decays'
    decayed = [n for n, m in backbone.named_modules() if isinstance(m, nn.Linear)
               and wd[id(m.weight)] == pytest.approx(base_wd)]
    assert decayed, 'no Linear weight of the backbone has weight decay'


# ----------------------------------------------------------------------------------------------
# schedules and optimizers of the full configs
# ----------------------------------------------------------------------------------------------

def check_no_decay_settings(cfg):
    paramwise = cfg.optim_wrapper.paramwise_cfg
    assert paramwise.get('norm_decay_mult') == 0, 'norms must not decay'
    custom = paramwise.get('custom_keys', {})
    for key in NO_DECAY_KEYS:
        assert key in custom and custom[key].get('decay_mult') == 0, f'{key!r} must not decay'


@pytest.mark.parametrize('path', [c for c in FULL_CONFIGS if c.endswith('_1x.py')], ids=cid)
def test_schedule_1x(path):
    cfg = load(path)
    assert cfg.train_cfg.type == 'EpochBasedTrainLoop' and cfg.train_cfg.max_epochs == 12, \
        cfg.train_cfg
    warmup, steps = cfg.param_scheduler
    assert warmup.type == 'LinearLR' and not warmup.by_epoch
    assert (warmup.begin, warmup.end) == (0, 500)
    assert steps.type == 'MultiStepLR' and steps.by_epoch and list(steps.milestones) == [8, 11]
    assert steps.gamma == 0.1 and steps.end == 12, steps
    opt = cfg.optim_wrapper.optimizer
    assert (opt.type, opt.lr, opt.weight_decay) == ('AdamW', 1e-4, 0.05), opt
    check_no_decay_settings(cfg)
    assert cfg.train_dataloader.batch_size == 2  # x 8 GPUs
    assert cfg.auto_scale_lr.base_batch_size == 16


@pytest.mark.parametrize('path', [c for c in FULL_CONFIGS if c.endswith('_160k_ade20k.py')],
                         ids=cid)
def test_schedule_160k(path):
    cfg = load(path)
    assert cfg.train_cfg.type == 'IterBasedTrainLoop'
    assert (cfg.train_cfg.max_iters, cfg.train_cfg.val_interval) == (160000, 16000), \
        cfg.train_cfg
    warmup, poly = cfg.param_scheduler
    assert warmup.type == 'LinearLR' and (warmup.begin, warmup.end) == (0, 1500)
    assert poly.type == 'PolyLR' and poly.power == 1.0 and poly.eta_min == 0
    assert (poly.begin, poly.end) == (1500, 160000) and not poly.by_epoch
    opt = cfg.optim_wrapper.optimizer
    assert (opt.type, opt.lr, opt.weight_decay) == ('AdamW', 6e-5, 0.01), opt
    check_no_decay_settings(cfg)
    assert cfg.train_dataloader.batch_size == 2 and cfg.auto_scale_lr.base_batch_size == 16
    assert tuple(cfg.model.data_preprocessor.size) == (512, 512)
    crop = [t for t in cfg.train_pipeline if t.type == 'RandomCrop'][0]
    assert tuple(crop.crop_size) == (512, 512)
    heads = cfg.model.decode_head, cfg.model.auxiliary_head
    assert heads[0].channels == 512 and heads[0].num_classes == 150
    assert heads[1].in_index == 2 and heads[1].num_classes == 150
    for dataset in (cfg.train_dataloader.dataset, cfg.val_dataloader.dataset):
        assert dataset.reduce_zero_label


# ----------------------------------------------------------------------------------------------
# backbone settings, norm schedules and hooks (every config)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize('path', CONFIGS, ids=cid)
def test_norm_schedule_and_hooks(path):
    cfg = load(path)
    models = registry(cfg)
    backbone = models.build(tiny_backbone_cfg(cfg.model.backbone, models))
    total = total_train_iters(cfg)
    prepbn = [m for m in backbone.modules() if isinstance(m, PRepBN)]
    for m in prepbn:
        # LN -> RepBN (after its pure-LN warm-up) must finish before training ends (users of
        # the SLAB code report NaN when T is far shorter than training); about 0.8 x.
        end = m.warmup + m.step
        assert 0.6 * total <= end < total, f'PRepBN ends at {end} of {total} iterations'
    for m in backbone.modules():
        if isinstance(m, UN):
            assert m.warmup_iters < total
    progressive = [m for m in backbone.modules() if callable(getattr(m, 'set_iter', None))]
    if progressive:
        assert hook_cfgs(cfg, 'ProgressiveNormHook'), \
            'the backbone has PRepBN/UN layers but no ProgressiveNormHook'
    reparam = hook_cfgs(cfg, 'ReparamEvalHook')
    assert len(reparam) == 1 and reparam[0].get('reparam', True), \
        'validation must run through one ReparamEvalHook(reparam=True)'
    assert cfg.custom_imports.imports == ['mmslab']
    assert not cfg.custom_imports.allow_failed_imports
    ckpt = cfg.default_hooks.checkpoint
    assert ckpt.get('save_best') and ckpt.get('max_keep_ckpts', -1) > 0


@pytest.mark.parametrize('path', FULL_CONFIGS, ids=cid)
def test_backbone_settings(path):
    cfg = load(path)
    models = registry(cfg)
    bb = cfg.model.backbone
    init = bb.init_cfg
    assert init.type == 'Pretrained' and init.checkpoint.startswith('checkpoints/')
    variant = variant_of(path)
    assert variant in VARIANTS, variant
    if issubclass(models.get(bb.type), ReparamSwinTransformer):
        size = variant.rsplit('_', 1)[-1]
        assert bb.drop_path_rate == {'t': 0.2, 's': 0.3, 'b': 0.5}[size]
    else:
        assert bb.drop_path_rate == 0.1  # mmdet's PVT configs
    expected_stats = 'train' if bb.get('norm_cfg', {}).get('type') == 'UN' else 'frozen'
    assert bb.bn_stats == expected_stats

    # The neck / heads take the widths the full-size backbone really outputs. Depth does not
    # change widths, so build it one block per stage.
    probe = copy.deepcopy(dict(bb))
    probe['init_cfg'] = None
    key = 'num_layers' if issubclass(models.get(bb.type), ReparamPVT) else 'depths'
    probe[key] = (1, 1, 1, 1)
    widths = output_widths(models.build(probe))
    kind = task(cfg)
    if kind in ('mask_rcnn', 'retinanet'):
        assert list(cfg.model.neck.in_channels) == widths
        assert cfg.model.neck.out_channels == 256
    else:
        assert list(cfg.model.decode_head.in_channels) == widths
        assert cfg.model.auxiliary_head.in_channels == widths[2]


# ----------------------------------------------------------------------------------------------
# demos
# ----------------------------------------------------------------------------------------------

def test_demo_mask_rcnn_settings():
    from mmslab.datasets.demo_data import COCO_DEMO_CLASSES
    cfg = load(osp.join(CONFIG_DIR, 'demo', 'mask_rcnn_slab_swin_t_demo.py'))
    assert tuple(cfg.train_dataloader.dataset.metainfo.classes) == tuple(COCO_DEMO_CLASSES)
    assert tuple(cfg.val_dataloader.dataset.metainfo.classes) == tuple(COCO_DEMO_CLASSES)
    roi = cfg.model.roi_head
    assert roi.bbox_head.num_classes == roi.mask_head.num_classes == len(COCO_DEMO_CLASSES)
    assert roi.bbox_roi_extractor.roi_layer.sampling_ratio == 2
    assert roi.mask_roi_extractor.roi_layer.sampling_ratio == 2
    assert cfg.model.train_cfg.rpn_proposal.max_per_img == 300
    assert cfg.model.train_cfg.rcnn.sampler.num == 128
    bb = cfg.model.backbone
    assert bb.init_cfg is None and bb.bn_stats == 'train'
    assert cfg.train_cfg.type == 'IterBasedTrainLoop'
    assert 100 <= cfg.train_cfg.max_iters <= 200
    assert cfg.train_cfg.val_interval == cfg.train_cfg.max_iters
    assert cfg.train_dataloader.batch_size == 4 and cfg.train_dataloader.num_workers == 2
    assert cfg.optim_wrapper.optimizer.lr == 4e-4
    for pipeline in (cfg.train_dataloader.dataset.pipeline, cfg.val_dataloader.dataset.pipeline):
        resize = [t for t in pipeline if t.type == 'Resize'][0]
        assert tuple(resize.scale) == (256, 256) and resize.keep_ratio
    assert 'val2017' in cfg.val_dataloader.dataset.ann_file
    assert cfg.val_evaluator.type == 'CocoMetric'
    assert set(cfg.val_evaluator.metric) == {'bbox', 'segm'}
    assert cfg.default_hooks.logger.interval == 10
    assert hook_cfgs(cfg, 'ReparamEvalHook')[0].compare_unfused


def test_demo_upernet_settings():
    from mmseg.datasets import ADE20KDataset

    from mmslab.datasets.demo_data import ADE_DEMO_CLASSES
    cfg = load(osp.join(CONFIG_DIR, 'demo', 'upernet_slab_swin_t_demo.py'))
    classes = tuple(ADE_DEMO_CLASSES[v] for v in sorted(ADE_DEMO_CLASSES))
    assert tuple(cfg.train_dataloader.dataset.metainfo.classes) == classes
    assert set(classes) <= set(ADE20KDataset.METAINFO['classes'])
    assert cfg.model.decode_head.num_classes == cfg.model.auxiliary_head.num_classes == \
        len(classes)
    assert cfg.model.backbone.init_cfg is None and cfg.model.backbone.bn_stats == 'train'
    assert cfg.train_cfg.val_interval == cfg.train_cfg.max_iters
    assert cfg.val_evaluator.iou_metrics == ['mIoU']
    assert hook_cfgs(cfg, 'ReparamEvalHook')[0].compare_unfused


# ----------------------------------------------------------------------------------------------
# missing data
# ----------------------------------------------------------------------------------------------

def make_layout(root, kind, data_root=osp.join('data', 'coco')):
    """Empty stand-ins of the folders and annotation files a ``kind`` config needs."""
    if kind == 'coco':
        base = osp.join(root, data_root)
        for split in ('train2017', 'val2017'):
            os.makedirs(osp.join(base, split), exist_ok=True)
        os.makedirs(osp.join(base, 'annotations'), exist_ok=True)
        for split in ('train2017', 'val2017'):
            open(osp.join(base, 'annotations', f'instances_{split}.json'), 'w').close()
    else:
        base = osp.join(root, data_root)
        for sub in ('images', 'annotations'):
            for split in ('training', 'validation'):
                os.makedirs(osp.join(base, sub, split), exist_ok=True)


def test_data_root_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for path in CONFIGS:
        cfg = load(path)
        data_root = cfg.train_dataloader.dataset.data_root
        for mode in ('train', 'test'):
            with pytest.raises(DataNotFoundError) as err:
                check_data_root(cfg, mode, cid(path))
            msg = str(err.value)
            assert data_root in msg and osp.abspath(data_root) in msg, msg
            assert 'make_demo_data.py' in msg, msg
            # The synthetic set is offered only for the demo configs' own root, never for the
            # real datasets' data/coco and data/ade.
            offers_demo = 'To create the synthetic demo data there' in msg
            assert offers_demo == (path in DEMO_CONFIGS), msg
    for data in ('data', osp.join('data', 'mmslab_demo')):
        make_layout(str(tmp_path), 'coco', osp.join(data, 'coco'))
        make_layout(str(tmp_path), 'ade', osp.join(data, 'ade', 'ADEChallengeData2016'))
    for path in CONFIGS:
        cfg = load(path)
        check_data_root(cfg, 'train')
        check_data_root(cfg, 'test')
    os.remove(osp.join('data', 'coco', 'annotations', 'instances_val2017.json'))
    with pytest.raises(DataNotFoundError, match='instances_val2017.json'):
        check_data_root(load(osp.join(CONFIG_DIR, 'mask_rcnn_swin_t_1x.py')), 'train')


@pytest.mark.slow  # tools/train.py in a subprocess
def test_train_tool_reports_missing_data(tmp_path):
    # A regression (train.py no longer checking the data first) fails here: mmdet's dataset
    # would then raise with a traceback and no pointer to make_demo_data.py.
    train_py = osp.join(REPO_ROOT, 'tools', 'train.py')
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    proc = subprocess.run(
        [sys.executable, train_py, osp.join(CONFIG_DIR, 'demo', 'mask_rcnn_slab_swin_t_demo.py'),
         '--work-dir', str(tmp_path / 'work')],
        cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=300)
    assert proc.returncode != 0
    assert 'make_demo_data.py' in proc.stdout, proc.stdout[-3000:]
    assert 'data/mmslab_demo/coco' in proc.stdout, proc.stdout[-3000:]
    assert 'Traceback' not in proc.stdout, proc.stdout[-3000:]
