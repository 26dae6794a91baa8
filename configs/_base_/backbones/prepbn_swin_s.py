# PRepBN-Swin-S (SLAB): Swin-S with every LayerNorm replaced by progressive PRepBN; window
# attention. `step` comes from the top-level config (`prepbn_step`).
# Weights: no public SLAB release for PRepBN-Swin-S (their table lists Swin-T PRepBN and
# SLAB-Swin-S only): train it with the authors' classification recipe
# (classification/cfgs/swin_t_prepbn.yaml scaled to Swin-S) and save it here.
_base_ = ['../reparam_eval.py']  # custom_hooks
backbone = dict(
    type='PRepBNSwin',
    arch='small',  # embed 96, depths (2, 2, 18, 2), heads (3, 6, 12, 24)
    drop_path_rate=0.3,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/prepbn_swin_s.pth'))
backbone_widths = [96, 192, 384, 768]
custom_hooks = [*_base_.custom_hooks, dict(type='ProgressiveNormHook')]
