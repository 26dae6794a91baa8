"""Generate the synthetic demo datasets used by the mmslab demo configs.

    python tools/make_demo_data.py                  # data/mmslab_demo/{coco,ade}
    python tools/make_demo_data.py --kind coco --num-train 100 --img-size 192
    python tools/make_demo_data.py --force          # regenerate a demo set made earlier

COCO goes to ``<out>/coco`` (``annotations/instances_{train,val}2017.json``,
``{train,val}2017/``), ADE20K to ``<out>/ade/ADEChallengeData2016``. The default ``<out>``,
``data/mmslab_demo``, is the root the demo configs (configs/demo/) read; it is apart from the
standard roots ``data/coco/`` and ``data/ade/`` where the real datasets live.

Nothing is written unless every folder it would write into is new, empty, or holds an earlier
output of this tool (its ``demo_info.json`` and only its files); ``<out>`` itself may hold
nothing but ``coco/`` and ``ade/``. Otherwise it stops with an error that names the folder,
also with ``--force``: a real dataset is never replaced or mixed with synthetic files.
"""
import argparse
import os
import os.path as osp

from mmslab.datasets.demo_data import (DEMO_DATA_ROOT, ForeignDataError, ade_demo_complete,
                                       check_demo_target, coco_demo_complete, make_ade_demo,
                                       make_coco_demo)

#: The folder of each kind under ``--out``.
SUBDIRS = {'coco': 'coco', 'ade': 'ade'}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Generate synthetic COCO / ADE20K demo data.')
    parser.add_argument('--out', default=DEMO_DATA_ROOT,
                        help='output root; COCO goes to <out>/coco, ADE20K to <out>/ade '
                        f'(default: {DEMO_DATA_ROOT}, where the demo configs read them). It '
                        'must be new, empty or hold only demo sets this tool wrote')
    parser.add_argument('--kind', choices=('coco', 'ade', 'all'), default='all')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--num-train', type=int, default=None,
                        help='training images (default: 400 for COCO, 200 for ADE20K)')
    parser.add_argument('--num-val', type=int, default=None,
                        help='validation images (default: 50)')
    parser.add_argument('--img-size', type=int, default=256, help='image side in pixels')
    parser.add_argument('--force', action='store_true',
                        help='regenerate a demo set this tool wrote earlier even if it is '
                        'complete (never overwrites files it did not write)')
    parser.add_argument('--no-progress', action='store_true', help='no progress bar')
    return parser.parse_args(argv)


def check_out_root(root: str) -> None:
    """Raise :class:`ForeignDataError` if ``root`` holds anything but the demo folders.

    ``--out data`` (or any folder of real datasets) would otherwise put demo sets beside the
    real ones under names that configs of real data may read.
    """
    if not osp.lexists(root):
        return
    if not osp.isdir(root):
        raise ForeignDataError(f'refusing to write demo data into {root} '
                               f'({osp.abspath(root)}): it is a file, not a folder. Nothing '
                               'was written. Pick another --out.')
    with os.scandir(root) as entries:
        foreign = sorted(e.name + ('/' if e.is_dir() else '') for e in entries
                         if e.name not in SUBDIRS.values() or not e.is_dir())
    if foreign:
        shown = ', '.join(osp.join(root, name) for name in foreign[:3])
        raise ForeignDataError(
            f'refusing to write demo data into {root} ({osp.abspath(root)}): it holds '
            f'{len(foreign)} entr{"y" if len(foreign) == 1 else "ies"} this tool did not make '
            f'({shown}{", ..." if len(foreign) > 3 else ""}); its output root holds only '
            f'{" and ".join(d + "/" for d in SUBDIRS.values())}. Nothing was written (also not '
            f'with --force). Pick a new or empty --out (default: {DEMO_DATA_ROOT}).')


def main(argv=None):
    args = parse_args(argv)
    counts = {}
    if args.num_train is not None:
        counts['num_train'] = args.num_train
    if args.num_val is not None:
        counts['num_val'] = args.num_val
    jobs = []
    if args.kind in ('coco', 'all'):
        jobs.append(('COCO', 'coco', coco_demo_complete, make_coco_demo, lambda d: d))
    if args.kind in ('ade', 'all'):
        jobs.append(('ADE20K', 'ade', ade_demo_complete, make_ade_demo,
                     lambda d: osp.join(d, 'ADEChallengeData2016')))
    # Every target is checked before the first file is written, so a refusal leaves no
    # half-made set behind.
    try:
        check_out_root(args.out)
        for _, kind, _, _, _ in jobs:
            check_demo_target(osp.join(args.out, SUBDIRS[kind]), kind)
    except ForeignDataError as err:
        raise SystemExit(f'error: {err}')
    for name, kind, complete, make, data_root in jobs:
        out_dir = osp.join(args.out, SUBDIRS[kind])
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
