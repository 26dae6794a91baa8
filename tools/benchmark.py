"""Latency of fused vs unfused models (and baselines), measured interleaved in one run.

    python tools/benchmark.py CONFIG [--checkpoint CKPT] [--shapes 512x512 800x1344]
        [--repeat 5] [--warmup 2] [--threads 2] [--baseline CONFIG ...]
        [--baseline-backbone swin_t ln_swin_t] [--parts backbone model]
        [--device {cpu,cuda}] [--precisions fp32 fp16 bf16] [--batch-size 1 config]
        [--compile [--compile-dynamic] [--compile-backend inductor]] [--cuda-graph] --out DIR

For every input shape and batch size it times the backbone alone and the whole model
(``mode='predict'``: forward + post-processing, no data loading) of: the fused model
(``mmslab.reparameterize``), the unfused model, each baseline config (as is) and the config's
model with a baseline backbone (``--baseline-backbone``: mmdet's / mmseg's ``swin_t``, the
LayerNorm control ``ln_swin_t``). Calls of all variants, and of every precision of each, are
interleaved so machine noise hits them alike. Prints one table of medians and ratios, writes
``benchmark.json`` and ``benchmark.png`` (latency against input size).

Device and precision: ``--device cuda`` (the default where CUDA is available) builds and fuses
the models on the CPU, moves them to the GPU and times each call with CUDA events
(:func:`mmslab.utils.timing.timed_ms`); ``--precisions fp32 fp16`` (alias ``--precisions``)
times each variant in each
precision: the backbone under ``torch.autocast``, the whole model with its network parts
under autocast and float32 post-processing (as ``tools/test.py --precision bf16``
evaluates). fp16 needs CUDA, bf16 a GPU of compute capability 8.0+ or a CPU with
avx512_bf16 / amx_bf16. The JSON records the device, the timing method and the machine
(``machine.gpu``: GPU name, driver, CUDA, cuDNN, compute capability, memory).

Ratios, per part, shape, batch size and precision: ``ratios`` (each variant / the fused
model, as before) and ``speedups`` (for every variant, each reference's median over its own,
>1: faster than the reference; references: the ``--baseline`` configs and the
``--baseline-backbone`` names, e.g. ``swin_t`` = mmdet's Swin-T, ``ln_swin_t`` = the
LayerNorm control; and ``speedup_vs_fp32``: the same variant in fp32 over this precision).

``--compile`` adds ``torch.compile`` of every fused backbone (the config's and the LayerNorm
control's) as rows of their own, timed in the same rotation as their eager forms; the first
call at each shape (the compilation: a static graph at the first shape, one graph for all
sizes at the second) is timed separately and reported with the number of graphs compiled.

``--cuda-graph`` (CUDA only) adds every variant but the unfused one with its backbone and
neck replayed from CUDA graphs (:func:`mmslab.deploy.cuda_graph.use_cuda_graphs`: one
capture per shape and precision, in the warm-up calls) as rows of their own, on copies of
the models, in the same rotation; the references gain graphed forms (``swin_t+graph``,
``ln_swin_t+graph``): at batch 1 a GPU waits on kernel launches, which graphs remove, so
these ratios are what the models' arithmetic buys.
"""
import argparse
import copy
import os
import os.path as osp

import torch
from mmengine.config import DictAction
from mmengine.utils import ProgressBar

import mmslab  # noqa: F401
from mmslab.deploy.cuda_graph import graph_captures, use_cuda_graphs
from mmslab.utils.launch import build_model_from_config
from mmslab.utils.allocator import add_allocator_argument, set_allocator_mode
from mmslab.utils.machine import machine_info, machine_line
from mmslab.utils.plotting import saved_figure
from mmslab.utils.timing import timing_method
from mmslab.benchmark import (add_device_arguments, autocast_call, check_device_arguments,
                              fake_batch, first_call_timed, fused_copy, make_runners,
                              measure_interleaved, move_to, parse_shape, save_report,
                              summarize, trained_like_parameters)


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
    p.add_argument('--cuda-graph', action='store_true',
                   help='also time every variant but the unfused one with its backbone and '
                   'neck replayed from CUDA graphs (CUDA only)')
    p.add_argument('--cfg-options', nargs='+', action=DictAction)
    add_device_arguments(p, config_batch=True)
    add_allocator_argument(p)
    p.add_argument('--out', required=True, help='output directory')
    args = p.parse_args(argv)
    set_allocator_mode(args.malloc)
    if args.repeat < 1 or args.warmup < 0:
        p.error('--repeat must be >= 1 and --warmup >= 0')
    check_device_arguments(p, args, 'tools/benchmark.py')
    if args.cuda_graph and args.device.type != 'cuda':
        p.error(f'--cuda-graph needs a CUDA device, got --device {args.device}')
    return args


def config_batch_sizes(batch_sizes, config: str, cfg_options=None) -> list:
    """``--batch-size`` with ``config`` replaced by the config's ``test_dataloader.batch_size``
    (repeats dropped)."""
    if 'config' not in batch_sizes:
        return list(batch_sizes)
    from mmslab.utils.launch import load_config
    cfg, _ = load_config(config, cfg_options)
    size = (cfg.get('test_dataloader', None) or {}).get('batch_size', None)
    if not isinstance(size, int) or size < 1:
        raise SystemExit(f'error: --batch-size config: {config} has no test_dataloader.'
                         f'batch_size (got {size!r}); give a number')
    return list(dict.fromkeys(size if b == 'config' else b for b in batch_sizes))


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
#: The end of a graphed variant's name (``'... (fused, CUDA graph)'``).
GRAPHED_SUFFIX = ', CUDA graph)'


def baseline_backbone(config: str, name: str) -> dict:
    """``BASELINES[name]`` with the config's ``out_indices`` (default: all four stages)."""
    from mmengine.config import Config
    cfg = Config.fromfile(config)
    if cfg.get('default_scope') == 'mmseg' and name == 'pvt_t':
        raise SystemExit('error: mmseg has no PVT v1 backbone; use swin_t')
    return dict(BASELINES[name],
                out_indices=tuple(cfg.model.backbone.get('out_indices', (0, 1, 2, 3))))


def build_model(config: str, checkpoint=None, cfg_options=None, backbone=None):
    _, model = build_model_from_config(config, cfg_options, backbone=backbone)
    if checkpoint:
        from mmengine.runner import load_checkpoint
        load_checkpoint(model, checkpoint, map_location='cpu', strict=True)
    else:  # random weights without the constant ones runtimes would fold away
        model.init_weights()
        trained_like_parameters(model)
    return model.eval()


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    shapes = [parse_shape(s) for s in args.shapes]
    batch_sizes = config_batch_sizes(args.batch_size, args.config, args.cfg_options)
    os.makedirs(args.out, exist_ok=True)
    name = osp.splitext(osp.basename(args.config))[0]
    # built and fused on the CPU (the folds compute in float64: the same fused weights for
    # every device), then moved to the timing device
    model = build_model(args.config, args.checkpoint, args.cfg_options)
    variants = {f'{name} (unfused)': model, f'{name} (fused)': fused_copy(model)}
    references = {}  # short name -> variant: the speed-ups' denominators
    for base in args.baseline:
        key = osp.splitext(osp.basename(base))[0]
        variants[key] = build_model(base)
        references[key] = key
    for base in args.baseline_backbone:
        baseline = build_model(args.config, None, args.cfg_options,
                               backbone=baseline_backbone(args.config, base))
        if base in MMSLAB_BASELINES:
            key = f'{name} with {base} backbone (LN control, fused)'
            variants[key] = fused_copy(baseline)
        else:
            key = f'{name} with {base} backbone (LN)'
            variants[key] = baseline
        references[base] = key
    for m in variants.values():
        move_to(m, device)
    if args.cuda_graph:
        short_names = {v: k for k, v in references.items()}
        for key in [k for k in variants if not k.endswith('(unfused)')]:
            graphed = key[:-1] + GRAPHED_SUFFIX
            variants[graphed] = use_cuda_graphs(move_to(copy.deepcopy(variants[key]), device))
            if key in short_names:
                references[f'{short_names[key]}+graph'] = graphed
    compiled = {}
    if args.compile:
        for key in [k for k in variants if k.endswith(('(fused)', ', fused)'))]:  # eager ones
            compiled[key[:-1] + ', torch.compile)'] = torch.compile(
                variants[key].backbone, backend=args.compile_backend,
                dynamic=True if args.compile_dynamic else None)

    precisions = args.precisions
    n_backbone = len(variants) + len(compiled)
    total = len(shapes) * len(batch_sizes) * len(precisions) * args.repeat * sum(
        n_backbone if part == 'backbone' else len(variants) for part in args.parts)
    bar = ProgressBar(total)
    results, compile_runs = [], []
    for shape in shapes:
        for batch in batch_sizes:
            for part in args.parts:
                fns = {(k, prec): make_runners(m, shape, part, batch, prec)
                       for k, m in variants.items() for prec in precisions}
                if compiled and part == 'backbone':
                    x = fake_batch(variants[f'{name} (fused)'], shape, batch)[0]
                    for key, fn in compiled.items():
                        for prec in precisions:
                            call = autocast_call(lambda fn=fn, x=x: fn(x), prec, device.type)
                            compile_runs.append(dict(
                                variant=key, shape=list(shape), batch_size=batch, precision=prec,
                                **first_call_timed(call, device=device)))
                            fns[(key, prec)] = call
                times = measure_interleaved(fns, args.repeat, args.warmup, bar.update, device)
                for (k, prec), ms in times.items():
                    summary = summarize(ms)
                    results.append(dict(variant=k, part=part, shape=list(shape),
                                        batch_size=batch, precision=prec, **summary,
                                        median_ms_per_image=summary['median_ms'] / batch,
                                        times_ms=ms))
    print()
    report = dict(config=args.config, checkpoint=args.checkpoint, device=str(device),
                  timing=timing_method(device), machine=machine_info(device),
                  threads=torch.get_num_threads(), precisions=precisions, batch_sizes=batch_sizes,
                  repeat=args.repeat, warmup=args.warmup, torch=torch.__version__,
                  references=references, results=results, ratios=ratios(results, name),
                  speedups=speedups(results, references))
    if args.cuda_graph:
        graph_variants = {k: m for k, m in variants.items() if k.endswith(GRAPHED_SUFFIX)}
        report['cuda_graph'] = {k: graph_captures(m) for k, m in graph_variants.items()}
    if compiled:
        report['compile'] = dict(backend=args.compile_backend, dynamic=args.compile_dynamic,
                                 first_calls=with_eager_times(compile_runs, results))
    print_table(report, name)
    for key, captures in report.get('cuda_graph', {}).items():
        print(f'{key}: {captures} CUDA graph(s) captured' + (
            '' if captures else ' (WARNING: it ran eagerly; its rows are not graph replays)'))
    save_report(report, args.out, 'benchmark', plot)
    return report


def _group(r) -> tuple:
    """What a ratio compares within: part, shape, batch size, precision."""
    return r['part'], tuple(r['shape']), r.get('batch_size', 1), r.get('precision', 'fp32')


def _group_fields(group) -> dict:
    part, shape, batch, precision = group
    return dict(part=part, shape=list(shape), batch_size=batch, precision=precision)


def with_eager_times(compile_runs, results):
    """Each compiled backbone's first call with its median and its eager form's, same shape,
    batch size and precision."""
    index = {(r['variant'], *_group(r)): r['median_ms'] for r in results
             if r['part'] == 'backbone'}
    out = []
    for run in compile_runs:
        group = _group(dict(run, part='backbone'))
        eager = run['variant'].replace(', torch.compile)', ')')
        ms, eager_ms = index[(run['variant'], *group)], index[(eager, *group)]
        out.append(dict(run, eager_variant=eager, median_ms=ms, eager_median_ms=eager_ms,
                        compiled_over_eager=ms / eager_ms))
    return out


def ratios(results, name):
    """Median latency of every other variant divided by the fused model's, same part, shape,
    batch size and precision (>1: fused faster)."""
    out = []
    fused_key = f'{name} (fused)'
    index = {(r['variant'], *_group(r)): r['median_ms'] for r in results}
    for (variant, *group), ms in index.items():
        ref = index.get((fused_key, *group))
        if variant != fused_key and ref:
            out.append(dict(_group_fields(group), variant=variant, ratio_vs_fused=ms / ref))
    return out


def speedups(results, references):
    """For every variant of every part, shape, batch size and precision: ``speedup_vs``
    {reference: the reference's median / the variant's} for each reference variant measured
    alike (not the variant itself; >1: the variant is faster) and, below fp32,
    ``speedup_vs_fp32`` (the same variant's fp32 median / this precision's).

    ``references``: {short name (``swin_t``, ``ln_swin_t``, a baseline config's name):
    variant}."""
    index = {(r['variant'], *_group(r)): r['median_ms'] for r in results}
    out = []
    for (variant, *group), ms in index.items():
        row = dict(_group_fields(group), variant=variant, median_ms=ms, speedup_vs={})
        for short, ref_variant in references.items():
            ref = index.get((ref_variant, *group))
            if ref_variant != variant and ref:
                row['speedup_vs'][short] = ref / ms
        if group[3] != 'fp32':
            fp32 = index.get((variant, *group[:3], 'fp32'))
            if fp32:
                row['speedup_vs_fp32'] = fp32 / ms
        out.append(row)
    return out


def table_rows(report, name) -> list:
    """The printed table: a header and one row per result."""
    refs = list(report.get('references', {}))
    several_precisions = len({_group(r)[3] for r in report['results']}) > 1
    header = ['part', 'shape', 'batch', 'precision', 'variant', 'median ms', 'x fused']
    header += [f'vs {short}' for short in refs] + (['vs fp32'] if several_precisions else [])
    fused = {(r['variant'], *_group(r)): r['ratio_vs_fused'] for r in report['ratios']}
    speed = {(r['variant'], *_group(r)): r for r in report['speedups']}
    rows = [header]
    for r in report['results']:
        key = (r['variant'], *_group(r))
        sp = speed.get(key, {})
        ratio = 1.0 if r['variant'] == f'{name} (fused)' else fused.get(key)
        row = [r['part'], 'x'.join(map(str, r['shape'])), str(_group(r)[2]), _group(r)[3],
               r['variant'], f"{r['median_ms']:.1f}", '-' if ratio is None else f'{ratio:.2f}']
        row += [f"{sp['speedup_vs'][short]:.2f}" if short in sp.get('speedup_vs', {}) else '-'
                for short in refs]
        if several_precisions:
            row.append(f"{sp['speedup_vs_fp32']:.2f}" if 'speedup_vs_fp32' in sp else '-')
        rows.append(row)
    return rows


def print_table(report, name):
    rows = table_rows(report, name)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print('  '.join(c.ljust(w) for c, w in zip(row, widths)))
    print(f"({machine_line(report['machine'])}; {report.get('device', 'cpu')}, "
          f"{report.get('timing', 'perf_counter')}, median of {report['repeat']} interleaved "
          "runs; 'x fused' = variant latency / fused latency, same part, shape, batch and "
          'precision)')
    for short, variant in report.get('references', {}).items():
        print(f"'vs {short}' = latency of {variant!r} / the variant's (>1: the variant is "
              'faster), same part, shape, batch and precision')
    if len(report.get('precisions', ['fp32'])) > 1:
        print("'vs fp32' = the variant's fp32 latency / its latency in this precision")
    for run in report.get('compile', {}).get('first_calls', []):
        print(f"{run['variant']} at {'x'.join(map(str, run['shape']))} "
              f"(batch {run.get('batch_size', 1)}, {run.get('precision', 'fp32')}): "
              f"{run['median_ms']:.1f} ms vs eager {run['eager_median_ms']:.1f} ms "
              f"(x{run['compiled_over_eager']:.2f}); first call {run['first_call_s']:.1f} s, "
              f"{run['graphs_compiled']} graph(s) compiled (backend "
              f"{report['compile']['backend']})")


def plot(report, path):
    parts = sorted({r['part'] for r in report['results']})
    with saved_figure(path, ncols=len(parts)) as (fig, axes):
        lines = dict.fromkeys((r['variant'], _group(r)[2], _group(r)[3])
                              for r in report['results'])
        several = len({line[1:] for line in lines}) > 1
        for ax, part in zip(axes[0], parts):
            for variant, batch, precision in lines:
                rs = sorted((r for r in report['results'] if r['variant'] == variant and
                             r['part'] == part and _group(r)[2:] == (batch, precision)),
                            key=lambda r: r['shape'][0] * r['shape'][1])
                if rs:
                    label = f'{variant}, {precision}, batch {batch}' if several else variant
                    ax.plot([r['shape'][0] * r['shape'][1] / 1e6 for r in rs],
                            [r['median_ms'] / batch for r in rs], marker='o', label=label)
            ax.set_xlabel('input size (megapixels)')
            ax.set_ylabel('median latency per image (ms)')
            ax.set_title(f"{part} latency on {report.get('device', 'cpu')}\n"
                         f'{machine_line(report["machine"])}', fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)


if __name__ == '__main__':
    main()
