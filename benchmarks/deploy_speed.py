"""Backbone latency in every runtime: PyTorch eager, onnxruntime fp32 / INT8, OpenVINO fp32 /
INT8, for mmdet's LayerNorm Swin-T and the fused mmslab T presets, interleaved in one run.

    python benchmarks/deploy_speed.py [--shapes 512x512 800x1344] [--repeat 3] [--threads 2]
        [--models ...] [--runtimes ...] [--upernet] --out work_dirs/deploy_speed

Every model is exported once per shape (static shapes, ``torch.onnx.export``, opset 18),
converted to OpenVINO, and quantized for each runtime on its own path (onnxruntime static
QDQ per-channel; NNCF for OpenVINO) with ``--calib-images`` random images (latency does not
depend on the calibration data; accuracy is measured by tools/test.py --backend ... --int8).
Then all (model, runtime) pairs run interleaved, batch 1. ``--upernet`` adds whole-model rows
(logits) of UperNet with fused RePa-Swin-T against UperNet with the LayerNorm Swin-T, at
512x512. Prints a table and the project's targets, writes ``deploy_speed.json`` and
``deploy_speed.png``; the JSON records the CPU, ISA level and BLAS.
"""
import argparse
import gc
import json
import os
import os.path as osp
import shutil
import tempfile

import numpy as np
import torch
from mmengine.utils import ProgressBar

import mmslab
from mmslab.benchmark import measure_interleaved, parse_shape, summarize
from mmslab.deploy import (convert_to_openvino, export_onnx, quantize_onnxruntime,
                           quantize_openvino)
from mmslab.deploy.runtimes import OnnxRuntimeModel, OpenVINOModel
from mmslab.models.layers.window_attention import window_softmax_choices
from mmslab.utils.allocator import add_allocator_argument, set_allocator_mode
from mmslab.utils.machine import machine_info, machine_line
from mmslab.utils.plotting import grouped_bars, saved_figure

MODELS = ('mmdet Swin-T', 'PRepBN-Swin-T', 'SLAB-Swin-T', 'RePa-Swin-T')
RUNTIMES = ('eager', 'ort fp32', 'ort int8', 'ov fp32', 'ov int8')
BASELINE = 'mmdet Swin-T'


def build_backbone(name: str) -> torch.nn.Module:
    """A backbone with realistic random weights, fused when it is an mmslab model."""
    from mmdet.models.backbones import SwinTransformer
    from mmslab.models import PRepBNSwin, RePaSwin, SLABSwin
    from mmslab.models.layers.bn_recalibration import recalibrate_bn
    torch.manual_seed(0)
    if name == 'mmdet Swin-T':
        model = SwinTransformer()
        model.init_weights()
        model.eval()  # mmdet's Swin.train() returns None: no chaining
        return model
    model = {'PRepBN-Swin-T': PRepBNSwin, 'SLAB-Swin-T': SLABSwin,
             'RePa-Swin-T': RePaSwin}[name]()
    model.init_weights()
    with torch.no_grad():  # alpha 0 + BN statistics of real activations: a normalizing model
        for pname, p in model.named_parameters():
            if pname.endswith('.alpha'):
                p.zero_()
    recalibrate_bn(model, [torch.randn(1, 3, 224, 224) for _ in range(2)], 2, logger='silent')
    return mmslab.reparameterize(model.eval())


def build_upernet(config: str, fuse: bool) -> torch.nn.Module:
    from mmengine.logging import MMLogger
    from mmslab.utils.launch import build_model_from_config
    _, model = build_model_from_config(config)
    logger = MMLogger.get_current_instance()
    level = logger.level
    logger.setLevel('WARNING')  # init_weights logs every parameter at INFO
    try:
        model.init_weights()
    finally:
        logger.setLevel(level)
    model.eval()
    if fuse:
        mmslab.reparameterize(model)
    return model


def deploy_forms(model, part, shape, runtimes, workdir, threads, calib_images):
    """{runtime: callable(image)} for one model and input shape."""
    os.makedirs(workdir, exist_ok=True)
    onnx_path = osp.join(workdir, 'model.onnx')
    needs_onnx = any(r != 'eager' for r in runtimes)
    if needs_onnx:
        export_onnx(model, part, shape, onnx_path)
    calib = [np.random.RandomState(i).randn(1, 3, *shape).astype(np.float32)
             for i in range(calib_images)]
    forms = {}
    x = torch.randn(1, 3, *shape)
    if 'eager' in runtimes:
        module = model
        forms['eager'] = lambda: module(x)
    image = x.numpy()
    if 'ort fp32' in runtimes:
        m = OnnxRuntimeModel(onnx_path, threads)
        forms['ort fp32'] = lambda m=m: m(image)
    if 'ort int8' in runtimes:
        q = quantize_onnxruntime(onnx_path, osp.join(workdir, 'model_int8.onnx'), calib)
        m = OnnxRuntimeModel(q, threads)
        forms['ort int8'] = lambda m=m: m(image)
    if 'ov fp32' in runtimes or 'ov int8' in runtimes:
        xml = convert_to_openvino(onnx_path, osp.join(workdir, 'openvino'))
        if 'ov fp32' in runtimes:
            m = OpenVINOModel(xml, threads)
            forms['ov fp32'] = lambda m=m: m(image)
        if 'ov int8' in runtimes:
            q = quantize_openvino(xml, osp.join(workdir, 'openvino', 'model_int8.xml'), calib)
            m = OpenVINOModel(q, threads)
            forms['ov int8'] = lambda m=m: m(image)
    return forms


def targets(res: dict, runtimes) -> list:
    """The issue's targets, evaluated on one shape's medians {(model, runtime): ms}."""
    out = []

    def ms(model, runtime):
        return res.get((model, runtime))

    for rt in ('ort int8', 'ov int8'):
        a, b = ms(BASELINE, rt), ms('RePa-Swin-T', rt)
        if a and b:
            out.append(dict(what=f'mmdet Swin-T / RePa-Swin-T fused, {rt}', ratio=a / b,
                            target=1.4))
    best = [(ms('RePa-Swin-T', rt), rt) for rt in runtimes if ms('RePa-Swin-T', rt)]
    if best and ms(BASELINE, 'eager'):
        t, rt = min(best)
        out.append(dict(what=f'mmdet Swin-T eager / RePa-Swin-T best ({rt})',
                        ratio=ms(BASELINE, 'eager') / t, target=3.0))
    for model in ('PRepBN-Swin-T', 'SLAB-Swin-T'):
        for rt in runtimes:
            a, b = ms(BASELINE, rt), ms(model, rt)
            if a and b:
                out.append(dict(what=f'mmdet Swin-T / {model} fused, {rt}', ratio=a / b,
                                target=1.0))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--shapes', nargs='+', default=['512x512', '800x1344'])
    p.add_argument('--models', nargs='+', default=list(MODELS), choices=MODELS)
    p.add_argument('--runtimes', nargs='+', default=list(RUNTIMES), choices=RUNTIMES)
    p.add_argument('--repeat', type=int, default=3)
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--calib-images', type=int, default=4)
    p.add_argument('--upernet', action='store_true',
                   help='add whole-model UperNet rows (512x512)')
    add_allocator_argument(p)
    p.add_argument('--out', default='work_dirs/deploy_speed')
    args = p.parse_args(argv)
    set_allocator_mode(args.malloc)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix='mmslab_deploy_')  # exported files: GBs at 800x1344
    try:
        report = measure_all(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f'\nmachine: {machine_line(report["machine"])}')
    for c in report['targets']:
        print(f"  {c['shape']:9s} {c['what']:52s} {c['ratio']:.2f}x (target >= "
              f"{c['target']:.1f}: {'met' if c['met'] else 'NOT met'})")
    plot(report, osp.join(args.out, 'deploy_speed.png'))
    print(f"wrote {osp.join(args.out, 'deploy_speed.json')} and deploy_speed.png")
    return report


def save_report(report: dict, out_dir: str) -> None:
    with open(osp.join(out_dir, 'deploy_speed.json'), 'w') as f:
        json.dump(report, f, indent=2)


def measure_all(args, tmp) -> dict:
    """Export, convert, quantize and time every case. The JSON is rewritten after each: a
    long run that fails late keeps the cases it finished."""
    rows, checks = [], []
    report = dict(machine=machine_info(), threads=args.threads, repeat=args.repeat,
                  warmup=args.warmup, calib_images=args.calib_images, rows=rows,
                  targets=checks)
    cases = [(s, 'backbone') for s in args.shapes]
    if args.upernet:
        cases.append(('512x512', 'upernet'))
    for shape_text, kind in cases:
        # One case at a time: its models, sessions and compiled runtimes are freed before
        # the next case is prepared (800x1344 sessions and UperNet calibration together
        # exceeded 24 GB).
        res = measure_case(args, tmp, shape_text, kind, rows)
        gc.collect()
        if kind == 'backbone':
            for t in targets(res, args.runtimes):
                checks.append(dict(shape=shape_text, **t, met=t['ratio'] >= t['target']))
        print_table(rows, kind, shape_text, args.runtimes)
        report['window_softmax'] = window_softmax_choices()
        save_report(report, args.out)
    return report


def measure_case(args, tmp, shape_text: str, kind: str, rows: list) -> dict:
    """Prepare and time one (shape, kind) case; appends its rows, returns {(model, rt): ms}."""
    shape = parse_shape(shape_text)
    fns = {}
    if kind == 'backbone':
        builds = {name: (build_backbone(name), 'backbone') for name in args.models}
    else:
        builds = {
            'UperNet Swin-T (LN)': (build_upernet(
                'configs/upernet_swin_t_160k_ade20k.py', False), 'model'),
            'UperNet RePa-Swin-T fused': (build_upernet(
                'configs/upernet_repa_swin_t_160k_ade20k.py', True), 'model')}
    print(f'preparing {kind} {shape_text}: export, OpenVINO conversion, INT8 calibration')
    for name, (model, part) in builds.items():
        forms = deploy_forms(model, part, shape, args.runtimes,
                             osp.join(tmp, f'{kind}_{shape_text}_{len(fns)}'), args.threads,
                             args.calib_images)
        for rt, fn in forms.items():
            fns[(name, rt)] = fn
    bar = ProgressBar(len(fns) * args.repeat)
    keyed = {f'{n} | {r}': f for (n, r), f in fns.items()}
    times = measure_interleaved(keyed, args.repeat, args.warmup, bar.update)
    print()
    res = {}
    for key, ms in times.items():
        name, rt = key.split(' | ')
        stats = summarize(ms)
        res[(name, rt)] = stats['median_ms']
        rows.append(dict(kind=kind, shape=shape_text, model=name, runtime=rt, **stats))
    return res


def print_table(rows, kind, shape, runtimes):
    sel = [r for r in rows if r['kind'] == kind and r['shape'] == shape]
    models = list(dict.fromkeys(r['model'] for r in sel))
    cell = {(r['model'], r['runtime']): r['median_ms'] for r in sel}
    print(f'\n{kind} {shape}: median ms, batch 1')
    print('  ' + 'model'.ljust(28) + ''.join(rt.rjust(10) for rt in runtimes))
    for m in models:
        print('  ' + m.ljust(28) + ''.join(
            (f'{cell[(m, rt)]:10.1f}' if (m, rt) in cell else '-'.rjust(10)) for rt in runtimes))


def plot(report, path):
    groups = list(dict.fromkeys((r['kind'], r['shape']) for r in report['rows']))
    with saved_figure(path, ncols=len(groups), panel_size=(6.5, 4.5)) as (fig, axes):
        for ax, (kind, shape) in zip(axes[0], groups):
            sel = [r for r in report['rows'] if r['kind'] == kind and r['shape'] == shape]
            models = list(dict.fromkeys(r['model'] for r in sel))
            runtimes = list(dict.fromkeys(r['runtime'] for r in sel))
            grouped_bars(ax, runtimes, {
                m: [next((r['median_ms'] for r in sel if r['model'] == m and
                          r['runtime'] == rt), 0.0) for rt in runtimes] for m in models})
            ax.set_ylabel('median latency (ms), batch 1')
            ax.set_title(f'{kind} {shape}', fontsize=10)
            ax.legend(fontsize=7)
            ax.grid(axis='y', alpha=0.3)
        fig.suptitle(machine_line(report['machine']), fontsize=9)


if __name__ == '__main__':
    main()
