# CPU demo, the LayerNorm baseline: Swin-T with LayerNorm and shifted-window softmax attention
# (mmdet's SwinTransformer, through mmslab's configurable Swin), window 8. Same data, heads and
# schedule as the SLAB-Swin-T demo.
_base_ = './mask_rcnn_slab_swin_t_demo.py'
model = dict(
    backbone=dict(
        type='ReparamSwinTransformer',
        norm_cfg=dict(_delete_=True, type='LN'),
        out_norm_cfg=dict(_delete_=True, type='LN'),
        attn_types=('window', 'window', 'window', 'window'),
        window_size=8))
