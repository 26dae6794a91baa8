# Runtime for mmdet (COCO) configs.
default_scope = 'mmdet'
custom_imports = dict(imports=['mmslab'], allow_failed_imports=False)

default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=50),
    param_scheduler=dict(type='ParamSchedulerHook'),
    # one checkpoint per epoch, keep the last 3 plus the best by box AP
    checkpoint=dict(
        type='CheckpointHook',
        interval=1,
        max_keep_ckpts=3,
        save_best='coco/bbox_mAP',
        rule='greater'),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    visualization=dict(type='DetVisualizationHook'))

# Validation and test run on a re-parameterized (fused) copy of the model, checked against the
# unfused model on the first batch and timed per image (latency.json in the work dir). Configs
# whose backbone has PRepBN or UN layers append ProgressiveNormHook (`backbone_hooks`).
custom_hooks = [
    dict(
        type='ReparamEvalHook',
        reparam=True,
        check_equivalence=True,
        tolerance=1e-3,
        measure_latency=True,
        warmup=2,
        compare_unfused=False)
]

env_cfg = dict(
    cudnn_benchmark=False,
    mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
    dist_cfg=dict(backend='nccl'))

vis_backends = [dict(type='LocalVisBackend')]
visualizer = dict(type='DetLocalVisualizer', vis_backends=vis_backends, name='visualizer')
log_processor = dict(type='LogProcessor', window_size=50, by_epoch=True)

log_level = 'INFO'
load_from = None
resume = False
