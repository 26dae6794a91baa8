# RetinaNet + FPN, COCO 1x, backbone: _base_/backbones/prepbn_pvt_t.py
_base_ = [
    './_base_/models/retinanet_fpn.py', './_base_/datasets/coco_detection.py',
    './_base_/schedules/schedule_1x.py', './_base_/default_runtime_det.py',
    './_base_/backbones/prepbn_pvt_t.py'
]
# PRepBN decays LN -> RepBN over 0.8 x this schedule (prepbn_step, see the schedule file).
model = dict(
    backbone=dict(**_base_.backbone, norm_cfg=dict(type='PRepBN', step=_base_.prepbn_step)),
    neck=dict(in_channels=_base_.backbone_widths[1:]))  # stages 2-4
