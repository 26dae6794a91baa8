"""Window softmax attention: both implementations equal an explicit softmax; the one used is a
rule (``sdpa`` eager, ``matmul`` in graphs) or set by ``export_mode(window_softmax=...)``."""

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
def test_each_implementation_matches_explicit_softmax(impl, shift):
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


def test_the_choice_is_a_rule():
    """sdpa in eager runs, training and inference alike; matmul while exporting; a set
    form wins. Nothing is timed (no timer is imported by the layers)."""
    assert wa.choose_window_softmax() == 'sdpa'
    with torch.no_grad():
        assert wa.choose_window_softmax() == 'sdpa'
        with export_mode(window_softmax='matmul'):
            assert wa.choose_window_softmax() == 'matmul'
    assert not hasattr(wa, 'fastest_choice')


def test_invalid_forced_choice_is_an_error():
    with pytest.raises(ValueError, match='valid: auto, sdpa, matmul'):
        with export_mode(window_softmax='fastest'):
            pass
    assert current_export_mode()['window_softmax'] == 'auto'  # restored after the error
