"""Model-level structural re-parameterization."""
from typing import Dict, List, Tuple

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from .layers.affine import FoldableNorm, fold_affine_into_next_conv


def deploy_children(module: nn.Module) -> None:
    """Call ``switch_to_deploy()`` on every descendant, parents before children.

    A parent folds its children first (e.g. a block folds its norm into the next linear and
    drops the norm), so modules a parent removed are never visited.
    """
    for child in list(module.children()):
        if hasattr(child, 'switch_to_deploy'):
            child.switch_to_deploy()
    for child in list(module.children()):
        deploy_children(child)


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


def _output_affine_slots(backbone: nn.Module) -> Dict[int, Tuple[nn.Module, str]]:
    """Backbone output position -> (parent, attribute) of a deployed output affine."""
    slots = {}
    if hasattr(backbone, 'out_indices') and hasattr(backbone, 'stages'):  # Swin
        for pos, i in enumerate(backbone.out_indices):
            norm = getattr(backbone, f'norm{i}', None)
            if isinstance(norm, FoldableNorm) and norm.deploy:
                slots[pos] = (backbone, f'norm{i}')
    return slots


def _lateral_convs(model: nn.Module) -> Dict[int, nn.Module]:
    """Backbone output position -> the ConvModule that is its *only* consumer at inference."""
    neck = getattr(model, 'neck', None)
    if neck is not None and type(neck).__name__ == 'FPN':
        found = {}
        for i in range(neck.start_level, neck.backbone_end_level):
            if neck.add_extra_convs == 'on_input' and i == neck.backbone_end_level - 1:
                continue  # also feeds a padded 3x3 extra conv: not foldable exactly
            found[i] = neck.lateral_convs[i - neck.start_level]
        return found
    head = getattr(model, 'decode_head', None)
    if neck is None and head is not None and type(head).__name__ == 'UPerHead' and \
            head.input_transform in (None, 'multiple_select'):
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
    return {}


def fold_output_affines_into_neck(model: nn.Module) -> List[int]:
    """Fold deployed backbone output affines into the 1x1 lateral convs that consume them.

    Handles mmdet's ``FPN`` and mmseg's ``UPerHead`` laterals; an output that also feeds
    anything else (an extra conv on the input, an auxiliary head, the PPM) keeps its affine.
    Returns the folded output positions.
    """
    backbone = getattr(model, 'backbone', None)
    if backbone is None:
        return []
    slots = _output_affine_slots(backbone)
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
        parent, attr = slots[pos]
        scale, shift = getattr(parent, attr).fused_affine()
        folded_conv = fold_affine_into_next_conv(conv, scale, shift)
        if conv.bias is None:
            # Keep the structure (no new bias): W t is a constant the BatchNorm after the conv
            # absorbs exactly in eval mode by shifting its running mean.
            with torch.no_grad():
                norm.running_mean.sub_(folded_conv.bias.to(norm.running_mean))
                conv.weight.copy_(folded_conv.weight)
        else:
            conv_module.conv = folded_conv
        setattr(parent, attr, nn.Identity())
        folded.append(pos)
    if folded:
        # Its outputs now lack the folded affines: equivalence checks must not compare them.
        backbone.output_changed_by_fusion = True
    if folded and hasattr(backbone, 'folded_out_norms'):
        backbone.folded_out_norms = tuple(sorted(set(backbone.folded_out_norms) | {
            backbone.out_indices[p] for p in folded}))
    return folded
