# CPU demo, PRepBN-Swin-T: the SLAB-Swin-T demo (same data, heads, schedule, PRepBN settings)
# with shifted-window softmax attention in every stage (window 8 on the 256x256 images).
# Used with the SLAB and RePa demos and the LayerNorm baseline to compare INT8 accuracy
# (benchmarks/int8_accuracy.py).
_base_ = './mask_rcnn_slab_swin_t_demo.py'
model = dict(
    backbone=dict(
        type='PRepBNSwin',
        attn_types=('window', 'window', 'window', 'window'),
        window_size=8))
