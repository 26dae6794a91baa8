# The custom hooks every mmslab config runs. Validation and test run on a re-parameterized
# (fused) copy of the model, checked against the unfused model on the first batch (detectors:
# the neck features, since proposal NMS may flip on a 1e-7 change; segmentors: the logits) and
# timed per image (latency.json in the work dir). Backbone bases (`_base_/backbones/`) inherit
# this file and append what their norms need (ProgressiveNormHook for PRepBN and UN): mmengine
# cannot append to a list that a sibling base defines, so the hooks come in through the
# backbone.
reparam_eval_hook = dict(
    type='ReparamEvalHook',
    reparam=True,
    check_equivalence=True,
    tolerance=1e-3,
    measure_latency=True,
    warmup=2,
    compare_unfused=False)
custom_hooks = [reparam_eval_hook]
