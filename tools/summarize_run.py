"""Summarize a training run: final metrics, fused vs unfused latency, and a plot.

    python tools/summarize_run.py WORK_DIR [--elapsed SECONDS]

Reads mmengine's ``vis_data/scalars.json`` of the newest run in WORK_DIR and the hook's
``latency.json``; prints the figures and writes ``summary.json`` and ``summary.png``.
"""
import argparse
import glob
import json
import os.path as osp

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
                    f"unfused {row['unfused_ms']:.0f} ms ({row['unfused_ms'] / row['fused_ms']:.2f}x)")
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
    summary['deployed'] = deployed_rows(args.work_dir)
    pred_png = osp.join(args.work_dir, 'predictions', 'predictions.png')
    if osp.exists(pred_png):
        summary['predictions'] = pred_png
    if args.elapsed:
        print(f'wall time          {args.elapsed / 60:.1f} min')
    png = osp.join(args.work_dir, 'summary.png')
    plot(train, evals, latency, png, summary.get('full_size_latency'))
    with open(osp.join(args.work_dir, 'summary.json'), 'w') as f:
        json.dump(summary, f, indent=2)
    print(f"logs, checkpoints: {osp.abspath(args.work_dir)}\nlatency:  {lat_path}\n"
          f"plot:     {png}\nsummary:  {osp.join(args.work_dir, 'summary.json')}")
    if 'predictions' in summary:
        print(f"predictions of the fused model: {summary['predictions']}")
    print('=' * 72)
    return summary


def deployed_rows(work_dir):
    """The whole exported model (``tools/export_onnx.py --latency``, ``export/export.json``)
    next to eager PyTorch, and the deployed model's metrics (``tools/test.py --backend``,
    ``deployed_*/metrics.json``); printed, returned for the summary."""
    rows = {}
    export_json = osp.join(work_dir, 'export', 'export.json')
    if osp.exists(export_json):
        with open(export_json) as f:
            latency = json.load(f).get('latency')
        if latency:
            ms = latency['median_ms']
            eager = ms.get('eager fp32')
            line = ', '.join(f"{k} {v:.0f} ms" + (f' ({eager / v:.2f}x)' if eager and k !=
                                                   'eager fp32' else '')
                             for k, v in ms.items())
            print(f"deployed   whole model {latency['shape']}: {line}")
            rows['latency'] = latency
    for path in sorted(glob.glob(osp.join(work_dir, 'deployed_*', 'metrics.json'))):
        with open(path) as f:
            metrics = json.load(f)
        name = osp.basename(osp.dirname(path))[len('deployed_'):]
        keys = [k for k in ('coco/bbox_mAP', 'coco/segm_mAP', 'mIoU') if k in metrics]
        print(f'deployed   {name:18s} ' + ', '.join(f'{k} {metrics[k]:.3f}' for k in keys))
        rows[name] = {k: metrics[k] for k in keys}
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


def plot(train, evals, latency, path, full_size=None):
    with saved_figure(path, ncols=3 if full_size else 2,
                      figsize=(16 if full_size else 11, 4)) as (fig, axes):
        axes = axes[0]
        if train:
            axes[0].plot([r['iter'] for r in train], [r['loss'] for r in train], label='loss')
            axes[0].set_xlabel('iteration')
            axes[0].set_ylabel('training loss')
            axes[0].grid(alpha=0.3)
            axes[0].set_title('training loss')
        if latency and latency.get('fused', {}).get('count'):
            names, values = ['fused'], [latency['fused']['median_ms']]
            if latency.get('unfused', {}).get('count'):
                names.append('unfused')
                values.append(latency['unfused']['median_ms'])
            axes[1].bar(names, values, color=['tab:green', 'tab:gray'][:len(values)])
            axes[1].set_ylabel('median ms per image')
            axes[1].set_title('inference latency, demo images')
        if full_size:
            series = [('fused', 'fused_ms'), ('unfused', 'unfused_ms'),
                      ('mmdet Swin-T', 'baseline_ms'), ('LN control', 'control_ms')]
            grouped_bars(axes[2], [f"{r['part']}\n{r['shape']}" for r in full_size],
                         {name: [r.get(key, 0.0) for r in full_size] for name, key in series},
                         color=['tab:green', 'tab:gray', 'tab:blue', 'tab:orange'])
            axes[2].set_ylabel('median ms per image')
            axes[2].set_title('latency at the full test size')
            axes[2].legend(fontsize=8)


if __name__ == '__main__':
    main()
