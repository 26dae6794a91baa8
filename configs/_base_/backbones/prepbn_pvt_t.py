# PRepBN-PVT-T (SLAB): PVT-v1-Tiny (dims 64/128/320/512, depths 2/2/2/2) with every LayerNorm
# replaced by progressive PRepBN; spatial-reduction softmax attention. `step` comes from the
# top-level config. drop_path_rate 0.1 as mmdet's PVT configs (PVT-v1 used 0.1 at every size).
# Weights: SLAB release pvt_t_prepbn (76.0% top-1),
#   https://github.com/xinghaochen/SLAB/releases/download/ckpts/pvt_tiny_prepbn.pth
_base_ = ['../reparam_eval.py']  # custom_hooks
backbone = dict(
    type='PRepBNPVT',
    arch='tiny',
    drop_path_rate=0.1,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/prepbn_pvt_t.pth'))
backbone_widths = [64, 128, 320, 512]
custom_hooks = [*_base_.custom_hooks, dict(type='ProgressiveNormHook')]
