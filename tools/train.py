"""Train an mmdet or mmseg model with mmslab's components registered.

    python tools/train.py CONFIG [--work-dir DIR] [--amp [--amp-dtype {float16,bfloat16}]]
                                 [--auto-scale-lr] [--resume [CKPT]]
                                 [--cfg-options KEY=VALUE ...] [--launcher {none,pytorch,slurm,mpi}]

The config's ``default_scope`` ('mmdet' or 'mmseg') selects the codebase. ``--resume`` without a
path resumes from the latest checkpoint in the work directory. ``--amp`` trains in mixed
precision: float16 (or ``--amp-dtype bfloat16``) with mmengine's ``AmpOptimWrapper`` on a GPU,
bfloat16 with ``CPUAmpOptimWrapper`` on a CPU with bf16 units (docs/methods.md, "Precision
map"). Multi-process training:
``tools/dist_train.sh CONFIG NPROC [args]``; on a machine without CUDA the processes talk over gloo.
"""
import argparse
import logging
import os

from mmengine.config import Config, DictAction
from mmengine.logging import print_log
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

import mmslab  # noqa: F401  (registers mmslab's components)
import mmslab.engine  # noqa: F401  (weights-only checkpoint loading for mmengine)
from mmslab.engine.optim_wrapper import AMP_DTYPES, AmpConfigError, amp_optim_wrapper_cfg
from mmslab.utils import DataCheckError, check_data_root, check_dataset_classes
from mmslab.utils.launch import (add_launcher_args, export_local_rank, load_config,
                                 set_work_dir, setup_cpu_distributed,
                                 teardown_cpu_distributed)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Train an mmdet/mmseg model with mmslab')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='the directory to save logs and checkpoints')
    parser.add_argument('--amp', action='store_true',
                        help='mixed precision training: float16 autocast with loss scaling on '
                        'a GPU (AmpOptimWrapper), bfloat16 autocast on a CPU with bf16 units '
                        '(CPUAmpOptimWrapper)')
    parser.add_argument('--amp-dtype', choices=AMP_DTYPES,
                        help='autocast dtype of --amp (default: float16 on a GPU, bfloat16 on '
                        'a CPU; a CPU takes bfloat16 only)')
    parser.add_argument('--auto-scale-lr', action='store_true',
                        help='scale the learning rate with the total batch size '
                        '(uses auto_scale_lr.base_batch_size of the config)')
    parser.add_argument('--resume', nargs='?', type=str, const='auto',
                        help='resume from this checkpoint; without a path, resume from the '
                        'latest checkpoint in the work directory')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, e.g. train_cfg.max_iters=10 '
                        'key="[a,b]" or key=a,b; nested lists/tuples need quotes: '
                        'key="[(a,b),(c,d)]"')
    add_launcher_args(parser)
    args = parser.parse_args(argv)
    if args.amp_dtype and not args.amp:
        parser.error('--amp-dtype chooses the dtype of --amp; add --amp')
    export_local_rank(args)
    return args


def enable_amp(cfg: Config, dtype=None) -> None:
    """Switch ``cfg.optim_wrapper`` to the AMP wrapper of this machine (see
    :func:`mmslab.engine.optim_wrapper.amp_optim_wrapper_cfg`)."""
    from mmengine.device import get_device

    from mmslab.utils.machine import has_bf16
    if cfg.get('optim_wrapper') is None:
        raise SystemExit('error: --amp needs an optim_wrapper in the config (it trains).')
    before = cfg.optim_wrapper.get('type', 'OptimWrapper')
    try:
        wrapper = amp_optim_wrapper_cfg(cfg.optim_wrapper, get_device(), has_bf16(), dtype)
    except AmpConfigError as err:
        raise SystemExit(f'error: {err}')
    if before == wrapper['type']:
        print_log(f'AMP training is already enabled in the config ({before}).',
                  logger='current', level=logging.WARNING)
    cfg.optim_wrapper = wrapper
    print_log(f"AMP: {wrapper['type']}, {wrapper['dtype']} autocast"
              + (f", loss_scale={wrapper['loss_scale']}" if 'loss_scale' in wrapper else ''),
              logger='current')


def enable_auto_scale_lr(cfg: Config) -> None:
    auto_scale_lr = cfg.get('auto_scale_lr', None)
    if not auto_scale_lr or 'base_batch_size' not in auto_scale_lr:
        raise SystemExit('error: --auto-scale-lr needs auto_scale_lr = dict(base_batch_size=...) '
                         'in the config.')
    cfg.auto_scale_lr.enable = True


def main(argv=None):
    args = parse_args(argv)
    # launcher first, so that --cfg-options may still override it
    cfg, _ = load_config(args.config, {'launcher': args.launcher, **(args.cfg_options or {})})
    # Before the Runner: a missing dataset, or one without the config's classes, fails there
    # only late and cryptically (mmengine's "need at least one array to concatenate").
    try:
        check_data_root(cfg, 'train', args.config)
        if os.environ.get('RANK', '0') == '0':  # one reading of the annotations per job
            check_dataset_classes(cfg, 'train', args.config)
    except DataCheckError as err:
        raise SystemExit(f'error: {err}')
    set_work_dir(cfg, args.work_dir, args.config)

    if args.amp:
        enable_amp(cfg, args.amp_dtype)
    if args.auto_scale_lr:
        enable_auto_scale_lr(cfg)

    if args.resume == 'auto':
        cfg.resume = True
        cfg.load_from = None
    elif args.resume is not None:
        cfg.resume = True
        cfg.load_from = args.resume

    own_group = setup_cpu_distributed(cfg, args.launcher)

    if 'runner_type' not in cfg:
        runner = Runner.from_cfg(cfg)
    else:
        runner = RUNNERS.build(cfg)
    runner.train()
    teardown_cpu_distributed(own_group)


if __name__ == '__main__':
    main()
