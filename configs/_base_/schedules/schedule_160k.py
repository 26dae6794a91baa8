# ADE20K 160k: 160,000 iterations at 16 images per batch (2 per GPU x 8 GPUs), AdamW lr 6e-5,
# weight decay 0.01, linear warm-up over 1,500 iterations then poly decay (power 1.0) to 0,
# validation (and a checkpoint) every 16k iterations, as mmseg's Swin UperNet.
max_iters = 160000
train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=16000)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')

param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(
        type='PolyLR',
        eta_min=0.0,
        power=1.0,
        begin=1500,
        end=max_iters,
        by_epoch=False)
]

# No weight decay on norms, RepBN's alpha and position tables (see schedule_1x.py).
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=0.00006, betas=(0.9, 0.999), weight_decay=0.01),
    paramwise_cfg=dict(
        norm_decay_mult=0.,
        custom_keys={
            'absolute_pos_embed': dict(decay_mult=0.),
            'relative_position_bias_table': dict(decay_mult=0.),
            'positional_encoding': dict(decay_mult=0.),
            'pos_embed': dict(decay_mult=0.),
            'alpha': dict(decay_mult=0.),
            'norm': dict(decay_mult=0.),
        }))

auto_scale_lr = dict(enable=False, base_batch_size=16)

# PRepBN decay length: 0.8 x 160k = 128k iterations (see schedule_1x.py for why 0.8 and for
# which norms it drives: with a converted release only the new output norms decay; loaded
# norms stay at g = 0), so the last 32k iterations train the pure RepBN model that is fused.
prepbn_step = 128000
