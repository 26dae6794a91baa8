"""Accuracy of the deployed models: fused PyTorch vs onnxruntime / OpenVINO, fp32 vs bf16
vs INT8.

    python benchmarks/int8_accuracy.py [--configs ...] [--calib-images 16] [--forms ...]
        [--out DIR]

For each demo config (default: SLAB-Swin-T, PRepBN-Swin-T, RePa-Swin-T and the LayerNorm
Swin-T baseline Mask R-CNN, all with the same heads, data and schedule; the UperNet demo
works too) it trains the model with tools/train.py unless
``work_dirs/<config>/last_checkpoint`` exists, exports the whole model with
tools/export_onnx.py (free input size; ``--int8``: onnxruntime static QDQ and NNCF,
calibrated on ``--calib-images`` training images), and evaluates it on the demo validation
set with tools/test.py in every form (bbox / segm mAP, or mIoU / aAcc): fused PyTorch fp32
and bf16 (``--precision bf16``: autocast), onnxruntime fp32 / INT8, OpenVINO fp32 / bf16 /
INT8. The bf16 forms run where the CPU has avx512_bf16 / amx_bf16 and are skipped (and
listed as skipped in the JSON) elsewhere; onnxruntime has no bf16 on x86. Does the
BatchNorm-only model quantize better, as the SLAB paper suggests? Prints the table, writes
``int8_accuracy.json`` and ``.png``.
"""
import argparse
import json
import os
import os.path as osp
import subprocess
import sys

from mmslab.utils.plotting import grouped_bars, saved_figure

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
PREFIX = 'mmslab-test-metrics: '
DEFAULT_CONFIGS = [f'configs/demo/mask_rcnn_{v}_demo.py'
                   for v in ('slab_swin_t', 'prepbn_swin_t', 'repa_swin_t', 'swin_t')]
FORMS = [('pytorch fused', []),
         ('pytorch bf16', ['--precision', 'bf16']),
         ('onnxruntime fp32', ['--backend', 'onnxruntime', '--precision', 'fp32']),
         ('onnxruntime int8', ['--backend', 'onnxruntime', '--precision', 'int8']),
         ('openvino fp32', ['--backend', 'openvino', '--precision', 'fp32']),
         ('openvino bf16', ['--backend', 'openvino', '--precision', 'bf16']),
         ('openvino int8', ['--backend', 'openvino', '--precision', 'int8'])]
FORM_NAMES = [f for f, _ in FORMS]
#: the fp32 reference of each lower-precision form
REFERENCE = {'pytorch bf16': 'pytorch fused', 'onnxruntime int8': 'onnxruntime fp32',
             'openvino bf16': 'openvino fp32', 'openvino int8': 'openvino fp32'}


def run(args, log):
    with open(log, 'a') as f:
        proc = subprocess.run([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        f.write(proc.stdout)
    if proc.returncode:
        raise SystemExit(f'failed ({proc.returncode}): {" ".join(args)}; see {log}')
    return proc.stdout


def short_schedule(config: str, iters) -> list:
    """``--cfg-options`` that shrink the demo schedule to ``iters`` iterations."""
    if not iters:
        return []
    from mmengine.config import Config
    cfg = Config.fromfile(osp.join(REPO, config))
    full = cfg.train_cfg.max_iters
    scale = iters / full
    opts = [f'train_cfg.max_iters={iters}', f'train_cfg.val_interval={iters}',
            f'default_hooks.checkpoint.interval={iters}',
            'param_scheduler.1.milestones=[' + ','.join(
                str(int(m * scale)) for m in cfg.param_scheduler[1].milestones) + ']',
            f'param_scheduler.1.end={iters}']
    for key in ('norm_cfg', 'out_norm_cfg'):
        norm = cfg.model.backbone.get(key) or {}
        if norm.get('type') == 'PRepBN':
            opts += [f'model.backbone.{key}.step={max(1, int(norm["step"] * scale))}',
                     f'model.backbone.{key}.warmup={int(norm.get("warmup", 0) * scale)}']
    return ['--cfg-options', *opts]


def metrics_of(output: str) -> dict:
    lines = [ln for ln in output.splitlines() if ln.startswith(PREFIX)]
    if not lines:
        raise SystemExit('tools/test.py printed no metrics')
    return json.loads(lines[-1][len(PREFIX):])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--configs', nargs='+', default=DEFAULT_CONFIGS)
    p.add_argument('--calib-images', type=int, default=16)
    p.add_argument('--train-iters', type=int, default=None,
                   help='train the models that need training for this many iterations '
                   '(default: the config\'s 200), with the PRepBN schedule and the lr steps '
                   'scaled to match')
    p.add_argument('--forms', nargs='+', choices=FORM_NAMES, default=FORM_NAMES,
                   help='the deployed forms to evaluate (default: all; the bf16 forms only '
                   'where the CPU has avx512_bf16 / amx_bf16)')
    p.add_argument('--out', default='work_dirs/int8_accuracy')
    args = p.parse_args(argv)
    from mmslab.utils.machine import has_bf16, machine_info
    skipped = [] if has_bf16() else [f for f in args.forms if 'bf16' in f]
    if skipped:
        print(f'skipping {", ".join(skipped)}: this CPU has neither avx512_bf16 nor amx_bf16',
              flush=True)
    forms = [(f, extra) for f, extra in FORMS if f in args.forms and f not in skipped]
    os.makedirs(args.out, exist_ok=True)
    log = osp.abspath(osp.join(args.out, 'log.txt'))
    results = {}
    for config in args.configs:
        name = osp.splitext(osp.basename(config))[0]
        work = osp.join('work_dirs', name)
        last = osp.join(REPO, work, 'last_checkpoint')
        if not osp.exists(last):
            print(f'{name}: training (tools/train.py)', flush=True)
            run([osp.join('tools', 'train.py'), config, '--work-dir', work,
                 *short_schedule(config, args.train_iters)], log)
        ckpt = open(last).read().strip()
        export_dir = osp.join(args.out, name)
        if any('--backend' in extra for _, extra in forms):
            print(f'{name}: exporting and quantizing', flush=True)
            run([osp.join('tools', 'export_onnx.py'), config, ckpt, '--out', export_dir,
                 '--int8', '--calib-images', str(args.calib_images)], log)
        results[name] = {}
        for form, extra in forms:
            test_work = osp.join(args.out, name, 'test_' + form.replace(' ', '_'))
            runtime = ['--export-dir', export_dir] if '--backend' in extra else []
            out = run([osp.join('tools', 'test.py'), config, ckpt, *runtime,
                       '--work-dir', test_work, *extra], log)
            m = metrics_of(out)
            results[name][form] = {k: m[k] for k in metric_keys(m)}
            print(f'  {form:18s} ' + '  '.join(f'{k} {m[k]:.3f}' for k in metric_keys(m)),
                  flush=True)
    print_table(results)
    with open(osp.join(args.out, 'int8_accuracy.json'), 'w') as f:
        json.dump(dict(calib_images=args.calib_images, part='model', dynamic=True,
                       machine=machine_info(), skipped_forms=skipped, results=results), f,
                  indent=2)
    plot(results, osp.join(args.out, 'int8_accuracy.png'))
    return results


def metric_keys(metrics: dict):
    """bbox / segm mAP of a detector, mIoU / aAcc of a segmentor."""
    det = ('coco/bbox_mAP', 'coco/segm_mAP')
    return [k for k in det if k in metrics] or [k for k in ('mIoU', 'aAcc') if k in metrics]


def present_forms(results):
    return [f for f in FORM_NAMES if any(f in r for r in results.values())]


def print_table(results):
    forms = present_forms(results)
    print('\nmetrics on the demo validation set (bbox / segm mAP, or mIoU / aAcc)')
    print('  ' + 'model'.ljust(28) + ''.join(f.rjust(19) for f in forms))
    for name, r in results.items():
        print('  ' + name.ljust(28) + ''.join(
            (' / '.join(f'{v:.3f}' for v in r[f].values()) if f in r else '-').rjust(19)
            for f in forms))
    for name, r in results.items():
        for form, ref in REFERENCE.items():
            if form in r and ref in r:
                key = next(iter(r[ref]))
                d = r[form][key] - r[ref][key]
                print(f'  {name} {form} - {ref}: {key} {d:+.3f}')


def plot(results, path):
    names = list(results)
    with saved_figure(path, figsize=(10, 4)) as (fig, axes):
        ax = axes[0][0]
        grouped_bars(ax, [n.replace('mask_rcnn_', '').replace('_demo', '') for n in names],
                     {form: [next(iter(results[n][form].values()), 0.0)
                             if form in results[n] else 0.0 for n in names]
                      for form in present_forms(results)})
        ax.set_ylabel('bbox mAP or mIoU (demo val)')
        ax.legend(fontsize=8)
        ax.grid(axis='y', alpha=0.3)


if __name__ == '__main__':
    main()
