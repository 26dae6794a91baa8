"""Backbone latency of the mmslab T presets, fused and unfused, against mmdet's own
LayerNorm Swin-T and PVT-T, interleaved in one run.

    python benchmarks/backbone_speed.py [--shapes 512x512 800x1344] [--repeat 5] [--threads 2]
        [--device {cpu,cuda}] [--precisions fp32 fp16 bf16] [--batch-size 1 8] [--compile]
        --out work_dirs/speed

Prints a table of medians and the ratios the project tracks, writes ``backbone_speed.json`` and
``backbone_speed.png``. Weights are random (latency does not depend on them), every norm has
non-trivial statistics. Models are built and fused on the CPU, then moved to ``--device``
(default: cuda where available), where each call is timed with CUDA events; every precision
of ``--precisions`` (``torch.autocast``; alias ``--dtypes``) is a variant of its own in the
same interleaved rotation.
Results are grouped by setting: ``'512x512'`` (fp32, batch 1), ``'512x512 fp16'``,
``'512x512 b8 bf16'``; ratios compare models within one setting.
"""
import argparse
import copy
import json
import os
import os.path as osp

import torch
from mmengine.utils import ProgressBar

import mmslab
from mmslab.benchmark import (add_device_arguments, autocast_call, check_device_arguments,
                              first_call_timed, measure_interleaved, move_to, parse_shape,
                              summarize, trained_like_parameters)
from mmslab.utils.allocator import add_allocator_argument, set_allocator_mode
from mmslab.utils.machine import machine_info, machine_line
from mmslab.utils.plotting import grouped_bars, saved_figure
from mmslab.utils.timing import timing_method

# (name, builder) pairs; "fused" variants are derived automatically for mmslab models.
RATIOS = [  # (numerator, denominator, target or None): ratio = numerator ms / denominator ms
    ('RePa-Swin-T', 'RePa-Swin-T fused', 1.4),
    ('mmdet Swin-T', 'RePa-Swin-T fused', 1.6),
    ('mmdet Swin-T', 'PRepBN-Swin-T fused', 1.25),
    ('PRepBN-Swin-T', 'PRepBN-Swin-T fused', None),
    ('mmdet Swin-T', 'SLAB-Swin-T fused', None),
    ('SLAB-Swin-T', 'SLAB-Swin-T fused', None),
    ('mmdet PVT-T', 'PRepBN-PVT-T fused', None),
    ('PRepBN-PVT-T', 'PRepBN-PVT-T fused', None),
]


def build_models():
    from mmdet.models.backbones import PyramidVisionTransformer, SwinTransformer
    from mmslab.models import PRepBNPVT, PRepBNSwin, RePaSwin, SLABSwin
    models = {'mmdet Swin-T': SwinTransformer(), 'mmdet PVT-T': PyramidVisionTransformer(
        num_layers=[2, 2, 2, 2])}
    ours = {'PRepBN-Swin-T': PRepBNSwin(), 'SLAB-Swin-T': SLABSwin(),
            'RePa-Swin-T': RePaSwin(), 'PRepBN-PVT-T': PRepBNPVT(arch='tiny')}
    for m in (*models.values(), *ours.values()):  # trained-like: see trained_like_parameters
        trained_like_parameters(m)
    g = torch.Generator().manual_seed(0)
    for name, m in ours.items():
        m.eval()
        with torch.no_grad():  # realistic, non-identity statistics
            for mod in m.modules():
                if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
                    mod.running_var.uniform_(0.5, 2.0, generator=g)
                    mod.running_mean.normal_(0, 0.5, generator=g)
        models[name] = m
        models[name + ' fused'] = mmslab.reparameterize(copy.deepcopy(m))
    for m in models.values():
        m.eval()
    return models


def setting_label(shape, batch_size: int = 1, precision: str = 'fp32') -> str:
    """``'512x512'``, ``'512x512 fp16'``, ``'512x512 b8'``, ``'512x512 b8 bf16'``: a results
    key (fp32 at batch 1 keeps the shape alone)."""
    label = 'x'.join(map(str, shape))
    if batch_size != 1:
        label += f' b{batch_size}'
    return label + (f' {precision}' if precision != 'fp32' else '')


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--shapes', nargs='+', default=['512x512', '800x1344'])
    p.add_argument('--repeat', type=int, default=5)
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--compile', action='store_true',
                   help='add torch.compile of the fused RePa/PRepBN Swin-T (separate rows, with '
                   'the compile time and the compiled / eager ratio)')
    add_device_arguments(p)
    add_allocator_argument(p)
    p.add_argument('--out', default='work_dirs/speed')
    args = p.parse_args(argv)
    set_allocator_mode(args.malloc)
    check_device_arguments(p, args, 'benchmarks/backbone_speed.py')
    device = args.device
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    models = {name: move_to(m, device) for name, m in build_models().items()}
    if args.compile:
        for name in ('RePa-Swin-T fused', 'PRepBN-Swin-T fused'):
            models[name + ' +compile'] = torch.compile(models[name])
    shapes = [parse_shape(s) for s in args.shapes]
    bar = ProgressBar(len(shapes) * len(args.batch_size) * len(args.precisions) * len(models) *
                      args.repeat)
    results, settings, first_calls = {}, {}, []
    for shape in shapes:
        for batch in args.batch_size:
            x = torch.randn(batch, 3, *shape, device=device)
            fns = {}
            for name, m in models.items():
                for precision in args.precisions:
                    fn = autocast_call(lambda m=m: m(x), precision, device.type)
                    if name.endswith(' +compile'):
                        # the compilation (static graph at the first shape, dynamic at the
                        # second), timed apart from the latency
                        first_calls.append(dict(variant=name, shape=setting_label(
                            shape, batch, precision), **first_call_timed(fn, device=device)))
                    fns[(name, precision)] = fn
            times = measure_interleaved(fns, args.repeat, args.warmup, bar.update, device)
            for precision in args.precisions:
                label = setting_label(shape, batch, precision)
                settings[label] = dict(shape=list(shape), batch_size=batch, precision=precision)
                results[label] = {name: summarize(times[(name, precision)]) for name in models}
    print()
    ratios = []
    for label, res in results.items():
        setting = settings[label]
        print(f"\n{label} (batch {setting['batch_size']}, {setting['precision']}, {device}, "
              f'{args.threads} threads, median of {args.repeat})')
        for name, r in res.items():
            print(f"  {name:28s} {r['median_ms']:9.1f} ms")
        for num, den, target in RATIOS:
            if num in res and den in res:
                value = res[num]['median_ms'] / res[den]['median_ms']
                ratios.append(dict(shape=label, numerator=num, denominator=den, ratio=value,
                                   target=target, batch_size=setting['batch_size'],
                                   precision=setting['precision']))
                mark = '' if target is None else (' (target >= %.2f: %s)' % (
                    target, 'met' if value >= target else 'NOT met'))
                print(f'  {num} / {den}: {value:.2f}x{mark}')
    for run in first_calls:
        res = results[run['shape']]
        run['compiled_over_eager'] = (res[run['variant']]['median_ms'] /
                                      res[run['variant'][:-len(' +compile')]]['median_ms'])
        print(f"  {run['variant']} at {run['shape']}: x{run['compiled_over_eager']:.2f} of eager;"
              f" first call {run['first_call_s']:.1f} s, {run['graphs_compiled']} graph(s) "
              "compiled")
    report = dict(device=str(device), timing=timing_method(device),
                  machine=machine_info(device), threads=args.threads, repeat=args.repeat,
                  precisions=args.precisions, batch_sizes=args.batch_size, torch=torch.__version__,
                  settings=settings, results=results, ratios=ratios)
    if first_calls:
        report['compile'] = first_calls
    print(f"\nmachine: {machine_line(report['machine'])}")
    with open(osp.join(args.out, 'backbone_speed.json'), 'w') as f:
        json.dump(report, f, indent=2)
    plot(results, osp.join(args.out, 'backbone_speed.png'))
    print(f"\nwrote {osp.join(args.out, 'backbone_speed.json')} and backbone_speed.png")
    return report


def plot(results, path):
    shapes = list(results)
    names = list(results[shapes[0]])
    with saved_figure(path, figsize=(10, 4.5)) as (fig, axes):
        ax = axes[0][0]
        grouped_bars(ax, names, {shape: [results[shape][n]['median_ms'] for n in names]
                                 for shape in shapes}, horizontal=True)
        ax.set_xlabel('median backbone latency per call (ms)')
        ax.legend()
        ax.grid(axis='x', alpha=0.3)


if __name__ == '__main__':
    main()
