"""The GPU acceptance check (``bash tools/gpu_check.sh`` installs first, then runs this).

    python tools/gpu_check.py [--iters 200] [--repeat 20] [--warmup 5] [--shape 800x1333]
        [--configs CONFIG ...] [--skip-train] [--step-timeout S] [--out work_dirs/gpu_check]

1. mmcv's CUDA ops (nms, roi_align, sigmoid_focal_loss) against their CPU results, and
   ``tests/test_cuda.py`` (the backbones on CUDA: mmdet equivalence, fp16 AMP steps, exact
   fusion, SLA against its formula, the fusion check with TF32 on);
2. the demo SLAB-Swin-T Mask R-CNN trained with ``--amp`` on CUDA (``tools/dist_train.sh``
   with 2 processes when 2+ GPUs), validated with the fused model through
   ``ReparamEvalHook`` (its latency.json);
3. the configs users train (:data:`REAL_CONFIGS`: Mask R-CNN and RetinaNet with the LayerNorm
   control, PRepBN-, SLAB-, RePa-Swin-T and PRepBN-PVT-T, UperNet with the control and
   SLAB-Swin-T), each trained ``--real-iters`` iterations with ``--amp`` at the config's own
   input size on the synthetic sets (progressive norms mid-decay), then validated through
   ``ReparamEvalHook``: s/iter, peak memory and the fusion check's difference per config,
   next to its family's control;
4. ``tools/benchmark.py`` for each config: the whole Mask R-CNN and the backbone at
   800x1333, fused / unfused / mmdet's Swin-T / mmslab's LayerNorm control, fp32 and fp16
   (autocast), interleaved;
5. one table (speed-ups vs mmdet's Swin-T and vs the LN control, with the targets of the
   SLAB paper's Figure 5) and ``gpu_check.json``.
"""
import argparse
import glob
import json
import os
import os.path as osp
import signal
import subprocess
import sys
import threading
import time

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, REPO)

DEMO_CONFIG = 'configs/demo/mask_rcnn_slab_swin_t_demo.py'
CONFIGS = ['configs/mask_rcnn_prepbn_swin_t_1x.py', 'configs/mask_rcnn_slab_swin_t_1x.py',
           'configs/mask_rcnn_repa_swin_t_1x.py']
PRECISIONS = ('fp32', 'fp16')
#: minimum speed-up of the fused whole Mask R-CNN over mmdet's Swin-T (SLAB paper, Figure 5:
#: V100, Swin-T 51 ms vs Swin-T-PRepBN 43 ms); and over the LayerNorm control, for every config
TARGETS_VS_MMDET = {'mask_rcnn_prepbn_swin_t_1x': 1.19, 'mask_rcnn_repa_swin_t_1x': 1.3}
TARGET_VS_CONTROL = 1.0
#: family -> (its LayerNorm control, the methods' configs), trained by step 3
REAL_CONFIGS = {
    'mask_rcnn': ('configs/mask_rcnn_swin_t_1x.py',
                  ['configs/mask_rcnn_prepbn_swin_t_1x.py', 'configs/mask_rcnn_slab_swin_t_1x.py',
                   'configs/mask_rcnn_repa_swin_t_1x.py', 'configs/mask_rcnn_prepbn_pvt_t_1x.py']),
    'retinanet': ('configs/retinanet_swin_t_1x.py',
                  ['configs/retinanet_prepbn_swin_t_1x.py', 'configs/retinanet_slab_swin_t_1x.py',
                   'configs/retinanet_repa_swin_t_1x.py', 'configs/retinanet_prepbn_pvt_t_1x.py']),
    'upernet': ('configs/upernet_swin_t_160k_ade20k.py',
                ['configs/upernet_slab_swin_t_160k_ade20k.py']),
}
#: The demo config of each task: its synthetic set (root and classes) is what the real
#: configs train on here.
DEMO_CONFIGS = {'det': 'configs/demo/mask_rcnn_slab_swin_t_demo.py',
                'seg': 'configs/demo/upernet_slab_swin_t_demo.py'}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--iters', type=int, default=200, help='training iterations of the demo')
    p.add_argument('--repeat', type=int, default=20, help='timed calls per variant')
    p.add_argument('--warmup', type=int, default=5, help='untimed calls per variant')
    p.add_argument('--shape', default='800x1333', help='timed input size HEIGHTxWIDTH')
    p.add_argument('--configs', nargs='+', default=CONFIGS, help='configs to time')
    p.add_argument('--skip-train', action='store_true', help='only the ops check and timing')
    p.add_argument('--real-iters', type=int, default=10,
                   help='training iterations of each real config (0: skip that step)')
    p.add_argument('--step-timeout', type=float, default=0,
                   help='seconds a step (training, one config\'s timing) may take before it is '
                        'stopped and reported as failed; 0: no limit')
    p.add_argument('--out', default='work_dirs/gpu_check')
    args = p.parse_args(argv)
    if args.iters < 1 or args.repeat < 1 or args.warmup < 0 or args.step_timeout < 0 or \
            args.real_iters < 0:
        p.error('--iters and --repeat must be >= 1, --warmup, --real-iters and '
                '--step-timeout >= 0')
    return args


def require_gpu():
    import torch
    if not torch.cuda.is_available():
        raise SystemExit(
            'error: torch.cuda.is_available() is False (torch '
            f'{torch.__version__}, built for CUDA {torch.version.cuda}): this is the GPU '
            "acceptance check. Run 'python -P mmslab/utils/cuda_build.py facts' to see what the "
            'driver and torch report.')
    return torch.cuda.device_count()


def run(cmd, log_path, timeout=0):
    """Run a tool, its output shown and kept in ``log_path``; returns (exit code, seconds).
    Past ``timeout`` seconds (0: never) its process group is killed and the code is
    ``'timeout'``, so that one hung step does not cost the steps after it."""
    print('$ ' + ' '.join(cmd), flush=True)
    t0 = time.time()
    with open(log_path, 'w') as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        timer = None
        if timeout:
            timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
            timer.start()
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        code = proc.wait()
        if timer is not None:
            timer.cancel()
            if code == -signal.SIGKILL and time.time() - t0 >= timeout:
                code = 'timeout'
                print(f'error: stopped after {timeout:.0f} s (--step-timeout): ' + ' '.join(cmd))
    return code, time.time() - t0


def train_demo(args, n_gpus, py):
    work = osp.join(args.out, 'train_amp')
    opts = ['--work-dir', work, '--amp', '--cfg-options', f'train_cfg.max_iters={args.iters}',
            f'train_cfg.val_interval={args.iters}',
            f'default_hooks.checkpoint.interval={args.iters}']
    if n_gpus >= 2:
        cmd = ['bash', 'tools/dist_train.sh', DEMO_CONFIG, '2'] + opts
    else:
        cmd = [py, 'tools/train.py', DEMO_CONFIG] + opts
    code, seconds = run(cmd, osp.join(args.out, 'train_amp.log'), args.step_timeout)
    result = dict(command=' '.join(cmd), exit_code=code, seconds=seconds,
                  processes=2 if n_gpus >= 2 else 1)
    runs = sorted(glob.glob(osp.join(work, '*', 'vis_data', 'scalars.json')))
    if runs:
        with open(runs[-1]) as f:
            records = [json.loads(line) for line in f if line.strip()]
        losses = [r['loss'] for r in records if 'loss' in r]
        evals = [r for r in records if 'coco/bbox_mAP' in r]
        result.update(first_loss=losses[0] if losses else None,
                      last_loss=losses[-1] if losses else None,
                      loss_scale=[r['loss_scale'] for r in records if 'loss_scale' in r][-1:],
                      bbox_mAP=evals[-1]['coco/bbox_mAP'] if evals else None,
                      segm_mAP=evals[-1].get('coco/segm_mAP') if evals else None)
    latency = osp.join(work, 'latency.json')
    if osp.exists(latency):
        with open(latency) as f:
            result['hook_latency'] = json.load(f)
    return result


def synthetic_config(config: str, iters: int, out_dir: str) -> str:
    """Write a config that trains ``config`` as it is (model, input size, optimizer, hooks)
    on the synthetic set of its task for ``iters`` iterations and validates once at the end:
    random initial weights, the synthetic set's root (that of the task's demo config, not the
    real dataset's) and classes, a constant learning rate, and progressive norms whose decay
    ends at ``2 * iters`` (mid-decay throughout, both statistics computed, as for most of a
    real schedule). Returns its path."""
    from mmengine.config import Config
    cfg = Config.fromfile(osp.join(REPO, config))
    task = 'seg' if cfg.default_scope == 'mmseg' else 'det'
    demo = Config.fromfile(osp.join(REPO, DEMO_CONFIGS[task]))
    classes = tuple(demo.classes)
    backbone = dict(init_cfg=None)
    for key in ('norm_cfg', 'out_norm_cfg'):
        norm = cfg.model.backbone.get(key) or {}
        if norm.get('type') == 'PRepBN':
            backbone[key] = dict(step=2 * iters)
    model = dict(backbone=backbone)
    n = len(classes)
    if task == 'seg':
        model.update(decode_head=dict(num_classes=n), auxiliary_head=dict(num_classes=n))
    elif 'roi_head' in cfg.model:
        model['roi_head'] = dict(bbox_head=dict(num_classes=n), mask_head=dict(num_classes=n))
    else:
        model['bbox_head'] = dict(num_classes=n)
    data = dict(dataset=dict(data_root=demo.data_root, metainfo=dict(classes=classes)))
    lines = [f'_base_ = {osp.join(REPO, config)!r}',
             f'model = {model!r}',
             f'train_dataloader = {data!r}',
             f'val_dataloader = {data!r}',
             'test_dataloader = val_dataloader',
             f"train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters={iters}, "
             f'val_interval={iters})',
             "param_scheduler = [dict(type='ConstantLR', factor=1.0, by_epoch=False)]",
             "default_hooks = dict(logger=dict(type='LoggerHook', interval=1), checkpoint=dict("
             f"type='CheckpointHook', by_epoch=False, interval={iters}, save_best=None))",
             "log_processor = dict(by_epoch=False)"]
    ann_file = demo.val_evaluator.get('ann_file')
    if ann_file:
        lines += [f'val_evaluator = dict(ann_file={ann_file!r})', 'test_evaluator = val_evaluator']
    os.makedirs(out_dir, exist_ok=True)
    path = osp.join(out_dir, osp.splitext(osp.basename(config))[0] + '_synthetic.py')
    with open(path, 'w') as f:
        f.write('\n'.join(lines) + '\n')
    return path


def training_figures(work_dir: str) -> dict:
    """s/iter (median of the logged iterations after the first two), peak memory (GiB, as
    mmengine logs it on a GPU), the last losses and the fusion check of a run's work dir."""
    out = {}
    runs = sorted(glob.glob(osp.join(work_dir, '*', 'vis_data', 'scalars.json')))
    if runs:
        with open(runs[-1]) as f:
            records = [json.loads(line) for line in f if line.strip()]
        train = [r for r in records if 'loss' in r]
        times = sorted(r['time'] for r in train[2:] if 'time' in r)
        memory = [r['memory'] for r in train if 'memory' in r]
        out.update(iterations=len(train),
                   s_per_iter=times[len(times) // 2] if times else None,
                   peak_memory_gib=max(memory) / 1024 if memory else None,
                   last_loss=train[-1]['loss'] if train else None)
    latency = osp.join(work_dir, 'latency.json')
    if osp.exists(latency):
        with open(latency) as f:
            lat = json.load(f)
        out.update(fusion_difference=lat.get('max_relative_difference'),
                   fusion_check=(lat.get('fusion_check') or {}).get('result'),
                   evaluated=lat.get('timed'))
    return out


def train_real_configs(args, py) -> list:
    """Step 3: every config of :data:`REAL_CONFIGS` trained and validated; one row each."""
    rows = []
    for family, (control, methods) in REAL_CONFIGS.items():
        for config in [control] + methods:
            name = osp.splitext(osp.basename(config))[0]
            work = osp.join(args.out, 'real', name)
            path = synthetic_config(config, args.real_iters, work)
            cmd = [py, 'tools/train.py', path, '--amp', '--work-dir', work]
            code, seconds = run(cmd, osp.join(args.out, f'real_{name}.log'), args.step_timeout)
            rows.append(dict(family=family, config=name, control=config == control,
                             exit_code=code, seconds=seconds, **training_figures(work)))
    return rows


def print_real_table(rows):
    controls = {r['family']: r for r in rows if r['control']}

    def num(v, fmt):
        return '-' if v is None else format(v, fmt)
    print(f"{'config':36s} {'exit':>5s} {'s/iter':>7s} {'x ctrl':>7s} {'peak GiB':>9s} "
          f"{'fusion diff':>12s}  evaluated")
    for r in rows:
        ctrl = controls.get(r['family'], {}).get('s_per_iter')
        ratio = r['s_per_iter'] / ctrl if ctrl and r.get('s_per_iter') else None
        print(f"{r['config']:36s} {str(r['exit_code']):>5s} {num(r.get('s_per_iter'), '.3f'):>7s} "
              f"{num(ratio, '.2f'):>7s} {num(r.get('peak_memory_gib'), '.2f'):>9s} "
              f"{num(r.get('fusion_difference'), '.2e'):>12s}  {r.get('evaluated') or '-'}")


def time_config(args, config, py):
    name = osp.splitext(osp.basename(config))[0]
    out = osp.join(args.out, 'speed', name)
    cmd = [py, 'tools/benchmark.py', config, '--device', 'cuda', '--precisions', *PRECISIONS,
           '--shapes', args.shape, '--parts', 'model', 'backbone',
           '--baseline-backbone', 'swin_t', 'ln_swin_t', '--repeat', str(args.repeat),
           '--warmup', str(args.warmup), '--out', out,
           # random weights: keep every detection (up to 100) so that every model's mask
           # head gets the same work and the whole-model times compare like with like
           '--cfg-options', 'model.test_cfg.rcnn.score_thr=0.0']
    code, seconds = run(cmd, osp.join(args.out, f'speed_{name}.log'), args.step_timeout)
    report = None
    if code == 0:
        with open(osp.join(out, 'benchmark.json')) as f:
            report = json.load(f)
    return dict(config=config, name=name, command=' '.join(cmd), exit_code=code,
                seconds=seconds, report=report)


def speed_rows(timing, precisions=PRECISIONS):
    """One row per (config, part, precision) at batch 1: the medians of tools/benchmark.py's
    JSON and the fused model's speed-ups over mmdet's Swin-T and over the LN control."""
    rows = []
    report = timing['report']
    if not report:
        return rows
    name = timing['name']
    med = {(r['variant'], r['part'], r['precision']): r['median_ms']
           for r in report['results'] if r.get('batch_size', 1) == 1}
    for part in ('model', 'backbone'):
        for prec in precisions:
            def get(suffix):
                return med.get((f'{name}{suffix}', part, prec))
            fused, unfused = get(' (fused)'), get(' (unfused)')
            mmdet = get(' with swin_t backbone (LN)')
            control = get(' with ln_swin_t backbone (LN control, fused)')
            if fused is None:
                continue
            row = dict(config=name, part=part, precision=prec, fused_ms=fused,
                       unfused_ms=unfused, mmdet_swin_t_ms=mmdet, ln_control_ms=control,
                       vs_mmdet=mmdet / fused if mmdet else None,
                       vs_control=control / fused if control else None)
            if part == 'model':
                target = TARGETS_VS_MMDET.get(name)
                row['targets'] = dict(vs_mmdet=target, vs_control=TARGET_VS_CONTROL)
                row['met'] = ((target is None or (row['vs_mmdet'] or 0) >= target) and
                              (row['vs_control'] or 0) >= TARGET_VS_CONTROL)
            rows.append(row)
    return rows


def print_table(rows, gpu_line):
    head = ('config', 'part', 'prec', 'fused', 'unfused', 'mmdet Swin-T', 'LN control',
            'x mmdet', 'x control', 'target')

    def ms(v):
        return '-' if v is None else f'{v:.1f}'

    def ratio(v):
        return '-' if v is None else f'{v:.2f}'
    table = [head]
    for r in rows:
        target = ''
        if 'met' in r:
            t = r['targets']
            want = (f">={t['vs_mmdet']} mmdet, " if t['vs_mmdet'] else '') + \
                f">={t['vs_control']} ctrl"
            target = f"{want}: {'met' if r['met'] else 'NOT met'}"
        table.append((r['config'].replace('mask_rcnn_', '').replace('_1x', ''), r['part'],
                      r['precision'], ms(r['fused_ms']), ms(r['unfused_ms']),
                      ms(r['mmdet_swin_t_ms']), ms(r['ln_control_ms']), ratio(r['vs_mmdet']),
                      ratio(r['vs_control']), target))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print('  '.join(c.ljust(w) for c, w in zip(row, widths)))
    print(f'(median ms per image, batch 1, {gpu_line}; x = baseline ms / fused ms)')


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    n_gpus = require_gpu()
    from mmslab.utils.cuda_build import verify_cuda_ops_on_gpu
    from mmslab.utils.machine import machine_info, machine_line
    machine = machine_info(device='cuda')
    report = dict(machine=machine, gpus=n_gpus, shape=args.shape, repeat=args.repeat,
                  warmup=args.warmup)
    print('== mmcv CUDA ops vs CPU')
    report['mmcv_cuda_ops'] = verify_cuda_ops_on_gpu()
    print('\n'.join(report['mmcv_cuda_ops']))
    py = sys.executable
    print('== the backbones on CUDA (tests/test_cuda.py)')
    code, seconds = run([py, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', 'tests/test_cuda.py'],
                        osp.join(args.out, 'test_cuda.log'), args.step_timeout)
    report['cuda_tests'] = dict(exit_code=code, seconds=seconds)
    if not args.skip_train:
        print(f'== demo training with --amp ({args.iters} iterations)')
        code, _ = run([py, 'tools/make_demo_data.py', '--kind', 'coco'],
                      osp.join(args.out, 'make_demo_data.log'))
        if code:
            raise SystemExit('error: tools/make_demo_data.py failed (see above)')
        report['train'] = train_demo(args, n_gpus, py)
    if args.real_iters:
        print(f'== the real configs, {args.real_iters} iterations each with --amp, validated')
        if args.skip_train:  # the demo step makes the synthetic sets otherwise
            run([py, 'tools/make_demo_data.py'], osp.join(args.out, 'make_demo_data.log'))
        else:
            run([py, 'tools/make_demo_data.py', '--kind', 'ade'],
                osp.join(args.out, 'make_demo_data_ade.log'))
        report['real_configs'] = train_real_configs(args, py)
    print('== latency at ' + args.shape)
    report['timings'] = [time_config(args, c, py) for c in args.configs]
    report['table'] = [row for t in report['timings'] for row in speed_rows(t)]
    failed = [t['config'] for t in report['timings'] if t['exit_code']]
    if report['cuda_tests']['exit_code']:
        failed.insert(0, 'tests/test_cuda.py')
    if not args.skip_train and report['train']['exit_code']:
        failed.insert(0, 'training')
    failed += [r['config'] for r in report.get('real_configs', []) if r['exit_code'] or
               r.get('fusion_check') != 'passed']
    report['failed'] = failed
    with open(osp.join(args.out, 'gpu_check.json'), 'w') as f:
        json.dump(report, f, indent=2, default=str)
    print('\n== GPU acceptance check')
    print(f"mmcv CUDA ops: {len(report['mmcv_cuda_ops'])} checked; tests/test_cuda.py: exit "
          f"{report['cuda_tests']['exit_code']} ({report['cuda_tests']['seconds']:.0f} s)")
    if not args.skip_train:
        t = report['train']
        lat = t.get('hook_latency') or {}
        print(f"training ({t['processes']} process(es), --amp, {args.iters} iterations): exit "
              f"{t['exit_code']}, loss {t.get('first_loss')} -> {t.get('last_loss')}, "
              f"bbox mAP {t.get('bbox_mAP')}, segm mAP {t.get('segm_mAP')}, "
              f"{t['seconds']:.0f} s; fused model through ReparamEvalHook: "
              f"{(lat.get('fused') or {}).get('median_ms', float('nan')):.1f} ms/img median")
    if report.get('real_configs'):
        print_real_table(report['real_configs'])
    print_table(report['table'], machine_line(machine))
    print(f"wrote {osp.join(args.out, 'gpu_check.json')}")
    if failed:
        raise SystemExit(f'error: failed steps: {", ".join(failed)} (logs in {args.out})')
    return report


if __name__ == '__main__':
    main()
