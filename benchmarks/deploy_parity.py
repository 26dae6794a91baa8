"""Parity of dynamic whole-model graphs at full COCO and ADE20K sizes, in both runtimes.

    python benchmarks/deploy_parity.py [--models "mmdet Swin-T" RePa-Swin-T upernet]
        [--out work_dirs/deploy_parity]

Each model (random, normalizing weights, fused when it is mmslab's) is exported once with
free height and width, traced at one size (Mask R-CNN 800x1216, UperNet 512x512), and run in
onnxruntime and OpenVINO (fp32) at other sizes: portrait and landscape COCO test sizes, and
ADE20K whole-image sizes up to 512x2048. Each output is compared with the fused PyTorch
model's (``mmslab.deploy.compare``: detections matched by label and IoU, largest box / score
/ mask-probability differences; logits: relative error). Prints the records and writes
``deploy_parity.json``.
"""
import argparse
import json
import os
import os.path as osp
import tempfile

import torch
from mmengine.utils import ProgressBar

from deploy_speed import (MASK_RCNN_CONFIGS, MMDET_MASK_RCNN, build_upernet,
                          mmdet_config)
from mmslab.deploy import export_onnx, torch_outputs
from mmslab.deploy.compare import compare_outputs
from mmslab.deploy.runtimes import convert_to_openvino, open_model
from mmslab.utils.machine import machine_info

DETECTOR_SIZES = [(800, 1216), (1216, 800), (800, 1344), (608, 1344)]
UPERNET_SIZES = [(512, 2048), (512, 683), (683, 512)]
CHOICES = tuple(MASK_RCNN_CONFIGS) + ('upernet', )


def build(name: str):
    """(model, traced size, sizes to check)."""
    if name == 'upernet':
        return (build_upernet('configs/upernet_repa_swin_t_160k_ade20k.py', True), (512, 512),
                UPERNET_SIZES)
    config = MASK_RCNN_CONFIGS[name]
    if config == MMDET_MASK_RCNN:
        config = mmdet_config(config)
    model = build_upernet(config, name != 'mmdet Swin-T',
                          cfg_options={'model.backbone.init_cfg': None})
    return model, (800, 1216), DETECTOR_SIZES


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--models', nargs='+', choices=CHOICES,
                   default=['mmdet Swin-T', 'RePa-Swin-T', 'upernet'])
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--out', default='work_dirs/deploy_parity')
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    report = dict(machine=machine_info(), records=[])
    for name in args.models:
        model, trace, sizes = build(name)
        with tempfile.TemporaryDirectory() as tmp:
            path = osp.join(tmp, 'model.onnx')
            names = export_onnx(model, 'model', trace, path, dynamic=True)
            runtimes = dict(onnxruntime=open_model(path, 'onnxruntime', threads=args.threads),
                            openvino=open_model(convert_to_openvino(
                                path, osp.join(tmp, 'openvino')), 'openvino',
                                threads=args.threads))
            bar = ProgressBar(len(sizes))
            for size in sizes:
                x = torch.randn(1, 3, *size)
                ref = torch_outputs(model, 'model', x)
                for runtime, run in runtimes.items():
                    report['records'].append(dict(model=name, traced=list(trace),
                                                  size=list(size), runtime=runtime,
                                                  **compare_outputs(names, ref, run(x.numpy()))))
                bar.update()
            print()
    for r in report['records']:
        extra = {k: v for k, v in r.items() if k not in ('model', 'traced', 'size', 'runtime')}
        print(f"{r['model']:14s} {'x'.join(map(str, r['size'])):>9s} {r['runtime']:12s} " +
              ', '.join(f'{k} {v:.3g}' for k, v in extra.items()))
    with open(osp.join(args.out, 'deploy_parity.json'), 'w') as f:
        json.dump(report, f, indent=2)
    print(f"wrote {osp.join(args.out, 'deploy_parity.json')}")
    return report


if __name__ == '__main__':
    main()
