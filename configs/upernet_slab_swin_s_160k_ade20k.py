# UperNet, ADE20K 512x512, 160k iterations, backbone: _base_/backbones/slab_swin_s.py
_base_ = [
    './_base_/models/upernet.py', './_base_/datasets/ade20k.py',
    './_base_/schedules/schedule_160k.py', './_base_/default_runtime_seg.py',
    './_base_/backbones/slab_swin_s.py'
]
# PRepBN decays LN -> RepBN over 0.8 x this schedule (prepbn_step, see the schedule file).
model = dict(
    # Output norms (new in dense prediction): start as pure BN (alpha 0) and keep training
    # their statistics (the backbone's out_bn_stats='train'), so they normalize throughout.
    backbone=dict(**_base_.backbone, norm_cfg=dict(type='PRepBN', step=_base_.prepbn_step),
                  out_norm_cfg=dict(type='PRepBN', step=_base_.prepbn_step, alpha_init=0.0)),
    decode_head=dict(in_channels=_base_.backbone_widths),
    auxiliary_head=dict(in_channels=_base_.backbone_widths[2]))  # stage 3
