# Runtime shared by the mmdet and mmseg configs (default_runtime_{det,seg}.py add the rest).
custom_imports = dict(imports=['mmslab'], allow_failed_imports=False)

default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    param_scheduler=dict(type='ParamSchedulerHook'),
    sampler_seed=dict(type='DistSamplerSeedHook'))

env_cfg = dict(
    cudnn_benchmark=False,
    mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
    dist_cfg=dict(backend='nccl'))

vis_backends = [dict(type='LocalVisBackend')]

log_level = 'INFO'
load_from = None
resume = False
