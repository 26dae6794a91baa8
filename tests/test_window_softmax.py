"""Window softmax attention: the model's computation (PyTorch's fused attention) and the
exported graphs' form (matmul, softmax, matmul) equal an explicit softmax."""

import pytest
import torch

from mmslab.deploy.window_graphs import window_msa_attend
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


@pytest.mark.parametrize('form', ['model', 'graph'])
@pytest.mark.parametrize('shift', [False, True])
def test_each_form_matches_explicit_softmax(form, shift):
    torch.manual_seed(0)
    attn = ShiftWindowAttention(24, 3, 4, shift=shift).eval()
    torch.nn.init.normal_(attn.w_msa.relative_position_bias_table, std=0.5)
    kernel = attn.w_msa
    h, w = 8, 8  # two windows per side, no padding: the layout is a plain partition + roll
    layout = attn._layout(h, w, torch.device('cpu'))
    qkv = torch.randn(2 * layout['num_windows'], 16, 72)
    attend = kernel.attend if form == 'model' else \
        (lambda *a, **k: window_msa_attend(kernel, *a, **k))
    mask = layout.get('shift_mask')
    with torch.no_grad():
        ours = attend(qkv, (4, 4), shift_mask=mask)
    dense = None if mask is None else mask.dense()
    ref = explicit_window_attention(qkv, 3, kernel.scale, kernel.position_bias(), dense)
    torch.testing.assert_close(ours.reshape(ref.shape), ref, rtol=1e-5, atol=1e-5)
    assert (mask is not None and (dense < 0).any()) == shift
