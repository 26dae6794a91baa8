"""A pretrained load that would leave attention or FFN weights random is an error.

The SLAB authors' SLAB-PVT releases use SLA in all four stages; a backbone configured with
softmax attention in a stage would get random weights there. That must not pass silently.
"""
import pytest
import torch

from conftest import randomize_weights
from layouts import PVT, to_authors_pvt

from mmslab.models import SLABPVT
from mmslab.models.checkpoint_utils import load_pretrained_backbone


@pytest.fixture
def slab_pvt_release(tmp_path):
    src = randomize_weights(SLABPVT(**PVT), seed=1)  # the default: SLA in all four stages
    assert src.attn_types == ('sla', ) * 4
    path = str(tmp_path / 'slab_pvt.pth')
    torch.save({'model': to_authors_pvt(src.state_dict(), schedule=(0, 300000, 5))}, path)
    return path


def test_default_slab_pvt_loads_the_release_completely(slab_pvt_release):
    info = load_pretrained_backbone(SLABPVT(**PVT), slab_pvt_release)
    assert info['format'] == 'slab' and not info['missing'] and not info['shape_mismatch']


def test_leaving_attention_uninitialized_is_an_error_unless_allowed(slab_pvt_release):
    mixed = dict(attn_types=('sla', 'sla', 'sla', 'softmax'))
    with pytest.raises(ValueError, match=r'attention/FFN parameters .* uninitialized'):
        load_pretrained_backbone(SLABPVT(**PVT, **mixed), slab_pvt_release)
    info = load_pretrained_backbone(SLABPVT(**PVT, **mixed), slab_pvt_release,
                                    allow_uninitialized=True)
    assert any('.attn.' in k for k in info['missing'])


def test_init_cfg_opt_in_and_unknown_keys(slab_pvt_release):
    mixed = dict(attn_types=('sla', 'sla', 'sla', 'softmax'))
    model = SLABPVT(**PVT, **mixed, init_cfg=dict(type='Pretrained', checkpoint=slab_pvt_release))
    with pytest.raises(ValueError, match='uninitialized'):
        model.init_weights()
    model = SLABPVT(**PVT, **mixed, init_cfg=dict(
        type='Pretrained', checkpoint=slab_pvt_release, allow_uninitialized=True))
    model.init_weights()
    model = SLABPVT(**PVT, init_cfg=dict(type='Pretrained', checkpoint=slab_pvt_release,
                                         reset_schedul=True))
    with pytest.raises(ValueError, match=r"unknown keys \['reset_schedul'\]"):
        model.init_weights()
