"""torch.compile of mmslab backbones: one graph for every input size (no recompilation per
stage or per size), outputs and gradients equal to eager, PRepBN's decay without
recompilation, and training through mmengine's ``compile=True``.

Graph counts use dynamo's ``CompileCounter`` backend (graphs run eagerly, so tracing is all
that costs); one test compiles with inductor to check its numerics, and the mmengine test
compiles everything with inductor (``compile=True``): about a minute on 2 cores with a cold
inductor cache, ~10 s with a warm one.
"""
import copy
import math
import uuid

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

import mmslab
from conftest import randomize_weights, rel_err
from presets import PVT_TINY, build_preset, build_swin

#: Sizes whose every stage has at least two windows per side (a size-1 dimension is a graph
#: of its own: dynamo specializes sizes 0 and 1), the last one padded at every stage.
SIZES = [(160, 192), (192, 256), (224, 160), (161, 199)]
#: The tiny PVT's sizes stay on one side of PyTorch's CPU convolution backend choice (mkldnn
#: above 20480 input elements: a guard on its 8-channel maps; real-size models are above it
#: at every stage).
PVT_SIZES = [(128, 160), (160, 192), (192, 160), (161, 199)]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def build(name: str, fused: bool):
    if name == 'LN':  # the LayerNorm control
        model = build_swin('ReparamSwinTransformer')
    elif name == 'PRepBNPVT':
        from mmdet.registry import MODELS
        model = MODELS.build(dict(type='PRepBNPVT', **PVT_TINY))
    else:
        model = build_preset(name)
    model = randomize_weights(model)
    return mmslab.reparameterize(model) if fused else model


def graphs_per_call(model, sizes, **compile_kwargs):
    """Graphs compiled so far after each call at ``sizes``, checking every output against
    eager. ``fullgraph=True``: a graph break fails the test."""
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True, **compile_kwargs)
    gen = torch.Generator().manual_seed(0)
    counts = []
    with torch.no_grad():
        for size in sizes:
            x = torch.randn(1, 3, *size, generator=gen)
            out, ref = compiled(x), model(x)
            assert len(out) == len(ref)
            for a, b in zip(out, ref):
                assert a.shape == b.shape
                assert rel_err(a, b) < 1e-5, (size, rel_err(a, b))
            counts.append(counter.frame_count)
    return counts


# (the fused RePa-Swin: test_dynamic_compile_is_one_graph_from_the_start, at the same sizes)
@pytest.mark.parametrize('name, fused', [
    pytest.param('SLABSwin', True, marks=pytest.mark.slow),
    pytest.param('LN', True, marks=pytest.mark.slow),
    pytest.param('PRepBNSwin', False, marks=pytest.mark.slow),
    ('PRepBNPVT', True)])
def test_one_graph_serves_every_input_size(name, fused):
    # Before: a fused Swin broke the graph ~20 times (patch merging's cached weight copies)
    # and recompiled every stage's pieces at every size (28 graphs at the first size, the
    # recompile limit hit by the fourth); an unfused one recompiled at every new size.
    # Now: a static graph at the first size, one dynamic graph at the second, none after.
    sizes = PVT_SIZES if 'PVT' in name else SIZES
    assert graphs_per_call(build(name, fused), sizes) == [1, 2, 2, 2]


@pytest.mark.slow
def test_dynamic_compile_is_one_graph_from_the_start():
    assert graphs_per_call(build('RePaSwin', True), SIZES, dynamic=True) == [1, 1, 1, 1]


@pytest.mark.slow
def test_training_graph_survives_the_prepbn_decay():
    """g moves every iteration: it is a tensor in the graph, so only the branch changes
    (LayerNorm warm-up -> blend -> RepBN) compile a new graph; loss and gradients equal
    eager's."""
    eager = build_preset('PRepBNSwin', norm_cfg=dict(type='PRepBN', step=4)).train()
    model = copy.deepcopy(eager)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.randn(2, 3, 160, 192, generator=torch.Generator().manual_seed(0))
    counts = []
    for it in range(6):  # g = 1, .75, .5, .25, 0, 0
        for m in (eager, model):
            mmslab.set_progressive_iter(m, it)
            m.zero_grad()
        ref = sum(o.pow(2).mean() for o in eager(x))
        loss = sum(o.pow(2).mean() for o in compiled(x))
        ref.backward()
        loss.backward()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
        scale = max(p.grad.abs().max() for p in eager.parameters() if p.grad is not None)
        for (key, p), q in zip(eager.named_parameters(), model.parameters()):
            assert (p.grad is None) == (q.grad is None), key
            if p.grad is not None:
                assert (p.grad - q.grad).abs().max() <= 1e-5 * scale, (it, key)
        counts.append(counter.frame_count)
    assert counts == [1, 2, 2, 2, 3, 3]


def test_inductor_output_equals_eager():
    """Inductor's code for a fused RePa-Swin (two stages to keep the compilation short) on a
    size padded in every stage: folded-norm padding value, shift mask, fused attention."""
    two_stages = dict(depths=(2, 2), num_heads=(1, 2), strides=(4, 2), out_indices=(0, 1),
                      attn_types=('window', 'window'))
    model = build_preset('RePaSwinPRepBN', **two_stages)
    model = mmslab.reparameterize(randomize_weights(model))
    x = torch.randn(1, 3, 61, 93, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, ref = torch.compile(model)(x), model(x)
    for a, b in zip(out, ref):
        assert rel_err(a, b) < 1e-5


# ----------------------------------------------------------------------------------------------
# mmengine: compile=True
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def ade_data(tmp_path_factory):
    from mmslab.datasets.demo_data import make_ade_demo
    root = tmp_path_factory.mktemp('compile_ade')
    make_ade_demo(str(root / 'ade'), num_train=4, num_val=2, img_size=64, seed=1,
                  progress=False)
    return root / 'ade' / 'ADEChallengeData2016'


def seg_train_cfg(data_root, work_dir, compile_cfg):
    """A tiny UperNet-free segmentor: PRepBN Swin (two stages; step 100 with r0 = 0.5 keeps
    every iteration in the blend, so g moves every iteration) + FCN head, 3 iterations."""
    pipeline = [dict(type='LoadImageFromFile'),
                dict(type='LoadAnnotations', reduce_zero_label=True),
                dict(type='Resize', scale=(64, 64), keep_ratio=False),
                dict(type='PackSegInputs')]
    return dict(
        default_scope='mmseg', work_dir=str(work_dir), randomness=dict(seed=0),
        experiment_name=f'compile_{uuid.uuid4().hex}',
        model=dict(
            type='EncoderDecoder',
            data_preprocessor=dict(type='SegDataPreProcessor', mean=[123.675, 116.28, 103.53],
                                   std=[58.395, 57.12, 57.375], bgr_to_rgb=True, pad_val=0,
                                   seg_pad_val=255, size=(64, 64)),
            backbone=dict(type='PRepBNSwin', embed_dims=16, depths=(2, 1), num_heads=(1, 2),
                          strides=(4, 2), out_indices=(0, 1), attn_types=('window', 'window'),
                          window_size=4, drop_path_rate=0.0,
                          norm_cfg=dict(type='PRepBN', step=100, r0=0.5)),
            decode_head=dict(type='FCNHead', in_channels=32, in_index=1, channels=16,
                             num_convs=1, num_classes=150, norm_cfg=dict(type='BN'),
                             align_corners=False,
                             loss_decode=dict(type='CrossEntropyLoss', loss_weight=1.0)),
            test_cfg=dict(mode='whole')),
        train_dataloader=dict(
            batch_size=2, num_workers=0, sampler=dict(type='InfiniteSampler', shuffle=True),
            dataset=dict(type='ADE20KDataset', data_root=str(data_root),
                         data_prefix=dict(img_path='images/training',
                                          seg_map_path='annotations/training'),
                         pipeline=pipeline)),
        train_cfg=dict(type='IterBasedTrainLoop', max_iters=3),
        # SGD: its compiled step is a fraction of AdamW's compilation time
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01)),
        default_hooks=dict(logger=dict(type='LoggerHook', interval=1), checkpoint=None),
        custom_hooks=[dict(type='ProgressiveNormHook')],
        log_level='WARNING', compile=compile_cfg)


def train(cfg):
    from mmengine.config import Config
    from mmengine.hooks import Hook
    from mmengine.runner import Runner

    class Record(Hook):
        def before_train(self, runner):
            self.start = {k: p.detach().clone() for k, p in runner.model.named_parameters()}
            self.losses = []

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            self.losses.append(outputs['loss'].item())

    runner = Runner.from_cfg(Config(cfg))
    record = Record()
    runner.register_hook(record, priority='LOW')
    runner.train()
    return runner, record


@pytest.mark.slow
def test_mmengine_training_with_compile_true(ade_data, tmp_path):
    runner, compiled = train(seg_train_cfg(ade_data, tmp_path / 'compiled', True))
    # mmengine swapped the model's train_step for the compiled one
    assert hasattr(runner.model.train_step, '_torchdynamo_orig_callable')
    assert len(compiled.losses) == 3 and all(math.isfinite(v) for v in compiled.losses)
    backbone = {k: p for k, p in runner.model.named_parameters() if k.startswith('backbone.')}
    changed = [k for k, p in backbone.items() if not torch.equal(p, compiled.start[k])]
    assert len(changed) > 0.8 * len(backbone), sorted(set(backbone) - set(changed))
    # the same run in eager: the same losses (the first before any update)
    torch._dynamo.reset()
    _, eager = train(seg_train_cfg(ade_data, tmp_path / 'eager', None))
    assert compiled.losses[0] == pytest.approx(eager.losses[0], rel=1e-5)
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-3)
