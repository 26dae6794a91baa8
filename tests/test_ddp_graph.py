"""Every trainable parameter is in the graph of every training iteration.

DDP with ``find_unused_parameters=False`` (mmengine's default) aborts the next iteration when
a parameter gets no gradient. PRepBN computes only one branch at g = 1 and at g = 0; these
tests check each preset at g = 1, 0 < g < 1 and g = 0, one iteration at a time, and that the
way the idle branch is kept in the graph changes neither outputs nor the active gradients.
"""
import pytest
import torch
import torch.nn as nn

from mmslab.engine.hooks import set_progressive_iter
from mmslab.models.layers import PRepBN

SWIN = dict(embed_dims=16, depths=(2, 2, 1, 1), num_heads=(1, 2, 2, 4), window_size=4,
            drop_path_rate=0.1)
PVT = dict(embed_dims=8, num_layers=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
           mlp_ratios=(2, 2, 2, 2), pretrain_img_size=64, drop_path_rate=0.1)
STEP = 2  # g = 1, 0.5, 0 at iterations 0, 1, 2


@pytest.fixture(autouse=True)
def as_under_ddp(monkeypatch):
    """What PRepBN does under a multi-process group (tests/test_distributed.py runs the
    real thing); a single process skips keeping idle branches in the graph."""
    monkeypatch.setattr(PRepBN, 'keep_idle_in_graph', True)
CASES = {
    'PRepBNSwin': ('PRepBNSwin', SWIN, {}),
    'SLABSwin': ('SLABSwin', SWIN, dict(window_size=(8, 4, 2, 2))),
    'RePaSwin+PRepBN': ('RePaSwin', SWIN, {}),
    'UN-Swin': ('ReparamSwinTransformer', SWIN,
                dict(norm_cfg=dict(type='UN', warmup_iters=1, window_size=2))),
    'BiNorm-Swin': ('ReparamSwinTransformer', SWIN,
                    dict(attn_types=('binorm', 'binorm', 'window', 'window'))),
    'PRepBNPVT': ('PRepBNPVT', PVT, {}),
    'SLABPVT': ('SLABPVT', PVT, {}),
}


def build(name, frozen_bn_stats):
    from mmdet.registry import MODELS
    type_, base, extra = CASES[name]
    cfg = dict(type=type_, **base, bn_stats='frozen' if frozen_bn_stats else 'train')
    cfg['norm_cfg'] = dict(type='PRepBN', step=STEP)
    cfg.update(extra)
    return MODELS.build(cfg)


@pytest.mark.parametrize('frozen_bn_stats', [False, True])
@pytest.mark.parametrize('name', list(CASES))
def test_every_parameter_gets_a_gradient_in_every_iteration(name, frozen_bn_stats):
    torch.manual_seed(0)
    model = build(name, frozen_bn_stats)
    model.init_weights()
    model.train()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    for it in range(STEP + 1):
        set_progressive_iter(model, it)
        model.zero_grad(set_to_none=True)
        outs = model(torch.randn(2, 3, 64, 64))
        sum(o.square().mean() for o in outs).backward()
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, f'iteration {it}: no gradient for {missing[:5]}'
        assert len(trainable) > 0


@pytest.mark.parametrize('cur_iter,expected_g', [(0, 1.0), (STEP, 0.0)])
def test_idle_branch_gets_zero_gradient_and_active_branch_is_unchanged(cur_iter, expected_g):
    """Against plain torch modules: g = 1 is exactly a LayerNorm, g = 0 exactly BN + alpha x."""
    torch.manual_seed(0)
    c = 12
    norm = PRepBN(c, step=STEP)
    with torch.no_grad():
        norm.norm1.weight.normal_(1, 0.2)
        norm.norm1.bias.normal_(0, 0.2)
        norm.norm2.bn.weight.normal_(1, 0.2)
        norm.norm2.bn.bias.normal_(0, 0.2)
        norm.norm2.alpha.fill_(0.7)
    ln = nn.LayerNorm(c)
    bn = nn.BatchNorm1d(c)
    ln.load_state_dict(norm.norm1.state_dict())
    bn.load_state_dict(norm.norm2.bn.state_dict())
    alpha = nn.Parameter(torch.tensor(0.7))
    norm.train()
    norm.set_iter(cur_iter)
    assert norm.ratio == expected_g

    x = torch.randn(3, 20, c) * 2 + 1
    grad = torch.randn(3, 20, c)
    x1 = x.clone().requires_grad_()
    out = norm(x1)
    out.backward(grad)
    x2 = x.clone().requires_grad_()
    if expected_g == 1.0:
        ref = ln(x2)
    else:
        ref = bn(x2.reshape(-1, c)).view_as(x2) + alpha * x2
    ref.backward(grad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    # the same input gradient as the plain module
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    if expected_g == 1.0:
        torch.testing.assert_close(norm.norm1.weight.grad, ln.weight.grad)
        idle = [norm.norm2.bn.weight, norm.norm2.bn.bias, norm.norm2.alpha]
        # BN statistics were not touched by a LayerNorm-only iteration
        assert int(norm.norm2.bn.num_batches_tracked) == 0
    else:
        torch.testing.assert_close(norm.norm2.bn.weight.grad, bn.weight.grad)
        # (alpha's gradient is one dot product: float32 sums in another order)
        torch.testing.assert_close(norm.norm2.alpha.grad, alpha.grad, rtol=1e-5, atol=1e-6)
        idle = [norm.norm1.weight, norm.norm1.bias]
    for p in idle:
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0


def test_single_process_skips_the_idle_branch(monkeypatch):
    monkeypatch.setattr(PRepBN, 'keep_idle_in_graph', None)
    norm = PRepBN(8, step=STEP).train()
    norm.set_iter(0)
    norm(torch.randn(2, 5, 8)).sum().backward()
    assert norm.norm2.alpha.grad is None and norm.norm2.bn.weight.grad is None
