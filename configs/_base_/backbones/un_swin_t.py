# UN-Swin-T: Swin-T with every LayerNorm replaced by Unified Normalization (offline, no
# centring, geometric mean of the last 4 per-step statistics after a 4,000-iteration warm-up,
# outlier filtration); window attention. Its iteration counter is driven by
# ProgressiveNormHook from runner.iter, so warm-up restarts at 0 when fine-tuning.
# bn_stats='train' (unlike the other detection/segmentation backbones): UN is designed to keep
# estimating its statistics during training, its smoothing over the window is what makes small
# batches usable, and its warm-up only means anything in training mode; frozen UN would be a
# fixed affine with the checkpoint's running variance.
# Weights: no public UN Swin release (the UN repository has T2T-ViT/NMT code only): train
# Swin-T with UN on ImageNet-1k, or start from the official Swin-T
# (swin_tiny_patch4_window7_224.pth, converted): LN weight/bias load into UN's affine and the
# running variance is estimated during warm-up.
_base_ = ['../reparam_eval.py']  # custom_hooks
backbone = dict(
    type='ReparamSwinTransformer',
    arch='tiny',
    norm_cfg=dict(type='UN', warmup_iters=4000, window_size=4),
    attn_types=('window', 'window', 'window', 'window'),
    window_size=7,
    bn_stats='train',
    drop_path_rate=0.2,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/un_swin_t.pth'))
backbone_widths = [96, 192, 384, 768]
custom_hooks = [*_base_.custom_hooks, dict(type='ProgressiveNormHook')]
