"""Normalization, attention and FFN layers, and the exactness of every fold."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mmslab
from conftest import explicit_shifted_window_attention, rel_err
from mmslab.engine.hooks import set_progressive_iter
from mmslab.models.layers import (SLA, ChannelIdleFFN, PRepBN, RepBN,
                                  ShiftWindowAttention, TokenBN, WindowMSA, build_norm,
                                  fold_affine_into_next_conv, fold_affine_into_next_linear,
                                  fold_affine_into_prev)


def randomize_bn(bn: nn.modules.batchnorm._BatchNorm, gen=None):
    c = bn.num_features
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(c, generator=gen))
        bn.running_var.copy_(torch.rand(c, generator=gen) * 2 + 0.2)
        bn.weight.copy_(torch.randn(c, generator=gen))
        bn.bias.copy_(torch.randn(c, generator=gen))


@pytest.mark.parametrize('dtype,tol', [(torch.float64, 1e-6), (torch.float32, 1e-4)])
@pytest.mark.parametrize('data_format', ['channels_last', 'channels_first'])
def test_repbn_fold_is_exact(dtype, tol, data_format):
    torch.manual_seed(0)
    norm = RepBN(8, data_format=data_format).to(dtype)
    randomize_bn(norm.bn)
    with torch.no_grad():
        norm.alpha.fill_(0.37)
    norm.eval()
    x = torch.randn(2, 5, 7, 8, dtype=dtype) if data_format == 'channels_last' else \
        torch.randn(2, 8, 5, 7, dtype=dtype)
    ref = norm(x)
    # Lemma 4.1 written out independently: BN(x) + alpha x.
    bn = norm.bn
    shape = (-1,) if data_format == 'channels_last' else (-1, 1, 1)
    direct = ((x - bn.running_mean.view(shape)) / torch.sqrt(bn.running_var.view(shape) + bn.eps)
              * bn.weight.view(shape) + bn.bias.view(shape) + 0.37 * x)
    assert rel_err(ref, direct) <= tol
    norm.switch_to_deploy()
    assert not hasattr(norm, 'bn') and norm.deploy
    assert rel_err(norm(x), ref) <= tol
    norm.switch_to_deploy()  # idempotent
    assert rel_err(norm(x), ref) <= tol
    fused = RepBN(8, data_format=data_format, deploy=True).to(dtype)
    fused.load_state_dict(norm.state_dict())
    assert rel_err(fused(x), ref) <= tol


def test_repbn_train_mode_uses_batch_statistics_and_refuses_deploy():
    norm = RepBN(4)
    x = torch.randn(3, 10, 4) * 5 + 2
    y = norm(x)
    flat = x.reshape(-1, 4)
    expected = (flat - flat.mean(0)) / torch.sqrt(flat.var(0, unbiased=False) + 1e-5) + flat
    assert torch.allclose(y.reshape(-1, 4), expected, atol=1e-5)
    with pytest.raises(RuntimeError, match='eval mode'):
        norm.switch_to_deploy()


@pytest.mark.parametrize('dtype,tol', [(torch.float64, 1e-6), (torch.float32, 1e-4)])
def test_fold_helpers_are_exact(dtype, tol):
    torch.manual_seed(1)
    scale, shift = torch.randn(6, dtype=dtype), torch.randn(6, dtype=dtype)
    x = torch.randn(4, 6, dtype=dtype)
    for bias in (True, False):
        lin = nn.Linear(6, 5, bias=bias).to(dtype)
        assert rel_err(fold_affine_into_next_linear(lin, scale, shift)(x),
                       lin(x * scale + shift)) <= tol
    conv = nn.Conv2d(3, 6, 3, stride=2, padding=1).to(dtype)
    img = torch.randn(2, 3, 9, 9, dtype=dtype)
    ref = conv(img) * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)
    assert rel_err(fold_affine_into_prev(conv, scale, shift)(img), ref) <= tol
    lin = nn.Linear(5, 6).to(dtype)
    z = torch.randn(3, 5, dtype=dtype)
    assert rel_err(fold_affine_into_prev(lin, scale, shift)(z), lin(z) * scale + shift) <= tol
    conv1 = nn.Conv2d(6, 4, 1).to(dtype)
    fmap = torch.randn(2, 6, 5, 5, dtype=dtype)
    ref = conv1(fmap * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1))
    assert rel_err(fold_affine_into_next_conv(conv1, scale, shift)(fmap), ref) <= tol
    with pytest.raises(ValueError, match='no padding'):
        fold_affine_into_next_conv(nn.Conv2d(6, 4, 3, padding=1), scale, shift)


def test_prepbn_schedule_values():
    norm = PRepBN(4, step=100, warmup=10)
    expected = {0: 1.0, 9: 1.0, 10: 1.0, 60: 0.5, 110: 0.0, 500: 0.0}
    for it, g in expected.items():
        norm.set_iter(it)
        assert norm.ratio == pytest.approx(g), it
    half = PRepBN(4, step=100, r0=0.8)
    half.set_iter(50)
    assert half.ratio == pytest.approx(0.4)


def test_prepbn_forward_mixes_ln_and_repbn():
    torch.manual_seed(0)
    norm = PRepBN(6, step=10)
    x = torch.randn(2, 9, 6) * 3 + 1
    norm.set_iter(5)
    ln = copy.deepcopy(norm.norm1)
    rep = copy.deepcopy(norm.norm2)
    y = norm(x)
    assert torch.allclose(y, 0.5 * ln(x) + 0.5 * rep(x), atol=1e-6)
    norm.eval()
    assert torch.allclose(norm(x), norm.norm2(x))  # eval is pure RepBN


def test_prepbn_skips_layernorm_when_schedule_finished():
    """Mid-decay both branches compute (the LayerNorm's parameters get gradients); once the
    decay has finished the LayerNorm is not computed (a single process: no gradient)."""
    norm = PRepBN(4, step=10)
    for it, ln_computed in ((3, True), (10, False)):
        norm.zero_grad(set_to_none=True)
        norm.set_iter(it)
        norm(torch.randn(2, 3, 4)).square().sum().backward()
        assert (norm.norm1.weight.grad is not None) == ln_computed, it
        assert norm.norm2.bn.weight.grad is not None


def _bn_reference(norm_bn: nn.BatchNorm1d, x: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """``nn.BatchNorm1d`` itself on ``x`` (its own running statistics are updated)."""
    c = x.shape[channel_dim]
    if channel_dim == -1:
        return norm_bn(x.reshape(-1, c)).view_as(x)
    return norm_bn(x.flatten(2)).view_as(x)


@pytest.mark.parametrize('data_format', ['channels_last', 'channels_first'])
@pytest.mark.parametrize('momentum', [0.1, None])
def test_repbn_and_prepbn_equal_their_formulas(data_format, momentum):
    """RepBN ``BN(x) + alpha x`` and PRepBN ``g LN(x) + (1 - g) RepBN(x)`` (SLAB eq. 4-5)
    equal the formulas written with ``nn.LayerNorm`` and ``nn.BatchNorm1d`` (their
    gradients by autograd, against :class:`RepMix`'s): outputs, every gradient (also when it
    arrives strided), the running statistics after three
    training steps (momentum or cumulative), and eval mode; also with a frozen BatchNorm
    (``bn_stats='frozen'``: eval-mode BN inside a training model)."""
    torch.manual_seed(0)
    c = 6
    channel_dim = -1 if data_format == 'channels_last' else 1
    for frozen in (False, True):
        rep = RepBN(c, momentum=0.1, data_format=data_format)
        prep = PRepBN(c, step=10, bn_momentum=0.1, data_format=data_format)
        for m in (rep.bn, prep.norm2.bn):
            m.momentum = momentum
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_()
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2)
        with torch.no_grad():
            prep.norm1.weight.uniform_(0.5, 1.5)
            prep.norm1.bias.normal_()
            rep.alpha.fill_(0.7)
        ref_bn, ref_pbn = copy.deepcopy(rep.bn), copy.deepcopy(prep.norm2.bn)
        ref_ln, ref_alpha = copy.deepcopy(prep.norm1), prep.norm2.alpha.detach().clone()
        ref_alpha.requires_grad_(True)
        rep_alpha = rep.alpha.detach().clone().requires_grad_(True)
        if frozen:
            for m in (rep.bn, prep.norm2.bn, ref_bn, ref_pbn):
                m.eval()
        prep.set_iter(4)  # g = 0.6
        g = prep.ratio
        for step in range(3):
            shape = (2, 7, 5, c) if channel_dim == -1 else (2, c, 7, 5)
            x = (torch.randn(*shape) * 3 + 1).requires_grad_(True)
            x_ref = x.detach().clone().requires_grad_(True)
            grad = torch.randn(*shape)
            y_rep = rep(x)
            ref_rep = _bn_reference(ref_bn, x_ref, channel_dim) + rep_alpha * x_ref
            y_prep = prep(x)
            x_last = x_ref if channel_dim == -1 else x_ref.movedim(1, -1)
            ref_prep = g * ref_ln(x_last) + (1 - g) * (
                _bn_reference(ref_pbn, x_last, -1) + ref_alpha * x_last)
            if channel_dim == 1:
                ref_prep = ref_prep.movedim(-1, 1)
            assert rel_err(y_rep, ref_rep) < 1e-5 and rel_err(y_prep, ref_prep) < 1e-5
            def loss(y):  # step 1: the gradient reaches the norms as a strided view
                if step != 1:
                    return (y * grad).sum()
                return (y.transpose(1, 2).contiguous() * grad.transpose(1, 2)).sum()
            for y in (y_rep, y_prep, ref_rep, ref_prep):
                loss(y).backward()
            assert rel_err(x.grad, x_ref.grad) < 1e-4  # (both norms summed, both sides)
            for ours, theirs in ((rep.bn, ref_bn), (prep.norm2.bn, ref_pbn)):
                assert rel_err(ours.weight.grad, theirs.weight.grad) < 1e-4
                assert rel_err(ours.bias.grad, theirs.bias.grad) < 1e-4
                assert torch.allclose(ours.running_mean, theirs.running_mean, atol=1e-6)
                assert torch.allclose(ours.running_var, theirs.running_var, atol=1e-5)
                assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked)
            assert rel_err(rep.alpha.grad, rep_alpha.grad) < 1e-4
            assert rel_err(prep.norm2.alpha.grad, ref_alpha.grad) < 1e-4
            assert rel_err(prep.norm1.weight.grad, ref_ln.weight.grad) < 1e-4
            assert rel_err(prep.norm1.bias.grad, ref_ln.bias.grad) < 1e-4
        rep.eval()
        ref_bn.eval()
        x = torch.randn(*shape)
        with torch.no_grad():
            assert rel_err(rep(x), _bn_reference(ref_bn, x, channel_dim) + rep_alpha * x) < 1e-5


def test_prepbn_without_schedule_driver_fails_loudly():
    norm = PRepBN(4, step=10)
    with pytest.raises(RuntimeError, match='ProgressiveNormHook'):
        norm(torch.randn(2, 3, 4))
    norm.eval()
    norm(torch.randn(2, 3, 4))  # eval needs no schedule


def test_prepbn_schedule_follows_iterations_not_forward_calls_and_resumes():
    model = nn.Sequential(PRepBN(4, step=20), PRepBN(4, step=20, warmup=4))

    def ratios(m):
        return [layer.ratio for layer in m]

    uninterrupted = []
    for it in range(12):
        set_progressive_iter(model, it)
        for _ in range(3):  # gradient accumulation / extra forwards
            model(torch.randn(2, 3, 4))
        uninterrupted.append(ratios(model))
    # Interrupted at iteration 6: save, rebuild, load, continue.
    first = nn.Sequential(PRepBN(4, step=20), PRepBN(4, step=20, warmup=4))
    resumed_seq = []
    for it in range(6):
        set_progressive_iter(first, it)
        first(torch.randn(2, 3, 4))
        resumed_seq.append(ratios(first))
    state = first.state_dict()
    assert int(state['0.cur_iter']) == 5
    second = nn.Sequential(PRepBN(4, step=20), PRepBN(4, step=20, warmup=4))
    second.load_state_dict(state)
    assert ratios(second) == resumed_seq[-1]
    for it in range(6, 12):
        set_progressive_iter(second, it)
        second(torch.randn(2, 3, 4))
        resumed_seq.append(ratios(second))
    assert resumed_seq == uninterrupted
    assert uninterrupted[0] == [1.0, 1.0] and uninterrupted[-1][0] == pytest.approx(1 - 11 / 20)


def test_prepbn_schedule_offset_keeps_finished_schedule_finished():
    norm = PRepBN(4, step=100, warmup=10)
    norm.load_state_dict(dict(norm.state_dict(), schedule_offset=torch.tensor(1.0)))
    norm.set_iter(0)
    assert norm.ratio == 0.0
    norm.reset_schedule()
    assert norm.ratio == 1.0


def test_prepbn_training_forward_reads_no_buffer():
    """A training forward reads no buffer (on a GPU each read waits for the device): it
    computes ``g * LN(x) + (1 - g) * (BN(x) + alpha * x)`` with the ``g`` that
    ``set_iter``, a loaded state dict or ``reset_schedule`` evaluated last."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class BufferReads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    norm = PRepBN(8, step=100)
    for p in (norm.norm1.weight, norm.norm1.bias, norm.norm2.bn.weight, norm.norm2.alpha):
        nn.init.normal_(p)
    x = torch.randn(4, 6, 8)

    def formula(g):
        ln = F.layer_norm(x, (8, ), norm.norm1.weight, norm.norm1.bias, 1e-5)
        bn = F.batch_norm(x.reshape(-1, 8), None, None, norm.norm2.bn.weight,
                          norm.norm2.bn.bias, training=True, eps=1e-5).view_as(x)
        return g * ln + (1 - g) * (bn + norm.norm2.alpha * x)

    norm.set_iter(30)
    with BufferReads() as reads:
        y = norm(x)
        y.sum().backward()
    assert reads.count == 0
    assert rel_err(y, formula(0.7)) <= 1e-6
    state = copy.deepcopy(norm.state_dict())
    state['cur_iter'].fill_(10)
    state['schedule_offset'].fill_(0.5)
    norm.load_state_dict(state)
    assert rel_err(norm(x), formula(0.4)) <= 1e-6
    norm.reset_schedule()
    assert rel_err(norm(x), formula(0.9)) <= 1e-6


@pytest.mark.parametrize('kwargs,match', [
    (dict(step=0), 'step'), (dict(step=-5), 'step'), (dict(warmup=-1), 'warmup'),
    (dict(r0=1.5), 'r0'), (dict(data_format='nchw'), 'data_format')])
def test_prepbn_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PRepBN(4, **kwargs)


def test_build_norm_validates():
    assert isinstance(build_norm(dict(type='LN'), 8), nn.LayerNorm)
    assert isinstance(build_norm(dict(type='PRepBN', step=5), 8), PRepBN)
    with pytest.raises(ValueError, match="valid types"):
        build_norm(dict(type='GN'), 8)
    with pytest.raises(ValueError, match='unexpected keyword|invalid'):
        build_norm(dict(type='RepBN', stepz=3), 8)
    with pytest.raises(ValueError, match='dict'):
        build_norm('LN', 8)


def test_build_layernorm_keys():
    ln = build_norm(dict(type='LN', eps=1e-6, requires_grad=False), 8)
    assert ln.eps == 1e-6 and not any(p.requires_grad for p in ln.parameters())
    assert build_norm(dict(type='LN', elementwise_affine=False), 8).weight is None
    with pytest.raises(ValueError, match=r"valid: \['elementwise_affine', 'eps', "
                                         r"'requires_grad'\]"):
        build_norm(dict(type='LN', momentum=0.1), 8)


@pytest.mark.parametrize('dtype,tol', [(torch.float64, 1e-6), (torch.float32, 1e-4)])
@pytest.mark.parametrize('idle_ratio', [0.0, 0.75, 1.0])
def test_channel_idle_ffn_fold_is_exact(dtype, tol, idle_ratio):
    torch.manual_seed(2)
    ffn = ChannelIdleFFN(8, 32, idle_ratio=idle_ratio).to(dtype)
    randomize_bn(ffn.norm1)
    randomize_bn(ffn.norm2)
    ffn.eval()
    x = torch.randn(2, 11, 8, dtype=dtype)
    ref = ffn(x)
    # Independent form of the training computation.
    bn1 = (x - ffn.norm1.running_mean) / torch.sqrt(ffn.norm1.running_var + 1e-5) * \
        ffn.norm1.weight + ffn.norm1.bias
    h = ffn.fc1(bn1)
    k = math.ceil(32 * (1 - idle_ratio))
    h = torch.cat([F.gelu(h[..., :k]), h[..., k:]], -1)
    h = (h - ffn.norm2.running_mean) / torch.sqrt(ffn.norm2.running_var + 1e-5) * \
        ffn.norm2.weight + ffn.norm2.bias
    assert rel_err(ref, x + ffn.fc2(h)) <= tol
    ffn.switch_to_deploy()
    ffn.switch_to_deploy()
    assert rel_err(ffn(x), ref) <= tol
    n_params = sum(p.numel() for p in ffn.parameters())
    assert n_params == 8 * 8 + 8 + (8 * k + k + k * 8 if k else 0)
    fresh = ChannelIdleFFN(8, 32, idle_ratio=idle_ratio, deploy=True).to(dtype)
    fresh.load_state_dict(ffn.state_dict())
    assert rel_err(fresh(x), ref) <= tol


@pytest.mark.parametrize('frozen', [False, True])
def test_channel_idle_ffn_training_equals_its_modules(frozen):
    """The training form, with each BatchNorm's batch affine folded into the next linear,
    equals ``x + fc2(BN2(act(fc1(BN1(x)))))`` run through the modules themselves: outputs,
    every gradient and both BatchNorms' running statistics over three steps (frozen: BNs in
    eval mode inside a training model)."""
    torch.manual_seed(3)
    ffn = ChannelIdleFFN(8, 32, idle_ratio=0.75).train()
    randomize_bn(ffn.norm1)
    randomize_bn(ffn.norm2)
    ref = copy.deepcopy(ffn)
    if frozen:
        for m in (ffn.norm1, ffn.norm2, ref.norm1, ref.norm2):
            m.eval()
    k = ffn.active
    for _ in range(3):
        x = (torch.randn(2, 11, 8) * 2 + 0.5).requires_grad_(True)
        x_ref = x.detach().clone().requires_grad_(True)
        grad = torch.randn(2, 11, 8)
        out = ffn(x)
        h = ref.fc1(ref.norm1(x_ref.reshape(-1, 8)))
        h = torch.cat([F.gelu(h[:, :k]), h[:, k:]], 1)
        expected = x_ref + ref.fc2(ref.norm2(h)).view_as(x_ref)
        assert rel_err(out, expected) < 1e-5
        (out * grad).sum().backward()
        (expected * grad).sum().backward()
        assert rel_err(x.grad, x_ref.grad) < 1e-4
        for (name, p), p_ref in zip(ffn.named_parameters(), ref.parameters()):
            assert rel_err(p.grad, p_ref.grad) < 1e-4, name
        for (name, b), b_ref in zip(ffn.named_buffers(), ref.buffers()):
            assert torch.allclose(b.float(), b_ref.float(), atol=1e-5), name


def test_channel_idle_ffn_validates_and_refuses_train_mode():
    with pytest.raises(ValueError, match='idle_ratio'):
        ChannelIdleFFN(8, 32, idle_ratio=1.2)
    with pytest.raises(RuntimeError, match='eval mode'):
        ChannelIdleFFN(8, 32).switch_to_deploy()


def naive_sla(qkv, pos, dwc, num_heads, grid, valid=None):
    """Quadratic-order SLA on one window: explicit similarity matrix."""
    n, c3 = qkv.shape
    c = c3 // 3
    q, k, v = qkv[:, :c], qkv[:, c:2 * c], qkv[:, 2 * c:]
    k = k + pos
    if valid is not None:
        q, k, v = q[valid], k[valid], v[valid]
    d = c // num_heads
    outs = []
    for h in range(num_heads):
        qh, kh, vh = (F.relu(q[:, h * d:(h + 1) * d]), F.relu(k[:, h * d:(h + 1) * d]),
                      v[:, h * d:(h + 1) * d])
        sim = qh @ kh.T  # [N, N]
        outs.append((sim @ vh) / (sim.sum(-1, keepdim=True) + 1e-6))
    out = torch.cat(outs, -1)
    gh, gw = grid
    v_map = v.view(gh, gw, num_heads, d).permute(2, 3, 0, 1)  # [heads, d, gh, gw]
    dw = F.conv2d(v_map, dwc.weight, dwc.bias, padding=dwc.padding, groups=d)
    return out + dw.permute(2, 3, 0, 1).reshape(gh * gw, c)


@pytest.mark.parametrize('heads', [1, 2, 4])
@pytest.mark.parametrize('grad', [True, False])
def test_sla_matches_naive_quadratic_computation(heads, grad):
    """On the packed qkv and on its three parts, in the training form (gradients) and the
    inference form (none: writes through ``out=``, no copies or concatenation)."""
    torch.manual_seed(3)
    sla = SLA(16, heads, 4).double()
    nn.init.normal_(sla.positional_encoding, std=0.5)
    qkv = torch.randn(3, 16, 48, dtype=torch.float64)
    with torch.set_grad_enabled(grad):
        out = sla.attend(qkv, (4, 4))
        parts = sla.attend(qkv.split(16, dim=-1), (4, 4))
    assert torch.equal(out, parts) if grad else rel_err(out, parts) <= 1e-12
    assert out.requires_grad == grad and out.is_contiguous()
    for b in range(3):
        ref = naive_sla(qkv[b], sla.positional_encoding[0], sla.dwc, heads, (4, 4))
        assert rel_err(out[b], ref) <= 1e-10


def test_sla_padding_does_not_change_valid_tokens():
    check_sla_padding()


def check_sla_padding():
    torch.manual_seed(4)
    attn = ShiftWindowAttention(16, 2, 8, attn_type='sla').double()
    nn.init.normal_(attn.w_msa.positional_encoding, std=0.5)
    # 6x7 map inside one 8x8 window: same as the naive formula on the valid tokens with the
    # positional encoding of their window positions and zero-padded DWC.
    x = torch.randn(1, 42, 16, dtype=torch.float64)
    out = attn(x, (6, 7))
    qkv = attn.w_msa.qkv(x)[0]
    pos = attn.w_msa.positional_encoding.view(8, 8, 16)[:6, :7].reshape(42, 16)
    ref = attn.w_msa.proj(naive_sla(qkv, pos, attn.w_msa.dwc, 2, (6, 7)))
    assert rel_err(out[0], ref) <= 1e-10
    # 12x12 map in 8x8 windows: padded to 16x16; the padded tokens must not leak.
    x = torch.randn(1, 144, 16, dtype=torch.float64)
    out = attn(x, (12, 12)).view(12, 12, 16)
    qkv = attn.w_msa.qkv(x)[0].view(12, 12, 48)
    win = qkv[8:12, 0:8].reshape(32, 48)  # window (1, 0): 4 valid rows of 8
    pos = attn.w_msa.positional_encoding.view(8, 8, 16)[:4, :8].reshape(32, 16)
    ref = attn.w_msa.proj(naive_sla(win, pos, attn.w_msa.dwc, 2, (4, 8)))
    assert rel_err(out[8:12, 0:8].reshape(32, 16), ref) <= 1e-10


def shifted_sla_reference(attn, x, hw):
    """SLA in (shifted) windows, transcribed: the ``[H*W, C]`` map's qkv zero-padded to
    whole windows, rolled by the shift, cut into windows; in each, the quadratic-order SLA
    over its valid tokens and the DWC over the window grid (zeros where padded); rolled
    back, cropped, ``proj``."""
    kernel = attn.w_msa
    (h, w), win, s = hw, kernel.window_size[0], attn.shift_size
    c, heads = kernel.embed_dims, kernel.num_heads
    d = c // heads
    hp, wp = -(-h // win) * win, -(-w // win) * win
    grid = x.new_zeros(hp, wp, 3 * c)
    grid[:h, :w] = kernel.qkv(x).view(h, w, 3 * c)
    valid = torch.zeros(hp, wp, dtype=torch.bool)
    valid[:h, :w] = True
    grid, valid = (t.roll((-s, -s), (0, 1)) for t in (grid, valid))
    pos = kernel.positional_encoding[0]
    out = x.new_zeros(hp, wp, c)
    for i in range(0, hp, win):
        for j in range(0, wp, win):
            q, k, v = grid[i:i + win, j:j + win].reshape(-1, 3 * c).split(c, dim=-1)
            keep = valid[i:i + win, j:j + win].reshape(-1)
            k = k + pos
            att = []
            for hd in range(heads):
                sl = slice(hd * d, (hd + 1) * d)
                sim = F.relu(q[:, sl]) @ F.relu(k[keep, sl]).T
                att.append(sim @ v[keep, sl] / (sim.sum(-1, keepdim=True) + 1e-6))
            v_map = v.view(win, win, heads, d).permute(2, 3, 0, 1)
            dw = F.conv2d(v_map, kernel.dwc.weight, kernel.dwc.bias, padding=2, groups=d)
            out[i:i + win, j:j + win] = (torch.cat(att, -1) + dw.permute(2, 3, 0, 1).reshape(
                -1, c)).view(win, win, c)
    out = out.roll((s, s), (0, 1))[:h, :w].reshape(h * w, c)
    return kernel.proj(out)


@pytest.mark.parametrize('shift', [False, True])
@pytest.mark.parametrize('sizes,window', [('ints', 8), ('traced', 8), ('traced', 7),
                                          ('padded', 8), ('padded', 7)])
def test_sla_windows_of_padded_maps_match_the_padded_formula(shift, sizes, window):
    """The windows of padded maps are computed cropped to their valid tokens, in four
    groups (``cropped_windows``), from Python int sizes (eager) or sizes as tensors (what
    tracing records: the graph computes the groups), or (a GPU, torch.compile) padded, the
    padded slots masked: the padded formula's numbers on maps whose shifted windows start
    with padding, wrap with a padded gap between their two valid parts, end in a partial
    window, or fit in one window along one axis; odd windows (shift ``(w - 1) / 2``) too.
    The gradients (training) are the formula's as well."""
    torch.manual_seed(7)
    attn = ShiftWindowAttention(16, 2, window, shift=shift, attn_type='sla').double()
    nn.init.normal_(attn.w_msa.positional_encoding, std=0.5)
    nn.init.normal_(attn.w_msa.dwc.weight, std=0.5)
    params = [attn.w_msa.qkv.weight, attn.w_msa.positional_encoding, attn.w_msa.dwc.weight]
    for hw in [(12, 12), (23, 31), (17, 8), (5, 30), (16, 11), (19, 6)]:
        x = torch.randn(2, hw[0] * hw[1], 16, dtype=torch.float64, requires_grad=True)
        if sizes == 'padded':
            lay = attn._layout(*hw, x.device, cropped=False)
            out = attn.w_msa.proj(attn._attend_padded(x, lay))
        else:
            out = attn(x, tuple(torch.tensor(v) for v in hw) if sizes == 'traced' else hw)
        ref = torch.stack([shifted_sla_reference(attn, x[b], hw) for b in range(2)])
        for b in range(2):
            assert rel_err(out[b], ref[b]) <= 1e-10
        with torch.no_grad():  # the inference form
            if sizes == 'padded':
                infer = attn.w_msa.proj(attn._attend_padded(x, lay))
            else:
                infer = attn._attend_cropped(x, attn._layout(*hw, x.device, cropped=True))
                infer = attn.w_msa.proj(infer)
        assert rel_err(infer, ref) <= 1e-10
        weights = torch.randn_like(out)
        grads = torch.autograd.grad((out * weights).sum(), [x] + params)
        ref_grads = torch.autograd.grad((ref * weights).sum(), [x] + params)
        for g, r in zip(grads, ref_grads):
            assert rel_err(g, r) <= 1e-10


def test_sla_runs_in_chunks_only_in_eager_cpu_inference(monkeypatch):
    """Chunks of windows are a loop around the whole-map computation, taken by a rule,
    never a timing: eager CPU inference with sizes known; training (gradients) and traced
    sizes take the whole map; the output is the formula's either way."""
    torch.manual_seed(3)
    attn = ShiftWindowAttention(16, 2, 8, shift=True, attn_type='sla').double().eval()
    nn.init.normal_(attn.w_msa.positional_encoding, std=0.5)
    chunked = []
    real = ShiftWindowAttention._forward_in_chunks
    monkeypatch.setattr(ShiftWindowAttention, '_forward_in_chunks',
                        lambda self, *a: chunked.append(1) or real(self, *a))
    x = torch.randn(1, 12 * 20, 16, dtype=torch.float64)
    ref = shifted_sla_reference(attn, x[0], (12, 20))
    with torch.no_grad():
        out = attn(x, (12, 20))
        assert torch.equal(attn(x, (12, 20)), out) and len(chunked) == 2
        assert rel_err(out[0], ref) <= 1e-10
        attn(x, (torch.tensor(12), torch.tensor(20)))
    whole = attn(x, (12, 20))
    assert rel_err(whole[0], ref) <= 1e-10 and len(chunked) == 2


@pytest.mark.parametrize('traced', [False, True])
@pytest.mark.parametrize('shift', [False, True])
def test_cropped_windows_skip_the_padding(shift, traced):
    """SLAB-Swin-T's stage 1 at 512 x 512 (128 x 128 tokens, windows of 56): the cropped
    groups hold 16384 window slots unshifted (no padded one) and 19600 shifted (spans
    56 + 56 + 28 per axis), where padded windows take 168 x 168 = 28224; every token has
    exactly one slot that is read back, and it holds that token."""
    from mmslab.models.layers.shift_window import cropped_windows
    size = torch.tensor(128) if traced else 128
    lay = cropped_windows(size, size, 56, 56, 28 if shift else 0)
    gather = torch.cat([torch.where(g['valid'].reshape(-1), g['gather'], 128 * 128)
                        for g in lay['groups']])
    slot = lay['slot']
    assert len(gather) == (19600 if shift else 16384)
    assert (gather[slot] == torch.arange(128 * 128)).all()
    assert sorted(gather[gather < 128 * 128].tolist()) == list(range(128 * 128))
    assert [int(g['count'] * g['hw'][0] * g['hw'][1]) for g in lay['groups']] == (
        [2 * 2 * 56 * 56, 2 * 56 * 28, 2 * 28 * 56, 28 * 28] if shift else
        [2 * 2 * 56 * 56, 2 * 56 * 16, 2 * 16 * 56, 16 * 16])
    # 200 rows, shifted: three whole windows, then the wrapped one, with rows 196..199 and
    # 0..27 and 24 padded rows between them
    wrapped = cropped_windows(200, 56, 56, 56, 28)['groups']
    assert [(g['count'], g['hw']) for g in wrapped] == [(3, (56, 56)), (3, (56, 56)),
                                                        (1, (56, 56)), (1, (56, 56))]
    assert wrapped[2]['valid'].sum().item() == 32 * 56


@pytest.mark.parametrize('windows', ['cropped', 'padded'])
def test_binorm_matches_naive_and_ignores_padding(windows):
    """BiNorm on windows cropped to their tokens (the CPU) and on padded windows (a GPU)."""
    torch.manual_seed(5)
    attn = ShiftWindowAttention(8, 2, 4, attn_type='binorm').double()
    x = torch.randn(1, 6 * 4, 8, dtype=torch.float64)
    if windows == 'padded':
        out = attn.w_msa.proj(attn._attend_padded(x, attn._layout(6, 4, x.device)))
    else:
        out = attn(x, (6, 4))
    out = out.view(6, 4, 8)
    qkv = attn.w_msa.qkv(x)[0].view(6, 4, 24)
    for rows in (slice(0, 4), slice(4, 6)):  # a full window and a padded one
        win = qkv[rows].reshape(-1, 24)
        q, k, v = win[:, :8], win[:, 8:16], win[:, 16:]
        heads = []
        for h in range(2):
            sl = slice(h * 4, (h + 1) * 4)
            kv = k[:, sl].T @ v[:, sl]
            heads.append((q[:, sl] / q[:, sl].norm(dim=-1, keepdim=True)) @
                         (kv / kv.norm(dim=0, keepdim=True)))
        ref = attn.w_msa.proj(torch.cat(heads, -1))
        assert rel_err(out[rows].reshape(-1, 8), ref) <= 1e-10


@pytest.mark.parametrize('traced_sizes', [False, True])
def test_shift_mask_leaves_no_denormal_probabilities(traced_sizes):
    """Softmax over attention scores plus the shift mask gives masked entries of exactly 0,
    never denormal floats (which CPUs multiply many times slower; Swin's -100 gave
    exp(-100) ~ 4e-44), for the constant mask and the one computed in a graph."""
    from mmslab.models.layers.shift_mask import shift_mask_by_type
    sizes = (21, 14, 7, 7, 3)
    if traced_sizes:  # the map's size (window and shift are constants of the model)
        sizes = (torch.tensor(21), torch.tensor(14)) + sizes[2:]
    mask = shift_mask_by_type(*sizes).dense()  # [nW, N, N]
    assert mask.shape == (6, 49, 49) and (mask < 0).any()
    torch.manual_seed(0)
    scores = torch.randn(6, 3, 49, 49) * 4  # [nW, heads, N, N]
    probs = (scores + mask.unsqueeze(1)).softmax(-1)
    masked = (mask < 0).unsqueeze(1).expand_as(probs)
    assert (probs[masked] == 0).all()
    tiny = torch.finfo(torch.float32).tiny
    assert not ((probs > 0) & (probs < tiny)).any()
    # the masked regions are those of the transcription's mask: each token sees its own
    assert (mask.diagonal(dim1=1, dim2=2) == 0).all()


def swin_img_mask(hp, wp, wh, ww, s):
    """Swin's shift mask as mmdet's ``ShiftWindowMSA`` builds it: regions of the padded map
    by slices, window partition, -100 between regions (here 1 for 'masked')."""
    img = torch.zeros(hp, wp)
    count = 0
    for hs in (slice(0, -wh), slice(-wh, -s), slice(-s, None)):
        for ws in (slice(0, -ww), slice(-ww, -s), slice(-s, None)):
            img[hs, ws] = count
            count += 1
    windows = img.view(hp // wh, wh, wp // ww, ww).transpose(1, 2).reshape(-1, wh * ww)
    return (windows.unsqueeze(1) - windows.unsqueeze(2) != 0).float()


@pytest.mark.parametrize('sizes', [(14, 21, 7, 7, 3), (7, 7, 7, 7, 3), (28, 7, 7, 7, 3),
                                   (12, 8, 4, 4, 2), (18, 20, 6, 5, 2)])
def test_shift_mask_by_window_kind_is_swins_mask(sizes):
    """Graphs with a free size gather the shift mask from four per-kind masks (interior, last
    column, last row, corner windows): the same masks as Swin's region construction at every
    padded size, from traced map sizes, and the constant mask of Python int sizes too."""
    from mmslab.models.layers.shift_mask import SHIFT_MASK_FILL, shift_mask_by_type
    hp, wp, wh, ww, s = sizes
    ref = swin_img_mask(hp, wp, wh, ww, s) * SHIFT_MASK_FILL
    by_type = shift_mask_by_type(torch.tensor(hp), torch.tensor(wp), wh, ww, s)
    assert by_type.window_type.shape == ((hp // wh) * (wp // ww), )
    assert torch.equal(by_type.dense(), ref)
    assert torch.equal(shift_mask_by_type(hp, wp, wh, ww, s).dense(), ref)
    with pytest.raises(ValueError, match='shift'):
        shift_mask_by_type(hp, wp, wh, ww, min(wh, ww))
    with pytest.raises(TypeError, match='Python ints'):
        shift_mask_by_type(hp, wp, torch.tensor(wh), ww, s)


@pytest.mark.parametrize('shift', [False, True])
def test_window_msa_matches_explicit_softmax_with_shift_mask(shift):
    torch.manual_seed(6)
    attn = ShiftWindowAttention(8, 2, 4, shift=shift, attn_type='window').double().eval()
    kernel = attn.w_msa
    with torch.no_grad():
        kernel.relative_position_bias_table.normal_()  # large enough to matter
    x = torch.randn(2, 8 * 8, 8, dtype=torch.float64)
    with torch.no_grad():
        ref = explicit_shifted_window_attention(
            x, (8, 8), 4, 2 if shift else 0, kernel.qkv, kernel.proj,
            kernel.relative_position_bias_table, num_heads=2)
        assert rel_err(attn(x, (8, 8)), ref) <= 1e-10
        # The deploy form gathers the bias once and caches bias + mask: the same result.
        kernel.switch_to_deploy()
        assert kernel.relative_position_bias.shape == (2, 16, 16)
        assert rel_err(attn(x, (8, 8)), ref) <= 1e-10


def test_attention_type_and_argument_errors():
    with pytest.raises(ValueError, match='valid types'):
        ShiftWindowAttention(8, 2, 4, attn_type='flash')
    with pytest.raises(ValueError, match='divisible'):
        WindowMSA(10, 3, 4)
    with pytest.raises(ValueError, match='attn_drop'):
        SLA(8, 2, 4, attn_drop=0.1)
    with pytest.raises(ValueError, match='tokens'):
        ShiftWindowAttention(8, 2, 4)(torch.randn(1, 10, 8), (3, 3))
    with pytest.raises(ValueError, match='RepBN'):
        RepBN(4)(torch.randn(2, 3, 5))


def test_tokenbn_fold():
    norm = TokenBN(5).double()
    randomize_bn(norm.bn)
    norm.eval()
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    ref = norm(x)
    norm.switch_to_deploy()
    assert rel_err(norm(x), ref) <= 1e-12


@pytest.mark.parametrize('name', ['SLABSwin', 'RePaSwin'])
def test_a_model_run_in_inference_mode_trains_afterwards(name):
    """Window layouts, SLA's head masks and tiled DWC weights are cached on first use. Made
    under ``torch.inference_mode`` they would be inference tensors, which autograd refuses to
    save for the backward pass: a model checked or timed that way and trained afterwards at
    the same size failed in ``index_select``. The caches are reused (same objects), and the
    gradients equal those of a model that never ran in inference mode."""
    from presets import build_preset
    torch.manual_seed(0)
    model = build_preset(name, depths=(2, 1, 1, 1))
    model.init_weights()
    fresh = copy.deepcopy(model)
    x = torch.randn(1, 3, 72, 88)
    model.eval()
    with torch.inference_mode():
        model(x)
    attns = [m for m in model.modules() if isinstance(m, ShiftWindowAttention)]
    cached = [dict(m._layouts) for m in attns]
    assert all(cached)
    grads = []
    for m in (model, fresh):
        m.train()
        set_progressive_iter(m, 5)
        sum(out.square().sum() for out in m(x)).backward()
        grads.append([p.grad for p in m.parameters() if p.requires_grad])
    assert all(m._layouts[k] is c[k] for m, c in zip(attns, cached) for k in c)
    assert [a is None for a in grads[0]] == [b is None for b in grads[1]]
    assert sum(a is not None for a in grads[0]) > len(grads[0]) // 2
    for a, b in zip(*grads):
        assert a is None or rel_err(a, b) <= 1e-6


@pytest.mark.parametrize('name', ['PRepBNSwin', 'SLABSwin'])
def test_a_fused_model_loaded_after_a_call_uses_the_new_weights(name):
    """Fused window attention caches its position bias (with the shift masks) per size:
    weights loaded in place after an inference call (load_state_dict) must
    replace them. Reference: a model built with those weights that never ran."""
    from presets import build_preset
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = build_preset(name)
        model.init_weights()
        mmslab.reparameterize(model.eval())
        models.append(model)
    used, other = models
    x = torch.randn(1, 3, 61, 83)
    with torch.no_grad():
        before = used(x)
        used.load_state_dict(other.state_dict())
        after, ref = used(x), other(x)
    for b, a, r in zip(before, after, ref):
        assert rel_err(b, r) > 1e-2  # the two models differ
        assert rel_err(a, r) <= 1e-6


def count_chunked_calls(monkeypatch) -> list:
    """Spy on SLA.attend inside ShiftWindowAttention._forward_in_chunks: the list gets one
    ``[B', N]`` shape per chunk."""
    calls, inside = [], []
    real_attend, real_chunks = SLA.attend, ShiftWindowAttention._forward_in_chunks

    def attend(self, qkv, *args, **kwargs):
        if inside:
            calls.append(tuple(qkv[0].shape[:2]))
        return real_attend(self, qkv, *args, **kwargs)

    def chunks(self, *args):
        inside.append(1)
        try:
            return real_chunks(self, *args)
        finally:
            inside.pop()
    monkeypatch.setattr(SLA, 'attend', attend)
    monkeypatch.setattr(ShiftWindowAttention, '_forward_in_chunks', chunks)
    return calls


@pytest.mark.parametrize('shift', [False, True])
@pytest.mark.parametrize('values', [1, 10 ** 6])
def test_sla_eager_inference_in_chunks_matches_the_padded_formula(monkeypatch, shift, values):
    """Eager CPU inference of window SLA in chunks of windows (qkv, kernel and proj per
    chunk, ShiftWindowAttention._forward_in_chunks): one window per chunk (``values`` 1) or
    all at once, two images, maps that pad, wrap, end in partial windows or fit in one
    window along an axis: the transcribed formula's numbers. Gradients take the whole-map
    path."""
    from mmslab.models.layers.shift_window import ShiftWindowAttention as SWA
    monkeypatch.setattr(SWA, 'chunk_values', values)
    calls = count_chunked_calls(monkeypatch)
    torch.manual_seed(7)
    attn = SWA(16, 2, 8, shift=shift, attn_type='sla').double().eval()
    nn.init.normal_(attn.w_msa.positional_encoding, std=0.5)
    nn.init.normal_(attn.w_msa.dwc.weight, std=0.5)
    nn.init.normal_(attn.w_msa.qkv.bias, std=0.5)
    for hw in [(12, 12), (23, 31), (17, 8), (5, 30), (16, 11), (8, 8)]:
        x = torch.randn(2, hw[0] * hw[1], 16, dtype=torch.float64)
        calls.clear()
        with torch.no_grad():
            out = attn(x, hw)
        assert calls and all(b % 2 == 0 for b, _ in calls)  # both images in each chunk
        if values == 1:
            assert all(b == 2 for b, _ in calls)  # one window (of each image) per chunk
        for b in range(2):
            assert rel_err(out[b], shifted_sla_reference(attn, x[b], hw)) <= 1e-10, hw
    calls.clear()
    attn(x.requires_grad_(), hw)
    assert not calls


def test_sla_in_chunks_follows_weights_loaded_after_a_call():
    """Weights loaded in place after a call in chunks are used by the next."""
    torch.manual_seed(8)
    attn = ShiftWindowAttention(16, 2, 8, shift=True, attn_type='sla').double().eval()
    x = torch.randn(1, 12 * 20, 16, dtype=torch.float64)
    with torch.no_grad():
        attn(x, (12, 20))
        new = {k: torch.randn_like(v) for k, v in attn.state_dict().items()}
        attn.load_state_dict(new)
        out = attn(x, (12, 20))
    assert rel_err(out[0], shifted_sla_reference(attn, x[0], (12, 20))) <= 1e-10


@pytest.mark.skipif(not __import__('mmslab.utils.machine', fromlist=['has_bf16']).has_bf16(),
                    reason='this CPU has no bf16 units: bf16 autocast would be emulated')
def test_sla_in_chunks_under_bf16_autocast_is_within_bf16_rounding(monkeypatch):
    """bf16 autocast: the chunked path computes in bf16 (as SLA's bf16 inference does) and
    gives a bf16 output within bf16 rounding of the float64 formula, on coherent
    activations (large kernel sums) and a padded, shifted map."""
    calls = count_chunked_calls(monkeypatch)
    torch.manual_seed(9)
    attn = ShiftWindowAttention(32, 2, 8, shift=True, attn_type='sla').eval()
    x = torch.randn(1, 12 * 20, 32) * 2 + 1
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
        out = attn(x, (12, 20))
    assert calls and out.dtype == torch.bfloat16
    ref = shifted_sla_reference(attn.double(), x[0].double(), (12, 20))
    assert rel_err(out[0].double(), ref) < 2e-2, rel_err(out[0].double(), ref)


def test_fused_model_caches_stay_bounded_in_bytes_across_input_sizes(monkeypatch):
    """Evaluation meets a new input size for almost every image: what a fused model keeps
    between calls is bounded in bytes (per module) and does not grow with the batch."""
    from mmslab.deploy.cuda_graph import _cached_tensors
    from presets import build_preset
    bound = 6 << 10
    monkeypatch.setattr(ShiftWindowAttention, 'layout_cache_bytes', bound)
    torch.manual_seed(0)
    model = build_preset('SLABSwin')  # softmax and SLA windows
    model.init_weights()
    model = mmslab.reparameterize(model.eval())
    attns = [m for m in model.modules() if isinstance(m, ShiftWindowAttention)]
    sizes = [(48 + 8 * i, 72 - 4 * i) for i in range(6)]

    def held():
        """(bytes kept outside the window layouts, the layouts' bytes)"""
        total = sum(t.numel() * t.element_size() for t in _cached_tensors(model))
        layouts = sum(m._layouts.nbytes for m in attns)
        return total - layouts, layouts

    other = []
    for batch in (1, 2):
        for m in attns:
            m._layouts.clear()
        with torch.no_grad():
            for size in sizes:
                model(torch.randn(batch, 3, *size))
                other.append(held()[0])
                assert all(0 < m._layouts.nbytes <= bound for m in attns)
    assert len(set(other)) == 1  # the rest depends on neither the size nor the batch
    assert any(0 < len(m._layouts) < len(sizes) for m in attns)  # the bound evicted
