# RePa-Swin-B (RePaFormer/RePaViT, ImageNet params 87.9M -> 52.8M after fusion): channel-idle
# FFN with BatchNorm before and inside it, GELU on a quarter of the hidden channels
# (idle_ratio 0.75, the rest pass linearly and fold away); LayerNorm before the window
# attention as in the authors' Swin. No progressive norm, hence no ProgressiveNormHook.
# Weights: no public release (the RePaViT README says weights "will be released soon"): train
# RePaSwin-B with the authors' code (--channel_idle --idle_ratio=0.75) and convert it to
# mmslab names (docs/checkpoint_formats.md).
_base_ = ['../reparam_eval.py']  # custom_hooks
backbone = dict(
    type='RePaSwin',
    arch='base',
    ffn_type='channel_idle',
    idle_ratio=0.75,
    drop_path_rate=0.5,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/repa_swin_b.pth'))
backbone_widths = [128, 256, 512, 1024]
