# Swin-T, LayerNorm baseline: mmslab's ReparamSwinTransformer with LN and shifted-window
# softmax attention everywhere. With these settings it is mmdet's SwinTransformer (same
# argument names, parameter names and outputs), but it runs through the same code as the
# PRepBN/SLAB/RePa variants, so latency comparisons measure the norm/attention/FFN changes only,
# and it is registered in both mmdet and mmseg. No norm to fold (LayerNorm stays), but
# ReparamEvalHook still evaluates a fused copy: the window attention switches to its gathered
# position bias and the patch merging to its offset-major gather.
# Weights: official Swin-T ImageNet-1k, swin_tiny_patch4_window7_224.pth (81.2% top-1),
#   https://github.com/SwinTransformer/storage/releases/download/v1.0.0/swin_tiny_patch4_window7_224.pth
#   converted to mmdet/mmslab parameter names (docs/checkpoint_formats.md).
_base_ = ['../reparam_eval.py']  # custom_hooks
backbone = dict(
    type='ReparamSwinTransformer',
    arch='tiny',  # embed 96, depths (2, 2, 6, 2), heads (3, 6, 12, 24)
    norm_cfg=dict(type='LN'),
    attn_types=('window', 'window', 'window', 'window'),
    window_size=7,
    drop_path_rate=0.2,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/swin_t.pth'))
backbone_widths = [96, 192, 384, 768]
