"""Tests of the synthetic demo datasets (mmslab.datasets.demo_data)."""
import colorsys
import json

import numpy as np
import pytest
import torch
from PIL import Image

from mmslab.datasets import (ADE_DEMO_CLASSES, COCO_DEMO_CLASSES, ade_demo_complete,
                             coco_demo_complete, make_ade_demo, make_coco_demo)

pytestmark = [
    # pycocotools + numpy 2 and mmseg's note on LoadAnnotations(reduce_zero_label=...) are noise.
    pytest.mark.filterwarnings('ignore:.*copy keyword:DeprecationWarning'),
    pytest.mark.filterwarnings('ignore:`reduce_zero_label` will be deprecated:UserWarning'),
]

SIZE = 112
N_TRAIN, N_VAL = 6, 3


@pytest.fixture(scope='module')
def coco_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp('coco')
    make_coco_demo(str(out), num_train=N_TRAIN, num_val=N_VAL, img_size=SIZE, seed=0,
                   progress=False)
    return out


@pytest.fixture(scope='module')
def ade_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp('ade')
    make_ade_demo(str(out), num_train=N_TRAIN, num_val=N_VAL, img_size=SIZE, seed=0,
                  progress=False)
    return out


def _pixels(directory):
    return {p.name: np.asarray(Image.open(p)) for p in sorted(directory.iterdir())}


def _same_pixels(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------
# determinism
# ------------------------------------------------------------------------------------------------
def test_coco_deterministic(tmp_path, coco_dir):
    make_coco_demo(str(tmp_path / 'a'), num_train=2, num_val=N_VAL, img_size=SIZE, seed=0,
                   progress=False)
    make_coco_demo(str(tmp_path / 'b'), num_train=2, num_val=N_VAL, img_size=SIZE, seed=1,
                   progress=False)
    val_json = 'annotations/instances_val2017.json'
    ref = (coco_dir / val_json).read_bytes()
    # Same seed: byte-identical annotations and identical pixels (and the validation split does
    # not depend on the number of training images).
    assert (tmp_path / 'a' / val_json).read_bytes() == ref
    assert _same_pixels(_pixels(tmp_path / 'a' / 'val2017'), _pixels(coco_dir / 'val2017'))
    # Different seed: different data.
    assert (tmp_path / 'b' / val_json).read_bytes() != ref
    assert not _same_pixels(_pixels(tmp_path / 'b' / 'val2017'), _pixels(coco_dir / 'val2017'))
    # Full rerun into the same directory reproduces the training annotations exactly.
    train_json = coco_dir / 'annotations/instances_train2017.json'
    before, pix_before = train_json.read_bytes(), _pixels(coco_dir / 'train2017')
    make_coco_demo(str(coco_dir), num_train=N_TRAIN, num_val=N_VAL, img_size=SIZE, seed=0,
                   progress=False)
    assert train_json.read_bytes() == before
    assert _same_pixels(_pixels(coco_dir / 'train2017'), pix_before)
    assert coco_demo_complete(str(coco_dir))
    assert not coco_demo_complete(str(tmp_path / 'missing'))


def test_ade_deterministic(tmp_path, ade_dir):
    make_ade_demo(str(tmp_path / 'a'), num_train=0, num_val=N_VAL, img_size=SIZE, seed=0,
                  progress=False)
    make_ade_demo(str(tmp_path / 'b'), num_train=0, num_val=N_VAL, img_size=SIZE, seed=3,
                  progress=False)
    for sub in ('images/validation', 'annotations/validation'):
        ref = _pixels(ade_dir / 'ADEChallengeData2016' / sub)
        assert len(ref) == N_VAL
        assert _same_pixels(_pixels(tmp_path / 'a' / 'ADEChallengeData2016' / sub), ref)
        assert not _same_pixels(_pixels(tmp_path / 'b' / 'ADEChallengeData2016' / sub), ref)
    assert ade_demo_complete(str(ade_dir))
    assert not ade_demo_complete(str(tmp_path / 'missing'))


# ------------------------------------------------------------------------------------------------
# COCO
# ------------------------------------------------------------------------------------------------
def test_coco_annotations_consistent(coco_dir):
    from pycocotools.coco import COCO

    assert len(COCO_DEMO_CLASSES) >= 5
    used = set()
    for split, num in (('train', N_TRAIN), ('val', N_VAL)):
        ann_file = coco_dir / f'annotations/instances_{split}2017.json'
        raw = json.loads(ann_file.read_text())
        assert [c['id'] for c in raw['categories']] == list(range(1, len(COCO_DEMO_CLASSES) + 1))
        assert [c['name'] for c in raw['categories']] == list(COCO_DEMO_CLASSES)
        coco = COCO(str(ann_file))
        assert len(coco.getImgIds()) == num
        ann_ids = [a['id'] for a in raw['annotations']]
        assert len(set(ann_ids)) == len(ann_ids)
        for img_id in coco.getImgIds():
            img = coco.imgs[img_id]
            w, h = img['width'], img['height']
            assert (w, h) == (SIZE, SIZE)
            with Image.open(coco_dir / f'{split}2017' / img['file_name']) as pil:
                assert pil.mode == 'RGB' and pil.size == (w, h)
            anns = coco.loadAnns(coco.getAnnIds(imgIds=[img_id]))
            assert len(anns) >= 2, 'every image should hold several objects'
            masks = []
            for ann in anns:
                used.add(ann['category_id'])
                assert ann['iscrowd'] == 0 and ann['area'] > 0
                assert isinstance(ann['segmentation'], list) and ann['segmentation']
                assert all(len(p) >= 6 and len(p) % 2 == 0 for p in ann['segmentation'])
                x, y, bw, bh = ann['bbox']
                assert x >= 0 and y >= 0 and bw >= 1 and bh >= 1
                assert x + bw <= w and y + bh <= h
                mask = coco.annToMask(ann).astype(bool)
                assert mask.shape == (h, w) and mask.any()
                ys, xs = np.nonzero(mask)
                mask_box = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])
                box = np.array([x, y, x + bw, y + bh])
                assert np.abs(mask_box - box).max() <= 2, (ann, mask_box)
                # The area is the visible pixel count; the polygon raster must agree.
                assert abs(mask.sum() - ann['area']) <= max(0.2 * ann['area'], 8)
                masks.append(mask)
            # Annotations describe visible parts: instances do not share pixels (beyond the
            # one-pixel rounding of traced polygons).
            for i in range(len(masks)):
                for j in range(i + 1, len(masks)):
                    inter = (masks[i] & masks[j]).sum()
                    assert inter <= 0.1 * min(masks[i].sum(), masks[j].sum()) + 2
    assert len(used) >= 5


def test_coco_classes_separable_by_colour(coco_dir):
    """Learnability sanity check: an object's mean colour alone predicts its class."""
    from pycocotools.coco import COCO
    coco = COCO(str(coco_dir / 'annotations/instances_train2017.json'))
    feats, labels = [], []
    for img_id in coco.getImgIds():
        img = np.asarray(
            Image.open(coco_dir / 'train2017' / coco.imgs[img_id]['file_name']), np.float32)
        for ann in coco.loadAnns(coco.getAnnIds(imgIds=[img_id])):
            r, g, b = img[coco.annToMask(ann).astype(bool)].mean(0) / 255
            hue, sat, _ = colorsys.rgb_to_hsv(r, g, b)
            feats.append([np.cos(2 * np.pi * hue) * sat, np.sin(2 * np.pi * hue) * sat])
            labels.append(ann['category_id'])
    feats, labels = np.array(feats), np.array(labels)
    classes = np.unique(labels)
    centroids = np.stack([feats[labels == c].mean(0) for c in classes])
    pred = classes[np.argmin(((feats[:, None] - centroids[None]) ** 2).sum(-1), 1)]
    assert (pred == labels).mean() >= 0.9


def test_coco_loads_with_mmdet_pipeline(coco_dir):
    from mmdet.datasets import CocoDataset
    from mmengine.registry import DefaultScope

    pipeline = [
        dict(type='LoadImageFromFile'),
        dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
        dict(type='Resize', scale=(96, 96), keep_ratio=True),
        dict(type='RandomFlip', prob=0.5),
        dict(type='PackDetInputs'),
    ]
    with DefaultScope.overwrite_default_scope('mmdet'):
        dataset = CocoDataset(
            data_root=str(coco_dir), ann_file='annotations/instances_train2017.json',
            data_prefix=dict(img='train2017/'), metainfo=dict(classes=COCO_DEMO_CLASSES),
            filter_cfg=dict(filter_empty_gt=True, min_size=4), pipeline=pipeline)
    assert len(dataset) == N_TRAIN
    labels = set()
    for i in range(len(dataset)):
        out = dataset[i]
        assert tuple(out['inputs'].shape) == (3, 96, 96)
        gt = out['data_samples'].gt_instances
        assert len(gt) >= 2
        assert len(gt.masks) == len(gt) and gt.masks.to_ndarray().any(axis=(1, 2)).all()
        boxes = gt.bboxes.tensor
        assert (boxes[:, 2:] > boxes[:, :2]).all()
        assert boxes.min() >= 0 and boxes.max() <= 96
        labels.update(gt.labels.tolist())
    assert labels <= set(range(len(COCO_DEMO_CLASSES))) and len(labels) >= 4


def _coco_predictions(coco, shift_label=0):
    samples = []
    for img_id in coco.getImgIds():
        info = coco.imgs[img_id]
        anns = coco.loadAnns(coco.getAnnIds(imgIds=[img_id]))
        boxes = torch.tensor([[a['bbox'][0], a['bbox'][1], a['bbox'][0] + a['bbox'][2],
                               a['bbox'][1] + a['bbox'][3]] for a in anns], dtype=torch.float32)
        labels = torch.tensor([(a['category_id'] - 1 + shift_label) % len(COCO_DEMO_CLASSES)
                               for a in anns])
        masks = torch.from_numpy(np.stack([coco.annToMask(a).astype(bool) for a in anns]))
        samples.append(
            dict(img_id=img_id, ori_shape=(info['height'], info['width']),
                 pred_instances=dict(bboxes=boxes, scores=torch.ones(len(anns)), labels=labels,
                                     masks=masks)))
    return samples


def test_coco_evaluates_with_mmdet_metric(coco_dir):
    from mmdet.evaluation import CocoMetric
    from pycocotools.coco import COCO

    ann_file = str(coco_dir / 'annotations/instances_val2017.json')
    coco = COCO(ann_file)

    def score(shift):
        metric = CocoMetric(ann_file=ann_file, metric=['bbox', 'segm'])
        metric.dataset_meta = dict(classes=COCO_DEMO_CLASSES)
        metric.process({}, _coco_predictions(coco, shift))
        return metric.compute_metrics(metric.results)

    perfect = score(0)
    assert perfect['bbox_mAP'] >= 0.99 and perfect['segm_mAP'] >= 0.99
    wrong = score(1)  # every box gets the next class
    assert wrong['bbox_mAP'] < 0.2 and wrong['segm_mAP'] < 0.2


# ------------------------------------------------------------------------------------------------
# ADE20K
# ------------------------------------------------------------------------------------------------
def _ade_dataset(ade_dir):
    from mmengine.registry import DefaultScope
    from mmseg.datasets import ADE20KDataset

    pipeline = [
        dict(type='LoadImageFromFile'),
        dict(type='LoadAnnotations', reduce_zero_label=True),
        dict(type='PackSegInputs'),
    ]
    with DefaultScope.overwrite_default_scope('mmseg'):
        return ADE20KDataset(
            data_root=str(ade_dir / 'ADEChallengeData2016'),
            data_prefix=dict(img_path='images/validation', seg_map_path='annotations/validation'),
            pipeline=pipeline)


def test_ade_loads_with_mmseg_pipeline(ade_dir):
    dataset = _ade_dataset(ade_dir)
    assert len(dataset) == N_VAL
    names = dataset.metainfo['classes']
    for value, name in ADE_DEMO_CLASSES.items():
        assert 1 <= value <= 150 and names[value - 1].strip() == name
    allowed = {v - 1 for v in ADE_DEMO_CLASSES} | {255}
    seen = set()
    for i in range(len(dataset)):
        out = dataset[i]
        assert tuple(out['inputs'].shape) == (3, SIZE, SIZE)
        seg = out['data_samples'].gt_sem_seg.data
        assert tuple(seg.shape) == (1, SIZE, SIZE)
        values = set(torch.unique(seg).tolist())
        assert values <= allowed, values
        assert 255 in values  # the unlabelled seams (value 0) became "ignore"
        assert len(values - {255}) >= 3, 'several classes per image'
        seen |= values
    assert len(seen - {255}) >= 5


def test_ade_evaluates_with_mmseg_metric(ade_dir):
    from mmseg.evaluation import IoUMetric

    dataset = _ade_dataset(ade_dir)
    gts = [dataset[i]['data_samples'].gt_sem_seg.data for i in range(len(dataset))]

    def score(preds):
        metric = IoUMetric(iou_metrics=['mIoU'])
        metric.dataset_meta = dataset.metainfo
        metric.process({}, [dict(pred_sem_seg=dict(data=p), gt_sem_seg=dict(data=g))
                            for p, g in zip(preds, gts)])
        return metric.compute_metrics(metric.results)

    assert score(gts)['mIoU'] == pytest.approx(100.0)
    # Predict the background class everywhere the ground truth has a shape.
    wrong = []
    for g in gts:
        p = g.clone()
        p[(p != 255) & ~torch.isin(p, torch.tensor([0, 2, 3, 9]))] = 3  # -> floor
        wrong.append(p)
    assert score(wrong)['mIoU'] < 80.0
