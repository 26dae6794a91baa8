# Runtime for mmseg (ADE20K) configs. The custom hooks (ReparamEvalHook, ProgressiveNormHook)
# come with the backbone base, see reparam_eval.py.
_base_ = ['./default_runtime.py']
default_scope = 'mmseg'

default_hooks = dict(
    logger=dict(type='LoggerHook', interval=50, log_metric_by_epoch=False),
    # a checkpoint at every validation (16k iterations), keep the last 3 plus the best mIoU
    checkpoint=dict(
        type='CheckpointHook',
        by_epoch=False,
        interval=16000,
        max_keep_ckpts=3,
        save_best='mIoU',
        rule='greater'),
    visualization=dict(type='SegVisualizationHook'))

env_cfg = dict(cudnn_benchmark=True)

visualizer = dict(type='SegLocalVisualizer', vis_backends=_base_.vis_backends, name='visualizer')
log_processor = dict(by_epoch=False)

tta_model = dict(type='SegTTAModel')
