# RetinaNet + FPN, COCO 1x, backbone: _base_/backbones/repa_swin_b.py
_base_ = [
    './_base_/models/retinanet_fpn.py', './_base_/datasets/coco_detection.py',
    './_base_/schedules/schedule_1x.py', './_base_/default_runtime_det.py',
    './_base_/backbones/repa_swin_b.py'
]
model = dict(
    backbone=_base_.backbone,
    neck=dict(in_channels=_base_.backbone_widths[1:]))  # stages 2-4
