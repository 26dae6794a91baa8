"""Convert an ImageNet checkpoint (SLAB, RePaViT, official/timm Swin, official PVT v1) into an
mmslab backbone checkpoint.

    python tools/convert_checkpoint.py SRC DST [--format auto|slab|repavit|swin|timm|pvt|mmslab]
        [--arch NAME] [--reset-schedule]

SRC may be ``{'model': ...}``, ``{'state_dict': ...}`` or a bare state dict; it is read with
``weights_only=True``. Entries holding other pickled objects (the SLAB authors' yacs ``config``,
RePaViT's ``argparse`` ``args``) are ignored and logged, never executed; a file whose tensors
cannot be read that way is refused (see docs/checkpoint_formats.md). The backbone is built from
``--arch`` (e.g. prepbn_swin_t, slab_swin_t, slab_swin_s, repa_swin_t/s/b, prepbn_pvt_t/s/m,
slab_pvt_t, swin_t) or inferred from the keys, and the converted weights must load into it
strictly (only output norms and relative-position indices, which classification checkpoints
do not have, keep their initial values). DST is ``{'state_dict': ..., 'meta': ...}``; use it as
``init_cfg=dict(type='Pretrained', checkpoint=DST)``.

The authors' progressive norms carry their schedule over (a finished LN -> RepBN decay stays
finished); ``--reset-schedule`` restarts it.
"""
import argparse
import pickle
import re
import sys

from mmslab.models.checkpoint_utils import convert_checkpoint_file
from mmslab.models.converters import ARCHS, FORMATS


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0].replace('\n', ' '))
    parser.add_argument('src', help='source checkpoint')
    parser.add_argument('dst', help='where to write the mmslab backbone checkpoint')
    parser.add_argument('--format', default='auto', choices=('auto', ) + FORMATS,
                        help='source layout (default: detect it from the keys)')
    parser.add_argument('--arch', default=None, choices=sorted(ARCHS),
                        help='target architecture (default: inferred from the keys)')
    parser.add_argument('--reset-schedule', action='store_true',
                        help='restart progressive LN -> RepBN schedules (schedule_offset = 0)')
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        convert_checkpoint_file(args.src, args.dst, fmt=args.format, arch=args.arch,
                                reset_schedule=args.reset_schedule)
    except pickle.UnpicklingError as err:
        text = str(err)
        found = re.search(r'GLOBAL (\S+)', text)
        reasons = ([f'unsupported global {found.group(1)}'] if found else []) + \
            [ln.strip() for ln in text.splitlines() if ln.startswith('mmslab could not read')]
        print(f'error: {args.src} holds pickled objects that cannot be read without executing '
              f'code from the file, and is refused{": " if reasons else ""}{"; ".join(reasons)}',
              file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, TypeError) as err:
        print(f'error: {err}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
