"""Model-level structural re-parameterization."""
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from .layers.affine import FoldableNorm


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
