"""Behaviour shared by mmslab backbones."""
import torch.nn as nn
from mmengine.logging import MMLogger
from torch.nn.modules.batchnorm import _BatchNorm

BN_STATS = ('train', 'frozen')


class ReparamBackboneMixin:
    """BN-statistics policy, pretrained loading and the deploy switch of mmslab backbones.

    Expects ``self.bn_stats`` and ``self.init_cfg``.
    """

    def _apply_bn_stats_policy(self, mode: bool) -> None:
        """Keep BatchNorm-type layers in eval mode where the statistics policy freezes them:
        the body's with ``bn_stats='frozen'``, the output norms' with
        ``out_bn_stats='frozen'`` (``None``: as the body)."""
        if not mode:
            return
        from ..layers.unified_norm import UN
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

    def _load_pretrained(self) -> bool:
        """Load ``init_cfg=dict(type='Pretrained', checkpoint=..., prefix=...,
        reset_schedule=False, allow_uninitialized=False)``; returns whether it did."""
        if self.init_cfg is None or self.init_cfg.get('type') != 'Pretrained':
            return False
        from ..checkpoint_utils import load_pretrained_backbone
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

    def switch_to_deploy(self) -> None:
        """Fold every foldable structure (see :func:`mmslab.reparameterize`)."""
        if self.training:
            raise RuntimeError('switch_to_deploy() needs eval mode: call model.eval() first')
        from ..reparam import deploy_children
        deploy_children(self)
        self.deploy = True


def check_bn_stats(bn_stats: str) -> str:
    if bn_stats not in BN_STATS:
        raise ValueError(f'bn_stats must be one of {BN_STATS}, got {bn_stats!r}')
    return bn_stats


def freeze_module(m: nn.Module) -> None:
    m.eval()
    for p in m.parameters():
        p.requires_grad = False
