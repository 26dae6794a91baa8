# COCO "1x": 12 epochs at 16 images per batch (2 per GPU x 8 GPUs), AdamW lr 1e-4, weight
# decay 0.05, linear warm-up over the first 500 iterations, lr x0.1 after epochs 8 and 11.
max_epochs = 12
train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=max_epochs, val_interval=1)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')

param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=500),
    dict(
        type='MultiStepLR',
        begin=0,
        end=max_epochs,
        by_epoch=True,
        milestones=[8, 11],
        gamma=0.1)
]

# No weight decay on normalization parameters (norm_decay_mult covers LayerNorm and BatchNorm
# modules; the 'norm' key also covers UN, which is neither), on RepBN's alpha, on position
# tables/embeddings of Swin (relative_position_bias_table, absolute_pos_embed), SLA
# (positional_encoding) and PVT (pos_embed).
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=0.0001, betas=(0.9, 0.999), weight_decay=0.05),
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

# The learning rate above is for a total batch of 16; `tools/train.py --auto-scale-lr` rescales
# it linearly to the actual total batch.
auto_scale_lr = dict(enable=False, base_batch_size=16)

# PRepBN decay length T (iterations over which the LayerNorm share g goes linearly 1 -> 0).
# What it drives: the authors' ImageNet releases finish their own LN -> RepBN decay, so every
# norm loaded from a converted release starts fine-tuning at g = 0 (pure RepBN) and stays
# there (`reset_schedule=True` in the backbone's init_cfg restarts them instead). T therefore
# only drives the norms that are new in detection -- the backbone's output norms norm0..norm3
# -- and every norm of a backbone trained without a progressive-norm checkpoint. The training
# log shows `prepbn_ratio_min` / `prepbn_ratio_max` over all PRepBN layers.
# Value: 12 epochs of COCO train2017 (117,266 images left after dropping those without
# annotations) at 16 images per iteration = 12 x 7,330 = 87,960 iterations. T = 70,000 is
# about 0.8 of that: g reaches 0 shortly before the second lr drop, so the last ~18k
# iterations train the pure RepBN model that is fused for inference. Users of the SLAB
# authors' code report NaN losses when T is far shorter than training; about 0.8 x worked.
# Rescale T with the schedule if you change epochs or batch size.
prepbn_step = 70000
