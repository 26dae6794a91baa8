"""Train an mmdet or mmseg model with mmslab's components registered.

    python tools/train.py CONFIG [--work-dir DIR] [--amp] [--auto-scale-lr] [--resume [CKPT]]
                                 [--cfg-options KEY=VALUE ...] [--launcher {none,pytorch,slurm,mpi}]

The config's ``default_scope`` ('mmdet' or 'mmseg') selects the codebase. ``--resume`` without a
path resumes from the latest checkpoint in the work directory. Multi-process training:
``tools/dist_train.sh CONFIG NPROC [args]``; on a machine without CUDA the processes talk over gloo.
"""
import argparse
import logging

from mmengine.config import Config, DictAction
from mmengine.logging import print_log
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

import mmslab  # noqa: F401  (registers mmslab's components)
import mmslab.engine  # noqa: F401  (weights-only checkpoint loading for mmengine)
from mmslab.utils import DataNotFoundError, check_data_root
from mmslab.utils.launch import (add_launcher_args, export_local_rank, load_config,
                                 set_work_dir, setup_cpu_distributed,
                                 teardown_cpu_distributed)



def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Train an mmdet/mmseg model with mmslab')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='the directory to save logs and checkpoints')
    parser.add_argument('--amp', action='store_true',
                        help='enable automatic mixed precision training (needs a GPU)')
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
    export_local_rank(args)
    return args


def enable_amp(cfg: Config) -> None:
    from mmengine.device import get_device
    if get_device() == 'cpu':
        raise SystemExit('error: --amp needs a GPU (mmengine\'s AmpOptimWrapper does not run '
                         'on CPU); drop --amp on this machine.')
    optim_wrapper = cfg.optim_wrapper.get('type', 'OptimWrapper')
    if optim_wrapper == 'AmpOptimWrapper':
        print_log('AMP training is already enabled in the config.', logger='current',
                  level=logging.WARNING)
        return
    if optim_wrapper != 'OptimWrapper':
        raise SystemExit(f'error: --amp only works with optim_wrapper.type=OptimWrapper, the '
                         f'config has {optim_wrapper}.')
    cfg.optim_wrapper.type = 'AmpOptimWrapper'
    cfg.optim_wrapper.loss_scale = 'dynamic'


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
    try:
        check_data_root(cfg, 'train', args.config)
    except DataNotFoundError as err:
        raise SystemExit(f'error: {err}')
    set_work_dir(cfg, args.work_dir, args.config)

    if args.amp:
        enable_amp(cfg)
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
