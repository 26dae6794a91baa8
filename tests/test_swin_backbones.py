"""The configurable Swin: mmdet equivalence, presets, freezing, and exact re-parameterization."""
import numpy as np
import pytest
import torch
import torch.nn as nn

import mmslab
from conftest import randomize_bn_statistics, rel_err
# re-exported: test_onnx_backbones and test_dynamic_export import PRESETS, build_preset here
from presets import PRESETS, build_preset  # noqa: F401
from presets import SWIN_TINY as TINY
from presets import build_swin as build
from mmslab.engine.hooks import set_progressive_iter
from mmslab.models import ReparamSwinTransformer, statistic_modules
from mmslab.models.layers import FoldableNorm


def test_vanilla_config_equals_mmdet_swin():
    from mmdet.models.backbones import SwinTransformer
    torch.manual_seed(0)
    ref = SwinTransformer(**TINY, out_indices=(0, 1, 2, 3))
    ref.init_weights()
    ref.eval()  # mmdet's Swin.train() returns None: no chaining
    ours = ReparamSwinTransformer(**TINY, norm_cfg=dict(type='LN')).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    for hw in [(64, 64), (70, 90), (33, 47)]:
        x = torch.randn(1, 3, *hw)
        with torch.no_grad():
            a, b = ref(x), ours(x)
        assert len(a) == len(b) == 4
        for ra, rb in zip(a, b):
            assert ra.shape == rb.shape
            assert rel_err(rb, ra) <= 1e-5, hw


@pytest.mark.parametrize('type_', ['PRepBNSwin', 'SLABSwin', 'RePaSwin'])
def test_mmdet_swin_weights_load_into_each_preset_with_layernorm(type_):
    from mmdet.models.backbones import SwinTransformer
    ref = SwinTransformer(**TINY)
    ref.eval()
    kwargs = dict(norm_cfg=dict(type='LN'))
    if type_ == 'SLABSwin':
        kwargs['attn_types'] = ('window', ) * 4
        kwargs['window_size'] = 4
    if type_ == 'RePaSwin':
        kwargs['ffn_type'] = 'mlp'
    ours = build(type_, **kwargs).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(1, 3, 48, 56)
    with torch.no_grad():
        for ra, rb in zip(ref(x), ours(x)):
            assert rel_err(rb, ra) <= 1e-5


@pytest.mark.parametrize('name', list(PRESETS))
def test_preset_shapes_train_step_and_exact_reparameterization(name):
    torch.manual_seed(0)
    model = build_preset(name)
    model.init_weights()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for it in range(3):  # move BN statistics and the schedule
        set_progressive_iter(model, it)
        outs = model(torch.randn(2, 3, 64, 72))
        loss = sum(o.square().mean() for o in outs)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    randomize_bn_statistics(model)
    model.eval()
    for hw in [(64, 64), (75, 50), (33, 97)]:
        x = torch.randn(1, 3, *hw)
        with torch.no_grad():
            outs = model(x)
        strides = [4, 8, 16, 32]
        for o, s, c in zip(outs, strides, [16, 32, 64, 128]):
            assert o.shape == (1, c, -(-hw[0] // s), -(-hw[1] // s)), (hw, o.shape)
    x = torch.randn(2, 3, 61, 83)
    with torch.no_grad():
        ref = model(x)
        mmslab.reparameterize(model)
        fused = model(x)
        mmslab.reparameterize(model)  # idempotent
        again = model(x)
    for r, f, a in zip(ref, fused, again):
        assert rel_err(f, r) <= 1e-4
        assert torch.equal(f, a)
    left = statistic_modules(model)
    if name == 'RePaSwin':  # the authors' setting keeps LayerNorm before attention
        assert left and all(t == 'LayerNorm' for _, t in left)
    else:
        assert left == []
    assert not any(isinstance(m, FoldableNorm) and not m.deploy for m in model.modules())
    # A deploy=True build has the fused structure: the fused state_dict loads strictly.
    deployed = build_preset(name, deploy=True).eval()
    deployed.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        for r, d in zip(ref, deployed(x)):
            assert rel_err(d, r) <= 1e-4


def test_repa_swin_parameter_count_after_fusion_follows_formula():
    model = build('RePaSwin', norm_cfg=dict(type='LN')).eval()
    ffn_before = sum(p.numel() for n, p in model.named_parameters() if '.ffn.' in n)
    mmslab.reparameterize(model)
    ffn_after = sum(p.numel() for n, p in model.named_parameters() if '.ffn.' in n)
    # Seed 004 sec. 4.3: per FFN (2*mu + 1) C^2 weights (+ biases), mu = k / C = 1 here.
    expected = 0
    for stage, c in zip(model.stages, [16, 32, 64, 128]):
        k = c  # ceil(4C * 0.25)
        expected += len(stage.blocks) * ((2 * k // c + 1) * c * c + c + k)
    assert ffn_after == expected
    assert ffn_after < ffn_before


def test_frozen_stages_and_bn_stats_policy():
    model = build('PRepBNSwin', norm_cfg=dict(type='PRepBN', step=4), frozen_stages=1,
                  bn_stats='frozen')
    model.train()
    assert not any(p.requires_grad for p in model.patch_embed.parameters())
    assert not any(p.requires_grad for p in model.stages[0].parameters())
    assert not any(p.requires_grad for p in model.norm0.parameters())
    assert all(p.requires_grad for p in model.stages[1].parameters())
    assert not model.stages[0].training and model.stages[1].training
    # bn_stats='frozen' freezes the body's statistics; the output norms (new in detection)
    # keep training theirs (out_bn_stats='train'), except norm0, frozen with its stage
    body = [m for n, m in model.named_modules() if isinstance(m, nn.BatchNorm1d)
            and not n.startswith('norm')]
    outs = {n.split('.')[0]: m for n, m in model.named_modules()
            if isinstance(m, nn.BatchNorm1d) and n.startswith('norm')}
    assert body and not any(m.training for m in body)
    assert not outs['norm0'].training
    assert all(outs[f'norm{i}'].training for i in (1, 2, 3))
    bns = body
    before = bns[-1].running_mean.clone()
    set_progressive_iter(model, 10)
    model(torch.randn(2, 3, 64, 64))
    assert torch.equal(before, bns[-1].running_mean)
    alpha = model.stages[1].blocks[0].norm1.norm2.alpha
    assert alpha.requires_grad


def test_with_cp_gives_same_gradients():
    torch.manual_seed(0)
    a = build('PRepBNSwin', norm_cfg=dict(type='PRepBN', step=4))
    b = build('PRepBNSwin', norm_cfg=dict(type='PRepBN', step=4), with_cp=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 32, 32)
    for m in (a, b):
        m.train()
        set_progressive_iter(m, 1)
        sum(o.sum() for o in m(x)).backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-5), n


@pytest.mark.parametrize('kwargs,match', [
    (dict(arch='huge'), 'arch'), (dict(attn_types=('window', 'softmax', 'window', 'window')),
                                  'attention type'),
    (dict(norm_cfg=dict(type='GN')), 'valid types'), (dict(ffn_type='moe'), 'ffn_type'),
    (dict(bn_stats='sync'), 'bn_stats'), (dict(out_indices=(0, 4)), 'out_indices'),
    (dict(ffn_type='channel_idle', idle_ratio=-0.1), 'idle_ratio')])
def test_backbone_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ReparamSwinTransformer(**{**TINY, **kwargs})


def test_registered_in_both_scopes():
    from mmdet.registry import MODELS as DET
    from mmseg.registry import MODELS as SEG
    for name in ('ReparamSwinTransformer', 'PRepBNSwin', 'SLABSwin', 'RePaSwin', 'RepBN',
                 'PRepBN', 'UN', 'SLA'):
        assert DET.get(name) is SEG.get(name) is not None


def test_registering_a_taken_name_is_an_error():
    from mmslab.registry import register_model
    with pytest.raises(KeyError, match='already taken'):
        register_model('SwinTransformer')(type('Clash', (nn.Module, ), {}))
    with pytest.raises(KeyError, match='already taken'):
        register_model('RepBN')(type('Clash2', (nn.Module, ), {}))
    with pytest.raises(KeyError, match='already taken'):
        register_model('LN')(type('Clash3', (nn.Module, ), {}))


@pytest.mark.parametrize('name', ['SLABSwin', 'RePaSwin'])
def test_fused_backbone_takes_a_non_contiguous_image(name):
    """A channels-last or transposed image (numpy's HWC -> CHW without a copy) gives the same
    outputs as its contiguous copy, unfused and fused (patch merging once failed on a view)."""
    torch.manual_seed(0)
    model = build_preset(name).eval()
    model.init_weights()
    # [1, 3, 45, 70] as numpy gives an HWC image transposed: strides (1, 1, 210, 3)
    x = torch.from_numpy(np.random.RandomState(0).randn(45, 70, 3).astype(np.float32)
                         .transpose(2, 0, 1)[None])
    for fused in (False, True):
        if fused:
            mmslab.reparameterize(model)
        with torch.no_grad():
            ref = model(x.contiguous())
            for image in (x, x.contiguous(memory_format=torch.channels_last)):
                for r, o in zip(ref, model(image)):
                    assert rel_err(o, r) < 1e-5


def test_fused_slab_swin_in_chunks_on_real_photographs(tmp_path, monkeypatch):
    """Real photographs (portrait, landscape, panorama: not square, no multiple of the
    windows) through a small fused SLAB-Swin in eager inference: SLA in chunks of windows
    (two windows a chunk here) gives the features of the whole map at once (held against
    the transcribed formula in test_layers) in every stage."""
    import cv2
    from glob import glob

    from conftest import make_photo_coco
    from mmslab.datasets import COCO_DEMO_CLASSES
    from mmslab.models import SLABSwin
    from mmslab.models.layers.shift_window import ShiftWindowAttention
    root = make_photo_coco(str(tmp_path), COCO_DEMO_CLASSES)
    paths = sorted(glob(f'{root}/val2017/*.jpg'))
    mean, std = np.array([123.675, 116.28, 103.53]), np.array([58.395, 57.12, 57.375])
    images = []
    for path in paths:  # half size: 300x256, 190x300, 65x256
        img = cv2.imread(path)[::2, ::2, ::-1]
        images.append(torch.from_numpy(((img - mean) / std).astype(np.float32))
                      .permute(2, 0, 1)[None])
    assert len({tuple(x.shape[2:]) for x in images}) == 3
    torch.manual_seed(0)
    model = SLABSwin(embed_dims=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8),
                     window_size=(14, 7, 7, 7), out_indices=(0, 1, 2, 3))
    model.init_weights()
    randomize_bn_statistics(model)
    model = mmslab.reparameterize(model.eval())
    monkeypatch.setattr(ShiftWindowAttention, 'chunk_values', 2 * 14 * 14 * 32)
    chunks = []
    real = ShiftWindowAttention._forward_in_chunks
    monkeypatch.setattr(ShiftWindowAttention, '_forward_in_chunks',
                        lambda self, *a: chunks.append(1) or real(self, *a))
    with torch.no_grad():
        for x in images:
            out = model(x)
            with monkeypatch.context() as m:
                m.setattr(ShiftWindowAttention, 'runs_in_chunks', lambda *a: False)
                ref = model(x)
            for r, o in zip(ref, out):
                assert rel_err(o, r) <= 1e-5, tuple(x.shape)
    sla_blocks = sum(isinstance(m, ShiftWindowAttention) and m.w_msa.masks_padding
                     for m in model.modules())
    assert sla_blocks and len(chunks) == 3 * sla_blocks  # each SLA block ran in chunks
