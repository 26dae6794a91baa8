"""Whole-detector ONNX export: image -> detections (and RoI masks) with standard ONNX ops.

:class:`DetectorEnd2End` wraps a built mmdet Mask R-CNN / Faster R-CNN or RetinaNet in eval
mode and writes its test-time post-processing (anchor grids, box decoding, NMS, RoI feature
extraction, mask selection) with traceable tensor operations, as mmdeploy's end2end models:

* the input ``image`` ``(1, 3, H, W)`` is the data preprocessor's output; H and W stay free
  in the graph: every size is read from tensor shapes at run time, none is baked in;
* NMS is ``torchvision.ops.nms`` (ONNX NonMaxSuppression) and RoI features come from
  ``torchvision.ops.roi_align`` (ONNX RoiAlign, opset >= 16 for ``aligned=True``): no mmcv
  operator enters the graph.

Outputs (:func:`end2end_output_names`): ``dets`` ``(N, 5)`` float32 (x1, y1, x2, y2, score
in the input's pixel frame), ``labels`` ``(N,)`` int64 and, with a mask head, ``masks``
``(N, M, M)``: the mask head's probabilities of each detection's class on its RoI (pasting
them into the image stays outside the graph). N <= max_per_img, by descending score: what
``model.predict(image, data_samples, rescale=False)`` returns when the data samples'
``img_shape`` is the input's (H, W), the box clipping bounds of the exported graph.
"""
import math
from typing import List, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmcv.ops import RoIAlign
from mmdet.models.dense_heads import RetinaHead, RPNHead
from mmdet.models.detectors import (FasterRCNN, MaskRCNN, RetinaNet, SingleStageDetector,
                                    TwoStageDetector)
from mmdet.models.roi_heads import (ConvFCBBoxHead, FCNMaskHead, Shared2FCBBoxHead,
                                    Shared4Conv1FCBBoxHead, SingleRoIExtractor, StandardRoIHead)
from mmdet.models.task_modules import AnchorGenerator, DeltaXYWHBBoxCoder
from torch import Tensor
from torch.onnx.operators import shape_as_tensor
from torchvision.ops import nms, roi_align

#: Exact types (subclasses may change the computation, so they are refused).
TWO_STAGE_DETECTORS = (TwoStageDetector, FasterRCNN, MaskRCNN)
ONE_STAGE_DETECTORS = (SingleStageDetector, RetinaNet)
BBOX_HEADS = (ConvFCBBoxHead, Shared2FCBBoxHead, Shared4Conv1FCBBoxHead)

#: mmdet's ``DeltaXYWHBBoxCoder.decode`` default, which none of the supported heads overrides.
WH_RATIO_CLIP = 16 / 1000


def _names(types: Sequence[type]) -> str:
    return ', '.join(t.__name__ for t in types)


def _require_type(obj, types: Sequence[type], what: str) -> None:
    if type(obj) not in types:
        raise ValueError(f'end-to-end export: {what} {type(obj).__name__} is not supported; '
                         f'supported: {_names(types)}')


def nms_iou_threshold(nms_cfg: dict, where: str) -> float:
    """The IoU threshold of an mmcv ``batched_nms`` config; ``ValueError`` for the variants
    :func:`batched_nms` does not implement (Soft-NMS, ``offset=1``, score filters...)."""
    cfg = dict(nms_cfg)
    nms_type = cfg.pop('type', 'nms')
    offset = cfg.pop('offset', 0)
    class_agnostic = cfg.pop('class_agnostic', False)
    # mmcv splits NMS per class above split_thr boxes: the same decisions, no setting to honour
    cfg.pop('split_thr', None)
    iou = cfg.pop('iou_threshold', None)
    if nms_type != 'nms' or offset != 0 or class_agnostic or iou is None or cfg:
        raise ValueError(f'end-to-end export: {where} nms={dict(nms_cfg)} is not supported; '
                         "supported: dict(type='nms', iou_threshold=...) with offset=0, "
                         'class-aware')
    return float(iou)


def _check_dense_head(head: nn.Module, what: str) -> None:
    _require_type(head.prior_generator, (AnchorGenerator, ), f'{what} prior generator')
    _require_type(head.bbox_coder, (DeltaXYWHBBoxCoder, ), f'{what} bbox coder')
    if getattr(head.loss_cls, 'custom_cls_channels', False):
        raise ValueError(f'end-to-end export: {what} with a custom classification activation '
                         f'({type(head.loss_cls).__name__}) is not supported')
    if head.test_cfg is None:
        raise ValueError(f'end-to-end export: {what} has no test_cfg')
    nms_iou_threshold(head.test_cfg['nms'], f'{what} test_cfg')


def _check_roi_extractor(extractor: nn.Module, what: str) -> None:
    _require_type(extractor, (SingleRoIExtractor, ), what)
    for layer in extractor.roi_layers:
        _require_type(layer, (RoIAlign, ), f'{what} roi_layer')
        if layer.pool_mode != 'avg':
            raise ValueError(f"end-to-end export: {what} RoIAlign pool_mode="
                             f"{layer.pool_mode!r} is not supported; supported: 'avg'")


def check_supported(model: nn.Module) -> None:
    """Raise ``ValueError`` naming the first part of ``model`` :class:`DetectorEnd2End` cannot
    reproduce: detector, head, RoI layer, box coder, anchor generator or NMS type."""
    if type(model) in TWO_STAGE_DETECTORS:
        _require_type(model.rpn_head, (RPNHead, ), 'RPN head')
        _check_dense_head(model.rpn_head, 'RPNHead')
        roi_head = model.roi_head
        _require_type(roi_head, (StandardRoIHead, ), 'RoI head')
        if roi_head.with_shared_head:
            raise ValueError('end-to-end export: a StandardRoIHead with a shared head '
                             f'({type(roi_head.shared_head).__name__}) is not supported')
        bbox_head = roi_head.bbox_head
        _require_type(bbox_head, BBOX_HEADS, 'bbox head')
        _require_type(bbox_head.bbox_coder, (DeltaXYWHBBoxCoder, ), 'bbox head coder')
        if bbox_head.custom_cls_channels or not (bbox_head.with_cls and bbox_head.with_reg):
            raise ValueError('end-to-end export: the bbox head needs softmax classification '
                             'and box regression')
        _check_roi_extractor(roi_head.bbox_roi_extractor, 'bbox RoI extractor')
        if roi_head.with_mask:
            _require_type(roi_head.mask_head, (FCNMaskHead, ), 'mask head')
            _check_roi_extractor(roi_head.mask_roi_extractor, 'mask RoI extractor')
        if roi_head.test_cfg is None:
            raise ValueError('end-to-end export: the RoI head has no test_cfg (rcnn)')
        nms_iou_threshold(roi_head.test_cfg['nms'], 'rcnn test_cfg')
    elif type(model) in ONE_STAGE_DETECTORS:
        _require_type(model.bbox_head, (RetinaHead, ), 'single-stage head')
        _check_dense_head(model.bbox_head, 'RetinaHead')
    else:
        raise ValueError(f'end-to-end export: detector {type(model).__name__} is not '
                         f'supported; supported: {_names(TWO_STAGE_DETECTORS)} with RPNHead '
                         f'+ StandardRoIHead, {_names(ONE_STAGE_DETECTORS)} with RetinaHead')


def end2end_output_names(model: nn.Module) -> List[str]:
    """``['dets', 'labels']``, plus ``'masks'`` for a two-stage detector with a mask head."""
    check_supported(model)
    names = ['dets', 'labels']
    if isinstance(model, TwoStageDetector) and model.roi_head.with_mask:
        names.append('masks')
    return names


# ----------------------------------------------------------------------------------------------
# traceable building blocks
# ----------------------------------------------------------------------------------------------

def grid_anchors(base_anchors: Tensor, stride: Tuple[int, int], featmap: Tensor) -> Tensor:
    """``(H * W * A, 4)`` anchors of one level, ordered by (y, x, base anchor) as mmdet's
    ``AnchorGenerator.single_level_grid_priors``.

    Args:
        base_anchors (Tensor): ``(A, 4)`` anchors of the cell at the origin (the generator's
            ``base_anchors``: its scales, ratios, octave base scale and center offset).
        stride (tuple[int, int]): ``(stride_w, stride_h)``.
        featmap (Tensor): ``(..., H, W)``; only its traced size is used (mmdet's
            ``_meshgrid`` takes ``len()`` of the shifts, which the tracer bakes in).
    """
    h, w = featmap.shape[-2:]
    shift_x = torch.arange(w, device=featmap.device).to(featmap.dtype) * stride[0]
    shift_y = torch.arange(h, device=featmap.device).to(featmap.dtype) * stride[1]
    yy, xx = torch.meshgrid(shift_y, shift_x, indexing='ij')
    shifts = torch.stack([xx, yy, xx, yy], dim=-1).reshape(-1, 1, 4)
    return (base_anchors.to(featmap)[None] + shifts).reshape(-1, 4)


def decode_deltas(coder: DeltaXYWHBBoxCoder, priors: Tensor, deltas: Tensor,
                  max_xy: Tensor) -> Tensor:
    """mmdet's ``delta2bbox`` for ``(N, 4)`` priors and deltas, in the same operation order
    (so in eager mode the same floats), clipped to ``[0, max_xy]`` when the coder clips.

    Args:
        max_xy (Tensor): ``(4,)`` = (W, H, W, H) of the input image.
    """
    deltas = deltas * deltas.new_tensor(coder.stds) + deltas.new_tensor(coder.means)
    dxy, dwh = deltas[:, :2], deltas[:, 2:]
    pxy = (priors[:, :2] + priors[:, 2:]) * 0.5
    pwh = priors[:, 2:] - priors[:, :2]
    dxy_wh = pwh * dxy
    max_ratio = abs(math.log(WH_RATIO_CLIP))
    if coder.add_ctr_clamp:
        dxy_wh = dxy_wh.clamp(min=-coder.ctr_clamp, max=coder.ctr_clamp)
        dwh = dwh.clamp(max=max_ratio)
    else:
        dwh = dwh.clamp(min=-max_ratio, max=max_ratio)
    gxy = pxy + dxy_wh
    gwh = pwh * dwh.exp()
    boxes = torch.cat([gxy - gwh * 0.5, gxy + gwh * 0.5], dim=-1)
    if coder.clip_border:
        boxes = torch.minimum(boxes.clamp(min=0), max_xy)
    return boxes


def topk_upto(scores: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """The ``min(k, len(scores))`` highest of ``(N,)`` scores (all of them if ``k <= 0``),
    descending, and their indices. The count follows the traced N, not the export's."""
    n = shape_as_tensor(scores)[0]
    return scores.topk(n.clamp(max=k) if k > 0 else n)


def batched_nms(boxes: Tensor, scores: Tensor, groups: Tensor, iou_threshold: float) -> Tensor:
    """Indices of the ``(N, 4)`` boxes NMS keeps within each group, by descending score.

    As mmcv's ``batched_nms``: the boxes of group ``g`` move by ``g * (max coordinate + 1)``
    so that groups never overlap, then one NMS runs on all of them. The same float offsets
    give the same IoUs as mmcv, hence the same decisions near the threshold.
    """
    # a padded -inf keeps max() defined without boxes (Pad: the TorchScript exporter fails
    # on a Concat with an infinite constant)
    top = F.pad(boxes.reshape(-1), (0, 1), value=float('-inf')).max()
    offsets = groups.to(boxes) * (top + 1)
    return nms(boxes + offsets[:, None], scores, iou_threshold)


class _PerClassNMS(torch.autograd.Function):
    """Class-aware NMS of class-specific boxes: ``(C, P, 4)`` boxes, ``(C, 1, P)`` scores ->
    ``(K, 3)`` rows ``(class, 0, box)`` of the boxes kept, scores above ``score_threshold``.

    Exported as one ONNX ``NonMaxSuppression`` with the classes as its batch, the form
    mmdeploy uses: the runtime runs C NMS of P boxes. The offset trick of
    :func:`batched_nms` would run one NMS of up to C * P boxes, quadratic in that count
    (in onnxruntime most of a Mask R-CNN's time with 80 classes and ``score_thr`` 0).
    """

    @staticmethod
    def forward(ctx, boxes: Tensor, scores: Tensor, iou_threshold: float,
                score_threshold: float) -> Tensor:
        rows = []
        for c in range(boxes.shape[0]):
            valid = (scores[c, 0] > score_threshold).nonzero()[:, 0]
            keep = valid[nms(boxes[c, valid], scores[c, 0, valid], iou_threshold)]
            rows.append(torch.stack([torch.full_like(keep, c), torch.zeros_like(keep), keep], 1))
        return torch.cat(rows) if rows else boxes.new_zeros((0, 3), dtype=torch.long)

    @staticmethod
    def symbolic(g, boxes, scores, iou_threshold: float, score_threshold: float):
        def const(value, dtype):
            return g.op('Constant', value_t=torch.tensor([value], dtype=dtype))

        # max_output_boxes_per_class: no limit (max_per_img applies after the merge)
        return g.op('NonMaxSuppression', boxes, scores, const(2**31 - 1, torch.long),
                    const(iou_threshold, torch.float), const(score_threshold, torch.float))


def per_class_nms(boxes: Tensor, scores: Tensor, iou_threshold: float,
                  score_threshold: float) -> Tuple[Tensor, Tensor]:
    """mmdet's ``multiclass_nms`` on ``(P, C, 4)`` class-specific boxes and ``(P, C)``
    scores: the (box, class) pairs scoring above ``score_threshold`` that survive NMS within
    their class, by descending score, as ``(box indices, class indices)``."""
    selected = _PerClassNMS.apply(boxes.transpose(0, 1).contiguous(),
                                  scores.t().unsqueeze(1).contiguous(), iou_threshold,
                                  score_threshold)
    classes, inds = selected[:, 0], selected[:, 2]
    kept = scores[inds, classes]
    order = topk_upto(kept, -1)[1]
    return inds[order], classes[order]


def roi_features(extractor: SingleRoIExtractor, feats: Sequence[Tensor], boxes: Tensor) -> Tensor:
    """``(K, C, h, w)`` RoIAlign features of ``(K, 4)`` boxes of image 0, in box order.

    mmdet's ``SingleRoIExtractor``: a box of scale ``s = sqrt(w * h)`` is pooled from level
    ``floor(log2(s / finest_scale + 1e-6))`` (clamped to the levels). Each level pools its
    subset (found with NonZero), and sorting the concatenated subset indices restores the
    box order, which avoids ScatterND.
    """
    num_levels = len(extractor.roi_layers)
    wh = boxes[:, 2:] - boxes[:, :2]
    scale = torch.sqrt(wh[:, 0] * wh[:, 1])
    levels = torch.floor(torch.log2(scale / extractor.finest_scale + 1e-6))
    levels = levels.clamp(min=0, max=num_levels - 1).long()
    rois = torch.cat([torch.zeros_like(boxes[:, :1]), boxes], dim=1)  # batch index 0
    pooled, indices = [], []
    for level, layer in enumerate(extractor.roi_layers):
        inds = (levels == level).nonzero()[:, 0]
        pooled.append(roi_align(feats[level], rois[inds], layer.output_size, layer.spatial_scale,
                                layer.sampling_ratio, layer.aligned))
        indices.append(inds)
    return torch.cat(pooled)[torch.argsort(torch.cat(indices))]


def dense_scores(head: nn.Module, cls_score: Tensor) -> Tensor:
    """``(H * W * A, num_classes)`` class probabilities of one level's ``(1, A * C, H, W)``
    logits of an anchor head, as its ``_predict_by_feat_single``. (4-D permute: NNCF's INT8
    transformation lost the rank of a ``cls_score[0]`` Gather feeding a 3-D Transpose.)"""
    logits = cls_score.permute(0, 2, 3, 1).reshape(-1, head.cls_out_channels)
    return logits.sigmoid() if head.use_sigmoid_cls else logits.softmax(-1)[:, :-1]


# ----------------------------------------------------------------------------------------------
# the wrapper
# ----------------------------------------------------------------------------------------------

class DetectorEnd2End(nn.Module):
    """``forward(image) -> (dets, labels[, masks])`` of an mmdet detector, exportable to ONNX
    with dynamic height and width (see the module docstring).

    Every setting is read from ``model`` (test_cfg, anchor generator, box coders, RoI
    extractors, mask head); :func:`check_supported` lists what is implemented.

    Args:
        model (nn.Module): a built mmdet ``MaskRCNN`` / ``FasterRCNN`` (RPNHead +
            StandardRoIHead) or ``RetinaNet``, in eval mode.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        check_supported(model)
        self.model = model
        self.two_stage = isinstance(model, TwoStageDetector)
        self.with_mask = self.two_stage and model.roi_head.with_mask

    def forward(self, image: Tensor) -> Tuple[Tensor, ...]:
        """``image`` ``(1, 3, H, W)`` -> ``dets`` ``(N, 5)``, ``labels`` ``(N,)`` and, with a
        mask head, ``masks`` ``(N, M, M)``."""
        feats = self.model.extract_feat(image)
        hw = shape_as_tensor(image)[2:].to(image.dtype)
        max_xy = hw[[1, 0, 1, 0]]
        if not self.two_stage:
            boxes, scores, labels = self._dense_detections(self.model.bbox_head, feats, max_xy)
            return torch.cat([boxes, scores[:, None]], dim=1), labels
        proposals = self._dense_detections(self.model.rpn_head, feats, max_xy)[0]
        dets, labels = self._rcnn_detections(feats, proposals, max_xy)
        if not self.with_mask:
            return dets, labels
        return dets, labels, self._masks(feats, dets[:, :4], labels)

    def _dense_detections(self, head: nn.Module, feats: Sequence[Tensor],
                          max_xy: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """An anchor head's ``predict`` for image 0: boxes ``(N, 4)``, scores ``(N,)``,
        labels ``(N,)``.

        Per level the ``nms_pre`` best (anchor, class) scores, those above ``score_thr``
        (RetinaNet; mmdet thresholds first and then takes the top ``nms_pre``: the same set);
        then decoding, the ``min_bbox_size`` filter and class-aware NMS over all levels. The
        RPN has no threshold and NMS separates levels instead of classes, as mmdet's RPNHead.
        """
        cfg = head.test_cfg
        is_rpn = isinstance(head, RPNHead)
        num_classes = head.num_classes
        priors = head.prior_generator
        cls_scores, bbox_preds = head(feats)
        mlvl_scores, mlvl_priors, mlvl_deltas, mlvl_groups = [], [], [], []
        for level, (cls_score, bbox_pred) in enumerate(zip(cls_scores, bbox_preds)):
            # flat index = anchor * num_classes + class, anchors ordered (y, x, base anchor)
            scores, inds = topk_upto(dense_scores(head, cls_score).reshape(-1),
                                     cfg.get('nms_pre', -1))
            if not is_rpn:
                keep = (scores > cfg.get('score_thr', 0)).nonzero()[:, 0]
                scores, inds = scores[keep], inds[keep]
            # indices are >= 0: truncation is floor division, and one ONNX Div
            anchor_inds = torch.div(inds, num_classes, rounding_mode='trunc')
            anchors = grid_anchors(priors.base_anchors[level], priors.strides[level],
                                   cls_score)
            mlvl_scores.append(scores)
            mlvl_priors.append(anchors[anchor_inds])
            mlvl_deltas.append(bbox_pred.permute(0, 2, 3, 1).reshape(-1, 4)[anchor_inds])
            mlvl_groups.append(torch.full_like(inds, level) if is_rpn else inds % num_classes)
        scores = torch.cat(mlvl_scores)
        groups = torch.cat(mlvl_groups)
        boxes = decode_deltas(head.bbox_coder, torch.cat(mlvl_priors), torch.cat(mlvl_deltas),
                              max_xy)
        min_size = cfg.get('min_bbox_size', -1)
        if min_size >= 0:
            wh = boxes[:, 2:] - boxes[:, :2]
            keep = ((wh[:, 0] > min_size) & (wh[:, 1] > min_size)).nonzero()[:, 0]
            boxes, scores, groups = boxes[keep], scores[keep], groups[keep]
        keep = batched_nms(boxes, scores, groups, nms_iou_threshold(cfg['nms'], 'test_cfg'))
        # mmdet slices with max_per_img as it is (no check for <= 0) in both heads
        keep = keep[:cfg['max_per_img']]
        labels = torch.zeros_like(keep) if is_rpn else groups[keep]
        return boxes[keep], scores[keep], labels

    def _rcnn_detections(self, feats: Sequence[Tensor], proposals: Tensor,
                         max_xy: Tensor) -> Tuple[Tensor, Tensor]:
        """StandardRoIHead's ``predict_bbox`` on ``(P, 4)`` proposals: ``dets`` ``(N, 5)``,
        ``labels`` ``(N,)``.

        mmdet's ``multiclass_nms``: class-specific (or agnostic) decoding, the (proposal,
        class) pairs of the foreground classes scoring above ``score_thr``, NMS within each
        class (:func:`per_class_nms`), the first ``max_per_img``.
        """
        roi_head = self.model.roi_head
        head = roi_head.bbox_head
        cfg = roi_head.test_cfg
        extractor = roi_head.bbox_roi_extractor
        cls_score, bbox_pred = head(
            roi_features(extractor, feats[:extractor.num_inputs], proposals))
        scores = cls_score.softmax(-1)[:, :-1]  # (P, C)
        num_classes = head.num_classes
        deltas = bbox_pred.reshape(-1, 1 if head.reg_class_agnostic else num_classes, 4)
        deltas = deltas.expand(-1, num_classes, 4)
        priors = proposals[:, None, :].expand(-1, num_classes, 4)
        boxes = decode_deltas(head.bbox_coder, priors.reshape(-1, 4), deltas.reshape(-1, 4),
                              max_xy).reshape(-1, num_classes, 4)  # (P, C, 4)
        rois, labels = per_class_nms(boxes, scores, nms_iou_threshold(cfg['nms'], 'rcnn'),
                                     float(cfg['score_thr']))
        if cfg['max_per_img'] > 0:
            rois, labels = rois[:cfg['max_per_img']], labels[:cfg['max_per_img']]
        return torch.cat([boxes[rois, labels], scores[rois, labels, None]], dim=1), labels

    def _masks(self, feats: Sequence[Tensor], boxes: Tensor, labels: Tensor) -> Tensor:
        """``(N, M, M)`` sigmoid of the mask head's logits of each detection's class."""
        roi_head = self.model.roi_head
        head = roi_head.mask_head
        extractor = roi_head.mask_roi_extractor
        logits = head(roi_features(extractor, feats[:extractor.num_inputs], boxes))
        if head.class_agnostic:
            logits = logits[:, 0]
        else:  # each detection's class channel
            index = labels.view(-1, 1, 1, 1).expand(-1, 1, *logits.shape[-2:])
            logits = logits.gather(1, index).squeeze(1)
        return logits.sigmoid()
