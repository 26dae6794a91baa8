"""Bad backbone arguments give errors that name the problem and the valid choices."""
import pytest

from mmslab.models import ReparamPVT, ReparamSwinTransformer

SWIN = dict(embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2), window_size=4)
PVT = dict(embed_dims=8, num_layers=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
           mlp_ratios=(2, 2, 2, 2), pretrain_img_size=64)


@pytest.mark.parametrize('frozen', [5, 9, -2])
def test_swin_frozen_stages_out_of_range(frozen):
    with pytest.raises(ValueError, match=r'frozen_stages must be in \[-1, 4\]'):
        ReparamSwinTransformer(**SWIN, frozen_stages=frozen)


@pytest.mark.parametrize('frozen', [-1, 0, 4])
def test_swin_frozen_stages_valid_range_builds_and_trains(frozen):
    ReparamSwinTransformer(**SWIN, frozen_stages=frozen).train()


@pytest.mark.parametrize('frozen', [4, 9, -2])
def test_pvt_frozen_stages_out_of_range(frozen):
    with pytest.raises(ValueError, match=r'frozen_stages must be in \[-1, 3\]'):
        ReparamPVT(**PVT, frozen_stages=frozen)


@pytest.mark.parametrize('cls,kwargs', [(ReparamSwinTransformer, SWIN), (ReparamPVT, PVT)])
def test_pretrained_and_init_cfg_together_raise(cls, kwargs):
    with pytest.raises(ValueError, match='init_cfg and pretrained cannot be set at the same'):
        cls(**kwargs, pretrained='a.pth', init_cfg=dict(type='Pretrained', checkpoint='b.pth'))
