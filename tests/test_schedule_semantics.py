"""What the 1x configs' PRepBN schedule and output-norm policy really do when fine-tuning
from a converted SLAB release (documented in configs/README.md and the schedule files).

* Norms loaded from a release that finished its LN -> RepBN decay sit at g = 0 from the
  first iteration; only the output norms (new in detection) decay over ``prepbn_step``.
* With ``bn_stats='frozen'`` the body's BatchNorm statistics stay put while the output
  norms' statistics train (``out_bn_stats='train'``), so the output norms normalize.
"""
import os.path as osp

import pytest
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from config_helpers import CONFIG_DIR, load, registry, tiny_backbone_cfg
from conftest import randomize_weights
from layouts import to_authors_swin

from mmslab.engine.hooks import progressive_ratio, set_progressive_iter
from mmslab.models.layers.repbn import PRepBN


def out_norm_names(model):
    return {f'norm{i}' for i in model.out_indices}


def is_output_norm(name: str, model) -> bool:
    return name.split('.')[0] in out_norm_names(model)


@pytest.fixture
def finetune_backbone(tmp_path):
    """The 1x SLAB-Swin-T config's backbone (shrunk), initialised from an author-layout file
    whose schedule has finished, through the config's own init_cfg path."""
    cfg = load(osp.join(CONFIG_DIR, 'mask_rcnn_slab_swin_t_1x.py'))
    models = registry(cfg)
    bb_cfg = tiny_backbone_cfg(cfg.model.backbone, models)
    source = randomize_weights(models.build(bb_cfg), seed=1)
    authors = {'model': to_authors_swin(source.state_dict(), schedule=(0, 60000, 0))}
    ckpt = tmp_path / 'slab_release.pth'
    torch.save(authors, ckpt)
    bb_cfg['init_cfg'] = dict(type='Pretrained', checkpoint=str(ckpt))
    model = models.build(bb_cfg)
    model.init_weights()
    return cfg, model


def test_loaded_norms_are_finished_and_only_output_norms_follow_prepbn_step(finetune_backbone):
    cfg, model = finetune_backbone
    step = cfg.prepbn_step
    model.train()
    body = [m for n, m in model.named_modules() if isinstance(m, PRepBN)
            and not is_output_norm(n, model)]
    outs = [m for n, m in model.named_modules() if isinstance(m, PRepBN)
            and is_output_norm(n, model)]
    assert body and len(outs) == 4
    assert all(m.step == step for m in body + outs)
    for it, expected_out in [(0, 1.0), (step // 2, 0.5), (step, 0.0)]:
        set_progressive_iter(model, it)
        assert {m.ratio for m in body} == {0.0}, 'loaded norms must stay pure RepBN'
        assert all(m.ratio == pytest.approx(expected_out) for m in outs)
        assert progressive_ratio(model) == pytest.approx((0.0, expected_out))
    # the configs start the output norms' RepBN as a plain BN
    assert all(float(m.norm2.alpha.detach()) == 0.0 for m in outs)


def test_frozen_body_statistics_but_training_output_norm_statistics(finetune_backbone):
    cfg, model = finetune_backbone
    assert cfg.model.backbone.bn_stats == 'frozen'
    model.train()
    set_progressive_iter(model, 0)
    bns = {n: m for n, m in model.named_modules() if isinstance(m, _BatchNorm)}
    body = {n: m for n, m in bns.items() if not is_output_norm(n, model)}
    outs = {n: m for n, m in bns.items() if is_output_norm(n, model)}
    assert body and outs
    assert not any(m.training for m in body.values())
    assert all(m.training for m in outs.values())

    # g = 1 for the output norms at iteration 0 would skip their BN: move to mid-schedule
    set_progressive_iter(model, cfg.prepbn_step // 2)
    before = {n: m.running_var.clone() for n, m in bns.items()}
    model(torch.randn(2, 3, 64, 64) * 3)
    for n, m in body.items():
        assert torch.equal(m.running_var, before[n]), f'{n}: frozen statistics moved'
    for n, m in outs.items():
        assert not torch.equal(m.running_var, before[n]), f'{n}: statistics did not train'


def test_output_norm_statistics_can_be_frozen_explicitly():
    from mmdet.registry import MODELS
    model = MODELS.build(dict(type='PRepBNSwin', embed_dims=16, depths=(1, 1, 1, 1),
                              num_heads=(1, 1, 2, 2), window_size=4, bn_stats='frozen',
                              out_bn_stats=None))
    model.train()
    assert not any(m.training for m in model.modules() if isinstance(m, _BatchNorm))
    with pytest.raises(ValueError, match="bn_stats must be one of"):
        MODELS.build(dict(type='PRepBNSwin', embed_dims=16, depths=(1, 1, 1, 1),
                          num_heads=(1, 1, 2, 2), out_bn_stats='sometimes'))
