# Runtime for mmseg (ADE20K) configs.
default_scope = 'mmseg'
custom_imports = dict(imports=['mmslab'], allow_failed_imports=False)

default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=50, log_metric_by_epoch=False),
    param_scheduler=dict(type='ParamSchedulerHook'),
    # a checkpoint at every validation (16k iterations), keep the last 3 plus the best mIoU
    checkpoint=dict(
        type='CheckpointHook',
        by_epoch=False,
        interval=16000,
        max_keep_ckpts=3,
        save_best='mIoU',
        rule='greater'),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    visualization=dict(type='SegVisualizationHook'))

# Validation/test on the fused model, see default_runtime_det.py.
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
    cudnn_benchmark=True,
    mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
    dist_cfg=dict(backend='nccl'))

vis_backends = [dict(type='LocalVisBackend')]
visualizer = dict(type='SegLocalVisualizer', vis_backends=vis_backends, name='visualizer')
log_processor = dict(by_epoch=False)

log_level = 'INFO'
load_from = None
resume = False

tta_model = dict(type='SegTTAModel')
