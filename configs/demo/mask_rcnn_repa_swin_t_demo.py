# CPU demo, RePa-Swin-T: channel-idle FFN (BatchNorms inside, 75% idle channels) and
# LayerNorm before attention, as in the RePaFormer authors' model; window 8 everywhere. Same
# data, heads and schedule as the SLAB-Swin-T demo.
_base_ = './mask_rcnn_slab_swin_t_demo.py'
model = dict(
    backbone=dict(
        type='RePaSwin',
        norm_cfg=dict(_delete_=True, type='LN'),
        out_norm_cfg=dict(_delete_=True, type='LN'),
        attn_types=('window', 'window', 'window', 'window'),
        window_size=8))
