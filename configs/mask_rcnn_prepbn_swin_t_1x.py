# Mask R-CNN + FPN, COCO 1x, backbone: _base_/backbones/prepbn_swin_t.py
_base_ = [
    './_base_/models/mask_rcnn_fpn.py', './_base_/datasets/coco_instance.py',
    './_base_/schedules/schedule_1x.py', './_base_/default_runtime_det.py',
    './_base_/backbones/prepbn_swin_t.py'
]
# PRepBN decays LN -> RepBN over 0.8 x this schedule (prepbn_step, see the schedule file).
model = dict(
    # Output norms (new in dense prediction): start as pure BN (alpha 0) and keep training
    # their statistics (the backbone's out_bn_stats='train'), so they normalize throughout.
    backbone=dict(**_base_.backbone, norm_cfg=dict(type='PRepBN', step=_base_.prepbn_step),
                  out_norm_cfg=dict(type='PRepBN', step=_base_.prepbn_step, alpha_init=0.0)),
    neck=dict(in_channels=_base_.backbone_widths))
