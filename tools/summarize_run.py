"""Summarize a training run: final metrics, fused vs unfused latency, the deployed model,
and a plot.

    python tools/summarize_run.py WORK_DIR [--elapsed SECONDS]

Reads from WORK_DIR (as ``tools/demo.sh`` fills it) mmengine's ``vis_data/scalars.json`` of
the newest run and the hook's ``latency.json``, and where present
``full_size_speed/benchmark.json`` (``tools/benchmark.py``), ``export/export.json`` (its
``latency``: the whole model in eager PyTorch and each exported form, and the form chosen
for this machine with the comparison behind it, ``tools/export_onnx.py --latency``) and
``deployed_*/metrics.json`` / ``latency.json`` (``tools/test.py --backend``: the deployed
model's metrics and per-image latency); prints the figures and writes ``summary.json`` and
``summary.png``.
"""
import argparse
import glob
import json
import os.path as osp

from mmslab.deploy.export_info import read_export_info
from mmslab.utils.plotting import grouped_bars, saved_figure


def load_scalars(work_dir):
    runs = sorted(glob.glob(osp.join(work_dir, '*', 'vis_data', 'scalars.json')))
    if not runs:
        raise SystemExit(f'no mmengine run (*/vis_data/scalars.json) found in {work_dir}')
    with open(runs[-1]) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('work_dir')
    p.add_argument('--elapsed', type=float, help='wall time of the run in seconds')
    args = p.parse_args(argv)
    records = load_scalars(args.work_dir)
    train = [r for r in records if 'loss' in r]
    evals = [r for r in records if 'loss' not in r and any(
        k.endswith('mAP') or k.endswith('mIoU') for k in r)]
    final = evals[-1] if evals else {}
    latency = None
    lat_path = osp.join(args.work_dir, 'latency.json')
    if osp.exists(lat_path):
        with open(lat_path) as f:
            latency = json.load(f)
    summary = dict(work_dir=osp.abspath(args.work_dir), elapsed_s=args.elapsed,
                   final_metrics={k: v for k, v in final.items() if isinstance(v, (int, float))},
                   latency=latency, iterations=train[-1].get('iter') if train else None)
    print('=' * 72)
    for key in ('coco/bbox_mAP', 'coco/bbox_mAP_50', 'coco/segm_mAP', 'coco/segm_mAP_50',
                'mIoU', 'aAcc'):
        if key in final:
            print(f'{key:20s} {final[key]:.3f}  (fused model, evaluated through ReparamEvalHook)')
    if latency:
        fused, unfused = latency.get('fused', {}), latency.get('unfused', {})
        if fused.get('count'):
            print(f"latency per image  fused:   median {fused['median_ms']:.1f} ms "
                  f"(p90 {fused['p90_ms']:.1f}, {fused['images_per_s']:.2f} img/s, "
                  f"{fused['count']} images)")
        if unfused.get('count'):
            print(f"latency per image  unfused: median {unfused['median_ms']:.1f} ms "
                  f"-> speed-up {latency.get('speedup_median', float('nan')):.2f}x")
    full = None
    full_path = osp.join(args.work_dir, 'full_size_speed', 'benchmark.json')
    if osp.exists(full_path):
        with open(full_path) as f:
            full = json.load(f)
        summary['full_size_latency'] = full_size_rows(full)
        for row in summary['full_size_latency']:
            line = (f"{row['part']:8s} {row['shape']}: fused {row['fused_ms']:.0f} ms, "
                    f"unfused {row['unfused_ms']:.0f} ms "
                    f"({row['unfused_ms'] / row['fused_ms']:.2f}x)")
            if row.get('baseline_ms'):
                line += (f", mmdet Swin-T {row['baseline_ms']:.0f} ms "
                         f"({row['baseline_ms'] / row['fused_ms']:.2f}x)")
            if row.get('control_ms'):
                line += (f", LN control {row['control_ms']:.0f} ms "
                         f"({row['control_ms'] / row['fused_ms']:.2f}x)")
            print(f'full size  {line}')
        print(f"           ({full['machine']['cpu']}, {full['threads']} threads, median of "
              f"{full['repeat']} interleaved runs, trained weights; the baseline has random "
              'weights)')
    summary['deployed'] = deployed = deployed_rows(args.work_dir, final)
    pred_png = osp.join(args.work_dir, 'predictions', 'predictions.png')
    if osp.exists(pred_png):
        summary['predictions'] = pred_png
    if args.elapsed:
        print(f'wall time          {args.elapsed / 60:.1f} min')
    png = osp.join(args.work_dir, 'summary.png')
    plot(train, evals, latency, png, summary.get('full_size_latency'), deployed)
    with open(osp.join(args.work_dir, 'summary.json'), 'w') as f:
        json.dump(summary, f, indent=2)
    print(f"logs, checkpoints: {osp.abspath(args.work_dir)}\nlatency:  {lat_path}\n"
          f"plot:     {png}\nsummary:  {osp.join(args.work_dir, 'summary.json')}")
    if 'predictions' in summary:
        print(f"predictions of the fused model: {summary['predictions']}")
    print('=' * 72)
    return summary


def deployed_rows(work_dir, fused_metrics=None):
    """The whole exported model (``tools/export_onnx.py --latency``, ``export/export.json``)
    next to eager PyTorch, and per ``deployed_<name>/`` (``tools/test.py --backend``) the
    deployed model's metrics (``metrics.json``) and per-image latency on the test images
    (``latency.json``); printed, returned for the summary and the plot."""
    rows = {}
    export_dir = osp.join(work_dir, 'export')
    if osp.exists(osp.join(export_dir, 'export.json')):
        latency = read_export_info(export_dir).get('latency')
        if latency:
            ms = latency['median_ms']
            eager = ms.get('eager fp32')
            line = ', '.join(f"{k} {v:.0f} ms" + (f' ({eager / v:.2f}x)' if eager and k !=
                                                   'eager fp32' else '')
                             for k, v in ms.items())
            print(f"deployed   whole model {latency['shape']}: {line}")
            rows['latency'] = latency
            choice = latency.get('deploy')
            if choice:
                print(f"deployed   chosen: {choice['runtime']} {choice['precision']} "
                      f"({choice['reason']})")
    for path in sorted(glob.glob(osp.join(work_dir, 'deployed_*', 'metrics.json'))):
        with open(path) as f:
            metrics = json.load(f)
        name = osp.basename(osp.dirname(path))[len('deployed_'):]
        keys = [k for k in ('coco/bbox_mAP', 'coco/segm_mAP', 'mIoU') if k in metrics]
        line = ', '.join(f'{k} {metrics[k]:.3f}' for k in keys)
        if fused_metrics and all(k in fused_metrics for k in keys):
            line += ' (fused PyTorch ' + ', '.join(f'{fused_metrics[k]:.3f}' for k in keys) + ')'
        print(f'deployed   {name:18s} {line}')
        rows[name] = {k: metrics[k] for k in keys}
        lat_path = osp.join(osp.dirname(path), 'latency.json')
        if osp.exists(lat_path):
            with open(lat_path) as f:
                lat = json.load(f)
            timed, unfused = lat.get('fused', {}), lat.get('unfused', {})
            if timed.get('count'):
                rows[name]['latency'] = dict(
                    timed=lat.get('timed', name), median_ms=timed['median_ms'],
                    unfused_median_ms=unfused.get('median_ms'), images=timed['count'])
                line = (f"deployed   {name:18s} latency per image: median "
                        f"{timed['median_ms']:.1f} ms ({lat.get('timed', name)})")
                if unfused.get('count'):
                    line += (f", unfused PyTorch {unfused['median_ms']:.1f} ms "
                             f"({unfused['median_ms'] / timed['median_ms']:.2f}x)")
                print(line)
    return rows


def full_size_rows(report):
    """Per part and shape: fused, unfused and LayerNorm-baseline medians of tools/benchmark.py."""
    rows = {}
    for r in report['results']:
        key = (r['part'], 'x'.join(map(str, r['shape'])))
        row = rows.setdefault(key, dict(part=key[0], shape=key[1]))
        if r['variant'].endswith('(fused)'):
            row['fused_ms'] = r['median_ms']
        elif r['variant'].endswith('(unfused)'):
            row['unfused_ms'] = r['median_ms']
        elif 'backbone (LN)' in r['variant']:
            row['baseline_ms'] = r['median_ms']
        elif '(LN control' in r['variant']:
            row['control_ms'] = r['median_ms']
    return [r for r in rows.values() if 'fused_ms' in r and 'unfused_ms' in r]


def plot(train, evals, latency, path, full_size=None, deployed=None):
    """Training loss; latency on the demo images (fused, unfused and each deployed model the
    work dir evaluated); at the full test size: fused / unfused / baselines, and the whole
    model in eager PyTorch and in each exported form."""
    deployed = deployed or {}
    whole = deployed.get('latency')
    ncols = 2 + bool(full_size) + bool(whole)
    with saved_figure(path, ncols=ncols, figsize=(5.5 * ncols, 4.5)) as (fig, axes):
        axes = list(axes[0])
        loss_ax, demo_ax = axes[:2]
        if train:
            loss_ax.plot([r['iter'] for r in train], [r['loss'] for r in train], label='loss')
            loss_ax.set_xlabel('iteration')
            loss_ax.set_ylabel('training loss')
            loss_ax.grid(alpha=0.3)
            loss_ax.set_title('training loss')
        names, values, colors = [], [], []
        if latency and latency.get('fused', {}).get('count'):
            names.append('fused')
            values.append(latency['fused']['median_ms'])
            colors.append('tab:green')
            if latency.get('unfused', {}).get('count'):
                names.append('unfused')
                values.append(latency['unfused']['median_ms'])
                colors.append('tab:gray')
        for name, row in deployed.items():
            if name != 'latency' and row.get('latency'):
                names.append(name.replace('_', ' ') + '\n(deployed)')
                values.append(row['latency']['median_ms'])
                colors.append('tab:purple')
        if values:
            demo_ax.bar(names, values, color=colors)
            for i, v in enumerate(values):
                demo_ax.annotate(f'{v:.0f}', (i, v), ha='center', va='bottom', fontsize=8)
            demo_ax.set_ylabel('median ms per image')
            demo_ax.set_title('inference latency, demo test images')
        col = 2
        if full_size:
            ax = axes[col]
            col += 1
            series = [('fused', 'fused_ms'), ('unfused', 'unfused_ms'),
                      ('mmdet Swin-T', 'baseline_ms'), ('LN control', 'control_ms')]
            grouped_bars(ax, [f"{r['part']}\n{r['shape']}" for r in full_size],
                         {name: [r.get(key, 0.0) for r in full_size] for name, key in series},
                         color=['tab:green', 'tab:gray', 'tab:blue', 'tab:orange'])
            ax.set_ylabel('median ms per image')
            ax.set_title('latency at the full test size')
            ax.legend(fontsize=8)
        if whole:
            ax = axes[col]
            ms = whole['median_ms']
            eager = ms.get('eager fp32')
            labels = [k.replace('onnxruntime', 'ORT').replace('openvino', 'OpenVINO')
                      .replace(' ', '\n') for k in ms]
            choice = whole.get('deploy') or {}
            chosen = f"{choice.get('runtime')} {choice.get('precision')}"
            ax.bar(labels, list(ms.values()),
                   color=['tab:gray' if k.startswith('eager') else
                          'tab:green' if k == chosen else 'tab:purple' for k in ms])
            for i, (k, v) in enumerate(ms.items()):
                note = f'{v:.0f}' + (f'\n{eager / v:.2f}x' if eager and k != 'eager fp32' else '')
                ax.annotate(note, (i, v), ha='center', va='bottom', fontsize=8)
            ax.set_ylabel('median ms per image')
            ax.set_title(f"deployed whole model, {whole['shape']}" +
                         (' (green: deployed)' if choice else ''))
            ax.margins(y=0.2)


if __name__ == '__main__':
    main()
