"""Regenerate the benchmark tables of README.md and docs/ from benchmarks/results/*.json.

    python benchmarks/make_tables.py            # rewrite the generated blocks in place
    python benchmarks/make_tables.py --check    # exit 1 and print a diff where a doc is stale

A generated block is the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in
a Markdown file; ``NAME`` is one of :data:`BLOCKS`. Everything outside the markers is written
by hand and left alone. tests/test_generated_docs.py checks that the committed docs equal
what this script writes.

Results files: ``benchmarks/results/<machine>-<tool>.json`` (``analyze_model.json`` has no
machine: counts do not depend on it). A file is either the JSON a tool wrote, or
``{"tool", "machine_label", "runs": [...]}`` where each run is the JSON a tool wrote. A run
(or its file) carries ``command`` (what produced it), ``machine`` and ``date``; figures
copied from older docs instead of a fresh run also carry ``source`` ("transcribed from
...").
To add a result, save the tool's JSON there, add ``command`` and ``date`` if it lacks them,
and run this script. ``*-benchmark_train.json`` (tools/benchmark_train.py) is picked up by
the training-speed blocks without further changes.

Standard library only: the test runs it without importing torch.
"""
import argparse
import difflib
import glob
import json
import os.path as osp
import re
import sys

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
RESULTS = osp.join(REPO, 'benchmarks', 'results')
DOCS = ['README.md', 'docs/benchmarks.md', 'docs/gpu.md', 'docs/deployment.md']

#: The presets of the model table: (name, config variant ``V`` or None, registered type).
PRESETS = [
    ('PRepBN-Swin-T', 'prepbn_swin_t', 'PRepBNSwin'),
    ('PRepBN-Swin-S', 'prepbn_swin_s', 'PRepBNSwin'),
    ('SLAB-Swin-T', 'slab_swin_t', 'SLABSwin'),
    ('SLAB-Swin-S', 'slab_swin_s', 'SLABSwin'),
    ('RePa-Swin-T', 'repa_swin_t', 'RePaSwin'),
    ('RePa-Swin-S', 'repa_swin_s', 'RePaSwin'),
    ('RePa-Swin-B', 'repa_swin_b', 'RePaSwin'),
    ('PRepBN-PVT-T', 'prepbn_pvt_t', 'PRepBNPVT'),
    ('PRepBN-PVT-S', 'prepbn_pvt_s', 'PRepBNPVT'),
    ('SLAB-PVT-T', None, 'SLABPVT'),
    ('SLAB-PVT-S', None, 'SLABPVT'),
]
MMDET = 'mmdet Swin-T'
CONTROL = 'LN Swin-T'
RUNTIMES = ['eager', 'eager bf16', 'ort fp32', 'ort int8', 'ov fp32', 'ov bf16', 'ov int8']
RUNTIME_LABELS = {'eager': 'eager fp32', 'eager bf16': 'eager bf16', 'ort fp32': 'ORT fp32',
                  'ort int8': 'ORT INT8', 'ov fp32': 'OV fp32', 'ov bf16': 'OV bf16',
                  'ov int8': 'OV INT8'}
MODEL_LABELS = {CONTROL: 'LN Swin-T (control)', 'UperNet Swin-T (LN)': 'LN Swin-T (control)',
                'UperNet RePa-Swin-T fused': 'RePa-Swin-T fused'}
#: References of the ratio tables, in this order, where the run has them.
REFERENCES = [CONTROL, MMDET, 'UperNet Swin-T (LN)']
KINDS = {'backbone': 'backbone', 'maskrcnn': 'whole Mask R-CNN', 'upernet': 'whole UperNet'}
FORMS = ['pytorch fused', 'pytorch bf16', 'onnxruntime fp32', 'onnxruntime int8',
         'openvino fp32', 'openvino bf16', 'openvino int8']
FORM_LABELS = {'pytorch fused': 'PyTorch fused', 'pytorch bf16': 'PyTorch bf16',
               'onnxruntime fp32': 'onnxruntime fp32', 'onnxruntime int8': 'onnxruntime INT8',
               'openvino fp32': 'OpenVINO fp32', 'openvino bf16': 'OpenVINO bf16',
               'openvino int8': 'OpenVINO INT8'}


# -- results ----------------------------------------------------------------------------------

def load(name: str) -> dict:
    """A results file (``name`` without ``.json``) as ``{"file": ..., "runs": [...]}``, each
    run with the file's ``command`` / ``machine`` / ``date`` / ``source`` where it lacks its
    own; None where the file does not exist."""
    path = osp.join(RESULTS, name + '.json')
    if not osp.isfile(path):
        return None
    with open(path) as f:
        data = json.load(f)
    runs = data['runs'] if 'runs' in data else [data]
    shared = {k: data[k] for k in ('command', 'machine', 'date', 'source', 'tool')
              if k in data and 'runs' in data}
    return dict(file=osp.relpath(path, REPO), label=data.get('machine_label'),
                runs=[dict(shared, **run) for run in runs])


def results_files(suffix: str) -> list:
    """The names of ``benchmarks/results/*-<suffix>.json``, sorted."""
    paths = glob.glob(osp.join(RESULTS, f'*-{suffix}.json'))
    return sorted(osp.splitext(osp.basename(p))[0] for p in paths)


def machine_text(machine) -> str:
    """A run's machine in words: as written, or from a tool's ``machine_info`` dict."""
    if machine is None:
        return 'machine not recorded'
    if isinstance(machine, str):
        return machine
    line = f"{machine.get('cpu', 'unknown CPU')} ({machine.get('isa', '?')}, " \
           f"{machine.get('blas', '?')}), {machine.get('torch_threads', '?')} threads"
    gpu = machine.get('gpu')
    if gpu:
        return f"{gpu['name']} (sm {gpu.get('compute_capability', '?')}, CUDA " \
               f"{gpu.get('cuda', '?')}, driver {gpu.get('driver', '?')}); host {line}"
    return line


def provenance(run: dict, tool_note: str = '') -> str:
    """The lines under a table: command, machine, date, and where transcribed figures came
    from."""
    out = [f"Command: `{run.get('command', 'not recorded')}`{tool_note}.",
           f"Machine: {machine_text(run.get('machine'))}. Date: {run.get('date', 'not recorded')}."]
    if run.get('source'):
        out.append(f"Figures {run['source']}.")
    if run.get('note'):
        out.append(f"Note: {run['note']}.")
    return '\n'.join(out)


# -- formatting -------------------------------------------------------------------------------

def fmt_ms(v: float) -> str:
    """Milliseconds: whole from 1000 up, one decimal from 100, three digits below."""
    if v >= 1000:
        return f'{v:.0f}'
    return f'{v:.1f}' if v >= 100 else f'{v:.3g}'


def fmt_bound(v: float) -> str:
    return f'{v:.0f}' if v >= 100 else f'{v:.3g}'


def fmt_spread(ms: dict) -> str:
    """``median (min-max)`` of a row with ``median_ms`` and perhaps ``min_ms`` / ``max_ms``."""
    text = fmt_ms(ms['median_ms'])
    if ms.get('min_ms') is not None and ms.get('max_ms') is not None:
        text += f" ({fmt_bound(ms['min_ms'])}-{fmt_bound(ms['max_ms'])})"
    return text


def fmt_ratio(ratio, spread=None) -> str:
    if ratio is None:
        return ''
    text = f'{ratio:.2f}'
    if spread:
        text += f' [{spread[0]:.2f}-{spread[1]:.2f}]'
    return text


def markdown_table(header: list, rows: list) -> str:
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    lines += ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows]
    return '\n'.join(lines)


def runtime_key(rt: str):
    base = rt[:-len(' static')] if rt.endswith(' static') else rt
    return (RUNTIMES.index(base) if base in RUNTIMES else len(RUNTIMES), rt != base, rt)


def runtime_label(rt: str) -> str:
    base = rt[:-len(' static')] if rt.endswith(' static') else rt
    return RUNTIME_LABELS.get(base, base) + (' static' if base != rt else '')


def model_label(name: str, kind: str) -> str:
    if name in MODEL_LABELS:
        return MODEL_LABELS[name]
    if kind in KINDS and name != MMDET and not name.endswith('fused') and \
            any(name == p[0] for p in PRESETS):
        return name + ' fused'  # deploy_speed times the mmslab presets fused
    return name


# -- benchmarks/deploy_speed.py ---------------------------------------------------------------

def deploy_ratio(run: dict, kind: str, shape: str, ref: str, model: str, rt: str):
    """``(ratio, spread)`` of ``ref``'s time over ``model``'s in runtime ``rt``: per-round
    ratios where the rows hold the rounds, else the run's recorded ratio (``targets``), else
    the ratio of the medians without a spread."""
    rows = {(r['model'], r['runtime']): r for r in run['rows']
            if r['kind'] == kind and r['shape'] == shape}
    a, b = rows.get((ref, rt)), rows.get((model, rt))
    if a is None or b is None:
        return None, None
    if a.get('rounds_ms') and b.get('rounds_ms'):
        rounds = [x / y for x, y in zip(a['rounds_ms'], b['rounds_ms'])]
        return a['median_ms'] / b['median_ms'], [min(rounds), max(rounds)]
    for t in run.get('targets', []):
        if t['kind'] == kind and t['shape'] == shape and t['what'] == f'{ref} / {model}, {rt}':
            return t['ratio'], t.get('spread')
    return a['median_ms'] / b['median_ms'], None


def deploy_ratio_pair(rows: list, a: tuple, b: tuple):
    """``(ratio, spread)`` of row ``a``'s time over row ``b``'s (``(model, runtime)``)."""
    index = {(r['model'], r['runtime']): r for r in rows}
    ra, rb = index.get(a), index.get(b)
    if ra is None or rb is None:
        return None, None
    if ra.get('rounds_ms') and rb.get('rounds_ms'):
        rounds = [x / y for x, y in zip(ra['rounds_ms'], rb['rounds_ms'])]
        return ra['median_ms'] / rb['median_ms'], [min(rounds), max(rounds)]
    return ra['median_ms'] / rb['median_ms'], None


def deploy_tables(run: dict, kind: str) -> list:
    """Markdown of each shape of ``kind`` in a deploy_speed run: median ms (min-max over the
    rounds), then the speed-up against each reference present."""
    out = []
    shapes = list(dict.fromkeys(r['shape'] for r in run['rows'] if r['kind'] == kind))
    for shape in shapes:
        rows = [r for r in run['rows'] if r['kind'] == kind and r['shape'] == shape]
        models = list(dict.fromkeys(r['model'] for r in rows))
        rts = sorted({r['runtime'] for r in rows}, key=runtime_key)
        cell = {(r['model'], r['runtime']): fmt_spread(r) for r in rows}
        header = [f'{KINDS[kind]} {shape}, ms'] + [runtime_label(rt) for rt in rts]
        out.append(markdown_table(header, [[model_label(m, kind)] + [
            cell.get((m, rt), '') for rt in rts] for m in models]))
        if any(static(rt) for rt in rts):  # --export both: each model's two graphs
            bases = [rt for rt in rts if not static(rt) and rt + ' static' in rts]
            out.append(markdown_table(
                [f'time dynamic / static, {shape} (above 1: static faster)'] +
                [runtime_label(rt) for rt in bases],
                [[model_label(m, kind)] + [fmt_ratio(*deploy_ratio_pair(
                    rows, (m, rt), (m, rt + ' static'))) for rt in bases] for m in models]))
            continue
        for ref in [r for r in REFERENCES if r in models]:
            others = [m for m in models if m not in REFERENCES]
            table = []
            for m in others:
                cells = [fmt_ratio(*deploy_ratio(run, kind, shape, ref, m, rt)) for rt in rts]
                if any(cells):
                    table.append([model_label(m, kind)] + cells)
            if table:
                header = [f'vs {model_label(ref, kind)}, {shape}'] + [
                    runtime_label(rt) for rt in rts]
                out.append(markdown_table(header, table))
    return out


def deploy_block(machine: str, kind: str, runtimes_filter=None) -> str:
    """Every run of ``<machine>-deploy_speed.json`` with cases of ``kind`` (and, where given,
    only the runs whose rows all have a runtime accepted by ``runtimes_filter``)."""
    data = load(f'{machine}-deploy_speed')
    parts = []
    for run in data['runs']:
        rows = [r for r in run['rows'] if r['kind'] == kind]
        if not rows or (runtimes_filter and not all(runtimes_filter(r['runtime'])
                                                    for r in rows)):
            continue
        parts.extend(deploy_tables(run, kind))
        parts.append(provenance(run))
    return '\n\n'.join(parts)


def static(rt: str) -> bool:
    return rt.endswith(' static')


# -- tools/analyze_model.py -------------------------------------------------------------------

def sizes() -> dict:
    """name -> analyze_model run (params and FLOPs unfused / fused)."""
    data = load('analyze_model')
    return {run['name']: run for run in data['runs']} if data else {}


def size_cells(run) -> tuple:
    if run is None:
        return '', ''
    u, f = run['unfused'], run['fused']
    params = f"{u['params'] / 1e6:.2f} -> {f['params'] / 1e6:.2f}"
    flops = f"{u['flops'] / 1e9:.2f} -> {f['flops'] / 1e9:.2f}"
    return params, flops


def block_sizes() -> str:
    data = load('analyze_model')
    rows = [[run['name'], *size_cells(run)] for run in data['runs']]
    shape = 'x'.join(map(str, data['runs'][0]['shape']))
    return '\n\n'.join([
        markdown_table(['backbone', 'params (M), unfused -> fused',
                        f'GFLOPs at {shape}, unfused -> fused'], rows),
        provenance(dict(data['runs'][0], command='python tools/analyze_model.py CONFIG '
                        '--shape 224 224'), ' (each run\'s own command is in '
                   f"`{data['file']}`)")])


# -- tools/benchmark.py and gpu_check ---------------------------------------------------------

def config_label(config: str) -> str:
    v = re.sub(r'^mask_rcnn_|_1x$', '', config)
    return next((p[0] for p in PRESETS if p[1] == v), config)


def block_compile(machine: str) -> str:
    data = load(f'{machine}-benchmark')
    rows, runs = [], []
    for run in data['runs']:
        if 'compile' not in run:
            continue
        runs.append(run)
        for r in run['compile']['first_calls']:
            name = r['variant']
            base = re.match(r'(mask_rcnn_\w+_1x)', name).group(1)
            label = 'LN Swin-T (control)' if 'ln_swin_t' in name else config_label(base)
            label += ', fused' + (', `dynamic=True`' if run['compile']['dynamic'] else '')
            label += f", {'x'.join(map(str, r['shape']))}"
            first = f"{r['first_call_s']:.0f} s" + (f" ({r['note']})" if r.get('note') else '')
            rows.append([label, fmt_ms(r['eager_median_ms']), fmt_ms(r['median_ms']),
                         f"{r['compiled_over_eager']:.2f}", first])
    parts = [markdown_table(['backbone', 'eager, ms', 'compiled, ms', 'compiled / eager',
                             'first call'], rows)]
    parts += [provenance(run) for run in runs]
    train = load(f'{machine}-compile_train_step')
    if train:
        for run in train['runs']:
            med = run['median_ms']
            parts.append(markdown_table(
                ['training step', 'eager, ms', 'compiled, ms', 'compiled / eager',
                 'first compiled step'],
                [[f"{run['model']} depths {run['depths']}, {run['batch']}x{run['shape']}",
                  fmt_ms(med['eager']), fmt_ms(med['compiled']),
                  f"{run['compiled_over_eager']:.2f}", f"{run['first_compiled_step_s']:.0f} s"]]))
            parts.append(provenance(run))
    return '\n\n'.join(parts)


def block_gpu_check(machine: str) -> str:
    data = load(f'{machine}-gpu_check')
    parts = []
    for run in data['runs']:
        rows = [[config_label(r['config']), 'Mask R-CNN' if r['part'] == 'model' else 'backbone',
                 r['precision'], fmt_ms(r['fused_ms']), fmt_ms(r['unfused_ms']),
                 fmt_ms(r['mmdet_swin_t_ms']), fmt_ms(r['ln_control_ms']),
                 f"{r['vs_mmdet']:.2f}", f"{r['vs_control']:.2f}"] for r in run['table']]
        parts.append(markdown_table(
            [f"{run.get('shape', '')}, batch 1", 'part', 'precision', 'fused, ms',
             'unfused, ms', 'mmdet Swin-T, ms', 'LN control, ms', 'x mmdet', 'x control'],
            rows))
        t = run.get('train')
        if t:
            lat = t.get('hook_latency', {})
            parts.append(markdown_table(
                ['demo training on the GPU', 'value'],
                [['iterations, precision', f"{t['iters']}, {t['precision']}"],
                 ['wall time', f"{t['seconds']:.0f} s"],
                 ['loss, first -> last', f"{t['first_loss']:.2f} -> {t['last_loss']:.2f}"],
                 ['fused model, bbox / segm mAP (demo val set)',
                  f"{t['bbox_mAP']:.3f} / {t['segm_mAP']:.3f}"],
                 ['ReparamEvalHook: fused / unfused, ms per image',
                  f"{lat['fused_median_ms']} / {lat['unfused_median_ms']}"],
                 ['largest relative fused-vs-unfused difference',
                  f"{lat['max_relative_difference']:.1e}"]]))
        ct = run.get('cuda_tests')
        if ct:
            parts.append(f"`tests/test_cuda.py`: {ct['passed']} passed in {ct['seconds']} s. "
                         f"mmcv's CUDA ops against the CPU: {'; '.join(run['mmcv_cuda_ops'])}.")
        parts.append(provenance(run))
    return '\n\n'.join(parts)


def block_gpu_graphs(machine: str) -> str:
    data = load(f'{machine}-benchmark')
    parts = []
    for run in data['runs']:
        if 'speedups' not in run or not any('CUDA graph' in s['variant']
                                            for s in run['speedups']):
            continue
        index = {(s['variant'], tuple(s['shape']), s['precision']): s for s in run['speedups']}
        rows = []
        for (variant, shape, prec), s in index.items():
            if not variant.endswith('(fused)'):
                continue
            g = index.get((variant[:-1] + ', CUDA graph)', shape, prec))
            name = config_label(variant.split(' ')[0])
            rows.append([f"{name}, {'x'.join(map(str, shape))}, {prec}",
                         fmt_ms(s['median_ms']), fmt_ratio(s['speedup_vs'].get('ln_swin_t')),
                         fmt_ratio(s['speedup_vs'].get('swin_t')),
                         fmt_ms(g['median_ms']) if g else '',
                         fmt_ratio(g['speedup_vs'].get('ln_swin_t+graph')) if g else '',
                         fmt_ratio(g['speedup_vs'].get('swin_t+graph')) if g else ''])
        parts.append(markdown_table(
            ['fused backbone, batch 1', 'eager, ms', 'x control', 'x mmdet', 'graphed, ms',
             'x control (graphed)', 'x mmdet (graphed)'], rows))
        parts.append(provenance(run))
    return '\n\n'.join(parts)


def block_gpu_batch(machine: str) -> str:
    data = load(f'{machine}-benchmark')
    parts = []
    for run in data['runs']:
        results = [r for r in run.get('results', []) if r.get('batch_size', 1) > 1]
        if not results:
            continue
        med = {(r['variant'], r['precision'], tuple(r['shape']), r['batch_size']): r['median_ms']
               for r in results}
        groups = sorted({(tuple(r['shape']), r['batch_size']) for r in results})
        precs = list(dict.fromkeys(r['precision'] for r in results))
        for shape, batch in groups:
            names = list(dict.fromkeys(r['variant'].split(' ')[0] for r in results))
            rows = []
            for name in names:
                def get(suffix, prec):
                    return med.get((name + suffix, prec, shape, batch))
                cols = [' (fused)', ' (unfused)', ' with swin_t backbone (LN)',
                        ' with ln_swin_t backbone (LN control, fused)']
                row = [config_label(name)]
                for c in cols:
                    row.append(' / '.join(fmt_ms(get(c, p)) for p in precs))
                row.append(' / '.join(f"{get(cols[2], p) / get(cols[0], p):.2f}" for p in precs))
                row.append(' / '.join(f"{get(cols[3], p) / get(cols[0], p):.2f}" for p in precs))
                rows.append(row)
            parts.append(markdown_table(
                [f"backbone {'x'.join(map(str, shape))}, batch {batch}, ms per call "
                 f"({' / '.join(precs)})", 'fused', 'unfused', 'mmdet Swin-T', 'LN control',
                 'x mmdet', 'x control'], rows))
        parts.append(provenance(run))
    return '\n\n'.join(parts)


# -- tools/benchmark_train.py -----------------------------------------------------------------

def train_tables(run: dict) -> str:
    """One benchmark_train.json report: step time and the ratios it recorded."""
    gpu = any('peak_memory_gib' in row for row in run['models'].values())
    mmdet = any(row.get('vs_mmdet_swin') for row in run['models'].values())
    header = ['model', 'step, median ms (min-max)', f"vs {run['reference']}"]
    header += ['vs mmdet Swin-T'] if mmdet else []
    header += ['peak memory, GiB'] if gpu else []
    rows = []
    for name, row in run['models'].items():
        s = row['step_ms']
        cells = [name, f"{fmt_ms(s['median'])} ({fmt_bound(s['min'])}-{fmt_bound(s['max'])})"]
        for key in ('vs_reference', ) + (('vs_mmdet_swin', ) if mmdet else ()):
            r = row.get(key)
            cells.append(fmt_ratio(r['median'], [r['min'], r['max']]) if r else '')
        if gpu:
            cells.append(f"{row['peak_memory_gib']:.2f}" if 'peak_memory_gib' in row else '')
        rows.append(cells)
    shape = 'x'.join(map(str, run['shape']))
    caption = (f"{run['part']} training step (forward, loss, backward), batch {run['batch']} at "
               f"{shape}, {run['precision']}, {run['device']}, progressive norms at "
               f"{run.get('prepbn_progress', '?')} of their decay; ratios: the model's step time "
               "over the reference's" + (" or mmdet Swin-T's" if mmdet else '') +
               " in the same round (> 1: slower), median [min-max] of the rounds.")
    return '\n\n'.join([caption, markdown_table(header, rows), provenance(run)])


def training_block(device_kind: str) -> str:
    """Every ``*-benchmark_train.json`` whose runs ran on ``device_kind`` (``cpu`` or
    ``cuda``)."""
    parts = []
    for name in results_files('benchmark_train'):
        data = load(name)
        runs = [r for r in data['runs'] if str(r.get('device', 'cpu')).startswith(device_kind)]
        for run in runs:
            parts.append(f"**{data['label'] or machine_text(run.get('machine'))}** "
                         f"(`{data['file']}`)")
            parts.append(train_tables(run))
    if not parts:
        return ('No training-step results are committed yet. `tools/benchmark_train.py` '
                'writes `benchmark_train.json`; saved as '
                '`benchmarks/results/<machine>-benchmark_train.json` (with `command` and '
                '`date` added), it is rendered here by `python benchmarks/make_tables.py`.')
    return '\n\n'.join(parts)


# -- benchmarks/gpu_kernels.py ----------------------------------------------------------------

def kernel_runs() -> list:
    """``(file, run)`` of every ``*-gpu_kernels.json`` run, in file order."""
    out = []
    for name in results_files('gpu_kernels'):
        data = load(name)
        out += [(data['file'], run) for run in data['runs']]
    return out


def fmt_times(count, reference) -> str:
    """``count / reference`` as ``1.23``; empty where either is missing."""
    return f'{count / reference:.2f}' if count is not None and reference else ''


def nested(row, *keys):
    """``row[k1][k2]...``; None where a level is missing."""
    for key in keys:
        row = row.get(key) if isinstance(row, dict) else None
    return row


def gpu_kernel_tables(run: dict) -> list:
    """The backbone, whole-model, extra-operator and host-sync tables of one run."""
    rows, parts = run.get('backbones', {}), []
    ctrl, mmdet = rows.get(run['reference']), rows.get(run['mmdet'])
    batches = [str(b) for b in run['infer_batches']]
    shape = 'x'.join(map(str, run['shape']))
    if rows:
        table = []
        for name, row in rows.items():
            cells = [model_label(name, '')]
            for phase in ('mid', 'after'):
                k = nested(row, 'train', phase, 'kernels')
                cells += ['' if k is None else str(k), ' / '.join(
                    fmt_times(k, nested(ref, 'train', phase, 'kernels')) or '-'
                    for ref in (ctrl, mmdet))]
            syncs = [nested(row, 'train', p, 'syncs') for p in ('mid', 'after')]
            cells.append(' / '.join(str(v) for v in syncs) if None not in syncs else '')
            for b in batches:
                k = nested(row, 'infer', b, 'kernels')
                cells += ['' if k is None else str(k),
                          fmt_times(k, nested(ctrl, 'infer', b, 'kernels'))]
            table.append(cells)
        header = ['backbone', f"training step, mid-decay ({run['batch']}x{shape})",
                  'x control / x mmdet', 'after decay', 'x control / x mmdet',
                  'host syncs, mid / after']
        for b in batches:
            header += [f'fused inference, batch {b}', 'x control']
        parts.append(f"GPU kernels of one backbone training step, batch {run['batch']} at "
                     f"{shape}, {run['precision']} autocast, progressive norms mid-decay and "
                     "after the decay, with its host syncs; and of the fused backbone's "
                     "inference forward (float32). x: the row's count over the control's / "
                     "mmdet Swin-T's (above 1: more kernels).")
        parts.append(markdown_table(header, table))
        if ctrl and 'train' in ctrl:
            extra = []
            for name, row in rows.items():
                if name in (run['reference'], run['mmdet']) or 'train' not in row:
                    continue
                ops, base = row['train']['mid']['ops'], ctrl['train']['mid']['ops']
                diff = {op: ops.get(op, 0) - base.get(op, 0) for op in set(ops) | set(base)}
                top = sorted(((d, op) for op, d in diff.items() if d),
                             key=lambda t: (-abs(t[0]), t[1]))[:6]
                extra.append([model_label(name, ''), str(row['train']['mid']['kernels'] -
                                                         ctrl['train']['mid']['kernels']),
                              ', '.join(f'`{op}` {d:+d}' for d, op in top)])
            parts.append(markdown_table(
                ['backbone', 'kernels over the control, mid-decay',
                 'where (operators, calls over the control\'s, largest first)'], extra))
    models = run.get('models', {})
    if models:
        table, sites = [], []
        for name, row in models.items():
            ref = next(r for r in models.values()
                       if r['family'] == row['family'] and r['control'])
            reg, rreg = row['regions'], ref['regions']
            table.append([
                f'`{name}`', f"{row['batch']}x{'x'.join(map(str, row['padded_shape']))}",
                str(row['kernels']), fmt_times(row['kernels'], ref['kernels']),
                str(row['syncs']), str(nested(reg, 'backbone', 'kernels')),
                fmt_times(nested(reg, 'backbone', 'kernels'),
                          nested(rreg, 'backbone', 'kernels')),
                str(nested(reg, 'backbone', 'syncs')),
                str(nested(reg, 'neck', 'kernels') or ''),
                str(nested(reg, 'heads', 'kernels')), str(nested(reg, 'heads', 'syncs')),
                str(nested(reg, 'data_preprocessor', 'syncs'))])
            if row['control']:
                where = {}
                for site, n in row.get('sync_sites', {}).items():
                    key = re.sub(r':\d+ ', ' ', site)  # one row per function
                    where[key] = where.get(key, 0) + n
                sites.append([f'`{name}`', ', '.join(
                    f'`{site}` {n}' for site, n in sorted(where.items(), key=lambda t: -t[1]))])
        parts.append("A whole training iteration at the config's training input and batch "
                     '(data preprocessor, losses with the network parts in bf16, backward; '
                     "progressive norms mid-decay), per part; x: over the family's control's "
                     "count. The heads' host syncs are mmdet's and mmseg's own, by function "
                     'below.')
        parts.append(markdown_table(
            ['whole training iteration', 'input', 'kernels', 'x control', 'host syncs',
             'backbone kernels', 'x control', 'backbone syncs', 'neck kernels',
             'heads kernels', 'heads syncs', 'data preprocessor syncs'], table))
        parts.append(markdown_table(['host syncs of a training iteration, by function',
                                     'calls'], sites))
    git = run.get('git', {})
    changed = len(git.get('changed_files', []))
    parts.append(provenance(run) + f"\nTree: commit `{(git.get('commit') or '?')[:10]}`"
                 + (f' with {changed} changed files' if changed else '')
                 + f", torch {run.get('torch', '?')}.")
    return parts


def block_gpu_kernels() -> str:
    parts = []
    for path, run in kernel_runs():
        parts.append(f'`{path}`')
        parts.extend(gpu_kernel_tables(run))
    if not parts:
        return ('No kernel counts are committed yet: `python benchmarks/gpu_kernels.py` '
                'writes `benchmarks/results/<machine>-gpu_kernels.json`.')
    return '\n\n'.join(parts)


# -- demo accuracy ----------------------------------------------------------------------------

def block_demo_accuracy() -> str:
    parts = []
    for name in results_files('int8_accuracy'):
        data = load(name)
        for run in data['runs']:
            for config, forms in run['results'].items():
                keys = list(next(iter(forms.values())))
                present = [f for f in FORMS if f in forms]
                fmt = (lambda v: f'{v:.3f}') if keys[0].startswith('coco') else \
                    (lambda v: f'{v:.2f}')
                label = ' / '.join(k.replace('coco/', '').replace('_', ' ') for k in keys)
                parts.append(markdown_table(
                    [f'`{config}`, {label}'] + [FORM_LABELS[f] for f in present],
                    [['50 validation images'] + [
                        ' / '.join(fmt(forms[f][k]) for k in keys) for f in present]]))
            parts.append(provenance(run))
        test = load(name.replace('int8_accuracy', 'test'))
        for run in (test or {}).get('runs', []):
            m = run['metrics']
            form = FORM_LABELS.get(f"{run['backend']} {run['precision']}", run['backend'])
            parts.append(f"`{run['config']}` in {form}, evaluated by `tools/test.py`: bbox / "
                         f"segm mAP {m['coco/bbox_mAP']:.3f} / {m['coco/segm_mAP']:.3f}.")
            parts.append(provenance(run))
    return '\n\n'.join(parts)


# -- the README's model table -----------------------------------------------------------------

def kernel_note(kernels) -> str:
    """The model table's note on its kernel column."""
    if not kernels:
        return ''
    run = kernels[0][1]
    return (f"GPU kernels: those one backbone training step (forward and backward, batch "
            f"{run['batch']} at {'x'.join(map(str, run['shape']))}, bf16 autocast, progressive "
            "norms mid-decay) launches on a GPU, counted on the CPU "
            "(`benchmarks/gpu_kernels.py`, [GPU kernels per training step]"
            "(docs/benchmarks.md#gpu-kernels-per-training-step)), and the count over the "
            "control's. ")


def block_model_table() -> str:
    size = sizes()
    cpu = load('amd-epyc-deploy_speed')['runs'][0]
    cpu_rows = {r['model']: r for r in cpu['rows']
                if r['kind'] == 'backbone' and r['shape'] == '512x512' and r['runtime'] == 'eager'}
    gpu = next(run for run in load('nvidia-h100-benchmark')['runs'] if 'speedups' in run)
    gpu_rows = {config_label(s['variant'].split(' ')[0]): s for s in gpu['speedups']
                if s['variant'].endswith('(fused)') and s['shape'] == [512, 512]
                and s['precision'] == 'fp32'}
    demo = load('amd-epyc-int8_accuracy')['runs'][0]['results']
    kernels = kernel_runs()
    kernel_rows = kernels[0][1].get('backbones', {}) if kernels else {}
    kernel_ctrl = nested(kernel_rows, CONTROL, 'train', 'mid', 'kernels')
    seg = load('intel-xeon-amx-int8_accuracy')['runs'][0]['results']
    rows = []
    for name, variant, _ in [(MMDET, None, None), ('LN Swin-T (control)', 'swin_t', None)] + \
            PRESETS:
        key = CONTROL if name.startswith('LN') else name
        params, flops = size_cells(size.get(name))
        c = cpu_rows.get(key)
        cpu_ms = fmt_ms(c['median_ms']) if c else ''
        cpu_vs = ''
        if c and key not in (MMDET, CONTROL):
            cpu_vs = ' / '.join(fmt_ratio(deploy_ratio(cpu, 'backbone', '512x512', ref, key,
                                                       'eager')[0]) for ref in (MMDET, CONTROL))
        elif c and key == CONTROL:
            cpu_vs = fmt_ratio(deploy_ratio(cpu, 'backbone', '512x512', MMDET, key,
                                            'eager')[0]) + ' / -'
        g = gpu_rows.get(name)
        gpu_ms = fmt_ms(g['median_ms']) if g else ''
        gpu_vs = ' / '.join(fmt_ratio(g['speedup_vs'][k]) for k in ('swin_t', 'ln_swin_t')) \
            if g else ''
        acc = ''
        if variant:
            det = demo.get(f'mask_rcnn_{variant}_demo', {}).get('pytorch fused')
            sem = seg.get(f'upernet_{variant}_demo', {}).get('pytorch fused')
            acc = '; '.join(
                ([f"Mask R-CNN {det['coco/bbox_mAP']:.3f} / {det['coco/segm_mAP']:.3f}"]
                 if det else []) + ([f"UperNet {sem['mIoU']:.2f} mIoU"] if sem else []))
        configs = f'`{variant}`' if variant and glob.glob(
            osp.join(REPO, 'configs', f'*_{variant}_*.py')) else ''
        k = nested(kernel_rows, key, 'train', 'mid', 'kernels')
        kernel_cell = f'{k} ({fmt_times(k, kernel_ctrl)})' if k is not None else ''
        rows.append([name, params, flops, cpu_ms, cpu_vs, gpu_ms, gpu_vs, kernel_cell, acc,
                     configs])
    header = ['backbone', 'params (M)', 'GFLOPs', 'CPU ms', 'CPU x mmdet / x control',
              'GPU ms', 'GPU x mmdet / x control',
              'GPU kernels per training step (x control)', 'demo accuracy', 'configs `V`']
    notes = (
        f"Parameters and GFLOPs: backbone at 224x224, unfused -> fused (`tools/analyze_model.py`). "
        f"CPU: the backbone (mmslab's fused) at 512x512, batch 1, eager PyTorch fp32, median "
        f"ms on "
        f"{machine_text(cpu['machine'])}, {cpu['date']} (`benchmarks/deploy_speed.py`). "
        f"GPU: the same on {machine_text(gpu['machine']).split(' (')[0]}, {gpu['date']} "
        f"(`tools/benchmark.py`). x = the reference's time over the row's. "
        f"{kernel_note(kernels)}Demo accuracy: "
        f"fused PyTorch on the synthetic demo sets (bbox / segm mAP, mIoU), not COCO or ADE20K. "
        f"Sources: `benchmarks/results/`.")
    return markdown_table(header, rows) + '\n\n' + notes


#: Generated blocks: NAME -> function returning the Markdown between the markers.
BLOCKS = {
    'model-table': block_model_table,
    'sizes': block_sizes,
    'epyc-backbones': lambda: deploy_block('amd-epyc', 'backbone'),
    'epyc-maskrcnn': lambda: deploy_block('amd-epyc', 'maskrcnn'),
    'xeon-backbones': lambda: deploy_block('intel-xeon-amx', 'backbone',
                                           lambda rt: not static(rt)),
    'xeon-maskrcnn': lambda: deploy_block('intel-xeon-amx', 'maskrcnn'),
    'xeon-dynamic-static': lambda: xeon_dynamic_static(),
    'xeon-upernet': lambda: deploy_block('intel-xeon-amx', 'upernet'),
    'xeon-compile': lambda: block_compile('intel-xeon-amx'),
    'demo-accuracy': block_demo_accuracy,
    'gpu-check': lambda: block_gpu_check('nvidia-h100'),
    'gpu-graphs': lambda: block_gpu_graphs('nvidia-h100'),
    'gpu-batch': lambda: block_gpu_batch('nvidia-h100'),
    'training-speed': lambda: training_block('cpu'),
    'training-speed-gpu': lambda: training_block('cuda'),
    'gpu-kernels': block_gpu_kernels,
}


def xeon_dynamic_static() -> str:
    """The run that timed static exports beside dynamic ones."""
    data = load('intel-xeon-amx-deploy_speed')
    parts = []
    for run in data['runs']:
        if any(static(r['runtime']) for r in run['rows']):
            parts.extend(deploy_tables(run, 'backbone'))
            parts.append(provenance(run))
    return '\n\n'.join(parts)


# -- the docs ---------------------------------------------------------------------------------

MARKER = re.compile(r'<!-- ([\w-]+):begin -->\n(.*?)<!-- \1:end -->', re.S)


def render(text: str) -> str:
    """``text`` with every generated block rewritten; an unknown block name is an error."""
    def sub(m):
        name = m.group(1)
        if name not in BLOCKS:
            raise KeyError(f'unknown generated block {name!r}; known: {sorted(BLOCKS)}')
        return f'<!-- {name}:begin -->\n{BLOCKS[name]().rstrip()}\n<!-- {name}:end -->'
    return MARKER.sub(sub, text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--check', action='store_true',
                   help='write nothing; exit 1 with a diff where a doc differs')
    args = p.parse_args(argv)
    stale = 0
    for doc in DOCS:
        path = osp.join(REPO, doc)
        with open(path) as f:
            old = f.read()
        new = render(old)
        if new == old:
            continue
        if args.check:
            stale += 1
            sys.stdout.writelines(difflib.unified_diff(
                old.splitlines(True), new.splitlines(True), doc, doc + ' (generated)'))
        else:
            with open(path, 'w') as f:
                f.write(new)
            print(f'updated {doc}')
    if stale:
        print(f'{stale} doc(s) differ from benchmarks/results/: run '
              'python benchmarks/make_tables.py')
    return 1 if stale else 0


if __name__ == '__main__':
    sys.exit(main())
