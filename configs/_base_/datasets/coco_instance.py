# COCO 2017 instance segmentation (boxes + masks): coco_detection.py with mask annotations and
# the segm metric. Expected layout of the real COCO (`python tools/make_demo_data.py` writes the
# synthetic demo set of configs/demo/ in the same layout to data/mmslab_demo/coco/ instead):
#   data/coco/annotations/instances_{train,val}2017.json
#   data/coco/{train,val}2017/*.jpg
_base_ = ['./coco_detection.py']

# The detection pipelines, loading masks too.
train_pipeline = [
    dict(step, with_mask=True) if step['type'] == 'LoadAnnotations' else step
    for step in _base_.train_pipeline
]
test_pipeline = [
    dict(step, with_mask=True) if step['type'] == 'LoadAnnotations' else step
    for step in _base_.test_pipeline
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader

val_evaluator = dict(metric=['bbox', 'segm'])
test_evaluator = val_evaluator
