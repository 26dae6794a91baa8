"""Synthetic, learnable demo datasets in COCO and ADE20K layout.

Both generators draw coloured geometric shapes (one distinct hue and outline per class) on a
noisy gradient background, so that a detector or segmentor trained for a few minutes on a CPU
scores well above chance. Everything is deterministic: the same ``seed`` gives byte-identical
annotation files and identical pixel arrays. Every image gets its own random stream derived from
``(seed, split, index)``, so changing ``num_train`` does not change the validation images.

COCO (``make_coco_demo``)
    ``annotations/instances_{train,val}2017.json`` and ``{train,val}2017/*.jpg``. Objects are
    painted in order, later ones on top. Each annotation describes the *visible* part of its
    object: ``segmentation`` is a list of polygons traced from the visible mask, ``bbox`` is the
    extent of those polygons and ``area`` the visible pixel count. Placements that would hide
    most of an earlier object, punch a hole into it, or cut off a tiny fragment are rejected, so
    occlusion stays moderate and every painted pixel of a shape is annotated.

ADE20K (``make_ade_demo``)
    ``ADEChallengeData2016/images/{training,validation}/*.jpg`` with label maps of the same stem
    in ``ADEChallengeData2016/annotations/...`` (PNG, mode ``L``). Label values follow the
    ADE20K convention: 0 is "unlabelled" (a one-pixel seam around every shape), 1..150 are the
    ADE20K classes; only the values listed in ``ADE_DEMO_CLASSES`` are used. Load with
    ``reduce_zero_label=True`` (the default of mmseg's ``ADE20KDataset``), which maps value ``v``
    to train id ``v - 1`` and 0 to 255 (ignored).

Both write only into a folder that is new, empty or holds an earlier output of the same
generator (its ``demo_info.json`` marker and only the files it writes): real datasets often sit
at the standard roots, or are symlinked there, and must never be mixed with or replaced by
synthetic files. Anything else raises :class:`ForeignDataError` before a file is written.
"""
import colorsys
import json
import os
import os.path as osp
import re
from typing import Dict, List, Optional, Sequence, Tuple

import cv2
import numpy as np
from PIL import Image, ImageDraw

# Defined with the data checks (a layer below, which name it in their messages); re-exported.
from mmslab.utils.config_checks import DEMO_DATA_ROOT

__all__ = [
    'COCO_DEMO_CLASSES', 'ADE_DEMO_CLASSES', 'DEMO_DATA_ROOT', 'ForeignDataError',
    'make_coco_demo', 'make_ade_demo', 'coco_demo_complete', 'ade_demo_complete',
    'foreign_entries', 'check_demo_target'
]


class ForeignDataError(FileExistsError):
    """A demo generator's target folder holds files the generator did not write."""


# ----------------------------------------------------------------------------------------------
# Class definitions
# ----------------------------------------------------------------------------------------------

#: COCO category names; category ``id`` is the 1-based position in this tuple.
COCO_DEMO_CLASSES: Tuple[str, ...] = ('circle', 'square', 'triangle', 'star', 'hexagon',
                                      'cross')

# Base hue (0..1) of every COCO class, in the order of COCO_DEMO_CLASSES.
_COCO_HUES = (0.0, 0.33, 0.62, 0.15, 0.83, 0.50)

#: Label values used in the ADE20K-style PNGs, mapped to the ADE20K class name of that value
#: (value ``v`` is ADE20K class ``v``, i.e. train id ``v - 1`` after ``reduce_zero_label``).
#: 1, 3, 4 and 10 are background regions (upper part: wall or sky, lower part: floor or grass);
#: the others are the shapes, see ``_ADE_SHAPES``. Value 0 (unlabelled) is also present.
ADE_DEMO_CLASSES: Dict[int, str] = {
    1: 'wall',
    3: 'sky',
    4: 'floor',
    10: 'grass',
    13: 'person',
    16: 'table',
    20: 'chair',
    21: 'car',
    23: 'painting',
}

# ADE label value -> (shape, base hue)
_ADE_SHAPES = {
    13: ('circle', 0.0),  # red discs
    16: ('square', 0.15),  # yellow squares
    20: ('triangle', 0.85),  # magenta triangles
    21: ('hexagon', 0.68),  # deep blue hexagons
    23: ('star', 0.48),  # saturated cyan stars
}
# ADE background value -> (base HSV, HSV jitter). Low saturation keeps shapes salient.
_ADE_UPPER = {1: ((0.10, 0.15, 0.80), (0.03, 0.05, 0.08)), 3: ((0.58, 0.35, 0.85), (0.03, 0.08,
                                                                                     0.08))}
_ADE_LOWER = {4: ((0.07, 0.40, 0.45), (0.02, 0.08, 0.08)), 10: ((0.30, 0.45, 0.45), (0.03, 0.08,
                                                                                      0.08))}

_SHAPES = ('circle', 'square', 'triangle', 'star', 'hexagon', 'cross')

# Object size range: diameter as a fraction of the image side.
_MIN_SIZE, _MAX_SIZE = 0.08, 0.45
_JPEG_QUALITY = 92
_MARKER = 'demo_info.json'
# Recorded in the marker so that a demo_info.json of some other origin is not taken for ours.
_GENERATOR = 'mmslab.datasets.demo_data'
_TRACE_SCALE = 4

# Per kind: the folders a generator makes under its ``out_dir`` and the files it writes there
# (paths relative to ``out_dir``, '/'-separated).
_LAYOUT = {
    'coco': (frozenset({'annotations', 'train2017', 'val2017'}),
             re.compile(r'demo_info\.json|annotations/instances_(train|val)2017\.json|'
                        r'train2017/demo_train_\d{6}\.jpg|val2017/demo_val_\d{6}\.jpg')),
    'ade': (frozenset({'ADEChallengeData2016', 'ADEChallengeData2016/images',
                       'ADEChallengeData2016/annotations'} |
                      {f'ADEChallengeData2016/{sub}/{split}'
                       for sub in ('images', 'annotations')
                       for split in ('training', 'validation')}),
            re.compile(r'demo_info\.json|'
                       r'ADEChallengeData2016/images/training/demo_training_\d{6}\.jpg|'
                       r'ADEChallengeData2016/images/validation/demo_validation_\d{6}\.jpg|'
                       r'ADEChallengeData2016/annotations/training/demo_training_\d{6}\.png|'
                       r'ADEChallengeData2016/annotations/validation/demo_validation_\d{6}\.png'
                       )),
}
_KIND_NAMES = {'coco': 'COCO', 'ade': 'ADE20K'}


# ----------------------------------------------------------------------------------------------
# Geometry and rendering helpers
# ----------------------------------------------------------------------------------------------
def _shape_polygon(shape: str, cx: float, cy: float, r: float, angle: float) -> np.ndarray:
    """Vertices (N, 2) of ``shape`` with circumradius ``r`` centred at (cx, cy), rotated."""
    if shape == 'circle':
        t = np.linspace(0, 2 * np.pi, 64, endpoint=False)
        pts = np.stack([np.cos(t), np.sin(t)], 1)
    elif shape in ('square', 'triangle', 'hexagon'):
        n = {'square': 4, 'triangle': 3, 'hexagon': 6}[shape]
        t = np.arange(n) * 2 * np.pi / n
        pts = np.stack([np.cos(t), np.sin(t)], 1)
    elif shape == 'star':
        t = np.arange(10) * np.pi / 5
        rad = np.where(np.arange(10) % 2 == 0, 1.0, 0.45)
        pts = np.stack([rad * np.cos(t), rad * np.sin(t)], 1)
    elif shape == 'cross':
        a, b = 1.0 / np.sqrt(1 + 0.35**2), 0.35 / np.sqrt(1 + 0.35**2)  # arm end on unit circle
        pts = np.array([[b, a], [b, b], [a, b], [a, -b], [b, -b], [b, -a], [-b, -a], [-b, -b],
                        [-a, -b], [-a, b], [-b, b], [-b, a]])
    else:
        raise ValueError(f'unknown shape {shape!r}')
    c, s = np.cos(angle), np.sin(angle)
    rot = np.array([[c, -s], [s, c]])
    return pts @ rot.T * r + np.array([cx, cy])


def _rasterize(poly: np.ndarray, h: int, w: int) -> np.ndarray:
    """Boolean (h, w) mask of a polygon given in pixel coordinates; clipped to the image."""
    canvas = Image.new('L', (w, h), 0)
    ImageDraw.Draw(canvas).polygon([(float(x), float(y)) for x, y in poly], fill=1, outline=1)
    return np.asarray(canvas, dtype=bool)


def _hsv(h: float, s: float, v: float) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb(h % 1.0, min(max(s, 0.0), 1.0), min(max(v, 0.0), 1.0)),
                    dtype=np.float32) * 255.0


def _background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Float32 (h, w, 3) low-saturation linear gradient with pixel noise and faint clutter."""
    c0 = _hsv(rng.random(), rng.uniform(0.0, 0.25), rng.uniform(0.30, 0.85))
    c1 = _hsv(rng.random(), rng.uniform(0.0, 0.25), rng.uniform(0.30, 0.85))
    theta = rng.uniform(0, 2 * np.pi)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    proj = np.cos(theta) * xx / max(w - 1, 1) + np.sin(theta) * yy / max(h - 1, 1)
    proj = (proj - proj.min()) / max(float(proj.max() - proj.min()), 1e-6)
    img = c0 * (1 - proj[..., None]) + c1 * proj[..., None]
    # Faint grey strokes as distractors (not annotated).
    clutter = Image.new('L', (w, h), 0)
    draw = ImageDraw.Draw(clutter)
    for _ in range(int(rng.integers(0, 4))):
        x0, y0, x1, y1 = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(0, w), rng.uniform(0, h)
        draw.line([(x0, y0), (x1, y1)], fill=int(rng.integers(20, 60)),
                  width=max(1, int(rng.integers(1, max(2, w // 64) + 1))))
    sign = 1.0 if rng.random() < 0.5 else -1.0
    img = img + sign * np.asarray(clutter, dtype=np.float32)[..., None]
    img = img + rng.normal(0.0, 7.0, size=(h, w, 3)).astype(np.float32)
    return img


def _paint(img: np.ndarray, mask: np.ndarray, colour: np.ndarray, rng: np.random.Generator,
           outline: bool = True) -> None:
    """Paint ``colour`` with a soft linear shading, noise and a darker rim into ``img``[mask]."""
    ys, xs = np.nonzero(mask)
    if len(ys) == 0:
        return
    theta = rng.uniform(0, 2 * np.pi)
    proj = np.cos(theta) * (xs - xs.mean()) + np.sin(theta) * (ys - ys.mean())
    proj = proj / max(float(np.abs(proj).max()), 1.0)
    shade = 1.0 + 0.15 * proj[:, None]
    pix = colour[None, :] * shade + rng.normal(0.0, 6.0, size=(len(ys), 3))
    img[ys, xs] = pix.astype(np.float32)
    if outline:
        m8 = mask.astype(np.uint8)
        rim = (m8 - cv2.erode(m8, np.ones((3, 3), np.uint8), borderType=cv2.BORDER_REPLICATE)) > 0
        img[rim] *= 0.55


def _to_uint8(img: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def _save_jpg(arr: np.ndarray, path: str) -> None:
    Image.fromarray(arr, 'RGB').save(path, format='JPEG', quality=_JPEG_QUALITY)


def _image_rng(seed: int, split: int, idx: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), split, idx]))


def _progress(total: int, enabled: bool):
    """An object with ``update()``: mmengine's ProgressBar when enabled, else a no-op."""
    if enabled and total > 0:
        from mmengine.utils import ProgressBar
        return ProgressBar(total)

    class _Silent:

        def update(self, num_tasks: int = 1) -> None:
            pass

    return _Silent()


def _remove_stale(directory: str, prefix: str, suffixes: Sequence[str]) -> None:
    """Delete files this module wrote earlier (``prefix*``) so no stale samples remain."""
    if not osp.isdir(directory):
        return
    for name in os.listdir(directory):
        if name.startswith(prefix) and name.endswith(tuple(suffixes)):
            os.remove(osp.join(directory, name))


# ----------------------------------------------------------------------------------------------
# Target folders: write only where nothing but our own output lives
# ----------------------------------------------------------------------------------------------
def _read_marker(out_dir: str) -> Optional[dict]:
    """The generator's marker in ``out_dir`` as a dict, or None (absent, unreadable, foreign)."""
    path = osp.join(out_dir, _MARKER)
    if not osp.isfile(path) or osp.islink(path):
        return None
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    # Markers from before the 'generator' entry carry the image counts instead.
    if info.get('generator') != _GENERATOR and 'num_train_images' not in info:
        return None
    return info


def foreign_entries(out_dir: str, kind: str, limit: int = 3) -> List[str]:
    """Up to ``limit`` paths under ``out_dir`` that ``make_{kind}_demo`` did not write.

    Without the generator's ``demo_info.json`` (of this ``kind``) every file is foreign; with
    it, any file or folder outside the generator's layout is, and so is every symlink (the
    generator makes none, and one may lead into a real dataset). A missing ``out_dir`` or one
    holding only the generator's (empty) folders gives ``[]``; a file or a dangling link in
    its place gives ``[out_dir]``. The walk stops at the ``limit``-th finding, so that a real
    dataset's many files are not all listed.
    """
    if kind not in _LAYOUT:
        raise ValueError(f'kind must be one of {tuple(_LAYOUT)}, got {kind!r}')
    if not osp.lexists(out_dir):
        return []
    if not osp.isdir(out_dir):
        return [out_dir]
    dirs, files = _LAYOUT[kind]
    info = _read_marker(out_dir)
    ours = info is not None and info.get('kind') == kind
    found: List[str] = []
    pending = ['']
    while pending and len(found) < limit:
        rel = pending.pop()
        with os.scandir(osp.join(out_dir, rel)) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                sub = f'{rel}/{entry.name}' if rel else entry.name
                if entry.is_symlink():
                    found.append(sub)
                elif entry.is_dir():
                    if sub in dirs:
                        pending.append(sub)
                    else:
                        found.append(sub + '/')
                elif not (ours and files.fullmatch(sub)):
                    found.append(sub)
                if len(found) >= limit:
                    break
    return [osp.join(out_dir, sub) for sub in found]


def check_demo_target(out_dir: str, kind: str) -> None:
    """Raise :class:`ForeignDataError` unless ``make_{kind}_demo`` may write into ``out_dir``.

    Allowed: a new or empty folder, or one with the generator's marker of this ``kind`` and
    nothing but the generator's files (an earlier demo set, complete or interrupted). The
    message names the folder, what was found there and what to do.
    """
    found = foreign_entries(out_dir, kind)
    if not found:
        return
    name = _KIND_NAMES[kind]
    where = f'{out_dir} ({osp.abspath(out_dir)})'
    if found == [out_dir]:
        what = 'that path is a file or a dangling link, not a folder'
    else:
        info = _read_marker(out_dir)
        shown = ', '.join(found) + (', ...' if len(found) >= 3 else '')
        if info is None or info.get('kind') != kind:
            what = (f'it is not empty ({shown}) and has no {_MARKER} of the {name} demo '
                    'generator, so it holds data the generator did not write (a real dataset?)')
        else:
            what = (f'besides an earlier {name} demo set it holds files the generator does not '
                    f'write: {shown}')
    raise ForeignDataError(
        f'refusing to write the synthetic {name} demo set into {where}: {what}. Nothing was '
        'written. Files the generator did not write are never replaced or mixed with demo '
        'files (--force of tools/make_demo_data.py only regenerates a demo set it wrote '
        f'itself). Pick another output root (tools/make_demo_data.py --out ROOT; the demo '
        f'configs read {DEMO_DATA_ROOT}), or move that folder away if it is yours to move.')


def _start_output(out_dir: str, kind: str) -> str:
    """Check ``out_dir``, create it and mark it as an unfinished demo set of ``kind``.

    The marker is written before any sample, so that an interrupted run leaves a folder this
    generator recognises as its own (and may overwrite), not an unmarked one it must refuse.
    Returns the marker's path.
    """
    check_demo_target(out_dir, kind)
    os.makedirs(out_dir, exist_ok=True)
    marker = osp.join(out_dir, _MARKER)
    with open(marker, 'w') as f:
        json.dump(dict(kind=kind, generator=_GENERATOR, complete=False), f, indent=1)
    return marker


# ----------------------------------------------------------------------------------------------
# COCO
# ----------------------------------------------------------------------------------------------
def _visible_annotation(mask: np.ndarray, min_fragment: int):
    """COCO polygons, bbox and area of a visible mask, or None if it is not representable.

    Not representable: empty, with a hole (COCO polygons cannot express holes), with a connected
    piece smaller than ``min_fragment`` pixels, or with a piece whose traced polygon degenerates.
    """
    m8 = mask.astype(np.uint8)
    area = int(m8.sum())
    if area == 0:
        return None
    num, _, stats, _ = cv2.connectedComponentsWithStats(m8, connectivity=8)
    if num < 2 or int(stats[1:, cv2.CC_STAT_AREA].min()) < min_fragment:
        return None
    _, hierarchy = cv2.findContours(m8, cv2.RETR_CCOMP, cv2.CHAIN_APPROX_SIMPLE)
    if hierarchy is None or (hierarchy[0][:, 3] != -1).any():
        return None  # a hole
    # Trace the outline on a 4x nearest-upsampled mask: the centres of its boundary cells lie
    # 1/8 px inside the original pixel edges, so the polygons rasterise (pycocotools) back to
    # exactly the visible pixels instead of losing half a pixel all around.
    up = cv2.resize(m8, None, fx=_TRACE_SCALE, fy=_TRACE_SCALE, interpolation=cv2.INTER_NEAREST)
    contours, _ = cv2.findContours(up, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE)
    polygons: List[List[float]] = []
    for contour in contours:
        approx = cv2.approxPolyDP(contour, 0.3 * _TRACE_SCALE, True).reshape(-1, 2)
        approx = (approx.astype(np.float64) + 0.5) / _TRACE_SCALE
        if len(approx) < 3:
            return None
        x, y = approx[:, 0], approx[:, 1]
        if 0.5 * abs(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1))) < 1.0:
            return None
        polygons.append([round(float(v), 3) for v in approx.reshape(-1)])
    xs = np.concatenate([np.asarray(p[0::2]) for p in polygons])
    ys = np.concatenate([np.asarray(p[1::2]) for p in polygons])
    x0, y0 = float(xs.min()), float(ys.min())
    bbox = [round(x0, 3), round(y0, 3), round(float(xs.max()) - x0, 3),
            round(float(ys.max()) - y0, 3)]
    if bbox[2] < 1 or bbox[3] < 1:
        return None
    return polygons, bbox, area


def _coco_layout(rng: np.random.Generator, size: int):
    """Random object layout for one image.

    Returns a list of (class index, full in-image mask) in paint order and the list of their
    visible annotations (polygons, bbox, area), same order.
    """
    h = w = size
    min_area = max(12, int(0.002 * h * w))
    min_fragment = max(6, int(0.0006 * h * w))
    target = int(rng.integers(2, 7))
    placed: List[Tuple[int, np.ndarray]] = []
    visible: List[np.ndarray] = []
    annos: list = []
    attempts = 0
    while len(placed) < target and attempts < 40 * target:
        attempts += 1
        cls = int(rng.integers(len(COCO_DEMO_CLASSES)))
        diameter = size * float(np.exp(rng.uniform(np.log(_MIN_SIZE), np.log(_MAX_SIZE))))
        r = diameter / 2
        # Centres may lie slightly outside, so some objects are clipped by the border.
        cx, cy = rng.uniform(-0.3 * r, w + 0.3 * r), rng.uniform(-0.3 * r, h + 0.3 * r)
        angle = rng.uniform(0, 2 * np.pi)
        poly = _shape_polygon(_SHAPES[cls], cx, cy, r, angle)
        mask = _rasterize(poly, h, w)
        full_area = np.pi * r * r if _SHAPES[cls] == 'circle' else 0.5 * abs(
            np.dot(poly[:, 0], np.roll(poly[:, 1], 1)) - np.dot(poly[:, 1], np.roll(poly[:, 0], 1)))
        if mask.sum() < max(min_area, 0.45 * full_area):
            continue  # too small or mostly outside the image
        new_anno = _visible_annotation(mask, min_fragment)
        if new_anno is None:
            continue
        new_visible, new_annos, ok = [], [], True
        for (_, old_full), old_vis, old_anno in zip(placed, visible, annos):
            if not (old_vis & mask).any():
                new_visible.append(old_vis)
                new_annos.append(old_anno)
                continue
            vis = old_vis & ~mask
            # Keep at least 55% of every earlier object visible.
            if vis.sum() < max(min_area, 0.55 * old_full.sum()):
                ok = False
                break
            anno = _visible_annotation(vis, min_fragment)
            if anno is None:
                ok = False
                break
            new_visible.append(vis)
            new_annos.append(anno)
        if not ok:
            continue
        placed.append((cls, mask))
        visible = new_visible + [mask]
        annos = new_annos + [new_anno]
    return placed, annos


def _coco_image(rng: np.random.Generator, size: int):
    img = _background(rng, size, size)
    placed, annos = _coco_layout(rng, size)
    for cls, mask in placed:
        hue = _COCO_HUES[cls] + rng.uniform(-0.03, 0.03)
        colour = _hsv(hue, rng.uniform(0.6, 0.95), rng.uniform(0.6, 0.95))
        _paint(img, mask, colour, rng)
    return _to_uint8(img), [(cls, anno) for (cls, _), anno in zip(placed, annos)]


def _write_coco_split(out_dir: str, split: str, split_code: int, num: int, size: int, seed: int,
                      bar) -> Tuple[str, int]:
    img_dir = osp.join(out_dir, f'{split}2017')
    os.makedirs(img_dir, exist_ok=True)
    prefix = f'demo_{split}_'
    _remove_stale(img_dir, prefix, ('.jpg', ))
    images, annotations = [], []
    ann_id = 1
    for idx in range(num):
        rng = _image_rng(seed, split_code, idx)
        arr, objects = _coco_image(rng, size)
        image_id = idx + 1
        file_name = f'{prefix}{idx:06d}.jpg'
        _save_jpg(arr, osp.join(img_dir, file_name))
        images.append(dict(id=image_id, file_name=file_name, width=size, height=size))
        for cls, (polygons, bbox, area) in objects:
            annotations.append(
                dict(id=ann_id, image_id=image_id, category_id=cls + 1, segmentation=polygons,
                     area=area, bbox=bbox, iscrowd=0))
            ann_id += 1
        bar.update()
    coco = dict(
        info=dict(description=f'mmslab synthetic shapes demo ({split})', version='1.0',
                  year=2024, contributor='mmslab', url='', date_created=''),
        licenses=[],
        images=images,
        annotations=annotations,
        categories=[dict(id=i + 1, name=n, supercategory='shape')
                    for i, n in enumerate(COCO_DEMO_CLASSES)])
    ann_file = osp.join(out_dir, 'annotations', f'instances_{split}2017.json')
    os.makedirs(osp.dirname(ann_file), exist_ok=True)
    with open(ann_file, 'w') as f:
        json.dump(coco, f)
    return ann_file, len(annotations)


def make_coco_demo(out_dir: str, num_train: int = 400, num_val: int = 50, img_size: int = 256,
                   seed: int = 0, progress: bool = True) -> dict:
    """Write a synthetic COCO-format instance dataset under ``out_dir``.

    Layout: ``annotations/instances_{train,val}2017.json`` and ``{train,val}2017/*.jpg``
    (``img_size`` x ``img_size`` RGB, 2-6 shapes each, categories ``COCO_DEMO_CLASSES`` with ids
    1..N). Returns a summary dict (paths and counts), also saved as ``demo_info.json``.
    Raises :class:`ForeignDataError` (before writing anything) if ``out_dir`` holds files this
    generator did not write (see :func:`check_demo_target`).
    """
    if img_size < 32:
        raise ValueError('img_size must be at least 32')
    if num_train < 0 or num_val < 0:
        raise ValueError('image counts must be non-negative')
    out_dir = str(out_dir)
    marker = _start_output(out_dir, 'coco')
    bar = _progress(num_train + num_val, progress)
    train_ann, n_train_inst = _write_coco_split(out_dir, 'train', 0, num_train, img_size, seed,
                                                bar)
    val_ann, n_val_inst = _write_coco_split(out_dir, 'val', 1, num_val, img_size, seed, bar)
    if progress and num_train + num_val > 0:
        print()
    summary = dict(
        kind='coco',
        generator=_GENERATOR,
        complete=True,
        root=out_dir,
        train_ann_file=train_ann,
        val_ann_file=val_ann,
        train_img_dir=osp.join(out_dir, 'train2017'),
        val_img_dir=osp.join(out_dir, 'val2017'),
        num_train_images=num_train,
        num_val_images=num_val,
        num_train_instances=n_train_inst,
        num_val_instances=n_val_inst,
        img_size=img_size,
        seed=seed,
        classes=list(COCO_DEMO_CLASSES))
    with open(marker, 'w') as f:
        json.dump(summary, f, indent=1)
    return summary


def coco_demo_complete(out_dir: str) -> bool:
    """Whether ``out_dir`` holds a finished ``make_coco_demo`` output (every listed file)."""
    try:
        with open(osp.join(out_dir, _MARKER)) as f:
            info = json.load(f)
        # A marker without 'complete' predates that entry and was written only when finished.
        if info.get('kind') != 'coco' or not info.get('complete', True):
            return False
        for split in ('train', 'val'):
            with open(osp.join(out_dir, 'annotations', f'instances_{split}2017.json')) as f:
                coco = json.load(f)
            for img in coco['images']:
                if not osp.isfile(osp.join(out_dir, f'{split}2017', img['file_name'])):
                    return False
        return True
    except (OSError, ValueError, KeyError):
        return False


# ----------------------------------------------------------------------------------------------
# ADE20K
# ----------------------------------------------------------------------------------------------
def _ade_image(rng: np.random.Generator, size: int):
    h = w = size
    upper = int(rng.choice(sorted(_ADE_UPPER)))
    lower = int(rng.choice(sorted(_ADE_LOWER)))
    # Horizon: a slightly tilted line between 30% and 70% of the height.
    y_left, y_right = rng.uniform(0.3, 0.7, size=2) * h
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    below = yy >= y_left + (y_right - y_left) * xx / max(w - 1, 1)
    label = np.where(below, lower, upper).astype(np.uint8)

    img = np.empty((h, w, 3), np.float32)
    for region, value, table in ((~below, upper, _ADE_UPPER), (below, lower, _ADE_LOWER)):
        (bh, bs, bv), (jh, js, jv) = table[value]
        c0 = _hsv(bh + rng.uniform(-jh, jh), bs + rng.uniform(-js, js), bv + rng.uniform(-jv, jv))
        c1 = c0 * rng.uniform(0.75, 1.0)
        t = (yy / max(h - 1, 1))[..., None]
        grad = c0 * (1 - t) + c1 * t
        img[region] = grad[region]
    # Region-specific texture: fine noise above, coarser blotches below.
    img += rng.normal(0, 5.0, size=(h, w, 3)).astype(np.float32)
    coarse = rng.normal(0, 12.0, size=(max(h // 8, 1), max(w // 8, 1))).astype(np.float32)
    coarse = cv2.resize(coarse, (w, h), interpolation=cv2.INTER_LINEAR)
    img[below] += coarse[below][:, None]

    shape_values = sorted(_ADE_SHAPES)
    seam = np.zeros((h, w), bool)
    kernel = np.ones((3, 3), np.uint8)
    n_shapes = int(rng.integers(1, 6))
    for _ in range(n_shapes):
        value = int(rng.choice(shape_values))
        shape, hue = _ADE_SHAPES[value]
        r = size * float(np.exp(rng.uniform(np.log(_MIN_SIZE), np.log(_MAX_SIZE)))) / 2
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        mask = _rasterize(_shape_polygon(shape, cx, cy, r, rng.uniform(0, 2 * np.pi)), h, w)
        if not mask.any():
            continue
        colour = _hsv(hue + rng.uniform(-0.02, 0.02), rng.uniform(0.65, 0.95),
                      rng.uniform(0.65, 0.95))
        _paint(img, mask, colour, rng, outline=False)
        label[mask] = value
        seam &= ~mask
        m8 = mask.astype(np.uint8)
        seam |= (cv2.dilate(m8, kernel) - m8) > 0  # one pixel just outside the shape
    label[seam] = 0
    return _to_uint8(img), label


def _write_ade_split(root: str, split: str, split_code: int, num: int, size: int, seed: int,
                     bar) -> None:
    img_dir = osp.join(root, 'images', split)
    ann_dir = osp.join(root, 'annotations', split)
    os.makedirs(img_dir, exist_ok=True)
    os.makedirs(ann_dir, exist_ok=True)
    prefix = f'demo_{split}_'
    _remove_stale(img_dir, prefix, ('.jpg', ))
    _remove_stale(ann_dir, prefix, ('.png', ))
    for idx in range(num):
        rng = _image_rng(seed, split_code, idx)
        arr, label = _ade_image(rng, size)
        stem = f'{prefix}{idx:06d}'
        _save_jpg(arr, osp.join(img_dir, stem + '.jpg'))
        Image.fromarray(label, 'L').save(osp.join(ann_dir, stem + '.png'), format='PNG')
        bar.update()


def make_ade_demo(out_dir: str, num_train: int = 200, num_val: int = 50, img_size: int = 256,
                  seed: int = 0, progress: bool = True) -> dict:
    """Write a synthetic ADE20K-format semantic segmentation dataset under ``out_dir``.

    Layout: ``ADEChallengeData2016/images/{training,validation}/*.jpg`` and
    ``ADEChallengeData2016/annotations/{training,validation}/*.png`` (same stems; label values in
    ``ADE_DEMO_CLASSES`` plus 0 = unlabelled). Returns a summary dict, also saved as
    ``demo_info.json`` in ``out_dir``. Raises :class:`ForeignDataError` (before writing
    anything) if ``out_dir`` holds files this generator did not write.
    """
    if img_size < 32:
        raise ValueError('img_size must be at least 32')
    if num_train < 0 or num_val < 0:
        raise ValueError('image counts must be non-negative')
    out_dir = str(out_dir)
    marker = _start_output(out_dir, 'ade')
    root = osp.join(out_dir, 'ADEChallengeData2016')
    os.makedirs(root, exist_ok=True)
    bar = _progress(num_train + num_val, progress)
    _write_ade_split(root, 'training', 0, num_train, img_size, seed, bar)
    _write_ade_split(root, 'validation', 1, num_val, img_size, seed, bar)
    if progress and num_train + num_val > 0:
        print()
    summary = dict(
        kind='ade',
        generator=_GENERATOR,
        complete=True,
        root=out_dir,
        data_root=root,
        train_img_dir=osp.join(root, 'images', 'training'),
        train_ann_dir=osp.join(root, 'annotations', 'training'),
        val_img_dir=osp.join(root, 'images', 'validation'),
        val_ann_dir=osp.join(root, 'annotations', 'validation'),
        num_train_images=num_train,
        num_val_images=num_val,
        img_size=img_size,
        seed=seed,
        label_values={str(k): v for k, v in ADE_DEMO_CLASSES.items()})
    with open(marker, 'w') as f:
        json.dump(summary, f, indent=1)
    return summary


def ade_demo_complete(out_dir: str) -> bool:
    """Whether ``out_dir`` holds a finished ``make_ade_demo`` output (all images and labels)."""
    try:
        with open(osp.join(out_dir, _MARKER)) as f:
            info = json.load(f)
        # A marker without 'complete' predates that entry and was written only when finished.
        if info.get('kind') != 'ade' or not info.get('complete', True):
            return False
        root = osp.join(out_dir, 'ADEChallengeData2016')
        for split, key in (('training', 'num_train_images'), ('validation', 'num_val_images')):
            for idx in range(int(info[key])):
                stem = f'demo_{split}_{idx:06d}'
                if not (osp.isfile(osp.join(root, 'images', split, stem + '.jpg'))
                        and osp.isfile(osp.join(root, 'annotations', split, stem + '.png'))):
                    return False
        return True
    except (OSError, ValueError, KeyError):
        return False
