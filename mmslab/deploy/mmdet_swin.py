"""Export of mmdet's and mmseg's own Swin Transformer: their layers' graph forms (rewrites,
see :mod:`.rewriters`).

Their ``ShiftWindowMSA`` and ``AdaptivePadding`` compute sizes with Python (``math.ceil``,
``int(...)``, ``if pad > 0``), so a traced graph would hold the padding, window count and
shift mask of the traced size only. The rewrites compute the same quantities from the
runtime size in the graph (what mmdeploy's rewrites did for its own export); the numbers
are those of the original forwards (``tests/test_dynamic_export.py`` compares them). The
shifted-window rewrite's shift mask fills
:data:`~mmslab.models.layers.shift_mask.SHIFT_MASK_FILL` where mmdet's fills -100, whose
masked softmax probabilities are denormal floats that onnxruntime multiplies many times
slower (the outputs are the same). In the ``split`` form their ``WindowMSA`` exports as
mmslab's window attention does (:mod:`.window_graphs`).
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from mmslab.models.layers.shift_mask import shift_mask_by_type
from mmslab.models.layers.symbolic import ceil_div, size_max
from .rewriters import register_rewriter
from .window_graphs import split_qkv


def foreign_window_msa_classes() -> tuple:
    """mmdet's and mmseg's own ``WindowMSA`` classes, those installed."""
    classes = []
    for module in ('mmdet.models.backbones.swin', 'mmseg.models.backbones.swin'):
        try:
            classes.append(__import__(module, fromlist=['WindowMSA']).WindowMSA)
        except ImportError:
            pass
    return tuple(classes)


def _adaptive_padding_forward(self, x: Tensor) -> Tensor:
    """``AdaptivePadding.forward`` with traced sizes (pads by zero when nothing is needed)."""
    (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
    h, w = x.shape[-2], x.shape[-1]
    pad_h = size_max((ceil_div(h, sh) - 1) * sh + (kh - 1) * dh + 1 - h, 0)
    pad_w = size_max((ceil_div(w, sw) - 1) * sw + (kw - 1) * dw + 1 - w, 0)
    if self.padding == 'corner':
        return F.pad(x, [0, pad_w, 0, pad_h])
    return F.pad(x, [pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2])


def _shift_window_msa_forward(self, query: Tensor, hw_shape) -> Tensor:
    """``ShiftWindowMSA.forward`` with padding, window partition / reverse and the shift
    mask computed from the runtime size."""
    b, _, c = query.shape
    h, w = hw_shape
    ws, s = self.window_size, self.shift_size
    x = query.view(b, h, w, c)
    x = F.pad(x, (0, 0, 0, (ws - w % ws) % ws, 0, (ws - h % ws) % ws))
    hp, wp = x.shape[1], x.shape[2]
    mask = None
    if s > 0:
        x = torch.roll(x, shifts=(-s, -s), dims=(1, 2))
        mask = shift_mask_by_type(hp, wp, ws, ws, s, device=x.device).dense()  # img_mask
    windows = x.view(b, hp // ws, ws, wp // ws, ws, c).transpose(2, 3).reshape(-1, ws * ws, c)
    out = self.w_msa(windows, mask=mask)
    x = out.view(b, hp // ws, wp // ws, ws, ws, c).transpose(2, 3).reshape(b, hp, wp, c)
    if s > 0:
        x = torch.roll(x, shifts=(s, s), dims=(1, 2))
    x = x[:, :h, :w, :].reshape(b, h * w, c)
    return self.drop(x)


def _window_msa_split_forward(self, x: Tensor, mask=None, head_layout='window_major'):
    """``WindowMSA.forward`` in the ``split`` form: q, k, v as three MatMuls in the
    runtime's head layout, the scale folded into q; the same function as mmdet's."""
    b, n, c = x.shape
    q, k, v = split_qkv(self.qkv, x, n, self.num_heads, self.scale, head_layout)
    attn = q @ k
    bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(
        n, n, -1).permute(2, 0, 1)
    if mask is not None:  # one image: B = nW
        bias = bias + mask.unsqueeze(1)
    attn = self.attn_drop(self.softmax(attn + bias))
    out = (attn @ v).transpose(1, 2).reshape(b, n, c)
    return self.proj_drop(self.proj(out))


def _window_msa_token_major(self, x: Tensor, mask=None) -> Tensor:
    return _window_msa_split_forward(self, x, mask, 'token_major')


def _register() -> None:
    """Register the rewrites for every Swin implementation installed."""
    for module, pad_module in (('mmdet.models.backbones.swin',
                                'mmdet.models.layers.transformer.utils'),
                               ('mmseg.models.backbones.swin', 'mmseg.models.utils.embed'),
                               (None, 'mmcv.cnn.bricks.transformer')):
        try:
            if module is not None:
                msa = __import__(module, fromlist=['ShiftWindowMSA']).ShiftWindowMSA
                register_rewriter(msa, 'forward')(_shift_window_msa_forward)
            pad = __import__(pad_module, fromlist=['AdaptivePadding']).AdaptivePadding
            register_rewriter(pad, 'forward')(_adaptive_padding_forward)
        except ImportError:
            pass
    for cls in foreign_window_msa_classes():
        register_rewriter(cls, 'forward', ['openvino'], form='split')(_window_msa_split_forward)
        register_rewriter(cls, 'forward', ['onnxruntime'], form='split')(
            _window_msa_token_major)


_register()
