"""Export round trip: deploy config + fused checkpoint == the original model."""

import pytest
import torch

import mmslab  # noqa: F401  (registers the components the configs name)
from conftest import load_tool, wrong_fold
from mmslab.datasets.demo_data import make_ade_demo



CONFIG = '''
default_scope = 'mmseg'
custom_imports = dict(imports=['mmslab'], allow_failed_imports=False)
data_root = {data_root!r}
model = dict(
    type='EncoderDecoder',
    data_preprocessor=dict(type='SegDataPreProcessor', mean=[123.675, 116.28, 103.53],
                           std=[58.395, 57.12, 57.375], bgr_to_rgb=True, pad_val=0,
                           seg_pad_val=255, size=(64, 64)),
    backbone=dict(type='SLABSwin', embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                  window_size=(8, 4, 2, 2), drop_path_rate=0.0,
                  norm_cfg=dict(type='PRepBN', step=10)),
    decode_head=dict(type='UPerHead', in_channels=[16, 32, 64, 128], in_index=[0, 1, 2, 3],
                     pool_scales=(1, 2), channels=16, num_classes=150, dropout_ratio=0.0,
                     norm_cfg=dict(type='BN'), align_corners=False,
                     loss_decode=dict(type='CrossEntropyLoss', loss_weight=1.0)),
    test_cfg=dict(mode='whole'))
test_pipeline = [dict(type='LoadImageFromFile'),
                 dict(type='Resize', scale=(64, 64), keep_ratio=False),
                 dict(type='LoadAnnotations', reduce_zero_label=True),
                 dict(type='PackSegInputs')]
test_dataloader = dict(batch_size=1, num_workers=0,
                       sampler=dict(type='DefaultSampler', shuffle=False),
                       dataset=dict(type='ADE20KDataset', data_root=data_root,
                                    data_prefix=dict(img_path='images/validation',
                                                     seg_map_path='annotations/validation'),
                                    pipeline=test_pipeline))
test_evaluator = dict(type='IoUMetric', iou_metrics=['mIoU'])
test_cfg = dict(type='TestLoop')
custom_hooks = [dict(type='ProgressiveNormHook'), dict(type='ReparamEvalHook', warmup=0)]
default_hooks = dict(logger=dict(type='LoggerHook', interval=1))
log_level = 'WARNING'
'''


def tiny_upernet(tmp_path, num_val: int):
    """``(config path, model)``: a tiny SLAB-Swin UperNet on a synthetic ADE20K set."""
    make_ade_demo(str(tmp_path / 'ade'), num_train=1, num_val=num_val, img_size=64, seed=3,
                  progress=False)
    cfg_path = tmp_path / 'tiny_upernet.py'
    cfg_path.write_text(CONFIG.format(
        data_root=str(tmp_path / 'ade' / 'ADEChallengeData2016')))
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS
    init_default_scope('mmseg')
    torch.manual_seed(0)
    model = MODELS.build(Config.fromfile(str(cfg_path)).model)
    model.init_weights()
    return cfg_path, model


def test_export_round_trip_gives_same_outputs_and_metrics(tmp_path):
    from mmengine.config import Config
    from mmseg.registry import MODELS
    cfg_path, model = tiny_upernet(tmp_path, num_val=3)
    with torch.no_grad():  # non-trivial statistics and a head that predicts several classes
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.normal_(0, 0.2)
                m.running_var.uniform_(0.5, 1.5)
        model.decode_head.conv_seg.bias[[0, 2, 3, 9]] += 2.0
    ckpt = tmp_path / 'model.pth'
    torch.save(dict(state_dict=model.state_dict(), meta=dict()), ckpt)

    ckpt_out, cfg_out = load_tool('reparameterize').main(
        [str(cfg_path), str(ckpt), str(tmp_path / 'deploy')])
    deploy_cfg = Config.fromfile(cfg_out)
    assert deploy_cfg.model.backbone.deploy is True
    assert [h['type'] for h in deploy_cfg.custom_hooks] == ['ReparamEvalHook']
    deployed = MODELS.build(deploy_cfg.model)
    state = torch.load(ckpt_out, weights_only=True)['state_dict']
    deployed.load_state_dict(state, strict=True)
    assert not any(type(m).__name__ in ('PRepBN', 'RepBN', 'LayerNorm') and not
                   getattr(m, 'deploy', False) for m in deployed.backbone.modules())
    model.eval()
    deployed.eval()
    x = torch.randn(1, 3, 64, 80)
    with torch.no_grad():
        ref, out = model(x, mode='tensor'), deployed(x, mode='tensor')
    assert ((ref - out).abs().max() / ref.abs().max()) <= 1e-4

    test_tool = load_tool('test')
    unfused = test_tool.main([str(cfg_path), str(ckpt), '--no-reparam',
                              '--work-dir', str(tmp_path / 'w1')])
    fused = test_tool.main([cfg_out, ckpt_out, '--work-dir', str(tmp_path / 'w2')])
    assert unfused['mIoU'] == pytest.approx(fused['mIoU'])
    assert unfused['aAcc'] == pytest.approx(fused['aAcc']) and unfused['aAcc'] > 0


def test_reparameterize_tool_refuses_a_wrong_fold(tmp_path, monkeypatch, capsys):
    """tools/reparameterize.py compares the fused model with the unfused one (float32, a
    test-set image) before writing anything: a correct fold passes and is reported, a wrong
    one exits with the module it diverged at and no file written."""
    cfg_path, model = tiny_upernet(tmp_path, num_val=1)
    ckpt = tmp_path / 'model.pth'
    torch.save(dict(state_dict=model.state_dict(), meta=dict()), ckpt)
    tool = load_tool('reparameterize')
    tool.main([str(cfg_path), str(ckpt), str(tmp_path / 'good')])
    assert 'fusion check: fused vs unfused' in capsys.readouterr().out
    monkeypatch.setattr(mmslab, 'reparameterize', wrong_fold(mmslab.reparameterize, 2, 1.2))
    with pytest.raises(SystemExit, match='differs.*stages.2.blocks.0.attn.w_msa.proj'):
        tool.main([str(cfg_path), str(ckpt), str(tmp_path / 'bad')])
    assert not (tmp_path / 'bad').exists()
