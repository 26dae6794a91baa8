"""Run an exported whole model on images with onnxruntime or OpenVINO, without PyTorch.

    python -m mmslab.deploy.predict EXPORT_DIR IMAGE [IMAGE ...] --out OUT_DIR
        [--runtime onnxruntime|openvino] [--precision fp32|bf16|int8] [--score-thr 0.3]
        [--threads N]

Only numpy, OpenCV and the runtime are needed (no torch, mmcv, mmengine, mmdet, mmseg): where
those are not installed, ``import mmslab`` registers nothing with OpenMMLab (see
``mmslab/__init__.py``) and this module imports none of them. Pre-processing repeats
the test pipeline of the OpenMMLab model (``LoadImageFromFile`` with cv2, ``Resize``, the
data preprocessor's channel order, normalization and padding) and post-processing repeats
mmdet's / mmseg's rescaling to the original image.

``EXPORT_DIR`` is written by ``tools/export_onnx.py --part model``: ``model.onnx``,
``model_int8.onnx``, ``openvino/model.xml``, ``openvino/model_int8.xml`` and ``export.json``.

The form that runs (:func:`mmslab.deploy.runtimes.choose_runtime_form`, printed first):
without ``--runtime`` / ``--precision``, the deployed form ``export.json`` records
(``latency.deploy``: the runtime and precision ``tools/export_onnx.py --latency`` chose on
the export's machine), or onnxruntime fp32 where the export was not timed. ``--runtime``
alone runs that runtime at the deployed precision if it is the deployed runtime, else in
fp32; ``--precision`` alone runs the deployed runtime at that precision. Where the deployed
form cannot run here (its INT8 artifact missing, OpenVINO not installed, bf16 on a CPU
without bf16 units), the same runtime's fp32, else onnxruntime, runs, and the printed line
says why.

``--precision``: ``fp32`` runs ``model.onnx`` / ``model.xml`` in fp32 arithmetic; ``int8``
(or ``--int8``) the INT8 artifact; ``bf16`` (OpenVINO on CPUs with avx512_bf16 / amx_bf16;
refused elsewhere and for onnxruntime, which has no bf16 on x86 CPUs) the fp32 model with
OpenVINO's ``INFERENCE_PRECISION_HINT=bf16``.

export.json contract, checked by its owner :mod:`mmslab.deploy.export_info` (the keys read
here; ``schema_version``, ``shape`` and ``dynamic`` are required of every export and any
other key, e.g. ``checkpoint_sha256``, is printed and not required):

* ``part``: ``"model"``. ``backbone`` / ``features`` exports end before the heads (no boxes,
  no masks, no labels) and are refused.
* ``task``: ``"detection"``, ``"instance_segmentation"`` or ``"semantic_segmentation"``.
* ``outputs``: the graph's output names in order; outputs are fetched by these names:

  - detection: ``dets`` ``(N, 5)`` (or ``(1, N, 5)``): x1, y1, x2, y2, score in the pixel
    frame of the network input; ``labels`` ``(N,)`` (or ``(1, N)``), integer class indices;
  - instance_segmentation: also ``masks`` ``(N, Mh, Mw)`` (or ``(1, N, Mh, Mw)``),
    probabilities of each detection's class inside its box (mmdeploy-style RoI masks, e.g.
    28x28), pasted here;
  - semantic_segmentation: ``seg_logits`` ``(1, K, h, w)`` at any stride of the input, or
    ``seg_label`` ``(1, h, w)`` / ``(1, 1, h, w)`` integer labels (argmax in the graph).

* ``pipeline``: ``{"resize": null | {"scale": [a, b], "keep_ratio": bool}, "mean": [3],
  "std": [3], "bgr_to_rgb": bool, "pad_size_divisor": int | null, "pad_value": float,
  "size": [h, w] | null}``. Every key must be present (``null`` where allowed). Resize is
  mmcv's: with ``keep_ratio`` the image is scaled by ``min(max(scale) / long side,
  min(scale) / short side)`` to ``int(w * f + 0.5) x int(h * f + 0.5)``, else to exactly
  ``scale = (w, h)``; bilinear (cv2 ``INTER_LINEAR``). Then BGR -> RGB if ``bgr_to_rgb``,
  ``(x - mean) / std``, and padding at the bottom / right with ``pad_value`` (in normalized
  units, as the data preprocessors pad the normalized tensor): to ``size`` if given (mmseg's
  ``SegDataPreProcessor`` ``size``), then up to multiples of ``pad_size_divisor``.
* ``classes``: the class names (semantic segmentation: one per logit channel).
* ``palette``: optional ``[[r, g, b], ...]``; a fixed random palette otherwise.
* ``mask_thr_binary``: optional, default 0.5 (mmdet's ``rcnn.mask_thr_binary``).
* ``align_corners``: optional, default false (the decode head's ``align_corners``).

Written to ``OUT_DIR`` for each image ``<stem>.<ext>``: ``<stem>.jpg`` (the image with boxes,
class names, scores and mask / segmentation overlays), ``<stem>.json`` and, for masks,
``<stem>_masks.png`` (pixel value ``i`` is the ``i``-th written detection, 0 none; where
masks overlap the higher score wins) or, for semantic segmentation, ``<stem>_label.png``
(the class index of each pixel). Both PNGs are 8-bit, 16-bit above 255 values.
"""
import argparse
import json
import os
import os.path as osp
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import cv2
import numpy as np

from .export_info import TASK_OUTPUTS, ExportInfoError, read_export_info
from .runtimes import (PRECISIONS, RUNTIMES, check_runtime, choose_runtime_form,
                       load_runtime_model, resolve_precision)

#: The keys of the whole-model contract (module docstring); the others are printed.
CONTRACT_KEYS = ('part', 'task', 'outputs', 'pipeline', 'classes', 'palette',
                 'mask_thr_binary', 'align_corners')


class PredictError(Exception):
    """A problem of the inputs (export directory, export.json, images) with a message for
    the user; ``main`` prints it without a traceback."""


# ----------------------------------------------------------------------------------------------
# export.json
# ----------------------------------------------------------------------------------------------

def load_export(export_dir: str) -> dict:
    """``EXPORT_DIR/export.json`` validated as a whole model
    (:func:`~mmslab.deploy.export_info.read_export_info`), with the optional keys' defaults:
    ``task``, ``outputs``, ``pipeline``, ``classes``, ``palette`` (``[K, 3]`` uint8),
    ``mask_thr_binary``, ``align_corners`` and ``extra`` (the other keys)."""
    try:
        spec = read_export_info(export_dir, whole_model=True)
    except ExportInfoError as err:
        raise PredictError(str(err)) from None
    classes = spec['classes']
    return dict(
        task=spec['task'], outputs=spec['outputs'], pipeline=spec['pipeline'], classes=classes,
        palette=make_palette(len(classes), spec.get('palette')),
        mask_thr_binary=float(_default(spec.get('mask_thr_binary'), 0.5)),
        align_corners=bool(spec.get('align_corners') or False),
        extra={k: v for k, v in spec.items() if k not in CONTRACT_KEYS})


def _default(value, default):
    return default if value is None else value


def make_palette(num: int, given: Optional[list] = None) -> np.ndarray:
    """``[num, 3]`` uint8 RGB colours: ``given`` first, a fixed random palette for the rest
    (seed 42, as mmseg / mmdet generate one when a dataset has none)."""
    rng = np.random.RandomState(42)
    palette = rng.randint(0, 256, size=(max(num, 1), 3))
    if given:
        n = min(len(given), len(palette))
        palette[:n] = np.asarray(given[:n])
    return palette.astype(np.uint8)


# ----------------------------------------------------------------------------------------------
# pre-processing
# ----------------------------------------------------------------------------------------------

def resized_size(w: int, h: int, scale: Sequence[float], keep_ratio: bool) -> Tuple[int, int]:
    """``(new_w, new_h)`` as mmcv's ``Resize``: ``rescale_size`` with ``keep_ratio``, else
    ``scale`` itself."""
    if not keep_ratio:
        return int(scale[0]), int(scale[1])
    factor = min(max(scale) / max(h, w), min(scale) / min(h, w))
    return int(w * float(factor) + 0.5), int(h * float(factor) + 0.5)


def read_image(path: str) -> np.ndarray:
    """BGR uint8 ``[H, W, 3]`` like mmcv's ``LoadImageFromFile`` (bytes, ``cv2.imdecode``)."""
    try:
        data = np.fromfile(path, dtype=np.uint8)
    except OSError as err:
        raise PredictError(f'cannot read image {path}: {err}')
    image = cv2.imdecode(data, cv2.IMREAD_COLOR) if data.size else None
    if image is None:
        raise PredictError(f'cannot decode image {path} (not an image OpenCV can read)')
    return image


def preprocess(image: np.ndarray, pipeline: dict) -> Tuple[np.ndarray, dict]:
    """``[1, 3, H', W']`` float32 network input and the geometry needed to map back:
    ``ori_shape``, ``img_shape`` (resized), ``pad_shape`` (h, w) and ``scale_factor``
    (w, h), as in mmdet's / mmseg's meta information."""
    h, w = image.shape[:2]
    img = image
    resize = pipeline['resize']
    if resize is not None:
        new_w, new_h = resized_size(w, h, resize['scale'], resize['keep_ratio'])
        if (new_w, new_h) != (w, h):
            img = cv2.resize(image, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    nh, nw = img.shape[:2]
    img = img.astype(np.float32)
    if pipeline['bgr_to_rgb']:
        img = img[..., ::-1]
    mean = np.asarray(pipeline['mean'], np.float32)
    std = np.asarray(pipeline['std'], np.float32)
    img = (img - mean) / std  # division, as the data preprocessors compute it

    ph, pw = nh, nw
    if pipeline['size'] is not None:  # mmseg pads up to a fixed size, never crops
        ph, pw = max(ph, int(pipeline['size'][0])), max(pw, int(pipeline['size'][1]))
    divisor = int(pipeline['pad_size_divisor'] or 1)
    ph, pw = -(-ph // divisor) * divisor, -(-pw // divisor) * divisor
    batch = np.full((1, 3, ph, pw), float(pipeline['pad_value']), np.float32)
    batch[0, :, :nh, :nw] = img.transpose(2, 0, 1)
    meta = dict(ori_shape=(h, w), img_shape=(nh, nw), pad_shape=(ph, pw),
                scale_factor=(nw / w, nh / h))
    return batch, meta


# ----------------------------------------------------------------------------------------------
# post-processing
# ----------------------------------------------------------------------------------------------

def linear_weights(src: np.ndarray, size: int) -> np.ndarray:
    """``[len(src), size]`` weights of linear interpolation of a length-``size`` signal at
    the (fractional) positions ``src``, zero beyond its ends (``grid_sample``'s
    ``padding_mode='zeros'``)."""
    i0 = np.floor(src).astype(np.int64)
    frac = (src - i0).astype(np.float32)
    weights = np.zeros((len(src), size), np.float32)
    rows = np.arange(len(src))
    for idx, w in ((i0, 1 - frac), (i0 + 1, frac)):
        ok = (idx >= 0) & (idx < size)
        weights[rows[ok], idx[ok]] += w[ok]
    return weights


def paste_mask(mask: np.ndarray, box: np.ndarray, img_h: int,
               img_w: int) -> Tuple[int, int, np.ndarray]:
    """One RoI probability map pasted into the image at ``box`` (original pixels), as mmdet's
    ``_do_paste_mask`` on the CPU (``skip_empty=True``): the region from one pixel outside
    the box, sampled bilinearly at pixel centres, ``grid_sample(align_corners=False)`` with
    zero padding. The sampling grid is separable, so the bilinear sampling is exactly
    ``W_y @ mask @ W_x^T``. Returns ``(y0, x0, probabilities)`` of the region."""
    x0, y0, x1, y1 = (float(v) for v in box)
    xs, ys = max(int(np.floor(x0)) - 1, 0), max(int(np.floor(y0)) - 1, 0)
    xe, ye = min(int(np.ceil(x1)) + 1, img_w), min(int(np.ceil(y1)) + 1, img_h)
    if x1 <= x0 or y1 <= y0 or xe <= xs or ye <= ys:  # degenerate box: empty mask
        return ys, xs, np.zeros((0, 0), np.float32)
    mh, mw = mask.shape
    # pixel centre -> mask coordinate: grid (c - x0) / (x1 - x0) * 2 - 1, unnormalized by
    # grid_sample as ((g + 1) * size - 1) / 2
    u = (np.arange(xs, xe) + 0.5 - x0) / (x1 - x0) * mw - 0.5
    v = (np.arange(ys, ye) + 0.5 - y0) / (y1 - y0) * mh - 0.5
    probs = linear_weights(v, mh) @ mask.astype(np.float32) @ linear_weights(u, mw).T
    return ys, xs, probs


def postprocess_detections(outputs: Dict[str, np.ndarray], meta: dict, score_thr: float,
                           num_classes: int, mask_thr: float = 0.5) -> List[dict]:
    """Detections with ``score > score_thr`` (mmdet's visualizer keeps ``scores >
    pred_score_thr``), highest score first, in original pixels: boxes divided by the scale
    factors (x by w, y by h), clipped to the image; with ``masks``, each RoI map pasted
    and thresholded (``>= mask_thr``) as a region ``mask`` at ``mask_origin`` (y, x)."""
    dets = np.asarray(outputs['dets'], np.float32)
    labels = np.asarray(outputs['labels'])
    if dets.ndim == 3 and dets.shape[0] == 1:  # mmdeploy's batch axis
        dets = dets[0]
    if dets.ndim != 2 or dets.shape[1] != 5:
        raise PredictError(f'dets has shape {dets.shape}; expected (N, 5)')
    labels = labels.reshape(-1).astype(np.int64)
    if len(labels) != len(dets):
        raise PredictError(f'{len(dets)} dets but {len(labels)} labels')
    masks = outputs.get('masks')
    if masks is not None:
        masks = np.asarray(masks, np.float32)
        masks = masks.reshape(-1, *masks.shape[-2:])
        if len(masks) != len(dets):
            raise PredictError(f'{len(dets)} dets but {len(masks)} masks')

    keep = np.nonzero(dets[:, 4] > score_thr)[0]
    keep = keep[np.argsort(-dets[keep, 4], kind='stable')]
    if len(keep) and not 0 <= labels[keep].min() <= labels[keep].max() < num_classes:
        raise PredictError(f'labels {sorted(set(labels[keep].tolist()))} do not fit the '
                           f'{num_classes} classes of export.json')
    h, w = meta['ori_shape']
    sx, sy = meta['scale_factor']
    results = []
    for i in keep:
        box = dets[i, :4] / np.array([sx, sy, sx, sy], np.float32)
        box = np.clip(box, 0, [w, h, w, h]).astype(np.float32)
        det = dict(bbox=box, score=float(dets[i, 4]), label=int(labels[i]))
        if masks is not None:
            y0, x0, probs = paste_mask(masks[i], box, h, w)
            det['mask_origin'], det['mask'] = (y0, x0), probs >= mask_thr
        results.append(det)
    return results


def resize_bilinear(x: np.ndarray, out_h: int, out_w: int,
                    align_corners: bool = False) -> np.ndarray:
    """``[C, h, w]`` float32 resized like ``F.interpolate(mode='bilinear')``: cv2
    ``INTER_LINEAR`` computes the same half-pixel-centre interpolation (no antialiasing)
    for ``align_corners=False``; ``align_corners=True`` uses interpolation matrices."""
    c, h, w = x.shape
    if (h, w) == (out_h, out_w):
        return x
    if not align_corners:
        hwc = cv2.resize(np.ascontiguousarray(x.transpose(1, 2, 0)), (out_w, out_h),
                         interpolation=cv2.INTER_LINEAR)
        return hwc.reshape(out_h, out_w, c).transpose(2, 0, 1)

    def positions(out: int, size: int) -> np.ndarray:
        return np.arange(out) * ((size - 1) / (out - 1) if out > 1 else 0.0)

    wy, wx = linear_weights(positions(out_h, h), h), linear_weights(positions(out_w, w), w)
    return np.einsum('oh,chw,pw->cop', wy, x, wx, optimize=True).astype(np.float32)


def nearest_indices(out: int, size: int) -> np.ndarray:
    """Source indices of ``F.interpolate(mode='nearest')``: ``floor(i * size / out)``."""
    return np.minimum(np.floor(np.arange(out) * (size / out)).astype(np.int64), size - 1)


def postprocess_semantic(outputs: Dict[str, np.ndarray], meta: dict, num_classes: int,
                         align_corners: bool = False, chunk: int = 32) -> np.ndarray:
    """``[H, W]`` int64 labels of the original image, as mmseg: logits resized (bilinear) to
    the padded input, cropped to the resized image, resized to the original size, argmax.
    Channels go in chunks (running max) so that ``K x H x W`` floats are never held at once.
    An in-graph ``seg_label`` map takes the same path with nearest-neighbour resizing."""
    ph, pw = meta['pad_shape']
    ih, iw = meta['img_shape']
    h, w = meta['ori_shape']
    if 'seg_logits' in outputs:
        logits = np.asarray(outputs['seg_logits'], np.float32)
        if logits.ndim != 4 or logits.shape[0] != 1:
            raise PredictError(f'seg_logits has shape {logits.shape}; expected (1, K, h, w)')
        logits = logits[0]
        if len(logits) != num_classes:
            raise PredictError(f'seg_logits has {len(logits)} channels but export.json lists '
                               f'{num_classes} classes')
        best_val = best_idx = None
        for c0 in range(0, len(logits), chunk):
            x = resize_bilinear(logits[c0:c0 + chunk], ph, pw, align_corners)[:, :ih, :iw]
            x = resize_bilinear(np.ascontiguousarray(x), h, w, align_corners)
            idx = x.argmax(0)
            val = np.take_along_axis(x, idx[None], 0)[0]
            if best_val is None:
                best_val, best_idx = val, idx + c0
            else:  # strict '>': the first maximal channel wins, as argmax over all
                better = val > best_val
                best_val[better], best_idx[better] = val[better], idx[better] + c0
        return best_idx.astype(np.int64)
    labels = np.asarray(outputs['seg_label'])
    if labels.ndim < 2 or labels.size != labels.shape[-2] * labels.shape[-1]:
        raise PredictError(f'seg_label has shape {labels.shape}; expected (1, h, w)')
    labels = labels.reshape(labels.shape[-2:])
    if labels.size and not 0 <= labels.min() <= labels.max() < num_classes:
        raise PredictError(f'seg_label holds labels {labels.min()}..{labels.max()}, outside '
                           f'the {num_classes} classes of export.json')
    rows = nearest_indices(ph, labels.shape[0])[:ih][nearest_indices(h, ih)]
    cols = nearest_indices(pw, labels.shape[1])[:iw][nearest_indices(w, iw)]
    return labels[np.ix_(rows, cols)].astype(np.int64)


# ----------------------------------------------------------------------------------------------
# the predictor
# ----------------------------------------------------------------------------------------------

class Predictor:
    """An exported whole model in a runtime: ``predictor(image_bgr) -> result dict``.

    Args:
        export_dir (str): what ``tools/export_onnx.py --part model`` wrote.
        runtime (str, optional): ``onnxruntime`` or ``openvino``. Default: None, the deployed
            form ``export.json`` records, onnxruntime where none is (module docstring).
        int8 (bool): run the INT8 model of that runtime (``precision='int8'``).
        threads (int): intra-op threads of the runtime; 0 lets it choose.
        precision (str, optional): 'fp32', 'bf16' (OpenVINO on CPUs with bf16 units) or
            'int8'. Default: None, the deployed precision where ``runtime`` is the deployed
            runtime, else fp32.

    Attributes:
        form (RuntimeForm): the runtime and precision that run, where they came from and
            the line that says so (``form.note``).
    """

    def __init__(self, export_dir: str, runtime: Optional[str] = None, int8: bool = False,
                 threads: int = 0, precision: Optional[str] = None):
        try:
            # what the caller named, checked before anything is read
            if runtime is not None:
                check_runtime(runtime)
            named = resolve_precision(precision, int8, runtime=runtime) \
                if precision is not None or int8 else None
            self.spec = load_export(export_dir)
            # (export.json's latency, among the keys outside the contract)
            self.form = choose_runtime_form(export_dir, self.spec['extra'], runtime, named)
            runtime, self.precision = self.form.runtime, self.form.precision
            self.model = load_runtime_model(export_dir, runtime, self.precision, threads)
        except (ValueError, OSError, RuntimeError) as err:  # no bf16 units: RuntimeError
            raise PredictError(str(err)) from None
        self.task, self.runtime = self.spec['task'], runtime
        self.int8, self.path = self.precision == 'int8', self.model.path
        missing = [n for n in self.spec['outputs'] if n not in self.model.output_names]
        if missing:
            raise PredictError(f'{self.path} has no output {", ".join(missing)} (its outputs: '
                               f'{", ".join(self.model.output_names)}); export.json and '
                               'the model disagree')
        known = set(TASK_OUTPUTS[self.task]) | {'seg_logits', 'seg_label'}
        # seg_logits wins when both are exported: mmseg's own post-processing
        self.fetch = [n for n in self.spec['outputs'] if n in known]
        if 'seg_logits' in self.fetch and 'seg_label' in self.fetch:
            self.fetch.remove('seg_label')

    def __call__(self, image: np.ndarray, score_thr: float = 0.3) -> dict:
        x, meta = preprocess(image, self.spec['pipeline'])
        fixed = self.model.input_hw
        if any(f is not None and f != s for f, s in zip(fixed, x.shape[-2:])):
            raise PredictError(
                f'the model input is fixed at {fixed[0]}x{fixed[1]} but this image '
                f'pre-processes to {x.shape[2]}x{x.shape[3]}: export.json\'s pipeline must '
                'produce that shape (pipeline.size, or a resize without keep_ratio), or '
                'export the model with --dynamic')
        start = time.perf_counter()
        outputs = self.model.run(x, self.fetch)
        latency_ms = (time.perf_counter() - start) * 1e3
        result = dict(task=self.task, meta=meta, latency_ms=latency_ms)
        if self.task == 'semantic_segmentation':
            result['seg'] = postprocess_semantic(outputs, meta, len(self.spec['classes']),
                                                 self.spec['align_corners'])
        else:
            result['detections'] = postprocess_detections(
                outputs, meta, score_thr, len(self.spec['classes']),
                self.spec['mask_thr_binary'])
        return result


# ----------------------------------------------------------------------------------------------
# drawing and files
# ----------------------------------------------------------------------------------------------

def _text_color(bgr) -> Tuple[int, int, int]:
    luma = 0.114 * bgr[0] + 0.587 * bgr[1] + 0.299 * bgr[2]
    return (0, 0, 0) if luma > 140 else (255, 255, 255)


def _label(canvas: np.ndarray, text: str, x: int, y: int, bgr, scale: float) -> None:
    """``text`` on a filled box of colour ``bgr`` whose bottom-left corner is (x, y), kept
    inside the image."""
    font = cv2.FONT_HERSHEY_SIMPLEX
    (tw, th), base = cv2.getTextSize(text, font, scale, 1)
    x = int(min(max(x, 0), max(canvas.shape[1] - tw - 2, 0)))
    y = int(min(max(y, th + base + 2), canvas.shape[0]))
    cv2.rectangle(canvas, (x, y - th - base - 2), (x + tw + 2, y), bgr, -1)
    cv2.putText(canvas, text, (x + 1, y - base - 1), font, scale, _text_color(bgr), 1,
                cv2.LINE_AA)


def draw_detections(image: np.ndarray, dets: List[dict], classes: List[str],
                    palette: np.ndarray) -> np.ndarray:
    canvas = image.copy()
    h, w = image.shape[:2]
    for det in reversed(dets):  # masks of higher scores on top
        if 'mask' in det and det['mask'].any():
            (y0, x0), m = det['mask_origin'], det['mask']
            region = canvas[y0:y0 + m.shape[0], x0:x0 + m.shape[1]]
            color = palette[det['label']][::-1].astype(np.float32)
            region[m] = (0.5 * region[m] + 0.5 * color).astype(np.uint8)
    thickness = max(1, round(max(h, w) / 500))
    scale = max(0.4, max(h, w) / 1600)
    for det in reversed(dets):
        bgr = tuple(int(c) for c in palette[det['label']][::-1])
        x1, y1, x2, y2 = (int(round(float(v))) for v in det['bbox'])
        cv2.rectangle(canvas, (x1, y1), (x2, y2), bgr, thickness)
        _label(canvas, f'{classes[det["label"]]} {det["score"]:.2f}', x1, y1, bgr, scale)
    return canvas


def draw_semantic(image: np.ndarray, seg: np.ndarray, classes: List[str],
                  palette: np.ndarray, legend: int = 12) -> np.ndarray:
    """The colour-coded labels blended over the image, and a legend of the largest classes."""
    colors = palette[np.clip(seg, 0, len(palette) - 1)][..., ::-1].astype(np.float32)
    canvas = (0.5 * image.astype(np.float32) + 0.5 * colors).astype(np.uint8)
    counts = np.bincount(seg.reshape(-1), minlength=len(classes))
    scale = max(0.4, max(image.shape[:2]) / 1600)
    y = 0
    for k in np.argsort(-counts, kind='stable')[:legend]:
        if counts[k] == 0:
            break
        (_, th), base = cv2.getTextSize(classes[k], cv2.FONT_HERSHEY_SIMPLEX, scale, 1)
        y += th + base + 4
        _label(canvas, classes[k], 2, y, tuple(int(c) for c in palette[k][::-1]), scale)
    return canvas


def write_label_png(path: str, labels: np.ndarray) -> None:
    dtype = np.uint8 if labels.max(initial=0) < 256 else np.uint16
    if not cv2.imwrite(path, labels.astype(dtype)):
        raise PredictError(f'cannot write {path}')


def save_result(result: dict, image: np.ndarray, image_path: str, out_dir: str, stem: str,
                spec: dict, score_thr: float, runtime: str, precision: str = 'fp32') -> dict:
    """Write ``<stem>.jpg``, ``<stem>.json`` and the label PNG; returns the JSON record."""
    classes, palette = spec['classes'], spec['palette']
    meta = result['meta']
    h, w = meta['ori_shape']
    record = dict(image=osp.abspath(image_path), width=w, height=h, task=result['task'],
                  runtime=runtime, precision=precision,
                  latency_ms=round(result['latency_ms'], 3),
                  input_shape=list(meta['pad_shape']), resized_shape=list(meta['img_shape']),
                  scale_factor=[float(s) for s in meta['scale_factor']])
    if result['task'] == 'semantic_segmentation':
        seg = result['seg']
        counts = np.bincount(seg.reshape(-1), minlength=len(classes))
        record['label_png'] = f'{stem}_label.png'
        record['histogram'] = [
            dict(label=int(k), **{'class': classes[k]},
                 pixels=int(counts[k]), fraction=round(float(counts[k]) / seg.size, 6))
            for k in np.nonzero(counts)[0]]
        write_label_png(osp.join(out_dir, record['label_png']), seg)
        canvas = draw_semantic(image, seg, classes, palette)
    else:
        dets = result['detections']
        record['score_thr'] = score_thr
        record['detections'] = []
        index_map = None
        if result['task'] == 'instance_segmentation':
            index_map = np.zeros((h, w), np.uint16 if len(dets) > 255 else np.uint8)
            record['masks_png'] = f'{stem}_masks.png'
        for i, det in enumerate(dets):
            entry = dict(bbox=[round(float(v), 3) for v in det['bbox']],
                         score=round(det['score'], 5), label=det['label'],
                         **{'class': classes[det['label']]})
            if 'mask' in det:
                (y0, x0), m = det['mask_origin'], det['mask']
                ys, xs = np.nonzero(m)
                entry.update(mask_index=i + 1, mask_area=int(len(ys)),
                             mask_bbox=[int(x0 + xs.min()), int(y0 + ys.min()),
                                        int(x0 + xs.max() + 1), int(y0 + ys.max() + 1)]
                             if len(ys) else None)
            record['detections'].append(entry)
        if index_map is not None:
            for i, det in reversed(list(enumerate(dets))):  # higher scores win overlaps
                (y0, x0), m = det['mask_origin'], det['mask']
                index_map[y0:y0 + m.shape[0], x0:x0 + m.shape[1]][m] = i + 1
            write_label_png(osp.join(out_dir, record['masks_png']), index_map)
        canvas = draw_detections(image, dets, classes, palette)
    if not cv2.imwrite(osp.join(out_dir, f'{stem}.jpg'), canvas):
        raise PredictError(f'cannot write {osp.join(out_dir, stem + ".jpg")}')
    with open(osp.join(out_dir, f'{stem}.json'), 'w') as f:
        json.dump(record, f, indent=2)
    return record


def unique_stems(paths: Sequence[str]) -> List[str]:
    """File stems, ``_2``, ``_3``... appended where two images share one."""
    seen, stems = {}, []
    for p in paths:
        stem = osp.splitext(osp.basename(p))[0]
        seen[stem] = seen.get(stem, 0) + 1
        stems.append(stem if seen[stem] == 1 else f'{stem}_{seen[stem]}')
    return stems


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog='python -m mmslab.deploy.predict',
        description='Predict with an exported whole model (tools/export_onnx.py --part model) '
        'in onnxruntime or OpenVINO, without PyTorch.')
    p.add_argument('export_dir', help='directory written by tools/export_onnx.py')
    p.add_argument('images', nargs='+', help='image files')
    p.add_argument('--out', required=True, help='output directory')
    p.add_argument('--runtime', choices=RUNTIMES, default=None,
                   help="default: the deployed form's runtime that export.json records "
                   '(tools/export_onnx.py --latency), onnxruntime where none is')
    p.add_argument('--precision', choices=PRECISIONS, default=None,
                   help='default: the deployed precision with the deployed runtime, else '
                   'fp32; bf16: OpenVINO computes the fp32 model in bf16 (CPUs with '
                   'avx512_bf16 / amx_bf16); int8: the INT8 model of the runtime')
    p.add_argument('--int8', action='store_true', help='the same as --precision int8')
    p.add_argument('--score-thr', type=float, default=0.3,
                   help='detections with a higher score are drawn and written')
    p.add_argument('--threads', type=int, default=0, help='runtime threads (0: its default)')
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        missing = [p for p in args.images if not osp.isfile(p)]
        if missing:
            raise PredictError(f'no such image: {", ".join(missing)}')
        predictor = Predictor(args.export_dir, args.runtime, args.int8, args.threads,
                              args.precision)
    except PredictError as err:
        print(f'error: {err}', file=sys.stderr)
        return 1
    if predictor.form.note:
        print(predictor.form.note)
    spec = predictor.spec
    scalar = (str, int, float, bool, type(None))
    extra = ', '.join(f'{k}={v}' for k, v in spec['extra'].items() if isinstance(v, scalar) or
                      isinstance(v, list) and all(isinstance(x, scalar) for x in v))
    print(f'{predictor.path}: {spec["task"]}, {len(spec["classes"])} classes, '
          f'{predictor.runtime} {predictor.precision}' + (f'; {extra}' if extra else ''))
    os.makedirs(args.out, exist_ok=True)
    failed = 0
    for path, stem in zip(args.images, unique_stems(args.images)):
        try:
            image = read_image(path)
            result = predictor(image, args.score_thr)
            record = save_result(result, image, path, args.out, stem, spec, args.score_thr,
                                 predictor.runtime, predictor.precision)
        except PredictError as err:
            print(f'error: {path}: {err}', file=sys.stderr)
            failed += 1
            continue
        h, w = result['meta']['ori_shape']
        ih, iw = result['meta']['pad_shape']
        if 'detections' in record:
            found = f'{len(record["detections"])} detections (score > {args.score_thr:g})'
        else:
            found = f'{len(record["histogram"])} classes: ' + ', '.join(
                e['class'] for e in sorted(record['histogram'], key=lambda e: -e['pixels']))
        print(f'{path}: {w}x{h} (input {iw}x{ih}), {found}, '
              f'{result["latency_ms"]:.1f} ms in {predictor.runtime} {predictor.precision}')
    if failed:
        print(f'error: {failed} of {len(args.images)} images failed', file=sys.stderr)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
