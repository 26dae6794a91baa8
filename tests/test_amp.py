"""Mixed-precision training (``tools/train.py --amp``).

* the decision (:func:`amp_optim_wrapper_cfg`): which wrapper, dtype and loss scaling on a GPU,
  a CPU with bf16 units and one without, with the device and CPU features passed in (no GPU
  needed);
* :class:`CPUAmpOptimWrapper`: registered for both codebases, refuses what it cannot do,
  autocasts the network parts only, its state round-trips;
* bf16 training through mmengine's Runner with the shipped configs (shrunk): finite losses
  close to the fp32 run's, the PRepBN / UN iteration schedule identical, and
  ``--amp --resume`` continuing an AMP run exactly;
* every norm and attention layer under CPU autocast (bf16, and fp16 for CUDA's numerics):
  statistics stay float32, outputs and gradients close to the float32 module's; UN's
  gradient statistics under a loss scale; LayerNorm's parameter gradients; the bf16
  convolutions of the shipped backbones.
"""
import copy
import math
import os.path as osp
import uuid

import pytest
import torch
import torch.nn as nn
from mmengine.config import Config

from config_helpers import CONFIG_DIR, load, registry, tiny_backbone_cfg
from conftest import load_tool, randomize_bn_statistics, randomize_weights, rel_err
from tool_runs import demo_data  # noqa: F401  (fixture)

from mmslab.engine.hooks.progressive_norm_hook import optim_loss_scale, set_loss_scale
from mmslab.engine.optim_wrapper import (AmpConfigError, CPUAmpOptimWrapper,
                                         amp_optim_wrapper_cfg, cpu_autocast)
from mmslab.models.backbones.pvt import ReparamPVT
from mmslab.models.backbones.swin import ReparamSwinTransformer
from mmslab.utils.machine import has_bf16

needs_bf16 = pytest.mark.skipif(
    not has_bf16(), reason='this CPU has no bf16 units (avx512_bf16 / amx_bf16): CPU --amp is '
    'refused there, and emulated bf16 would take minutes')

PLAIN = dict(type='OptimWrapper', optimizer=dict(type='AdamW', lr=1e-4, weight_decay=0.05),
             clip_grad=dict(max_norm=1.0), paramwise_cfg=dict(norm_decay_mult=0.0))


@pytest.fixture(scope='module', autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is much faster than two on a busy 2-core machine
    (as tests/test_configs.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------
# the decision
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize('device', ['cuda', 'npu'])
def test_gpu_gets_amp_optim_wrapper_fp16_with_dynamic_loss_scale(device):
    plain = copy.deepcopy(PLAIN)
    cfg = amp_optim_wrapper_cfg(plain, device, has_bf16=False)
    assert cfg == dict(PLAIN, type='AmpOptimWrapper', loss_scale='dynamic', dtype='float16')
    assert plain == PLAIN  # the config's own dict is left alone


def test_gpu_trains_bf16_when_asked():
    cfg = amp_optim_wrapper_cfg(PLAIN, 'cuda', has_bf16=False, dtype='bfloat16')
    assert (cfg['type'], cfg['loss_scale'], cfg['dtype']) == ('AmpOptimWrapper', 'dynamic',
                                                              'bfloat16')


def test_cpu_with_bf16_units_gets_the_cpu_wrapper():
    for dtype in (None, 'bfloat16'):
        cfg = amp_optim_wrapper_cfg(PLAIN, 'cpu', has_bf16=True, dtype=dtype)
        assert cfg == dict(PLAIN, type='CPUAmpOptimWrapper', dtype='bfloat16')
        assert 'loss_scale' not in cfg  # bf16 has fp32's range: no loss scaling


def test_cpu_without_bf16_units_is_refused():
    with pytest.raises(AmpConfigError, match=r'no bf16 units.*avx512_bf16.*Drop --amp'):
        amp_optim_wrapper_cfg(PLAIN, 'cpu', has_bf16=False)


def test_float16_on_cpu_is_refused():
    with pytest.raises(AmpConfigError, match=r'float16 autocast needs a GPU.*bfloat16'):
        amp_optim_wrapper_cfg(PLAIN, 'cpu', has_bf16=True, dtype='float16')
    # also when the config's AMP wrapper asks for it
    gpu_cfg = dict(PLAIN, type='AmpOptimWrapper', dtype='float16')
    with pytest.raises(AmpConfigError, match='float16 autocast needs a GPU'):
        amp_optim_wrapper_cfg(gpu_cfg, 'cpu', has_bf16=True)


def test_other_wrapper_types_and_dtypes_are_refused():
    with pytest.raises(AmpConfigError, match=r'optim_wrapper.type OptimWrapper.*'
                       r'the config has ApexOptimWrapper'):
        amp_optim_wrapper_cfg(dict(PLAIN, type='ApexOptimWrapper'), 'cuda', has_bf16=True)
    with pytest.raises(AmpConfigError, match=r"'float32'; valid: float16, bfloat16"):
        amp_optim_wrapper_cfg(PLAIN, 'cuda', has_bf16=True, dtype='float32')
    with pytest.raises(AmpConfigError, match=r"on 'mps'"):
        amp_optim_wrapper_cfg(PLAIN, 'mps', has_bf16=True)


def test_an_amp_wrapper_in_the_config_is_kept_or_moved_to_the_device():
    gpu_cfg = dict(PLAIN, type='AmpOptimWrapper', loss_scale=512.0)
    kept = amp_optim_wrapper_cfg(gpu_cfg, 'cuda', has_bf16=False)
    assert (kept['type'], kept['loss_scale'], kept['dtype']) == ('AmpOptimWrapper', 512.0,
                                                                 'float16')
    moved = amp_optim_wrapper_cfg(gpu_cfg, 'cpu', has_bf16=True)
    assert moved == dict(PLAIN, type='CPUAmpOptimWrapper', dtype='bfloat16')
    cpu_cfg = dict(PLAIN, type='CPUAmpOptimWrapper', dtype='bfloat16')
    assert amp_optim_wrapper_cfg(cpu_cfg, 'cuda', has_bf16=True)['dtype'] == 'bfloat16'
    # an explicit --amp-dtype wins over the config's
    assert amp_optim_wrapper_cfg(cpu_cfg, 'cuda', True, 'float16')['dtype'] == 'float16'


def test_train_tool_applies_the_decision(monkeypatch, capsys):
    import mmengine.device

    import mmslab.utils.machine
    train = load_tool('train')
    monkeypatch.setattr(mmslab.utils.machine, 'has_bf16', lambda: False)

    monkeypatch.setattr(mmengine.device, 'get_device', lambda: 'cuda')
    cfg = Config(dict(optim_wrapper=copy.deepcopy(PLAIN)))
    train.enable_amp(cfg, 'bfloat16')
    assert cfg.optim_wrapper.type == 'AmpOptimWrapper'
    assert (cfg.optim_wrapper.loss_scale, cfg.optim_wrapper.dtype) == ('dynamic', 'bfloat16')
    assert cfg.optim_wrapper.optimizer.type == 'AdamW'

    monkeypatch.setattr(mmengine.device, 'get_device', lambda: 'cpu')
    with pytest.raises(SystemExit, match=r'^error: --amp on a CPU.*no bf16 units'):
        train.enable_amp(Config(dict(optim_wrapper=copy.deepcopy(PLAIN))))
    with pytest.raises(SystemExit):
        train.parse_args(['config.py', '--amp-dtype', 'bfloat16'])  # without --amp
    assert '--amp-dtype chooses the dtype of --amp; add --amp' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.parse_args(['config.py', '--amp', '--amp-dtype', 'float64'])
    assert "invalid choice: 'float64'" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# the CPU wrapper
# ----------------------------------------------------------------------------------------------

def build_wrapper(model, **kwargs):
    from mmdet.registry import OPTIM_WRAPPERS
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return OPTIM_WRAPPERS.build(dict(type='CPUAmpOptimWrapper', optimizer=optimizer, **kwargs))


def test_cpu_wrapper_is_registered_for_both_codebases_and_checks_its_arguments():
    from mmdet.registry import OPTIM_WRAPPERS as MMDET
    from mmseg.registry import OPTIM_WRAPPERS as MMSEG
    assert MMDET.get('CPUAmpOptimWrapper') is CPUAmpOptimWrapper
    assert MMSEG.get('CPUAmpOptimWrapper') is CPUAmpOptimWrapper
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"dtype 'float16'; valid: bfloat16"):
        build_wrapper(model, dtype='float16', allow_emulated=True)
    # a model on another device would silently train in fp32 under CPU autocast
    wrapper = build_wrapper(model, allow_emulated=True)
    with pytest.raises(RuntimeError, match='the model is on meta; use AmpOptimWrapper'):
        with wrapper.optim_context(nn.Linear(4, 4, device='meta')):
            pass


def test_cpu_wrapper_refuses_a_cpu_without_bf16_units(monkeypatch):
    import mmslab.utils.machine
    monkeypatch.setattr(mmslab.utils.machine, 'has_bf16', lambda: False)
    with pytest.raises(RuntimeError, match=r'bf16 needs a CPU with avx512_bf16 or amx_bf16.*'
                       r'allow_emulated=True'):
        build_wrapper(nn.Linear(4, 4))
    build_wrapper(nn.Linear(4, 4), allow_emulated=True)  # explicitly allowed


def test_cpu_wrapper_autocasts_the_network_parts_and_its_state_round_trips():
    torch.manual_seed(0)
    # two "network parts" (children with parameters), as a backbone and a head
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16)), nn.Linear(16, 1))
    inner = []
    model[0][0].register_forward_hook(lambda m, i, o: inner.append(o.dtype))
    wrapper = build_wrapper(model, allow_emulated=True)
    for _ in range(2):
        with wrapper.optim_context(model):
            out = model(torch.randn(4, 8))
            loss = out.square().mean()
        wrapper.update_params(loss)
    assert inner == [torch.bfloat16] * 2  # inside a part: bf16 matmuls
    assert out.dtype == torch.float32  # between and after the parts: float32
    # outside the training step the model is untouched (and so are its deep copies)
    assert not any('forward' in vars(m) for m in model.modules())
    assert model(torch.randn(4, 8)).dtype == torch.float32 and inner[-1] == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    state = wrapper.state_dict()
    assert state['state'] and all(s['exp_avg'].dtype == torch.float32
                                  for s in state['state'].values())

    fresh = build_wrapper(copy.deepcopy(model), allow_emulated=True)
    # a GPU AmpOptimWrapper checkpoint carries a loss-scaler state; bf16 needs none
    fresh.load_state_dict(dict(copy.deepcopy(state), loss_scaler={'scale': 65536.0}))
    loaded = fresh.state_dict()
    assert loaded['param_groups'] == state['param_groups']
    for key, s in state['state'].items():
        for name, value in s.items():
            assert torch.equal(loaded['state'][key][name], value), (key, name)

    # autocast_parts=False: the whole step under autocast, as AmpOptimWrapper on a GPU
    whole = build_wrapper(model, allow_emulated=True, autocast_parts=False)
    with whole.optim_context(model):
        assert model(torch.randn(4, 8)).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------
# bf16 training through mmengine's Runner
# ----------------------------------------------------------------------------------------------

#: PRepBN whose decay takes 2 iterations: g = 1, 0.5, 0 in iterations 1-3, so a 3-iteration
#: run crosses the LayerNorm-only, mixed and RepBN-only branches.
FAST_PREPBN = dict(type='PRepBN', step=2)
#: UN whose moving averages start at iteration 2 (window 2, warm-up 1) with the gradient
#: scale from iteration 1: 3 iterations cover warm-up, fill-up and the averages.
FAST_UN = dict(type='UN', warmup_iters=1, window_size=2, grad_scale_start=0)

#: name -> (shipped config, backbone overrides): the UperNet config of every shipped
#: backbone, the norms and attentions no shipped config uses (RepBN with BiNorm attention,
#: SLAB-PVT's global SLA), and the two detectors (RPN proposals, NMS, RoIAlign and the
#: losses between the autocast network parts).
VARIANTS = {
    'slab_swin': ('upernet_slab_swin_t_160k_ade20k',
                  dict(norm_cfg=FAST_PREPBN, out_norm_cfg=FAST_PREPBN)),
    'prepbn_swin': ('upernet_prepbn_swin_t_160k_ade20k',
                    dict(norm_cfg=FAST_PREPBN, out_norm_cfg=FAST_PREPBN)),
    'un_swin': ('upernet_un_swin_t_160k_ade20k', dict(norm_cfg=FAST_UN)),
    'repa_swin': ('upernet_repa_swin_t_160k_ade20k', {}),
    'repbn_binorm_swin': ('upernet_swin_t_160k_ade20k',
                          dict(norm_cfg=dict(type='RepBN'),
                               attn_types=('binorm', 'binorm', 'window', 'window'))),
    'swin_ln': ('upernet_swin_t_160k_ade20k', {}),
    'prepbn_pvt': ('upernet_prepbn_pvt_t_160k_ade20k', dict(norm_cfg=FAST_PREPBN)),
    'slab_pvt': ('upernet_prepbn_pvt_t_160k_ade20k',
                 dict(norm_cfg=FAST_PREPBN, attn_types=('sla', ) * 4)),
    'pvt_ln': ('upernet_prepbn_pvt_t_160k_ade20k', dict(norm_cfg=dict(type='LN', eps=1e-6))),
    'mask_rcnn_slab_swin': ('mask_rcnn_slab_swin_t_1x',
                            dict(norm_cfg=FAST_PREPBN, out_norm_cfg=FAST_PREPBN)),
    'retinanet_prepbn_pvt': ('retinanet_prepbn_pvt_t_1x', dict(norm_cfg=FAST_PREPBN)),
}
ITERS = 3
SIZE = 64  # segmentation crops
DET_SIZE = 96  # detection images (the demo COCO set's size)
CH = 16


def shrink_heads(model, widths) -> None:
    """Tiny necks and heads on the tiny backbone's ``widths``; no dropout."""
    if model.type == 'EncoderDecoder':
        model.data_preprocessor.size = (SIZE, SIZE)
        model.decode_head.update(in_channels=widths, channels=CH, dropout_ratio=0.0)
        model.auxiliary_head.update(in_channels=widths[model.auxiliary_head.in_index],
                                    channels=CH, dropout_ratio=0.0)
        return
    model.neck.update(in_channels=widths, out_channels=CH)
    if model.type == 'RetinaNet':
        model.bbox_head.update(in_channels=CH, feat_channels=CH, stacked_convs=1)
        return
    model.rpn_head.update(in_channels=CH, feat_channels=CH)
    roi = model.roi_head
    roi.bbox_roi_extractor.out_channels = roi.mask_roi_extractor.out_channels = CH
    roi.bbox_head.update(in_channels=CH, fc_out_channels=32)
    roi.mask_head.update(in_channels=CH, conv_out_channels=CH, num_convs=1)


def train_data(cfg, data_root) -> dict:
    """The demo sets without random augmentation: ADE20K at 64x64, COCO at 96x96."""
    if cfg.default_scope == 'mmseg':
        pipeline = [dict(type='LoadImageFromFile'),
                    dict(type='LoadAnnotations', reduce_zero_label=True),
                    dict(type='Resize', scale=(SIZE, SIZE), keep_ratio=False),
                    dict(type='PackSegInputs')]
        dataset = dict(type='ADE20KDataset', data_root=str(data_root['seg']),
                       data_prefix=dict(img_path='images/training',
                                        seg_map_path='annotations/training'),
                       pipeline=pipeline)
    else:
        from mmslab.datasets import COCO_DEMO_CLASSES
        pipeline = [dict(type='LoadImageFromFile'),
                    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
                    dict(type='Resize', scale=(DET_SIZE, DET_SIZE), keep_ratio=True),
                    dict(type='PackDetInputs')]
        dataset = dict(type='CocoDataset', data_root=str(data_root['det']),
                       metainfo=dict(classes=tuple(COCO_DEMO_CLASSES)),
                       ann_file='annotations/instances_train2017.json',
                       data_prefix=dict(img='train2017/'),
                       filter_cfg=dict(filter_empty_gt=True, min_size=4), pipeline=pipeline)
    return dict(batch_size=2, num_workers=0, persistent_workers=False,
                sampler=dict(type='InfiniteSampler', shuffle=True), dataset=dataset)


def runner_cfg(name, data_root, work_dir, max_iters=ITERS) -> Config:
    """The shipped config of ``name``, shrunk: tiny backbone, neck and heads, the demo data
    without random augmentation, no dropout / drop path (the fp32 and bf16 runs must see the
    same data and masks), statistics trained (the harder case for bf16), no validation."""
    config, overrides = VARIANTS[name]
    cfg = load(osp.join(CONFIG_DIR, f'{config}.py'))
    models = registry(cfg)
    backbone = tiny_backbone_cfg(cfg.model.backbone, models)
    backbone.update(overrides, drop_path_rate=0.0, bn_stats='train')
    if issubclass(models.get(backbone['type']), ReparamPVT):
        # PVT's strided reduction convs at 8-24 channels (the shared tiny PVT's 8 / 16) hit
        # a oneDNN bf16 convolution bug (test_bf16_strided_convolutions_are_accurate)
        backbone.update(embed_dims=32)
    with torch.no_grad():
        widths = [o.shape[1] for o in models.build(copy.deepcopy(backbone)).eval()(
            torch.zeros(1, 3, SIZE, SIZE))]
    cfg.model.backbone = backbone
    shrink_heads(cfg.model, widths)
    cfg.train_dataloader = train_data(cfg, data_root)
    for key in ('val_dataloader', 'val_evaluator', 'val_cfg', 'test_dataloader',
                'test_evaluator', 'test_cfg'):
        cfg[key] = None
    cfg.train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters)
    cfg.param_scheduler = []
    cfg.optim_wrapper.optimizer.lr = 1e-4  # the configs' order (1e-4, 6e-5)
    cfg.pop('auto_scale_lr', None)
    cfg.custom_hooks = [h for h in cfg.get('custom_hooks', [])
                        if h['type'] != 'ReparamEvalHook']  # evaluation is not trained
    cfg.default_hooks.logger = dict(type='LoggerHook', interval=1)
    cfg.default_hooks.checkpoint = None
    cfg.env_cfg = dict(cudnn_benchmark=False, mp_cfg=dict(mp_start_method='fork',
                                                          opencv_num_threads=0),
                       dist_cfg=dict(backend='gloo'))
    cfg.randomness = dict(seed=0)
    cfg.work_dir = str(work_dir)
    cfg.log_level = 'WARNING'
    # unique: mmengine keys the default scope by experiment name (second resolution)
    cfg.experiment_name = f'amp_{name}_{uuid.uuid4().hex}'
    return cfg


class Record:
    """What every training iteration did: the loss and each PRepBN / UN layer's schedule."""

    def __init__(self):
        from mmengine.hooks import Hook

        record = self

        class _Hook(Hook):
            priority = 'LOW'

            def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
                record.losses.append(outputs['loss'].item())
                record.schedule.append(schedule_state(runner.model))

        self.hook = _Hook()
        self.losses, self.schedule = [], []


def schedule_state(model):
    """``(name, cur_iter, g)`` of every PRepBN and ``(name, cur_iter, last_iter, num_filled)``
    of every UN."""
    from mmslab.models.layers import PRepBN
    from mmslab.models.layers.unified_norm import UN
    out = []
    for n, m in model.named_modules():
        if isinstance(m, PRepBN):
            out.append((n, int(m.cur_iter), m.ratio))
        elif isinstance(m, UN):
            out.append((n, int(m.cur_iter), int(m.last_iter), int(m.num_filled)))
    return out


def train(cfg: Config, amp: bool):
    from mmengine.runner import Runner
    cfg = copy.deepcopy(cfg)
    if amp:
        load_tool('train').enable_amp(cfg)  # what tools/train.py --amp does
    runner = Runner.from_cfg(cfg)
    record = Record()
    runner.register_hook(record.hook)
    runner.train()
    return runner, record


#: Tolerance of the bf16 losses against fp32 (relative). The first iteration compares the
#: forward alone (same weights): bf16 rounds to 8 significant bits (2^-9 = 0.2 % per
#: operation), but the losses of untrained heads move little with it (measured: at most
#: 3.1e-4, RetinaNet). Later iterations add AdamW updates from bf16 gradients (Adam turns
#: small gradient differences into full-size steps) and a forward at the new weights, where
#: the tiny random PVTs' softmax logits reach +-2000 (RepBN's alpha * x hands the residual's
#: scale to q and k): bf16 rounding of q and k moves such logits by units. Measured: 1.0 %
#: (RetinaNet PVT, iteration 3; as much from the same fp32 weights), at most 3.6e-4 elsewhere.
FIRST_LOSS_RTOL = 2e-3
LATER_LOSS_RTOL = 5e-2


@needs_bf16
@pytest.mark.parametrize('name', list(VARIANTS))
def test_bf16_training_matches_fp32(demo_data, tmp_path, name):  # noqa: F811
    cfg = runner_cfg(name, demo_data, tmp_path / 'run')
    _, fp32 = train(cfg, amp=False)
    runner, bf16 = train(cfg, amp=True)
    assert type(runner.optim_wrapper).__name__ == 'CPUAmpOptimWrapper'
    assert len(bf16.losses) == len(fp32.losses) == ITERS
    assert all(math.isfinite(v) for v in bf16.losses), bf16.losses
    assert bf16.losses[0] == pytest.approx(fp32.losses[0], rel=FIRST_LOSS_RTOL)
    assert bf16.losses == pytest.approx(fp32.losses, rel=LATER_LOSS_RTOL)
    assert bf16.losses[0] != fp32.losses[0]  # bf16 did run: fp32 would agree to the bit
    # the PRepBN / UN schedules advanced exactly as in fp32, one step per iteration
    assert bf16.schedule == fp32.schedule
    # parameters and statistics stayed float32
    assert all(p.dtype == torch.float32 for p in runner.model.parameters())
    assert not any(b.dtype in (torch.bfloat16, torch.float16) for b in runner.model.buffers())
    print(f'{name}: fp32 {fp32.losses} bf16 {bf16.losses} rel '
          f'{[abs(a - b) / b for a, b in zip(bf16.losses, fp32.losses)]}')
    if name in ('slab_swin', 'prepbn_swin'):
        ratios = [{g for _, _, g in it} for it in bf16.schedule]
        assert ratios == [{1.0}, {0.5}, {0.0}]


@needs_bf16
def test_amp_resume_restores_schedule_and_optimizer_state(demo_data, tmp_path):  # noqa: F811
    """``tools/train.py --amp`` for 4 iterations, and again resumed (``--amp --resume``) from
    its iteration-2 checkpoint: the same final model, optimizer state and schedule (the
    resumed iterations 3-4 need AdamW's moments and PRepBN's counter of the first two)."""
    from mmslab.utils.checkpoint import load_checkpoint_file
    train_tool = load_tool('train')
    cfg = runner_cfg('slab_swin', demo_data, tmp_path / 'full', max_iters=4)
    # a decay over 4 iterations: g = 1, .75, .5, .25, so the resumed run is mid-schedule
    cfg.model.backbone.norm_cfg = cfg.model.backbone.out_norm_cfg = dict(type='PRepBN',
                                                                          step=4)
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', by_epoch=False, interval=2)
    path = str(tmp_path / 'slab_swin_amp.py')
    cfg.dump(path)
    train_tool.main([path, '--amp', '--work-dir', str(tmp_path / 'full')])
    resumed_dir = tmp_path / 'resumed'
    train_tool.main([path, '--amp', '--work-dir', str(resumed_dir), '--resume',
                     str(tmp_path / 'full' / 'iter_2.pth'),
                     '--cfg-options', f'experiment_name=amp_resume_{uuid.uuid4().hex}'])
    full = load_checkpoint_file(str(tmp_path / 'full' / 'iter_4.pth'))
    again = load_checkpoint_file(str(resumed_dir / 'iter_4.pth'))
    start = load_checkpoint_file(str(tmp_path / 'full' / 'iter_2.pth'))
    assert again['meta']['iter'] == full['meta']['iter'] == 4
    iters = {int(v) for k, v in again['state_dict'].items() if k.endswith('cur_iter')}
    assert iters == {3}  # the iteration the last step ran at, as in the full run
    # the AMP run's optimizer state was restored: AdamW's step counts went on (a parameter
    # without a gradient in an iteration, e.g. RepBN's at g = 1, is not stepped)
    assert type(again['optimizer']) is dict and 'loss_scaler' not in again['optimizer']
    for key, state in again['optimizer']['state'].items():
        assert float(state['step']) == float(start['optimizer']['state'][key]['step']) + 2
    for key, value in full['state_dict'].items():
        torch.testing.assert_close(again['state_dict'][key], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f'{key}: {m}')
    for key, state in full['optimizer']['state'].items():
        for name, value in state.items():
            torch.testing.assert_close(again['optimizer']['state'][key][name], value,
                                       rtol=1e-5, atol=1e-8)


# ----------------------------------------------------------------------------------------------
# each layer under autocast
# ----------------------------------------------------------------------------------------------

def tokens(shape, seed=0):
    """Realistic noisy activations: per-channel scales over two decades and offsets, plus a
    few outlier tokens ten times larger."""
    g = torch.Generator().manual_seed(seed)
    c = shape[-1]
    scale = torch.exp(torch.randn(c, generator=g))
    x = torch.randn(shape, generator=g) * scale + torch.randn(c, generator=g) * scale
    outliers = torch.rand(shape[:-1], generator=g) < 0.01
    return torch.where(outliers.unsqueeze(-1), x * 10, x)


def make_norm(kind, c):
    from mmslab.models.layers import PRepBN, RepBN, TokenBN
    from mmslab.models.layers.unified_norm import UN
    if kind == 'RepBN':
        return RepBN(c)
    if kind == 'TokenBN':
        return TokenBN(c)
    if kind == 'PRepBN':
        m = PRepBN(c, step=4)
        m.set_iter(2)  # g = 0.5: both branches
        return m
    return UN(c, warmup_iters=0, window_size=2, grad_scale_start=0)  # averages from it 2


#: Relative tolerance per autocast dtype of outputs / parameter gradients against the fp32
#: module: 8 (bf16) and 11 (fp16) significant bits of the low-precision input and matmuls.
OUT_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
GRAD_TOL = {torch.bfloat16: 5e-2, torch.float16: 1e-2}
#: fp16 gradients underflow without the loss scale AmpOptimWrapper's GradScaler applies on a
#: GPU (65536 at the start); bf16 has float32's range and needs none.
LOSS_SCALE = {torch.bfloat16: 1.0, torch.float16: 65536.0}
AUTOCAST_DTYPES = [pytest.param(torch.bfloat16, id='bf16', marks=needs_bf16),
                   pytest.param(torch.float16, id='fp16')]


def autocast_twins(module, inputs, dtype, steps=1, set_iter=None):
    """Run ``steps`` training steps (forward, a fixed random loss, backward) of ``module`` in
    float32 and of a copy under :func:`cpu_autocast` (``dtype``, what CPUAmpOptimWrapper
    trains in) with the inputs rounded to ``dtype`` (as a preceding layer hands them on) and
    the fp16 loss scale (:data:`LOSS_SCALE`). Returns ``(ref, amp, ref_out, amp_out)`` of the
    last step; gradients accumulate over the steps."""
    ref, amp = module, copy.deepcopy(module)
    set_loss_scale(amp, LOSS_SCALE[dtype])  # as ProgressiveNormHook does for UN
    for step in range(steps):
        if set_iter is not None:
            set_iter(ref, step)
            set_iter(amp, step)
        xs = [x.clone().requires_grad_() for x in inputs]
        ref_out = ref(*xs)
        with cpu_autocast(dtype):
            amp_out = amp(*[x.to(dtype) for x in xs])
        w = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(step))
        (ref_out * w).mean().backward()  # a mean, as the losses are
        ((amp_out.float() * w).mean() * LOSS_SCALE[dtype]).backward()
    for p in amp.parameters():
        p.grad /= LOSS_SCALE[dtype]
    return ref, amp, ref_out.detach(), amp_out.detach()


def check_params_and_stats(ref, amp, dtype, grad_tol=None, grad_norm=False):
    """Parameters and their gradients float32 and finite, each gradient within ``grad_tol``
    (default ``GRAD_TOL``) of the fp32 module's in its largest entry (``grad_norm``: all
    gradients together, in norm); floating buffers (statistics) in their fp32-run dtype and
    close to the fp32 module's, counters equal."""
    tol = grad_tol or GRAD_TOL[dtype]
    pairs = list(zip(ref.named_parameters(), amp.parameters()))
    for (n, p), q in pairs:
        assert q.dtype == torch.float32 and q.grad.dtype == torch.float32, n
        assert torch.isfinite(q.grad).all(), n
        if not grad_norm:
            assert rel_err(q.grad, p.grad) < tol, (n, rel_err(q.grad, p.grad))
    if grad_norm:
        g_ref = torch.cat([p.grad.flatten() for (_, p), _ in pairs])
        g_amp = torch.cat([q.grad.flatten() for _, q in pairs])
        err = ((g_amp - g_ref).norm() / g_ref.norm()).item()
        assert err < tol, err
    for (n, b), c in zip(ref.named_buffers(), amp.buffers()):
        if b.is_floating_point():
            assert c.dtype == b.dtype == (torch.float64 if n.endswith('schedule_offset')
                                          else torch.float32), f'{n}: {c.dtype}'
            assert rel_err(c, b) < OUT_TOL[dtype], (n, rel_err(c, b))
        else:
            assert torch.equal(c, b), n  # counters (iterations, fill levels)


@pytest.mark.parametrize('dtype', AUTOCAST_DTYPES)
@pytest.mark.parametrize('kind', ['RepBN', 'TokenBN', 'PRepBN', 'UN'])
def test_norm_statistics_stay_float32_under_autocast(kind, dtype):
    torch.manual_seed(0)
    norm = randomize_bn_statistics(make_norm(kind, 32).train(), alpha=0.5)
    x = tokens((4, 196, 32))
    ref, amp, y, y_amp = autocast_twins(norm, [x], dtype, steps=3,
                                        set_iter=lambda m, it: m.set_iter(it)
                                        if kind == 'UN' else None)
    assert y_amp.dtype == dtype  # the norm hands on the dtype it got
    assert rel_err(y_amp.float(), y) < OUT_TOL[dtype], rel_err(y_amp.float(), y)
    check_params_and_stats(ref, amp, dtype)
    # eval mode: the statistics are used as they are
    with torch.no_grad(), cpu_autocast(dtype):
        y_eval = amp.eval()(x.to(dtype))
    assert rel_err(y_eval.float(), ref.eval()(x)) < OUT_TOL[dtype]


def window_attention(kind):
    from mmslab.models.layers.shift_window import ShiftWindowAttention
    return ShiftWindowAttention(32, 2, 7, shift=True, attn_type=kind)


def pvt_attention(kind):
    from mmslab.models.backbones.pvt import GlobalSLA, SpatialReductionAttention
    if kind == 'sra':
        return SpatialReductionAttention(32, 2, sr_ratio=2, norm_cfg=dict(type='RepBN'))
    return GlobalSLA(32, 2, grid=(16, 16))


#: Tolerance of whole attention modules' gradients, all parameters together, in norm.
#: Activation gradients are rounded to the autocast dtype too (as on a GPU), and SLA's
#: normalizer gives a few tokens q-gradients ~700x the median: their rounding dominates sums
#: that cancel (GlobalSLA's qkv-bias gradient: 3 % bf16, 11 % fp16 in its largest entry,
#: while 2^-11 noise on qkv in float32 moves it by 0.1 %). Measured in norm: at most 1.3 %
#: (bf16) and 1.6 % (fp16). The kernels' own arithmetic is checked entry by entry on
#: identical inputs by test_attention_kernels_under_autocast_match_fp32_on_the_same_inputs.
ATTN_GRAD_TOL = {torch.bfloat16: 0.05, torch.float16: 0.03}


@pytest.mark.parametrize('dtype', AUTOCAST_DTYPES)
@pytest.mark.parametrize('build,kind', [(window_attention, 'window'),
                                        (window_attention, 'sla'),
                                        (window_attention, 'binorm'),
                                        (pvt_attention, 'sra'), (pvt_attention, 'global_sla')])
def test_attention_under_autocast_is_close_to_fp32(build, kind, dtype):
    """Shifted, padded windows (15 x 15 tokens, window 7) and PVT's attentions (a RepBN on
    the reduced map; global SLA resizing its 16 x 16 encoding) on normalized tokens."""
    torch.manual_seed(0)
    attn = randomize_weights(build(kind)).train()
    hw = (15, 15)
    x = tokens((2, hw[0] * hw[1], 32)) / 3
    ref, amp, y, y_amp = autocast_twins(WithShape(attn, hw), [x], dtype)
    assert y_amp.dtype == dtype  # hands on the autocast dtype, as a Linear would
    assert rel_err(y_amp.float(), y) < OUT_TOL[dtype], rel_err(y_amp.float(), y)
    check_params_and_stats(ref, amp, dtype, ATTN_GRAD_TOL[dtype], grad_norm=True)


def window_kernel_case(kind):
    """``(kernel, attend arguments)``: the kernel of a shifted 7 x 7 window attention on a
    15 x 15 map, with the shift mask and the padding of that layout."""
    from mmslab.models.layers.shift_mask import shift_mask_by_type
    from mmslab.models.layers.shift_window import padded_windows
    swa = window_attention(kind)
    lay = padded_windows(15, 15, 7, 7, 3)
    kwargs = dict(window_hw=(7, 7))
    if swa.w_msa.uses_shift_mask:
        kwargs['shift_mask'] = shift_mask_by_type(21, 21, 7, 7, 3)
    if swa.w_msa.masks_padding:
        kwargs['valid'] = lay['valid']
    return swa.w_msa, (2 * lay['num_windows'], 49), kwargs


@pytest.mark.parametrize('dtype', AUTOCAST_DTYPES)
@pytest.mark.parametrize('kind', ['window', 'sla', 'binorm', 'global_sla'])
def test_attention_kernels_under_autocast_match_fp32_on_the_same_inputs(kind, dtype):
    """The kernels' own arithmetic: fed the same (low-precision) qkv, the autocast kernel's
    output, qkv gradient and parameter gradients (relative position bias, SLA's positional
    encoding and DWC) are within rounding of the float32 kernel's; nothing is summed in low
    precision."""
    torch.manual_seed(0)
    if kind == 'global_sla':
        kernel = pvt_attention(kind).kernel  # SLA over the whole 15 x 15 map
        shape, kwargs = (2, 15 * 15), dict(window_hw=(15, 15))
    else:
        kernel, shape, kwargs = window_kernel_case(kind)
    kernel = randomize_weights(kernel).train()
    qkv = tokens((*shape, 3 * kernel.embed_dims), seed=1).to(dtype)
    ref, amp = kernel, copy.deepcopy(kernel)
    q_ref, q_amp = qkv.float().requires_grad_(), qkv.clone().requires_grad_()
    out = ref.attend(q_ref, **kwargs)
    with cpu_autocast(dtype):
        out_amp = amp.attend(q_amp, **kwargs)
    assert out_amp.dtype == dtype
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * w).sum().backward()
    (out_amp.float() * w).sum().backward()
    assert rel_err(out_amp.float(), out) < OUT_TOL[dtype], rel_err(out_amp.float(), out)
    assert rel_err(q_amp.grad.float(), q_ref.grad) < OUT_TOL[dtype]
    grads = [(n, p.grad, q.grad) for (n, p), q in zip(ref.named_parameters(),
                                                      amp.parameters()) if p.grad is not None]
    assert grads or kind == 'binorm'  # BiNorm has no parameters of its own in the kernel
    for n, g_ref, g_amp in grads:
        assert g_amp.dtype == torch.float32
        assert rel_err(g_amp, g_ref) < OUT_TOL[dtype], (n, rel_err(g_amp, g_ref))


class WithShape(nn.Module):
    """``module(x, hw)`` as ``forward(x)``."""

    def __init__(self, module, hw):
        super().__init__()
        self.module, self.hw = module, hw

    def forward(self, x):
        return self.module(x, self.hw)


@pytest.mark.parametrize('kind', ['sla', 'binorm'])
def test_linear_attention_sums_over_a_56x56_window_do_not_overflow_fp16(kind):
    """K^T V and the normalizer sum over all 3136 tokens of a 56 x 56 window (SLAB-Swin's
    stage 1): with activations of a few units these sums pass float16's 65504, so they must
    run in float32 under CUDA's fp16 autocast (emulated here with CPU fp16 autocast)."""
    from mmslab.models.layers.linear_attention import SLA, BiNormAttention
    torch.manual_seed(0)
    c, n = 32, 56 * 56
    kernel = (SLA if kind == 'sla' else BiNormAttention)(c, 2, 56).eval()
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, n, 3 * c, generator=g) * 2 + 5  # positive means: coherent sums
    k, v = qkv[0, :, c:2 * c], qkv[0, :, 2 * c:]
    assert (k.relu().T @ v).min() > 65504  # every entry of K^T V overflows float16
    with torch.no_grad():
        ref = kernel.attend(qkv, (56, 56)).reshape(1, n, c)
        with cpu_autocast(torch.float16):
            out = kernel.attend(qkv.half(), (56, 56)).reshape(1, n, c)
    assert out.dtype == torch.float16
    assert torch.isfinite(out).all()
    assert rel_err(out.float(), ref) < OUT_TOL[torch.float16]


@pytest.mark.parametrize('dtype', AUTOCAST_DTYPES)
def test_cpu_autocast_gives_layer_norm_float32_parameter_gradients(dtype):
    """PyTorch's CPU LayerNorm backward sums the weight / bias gradients in the input dtype
    (bf16: ~40 % off at 32k tokens). cpu_autocast computes LayerNorm in float32; outside it,
    autocast's LayerNorm is what it was."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32768, 96, generator=g).to(dtype)  # a 2 x 128 x 128 stage-1 map
    dy = torch.randn(32768, 96, generator=g).to(dtype)
    ref = nn.LayerNorm(96).double()
    ref(x.double()).backward(dy.double())
    ln = nn.LayerNorm(96)
    xa = x.clone().requires_grad_()
    with cpu_autocast(dtype):
        y = ln(xa)
    y.backward(dy)
    assert y.dtype == dtype and xa.grad.dtype == dtype  # dtypes as without cpu_autocast
    for name in ('weight', 'bias'):
        err = rel_err(getattr(ln, name).grad.double(), getattr(ref, name).grad)
        assert err < 1e-4, (name, err)
    assert rel_err(y.double(), ref(x.double())) < OUT_TOL[dtype]
    with torch.no_grad():  # plain autocast: the op in the input dtype, as before
        with torch.autocast('cpu', dtype=dtype):
            plain = ln(x)
        assert torch.equal(plain, ln(x))


def un_step(norm, x, it, dy):
    norm.set_iter(it)
    xs = x.clone().requires_grad_()
    norm(xs).backward(dy)
    return xs.grad


def test_un_gradient_statistics_ignore_the_loss_scale_and_overflow_steps():
    """fp16 AMP scales the gradients by the GradScaler's scale (changing over training) and
    makes them inf on overflow steps, which the scaler then skips. UN's gradient window and
    EMA stay those of the unscaled gradients, and an overflow step records nothing."""
    from mmslab.models.layers.unified_norm import UN
    torch.manual_seed(0)
    plain = UN(16, warmup_iters=0, window_size=2, grad_scale_start=0).train()
    scaled = copy.deepcopy(plain)
    x = tokens((2, 64, 16))
    g = torch.Generator().manual_seed(0)
    dys = [torch.randn(2, 64, 16, generator=g) for _ in range(4)]
    for it, (dy, s) in enumerate(zip(dys, [1024.0, 65536.0, 32768.0, 2.0 ** 20])):
        dx = un_step(plain, x, it, dy)
        scaled.set_loss_scale(s)
        dx_scaled = un_step(scaled, x, it, dy * s)
        torch.testing.assert_close(dx_scaled / s, dx, rtol=1e-5, atol=1e-7)
        for name in ('grad_window', 'grad_est', 'running_var', 'window'):
            torch.testing.assert_close(getattr(scaled, name), getattr(plain, name),
                                       rtol=1e-5, atol=1e-9, msg=lambda m: f'{name}: {m}')
    # an overflow step: inf gradients go through (the scaler skips the step), the statistics
    # keep their values and the next iteration is as if the step had not happened
    before = {k: v.clone() for k, v in scaled.state_dict().items() if k.startswith('grad_')}
    overflow = dys[0].clone()
    overflow[0, 0, 0] = float('inf')
    assert not torch.isfinite(un_step(scaled, x, 4, overflow)).all()
    after = {k: v for k, v in scaled.state_dict().items() if k.startswith('grad_')}
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert torch.isfinite(un_step(scaled, x, 5, dys[1] * 2.0 ** 20)).all()
    assert torch.isfinite(scaled.grad_est).all()
    with pytest.raises(ValueError, match='positive finite'):
        scaled.set_loss_scale(0.0)


def test_progressive_norm_hook_reads_the_gradscaler_scale():
    class Scaler:
        def is_enabled(self):
            return True

        def get_scale(self):
            return 4096.0

    assert optim_loss_scale(type('AmpWrapper', (), dict(loss_scaler=Scaler()))()) == 4096.0
    assert optim_loss_scale(object()) == 1.0  # OptimWrapper, CPUAmpOptimWrapper


@needs_bf16
@pytest.mark.parametrize('config', ['upernet_slab_swin_t_160k_ade20k',
                                    'upernet_prepbn_pvt_t_160k_ade20k'])
def test_bf16_strided_convolutions_are_accurate(config):
    """oneDNN's bf16 convolution on this CPU is wrong (~100 % error) for kernel = stride >= 4
    at 8-24 channels (torch 2.14: e.g. 8 -> 8 channels, kernel 8, the tiny PVT's stage-1
    reduction). The shipped backbones' patch embeddings, PVT reductions and SLA's depth-wise
    convs, at their real widths, must be right in bf16."""
    cfg = load(osp.join(CONFIG_DIR, f'{config}.py'))
    models = registry(cfg)
    backbone = dict(cfg.model.backbone, init_cfg=None)
    # the real widths, one block per stage (the convolutions do not depend on depth)
    depth = 'depths' if issubclass(models.get(backbone['type']), ReparamSwinTransformer) \
        else 'num_layers'
    backbone[depth] = (1, 1, 1, 1)
    model = models.build(backbone)
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) >= 3  # patch embedding + SLA DWCs (Swin) or + reductions (PVT)
    g = torch.Generator().manual_seed(0)
    seen = set()
    for name, conv in convs:
        key = (conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.groups)
        if key in seen:
            continue
        seen.add(key)
        s = conv.stride[0]
        x = torch.randn(2, conv.in_channels, 4 * max(s, 2), 5 * max(s, 2), generator=g)
        with torch.no_grad():
            ref = conv(x.bfloat16().float())
            with cpu_autocast():
                out = conv(x)
        assert rel_err(out.float(), ref) < OUT_TOL[torch.bfloat16], (name, key)


def test_sla_bf16_inference_sums_in_bf16_within_rounding():
    """bf16 inference keeps SLA's kernel sums in bf16 (float32's range, float32 accumulation
    inside the products): over a 56 x 56 window of coherent activations the output is within
    bf16 rounding of the float64 formula's. fp16 and training keep float32."""
    from mmslab.models.layers.linear_attention import SLA, sla_dtype
    t = torch.zeros(1, dtype=torch.bfloat16)
    with torch.no_grad():
        assert sla_dtype(t) == torch.bfloat16
        assert sla_dtype(t.half()) == torch.float32
    assert sla_dtype(t) == torch.float32  # grad mode: training
    torch.manual_seed(0)
    c, n = 32, 56 * 56
    kernel = SLA(c, 2, 56).eval()
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, n, 3 * c, generator=g) * 2 + 5
    with torch.no_grad():
        ref = kernel.double().attend(qkv.double(), (56, 56)).reshape(1, n, c)
        kernel.float()
        with cpu_autocast(torch.bfloat16):
            out = kernel.attend(qkv.bfloat16(), (56, 56)).reshape(1, n, c)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert rel_err(out.double(), ref) < OUT_TOL[torch.bfloat16], rel_err(out.double(), ref)
