# SLAB-Swin-S: as SLAB-Swin-T with Swin-S depths. `step` comes from the top-level config.
# Weights: SLAB release slab_swin_s (83.6% top-1),
#   https://github.com/xinghaochen/SLAB/releases/download/ckpts/slab_swin_small.pth
backbone = dict(
    type='SLABSwin',
    arch='small',
    attn_types=('sla', 'sla', 'window', 'window'),
    window_size=(56, 28, 7, 7),
    drop_path_rate=0.3,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/slab_swin_s.pth'))
backbone_widths = [96, 192, 384, 768]
backbone_hooks = [dict(type='ProgressiveNormHook')]
