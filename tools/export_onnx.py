"""Export the fused model to ONNX and OpenVINO, check it against PyTorch, quantize to INT8.

    python tools/export_onnx.py CONFIG CHECKPOINT --out DIR
        [--part model|features|backbone] [--no-dynamic --shape H W] [--seg-argmax]
        [--attention split|packed] [--runtime onnxruntime openvino] [--int8]
        [--calib-images N] [--eval-images N]
        [--latency HxW [--repeat N]] [--threads N] [--cfg-options ...]
    python tools/export_onnx.py CONFIG --random-weights --out DIR ...   # no checkpoint

By default the whole model (``--part model``) is exported with free height and width, so
one file serves every image the config's test pipeline produces (portrait, landscape,
ADE20K whole images):

* detectors (Mask R-CNN, RetinaNet): input ``image`` = the data preprocessor's output
  ``[1, 3, H, W]``; outputs ``dets [N, 5]`` (x1, y1, x2, y2 in the input's pixels, score),
  ``labels [N]`` and, for Mask R-CNN, ``masks [N, 28, 28]`` (RoI mask probabilities; paste
  them into the image at their boxes), after NMS;
* segmentors: ``seg_logits`` (the decode head's logits), or ``seg_label [1, H, W]`` with
  ``--seg-argmax`` (resize and argmax in the graph).

``--no-dynamic`` traces one static size (``--shape``; inputs are zero-padded to it).
``--attention`` sets how window softmax attention is laid out in the graph (``split``, the
default, or ``packed``; see docs/deployment.md); export.json records it per block, and
the head layout of each runtime's graph: ``model.onnx`` takes onnxruntime's (q, k, v
permutations it folds into its attention products), ``openvino/model.xml`` is traced again
in OpenVINO's (the multi-head transposes it fuses) where they differ.
The model is fused with ``mmslab.reparameterize``. Written to DIR: ``model.onnx``,
``openvino/model.xml``; with ``--int8`` ``model_int8.onnx`` (onnxruntime static QDQ) and
``openvino/model_int8.xml`` (NNCF), both calibrated on ``--calib-images`` images of the
training set through the test pipeline, the data preprocessor and the export's padding;
``export.json`` (written and validated by ``mmslab/deploy/export_info.py``): what was
exported from which checkpoint (SHA-256), the pre-processing, parity of each fp32 runtime
against the fused PyTorch model on test images (required; several sizes and both
orientations for dynamic exports), and the INT8 deviation on ``--eval-images`` test images
not used for calibration;
on CPUs with bf16 units also OpenVINO bf16's deviation (``bf16_on_test_images``: the fp32 IR
run with ``INFERENCE_PRECISION_HINT=bf16``, as ``tools/test.py --precision bf16`` runs it).

``--latency HxW`` times, interleaved, the fused eager model and every exported form (each
runtime's fp32, OpenVINO bf16 where the CPU has bf16 units, INT8 with ``--int8``) on one
image of that size, and records in ``export.json`` (``latency``) the medians, the machine
(CPU, ISA) and ``deploy``: the form to deploy on this machine
(:func:`mmslab.deploy.runtimes.choose_deployment`: the fastest fp32 form, replaced by a bf16
or INT8 one only where that runs at least 1.05x as fast) with the comparison behind it.
``tools/test.py --export-dir DIR`` and ``python -m mmslab.deploy.predict DIR`` run that form
unless told otherwise (:func:`mmslab.deploy.runtimes.choose_runtime_form`).
"""
import argparse
import copy
import os
import os.path as osp
import time

import numpy as np
import torch
from mmengine.config import DictAction
from mmengine.logging import print_log
from mmengine.utils import ProgressBar

import mmslab
from mmslab.deploy.compare import FP32_TOLERANCE, compare_outputs, within_fp32_tolerance
from mmslab.deploy.export_info import (is_segmentor, new_export_info, task_of,
                                       write_export_info)
from mmslab.deploy.onnx_export import (ATTENTION_LAYOUTS, DEFAULT_ATTENTION_LAYOUT, PARTS,
                                       ExportWrapper, export_runtime_graphs, onnx_size_mb,
                                       torch_outputs)
from mmslab.deploy.quantize import (calibration_images, preprocessed_images,
                                    quantize_onnxruntime, quantize_openvino)
from mmslab.deploy.runtimes import (RUNTIME_PRECISIONS, RUNTIMES, artifact_path,
                                    choose_deployment, int8_weight_bits, load_runtime_model)
from mmslab.engine.hooks.reparam_eval_hook import verify_fusion
from mmslab.utils.launch import build_model_from_config, load_config
from mmslab.utils.machine import has_bf16, machine_info


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('config')
    p.add_argument('checkpoint', nargs='?', help='the weights to export')
    p.add_argument('--random-weights', action='store_true',
                   help='export without a checkpoint (random, normalizing weights: for '
                   'timing and tests only)')
    p.add_argument('--out', required=True, help='output directory')
    p.add_argument('--part', choices=PARTS, default='model',
                   help='model (default: the whole detector / segmentor), features '
                   '(detector backbone + neck), backbone')
    p.add_argument('--dynamic', action=argparse.BooleanOptionalAction, default=True,
                   help='free height and width (default); --no-dynamic: one static size')
    p.add_argument('--shape', nargs=2, type=int, metavar=('H', 'W'),
                   help='the traced input size (the static size with --no-dynamic; default '
                   '800 1344 for detectors, 512 512 for segmentors)')
    p.add_argument('--attention', choices=ATTENTION_LAYOUTS, default=DEFAULT_ATTENTION_LAYOUT,
                   help='layout of window softmax attention in the graph: split (default; '
                   'q, k, v as separate MatMuls in the multi-head pattern OpenVINO fuses) or '
                   'packed (one qkv MatMul and a 5-D transpose). Recorded in export.json')
    p.add_argument('--seg-argmax', action='store_true',
                   help='segmentors: resize the logits to the input and argmax in the graph')
    p.add_argument('--runtime', nargs='+', choices=RUNTIMES, default=list(RUNTIMES))
    p.add_argument('--int8', action='store_true', help='also write INT8 models')
    p.add_argument('--int8-weight-bits', type=int, choices=(7, 8), default=None,
                   help='onnxruntime INT8 weight bits (default: 8 on CPUs with VNNI or AMX, '
                   '7 on others, whose u8 x s8 products saturate with 8-bit weights; give 7 '
                   'for a model that will run on such a CPU)')
    p.add_argument('--calib-images', type=int, default=8,
                   help='INT8 calibration images (from the config\'s training set)')
    p.add_argument('--eval-images', type=int, default=4,
                   help='test-set images for the parity check and the INT8 deviation')
    p.add_argument('--latency', metavar='HxW',
                   help='also time, per image at this size, the fused model in eager PyTorch '
                   "(its own predict) and every exported form (interleaved; JSON 'latency') "
                   "and record the form to deploy on this machine ('latency.deploy')")
    p.add_argument('--repeat', type=int, default=5, help='timed calls per form (--latency)')
    p.add_argument('--threads', type=int, default=None, help='torch/runtime threads')
    p.add_argument('--cfg-options', nargs='+', action=DictAction)
    args = p.parse_args(argv)
    if args.checkpoint and args.random_weights:
        p.error('give a CHECKPOINT or --random-weights, not both')
    if not args.checkpoint and not args.random_weights:
        p.error('no CHECKPOINT: pass the weights to export, or --random-weights to export a '
                'randomly initialized model on purpose')
    if args.checkpoint and not osp.isfile(args.checkpoint):
        p.error(f'checkpoint {args.checkpoint} not found')
    if args.shape and (args.shape[0] % 32 or args.shape[1] % 32):
        p.error(f'--shape {args.shape[0]} {args.shape[1]}: height and width must be multiples '
                'of 32 (what the data preprocessors pad to)')
    if args.calib_images < 1 or args.eval_images < 1:
        p.error('--calib-images and --eval-images must be >= 1')
    return args


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
        print_log('exporting RANDOM weights (--random-weights): the outputs mean nothing',
                  logger='current', level=30)
        model.init_weights()
        condition_random_weights(model.eval(), shape)
    unfused = copy.deepcopy(model)
    mmslab.reparameterize(model)
    return cfg, model, shape, unfused


def test_images(cfg, model, args, shape):
    """Real inputs for the parity check: test-set images through the test pipeline (and,
    for a dynamic export, each one transposed too: the other orientation); random images if
    the config's data is not there."""
    static = None if args.dynamic else shape
    try:
        images = preprocessed_images(cfg, model, args.eval_images, 'test', static)
        source = 'test set'
    except (FileNotFoundError, RuntimeError, ValueError) as err:
        print_log(f'parity on random images ({err})', logger='current', level=30)
        images = [np.random.default_rng(i).standard_normal((1, 3, *shape)).astype(np.float32)
                  for i in range(args.eval_images)]
        source = 'random'
    if args.dynamic:  # other sizes and both orientations: a narrow crop and its transpose
        first = images[0]
        narrow = first[..., :max(32, first.shape[-1] // 64 * 32)]
        images += [narrow, np.ascontiguousarray(narrow.transpose(0, 1, 3, 2)),
                   np.ascontiguousarray(first.transpose(0, 1, 3, 2))]
    return images, source


def measure_latency(model, part, args) -> dict:
    """Median ms per image at ``--latency`` of the fused eager model (mmdet's / mmseg's own
    ``predict`` for part ``model``) and of each exported form, interleaved."""
    from mmslab.benchmark import (fake_batch, make_runners, measure_interleaved, parse_shape,
                                  summarize)
    shape = parse_shape(args.latency)
    inputs, _ = fake_batch(model, shape)  # padded to 32, as the data preprocessor does
    if not args.dynamic and list(inputs.shape[-2:]) != list(args.shape or []):
        raise SystemExit(f'error: --latency {args.latency} needs a dynamic export or '
                         f'--shape {inputs.shape[-2]} {inputs.shape[-1]}')
    image = inputs.numpy()
    eager = make_runners(model, shape, 'model' if part == 'model' else 'backbone') \
        if part != 'features' else (lambda: model.extract_feat(inputs))
    fns = {'eager fp32': eager}
    for runtime in args.runtime:
        runs = dict(bf16=has_bf16(), int8=args.int8)  # what this CPU and export allow
        for precision in [p for p in RUNTIME_PRECISIONS[runtime] if runs.get(p, True)]:
            m = load_runtime_model(args.out, runtime, precision, args.threads or 0)
            fns[f'{runtime} {precision}'] = lambda m=m: m(image)
    bar = ProgressBar(len(fns) * args.repeat)
    times = measure_interleaved(fns, args.repeat, 1, bar.update)
    print()
    out = dict(shape=args.latency, input=list(inputs.shape[-2:]), repeat=args.repeat,
               median_ms={k: summarize(v)['median_ms'] for k, v in times.items()},
               machine=machine_info('cpu'))
    for k, ms in out['median_ms'].items():
        print(f'latency {args.latency} {k:18s} {ms:9.1f} ms')
    out['deploy'] = choose_deployment(out['median_ms'])
    print(f"deploy: {out['deploy']['runtime']} {out['deploy']['precision']} "
          f"({out['deploy']['reason']})")
    return out


def size_key(image, index: int) -> str:
    return f"{index}: {'x'.join(map(str, image.shape[-2:]))}"


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    cfg, model, shape, unfused = build(args)
    images, source = test_images(cfg, model, args, shape)
    try:  # the fold itself, before anything is exported from it (float32, one image)
        verify_fusion(unfused, model, [torch.from_numpy(images[0])])
    except RuntimeError as err:
        raise SystemExit(f'error: {err}') from None
    del unfused
    part = args.part
    try:
        ExportWrapper(model, part, args.seg_argmax)  # refuses what does not apply
    except ValueError as err:
        raise SystemExit(f'error: {err}')
    onnx_path = osp.join(args.out, 'model.onnx')
    print_log(f"exporting {part} of the fused model ({'dynamic H, W' if args.dynamic else 'static'}"
              f', traced at {shape[0]}x{shape[1]}) to {onnx_path}', logger='current')
    t0 = time.perf_counter()
    # (OpenVINO's IR comes from a graph in its own head layout: export_runtime_graphs)
    names, attention = export_runtime_graphs(
        model, part, shape, args.out, args.runtime, dynamic=args.dynamic,
        seg_argmax=args.seg_argmax, attention=args.attention)
    export_s = time.perf_counter() - t0
    # (the model section's digest is of the config as written: building a model mutates it)
    report = new_export_info(
        cfg, load_config(args.config, args.cfg_options)[0], config=args.config,
        checkpoint=args.checkpoint, part=part, task=task_of(model), outputs=names,
        shape=shape, dynamic=args.dynamic, seg_argmax=args.seg_argmax,
        attention=attention,
        precisions=['fp32'] + (['int8'] if args.int8 else []), tolerance=FP32_TOLERANCE,
        export_seconds=round(export_s, 1), runtimes={})
    report['onnx_mb'] = onnx_size_mb(onnx_path)

    if args.int8:
        calib = calibration_images(cfg, model, args.calib_images,
                                   None if args.dynamic else shape)
        weight_bits = args.int8_weight_bits or int8_weight_bits()
        report['int8'] = dict(calibration_images=len(calib), calibration_set='train',
                              onnxruntime_weight_bits=weight_bits,
                              quantized='MatMul/Gemm/Conv layers with weights (onnxruntime: '
                              'per-channel s8 weights (7-bit where onnxruntime_weight_bits '
                              'says so), u8 activations, MatMul outputs float '
                              '(MatMulIntegerToFloat); '
                              'OpenVINO: NNCF transformer preset, which also quantizes '
                              'the inputs of attention products and depth-wise convs); '
                              'onnxruntime keeps depth-wise convs and attention products '
                              'float; softmax, norms, NMS, RoIAlign stay float in both')
        if 'onnxruntime' in args.runtime:
            quantize_onnxruntime(onnx_path, artifact_path(args.out, 'onnxruntime', 'int8'),
                                 calib, weight_bits=weight_bits)
        if 'openvino' in args.runtime:
            quantize_openvino(artifact_path(args.out, 'openvino', 'fp32'),
                              artifact_path(args.out, 'openvino', 'int8'), calib)

    report['parity_images'] = dict(source=source,
                                   sizes=['x'.join(map(str, im.shape[-2:])) for im in images])
    refs = [torch_outputs(model, part, torch.from_numpy(im), args.seg_argmax) for im in images]
    bar = ProgressBar(len(args.runtime) * (1 + bool(args.int8)))
    failures = []
    for runtime in args.runtime:
        entry = report['runtimes'].setdefault(runtime, {})
        fp32 = load_runtime_model(args.out, runtime, 'fp32', args.threads or 0)
        entry['fp32'] = {}
        for i, (im, ref) in enumerate(zip(images, refs)):
            record = compare_outputs(names, ref, fp32(im))
            entry['fp32'][size_key(im, i)] = record
            if not within_fp32_tolerance(record):
                failures.append(f'{runtime} fp32 on image {size_key(im, i)}: {record}')
        bar.update()
        if args.int8:
            int8 = load_runtime_model(args.out, runtime, 'int8', args.threads or 0)
            entry['int8_on_test_images'] = {
                size_key(im, i): compare_outputs(names, ref, int8(im))
                for i, (im, ref) in enumerate(zip(images, refs))}
            bar.update()
        if runtime == 'openvino' and has_bf16():  # bf16 computes the fp32 IR: its deviation
            bf16 = load_runtime_model(args.out, runtime, 'bf16', args.threads or 0)
            entry['bf16_on_test_images'] = {
                size_key(im, i): compare_outputs(names, ref, bf16(im))
                for i, (im, ref) in enumerate(zip(images, refs))}
    print()
    if args.latency:
        report['latency'] = measure_latency(model, part, args)
    info_path = write_export_info(args.out, report)
    for runtime, entry in report['runtimes'].items():
        for precision in ('fp32', 'int8_on_test_images', 'bf16_on_test_images'):
            for size, record in entry.get(precision, {}).items():
                print(f'{runtime:12s} {precision[:4]} {size:>14s} ' +
                      ', '.join(f'{k} {v:.4g}' for k, v in record.items()))
    print(f"wrote {onnx_path} ({report['onnx_mb']:.1f} MB) and {info_path}")
    if failures:
        raise SystemExit('error: the exported model differs from the fused PyTorch model: ' +
                         '; '.join(failures))
    return report


if __name__ == '__main__':
    main()
