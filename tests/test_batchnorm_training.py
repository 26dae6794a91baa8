"""BatchNorm in training as multi-GPU training expects it: one running-statistics update per
step under activation checkpointing, normalization before autocast rounds the tokens, and
every BatchNorm mmslab trains reached by SyncBatchNorm conversion."""
import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from conftest import rel_err
from presets import build_preset
from mmslab.engine.hooks import set_progressive_iter
from mmslab.models.layers import ChannelIdleFFN, PRepBN, RepBN, TokenBN

#: one preset per norm / FFN that keeps statistics (PRESETS of tests/presets.py)
NORM_PRESETS = {
    'PRepBN': ('PRepBNSwin', {}),
    'RepBN': ('BiNormSwin', {}),
    'TokenBN': ('PRepBNSwin', dict(norm_cfg=dict(type='TokenBN'))),
    'UN': ('UNSwin', {}),
    'ChannelIdleFFN': ('RePaSwin', {}),
}


def statistics(model):
    return {k: v.clone() for k, v in model.state_dict().items()
            if 'running' in k or 'num_batches' in k or 'window' in k or 'iter' in k
            or 'filled' in k or 'grad_est' in k}


@pytest.mark.parametrize('norm', sorted(NORM_PRESETS))
def test_with_cp_updates_running_statistics_once_per_step(norm):
    preset, extra = NORM_PRESETS[norm]
    torch.manual_seed(0)
    plain = build_preset(preset, **extra)
    checkpointed = build_preset(preset, with_cp=True, **extra)
    checkpointed.load_state_dict(plain.state_dict())
    outs = []
    for model in (plain, checkpointed):
        model.train()
        torch.manual_seed(1)
        for it in range(3):
            set_progressive_iter(model, it + 1)
            x = torch.randn(2, 3, 32, 48) * 2 + 1
            out = model(x)
            sum(o.square().mean() for o in out).backward()
        outs.append([o.detach() for o in out])
    stats = [statistics(m) for m in (plain, checkpointed)]
    assert stats[0], norm
    tracked = [v for k, v in stats[1].items() if k.endswith('num_batches_tracked')]
    if norm != 'UN':
        assert tracked and all(int(v) == 3 for v in tracked), norm
    for key, value in stats[0].items():
        assert torch.allclose(value.float(), stats[1][key].float(), atol=1e-6), (norm, key)
    for a, b in zip(*outs):
        assert rel_err(b, a) < 1e-5, norm
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        if p.grad is not None:
            assert rel_err(q.grad, p.grad) < 1e-4, (norm, name)


def far_from_zero_tokens(c=64, n=4096, seed=0):
    """Tokens whose channel means are 20 times their standard deviations."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(c, generator=g) * 20
    return mean + torch.randn(n, c, generator=g)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_batchnorms_normalize_before_autocast_rounds_the_tokens(dtype):
    """``fc1(norm1(x))`` of the channel-idle FFN and each BatchNorm norm under autocast
    against the same modules run in float32: the error of rounding normalized tokens (a
    fraction of a percent), not that of rounding raw ones against a large folded bias."""
    if dtype == torch.float16:
        pytest.importorskip('torch', minversion='2.1')
    x = far_from_zero_tokens()
    torch.manual_seed(0)
    ffn = ChannelIdleFFN(64, 256).train()
    ref = ffn.fc1(ffn.norm1(x)).detach()
    ffn_copy = copy.deepcopy(ffn)
    with torch.autocast('cpu', dtype=dtype):
        out = ffn_copy.fc1(ffn_copy.norm1(x))  # the path forward() takes
        full = ffn_copy(x[None])
    assert rel_err(out.float(), ref) < 0.01
    expected = copy.deepcopy(ffn)(x[None])
    assert rel_err(full.float() - x, (expected - x).detach()) < 0.03
    for norm in (TokenBN(64), RepBN(64), PRepBN(64, step=4, warmup=0)):
        norm.train()
        if isinstance(norm, PRepBN):
            norm.set_iter(2)  # mid-decay: both branches
        ref = copy.deepcopy(norm)(x).detach()
        with torch.autocast('cpu', dtype=dtype):
            out = norm(x)
        assert rel_err(out.float(), ref) < 0.01, type(norm).__name__


def count_sync_bn_forwards(model):
    calls = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.SyncBatchNorm):
            calls[name] = 0
            m.register_forward_pre_hook(lambda mod, args, name=name: calls.__setitem__(
                name, calls[name] + 1))
    return calls


@pytest.mark.parametrize('preset', ['RePaSwin', 'PRepBNSwin', 'BiNormSwin', 'TokenBN'])
@pytest.mark.parametrize('convert', ['torch', 'mmengine'])
def test_every_batchnorm_is_run_as_a_sync_batchnorm_after_conversion(preset, convert):
    """After ``nn.SyncBatchNorm.convert_sync_batchnorm`` or mmengine's ``sync_bn='torch'``,
    every BatchNorm of the model is a SyncBatchNorm and runs in a training forward (on the
    CPU, without a process group, SyncBatchNorm normalizes like BatchNorm: its forward is
    counted)."""
    from mmengine.model import convert_sync_batchnorm
    extra = dict(norm_cfg=dict(type='TokenBN')) if preset == 'TokenBN' else {}
    torch.manual_seed(0)
    model = build_preset('PRepBNSwin' if preset == 'TokenBN' else preset, **extra)
    bns = [n for n, m in model.named_modules() if isinstance(m, _BatchNorm)]
    assert bns
    if convert == 'torch':
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    else:
        model = convert_sync_batchnorm(model, implementation='torch')
    calls = count_sync_bn_forwards(model)
    assert sorted(calls) == sorted(bns)
    model.train()
    set_progressive_iter(model, 2)  # PRepBN mid-decay: its BN runs
    sum(o.sum() for o in model(torch.randn(2, 3, 32, 48))).backward()
    skipped = sorted(n for n, c in calls.items() if c == 0)
    assert not skipped, f'SyncBatchNorm modules never called: {skipped}'
