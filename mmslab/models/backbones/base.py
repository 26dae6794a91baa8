"""Behaviour shared by mmslab backbones."""
import copy

import torch.nn as nn
from mmengine.logging import MMLogger
from mmengine.model import BaseModule
from torch.nn.modules.batchnorm import _BatchNorm

from ..checkpoint_utils import load_pretrained_backbone
from ..layers.reparameterizable import Reparameterizable, deploy_children
from ..layers.repbn import SLAB_PREPBN_STEPS
from ..layers.unified_norm import UN

BN_STATS = ('train', 'frozen')

#: The default ``norm_cfg`` of the SLAB presets (PRepBN-*, SLAB-*): progressive PRepBN over the
#: SLAB authors' ImageNet decay length, 300k iterations. A registered model name builds the
#: published model with its published settings, as mmdet's ``SwinTransformer()`` is Swin-T;
#: the authors' converted checkpoints carry a finished schedule, so ``step`` only drives norms
#: that start fresh. A fine-tuning config passes ``norm_cfg=dict(type='PRepBN', step=...)``
#: from its own schedule, as every shipped config does (``prepbn_step``).
SLAB_NORM_CFG = dict(type='PRepBN', step=SLAB_PREPBN_STEPS)


class BackbonePreset:
    """Mixin of preset backbones (``class SLABSwin(BackbonePreset, ReparamSwinTransformer)``):
    the parent's constructor with the defaults in ``preset``, each overridable by a keyword
    (like mmpretrain's ``arch_settings``, timm's ``model_args``)."""

    preset: dict = {}

    def __init__(self, **kwargs):
        super().__init__(**{**copy.deepcopy(self.preset), **kwargs})


class ReparamBackboneMixin(Reparameterizable):
    """BN-statistics policy, initialization, pretrained loading and the deploy switch of
    mmslab backbones.

    Expects ``self.bn_stats``, ``self.init_cfg`` and ``self.deploy``.

    Attributes:
        folded_out_norms: output indices whose norm :func:`mmslab.reparameterize` folded
            into the neck (their outputs then lack it); none unless the backbone has output
            norms to fold (see :meth:`output_affines`).
    """

    folded_out_norms = ()

    def _apply_bn_stats_policy(self, mode: bool) -> None:
        """Keep BatchNorm-type layers in eval mode where the statistics policy freezes them:
        the body's with ``bn_stats='frozen'``, the output norms' with
        ``out_bn_stats='frozen'`` (``None``: as the body)."""
        if not mode:
            return
        out_norms = set(self._output_norms())
        out_policy = getattr(self, 'out_bn_stats', None) or self.bn_stats

        def freeze_stats(module: nn.Module) -> None:
            for m in module.modules():
                if isinstance(m, (_BatchNorm, UN)):
                    m.eval()

        if out_policy == 'frozen':
            for m in out_norms:
                freeze_stats(m)
        if self.bn_stats == 'frozen':
            for name, child in self.named_children():
                if child not in out_norms:
                    freeze_stats(child)

    def _output_norms(self):
        """The norms applied to the returned feature maps only (none by default)."""
        return []

    def output_affines(self) -> dict:
        """Output position -> attribute name of a deployed per-channel output affine that
        :func:`mmslab.reparameterize` may fold into the neck (none by default)."""
        return {}

    def fusion_changed_outputs(self):
        # Outputs whose norm moved into the neck are returned without it.
        return ('', ) if self.folded_out_norms else ()

    def _load_pretrained(self) -> bool:
        """Load ``init_cfg=dict(type='Pretrained', checkpoint=..., prefix=...,
        reset_schedule=False, allow_uninitialized=False)``; returns whether it did."""
        if self.init_cfg is None or self.init_cfg.get('type') != 'Pretrained':
            return False
        known = {'type', 'checkpoint', 'prefix', 'reset_schedule', 'allow_uninitialized',
                 'map_location'}
        unknown = set(self.init_cfg) - known
        if unknown:
            raise ValueError(f'init_cfg has unknown keys {sorted(unknown)}; valid: '
                             f'{sorted(known)}')
        load_pretrained_backbone(self, self.init_cfg['checkpoint'],
                                 prefix=self.init_cfg.get('prefix'),
                                 logger=MMLogger.get_current_instance(),
                                 reset_schedule=self.init_cfg.get('reset_schedule', False),
                                 allow_uninitialized=self.init_cfg.get('allow_uninitialized',
                                                                       False))
        return True

    def init_weights(self) -> None:
        """``init_cfg=dict(type='Pretrained', ...)`` loads a checkpoint; another ``init_cfg``
        is mmengine's; without one, every layer gets the backbone's default
        (:meth:`_init_default`), then every child with an ``init_weights`` of its own that
        is not an mmengine ``BaseModule`` (a kernel's bias table, a position embedding)
        runs it, so a layer's own initialization wins, in any backbone it is placed in."""
        if self._load_pretrained():
            return
        if self.init_cfg is not None:
            super().init_weights()
            return
        for m in self.modules():
            self._init_default(m)
        for m in self.modules():
            if m is not self and hasattr(m, 'init_weights') and not isinstance(m, BaseModule):
                m.init_weights()

    def _init_default(self, m: nn.Module) -> None:
        """The backbone's default initialization of one layer (the authors')."""
        raise NotImplementedError

    def _switch_to_deploy(self) -> None:
        """Fold every foldable structure (see :func:`mmslab.reparameterize`)."""
        deploy_children(self)


def check_bn_stats(bn_stats: str) -> str:
    if bn_stats not in BN_STATS:
        raise ValueError(f'bn_stats must be one of {BN_STATS}, got {bn_stats!r}')
    return bn_stats


def freeze_module(m: nn.Module) -> None:
    m.eval()
    for p in m.parameters():
        p.requires_grad = False


def init_cfg_from_pretrained(pretrained, init_cfg):
    """mmdet's deprecated ``pretrained=path`` as ``init_cfg=dict(type='Pretrained', ...)``."""
    if pretrained is None:
        return init_cfg
    if init_cfg is not None:
        raise ValueError('init_cfg and pretrained cannot be set at the same time')
    return dict(type='Pretrained', checkpoint=pretrained)


def per_stage(value, num_stages: int, what: str) -> tuple:
    """A per-stage setting given once (repeated) or as a sequence of one entry per stage."""
    values = tuple(value) if isinstance(value, (list, tuple)) else (value, ) * num_stages
    if len(values) != num_stages:
        raise ValueError(f'{what} needs one entry per stage ({num_stages}), got {value!r}')
    return values
