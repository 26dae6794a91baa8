"""Window softmax attention: both implementations equal an explicit softmax, and the one used
at inference is chosen by measurement (or forced by ``export_mode(window_softmax=...)``, whose
process default is MMSLAB_WINDOW_SOFTMAX)."""
import os
import subprocess
import sys

import pytest
import torch

from mmslab.models.layers import window_attention as wa
from mmslab.models.layers.export_mode import current_export_mode, export_mode
from mmslab.models.layers.shift_window import ShiftWindowAttention


def explicit_window_attention(qkv, heads, scale, bias, mask):
    """softmax(q k^T * scale + relative bias + shift mask) v, written out per head."""
    bw, n, c3 = qkv.shape
    c = c3 // 3
    d = c // heads
    q, k, v = qkv[..., :c], qkv[..., c:2 * c], qkv[..., 2 * c:]
    out = torch.empty(bw, n, heads, d, dtype=qkv.dtype)
    for h in range(heads):
        qh, kh, vh = (t[..., h * d:(h + 1) * d] for t in (q, k, v))
        logits = torch.einsum('bid,bjd->bij', qh, kh) * scale + bias[h]
        if mask is not None:
            logits = logits + mask.repeat(bw // mask.shape[0], 1, 1)
        out[:, :, h] = torch.einsum('bij,bjd->bid', logits.softmax(-1), vh)
    return out


@pytest.mark.parametrize('impl', ['sdpa', 'matmul'])
@pytest.mark.parametrize('shift', [False, True])
def test_each_implementation_matches_explicit_softmax(monkeypatch, impl, shift):
    monkeypatch.setattr(wa, '_time_implementations', lambda *a, **k: pytest.fail('timed'))
    torch.manual_seed(0)
    attn = ShiftWindowAttention(24, 3, 4, shift=shift).eval()
    torch.nn.init.normal_(attn.w_msa.relative_position_bias_table, std=0.5)
    kernel = attn.w_msa
    h, w = 8, 8  # two windows per side, no padding: the layout is a plain partition + roll
    layout = attn._layout(h, w, torch.device('cpu'))
    qkv = torch.randn(2 * layout['num_windows'], 16, 72)
    with torch.no_grad(), export_mode(window_softmax=impl):
        ours = kernel.attend(qkv, layout['num_windows'], (4, 4),
                             shift_mask=layout['shift_mask'])
    ref = explicit_window_attention(qkv, 3, kernel.scale, kernel.position_bias(),
                                    layout['shift_mask'])
    torch.testing.assert_close(ours.reshape(ref.shape), ref, rtol=1e-5, atol=1e-5)
    if shift:
        assert layout['shift_mask'] is not None and (layout['shift_mask'] < 0).any()


def test_choice_is_measured_once_per_shape_and_recorded(monkeypatch):
    assert current_export_mode()['window_softmax'] == 'auto'
    monkeypatch.setattr(wa, '_CHOICES', {})
    timed = []
    real = wa._time_implementations

    def counting(*args, **kwargs):
        timed.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(wa, '_time_implementations', counting)
    attn = ShiftWindowAttention(16, 2, 4).eval()
    with torch.no_grad():
        for _ in range(3):
            attn(torch.randn(1, 64, 16), (8, 8))
        attn(torch.randn(1, 144, 16), (12, 12))
    assert len(timed) == 2, 'one measurement per attention shape'
    choices = wa.window_softmax_choices()
    assert len(choices) == 2
    for choice in choices.values():
        assert choice['impl'] in ('sdpa', 'matmul')
        faster = min(('sdpa', 'matmul'), key=lambda k: choice[f'{k}_ms'])
        assert choice['impl'] == faster


def test_training_and_export_do_not_measure(monkeypatch):
    monkeypatch.setattr(wa, '_time_implementations', lambda *a, **k: pytest.fail('timed'))
    q = torch.randn(2, 2, 16, 8, requires_grad=True)
    k, v = torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    mask = torch.zeros(2, 2, 16, 16)
    assert wa.choose_window_softmax(q, k, v, mask, 0.3) == 'sdpa'


def test_invalid_forced_choice_is_an_error():
    with pytest.raises(ValueError, match='valid: auto, sdpa, matmul'):
        with export_mode(window_softmax='fastest'):
            pass
    assert current_export_mode()['window_softmax'] == 'auto'  # restored after the error


@pytest.mark.parametrize('value, ok', [('matmul', True), ('fastest', False)])
def test_environment_sets_the_process_default_once(value, ok):
    """MMSLAB_WINDOW_SOFTMAX is read when export_mode is imported, and a bad value fails
    there, naming the choices."""
    code = ('from mmslab.models.layers.export_mode import current_export_mode; '
            'print(current_export_mode()["window_softmax"])')
    env = dict(os.environ, MMSLAB_WINDOW_SOFTMAX=value)
    run = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True)
    if ok:
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == value
    else:
        assert run.returncode != 0
        assert "MMSLAB_WINDOW_SOFTMAX='fastest'; valid: auto, sdpa, matmul" in run.stderr
