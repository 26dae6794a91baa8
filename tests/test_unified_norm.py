"""Unified Normalization (UN) against a direct, step-by-step transcription of the paper."""
import copy

import pytest
import torch

from mmslab.models.layers.unified_norm import UN

C = 4
M, WARMUP, START, CLAMP, MOM, EPS = 3, 5, 7, 1.3, 0.9, 1e-5
STEPS, OUTLIER_STEP = 14, 10
F64 = torch.float64


def _to_rows(t, data_format):
    """``[..., C]`` or ``[B, C, *]`` -> ``[N, C]``."""
    if data_format == 'channels_first':
        t = t.movedim(1, -1)
    return t.reshape(-1, C)


def _make_steps(data_format, outlier=True, seed=0):
    """Inputs whose per-channel quadratic mean drifts smoothly, plus one outlier batch.

    The outlier test compares window dispersions, so i.i.d. batch noise trips it often (see the
    module notes); a smooth drift keeps every ordinary step below the threshold.
    """
    gen = torch.Generator().manual_seed(seed)
    shape = (2, 5, C) if data_format == 'channels_last' else (2, C, 3, 2)
    dims = (0, 1) if data_format == 'channels_last' else (0, 2, 3)
    axis_shape = (C,) if data_format == 'channels_last' else (C, 1, 1)
    rate = torch.tensor([0.06, -0.05, 0.03, -0.02], dtype=F64).view(axis_shape)
    xs, gs = [], []
    for t in range(STEPS):
        x = torch.randn(*shape, generator=gen, dtype=F64) + 0.3
        x = x / x.square().mean(dim=dims, keepdim=True).sqrt()  # quadratic mean exactly 1
        x = x * torch.exp(rate * t)
        if outlier and t == OUTLIER_STEP:
            x = x * 40.0
        xs.append(x)
        gs.append(torch.randn(*shape, generator=gen, dtype=F64))
    return xs, gs


def _reference(xs, gs, w, b, filtration, warmup=WARMUP):
    """Paper Algorithm 2 with Eq. 18-19 and the clamped gradient scale, on ``[N, C]`` rows."""
    acts, grads = [], []  # recorded statistics, oldest first
    running, psi = torch.ones(C, dtype=F64), None
    out = []
    for t, (x, g) in enumerate(zip(xs, gs)):
        s = (x * x).mean(0)
        previous = acts[-M:]
        acts.append(s)
        mode, var = 'current', s
        if len(previous) == M and t >= warmup:
            window = torch.stack(acts[-M:])
            gm = torch.prod(window, 0) ** (1.0 / M)
            mode, var = 'average', gm
            if filtration:
                roots = torch.stack(previous).sqrt()
                threshold = M * ((roots - roots.mean(0)) ** 2).mean(0)
                if bool((window.mean(0) - gm > threshold).any()):
                    mode, var = 'outlier', s
        new_running = MOM * running + (1 - MOM) * var
        if mode == 'outlier':
            acts[-1] = running  # passivated with the estimate from before this step
        running = new_running
        z = x / torch.sqrt(var + EPS)
        y = w * z + b
        dz = g * w
        gstat = (dz * z).mean(0)
        grads.append(gstat)
        if mode == 'outlier':
            grads[-1] = psi
            used = gstat
        else:
            mean = torch.stack(grads[-M:]).mean(0)
            psi = mean if psi is None else MOM * psi + (1 - MOM) * mean
            used = psi if mode == 'average' else gstat
        dx = (dz - used * z) / torch.sqrt(var + EPS)
        if t >= max(START, warmup):
            dx = dx * torch.sqrt((var + EPS) / (running + EPS)).clamp(1 / CLAMP, CLAMP)
        out.append(dict(mode=mode, y=y, dx=dx, dw=(g * z).sum(0), db=g.sum(0),
                        running=running.clone()))
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
                running=un.running_var.clone())


def _train(un, xs, gs):
    return [_train_step(un, t, x, g) for t, (x, g) in enumerate(zip(xs, gs))]


@pytest.mark.parametrize('data_format', ['channels_last', 'channels_first'])
@pytest.mark.parametrize('filtration,warmup', [(True, WARMUP), (False, WARMUP), (True, 0)])
def test_matches_paper_formulas(data_format, filtration, warmup):
    xs, gs = _make_steps(data_format)
    un = _un(outlier_filtration=filtration, data_format=data_format, warmup_iters=warmup)
    with torch.no_grad():
        un.weight.copy_(torch.tensor([1.5, -0.7, 0.9, 2.0]))
        un.bias.copy_(torch.tensor([0.1, 0.2, -0.3, 0.0]))
    w, b = un.weight.detach().clone(), un.bias.detach().clone()
    ref = _reference([_to_rows(x, data_format) for x in xs],
                     [_to_rows(g, data_format) for g in gs], w, b, filtration, warmup)
    modes = [r['mode'] for r in ref]
    # The data must exercise every phase: fill-up/warm-up, geometric mean, outlier.
    first = max(warmup, M)  # averaging needs M earlier statistics in the window
    assert modes[:first + 1] == ['current'] * first + ['average']
    assert modes[OUTLIER_STEP] == ('outlier' if filtration else 'average')
    assert modes.count('average') >= 7

    got = _train(un, xs, gs)
    for t, (r, g) in enumerate(zip(ref, got)):
        for key in ('y', 'dx'):
            torch.testing.assert_close(_to_rows(g[key], data_format), r[key], rtol=1e-9,
                                       atol=1e-12, msg=f'{key} at step {t} ({r["mode"]})')
        for key in ('dw', 'db', 'running'):
            torch.testing.assert_close(g[key], r[key], rtol=1e-9, atol=1e-12,
                                       msg=f'{key} at step {t} ({r["mode"]})')
    assert int(un.num_filled) == M and int(un.grad_filled) == M


def test_outlier_slot_is_passivated():
    xs, gs = _make_steps('channels_last')
    n = OUTLIER_STEP
    with_f, without = _un(outlier_filtration=True), _un(outlier_filtration=False)
    for un in (with_f, without):
        _train(un, xs[:n], gs[:n])
    running_before = with_f.running_var.clone()
    for un in (with_f, without):
        _train_step(un, n, xs[n], gs[n])
    s = xs[n].square().mean(dim=(0, 1))
    assert torch.equal(with_f.window[-1], running_before)
    assert torch.equal(without.window[-1], s)
    assert s.min() > 100 * running_before.max()


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
    assert un._iter_mode == (4, 'average')


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
