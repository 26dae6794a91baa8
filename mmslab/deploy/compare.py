"""How far a runtime's outputs are from PyTorch's, for each kind of exported output."""
from typing import Dict, Sequence

import numpy as np

#: fp32 runtimes must reproduce PyTorch within these (detections: every detection matched).
FP32_TOLERANCE = dict(relative_error=1e-4, box_px=1.0, score=1e-3, pixel_agreement=0.999)


def max_relative_error(ref: Sequence[np.ndarray], out: Sequence[np.ndarray]) -> float:
    """Largest ``max|a - b| / max|a|`` over the outputs (shapes must match)."""
    if len(ref) != len(out):
        raise RuntimeError(f'runtime returned {len(out)} outputs, PyTorch {len(ref)}')
    worst = 0.0
    for a, b in zip(ref, out):
        if a.shape != b.shape:
            raise RuntimeError(f'runtime output shape {b.shape} != PyTorch {a.shape}')
        scale = max(float(np.abs(a).max()), 1e-6) if a.size else 1.0
        if a.size:
            worst = max(worst, float(np.abs(a.astype(np.float64) - b).max()) / scale)
    return worst


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``[N, 4] x [M, 4] -> [N, M]`` IoU of x1, y1, x2, y2 boxes."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(-1)
    area_a = np.clip(a[:, 2:] - a[:, :2], 0, None).prod(-1)
    area_b = np.clip(b[:, 2:] - b[:, :2], 0, None).prod(-1)
    return inter / np.maximum(area_a[:, None] + area_b[None] - inter, 1e-9)


def compare_detections(ref: Dict[str, np.ndarray], out: Dict[str, np.ndarray],
                       iou_thr: float = 0.5) -> dict:
    """Match every reference detection to the unused runtime detection of the same label with
    the highest IoU (>= ``iou_thr``), in score order. Returns counts, the matched fraction and
    the largest box (px), score and mask-probability differences of matched pairs."""
    rd, rl, od, ol = ref['dets'], ref['labels'], out['dets'], out['labels']
    iou = box_iou(rd[:, :4], od[:, :4]) if len(rd) and len(od) else np.zeros((len(rd), len(od)))
    used = np.zeros(len(od), bool)
    pairs = []
    for i in range(len(rd)):
        candidates = np.where((ol == rl[i]) & ~used & (iou[i] >= iou_thr))[0]
        if len(candidates):
            j = candidates[np.argmax(iou[i, candidates])]
            used[j] = True
            pairs.append((i, j))
    result = dict(num_ref=int(len(rd)), num_out=int(len(od)),
                  matched=len(pairs) / len(rd) if len(rd) else float(len(od) == 0),
                  max_box_px=0.0, max_score=0.0, mean_iou=1.0)
    if pairs:
        i, j = map(np.array, zip(*pairs))
        result.update(max_box_px=float(np.abs(rd[i, :4] - od[j, :4]).max()),
                      max_score=float(np.abs(rd[i, 4] - od[j, 4]).max()),
                      mean_iou=float(iou[i, j].mean()))
        if 'masks' in ref and 'masks' in out:
            result['max_mask_prob'] = float(np.abs(ref['masks'][i] - out['masks'][j]).max())
    return result


def compare_outputs(names: Sequence[str], ref: Sequence[np.ndarray],
                    out: Sequence[np.ndarray]) -> dict:
    """One comparison record for the outputs ``names`` (see the module docstring)."""
    if len(ref) != len(out):
        raise RuntimeError(f'runtime returned {len(out)} outputs, PyTorch {len(ref)}')
    if 'dets' in names:
        return compare_detections(dict(zip(names, ref)), dict(zip(names, out)))
    if 'seg_label' in names:
        a, b = ref[0], out[0]
        if a.shape != b.shape:
            raise RuntimeError(f'runtime output shape {b.shape} != PyTorch {a.shape}')
        return dict(pixel_agreement=float((a == b).mean()))
    return dict(relative_error=max_relative_error(ref, out))


def within_fp32_tolerance(record: dict) -> bool:
    tol = FP32_TOLERANCE
    if 'relative_error' in record:
        return record['relative_error'] <= tol['relative_error']
    if 'pixel_agreement' in record:
        return record['pixel_agreement'] >= tol['pixel_agreement']
    return (record['num_ref'] == record['num_out'] and record['matched'] == 1.0
            and record['max_box_px'] <= tol['box_px'] and record['max_score'] <= tol['score'])
