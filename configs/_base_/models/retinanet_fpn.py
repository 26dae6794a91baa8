# RetinaNet with FPN, mmdet 3.x reference settings (FPN 256 channels, P3-P7 with the extra
# levels computed from the last backbone map, focal loss, 9 anchors per location).
# As in mmdet's Swin/PVT RetinaNet configs only stages 2-4 (strides 8, 16, 32) feed the FPN, so
# `out_indices=(1, 2, 3)`: an unused stage-1 output norm would otherwise hold parameters without
# gradients. The top-level config sets `neck.in_channels = backbone_widths[1:]`.
model = dict(
    type='RetinaNet',
    data_preprocessor=dict(
        type='DetDataPreprocessor',
        mean=[123.675, 116.28, 103.53],
        std=[58.395, 57.12, 57.375],
        bgr_to_rgb=True,
        pad_size_divisor=32),
    # bn_stats='frozen': see the comment in mask_rcnn_fpn.py.
    backbone=dict(out_indices=(1, 2, 3), bn_stats='frozen'),
    neck=dict(
        type='FPN',
        in_channels=None,
        out_channels=256,
        start_level=0,
        add_extra_convs='on_input',
        num_outs=5),
    bbox_head=dict(
        type='RetinaHead',
        num_classes=80,
        in_channels=256,
        stacked_convs=4,
        feat_channels=256,
        anchor_generator=dict(
            type='AnchorGenerator',
            octave_base_scale=4,
            scales_per_octave=3,
            ratios=[0.5, 1.0, 2.0],
            strides=[8, 16, 32, 64, 128]),
        bbox_coder=dict(
            type='DeltaXYWHBBoxCoder', target_means=[.0, .0, .0, .0],
            target_stds=[1.0, 1.0, 1.0, 1.0]),
        loss_cls=dict(
            type='FocalLoss', use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=1.0),
        loss_bbox=dict(type='L1Loss', loss_weight=1.0)),
    train_cfg=dict(
        assigner=dict(
            type='MaxIoUAssigner', pos_iou_thr=0.5, neg_iou_thr=0.4, min_pos_iou=0,
            ignore_iof_thr=-1),
        sampler=dict(type='PseudoSampler'),  # focal loss needs no sampling
        allowed_border=-1,
        pos_weight=-1,
        debug=False),
    test_cfg=dict(
        nms_pre=1000,
        min_bbox_size=0,
        score_thr=0.05,
        nms=dict(type='nms', iou_threshold=0.5),
        max_per_img=100))
