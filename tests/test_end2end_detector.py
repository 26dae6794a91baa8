"""mmslab/deploy/end2end.py: whole detectors (Mask R-CNN, RetinaNet) exported with a dynamic
input size, against mmdet's own ``model.predict(..., rescale=False)`` in PyTorch,
onnxruntime and OpenVINO.

Tiny random detectors: ResNet-18 with 8 base channels, FPN with 16 channels, 4 classes.
Random weights give nearly the same class logits for every RoI / anchor (the classes are
decided by the biases, scores nearly tie), so the classifiers are calibrated on one image:
logits spread per class as a trained model's are. The thresholds then keep tens of
detections of all classes, below ``max_per_img``.
"""
import copy
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from mmdet.models.roi_heads.mask_heads.fcn_mask_head import _do_paste_mask
from mmdet.registry import MODELS, TASK_UTILS
from mmdet.structures import DetDataSample
from mmdet.structures.bbox import bbox2roi
from mmengine.config import ConfigDict
from mmengine.registry import init_default_scope

from conftest import randomize_weights
from mmslab.deploy.end2end import (DetectorEnd2End, check_supported, end2end_output_names,
                                   grid_anchors)

NUM_CLASSES = 4
EXPORT_SIZE = (128, 128)
SIZES = [(96, 160), (160, 96)]  # landscape and portrait, both unlike the export's
BACKBONE = dict(type='ResNet', depth=18, base_channels=8, out_indices=(0, 1, 2, 3),
                norm_cfg=dict(type='BN', requires_grad=False), norm_eval=True)
NECK = dict(type='FPN', in_channels=[8, 16, 32, 64], out_channels=16, num_outs=5)
NMS = dict(type='nms', iou_threshold=0.5)
MIN_BBOX_SIZE = 8  # not mmdet's 0, which keeps all but empty boxes: border boxes go too


def roi_extractor(size: int) -> dict:
    return dict(type='SingleRoIExtractor', out_channels=16, featmap_strides=[4, 8, 16, 32],
                roi_layer=dict(type='RoIAlign', output_size=size, sampling_ratio=0))


MASK_RCNN = dict(
    type='MaskRCNN', data_preprocessor=dict(type='DetDataPreprocessor', pad_size_divisor=32),
    backbone=BACKBONE, neck=NECK,
    rpn_head=dict(
        type='RPNHead', in_channels=16, feat_channels=16,
        anchor_generator=dict(type='AnchorGenerator', scales=[8], ratios=[0.5, 1.0, 2.0],
                              strides=[4, 8, 16, 32, 64]),
        bbox_coder=dict(type='DeltaXYWHBBoxCoder', target_means=[0.0] * 4,
                        target_stds=[1.0] * 4)),
    roi_head=dict(
        type='StandardRoIHead', bbox_roi_extractor=roi_extractor(7),
        bbox_head=dict(type='Shared2FCBBoxHead', in_channels=16, fc_out_channels=32,
                       roi_feat_size=7, num_classes=NUM_CLASSES,
                       bbox_coder=dict(type='DeltaXYWHBBoxCoder', target_means=[0.0] * 4,
                                       target_stds=[0.1, 0.1, 0.2, 0.2])),
        mask_roi_extractor=roi_extractor(14),
        mask_head=dict(type='FCNMaskHead', num_convs=2, in_channels=16, conv_out_channels=16,
                       num_classes=NUM_CLASSES)),
    train_cfg=None,
    test_cfg=dict(
        rpn=dict(nms_pre=1000, max_per_img=1000, nms=dict(type='nms', iou_threshold=0.7),
                 min_bbox_size=MIN_BBOX_SIZE),
        rcnn=dict(score_thr=0.5, nms=NMS, max_per_img=100, mask_thr_binary=0.5)))

RETINANET = dict(
    type='RetinaNet', data_preprocessor=dict(type='DetDataPreprocessor', pad_size_divisor=32),
    backbone=BACKBONE, neck=dict(NECK, start_level=1, add_extra_convs='on_input'),
    bbox_head=dict(
        type='RetinaHead', num_classes=NUM_CLASSES, in_channels=16, stacked_convs=2,
        feat_channels=16,
        anchor_generator=dict(type='AnchorGenerator', octave_base_scale=4, scales_per_octave=3,
                              ratios=[0.5, 1.0, 2.0], strides=[8, 16, 32, 64, 128]),
        bbox_coder=dict(type='DeltaXYWHBBoxCoder', target_means=[0.0] * 4,
                        target_stds=[1.0] * 4),
        loss_cls=dict(type='FocalLoss', use_sigmoid=True)),
    test_cfg=dict(nms_pre=1000, min_bbox_size=MIN_BBOX_SIZE, score_thr=0.3, nms=NMS,
                  max_per_img=100))


def noise_image(h: int, w: int, seed: int = 0) -> torch.Tensor:
    """``(1, 3, h, w)`` normalized-image-like input: smooth blobs plus pixel noise."""
    g = torch.Generator().manual_seed(seed)
    blobs = F.interpolate(torch.randn(1, 3, h // 16, w // 16, generator=g), size=(h, w),
                          mode='bilinear', align_corners=False)
    return blobs + 0.3 * torch.randn(1, 3, h, w, generator=g)


def predict(model, image):
    """mmdet's predictions with the input's own size as ``img_shape`` (the clipping bounds
    of the exported graph) and no rescaling."""
    hw = tuple(image.shape[-2:])
    sample = DetDataSample(metainfo=dict(img_shape=hw, ori_shape=hw, pad_shape=hw,
                                         batch_input_shape=hw, scale_factor=(1.0, 1.0)))
    with torch.no_grad():
        return model.predict(image, [sample], rescale=False)[0].pred_instances


def calibrate(model, layer, image, mean, std: float) -> None:
    """Rescale ``layer``'s output channels so that, on ``image``, each has mean ``mean`` and
    standard deviation ``std`` over the positions / RoIs it is applied to."""
    outs = []
    handle = layer.register_forward_hook(lambda module, args, out: outs.append(out))
    predict(model, image)
    handle.remove()
    with torch.no_grad():
        # (N, C) or (1, C, H, W) per call -> (C, samples), without the bias
        z = torch.cat([o.transpose(0, 1).reshape(o.shape[1], -1) for o in outs], 1)
        z = z - layer.bias[:, None]
        gain = std / z.std(1)
        layer.weight.mul_(gain.view(-1, *[1] * (layer.weight.dim() - 1)))
        layer.bias.copy_(torch.as_tensor(mean) - z.mean(1) * gain)


def build(name: str, calibrated: bool = True):
    """The tiny ``'mask_rcnn'`` or ``'retinanet'``, eval mode."""
    init_default_scope('mmdet')
    model = randomize_weights(MODELS.build(ConfigDict(MASK_RCNN if name == 'mask_rcnn'
                                                      else RETINANET)))
    if not calibrated:
        return model
    image = noise_image(*EXPORT_SIZE, seed=99)
    if name == 'mask_rcnn':
        calibrate(model, model.rpn_head.rpn_cls, image, 0.0, 2.0)
        # background logit 3 above the classes' on average
        calibrate(model, model.roi_head.bbox_head.fc_cls, image,
                  torch.tensor([0.0] * NUM_CLASSES + [3.0]), 2.0)
        calibrate(model, model.roi_head.mask_head.conv_logits, image, 0.0, 2.0)
    else:
        calibrate(model, model.bbox_head.retina_cls, image, -5.0, 1.5)
    return model


# Mask R-CNN (masks: the longer export and runs) is not in the fast lane; RetinaNet is
@pytest.fixture(scope='module', params=[pytest.param('mask_rcnn', marks=pytest.mark.slow),
                                        'retinanet'])
def detector(request):
    return build(request.param)


def check_detections(ref, dets: np.ndarray, labels: np.ndarray, box_tol: float,
                     score_tol: float) -> None:
    """Same detections in the same order as mmdet's ``pred_instances``."""
    assert len(ref.scores) >= 5  # else the comparison tests little
    assert dets.shape == (len(ref.scores), 5) and labels.dtype == np.int64
    np.testing.assert_array_equal(labels, ref.labels.numpy())
    np.testing.assert_allclose(dets[:, :4], ref.bboxes.numpy(), rtol=0, atol=box_tol)
    np.testing.assert_allclose(dets[:, 4], ref.scores.numpy(), rtol=0, atol=score_tol)


def mmdet_roi_masks(model, image, ref) -> torch.Tensor:
    """``(N, 28, 28)`` mmdet's mask probabilities of its own detections (mmcv RoIAlign and
    SingleRoIExtractor), each for its predicted class."""
    with torch.no_grad():
        feats = model.extract_feat(image)
        logits = model.roi_head._mask_forward(feats, bbox2roi([ref.bboxes]))['mask_preds']
    return logits[torch.arange(len(ref.labels)), ref.labels].sigmoid()


def test_grid_anchors_match_mmdet(detector):
    head = detector.rpn_head if hasattr(detector, 'rpn_head') else detector.bbox_head
    generator = head.prior_generator
    sizes = [(3 + i, 5 + 2 * i) for i in range(generator.num_levels)]
    expected = generator.grid_priors(sizes, device='cpu')
    for level, size in enumerate(sizes):
        anchors = grid_anchors(generator.base_anchors[level], generator.strides[level],
                               torch.zeros(1, 1, *size))
        assert torch.equal(anchors, expected[level])


@pytest.mark.parametrize('size', SIZES)
def test_eager_matches_mmdet_predict(detector, size):
    image = noise_image(*size, seed=size[0])
    ref = predict(detector, image)
    with torch.no_grad():
        outs = DetectorEnd2End(detector).eval()(image)
    assert len(outs) == len(end2end_output_names(detector))
    dets, labels = outs[0].numpy(), outs[1].numpy()
    check_detections(ref, dets, labels, box_tol=1e-3, score_tol=1e-5)
    if len(outs) == 3:
        masks = outs[2]
        assert masks.shape == (len(labels), 28, 28)
        torch.testing.assert_close(masks, mmdet_roi_masks(detector, image, ref), rtol=0,
                                   atol=1e-5)
        # pasted and binarized as mmdet does: its masks, but for pixels at the threshold
        pasted = _do_paste_mask(masks[:, None], outs[0][:, :4], *size, skip_empty=False)[0]
        thr = detector.roi_head.test_cfg.mask_thr_binary
        decided = (pasted - thr).abs() > 1e-4
        assert torch.equal((pasted >= thr)[decided], ref.masks[decided])


def export(model, path: str) -> list:
    """Export ``DetectorEnd2End(model)`` at EXPORT_SIZE with free height, width and number
    of detections; returns the output names. No TracerWarning may come from end2end.py:
    one means a traced value became a constant."""
    names = end2end_output_names(model)
    axes = {'image': {2: 'height', 3: 'width'}}
    axes.update({n: {0: 'num_dets'} for n in names})
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter('always')
        torch.onnx.export(DetectorEnd2End(model).eval(), (noise_image(*EXPORT_SIZE), ), path,
                          input_names=['image'], output_names=names, dynamic_axes=axes,
                          opset_version=18, dynamo=False)
    baked = [str(w.message) for w in caught if issubclass(w.category, torch.jit.TracerWarning)
             and w.filename.endswith('end2end.py')]
    assert not baked, baked
    return names


@pytest.fixture(scope='module')
def exported(detector, tmp_path_factory):
    """(path, output names) of ``detector``'s export."""
    path = str(tmp_path_factory.mktemp('end2end') / 'model.onnx')
    return path, export(detector, path)


def runtimes(path: str) -> dict:
    """{runtime: image array -> output arrays} for the ONNX file."""
    import openvino as ov
    session = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
    compiled = ov.Core().compile_model(path, 'CPU', {'INFERENCE_PRECISION_HINT': 'f32'})
    return dict(onnxruntime=lambda image: session.run(None, {'image': image}),
                openvino=lambda image: [compiled([image])[out] for out in compiled.outputs])


def test_onnx_matches_mmdet_predict(detector, exported):
    path, names = exported
    graph = onnx.load(path).graph
    ops = {node.op_type for node in graph.node}
    assert 'NonMaxSuppression' in ops
    assert ('RoiAlign' in ops) == hasattr(detector, 'roi_head')
    assert all(node.domain in ('', 'ai.onnx') for node in graph.node)
    run_in = runtimes(path)
    wrapper = DetectorEnd2End(detector).eval()
    for size in SIZES:
        image = noise_image(*size, seed=size[0] + 1)
        ref = predict(detector, image)
        with torch.no_grad():
            eager = wrapper(image)
        for runtime, run in run_in.items():
            outs = dict(zip(names, run(image.numpy())))
            try:
                check_detections(ref, outs['dets'], outs['labels'], box_tol=1e-2,
                                 score_tol=1e-4)
                if 'masks' in outs:  # the eager masks equal mmdet's (test above)
                    np.testing.assert_allclose(outs['masks'], eager[2].numpy(), rtol=0,
                                               atol=1e-4)
            except AssertionError as e:
                raise AssertionError(f'{runtime} at {size}: {e}') from None


def test_no_detections_give_empty_outputs(detector, tmp_path):
    """Nothing above the score threshold: empty outputs, not errors, in every runtime
    (empty NonZero, NonMaxSuppression, RoiAlign and mask head convolutions)."""
    model = copy.deepcopy(detector)
    head = model.roi_head if hasattr(model, 'roi_head') else model.bbox_head
    head.test_cfg.score_thr = 1.0  # mmdet keeps scores > score_thr
    image = noise_image(*SIZES[0])
    assert len(predict(model, image).scores) == 0
    path = str(tmp_path / 'model.onnx')
    names = export(model, path)
    with torch.no_grad():
        eager = DetectorEnd2End(model).eval()(image)
    shapes = [(0, 5), (0, ), (0, 28, 28)][:len(names)]
    assert [tuple(o.shape) for o in eager] == shapes
    for runtime, run in runtimes(path).items():
        assert [o.shape for o in run(image.numpy())] == shapes, runtime


def _replace_coder(model):
    model.rpn_head.bbox_coder = TASK_UTILS.build(dict(type='LegacyDeltaXYWHBBoxCoder'))


def _max_pool(model):
    model.roi_head.mask_roi_extractor.roi_layers[0].pool_mode = 'max'


def _soft_nms(model):
    model.roi_head.test_cfg.nms = dict(type='soft_nms', iou_threshold=0.5)


def _fcos_head(model):
    model.bbox_head = MODELS.build(dict(type='FCOSHead', num_classes=NUM_CLASSES,
                                        in_channels=16, feat_channels=16, stacked_convs=1,
                                        norm_cfg=None))


def _rpn_only(model):
    return MODELS.build(ConfigDict(type='RPN', backbone=BACKBONE, neck=NECK,
                                   rpn_head=MASK_RCNN['rpn_head'], train_cfg=None,
                                   test_cfg=dict(rpn=MASK_RCNN['test_cfg']['rpn'])))


@pytest.mark.parametrize('name,change,message', [
    ('mask_rcnn', _replace_coder, 'LegacyDeltaXYWHBBoxCoder'),
    ('mask_rcnn', _max_pool, "pool_mode='max'"),
    ('mask_rcnn', _soft_nms, 'soft_nms'),
    ('retinanet', _fcos_head, 'FCOSHead'),
    ('retinanet', _rpn_only, 'detector RPN'),
])
def test_unsupported_settings_raise(name, change, message):
    model = build(name, calibrated=False)
    model = change(model) or model
    with pytest.raises(ValueError, match=message):
        check_supported(model)
    with pytest.raises(ValueError, match=message):
        DetectorEnd2End(model)
