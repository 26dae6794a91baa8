# PRepBN-Swin-T (SLAB): Swin-T with every LayerNorm replaced by progressive PRepBN
# (g * LN + (1 - g) * RepBN, g: 1 -> 0); window attention. The decay length `step` is set by
# the top-level config from its schedule (`prepbn_step`).
# Weights: SLAB release swin_t_prepbn (81.4% top-1),
#   https://github.com/xinghaochen/SLAB/releases/download/ckpts/swin_tiny_prepbn.pth
_base_ = ['../reparam_eval.py']  # custom_hooks
backbone = dict(
    type='PRepBNSwin',
    arch='tiny',
    drop_path_rate=0.2,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/prepbn_swin_t.pth'))
backbone_widths = [96, 192, 384, 768]
custom_hooks = [*_base_.custom_hooks, dict(type='ProgressiveNormHook')]
