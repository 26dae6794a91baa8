"""Draw the fused model's predictions (boxes and masks, or segmentation maps) on a few
validation images with mmdet's / mmseg's own visualizer.

    python tools/visualize_predictions.py CONFIG CHECKPOINT [--num-images 4] [--score-thr 0.3]
        [--no-reparam] [--cfg-options ...] --out DIR

The model is built and loaded with mmdet's ``init_detector`` (mmseg's ``init_model``), fused
with :func:`mmslab.reparameterize` unless ``--no-reparam``, and run with mmdet's
``inference_detector`` (mmseg's ``inference_model``) on the first images of the config's
validation set. Writes one picture per image and ``predictions.png``, a grid of all of them.
"""
import argparse
import os
import os.path as osp

import mmcv
import numpy as np
from mmengine.config import DictAction
from mmengine.utils import ProgressBar

import mmslab
from mmslab.utils.launch import load_config


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('config')
    p.add_argument('checkpoint')
    p.add_argument('--num-images', type=int, default=4)
    p.add_argument('--score-thr', type=float, default=0.3,
                   help='detections below this score are not drawn')
    p.add_argument('--no-reparam', action='store_true', help='draw the unfused model')
    p.add_argument('--cfg-options', nargs='+', action=DictAction)
    p.add_argument('--out', required=True, help='output directory')
    args = p.parse_args(argv)
    if args.num_images < 1:
        p.error('--num-images must be >= 1')
    return args


def val_images(cfg, n):
    """Paths of the first ``n`` images of the validation set, via the dataset class itself."""
    from mmengine.registry import DATASETS
    ds_cfg = cfg.val_dataloader.dataset.copy()
    ds_cfg.pipeline = []
    dataset = DATASETS.build(ds_cfg)
    return [dataset.get_data_info(i)['img_path'] for i in range(min(n, len(dataset)))]


def main(argv=None):
    args = parse_args(argv)
    cfg, scope = load_config(args.config, args.cfg_options)
    cfg.model.backbone.init_cfg = None  # weights come from the checkpoint
    if scope == 'mmdet':
        from mmdet.apis import inference_detector as infer, init_detector as init
        from mmdet.registry import VISUALIZERS
    else:
        from mmseg.apis import inference_model as infer, init_model as init
        from mmseg.registry import VISUALIZERS
    model = init(cfg, args.checkpoint, device='cpu')
    if not args.no_reparam:
        mmslab.reparameterize(model.eval())
    visualizer = VISUALIZERS.build(cfg.visualizer)
    visualizer.dataset_meta = model.dataset_meta
    os.makedirs(args.out, exist_ok=True)
    paths = val_images(cfg, args.num_images)
    outputs = []
    bar = ProgressBar(len(paths))
    for path in paths:
        result = infer(model, path)
        image = mmcv.imread(path, channel_order='rgb')
        out_file = osp.join(args.out, osp.splitext(osp.basename(path))[0] + '_pred.png')
        kwargs = dict(pred_score_thr=args.score_thr) if scope == 'mmdet' else {}
        visualizer.add_datasample(osp.basename(path), image, data_sample=result, draw_gt=False,
                                  show=False, out_file=out_file, **kwargs)
        outputs.append(out_file)
        bar.update()
    grid = osp.join(args.out, 'predictions.png')
    save_grid(outputs, grid)
    print(f'\npredictions of the {"unfused" if args.no_reparam else "fused"} model: {grid}')
    return grid


def save_grid(files, path, cols=4):
    images = [mmcv.imread(f) for f in files]
    h = max(i.shape[0] for i in images)
    w = max(i.shape[1] for i in images)
    cols = min(cols, len(images))
    rows = -(-len(images) // cols)
    canvas = np.full((rows * h, cols * w, 3), 255, dtype=np.uint8)
    for k, img in enumerate(images):
        r, c = divmod(k, cols)
        canvas[r * h:r * h + img.shape[0], c * w:c * w + img.shape[1]] = img
    mmcv.imwrite(canvas, path)


if __name__ == '__main__':
    main()
