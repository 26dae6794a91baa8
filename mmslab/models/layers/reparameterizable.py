"""The structural re-parameterization protocol every fusable mmslab module follows.

A fusable module has two forms with the same constructor: the training form and, with
``deploy=True``, the fused form whose state dict a fused checkpoint holds (exactly the keys,
shapes and outputs ``switch_to_deploy()`` makes of a trained module; enforced for every
registered module and backbone by ``tests/test_deploy_protocol.py``). Every mmslab module
whose constructor takes ``deploy`` has the switch, a no-op where nothing of its own changes
(SLA, BiNorm, GlobalSLA), except the containers that only hand ``deploy`` on
(``ShiftWindowAttention``, ``SwinStage``). As in mmpretrain's
RepVGG/MobileOne, the *computation* of the fused weights is separate from the *swap*:

* a pure method (``fused_affine()``, ``fused_weights()``, ...) returns tensors and changes
  nothing;
* :meth:`Reparameterizable.switch_to_deploy` runs the guard shared by all of them (a no-op
  when already fused; refuse training mode when the fused weights depend on running
  statistics), calls the subclass's ``_switch_to_deploy()`` to swap sub-modules and
  parameters, then sets ``deploy = True``.

:func:`deploy_children` applies the switch to a whole tree, parents first, so a parent that
folds a child norm into its neighbour removes that child before it is visited.
"""
from typing import Tuple

import torch
import torch.nn as nn


class Reparameterizable:
    """Mixin of modules with a fused (``deploy``) form; see the module docstring.

    Subclasses set ``self.deploy`` in ``__init__`` and implement ``_switch_to_deploy()``.

    Attributes:
        needs_eval_mode: the fused weights use running statistics or eval-mode behaviour, so
            fusing a module in training mode is an error (a property where it depends on the
            module's children).
    """

    needs_eval_mode = True
    deploy: bool

    @torch.no_grad()
    def switch_to_deploy(self) -> None:
        """Turn this module into its fused form in place (idempotent)."""
        if self.deploy:
            return
        if self.training and self.needs_eval_mode:
            raise RuntimeError(f'{type(self).__name__}.switch_to_deploy() needs eval mode: the '
                               'fused weights use running statistics. Call model.eval() first.')
        self._switch_to_deploy()
        self.deploy = True

    def _switch_to_deploy(self) -> None:
        raise NotImplementedError

    def fusion_changed_outputs(self) -> Tuple[str, ...]:
        """Names of sub-modules (``''``: this module) whose *output* fusion changes by design,
        e.g. a conv that absorbed the norm after it. Equivalence checks between a model and
        its fused copy skip them."""
        return ()


def deploy_children(module: nn.Module) -> None:
    """Call ``switch_to_deploy()`` on every descendant, parents before children.

    A parent folds its children first (e.g. a block folds its norm into the next linear and
    drops the norm), so modules a parent removed are never visited.
    """
    for child in list(module.children()):
        # Duck-typed: OpenMMLab's own re-parameterizable blocks (RepVGG, MobileOne) fold too.
        if hasattr(child, 'switch_to_deploy'):
            child.switch_to_deploy()
    for child in list(module.children()):
        deploy_children(child)
