"""Generate the synthetic demo datasets used by the mmslab demo configs.

    python tools/make_demo_data.py                  # data/coco, data/ade/ADEChallengeData2016
    python tools/make_demo_data.py --kind coco --num-train 100 --img-size 192
    python tools/make_demo_data.py --force          # regenerate even if present

COCO goes to ``<out>/coco`` (``annotations/instances_{train,val}2017.json``,
``{train,val}2017/``), ADE20K to ``<out>/ade/ADEChallengeData2016``, matching the standard data
roots ``data/coco/`` and ``data/ade/ADEChallengeData2016``.
"""
import argparse
import os.path as osp

from mmslab.datasets.demo_data import (ade_demo_complete, coco_demo_complete,
                                       make_ade_demo, make_coco_demo)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Generate synthetic COCO / ADE20K demo data.')
    parser.add_argument('--out', default='data',
                        help='output root; COCO goes to <out>/coco, ADE20K to <out>/ade')
    parser.add_argument('--kind', choices=('coco', 'ade', 'all'), default='all')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--num-train', type=int, default=None,
                        help='training images (default: 400 for COCO, 200 for ADE20K)')
    parser.add_argument('--num-val', type=int, default=None,
                        help='validation images (default: 50)')
    parser.add_argument('--img-size', type=int, default=256, help='image side in pixels')
    parser.add_argument('--force', action='store_true',
                        help='regenerate even if a complete dataset is already present')
    parser.add_argument('--no-progress', action='store_true', help='no progress bar')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    counts = {}
    if args.num_train is not None:
        counts['num_train'] = args.num_train
    if args.num_val is not None:
        counts['num_val'] = args.num_val
    jobs = []
    if args.kind in ('coco', 'all'):
        jobs.append(('COCO', osp.join(args.out, 'coco'), coco_demo_complete, make_coco_demo,
                     lambda d: d))
    if args.kind in ('ade', 'all'):
        jobs.append(('ADE20K', osp.join(args.out, 'ade'), ade_demo_complete, make_ade_demo,
                     lambda d: osp.join(d, 'ADEChallengeData2016')))
    for name, out_dir, complete, make, data_root in jobs:
        if not args.force and complete(out_dir):
            print(f'{name} demo data already present in {data_root(out_dir)} '
                  '(kept; use --force to regenerate)')
            continue
        print(f'Generating {name} demo data in {data_root(out_dir)} ...')
        summary = make(out_dir, img_size=args.img_size, seed=args.seed,
                       progress=not args.no_progress, **counts)
        extra = ''
        if 'num_train_instances' in summary:
            extra = (f', {summary["num_train_instances"]} + {summary["num_val_instances"]} '
                     'instances')
        print(f'Wrote {name} demo data to {data_root(out_dir)}: '
              f'{summary["num_train_images"]} train + {summary["num_val_images"]} val images'
              f'{extra}')


if __name__ == '__main__':
    main()
