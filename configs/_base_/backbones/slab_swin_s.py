# SLAB-Swin-S: as SLAB-Swin-T with Swin-S depths. `step` comes from the top-level config.
# Weights: SLAB release slab_swin_s (83.6% top-1),
#   https://github.com/xinghaochen/SLAB/releases/download/ckpts/slab_swin_small.pth
_base_ = ['../reparam_eval.py']  # custom_hooks
backbone = dict(
    type='SLABSwin',
    arch='small',
    drop_path_rate=0.3,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/slab_swin_s.pth'))
backbone_widths = [96, 192, 384, 768]
custom_hooks = [*_base_.custom_hooks, dict(type='ProgressiveNormHook')]
