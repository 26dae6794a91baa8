# SLAB-Swin-T: PRepBN everywhere, simplified linear attention in stages 1-2 (windows 56 and 28,
# as in the authors' detection backbone), shifted-window softmax attention in stages 3-4
# (window 7). `step` comes from the top-level config (`prepbn_step`).
# Weights: SLAB release slab_swin_t (81.8% top-1),
#   https://github.com/xinghaochen/SLAB/releases/download/ckpts/slab_swin_tiny.pth
backbone = dict(
    type='SLABSwin',
    arch='tiny',
    attn_types=('sla', 'sla', 'window', 'window'),
    window_size=(56, 28, 7, 7),
    drop_path_rate=0.2,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/slab_swin_t.pth'))
backbone_widths = [96, 192, 384, 768]
backbone_hooks = [dict(type='ProgressiveNormHook')]
