"""Latency of fused vs unfused models (and baselines), measured interleaved in one run.

    python tools/benchmark.py CONFIG [--checkpoint CKPT] [--shapes 512x512 800x1344]
        [--repeat 5] [--warmup 2] [--threads 2] [--baseline CONFIG ...] [--parts backbone model]
        [--compile [--compile-dynamic] [--compile-backend inductor]] --out DIR

For every input shape it times, at batch 1, the backbone alone and the whole model
(``mode='predict'``: forward + post-processing, no data loading) of: the fused model
(``mmslab.reparameterize``), the unfused model, and each baseline config (as is). Calls of
all variants are interleaved so machine noise hits them alike. Prints a table of medians
and ratios, writes ``benchmark.json`` and ``benchmark.png`` (latency against input size).

``--compile`` adds ``torch.compile`` of every fused backbone (the config's and the LayerNorm
control's) as rows of their own, timed in the same rotation as their eager forms; the first
call at each shape (the compilation: a static graph at the first shape, one graph for all
sizes at the second) is timed separately and reported with the number of graphs compiled.
"""
import argparse
import json
import os
import os.path as osp

import torch
from mmengine.config import DictAction
from mmengine.utils import ProgressBar

import mmslab  # noqa: F401
from mmslab.utils.launch import build_model_from_config
from mmslab.models.layers.window_attention import window_softmax_choices
from mmslab.utils.allocator import add_allocator_argument, set_allocator_mode
from mmslab.utils.machine import machine_info, machine_line
from mmslab.utils.plotting import saved_figure
from mmslab.benchmark import (fake_batch, first_call_timed, fused_copy, make_runners,
                              measure_interleaved, parse_shape, summarize)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('config')
    p.add_argument('--checkpoint', help='weights to load (default: random init)')
    p.add_argument('--shapes', nargs='+', default=['512x512', '800x1344'],
                   help='input sizes HEIGHTxWIDTH')
    p.add_argument('--repeat', type=int, default=5, help='timed calls per variant and shape')
    p.add_argument('--warmup', type=int, default=2, help='untimed calls per variant and shape')
    p.add_argument('--threads', type=int, default=None, help='torch threads (default: as is)')
    p.add_argument('--baseline', nargs='*', default=[], help='baseline configs, timed as is')
    p.add_argument('--baseline-backbone', nargs='*', default=[], choices=sorted(BASELINES),
                   help="the config's own model with its backbone replaced by mmdet's / "
                   "mmseg's (LayerNorm) backbone of that name, or by mmslab's LayerNorm "
                   "control (ln_swin_t, fused), same neck and heads, random weights")
    p.add_argument('--parts', nargs='+', default=['backbone', 'model'],
                   choices=['backbone', 'model'])
    p.add_argument('--compile', action='store_true',
                   help='also time torch.compile of the fused backbones (the config\'s and the '
                   'LN control\'s), next to their eager forms, with the compile time')
    p.add_argument('--compile-backend', default='inductor',
                   help='torch.compile backend (default inductor)')
    p.add_argument('--compile-dynamic', action='store_true',
                   help='compile with dynamic=True: one graph for every size from the first '
                   'call (default: a static graph at the first shape, a dynamic one at the '
                   'second, as torch.compile does)')
    p.add_argument('--cfg-options', nargs='+', action=DictAction)
    add_allocator_argument(p)
    p.add_argument('--out', required=True, help='output directory')
    args = p.parse_args(argv)
    set_allocator_mode(args.malloc)
    if args.repeat < 1 or args.warmup < 0:
        p.error('--repeat must be >= 1 and --warmup >= 0')
    return args


# LayerNorm baselines from the OpenMMLab libraries themselves (widths match mmslab's T/S).
BASELINES = {
    'swin_t': dict(type='SwinTransformer', embed_dims=96, depths=[2, 2, 6, 2],
                   num_heads=[3, 6, 12, 24], window_size=7, drop_path_rate=0.0),
    'pvt_t': dict(type='PyramidVisionTransformer', num_layers=[2, 2, 2, 2]),
    # the control: mmslab's own LayerNorm Swin-T, fused like the methods (window handling of
    # mmslab without the methods' norm / FFN changes: what the method alone buys)
    'ln_swin_t': dict(type='ReparamSwinTransformer', arch='tiny', norm_cfg=dict(type='LN'),
                      drop_path_rate=0.0),
}
#: Baselines built by mmslab, timed fused (mmdet's / mmseg's are timed as they are).
MMSLAB_BASELINES = ('ln_swin_t', )


def baseline_backbone(config: str, name: str) -> dict:
    """``BASELINES[name]`` with the config's ``out_indices``."""
    from mmengine.config import Config
    cfg = Config.fromfile(config)
    if cfg.get('default_scope') == 'mmseg' and name == 'pvt_t':
        raise SystemExit('error: mmseg has no PVT v1 backbone; use swin_t')
    return dict(BASELINES[name], out_indices=tuple(cfg.model.backbone.out_indices))


def build_model(config: str, checkpoint=None, cfg_options=None, backbone=None):
    _, model = build_model_from_config(config, cfg_options, backbone=backbone)
    if checkpoint:
        from mmengine.runner import load_checkpoint
        load_checkpoint(model, checkpoint, map_location='cpu', strict=True)
    else:
        model.init_weights()
    return model.eval()


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [parse_shape(s) for s in args.shapes]
    os.makedirs(args.out, exist_ok=True)
    name = osp.splitext(osp.basename(args.config))[0]
    model = build_model(args.config, args.checkpoint, args.cfg_options)
    variants = {f'{name} (unfused)': model, f'{name} (fused)': fused_copy(model)}
    for base in args.baseline:
        variants[osp.splitext(osp.basename(base))[0]] = build_model(base)
    for base in args.baseline_backbone:
        baseline = build_model(args.config, None, args.cfg_options,
                               backbone=baseline_backbone(args.config, base))
        if base in MMSLAB_BASELINES:
            variants[f'{name} with {base} backbone (LN control, fused)'] = fused_copy(baseline)
        else:
            variants[f'{name} with {base} backbone (LN)'] = baseline
    compiled = {}
    if args.compile:
        for key in [k for k in variants if k.endswith(('(fused)', ', fused)'))]:
            compiled[key[:-1] + ', torch.compile)'] = torch.compile(
                variants[key].backbone, backend=args.compile_backend,
                dynamic=True if args.compile_dynamic else None)

    n_backbone = len(variants) + len(compiled)
    total = len(shapes) * args.repeat * sum(
        n_backbone if part == 'backbone' else len(variants) for part in args.parts)
    bar = ProgressBar(total)
    results, compile_runs = [], []
    for shape in shapes:
        for part in args.parts:
            fns = {k: make_runners(m, shape, part) for k, m in variants.items()}
            if compiled and part == 'backbone':
                x = fake_batch(variants[f'{name} (fused)'], shape)[0]
                for key, fn in compiled.items():
                    compile_runs.append(dict(variant=key, shape=list(shape),
                                             **first_call_timed(fn, x)))
                    fns[key] = lambda fn=fn, x=x: fn(x)
            times = measure_interleaved(fns, args.repeat, args.warmup, bar.update)
            for k, ms in times.items():
                results.append(dict(variant=k, part=part, shape=list(shape), **summarize(ms),
                                    times_ms=ms))
    print()
    report = dict(config=args.config, checkpoint=args.checkpoint, machine=machine_info(),
                  threads=torch.get_num_threads(),
                  repeat=args.repeat, warmup=args.warmup, torch=torch.__version__,
                  results=results, ratios=ratios(results, name),
                  window_softmax=window_softmax_choices())
    if compiled:
        report['compile'] = dict(backend=args.compile_backend, dynamic=args.compile_dynamic,
                                 first_calls=with_eager_times(compile_runs, results))
    print_table(report, name)
    with open(osp.join(args.out, 'benchmark.json'), 'w') as f:
        json.dump(report, f, indent=2)
    plot(report, osp.join(args.out, 'benchmark.png'))
    print(f'wrote {osp.join(args.out, "benchmark.json")} and benchmark.png')
    return report


def with_eager_times(compile_runs, results):
    """Each compiled backbone's first call with its median and its eager form's, same shape."""
    index = {(r['variant'], tuple(r['shape'])): r['median_ms'] for r in results
             if r['part'] == 'backbone'}
    out = []
    for run in compile_runs:
        shape = tuple(run['shape'])
        eager = run['variant'].replace(', torch.compile)', ')')
        ms, eager_ms = index[(run['variant'], shape)], index[(eager, shape)]
        out.append(dict(run, eager_variant=eager, median_ms=ms, eager_median_ms=eager_ms,
                        compiled_over_eager=ms / eager_ms))
    return out


def ratios(results, name):
    """Median latency of every other variant divided by the fused model's (>1: fused faster)."""
    out = []
    fused_key = f'{name} (fused)'
    index = {(r['variant'], r['part'], tuple(r['shape'])): r['median_ms'] for r in results}
    for (variant, part, shape), ms in index.items():
        ref = index.get((fused_key, part, shape))
        if variant != fused_key and ref:
            out.append(dict(part=part, shape=list(shape), variant=variant,
                            ratio_vs_fused=ms / ref))
    return out


def print_table(report, name):
    rows = [('part', 'shape', 'variant', 'median ms', 'x fused')]
    fused = {(r['part'], tuple(r['shape'])): r['median_ms'] for r in report['results']
             if r['variant'] == f'{name} (fused)'}
    for r in report['results']:
        ref = fused.get((r['part'], tuple(r['shape'])))
        rows.append((r['part'], 'x'.join(map(str, r['shape'])), r['variant'],
                     f"{r['median_ms']:.1f}", f"{r['median_ms'] / ref:.2f}" if ref else '-'))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        print('  '.join(c.ljust(w) for c, w in zip(row, widths)))
    print(f"({machine_line(report['machine'])}, median of {report['repeat']} interleaved "
          "runs; 'x fused' = variant latency / fused latency)")
    for run in report.get('compile', {}).get('first_calls', []):
        print(f"{run['variant']} at {'x'.join(map(str, run['shape']))}: "
              f"{run['median_ms']:.1f} ms vs eager {run['eager_median_ms']:.1f} ms "
              f"(x{run['compiled_over_eager']:.2f}); first call {run['first_call_s']:.1f} s, "
              f"{run['graphs_compiled']} graph(s) compiled (backend "
              f"{report['compile']['backend']})")


def plot(report, path):
    parts = sorted({r['part'] for r in report['results']})
    with saved_figure(path, ncols=len(parts)) as (fig, axes):
        for ax, part in zip(axes[0], parts):
            for variant in dict.fromkeys(r['variant'] for r in report['results']):
                rs = sorted((r for r in report['results'] if r['variant'] == variant and
                             r['part'] == part), key=lambda r: r['shape'][0] * r['shape'][1])
                if rs:
                    ax.plot([r['shape'][0] * r['shape'][1] / 1e6 for r in rs],
                            [r['median_ms'] for r in rs], marker='o', label=variant)
            ax.set_xlabel('input size (megapixels)')
            ax.set_ylabel('median latency per image (ms)')
            ax.set_title(f'{part} latency, batch 1\n{machine_line(report["machine"])}',
                         fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)


if __name__ == '__main__':
    main()
