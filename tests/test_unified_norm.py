"""Unified Normalization (UN) against a direct, step-by-step transcription of its algorithm.

The reference below is written from the UN paper (Yang et al., ACM MM 2022) and, where the two
differ, from the authors' reference implementation (GitHub hikvision-research/
Unified-Normalization): one scalar outlier threshold per layer, gradient EMA used also during
warm-up, gradient scale applied to the incoming gradient and set to 1 on outlier steps.
"""
import copy

import pytest
import torch

from mmslab.models.layers.unified_norm import UN

C = 4
M, WARMUP, START, CLAMP, MOM, EPS = 3, 5, 7, 1.3, 0.9, 1e-5
STEPS, OUTLIER_STEP = 14, 10
F64 = torch.float64
# Stationary per-channel scales of the random batches.
SCALE = torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=F64)


def _to_rows(t, data_format):
    """``[..., C]`` or ``[B, C, *]`` -> ``[N, C]``."""
    if data_format == 'channels_first':
        t = t.movedim(1, -1)
    return t.reshape(-1, C)


def _make_steps(data_format, outlier=True, seed=0, steps=STEPS):
    """Fresh noisy batches ``randn * per-channel scale`` each step, one 40x outlier batch."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, 5, C) if data_format == 'channels_last' else (2, C, 3, 2)
    scale = SCALE if data_format == 'channels_last' else SCALE.view(C, 1, 1)
    xs, gs = [], []
    for t in range(steps):
        x = torch.randn(*shape, generator=gen, dtype=F64) * scale
        if outlier and t == OUTLIER_STEP:
            x = x * 40.0
        xs.append(x)
        gs.append(torch.randn(*shape, generator=gen, dtype=F64))
    return xs, gs


def _reference(xs, gs, w, b, filtration, warmup=WARMUP, clamp=CLAMP, start=START):
    """UN training steps on ``[N, C]`` rows, written out with plain tensor operations."""
    acts, grads = [], []  # recorded activation / gradient statistics, oldest first
    running = torch.ones(C, dtype=F64)
    psi = torch.zeros(C, dtype=F64)  # gradient EMA, starts at 0
    out = []
    for t, (x, gy) in enumerate(zip(xs, gs)):
        # ---- forward
        s = (x * x).mean(0)
        active = len(acts) >= M and t >= warmup
        if active:
            # Scalar threshold: M * unbiased variance of every sqrt entry of the previous window.
            roots = torch.stack(acts[-M:]).sqrt().flatten()
            threshold = M * ((roots - roots.mean()) ** 2).sum() / (roots.numel() - 1)
        acts.append(s)
        mode, var = 'current', s
        if active:
            window = torch.stack(acts[-M:])
            am, gm = window.mean(0), window.prod(0) ** (1.0 / M)
            mode, var = 'average', gm
            if filtration and bool((am - gm > threshold).any()):
                mode, var = 'outlier', s
                acts[-1] = running  # passivated with the estimate from before this step
        r = torch.ones(C, dtype=F64)
        if clamp is not None and t >= max(start, warmup) and mode != 'outlier':
            r = (torch.sqrt(var + EPS) / torch.sqrt(running + EPS)).clamp(1 / clamp, clamp)
        running = MOM * running + (1 - MOM) * var
        z = x / torch.sqrt(var + EPS)
        y = w * z + b
        # ---- backward
        g = gy * r * w
        gstat = (g * z).mean(0)
        grads.append(psi if mode == 'outlier' else gstat)
        fed = torch.stack(grads[-M:]).mean(0) if mode == 'average' else gstat
        psi = MOM * psi + (1 - MOM) * fed
        used = gstat if mode == 'outlier' else psi
        dx = (g - used * z) / torch.sqrt(var + EPS)
        out.append(dict(mode=mode, r=r, y=y, dx=dx, dw=(gy * r * z).sum(0), db=gy.sum(0),
                        running=running, grad_est=psi, window=torch.stack(acts[-M:]),
                        grad_window=torch.stack(grads[-M:])))
    return out


def _un(**kw):
    args = dict(eps=EPS, window_size=M, warmup_iters=WARMUP, momentum=MOM,
                grad_scale_clamp=CLAMP, grad_scale_start=START)
    args.update(kw)
    return UN(C, **args).double()


def _train_step(un, t, x, g):
    un.set_iter(t)
    un.zero_grad()
    x = x.clone().requires_grad_()
    y = un(x)
    y.backward(g)
    return dict(y=y.detach(), dx=x.grad, dw=un.weight.grad.clone(), db=un.bias.grad.clone(),
                running=un.running_var.clone(), grad_est=un.grad_est.clone(),
                window=un.window.clone(), grad_window=un.grad_window.clone())


def _train(un, xs, gs):
    return [_train_step(un, t, x, g) for t, (x, g) in enumerate(zip(xs, gs))]


@pytest.mark.parametrize('data_format', ['channels_last', 'channels_first'])
@pytest.mark.parametrize('filtration,warmup', [(True, WARMUP), (False, WARMUP), (True, 0)])
def test_matches_reference_steps(data_format, filtration, warmup):
    xs, gs = _make_steps(data_format)
    un = _un(outlier_filtration=filtration, data_format=data_format, warmup_iters=warmup)
    with torch.no_grad():
        un.weight.copy_(torch.tensor([1.5, -0.7, 0.9, 2.0]))
        un.bias.copy_(torch.tensor([0.1, 0.2, -0.3, 0.0]))
    w, b = un.weight.detach().clone(), un.bias.detach().clone()
    ref = _reference([_to_rows(x, data_format) for x in xs],
                     [_to_rows(g, data_format) for g in gs], w, b, filtration, warmup)
    modes = [r['mode'] for r in ref]
    # The noisy data must exercise every phase: fill-up/warm-up, geometric mean, one outlier.
    first = max(warmup, M)
    assert modes[:first + 1] == ['current'] * first + ['average']
    assert modes[OUTLIER_STEP] == ('outlier' if filtration else 'average')
    assert modes.count('outlier') == (1 if filtration else 0)
    assert modes.count('average') >= 7
    # ... and the gradient scale: 1 before its start, inside the clamp and at the clamp after.
    scale_from = max(START, warmup)
    rs = torch.stack([r['r'] for r in ref])
    assert torch.equal(rs[:scale_from], torch.ones(scale_from, C, dtype=F64))
    after = torch.cat([rs[scale_from:OUTLIER_STEP], rs[OUTLIER_STEP + 1:]])
    at_clamp = torch.isclose(after, torch.tensor(1 / CLAMP, dtype=F64)) \
        | torch.isclose(after, torch.tensor(CLAMP, dtype=F64))
    assert at_clamp.any() and not at_clamp.all()
    assert bool((after != 1).all())
    if filtration:
        assert torch.equal(rs[OUTLIER_STEP], torch.ones(C, dtype=F64))

    got = _train(un, xs, gs)
    for t, (r, g) in enumerate(zip(ref, got)):
        msg = f'at step {t} ({r["mode"]})'
        for key in ('y', 'dx'):
            torch.testing.assert_close(_to_rows(g[key], data_format), r[key], rtol=1e-9,
                                       atol=1e-12, msg=lambda m, k=key: f'{k} {msg}: {m}')
        keys = ['dw', 'db', 'running', 'grad_est']
        if t >= M - 1:  # window buffers are fully populated
            keys += ['window', 'grad_window']
        for key in keys:
            torch.testing.assert_close(g[key], r[key], rtol=1e-9, atol=1e-12,
                                       msg=lambda m, k=key: f'{k} {msg}: {m}')
    assert int(un.num_filled) == M and int(un.grad_filled) == M


def test_reference_catches_wrong_variants():
    """The comparison above can fail: the flawed variants differ from the reference."""
    xs, gs = _make_steps('channels_last')
    xs, gs = [_to_rows(x, 'channels_last') for x in xs], [_to_rows(g, 'channels_last') for g in gs]
    w, b = torch.ones(C, dtype=F64), torch.zeros(C, dtype=F64)
    ref = _reference(xs, gs, w, b, True)
    # Per-channel population-variance threshold of the previous window (the old defect).
    acts, fired = [], 0
    for t, x in enumerate(xs):
        s = (x * x).mean(0)
        prev = acts[-M:]
        acts.append(s)
        if len(prev) == M and t >= WARMUP:
            window = torch.stack(acts[-M:])
            gm = window.prod(0) ** (1.0 / M)
            thr = M * torch.stack(prev).sqrt().var(0, unbiased=False)
            fired += bool((window.mean(0) - gm > thr).any())
    assert fired > [r['mode'] for r in ref].count('outlier')


@pytest.mark.parametrize('margin,fires', [(0.5, False), (1.1, True)])
def test_outlier_threshold_is_one_unbiased_scalar(margin, fires):
    """Threshold = M * unbiased variance of all sqrt entries of the previous window."""
    import statistics
    prev = [[1.0, 10.0], [1.1, 10.0]]  # sqrt of the recorded statistics, [iteration][channel]
    entries = [v for row in prev for v in row]
    unbiased, biased = 2 * statistics.variance(entries), 2 * statistics.pvariance(entries)
    # Channel 0 jumps: its AM - GM, (sqrt(a) - sqrt(b))^2 / 2 for M = 2, lies a fraction
    # `margin` of the way from the biased to the unbiased threshold (or beyond it); a
    # per-channel threshold (0.005 for channel 0) would fire in both cases.
    gap = biased + margin * (unbiased - biased)
    new = [prev[1][0] + (2 * gap) ** 0.5, 10.0]
    un = UN(2, window_size=2, warmup_iters=0, grad_scale_clamp=None).double()
    with torch.no_grad():
        for t, row in enumerate(prev + [new]):
            un.set_iter(t)
            un(torch.tensor([row], dtype=F64))  # one token: s = row^2 exactly
    assert un.iteration_mode == (2, 'outlier' if fires else 'average')


def test_outlier_slots_are_passivated():
    xs, gs = _make_steps('channels_last')
    n = OUTLIER_STEP
    with_f, without = _un(outlier_filtration=True), _un(outlier_filtration=False)
    for un in (with_f, without):
        _train(un, xs[:n], gs[:n])
    running_before = with_f.running_var.clone()
    est_before = with_f.grad_est.clone()
    for un in (with_f, without):
        _train_step(un, n, xs[n], gs[n])
    s = xs[n].square().mean(dim=(0, 1))
    assert torch.equal(with_f.window[-1], running_before)
    assert torch.equal(with_f.grad_window[-1], est_before)
    assert torch.equal(without.window[-1], s)
    assert bool((s > 50 * running_before).all())
    # The running variance still takes the outlier's statistic; the gradient EMA keeps moving.
    torch.testing.assert_close(with_f.running_var, MOM * running_before + (1 - MOM) * s)
    assert not torch.equal(with_f.grad_est, est_before)


def _firing_rate(channels, iters=60, tokens=(2, 64), seed=0):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(0.5 * torch.randn(channels, generator=gen))  # fixed per channel
    un = UN(channels, window_size=4, warmup_iters=0)
    fired = 0
    with torch.no_grad():
        for t in range(iters):
            un.set_iter(t)
            un(torch.randn(*tokens, channels, generator=gen) * scale)
            fired += t >= 4 and un.iteration_mode[1] == 'outlier'
    return fired / (iters - 4), un


@pytest.mark.parametrize('channels', [96, 768])
def test_outlier_filter_fires_rarely_on_stationary_data(channels):
    rate, un = _firing_rate(channels)
    assert rate < 0.1, rate
    # A real outlier batch is still caught in a wide layer.
    un.set_iter(1000)
    with torch.no_grad():
        un(40 * torch.randn(2, 64, channels))
    assert un.iteration_mode == (1000, 'outlier')


def test_eval_output_is_running_affine():
    xs, gs = _make_steps('channels_first')
    un = _un(data_format='channels_first')
    with torch.no_grad():
        un.weight.uniform_(0.5, 2.0)
        un.bias.uniform_(-1, 1)
    _train(un, xs[:8], gs[:8])
    un.eval()
    x = xs[-1]
    before = (un.window.clone(), un.running_var.clone(), int(un.num_filled))
    shape = (1, C, 1, 1)
    expected = (un.weight.view(shape) * x / torch.sqrt(un.running_var.view(shape) + EPS)
                + un.bias.view(shape))
    torch.testing.assert_close(un(x), expected, rtol=1e-12, atol=1e-12)
    # Eval forwards leave the statistics alone.
    assert torch.equal(un.window, before[0]) and torch.equal(un.running_var, before[1])
    assert int(un.num_filled) == before[2]


@pytest.mark.parametrize('data_format', ['channels_last', 'channels_first'])
def test_switch_to_deploy(data_format):
    xs, gs = _make_steps(data_format)
    un = _un(data_format=data_format)
    with torch.no_grad():
        un.weight.uniform_(0.5, 2.0)
        un.bias.uniform_(-1, 1)
    _train(un, xs[:9], gs[:9])
    with pytest.raises(RuntimeError, match='eval mode'):
        un.switch_to_deploy()  # still in train mode
    un.eval()
    x = xs[-1]
    expected = un(x)
    un.switch_to_deploy()
    assert un.deploy
    got = un(x)
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel <= 1e-6
    assert set(un.state_dict()) == {'weight', 'bias'}
    params = [p.clone() for p in un.parameters()]
    un.switch_to_deploy()  # idempotent
    assert all(torch.equal(a, b) for a, b in zip(params, un.parameters()))
    torch.testing.assert_close(un(x), got, rtol=0, atol=0)

    fresh = UN(C, data_format=data_format, deploy=True).double().eval()
    fresh.load_state_dict(un.state_dict())
    torch.testing.assert_close(fresh(x), got, rtol=0, atol=0)
    un.set_iter(5)
    un.reset_iter()  # no-ops in deploy form


def test_extra_forwards_in_one_iteration_do_not_advance():
    gen = torch.Generator().manual_seed(1)
    un = _un(warmup_iters=0, grad_scale_clamp=None, outlier_filtration=False)
    for t in range(M + 2):
        un.set_iter(t)
        un(torch.randn(6, C, generator=gen, dtype=F64)).sum().backward()
    t = M + 2
    un.set_iter(t)
    x1 = torch.randn(6, C, generator=gen, dtype=F64, requires_grad=True)
    x2 = 3 * torch.randn(6, C, generator=gen, dtype=F64, requires_grad=True)
    y1 = un(x1)
    state = {k: v.clone() for k, v in un.state_dict().items()}
    assert int(un.last_iter) == t
    y2 = un(x2)
    y3 = un(x2)
    for k, v in un.state_dict().items():
        if k not in ('weight', 'bias', 'grad_window', 'grad_est', 'grad_iter', 'grad_filled'):
            assert torch.equal(v, state[k]), k
    # Averages active: every forward of the iteration uses the same geometric mean.
    gm = un.window.log().mean(0).exp()
    torch.testing.assert_close(y2, un.weight * x2 / torch.sqrt(gm + EPS) + un.bias)
    torch.testing.assert_close(y1, un.weight * x1 / torch.sqrt(gm + EPS) + un.bias)
    torch.testing.assert_close(y2, y3)
    # One gradient push per iteration, however many backward passes.
    old_grad_window = un.grad_window.clone()
    (y1.sum() + y2.sum() + y3.sum()).backward()
    assert int(un.grad_iter) == t
    assert torch.equal(un.grad_window[:-1], old_grad_window[1:])
    est = un.grad_est.clone()
    x1.grad = None
    un(x1).sum().backward()  # a later backward of the same iteration
    assert torch.equal(un.grad_window[:-1], old_grad_window[1:])
    assert torch.equal(un.grad_est, est)
    # Both backward passes used the same estimate: identical gradient for the same input/grad.
    g_later = x1.grad.clone()
    x1.grad = None
    un.set_iter(t)
    un(x1).sum().backward()
    torch.testing.assert_close(x1.grad, g_later)


def test_extra_forward_uses_same_gradient_scale():
    """A second forward of an iteration scales with the running_var from before the update."""
    xs, gs = _make_steps('channels_last')
    un = _un(grad_scale_clamp=100.0)
    _train(un, xs[:9], gs[:9])
    un.set_iter(9)
    un.zero_grad()
    a, b = xs[9].clone().requires_grad_(), xs[9].clone().requires_grad_()
    ya, yb = un(a), un(b)
    assert un.iteration_mode == (9, 'average')
    (ya * gs[9]).sum().backward()
    (yb * gs[9]).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)


def test_extra_forward_in_warmup_uses_own_statistic():
    un = _un(warmup_iters=100)
    un.set_iter(0)
    un(torch.randn(5, C, dtype=F64))
    x = 4 * torch.randn(5, C, dtype=F64)
    expected = x / torch.sqrt((x * x).mean(0) + EPS)
    torch.testing.assert_close(un(x), expected)
    assert int(un.num_filled) == 1


def test_reset_iter_restarts_warmup():
    gen = torch.Generator().manual_seed(2)
    un = _un(warmup_iters=3, grad_scale_clamp=None, outlier_filtration=False)
    for t in range(6):
        un.set_iter(t)
        un(torch.randn(8, C, generator=gen, dtype=F64) * (1 + t))
    x = torch.randn(8, C, generator=gen, dtype=F64)
    current = x / torch.sqrt((x * x).mean(0) + EPS)
    un.set_iter(6)
    assert not torch.allclose(un(x), current)  # averaged after warm-up
    un.reset_iter()
    assert int(un.cur_iter) == 0 and int(un.num_filled) == 0
    torch.testing.assert_close(un(x), current)  # warm-up again: current statistics
    for t in range(1, 4):
        un.set_iter(t)
        torch.testing.assert_close(un(x), current)
    un.set_iter(4)
    assert int(un.num_filled) == M
    un(2 * x)
    assert un.iteration_mode == (4, 'average')


def test_training_without_set_iter_raises():
    with pytest.raises(RuntimeError, match='ProgressiveNormHook'):
        UN(C)(torch.randn(3, C))


def test_float32_half_inputs_and_shape_check():
    un = UN(C, warmup_iters=0)
    un.set_iter(0)
    x = torch.randn(2, 3, C, dtype=torch.float16, requires_grad=True)
    y = un(x)
    assert y.dtype == torch.float16 and y.shape == x.shape
    y.float().sum().backward()
    assert x.grad.dtype == torch.float16
    assert un.weight.grad.dtype == torch.float32 and un.bias.grad.dtype == torch.float32
    with pytest.raises(ValueError, match='shape'):
        un(torch.randn(2, C + 1))
    with pytest.raises(ValueError, match='shape'):
        UN(C, data_format='channels_first').eval()(torch.randn(2, 3, C))


@pytest.mark.parametrize('kwargs', [
    dict(num_features=0), dict(num_features=2.5), dict(window_size=1), dict(window_size=2.5),
    dict(warmup_iters=-1), dict(momentum=0.0), dict(momentum=1.0), dict(momentum=1.5),
    dict(eps=0.0), dict(eps=-1e-5), dict(data_format='NCHW'), dict(grad_scale_clamp=0.5),
    dict(grad_scale_start=-1),
])
def test_invalid_arguments(kwargs):
    args = dict(num_features=C)
    args.update(kwargs)
    with pytest.raises(ValueError):
        UN(**args)


def test_registered():
    from mmslab.registry import MODELS
    from mmdet.registry import MODELS as MMDET_MODELS
    from mmseg.registry import MODELS as MMSEG_MODELS
    for registry in (MODELS, MMDET_MODELS, MMSEG_MODELS):
        assert registry.get('UN') is UN
    built = MMDET_MODELS.build(dict(type='UN', num_features=C, warmup_iters=10))
    assert isinstance(built, UN) and built.warmup_iters == 10
    assert copy.deepcopy(built).window.shape == (4, C)


def test_gradient_average_is_over_the_recorded_statistics_only():
    """Iterations without a backward fill the activation window, not the gradient one: once
    the averages are active the gradient EMA takes the mean of the statistics recorded, not
    of the whole window (a reset leaves none behind)."""
    gen = torch.Generator().manual_seed(2)
    un = _un(warmup_iters=0, grad_scale_clamp=None, outlier_filtration=False)
    un.reset_iter()
    for t in range(M):  # all but the last without a backward
        un.set_iter(t)
        x = torch.randn(6, C, generator=gen, dtype=F64, requires_grad=True)
        y = un(x)
        if t == M - 1:
            y.pow(2).sum().backward()
    assert int(un.grad_filled) == 1
    un.set_iter(M)
    est = un.grad_est.clone()
    un(torch.randn(6, C, generator=gen, dtype=F64)).pow(2).sum().backward()
    assert un.iteration_mode == (M, 'average') and int(un.grad_filled) == 2
    recorded = un.grad_window[-2:].mean(dim=0)
    torch.testing.assert_close(un.grad_est, MOM * est + (1 - MOM) * recorded)
