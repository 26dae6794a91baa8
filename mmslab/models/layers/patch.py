"""Patch embedding and patch merging with foldable norms (mmdet-compatible names)."""
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from mmslab.utils.tensor_state import tensor_state
from .affine import FoldableNorm, fold_affine_into_next_linear, fold_affine_into_prev
from .builder import build_norm, is_foldable_norm
from .reparameterizable import Reparameterizable
from .symbolic import ceil_div, size_max


class _NormFoldingLayer(Reparameterizable, nn.Module):
    """A projection next to a norm; deploy folds a foldable norm into the projection.

    Subclasses name the projection (``_layer_attr``) and how to fold (``_fold``, a function
    of ``(layer, scale, shift)``). ``norm_folded`` records that the norm now lives in it.
    """

    _layer_attr = ''

    @staticmethod
    def _fold(layer: nn.Module, scale, shift) -> nn.Module:
        raise NotImplementedError

    @property
    def needs_eval_mode(self) -> bool:
        return isinstance(self.norm, FoldableNorm)

    def _switch_to_deploy(self) -> None:
        if isinstance(self.norm, FoldableNorm):
            layer = self._fold(getattr(self, self._layer_attr), *self.norm.fused_affine())
            setattr(self, self._layer_attr, layer)
            self.norm = nn.Identity()
            self.norm_folded = True


class PatchEmbed(_NormFoldingLayer):
    """Conv patch embedding with corner padding and a norm, as mmdet's ``PatchEmbed``.

    ``projection`` and ``norm`` keep mmdet's names. In deploy form a foldable norm lives
    inside the conv (including the ``scale * conv_bias`` term).

    Shape: ``[B, C_in, H, W]`` -> (``[B, H'*W', C]``, ``(H', W')``).
    """

    _layer_attr = 'projection'
    _fold = staticmethod(fold_affine_into_prev)

    def __init__(self, in_channels: int, embed_dims: int, patch_size: int, stride: int,
                 norm_cfg=None, adaptive_padding: bool = True, deploy: bool = False):
        super().__init__()
        self.patch_size, self.stride = patch_size, stride
        # Swin pads bottom/right so every pixel is covered; PVT v1 does not pad (floor).
        self.adaptive_padding = adaptive_padding
        fold = deploy and norm_cfg is not None and is_foldable_norm(norm_cfg)
        self.projection = nn.Conv2d(in_channels, embed_dims, patch_size, stride=stride)
        if norm_cfg is None or fold:
            self.norm = nn.Identity()
        else:
            self.norm = build_norm(norm_cfg, embed_dims, deploy=deploy)
        self.norm_folded = fold
        self.deploy = deploy

    def forward(self, x: Tensor) -> Tuple[Tensor, Tuple[int, int]]:
        k, s = self.patch_size, self.stride
        # Channels-last conv output makes the [B, H*W, C] tokens a contiguous view: every
        # later Linear and residual add then runs on contiguous memory. Converted before
        # padding (which keeps the layout): converting the padded image costs more, most of
        # all under torch.compile with a symbolic padding.
        x = x.contiguous(memory_format=torch.channels_last)
        if self.adaptive_padding:
            # sizes: ints, dynamo's symbolic ints or traced tensors (a graph of free size)
            h, w = x.shape[-2], x.shape[-1]
            pad_h = (ceil_div(h, s) - 1) * s + k - h
            pad_w = (ceil_div(w, s) - 1) * s + k - w
            if k < s:  # (never negative otherwise; simpler symbolic sizes downstream)
                pad_h, pad_w = size_max(pad_h, 0), size_max(pad_w, 0)
            # (compiled: always, so that no guard on the sizes recompiles the graph)
            if torch.compiler.is_compiling() or not isinstance(pad_h, int) or pad_h or pad_w:
                x = F.pad(x, (0, pad_w, 0, pad_h))
        x = self.projection(x)
        b, c, h, w = x.shape
        x = x.permute(0, 2, 3, 1).reshape(b, h * w, c)
        return self.norm(x), (h, w)

    def fusion_changed_outputs(self):
        # The conv's output includes the norm that follows it.
        return ('projection', ) if self.norm_folded else ()


class PatchMerging(_NormFoldingLayer):
    """2x2 patch merging: gather, norm, linear reduction, as mmdet's ``PatchMerging``.

    Channels of a merged token are ordered like ``nn.Unfold`` (channel-major, then the 2x2
    offsets) so mmdet weights load. In deploy form a foldable norm is folded into
    ``reduction`` (which then has a bias), and the gather runs offset-major (row offset,
    column offset, channel) against the weights permuted to match (cached copies of the
    reduction's columns and of a remaining LayerNorm's affine, whose statistics ignore the
    order; the state dict keeps unfold's order): gathering whole ``C``-channel tokens is a
    block copy, where unfold's order interleaves single values (a 6-D transpose that cost
    onnxruntime 3 % of Swin-T at 512x512). Odd sizes are zero-padded at the bottom/right.

    Shape: (``[B, H*W, C]``, ``(H, W)``) -> (``[B, ceil(H/2)*ceil(W/2), C_out]``, new hw).
    """

    _layer_attr = 'reduction'
    _fold = staticmethod(fold_affine_into_next_linear)

    def __init__(self, in_channels: int, out_channels: int, norm_cfg=None,
                 deploy: bool = False):
        super().__init__()
        fold = deploy and norm_cfg is not None and is_foldable_norm(norm_cfg)
        self.norm = nn.Identity() if norm_cfg is None or fold else build_norm(
            norm_cfg, 4 * in_channels, deploy=deploy)
        self.reduction = nn.Linear(4 * in_channels, out_channels, bias=fold)
        self.norm_folded = fold
        self.deploy = deploy
        self._offset_major = {}  # name -> (key of the tensor it was made from, permuted copy)

    def _offset_major_copy(self, name: str, t: Tensor) -> Tensor:
        """``t`` with its last dim (``4*C``) permuted from unfold's ``(C, 2, 2)`` order to
        ``(2, 2, C)``; cached until ``t`` changes (computed in the graph under
        ``torch.compile``, which cannot compare data pointers)."""
        if torch.compiler.is_compiling():
            lead, c4 = t.shape[:-1], t.shape[-1]
            return t.reshape(*lead, c4 // 4, 2, 2).movedim(-3, -1).reshape(*lead, c4)
        key = (tensor_state(t), t.dtype, t.device)
        cached = self._offset_major.get(name)
        if cached is None or cached[0] != key:
            lead, c4 = t.shape[:-1], t.shape[-1]
            permuted = t.detach().reshape(*lead, c4 // 4, 2, 2).movedim(-3, -1)
            cached = (key, permuted.reshape(*lead, c4).contiguous())
            self._offset_major[name] = cached
        return cached[1]

    def _offset_major_ready(self) -> bool:
        norm = self.norm
        return self.deploy and (isinstance(norm, nn.Identity) or (
            type(norm) is nn.LayerNorm and norm.weight is not None and norm.bias is not None))

    def forward(self, x: Tensor, hw_shape: Tuple[int, int]) -> Tuple[Tensor, Tuple[int, int]]:
        b, n, c = x.shape
        h, w = hw_shape
        if isinstance(h, int) and n != h * w:
            raise ValueError(f'input has {n} tokens but hw_shape {hw_shape} has {h * w}')
        x = x.view(b, h, w, c)
        offset_major = self._offset_major_ready()
        if torch.compiler.is_compiling():  # symbolic ints: sizes written as ceilings, no branch
            h2, w2 = ceil_div(h, 2), ceil_div(w, 2)
            x = F.pad(x, (0, 0, 0, 2 * w2 - w, 0, 2 * h2 - h))
            # The 2x2 offsets as four strided slices, concatenated (offset-major) or stacked
            # (channel-major): inductor's dynamic-shape code for the reshape-transpose of a
            # padded map below is many times slower than for these.
            parts = [x[:, i::2, j::2] for i in (0, 1) for j in (0, 1)]
            x = (torch.cat(parts, -1) if offset_major else torch.stack(parts, -1)).reshape(
                b, h2 * w2, 4 * c)
        else:
            if not isinstance(h, int) or h % 2 or w % 2:  # (traced sizes: no branch)
                x = F.pad(x, (0, 0, 0, w % 2, 0, h % 2))
            h2, w2 = x.shape[1] // 2, x.shape[2] // 2
            if offset_major:
                # [B, h2, 2, w2, 2*C] -> [B, h2, w2, 2, 2*C]: offset-major, moves whole tokens.
                # (reshape: a channels-last input reaches here as a strided view)
                x = x.reshape(b, h2, 2, w2, 2 * c).transpose(2, 3).reshape(b, h2 * w2, 4 * c)
            else:
                # [B, h2, 2, w2, 2, C] -> [B, h2, w2, C, 2, 2]: unfold's channel-major order.
                x = x.reshape(b, h2, 2, w2, 2, c).permute(0, 1, 3, 5, 2, 4).reshape(
                    b, h2 * w2, 4 * c)
        if offset_major:
            if isinstance(self.norm, nn.LayerNorm):
                x = F.layer_norm(x, self.norm.normalized_shape,
                                 self._offset_major_copy('norm.weight', self.norm.weight),
                                 self._offset_major_copy('norm.bias', self.norm.bias),
                                 self.norm.eps)
            weight = self._offset_major_copy('reduction.weight', self.reduction.weight)
            return F.linear(x, weight, self.reduction.bias), (h2, w2)
        return self.reduction(self.norm(x)), (h2, w2)
