"""Export the fused model to ONNX, check it in onnxruntime and OpenVINO, quantize it to INT8.

    python tools/export_onnx.py CONFIG [CHECKPOINT] --out DIR [--shape H W] [--dynamic]
        [--part backbone|features|model] [--runtime onnxruntime openvino] [--int8]
        [--calib-images N] [--threads N] [--cfg-options ...]

Without CHECKPOINT the model has random weights (the config's init_cfg is ignored), made
realistic for the parity check: RepBN ``alpha`` 0 and BatchNorm statistics estimated on a few
random images, so activations are normalized as in a trained model (a default-initialized
RepBN passes its raw input on, activations grow with depth and fp32 comparisons lose their
meaning). The model is fused with ``mmslab.reparameterize`` and exported with
``torch.onnx.export`` (opset 18). Written to DIR:

* ``model.onnx`` (and ``model_int8.onnx`` with ``--int8``: onnxruntime static QDQ
  quantization, per-channel weights, calibrated on ``--calib-images`` images of the config's
  training set);
* ``openvino/model.xml`` (and ``openvino/model_int8.xml``: NNCF post-training quantization on
  the same images);
* ``export.json``: shapes, parity of every runtime against the fused PyTorch model (relative
  error, required <= 1e-4 for fp32), the INT8 models' deviation, sizes and the machine.

Parts: ``backbone``; ``features`` (detectors: backbone + neck; the heads stay in PyTorch, see
``mmslab/deploy/onnx_export.py``); ``model`` (segmentors: logits). Swin window layouts are
constants of the input size, so ``--dynamic`` is refused for Swin-type backbones: export one
file per input size.
"""
import argparse
import json
import os
import os.path as osp

import torch
from mmdet.models.backbones import SwinTransformer as MMDetSwinTransformer
from mmengine.config import DictAction
from mmengine.logging import print_log
from mmengine.utils import ProgressBar
from mmseg.models.backbones import SwinTransformer as MMSegSwinTransformer

import mmslab
from mmslab.deploy import (PARTS, RUNTIMES, ExportWrapper, artifact_path, calibration_images,
                           convert_to_openvino, export_onnx, load_runtime_model,
                           max_relative_error, quantize_onnxruntime, quantize_openvino,
                           torch_outputs)
from mmslab.deploy.onnx_export import onnx_size_mb
from mmslab.models import ReparamSwinTransformer
from mmslab.utils.launch import build_model_from_config
from mmslab.utils.machine import machine_info

#: Backbones whose (shifted) window layout is a constant of the input size.
SWIN_BACKBONES = (ReparamSwinTransformer, MMDetSwinTransformer, MMSegSwinTransformer)

PARITY_TOL = 1e-4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('config')
    p.add_argument('checkpoint', nargs='?', help='weights (default: random, see above)')
    p.add_argument('--out', required=True, help='output directory')
    p.add_argument('--shape', nargs=2, type=int, metavar=('H', 'W'),
                   help='input size (default: 800 1344 for detectors, 512 512 for segmentors)')
    p.add_argument('--dynamic', action='store_true', help='free height and width')
    p.add_argument('--part', choices=PARTS,
                   help='default: features (detectors), model (segmentors)')
    p.add_argument('--runtime', nargs='+', choices=RUNTIMES, default=list(RUNTIMES))
    p.add_argument('--int8', action='store_true', help='also write INT8 models')
    p.add_argument('--calib-images', type=int, default=8,
                   help='calibration images for INT8 (from the config\'s training set)')
    p.add_argument('--threads', type=int, default=None, help='torch/runtime threads')
    p.add_argument('--cfg-options', nargs='+', action=DictAction)
    args = p.parse_args(argv)
    if args.shape and (args.shape[0] % 32 or args.shape[1] % 32):
        p.error(f'--shape {args.shape[0]} {args.shape[1]}: height and width must be multiples '
                'of 32 (what the data preprocessors pad to)')
    if args.calib_images < 1:
        p.error('--calib-images must be >= 1')
    return args


def is_segmentor(model) -> bool:
    return hasattr(model, 'decode_head')


def condition_random_weights(model, shape, iters: int = 4) -> None:
    """RepBN alpha 0 and BN statistics of random images: a normalizing random model."""
    from mmslab.models.layers.bn_recalibration import recalibrate_bn
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith('.alpha'):
                p.zero_()
    backbone = model.backbone
    images = [torch.randn(1, 3, *shape) for _ in range(iters)]
    recalibrate_bn(backbone, images, iters, logger='silent')
    model.eval()


def build(args):
    cfg, model = build_model_from_config(args.config, args.cfg_options)
    shape = tuple(args.shape or ((512, 512) if is_segmentor(model) else (800, 1344)))
    if args.checkpoint:
        from mmengine.runner import load_checkpoint
        load_checkpoint(model, args.checkpoint, map_location='cpu', strict=True,
                        logger='current')
        model.eval()
    else:
        model.init_weights()
        condition_random_weights(model.eval(), shape)
    mmslab.reparameterize(model)
    return cfg, model, shape


def check_dynamic_supported(model) -> None:
    if isinstance(model.backbone, SWIN_BACKBONES):
        raise SystemExit(
            'error: --dynamic is not supported for Swin-type backbones: the (shifted) window '
            'layout is a constant of the input size. Export one model per input size.')


def parity(model, part, runtime_model, shape) -> float:
    image = torch.randn(1, 3, *shape)
    ref = torch_outputs(model, part, image)
    return max_relative_error(ref, runtime_model(image.numpy()))


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    cfg, model, shape = build(args)
    part = args.part or ('model' if is_segmentor(model) else 'features')
    try:
        ExportWrapper(model, part)  # refuses a part the model does not have
    except ValueError as err:
        raise SystemExit(f'error: {err}')
    if args.dynamic:
        check_dynamic_supported(model)
    onnx_path = osp.join(args.out, 'model.onnx')
    print_log(f'exporting {part} of the fused model at {shape[0]}x{shape[1]} to {onnx_path}',
              logger='current')
    names = export_onnx(model, part, shape, onnx_path, dynamic=args.dynamic)
    shapes = [shape]
    if args.dynamic:
        shapes.append((shape[0] + 64, shape[1] - 32 if shape[1] > 64 else shape[1] + 32))
    report = dict(config=args.config, checkpoint=args.checkpoint, part=part,
                  shape=list(shape), dynamic=args.dynamic, outputs=names,
                  machine=machine_info(), tolerance=PARITY_TOL, runtimes={})
    report['onnx_mb'] = onnx_size_mb(onnx_path)

    if 'openvino' in args.runtime:
        convert_to_openvino(onnx_path, osp.join(args.out, 'openvino'))

    calib = None
    if args.int8:
        calib = calibration_images(cfg, model, args.calib_images,
                                   None if args.dynamic else shape)
        if 'onnxruntime' in args.runtime:
            quantize_onnxruntime(onnx_path, artifact_path(args.out, 'onnxruntime', True), calib)
        if 'openvino' in args.runtime:
            quantize_openvino(artifact_path(args.out, 'openvino', False),
                              artifact_path(args.out, 'openvino', True), calib)

    bar = ProgressBar(len(args.runtime) * (1 + bool(args.int8)))
    failures = []
    for runtime in args.runtime:
        entry = report['runtimes'].setdefault(runtime, {})
        fp32 = load_runtime_model(args.out, runtime, False, args.threads or 0)
        entry['fp32_max_relative_error'] = {
            'x'.join(map(str, s)): parity(model, part, fp32, s) for s in shapes}
        for s, err in entry['fp32_max_relative_error'].items():
            if err > PARITY_TOL:
                failures.append(f'{runtime} fp32 at {s}: relative error {err:.3g}')
        bar.update()
        if args.int8:
            int8 = load_runtime_model(args.out, runtime, True, args.threads or 0)
            image = torch.from_numpy(calib[0]) if calib[0].shape[-2:] == shape else \
                torch.randn(1, 3, *shape)
            ref = torch_outputs(model, part, image)
            entry['int8_max_relative_deviation'] = max_relative_error(ref, int8(image.numpy()))
            bar.update()
    print()
    with open(osp.join(args.out, 'export.json'), 'w') as f:
        json.dump(report, f, indent=2)
    for runtime, entry in report['runtimes'].items():
        line = ', '.join(f'{s}: {e:.2g}' for s, e in entry['fp32_max_relative_error'].items())
        extra = ''
        if 'int8_max_relative_deviation' in entry:
            extra = f"; INT8 deviates by {entry['int8_max_relative_deviation']:.3g}"
        print(f'{runtime:12s} fp32 parity (max relative error) {line}{extra}')
    print(f"wrote {onnx_path} ({report['onnx_mb']:.1f} MB) and {osp.join(args.out, 'export.json')}")
    if failures:
        raise SystemExit('error: the exported model differs from the fused PyTorch model: ' +
                         '; '.join(failures))
    return report


if __name__ == '__main__':
    main()
