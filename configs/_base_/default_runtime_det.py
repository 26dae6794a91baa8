# Runtime for mmdet (COCO) configs. The custom hooks (ReparamEvalHook, ProgressiveNormHook)
# come with the backbone base, see reparam_eval.py.
_base_ = ['./default_runtime.py']
default_scope = 'mmdet'

default_hooks = dict(
    logger=dict(type='LoggerHook', interval=50),
    # one checkpoint per epoch, keep the last 3 plus the best by box AP
    checkpoint=dict(
        type='CheckpointHook',
        interval=1,
        max_keep_ckpts=3,
        save_best='coco/bbox_mAP',
        rule='greater'),
    visualization=dict(type='DetVisualizationHook'))

visualizer = dict(type='DetLocalVisualizer', vis_backends=_base_.vis_backends, name='visualizer')
log_processor = dict(type='LogProcessor', window_size=50, by_epoch=True)
