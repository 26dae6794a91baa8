# CPU demo: SLAB-Swin-T Mask R-CNN trained from scratch on the synthetic COCO set
# (`python tools/make_demo_data.py` -> data/mmslab_demo/coco/, 256x256 images), then
# validated with the fused model (box + mask AP on val2017) and timed against the unfused one.
# The demo root is not data/coco/, where the real COCO of the 1x configs lives.
#   python tools/train.py configs/demo/mask_rcnn_slab_swin_t_demo.py
# Cost on 2 CPU threads: a few seconds per iteration (RoIAlign dominates; hence
# sampling_ratio=2 and fewer proposals/RoIs than COCO training).
_base_ = '../mask_rcnn_slab_swin_t_1x.py'

# The demo classes, in the order of mmslab.datasets.demo_data.COCO_DEMO_CLASSES (category id =
# position + 1). Copied here because configs cannot import; tests/test_configs.py checks they
# match.
classes = ('circle', 'square', 'triangle', 'star', 'hexagon', 'cross')
num_classes = len(classes)

max_iters = 200
img_scale = (256, 256)

model = dict(
    backbone=dict(
        init_cfg=None,  # from scratch: no checkpoint
        # From scratch the BN statistics must be learned, and 4 images x many tokens per
        # batch estimate them well: update the running statistics.
        bn_stats='train',
        # A short run from scratch (not the fine-tuning the schedule rule is made for):
        # 50 iterations of pure LayerNorm learn the features fast, LN -> RepBN decays over the
        # next 110, and the learning rate drops when the model becomes pure RepBN (iteration
        # 160). Measured here: pure RepBN at the full learning rate diverged within ~20
        # iterations, so the switch must not happen at the full rate.
        # alpha starts at 0 (the paper: 1) so the RepBN branch starts as a plain, normalizing
        # BN: from scratch, BN(x) + x lets the un-normalized residual stream leak into every
        # branch, and the loss jumped 3x when the LayerNorm share reached 0.
        norm_cfg=dict(type='PRepBN', step=110, warmup=50, alpha_init=0.0),
        # the output norms follow the same short schedule
        out_norm_cfg=dict(type='PRepBN', step=110, warmup=50, alpha_init=0.0),
        # Short training: less stochastic depth than the 1x config's 0.2.
        drop_path_rate=0.1,
        # Windows in proportion to the inputs: the authors' 56/28 windows cover about 1/3.6
        # of an 800x1344 image's stage-1/2 maps; at 256x256 (maps 64 and 32) that is 16 and
        # 8. Stages 3-4 keep window attention with window 8 (their maps are 16 and 8).
        window_size=(16, 8, 8, 8)),
    # 128-channel neck and heads instead of 256: on 2 CPU cores the FPN and mask-head convs
    # (forward + backward) cost more than the backbone; a quarter of their cost buys more
    # iterations in the same ten minutes.
    neck=dict(out_channels=128),
    rpn_head=dict(in_channels=128, feat_channels=128),
    roi_head=dict(
        bbox_roi_extractor=dict(roi_layer=dict(sampling_ratio=2), out_channels=128),
        bbox_head=dict(num_classes=num_classes, in_channels=128),
        mask_roi_extractor=dict(roi_layer=dict(sampling_ratio=2), out_channels=128),
        mask_head=dict(num_classes=num_classes, in_channels=128, conv_out_channels=128)),
    train_cfg=dict(
        rpn_proposal=dict(nms_pre=1000, max_per_img=300),
        rcnn=dict(sampler=dict(num=128))),
    test_cfg=dict(rpn=dict(nms_pre=1000, max_per_img=300)))

data_root = 'data/mmslab_demo/coco/'
metainfo = dict(classes=classes)
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=img_scale, keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=img_scale, keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(
        type='PackDetInputs',
        meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))
]
train_dataloader = dict(
    batch_size=4,
    num_workers=2,
    persistent_workers=True,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(
        data_root=data_root,
        metainfo=metainfo,
        ann_file='annotations/instances_train2017.json',
        data_prefix=dict(img='train2017/'),
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=1,
    num_workers=2,
    dataset=dict(
        data_root=data_root,
        metainfo=metainfo,
        ann_file='annotations/instances_val2017.json',
        data_prefix=dict(img='val2017/'),
        pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(
    type='CocoMetric',
    ann_file=data_root + 'annotations/instances_val2017.json',
    metric=['bbox', 'segm'])
test_evaluator = val_evaluator

# 200 iterations, validation once at the end.
train_cfg = dict(
    _delete_=True, type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
optim_wrapper = dict(optimizer=dict(lr=4e-4))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=20),
    dict(
        type='MultiStepLR',
        by_epoch=False,
        begin=0,
        end=max_iters,
        milestones=[160, 185],
        gamma=0.1)
]
auto_scale_lr = dict(enable=False, base_batch_size=4)  # lr 4e-4 is for batch 4

default_hooks = dict(
    logger=dict(type='LoggerHook', interval=10),
    checkpoint=dict(
        type='CheckpointHook',
        by_epoch=False,
        interval=max_iters,
        max_keep_ckpts=1,
        save_best='coco/bbox_mAP',
        rule='greater'))
log_processor = dict(type='LogProcessor', window_size=10, by_epoch=False)
# The full config's hooks, with the unfused model timed too.
custom_hooks = [
    dict(type='ProgressiveNormHook'),
    dict(_base_.reparam_eval_hook, compare_unfused=True)
]
