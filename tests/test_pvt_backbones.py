"""The configurable PVT v1: mmdet equivalence, presets and exact re-parameterization."""
import pytest
import torch

import mmslab
from conftest import randomize_bn_statistics, rel_err
from presets import PVT_TINY as TINY  # also imported from here by test_dynamic_export
from mmslab.engine.hooks import set_progressive_iter
from mmslab.models import ReparamPVT, statistic_modules


def test_layernorm_pvt_equals_mmdet_pvt():
    from mmdet.models.backbones import PyramidVisionTransformer
    torch.manual_seed(0)
    ref = PyramidVisionTransformer(**TINY).eval()
    ref.init_weights()
    ours = ReparamPVT(**TINY).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    for hw in [(64, 64), (96, 80)]:
        x = torch.randn(1, 3, *hw)
        with torch.no_grad():
            for a, b in zip(ref(x), ours(x)):
                assert a.shape == b.shape
                assert rel_err(b, a) <= 1e-5


@pytest.mark.parametrize('type_,kwargs', [
    ('PRepBNPVT', dict(norm_cfg=dict(type='PRepBN', step=4))),
    ('SLABPVT', dict(norm_cfg=dict(type='PRepBN', step=4))),
    ('ReparamPVT', dict(norm_cfg=dict(type='RepBN'), attn_types=('sla', 'softmax', 'sla',
                                                                  'softmax')))])
def test_pvt_presets_train_and_fold_exactly(type_, kwargs):
    from mmseg.registry import MODELS
    torch.manual_seed(0)
    model = MODELS.build(dict(type=type_, **TINY, **kwargs))
    model.init_weights()
    model.train()
    for it in range(2):
        set_progressive_iter(model, it)
        sum(o.mean() for o in model(torch.randn(2, 3, 64, 64))).backward()
    randomize_bn_statistics(model, seed=1, alpha=0.3)
    model.eval()
    x = torch.randn(1, 3, 80, 112)
    with torch.no_grad():
        ref = model(x)
        assert [o.shape[1] for o in ref] == [8, 16, 16, 32]
        mmslab.reparameterize(model)
        fused = model(x)
    for r, f in zip(ref, fused):
        assert rel_err(f, r) <= 1e-4
    assert statistic_modules(model) == []
    deployed = MODELS.build(dict(type=type_, **TINY, **kwargs, deploy=True)).eval()
    deployed.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        for r, d in zip(ref, deployed(x)):
            assert rel_err(d, r) <= 1e-4


def test_pvt_rejects_bad_arguments():
    with pytest.raises(ValueError, match='attention type'):
        ReparamPVT(**TINY, attn_types=('linear', ) * 4)
    with pytest.raises(ValueError, match='arch'):
        ReparamPVT(arch='huge')
    with pytest.raises(ValueError, match='one entry per stage'):
        ReparamPVT(**{**TINY, 'sr_ratios': (8, 4)})
