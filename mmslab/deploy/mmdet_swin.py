"""Export of mmdet's and mmseg's own Swin Transformer.

Their ``ShiftWindowMSA`` and ``AdaptivePadding`` compute sizes with Python (``math.ceil``,
``int(...)``, ``if pad > 0``), so a traced graph holds the padding, window count and shift
mask of the traced size only. :func:`dynamic_mmdet_swin` swaps in forwards that compute the
same quantities from the runtime size in the graph (what mmdeploy's rewrites did for its own
export), for the duration of a dynamic export; the numbers are those of the original
forwards (``tests/test_dynamic_export.py`` compares them).

Every export, static ones too (:func:`mmdet_swin_export_forwards`), takes mmslab's shifted
window forward: its shift mask fills :data:`~mmslab.models.layers.shift_window.SHIFT_MASK_FILL`
where mmdet's fills -100, whose masked softmax probabilities are denormal floats that
onnxruntime multiplies many times slower (the outputs are the same).
"""
from contextlib import contextmanager
from typing import Iterator, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from mmslab.models.layers.shift_window import shift_window_mask
from mmslab.models.layers.symbolic import as_size, ceil_div
from mmslab.models.layers.window_attention import foreign_window_msa_classes, split_qkv


def _adaptive_padding_forward(self, x: Tensor) -> Tensor:
    """``AdaptivePadding.forward`` with traced sizes (pads by zero when nothing is needed)."""
    (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
    h, w = as_size(x.shape[-2], x.device), as_size(x.shape[-1], x.device)
    pad_h = ((ceil_div(h, sh) - 1) * sh + (kh - 1) * dh + 1 - h).clamp(min=0)
    pad_w = ((ceil_div(w, sw) - 1) * sw + (kw - 1) * dw + 1 - w).clamp(min=0)
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
        mask = shift_window_mask(hp, wp, ws, ws, s, x.device)  # mmdet's img_mask, in the graph
    windows = x.view(b, hp // ws, ws, wp // ws, ws, c).transpose(2, 3).reshape(-1, ws * ws, c)
    out = self.w_msa(windows, mask=mask)
    x = out.view(b, hp // ws, wp // ws, ws, ws, c).transpose(2, 3).reshape(b, hp, wp, c)
    if s > 0:
        x = torch.roll(x, shifts=(s, s), dims=(1, 2))
    x = x[:, :h, :w, :].reshape(b, h * w, c)
    return self.drop(x)


def _window_msa_split_forward(self, x: Tensor, mask=None) -> Tensor:
    """``WindowMSA.forward`` in the ``split`` exported attention layout (see
    :mod:`mmslab.models.layers.export_mode`): q, k, v as three
    MatMuls with the standard multi-head transposes and the scale folded into q; the same
    function as mmdet's."""
    b, n, c = x.shape
    q, k, v = split_qkv(self.qkv, x, n, self.num_heads, self.scale)
    attn = q @ k
    bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(
        n, n, -1).permute(2, 0, 1)
    if mask is not None:  # one image: B = nW (as in WindowMSA.attend_tokens)
        bias = bias + mask.unsqueeze(1)
    attn = self.attn_drop(self.softmax(attn + bias))
    out = (attn @ v).transpose(1, 2).reshape(b, n, c)
    return self.proj_drop(self.proj(out))


def _split_attention_classes() -> List[Tuple[type, str, object]]:
    return [(cls, 'forward', _window_msa_split_forward) for cls in foreign_window_msa_classes()]


def _patched_classes(dynamic: bool = True) -> List[Tuple[type, str, object]]:
    """(class, method name, replacement) for every Swin implementation installed: the
    shifted-window attention, and with ``dynamic`` the patch embedding's padding."""
    targets = []
    try:
        from mmdet.models.backbones.swin import ShiftWindowMSA as DetMSA
        from mmdet.models.layers.transformer.utils import AdaptivePadding as DetPad
        targets += [(DetMSA, 'forward', _shift_window_msa_forward),
                    (DetPad, 'forward', _adaptive_padding_forward)]
    except ImportError:
        pass
    try:
        from mmseg.models.backbones.swin import ShiftWindowMSA as SegMSA
        from mmseg.models.utils.embed import AdaptivePadding as SegPad
        targets += [(SegMSA, 'forward', _shift_window_msa_forward),
                    (SegPad, 'forward', _adaptive_padding_forward)]
    except ImportError:
        pass
    try:
        from mmcv.cnn.bricks.transformer import AdaptivePadding as CvPad
        targets.append((CvPad, 'forward', _adaptive_padding_forward))
    except ImportError:
        pass
    # a static graph keeps the original padding forward: its sizes are the traced ones
    return [t for t in targets if dynamic or t[2] is not _adaptive_padding_forward]


@contextmanager
def mmdet_swin_export_forwards(dynamic: bool) -> Iterator[None]:
    """Inside the block, mmdet's / mmseg's Swin layers take mmslab's export forwards: the
    shifted-window attention always (its denormal-free shift mask), and with ``dynamic``
    the shape-generic padding too."""
    with _patched(_patched_classes(dynamic)):
        yield


@contextmanager
def dynamic_mmdet_swin() -> Iterator[None]:
    """Inside the block, mmdet's / mmseg's Swin layers take the shape-generic forwards."""
    with mmdet_swin_export_forwards(dynamic=True):
        yield


@contextmanager
def split_mmdet_window_attention() -> Iterator[None]:
    """Inside the block, mmdet's / mmseg's ``WindowMSA`` export in the ``split`` layout, as
    mmslab's window attention does, so both are exported the same way."""
    with _patched(_split_attention_classes()):
        yield


_INHERITED = object()  # saved in place of a method the class inherits: restore by deleting


@contextmanager
def _patched(targets) -> Iterator[None]:
    """Set each ``(class, name, function)`` for the block; on leaving it, however that
    happens, every class is as it was: its own method put back, or, where it inherited the
    method, the class attribute deleted so that it inherits again."""
    saved = []
    try:
        for cls, name, fn in targets:
            if any(cls is c and name == n for c, n, _ in saved):
                continue  # one class reachable from two packages
            saved.append((cls, name, vars(cls).get(name, _INHERITED)))
            setattr(cls, name, fn)
        yield
    finally:
        for cls, name, original in reversed(saved):
            if original is _INHERITED:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
