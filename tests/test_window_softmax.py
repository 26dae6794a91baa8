"""Window softmax attention: the model's computation (PyTorch's fused attention) equals an
explicit softmax, and so does the ``split`` graph form in both head layouts."""

import pytest
import torch

from mmslab.deploy.window_graphs import _attend_padded_split
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


@pytest.mark.parametrize('shift', [False, True])
def test_window_attention_matches_explicit_softmax(shift):
    torch.manual_seed(0)
    attn = ShiftWindowAttention(24, 3, 4, shift=shift).eval()
    torch.nn.init.normal_(attn.w_msa.relative_position_bias_table, std=0.5)
    kernel = attn.w_msa
    h, w = 8, 8  # two windows per side, no padding: the layout is a plain partition + roll
    layout = attn._layout(h, w, torch.device('cpu'))
    qkv = torch.randn(2 * layout['num_windows'], 16, 72)
    mask = layout.get('shift_mask')
    with torch.no_grad():
        ours = kernel.attend(qkv, (4, 4), shift_mask=mask)
    dense = None if mask is None else mask.dense()
    ref = explicit_window_attention(qkv, 3, kernel.scale, kernel.position_bias(), dense)
    torch.testing.assert_close(ours.reshape(ref.shape), ref, rtol=1e-5, atol=1e-5)
    assert (mask is not None and (dense < 0).any()) == shift


@pytest.mark.parametrize('head_layout', ['window_major', 'token_major'])
@pytest.mark.parametrize('shift', [False, True])
def test_split_form_equals_the_model(shift, head_layout):
    """On a padded map (one image, as exports take): the windows gathered from the tokens
    plus the padded token, q, k, v as three MatMuls in each head layout."""
    torch.manual_seed(1)
    attn = ShiftWindowAttention(24, 3, 4, shift=shift).eval()
    torch.nn.init.normal_(attn.w_msa.relative_position_bias_table, std=0.5)
    torch.nn.init.normal_(attn.w_msa.qkv.bias, std=0.5)
    x = torch.randn(1, 10 * 7, 24)
    lay = attn._layout(10, 7, torch.device('cpu'))
    with torch.no_grad():
        ref = attn._attend_padded(x, lay)
        out = _attend_padded_split(attn, x, lay, head_layout)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
