# Mask R-CNN + FPN, COCO 1x, backbone: _base_/backbones/swin_t.py
_base_ = [
    './_base_/models/mask_rcnn_fpn.py', './_base_/datasets/coco_instance.py',
    './_base_/schedules/schedule_1x.py', './_base_/default_runtime_det.py',
    './_base_/backbones/swin_t.py'
]
model = dict(
    backbone=_base_.backbone,
    neck=dict(in_channels=_base_.backbone_widths))
