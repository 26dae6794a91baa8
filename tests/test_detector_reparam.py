"""Model-level re-parameterization of whole detectors and segmentors."""
import pytest
import torch
import torch.nn as nn

import mmslab
from conftest import randomize_bn_statistics
from mmslab.models import statistic_modules
from mmslab.models.reparam import fold_output_affines_into_neck

BACKBONE = dict(type='SLABSwin', embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                window_size=(8, 4, 2, 2), drop_path_rate=0.0, norm_cfg=dict(type='PRepBN',
                                                                            step=3))


def flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in flat(o)]


def check(model, x, expect_folded):
    model.eval()
    randomize_bn_statistics(model)
    with torch.no_grad():
        ref = flat(model(x, mode='tensor'))
        mmslab.reparameterize(model)
        out = flat(model(x, mode='tensor'))
    assert len(out) == len(ref) and ref
    for r, o in zip(ref, out):
        assert r.shape == o.shape
        assert ((r - o).abs().max() / r.abs().max().clamp_min(1e-6)) <= 1e-4
    folded = [i for i in range(4) if isinstance(getattr(model.backbone, f'norm{i}', None),
                                                 nn.Identity)]
    assert folded == expect_folded
    assert not [n for n, _ in statistic_modules(model.backbone)]


@pytest.mark.parametrize('start_level,extra,expect', [(0, 'on_output', [0, 1, 2, 3]),
                                                      (1, 'on_input', [1, 2])])
def test_fpn_detector_folds_output_affines_into_laterals(start_level, extra, expect):
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope
    init_default_scope('mmdet')
    model = MODELS.build(dict(
        type='RetinaNet',
        data_preprocessor=dict(type='DetDataPreprocessor', pad_size_divisor=32),
        backbone=BACKBONE,
        neck=dict(type='FPN', in_channels=[16, 32, 64, 128], out_channels=16,
                  start_level=start_level, add_extra_convs=extra, num_outs=5),
        bbox_head=dict(type='RetinaHead', num_classes=3, in_channels=16, stacked_convs=1,
                       feat_channels=16,
                       anchor_generator=dict(type='AnchorGenerator', octave_base_scale=4,
                                             scales_per_octave=3, ratios=[1.0],
                                             strides=[4, 8, 16, 32, 64]),
                       bbox_coder=dict(type='DeltaXYWHBBoxCoder'),
                       loss_cls=dict(type='FocalLoss', use_sigmoid=True),
                       loss_bbox=dict(type='L1Loss'))))
    check(model, torch.randn(1, 3, 64, 96), expect)


def test_upernet_folds_laterals_but_not_aux_or_ppm_inputs():
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS
    init_default_scope('mmseg')
    model = MODELS.build(dict(
        type='EncoderDecoder', data_preprocessor=dict(type='SegDataPreProcessor'),
        backbone=BACKBONE,
        decode_head=dict(type='UPerHead', in_channels=[16, 32, 64, 128], in_index=[0, 1, 2, 3],
                         pool_scales=(1, 2), channels=16, num_classes=5,
                         norm_cfg=dict(type='BN')),
        auxiliary_head=dict(type='FCNHead', in_channels=64, in_index=2, channels=8,
                            num_convs=1, num_classes=5, norm_cfg=dict(type='BN'))))
    check(model, torch.randn(1, 3, 64, 64), [0, 1])
    assert fold_output_affines_into_neck(model) == []  # idempotent: nothing left to fold
