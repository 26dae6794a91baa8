# PRepBN-PVT-S (SLAB): PVT-v1-Small (depths 3/4/6/3) with progressive PRepBN. `step` comes from
# the top-level config. drop_path_rate 0.1 as mmdet's PVT configs.
# Weights: SLAB release pvt_s_prepbn (80.1% top-1),
#   https://github.com/xinghaochen/SLAB/releases/download/ckpts/pvt_small_prepbn.pth
_base_ = ['../reparam_eval.py']  # custom_hooks
backbone = dict(
    type='PRepBNPVT',
    arch='small',
    drop_path_rate=0.1,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/prepbn_pvt_s.pth'))
backbone_widths = [64, 128, 320, 512]
custom_hooks = [*_base_.custom_hooks, dict(type='ProgressiveNormHook')]
