# CPU demo: SLAB-Swin-T UperNet trained from scratch on the synthetic ADE20K set
# (`python tools/make_demo_data.py` -> data/mmslab_demo/ade/ADEChallengeData2016, 256x256
# images), then validated with the fused model (mIoU) and timed against the unfused one. The
# demo root is not data/ade/, where the real ADE20K of the 160k configs lives.
#   python tools/train.py configs/demo/upernet_slab_swin_t_demo.py
_base_ = '../upernet_slab_swin_t_160k_ade20k.py'

# The ADE20K classes the demo label maps use (mmslab.datasets.demo_data.ADE_DEMO_CLASSES, in
# label-value order; checked by tests/test_configs.py). Naming a subset of ADE20K's classes
# makes mmseg remap labels to 0..8 and ignore the rest, so the heads predict 9 classes.
classes = ('wall', 'sky', 'floor', 'grass', 'person', 'table', 'chair', 'car', 'painting')
num_classes = len(classes)

max_iters = 150
crop_size = (256, 256)

model = dict(
    data_preprocessor=dict(size=crop_size),
    backbone=dict(
        init_cfg=None,  # from scratch: no checkpoint
        bn_stats='train',  # statistics must be learned from scratch
        # As in the detection demo: LN warm-up, LN -> RepBN over the middle of the run, RepBN
        # alpha from 0 so the switch to pure RepBN does not make the loss jump.
        norm_cfg=dict(type='PRepBN', step=80, warmup=40, alpha_init=0.0),
        # the output norms follow the same short schedule
        out_norm_cfg=dict(type='PRepBN', step=80, warmup=40, alpha_init=0.0),
        drop_path_rate=0.1,
        # Windows in proportion to the inputs (see the detection demo).
        window_size=(16, 8, 8, 8)),
    # Narrower heads than UperNet's 512/256 channels: at 512 channels the head's 3x3 convs on
    # the stride-4 map cost most of a CPU iteration.
    decode_head=dict(channels=128, num_classes=num_classes),
    auxiliary_head=dict(channels=64, num_classes=num_classes))

data_root = 'data/mmslab_demo/ade/ADEChallengeData2016'
metainfo = dict(classes=classes)
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomResize', scale=(256, 256), ratio_range=(0.75, 1.5), keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(256, 256), keep_ratio=True),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs')
]
train_dataloader = dict(
    batch_size=4,
    num_workers=2,
    dataset=dict(data_root=data_root, metainfo=metainfo, pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=1,
    num_workers=2,
    dataset=dict(data_root=data_root, metainfo=metainfo, pipeline=test_pipeline))
test_dataloader = val_dataloader

train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
optim_wrapper = dict(optimizer=dict(lr=4e-4))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=15),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=15, end=max_iters, by_epoch=False)
]
auto_scale_lr = dict(enable=False, base_batch_size=4)

default_hooks = dict(
    logger=dict(type='LoggerHook', interval=10, log_metric_by_epoch=False),
    checkpoint=dict(
        type='CheckpointHook',
        by_epoch=False,
        interval=max_iters,
        max_keep_ckpts=1,
        save_best='mIoU',
        rule='greater'))
# The full config's hooks, with the unfused model timed too.
custom_hooks = [
    dict(type='ProgressiveNormHook'),
    dict(_base_.reparam_eval_hook, compare_unfused=True)
]
