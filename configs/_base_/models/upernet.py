# UperNet as in mmseg's Swin UperNet: UPerHead (512 channels, PPM scales 1/2/3/6) on all four
# stages, auxiliary FCN head (256 channels, loss weight 0.4) on stage 3, SyncBN in the heads
# (mmengine reverts it to BN in non-distributed runs), 150 ADE20K classes, whole-image test.
# The top-level config sets `decode_head.in_channels = backbone_widths` and
# `auxiliary_head.in_channels = backbone_widths[2]`.
head_norm_cfg = dict(type='SyncBN', requires_grad=True)
model = dict(
    type='EncoderDecoder',
    data_preprocessor=dict(
        type='SegDataPreProcessor',
        mean=[123.675, 116.28, 103.53],
        std=[58.395, 57.12, 57.375],
        bgr_to_rgb=True,
        pad_val=0,
        seg_pad_val=255,
        size=(512, 512)),  # the training crop (datasets/ade20k.py)
    pretrained=None,
    # bn_stats='frozen' for segmentation too: the per-GPU batch is again 2 images (8 GPUs x 2),
    # and although a 512x512 crop gives many tokens, tokens of one image are strongly
    # correlated, so the batch statistics (worst in stage 4: 2 x 16 x 16 tokens) swing from
    # batch to batch and the running averages would chase them; 2048x512 whole-image inference
    # would then see statistics training never used. Frozen statistics keep training and the
    # fused model identical; BN affines and alpha adapt to ADE20K. If wanted, re-estimate the
    # statistics on ADE20K after training with tools/recalibrate_bn.py.
    backbone=dict(out_indices=(0, 1, 2, 3), bn_stats='frozen'),
    decode_head=dict(
        type='UPerHead',
        in_channels=None,
        in_index=[0, 1, 2, 3],
        pool_scales=(1, 2, 3, 6),
        channels=512,
        dropout_ratio=0.1,
        num_classes=150,
        norm_cfg=head_norm_cfg,
        align_corners=False,
        loss_decode=dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0)),
    auxiliary_head=dict(
        type='FCNHead',
        in_channels=None,
        in_index=2,
        channels=256,
        num_convs=1,
        concat_input=False,
        dropout_ratio=0.1,
        num_classes=150,
        norm_cfg=head_norm_cfg,
        align_corners=False,
        loss_decode=dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=0.4)),
    train_cfg=dict(),
    test_cfg=dict(mode='whole'))
