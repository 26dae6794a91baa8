# UperNet, ADE20K 512x512, 160k iterations, backbone: _base_/backbones/repa_swin_t.py
_base_ = [
    './_base_/models/upernet.py', './_base_/datasets/ade20k.py',
    './_base_/schedules/schedule_160k.py', './_base_/default_runtime_seg.py',
    './_base_/backbones/repa_swin_t.py'
]
model = dict(
    backbone=_base_.backbone,
    decode_head=dict(in_channels=_base_.backbone_widths),
    auxiliary_head=dict(in_channels=_base_.backbone_widths[2]))  # stage 3
