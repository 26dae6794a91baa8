# SLAB-Swin-T: PRepBN everywhere, simplified linear attention in stages 1-2 (windows 56 and 28,
# as in the authors' detection backbone), shifted-window softmax attention in stages 3-4
# (window 7): the SLABSwin preset sets these attention types and windows. `step` comes from
# the top-level config (`prepbn_step`).
# Weights: SLAB release slab_swin_t (81.8% top-1),
#   https://github.com/xinghaochen/SLAB/releases/download/ckpts/slab_swin_tiny.pth
_base_ = ['../reparam_eval.py']  # custom_hooks
backbone = dict(
    type='SLABSwin',
    arch='tiny',
    drop_path_rate=0.2,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/slab_swin_t.pth'))
backbone_widths = [96, 192, 384, 768]
custom_hooks = [*_base_.custom_hooks, dict(type='ProgressiveNormHook')]
