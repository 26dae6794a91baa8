"""BN re-calibration restores true statistics and leaves everything else as it was."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mmslab.models.layers.bn_recalibration import recalibrate_bn
from mmslab.models.layers.unified_norm import UN

BATCH, NUM_BATCHES = 64, 6


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 4),
                          UN(4, warmup_iters=0), nn.Conv1d(4, 2, 1),
                          nn.BatchNorm1d(2, track_running_stats=False))
    with torch.no_grad():  # wrong statistics, as after training with drop-path
        model[1].running_mean.fill_(5.0)
        model[1].running_var.fill_(100.0)
        model[4].running_var.fill_(7.0)
    return model


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _model()

    def forward(self, x):
        h = self.body[:5](x)
        return self.body[5:](h.unsqueeze(-1))


def _data():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH * NUM_BATCHES, 3, generator=gen) * torch.tensor([1.0, 3.0, 0.5]) + 2.0
    return x, list(x.split(BATCH))


def test_recalibrated_statistics_match_data():
    net = _Net()
    net.train()
    net.body[3].eval()  # a flag that must come back as it was
    net.body[0].bias.requires_grad_(False)
    bn, un = net.body[1], net.body[4]
    params = {k: v.clone() for k, v in net.named_parameters()}
    flags = {k: v.requires_grad for k, v in net.named_parameters()}
    modes = {k: m.training for k, m in net.named_modules()}
    x, batches = _data()

    out = recalibrate_bn(net, batches, NUM_BATCHES)
    assert out is net

    # BN: statistics of its input over the whole data (equal batches, so the cumulative average
    # of batch means is the data mean; batch variances average to the data variance).
    with torch.no_grad():
        h = net.body[0](x)
    torch.testing.assert_close(bn.running_mean, h.mean(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bn.running_var, h.var(0), rtol=0.05, atol=0)
    assert int(bn.num_batches_tracked) == NUM_BATCHES
    # UN: average over batches of the quadratic mean of its input, with train-mode BN before it.
    with torch.no_grad():
        expected = torch.stack([
            net.body[3](F.relu(F.batch_norm(net.body[0](b), None, None, bn.weight, bn.bias,
                                            training=True, eps=bn.eps))).square().mean(0)
            for b in batches]).mean(0)
    torch.testing.assert_close(un.running_var, expected, rtol=1e-5, atol=1e-6)

    for k, v in net.named_parameters():
        assert torch.equal(v, params[k]), k
        assert v.requires_grad == flags[k], k
        assert v.grad is None, k
    assert {k: m.training for k, m in net.named_modules()} == modes
    assert bn.momentum == 0.1 and un.momentum == 0.9


def test_loader_restarts_and_iterator_runs_out():
    net = _Net()
    _, batches = _data()
    recalibrate_bn(net, batches[:2], 5)  # a list is re-iterated
    assert int(net.body[1].num_batches_tracked) == 5
    with pytest.warns(UserWarning, match='ran out after 2 of 5'):
        recalibrate_bn(net, iter(batches[:2]), 5)
    assert int(net.body[1].num_batches_tracked) == 2


def test_custom_forward_and_restore_on_error():
    net = _Net()
    net.train()
    _, batches = _data()
    seen = []

    def forward_fn(model, batch):
        seen.append(batch['x'].shape[0])
        assert not torch.is_grad_enabled()
        assert model.body[1].training and not model.body[0].training
        return model(batch['x'])

    recalibrate_bn(net, [dict(x=b) for b in batches], 3, forward_fn=forward_fn)
    assert seen == [BATCH] * 3

    def failing(model, batch):
        raise RuntimeError('boom')

    with pytest.raises(RuntimeError, match='boom'):
        recalibrate_bn(net, batches, 2, forward_fn=failing)
    assert net.training and net.body[1].momentum == 0.1 and net.body[4].momentum == 0.9
    assert all(p.requires_grad for p in net.parameters())
    with pytest.raises(TypeError, match='forward_fn'):
        recalibrate_bn(net, [dict(x=b) for b in batches], 1)
    with pytest.raises(ValueError, match='num_iters'):
        recalibrate_bn(net, batches, 0)
