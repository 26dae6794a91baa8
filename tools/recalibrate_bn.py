"""Re-estimate the BatchNorm/UN running statistics of a trained mmdet or mmseg model.

    python tools/recalibrate_bn.py CONFIG CHECKPOINT --iters N --out NEW_CHECKPOINT \
        [--device cpu] [--cfg-options key=value ...]

Builds the model from the config (its ``default_scope`` picks mmdet or mmseg), loads the
checkpoint, runs N no-grad batches of the config's ``train_dataloader`` through the model with
only the BN-type layers in train mode (see ``mmslab.models.layers.bn_recalibration``), and saves
``{'state_dict': ..., 'meta': ...}``.
"""
import argparse
import os.path as osp

import torch
from mmengine.config import DictAction
from mmengine.runner import Runner, load_checkpoint

from mmslab.models.layers.bn_recalibration import recalibrate_bn
from mmslab.utils.launch import load_config, model_registry


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('config', help='mmdet or mmseg config file')
    parser.add_argument('checkpoint', help='trained checkpoint')
    parser.add_argument('--iters', type=int, required=True,
                        help='number of training batches to average the statistics over')
    parser.add_argument('--out', required=True, help='where to write the new checkpoint')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, e.g. train_dataloader.batch_size=4')
    return parser.parse_args()


def main():
    args = parse_args()
    if args.iters < 1:
        raise SystemExit('--iters must be >= 1')
    cfg, scope = load_config(args.config, args.cfg_options)
    model = model_registry(scope).build(cfg.model)
    checkpoint = load_checkpoint(model, args.checkpoint, map_location='cpu')
    model.to(args.device)
    loader = Runner.build_dataloader(cfg.train_dataloader)
    recalibrate_bn(model, loader, args.iters)

    meta = dict(checkpoint.get('meta') or {}) if isinstance(checkpoint, dict) else {}
    meta['bn_recalibration'] = dict(iters=args.iters, config=osp.abspath(args.config),
                                    source_checkpoint=osp.abspath(args.checkpoint))
    state_dict = {k: v.cpu() for k, v in model.state_dict().items()}
    torch.save({'state_dict': state_dict, 'meta': meta}, args.out)
    print(f'Wrote the re-calibrated checkpoint to {osp.abspath(args.out)}')


if __name__ == '__main__':
    main()
