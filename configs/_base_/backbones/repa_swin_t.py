# RePa-Swin-T (RePaFormer/RePaViT, ImageNet params 28.3M -> 17.5M after fusion): channel-idle
# FFN with BatchNorm before and inside it, GELU on a quarter of the hidden channels
# (idle_ratio 0.75, the rest pass linearly and fold away); LayerNorm before the window
# attention as in the authors' Swin. No progressive norm, hence no ProgressiveNormHook.
# Weights: no public release (the RePaViT README says weights "will be released soon"): train
# RePaSwin-T with the authors' code (--channel_idle --idle_ratio=0.75) and convert it to
# mmslab names (docs/checkpoint_formats.md).
_base_ = ['../reparam_eval.py']  # custom_hooks
backbone = dict(
    type='RePaSwin',
    arch='tiny',
    ffn_type='channel_idle',
    idle_ratio=0.75,
    drop_path_rate=0.2,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/repa_swin_t.pth'))
backbone_widths = [96, 192, 384, 768]
