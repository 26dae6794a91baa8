"""The deploy protocol, enforced over the registry: ``deploy=True`` builds exactly what
``switch_to_deploy()`` makes of a trained model (keys, shapes, outputs).

Every case trains a copy for a few steps (PRepBN/UN schedules driven, BatchNorm statistics
updated), perturbs every parameter and statistic so no fold is the identity, fuses it, then
loads the fused state dict *strictly* into a ``deploy=True`` build and compares outputs on
noisy input. A new registered re-parameterizable class fails ``test_grid_covers_registry``
until it has a case here.
"""
import copy
import inspect
import itertools

import pytest
import torch
import torch.nn as nn

import mmslab  # noqa: F401  (registers everything)
from conftest import rel_err
from mmslab.engine.hooks import set_progressive_iter
from mmslab.models.backbones.base import ReparamBackboneMixin
from mmslab.models.backbones.pvt import PVTBlock, ReparamPVT
from mmslab.models.backbones.swin import ReparamSwinTransformer, SwinBlock
from mmslab.models.layers import (FoldableNorm, PatchEmbed, PatchMerging, Reparameterizable,
                                  build_norm, deploy_children)
from mmslab.registry import MODELS

#: Norms whose deploy form differs in structure (LN is kept; the others become affines).
NORMS = {
    'LN': dict(type='LN'),
    'RepBN': dict(type='RepBN'),
    'PRepBN': dict(type='PRepBN', step=4),
    'UN': dict(type='UN', warmup_iters=1, window_size=2),
    'TokenBN': dict(type='TokenBN'),
}
C = 8


def perturb(model: nn.Module, seed: int = 0) -> nn.Module:
    """Move every parameter and running statistic away from its initial value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith('running_mean'):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
            elif name.endswith('running_var'):
                b.copy_(torch.rand(b.shape, generator=g) * 1.5 + 0.5)
    return model


def train_steps(model: nn.Module, make_input, steps: int = 2) -> None:
    """A few SGD steps in training mode (schedules driven, statistics updated)."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for it in range(steps):
        set_progressive_iter(model, it)
        out = model(*make_input())
        loss = sum(o.square().mean() for o in (out if isinstance(out, tuple) else (out, ))
                   if isinstance(o, torch.Tensor))
        opt.zero_grad()
        loss.backward()
        opt.step()


def fuse(model: nn.Module) -> nn.Module:
    """What ``mmslab.reparameterize`` does to a module: itself, then its descendants."""
    model.eval()
    if hasattr(model, 'switch_to_deploy'):
        model.switch_to_deploy()
    deploy_children(model)
    return model


def outputs(model, inputs):
    with torch.no_grad():
        out = model(*inputs)
    return [o for o in (out if isinstance(out, tuple) else (out, )) if isinstance(o, torch.Tensor)]


def check_protocol(build, make_input, tol=1e-4):
    """``build(deploy)`` -> module; ``make_input()`` -> forward arguments."""
    torch.manual_seed(0)
    model = build(False)
    train_steps(model, make_input)
    perturb(model).eval()
    fused = fuse(copy.deepcopy(model))
    deployed = build(True).eval()
    fused_sd, deployed_sd = fused.state_dict(), deployed.state_dict()
    assert sorted(deployed_sd) == sorted(fused_sd), (
        f'deploy=True keys differ from switch_to_deploy(): only in deploy=True '
        f'{sorted(set(deployed_sd) - set(fused_sd))}, only in the fused model '
        f'{sorted(set(fused_sd) - set(deployed_sd))}')
    for k, v in fused_sd.items():
        assert deployed_sd[k].shape == v.shape, k
    deployed.load_state_dict(fused_sd, strict=True)
    x = make_input()
    ref, a, b = outputs(model, x), outputs(fused, x), outputs(deployed, x)
    assert len(ref) == len(a) == len(b)
    for r, f, d in zip(ref, a, b):
        assert torch.equal(f, d)
        assert rel_err(f, r) <= tol


# -- layers --------------------------------------------------------------------------------------
def tokens(hw=(6, 5), c=C):
    return lambda: (torch.randn(2, hw[0] * hw[1], c), hw)


@pytest.mark.parametrize('norm', [n for n in NORMS if n != 'LN'])
@pytest.mark.parametrize('data_format', ['channels_last', 'channels_first'])
def test_norm(norm, data_format):
    shape = (2, 5, C) if data_format == 'channels_last' else (2, C, 3, 4)
    check_protocol(lambda deploy: build_norm(NORMS[norm], C, data_format, deploy=deploy),
                   lambda: (torch.randn(shape), ))


@pytest.mark.parametrize('norm', NORMS)
def test_patch_layers(norm):
    cfg = NORMS[norm]
    check_protocol(lambda deploy: PatchEmbed(3, C, 4, 4, cfg, deploy=deploy),
                   lambda: (torch.randn(2, 3, 18, 22), ))
    check_protocol(lambda deploy: PatchMerging(C, 2 * C, cfg, deploy=deploy), tokens((5, 6)))


@pytest.mark.parametrize('norm,attn,ffn,qkv_bias', itertools.product(
    NORMS, ['window', 'sla', 'binorm'], ['mlp', 'channel_idle'], [True, False]))
def test_swin_block(norm, attn, ffn, qkv_bias):
    def build(deploy):
        return SwinBlock(C, 2, 2 * C, window_size=4, shift=True, attn_type=attn, ffn_type=ffn,
                         qkv_bias=qkv_bias, norm_cfg=NORMS[norm], deploy=deploy)

    check_protocol(build, tokens((6, 5)))  # padded windows: the qkv_pad path


@pytest.mark.parametrize('norm,attn,sr_ratio,qkv_bias', itertools.product(
    NORMS, ['softmax', 'sla', 'binorm'], [1, 2], [True, False]))
def test_pvt_block(norm, attn, sr_ratio, qkv_bias):
    def build(deploy):
        return PVTBlock(C, 2, 2 * C, sr_ratio, attn, (4, 4), qkv_bias, 0.0, 0.0, 0.0, None,
                        NORMS[norm], deploy=deploy)

    check_protocol(build, tokens((4, 4)))


# -- backbones (every registered one: the base classes and their presets) ----------------------
def registered_backbones():
    return sorted(name for name, cls in MODELS.module_dict.items()
                  if isinstance(cls, type) and issubclass(cls, ReparamBackboneMixin))


def tiny_backbone(name, norm, qkv_bias, deploy):
    cls = MODELS.get(name)
    kwargs = dict(norm_cfg=NORMS[norm], qkv_bias=qkv_bias, drop_path_rate=0.0, deploy=deploy)
    if issubclass(cls, ReparamSwinTransformer):
        kwargs.update(embed_dims=C, depths=(2, 1, 1, 1), num_heads=(1, 2, 2, 4))
        if 'window_size' not in getattr(cls, 'preset', {}):
            kwargs['window_size'] = 4
    else:
        assert issubclass(cls, ReparamPVT), name
        kwargs.update(embed_dims=4, num_layers=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                      mlp_ratios=(2, 2, 2, 2), pretrain_img_size=64)
    return cls(**kwargs)


@pytest.mark.parametrize('name,norm,qkv_bias', itertools.product(
    registered_backbones(), ['LN', 'RepBN', 'PRepBN', 'UN'], [True, False]))
def test_backbone(name, norm, qkv_bias):
    check_protocol(lambda deploy: tiny_backbone(name, norm, qkv_bias, deploy),
                   lambda: (torch.randn(2, 3, 60, 68), ), tol=1e-3)


# -- coverage and the contract of the ``deploy`` argument --------------------------------------
def all_grid_modules():
    """Every module class the grid above instantiates."""
    built = [build_norm(cfg, C) for cfg in NORMS.values()]
    for cfg in NORMS.values():
        built += [PatchEmbed(3, C, 4, 4, cfg), PatchMerging(C, 2 * C, cfg)]
    for attn, ffn in itertools.product(['window', 'sla', 'binorm'], ['mlp', 'channel_idle']):
        built.append(SwinBlock(C, 2, 2 * C, window_size=4, attn_type=attn, ffn_type=ffn))
    for attn, sr in itertools.product(['softmax', 'sla', 'binorm'], [1, 2]):
        built.append(PVTBlock(C, 2, 2 * C, sr, attn, (4, 4), True, 0., 0., 0., None,
                              dict(type='LN')))
    built += [tiny_backbone(n, 'LN', True, False) for n in registered_backbones()]
    return {type(m) for b in built for m in b.modules()}


def test_grid_covers_registry():
    reparam = {cls for cls in MODELS.module_dict.values()
               if isinstance(cls, type) and issubclass(cls, Reparameterizable)}
    missing = reparam - all_grid_modules()
    assert not missing, f'registered re-parameterizable classes without a protocol case: ' \
                        f'{sorted(c.__name__ for c in missing)}'


#: Classes that take ``deploy`` only to hand it to the layers they build (no state of their
#: own changes): documented in their docstrings and docs/architecture.md.
PASS_THROUGH = {'ShiftWindowAttention', 'SwinStage'}


def test_every_module_taking_deploy_can_switch():
    classes = set()
    for cls in all_grid_modules() | set(MODELS.module_dict.values()):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            continue
        if not cls.__module__.startswith('mmslab.'):
            continue
        if 'deploy' in inspect.signature(cls.__init__).parameters:
            classes.add(cls)
    assert classes
    for cls in classes:
        if cls.__name__ in PASS_THROUGH:
            continue
        assert issubclass(cls, Reparameterizable), (
            f'{cls.__name__} takes deploy= but has no switch_to_deploy(); subclass '
            'Reparameterizable or list it as a pass-through')
        if issubclass(cls, FoldableNorm):
            continue
        assert cls._switch_to_deploy is not Reparameterizable._switch_to_deploy, cls
