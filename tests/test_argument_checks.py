"""Bad backbone arguments give errors that name the problem and the valid choices."""
import pytest
import torch

from mmslab.models import ReparamPVT, ReparamSwinTransformer

SWIN = dict(embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2), window_size=4)
PVT = dict(embed_dims=8, num_layers=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
           mlp_ratios=(2, 2, 2, 2), pretrain_img_size=64)


@pytest.mark.parametrize('frozen', [5, 9, -2])
def test_swin_frozen_stages_out_of_range(frozen):
    with pytest.raises(ValueError, match=r'frozen_stages must be in \[-1, 4\]'):
        ReparamSwinTransformer(**SWIN, frozen_stages=frozen)


@pytest.mark.parametrize('frozen', [-1, 0, 2, 4])
def test_swin_frozen_stages_valid_range_builds_and_trains(frozen):
    """Every value in [-1, 4] builds; after ``train()`` exactly the patch embedding (0) and
    stages 1..frozen with their output norms are frozen (no gradients, eval mode; 4: the
    whole backbone), and a training step gives a gradient to every other parameter."""
    model = ReparamSwinTransformer(**SWIN, frozen_stages=frozen).train()
    frozen_prefixes = (['patch_embed.'] if frozen >= 0 else []) + [
        p for i in range(frozen) for p in (f'stages.{i}.', f'norm{i}.')]
    params = dict(model.named_parameters())
    expect_frozen = {n for n in params if n.startswith(tuple(frozen_prefixes))}
    assert {n for n, p in params.items() if not p.requires_grad} == expect_frozen
    assert bool(expect_frozen) == (frozen >= 0)
    assert (expect_frozen == set(params)) == (frozen == 4)  # 4: the whole backbone
    for name, module in model.named_modules():
        if name and (name + '.').startswith(tuple(frozen_prefixes)):
            assert not module.training, name

    outs = model(torch.randn(2, 3, 64, 64))
    assert [o.shape[1] for o in outs] == [16, 32, 64, 128]
    if frozen == 4:
        assert not any(o.requires_grad for o in outs)
        return
    sum(o.square().mean() for o in outs).backward()
    for name, p in params.items():
        if name in expect_frozen:
            assert p.grad is None, name
        else:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize('frozen', [4, 9, -2])
def test_pvt_frozen_stages_out_of_range(frozen):
    with pytest.raises(ValueError, match=r'frozen_stages must be in \[-1, 3\]'):
        ReparamPVT(**PVT, frozen_stages=frozen)


@pytest.mark.parametrize('cls,kwargs', [(ReparamSwinTransformer, SWIN), (ReparamPVT, PVT)])
def test_pretrained_and_init_cfg_together_raise(cls, kwargs):
    with pytest.raises(ValueError, match='init_cfg and pretrained cannot be set at the same'):
        cls(**kwargs, pretrained='a.pth', init_cfg=dict(type='Pretrained', checkpoint='b.pth'))
