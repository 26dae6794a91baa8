"""Model-level structural re-parameterization: backbone, then its outputs into the neck."""
from typing import Callable, Dict, List

import torch
import torch.nn as nn
from mmdet.models.necks import FPN
from mmseg.models.decode_heads import UPerHead
from torch.nn.modules.batchnorm import _BatchNorm

from .layers.affine import FoldableNorm, fold_affine_into_next_conv
from .layers.reparameterizable import deploy_children


def reparameterize(model: nn.Module) -> nn.Module:
    """Fold every re-parameterizable structure of ``model`` in place and return it.

    Works on a backbone, a detector or a segmentor: the model is put in eval mode, each module
    that knows how to fold itself does (``switch_to_deploy()``, idempotent), parents first.
    Afterwards no mmslab normalization computes statistics at inference: norms with a Linear
    or Conv next to them are folded into it, the rest are per-channel affines.
    """
    model.eval()
    if hasattr(model, 'switch_to_deploy'):
        model.switch_to_deploy()
    deploy_children(model)
    fold_output_affines_into_neck(model)
    for name, m in model.named_modules():
        if isinstance(m, FoldableNorm) and not m.deploy:
            raise RuntimeError(f'{name} ({type(m).__name__}) was not folded')
    return model


def statistic_modules(model: nn.Module):
    """Names and types of modules that still compute normalization statistics."""
    found = []
    for name, m in model.named_modules():
        if isinstance(m, (_BatchNorm, nn.LayerNorm, nn.GroupNorm)) or (
                isinstance(m, FoldableNorm) and not m.deploy):
            found.append((name, type(m).__name__))
    return found


def _fpn_laterals(model: nn.Module) -> Dict[int, nn.Module]:
    neck = model.neck
    found = {}
    for i in range(neck.start_level, neck.backbone_end_level):
        if neck.add_extra_convs == 'on_input' and i == neck.backbone_end_level - 1:
            continue  # also feeds a padded 3x3 extra conv: not foldable exactly
        found[i] = neck.lateral_convs[i - neck.start_level]
    return found


def _uperhead_laterals(model: nn.Module) -> Dict[int, nn.Module]:
    head = model.decode_head
    if head.input_transform not in (None, 'multiple_select'):
        return {}
    aux_inputs = set()
    aux = getattr(model, 'auxiliary_head', None)
    for h in (aux if isinstance(aux, nn.ModuleList) else [aux] if aux is not None else []):
        idx = h.in_index
        aux_inputs.update(idx if isinstance(idx, (list, tuple)) else [idx])
    found = {}
    for lateral, pos in zip(head.lateral_convs, head.in_index[:-1]):
        if pos not in aux_inputs and list(head.in_index).count(pos) == 1:
            found[pos] = lateral
    return found


#: Consumers of the backbone outputs whose 1x1 lateral convs can absorb an output affine,
#: keyed by their exact class (a subclass may route the outputs elsewhere too). Each maps the
#: model to {output position: the ConvModule that is that output's only consumer}.
LATERAL_FOLDERS: Dict[type, Callable[[nn.Module], Dict[int, nn.Module]]] = {
    FPN: _fpn_laterals,
    UPerHead: _uperhead_laterals,
}


def _lateral_convs(model: nn.Module) -> Dict[int, nn.Module]:
    """Backbone output position -> the ConvModule that is its *only* consumer at inference."""
    consumer = getattr(model, 'neck', None)
    if consumer is None:
        consumer = getattr(model, 'decode_head', None)  # mmseg: the head reads the backbone
    laterals = LATERAL_FOLDERS.get(type(consumer))
    return {} if laterals is None else laterals(model)


def fold_output_affines_into_neck(model: nn.Module) -> List[int]:
    """Fold deployed backbone output affines into the 1x1 lateral convs that consume them.

    Handles mmdet's ``FPN`` and mmseg's ``UPerHead`` laterals; an output that also feeds
    anything else (an extra conv on the input, an auxiliary head, the PPM) keeps its affine.
    Returns the folded output positions.
    """
    backbone = getattr(model, 'backbone', None)
    if backbone is None:
        return []
    slots = backbone.output_affines() if hasattr(backbone, 'output_affines') else {}
    folded = []
    for pos, conv_module in _lateral_convs(model).items():
        if pos not in slots or not hasattr(conv_module, 'conv'):
            continue
        conv = conv_module.conv
        padding = conv.padding if isinstance(conv.padding, tuple) else (conv.padding, )
        norm = getattr(conv_module, 'norm', None) if getattr(conv_module, 'with_norm',
                                                              False) else None
        if conv.groups != 1 or any(padding) or (conv.bias is None and not isinstance(
                norm, _BatchNorm)):
            continue
        attr = slots[pos]
        scale, shift = getattr(backbone, attr).fused_affine()
        folded_conv = fold_affine_into_next_conv(conv, scale, shift)
        if conv.bias is None:
            # Keep the structure (no new bias): W t is a constant the BatchNorm after the conv
            # absorbs exactly in eval mode by shifting its running mean.
            with torch.no_grad():
                norm.running_mean.sub_(folded_conv.bias.to(norm.running_mean))
                conv.weight.copy_(folded_conv.weight)
        else:
            conv_module.conv = folded_conv
        setattr(backbone, attr, nn.Identity())
        folded.append(pos)
    if folded:
        # Declared state: deploy configs rebuild the backbone with these norms as Identity,
        # and equivalence checks skip its outputs (see ``fusion_changed_outputs``).
        backbone.folded_out_norms = tuple(sorted(set(backbone.folded_out_norms) | {
            backbone.out_indices[p] for p in folded}))
    return folded
