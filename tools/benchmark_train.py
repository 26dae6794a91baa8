"""Training-step cost of backbones (or whole models) from configs, interleaved in one run.

    python tools/benchmark_train.py [CONFIG ...] [--part {backbone,model}] [--shape 800x1216]
        [--batch 2] [--precision {fp32,fp16,bf16}] [--device {cpu,cuda}] [--repeat 10]
        [--warmup 2] [--threads N] [--prepbn-progress 0.5] [--no-mmdet-swin] [--profile N]
        --out DIR

One training step is forward, a loss, and backward (no optimizer update: the same for every
model). ``--part backbone`` (default) takes each config's ``model.backbone``, runs it on a
random batch and uses the mean square of its outputs as the loss. ``--part model`` builds the
whole detector or segmentor and computes its own training losses on a synthetic batch of
``--batch`` images with boxes and masks (mmdet's ``demo_mm_inputs``) or label maps, through the
model's data preprocessor: a whole training iteration without data loading.

The first config is the reference (default: the Mask R-CNN configs of the LayerNorm Swin-T
control, PRepBN-, SLAB- and RePa-Swin-T); with ``--part backbone`` mmdet's own Swin-T with the
control's settings is added (``--no-mmdet-swin`` leaves it out). Progressive norms are put
``--prepbn-progress`` of the way through their LayerNorm -> BatchNorm decay (0.5: both
statistics computed, as for most of a schedule). ``--precision fp16`` runs autocast with a
``GradScaler`` (``--amp`` of ``tools/train.py``), ``bf16`` autocast alone.

Prints the median step time, its spread (min-max over rounds), each model against the
reference and against mmdet's Swin-T (per-round ratios: median [min-max]), peak memory on a
GPU; writes ``benchmark_train.json`` (with the machine) and ``benchmark_train.png``.
``--profile N`` then runs N more steps of each model under ``torch.profiler`` and records
where a step's time goes: its operators by self time on the device (the GPU's kernels, or the
CPU), with their calls per step, and the kernel launches per step on a GPU.
"""
import argparse
import datetime
import os.path as osp
import statistics
import sys

import torch
from mmengine.config import Config

import mmslab  # noqa: F401 (registers the models)
from mmslab.benchmark import parse_shape, save_report
from mmslab.utils.launch import load_config, model_registry
from mmslab.utils.machine import machine_info, machine_line
from mmslab.utils.plotting import saved_figure
from mmslab.utils.precision import PRECISION_DTYPES, check_autocast_precision
from mmslab.utils.timing import measure_interleaved, resolve_device, timing_method

DEFAULT_CONFIGS = ['configs/mask_rcnn_swin_t_1x.py', 'configs/mask_rcnn_prepbn_swin_t_1x.py',
                   'configs/mask_rcnn_slab_swin_t_1x.py', 'configs/mask_rcnn_repa_swin_t_1x.py']
MMDET_SWIN = 'mmdet Swin-T'


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('configs', nargs='*', default=DEFAULT_CONFIGS,
                   help='configs to time; the first is the reference (default: the LayerNorm '
                   'control, PRepBN-, SLAB- and RePa-Swin-T Mask R-CNN 1x)')
    p.add_argument('--part', default='backbone', choices=['backbone', 'model'])
    p.add_argument('--shape', default='800x1216', help='input size HEIGHTxWIDTH')
    p.add_argument('--batch', type=int, default=2, help='images per step')
    p.add_argument('--precision', default='fp32', choices=list(PRECISION_DTYPES))
    p.add_argument('--device', default=None, help='cpu, cuda or cuda:N (default: cuda if '
                   'available)')
    p.add_argument('--repeat', type=int, default=10, help='timed steps per model')
    p.add_argument('--warmup', type=int, default=2, help='untimed steps per model')
    p.add_argument('--threads', type=int, default=None, help='torch threads (default: as is)')
    p.add_argument('--prepbn-progress', type=float, default=0.5,
                   help='position in the progressive norms\' decay, 0 (LayerNorm) to 1 '
                   '(BatchNorm); default 0.5')
    p.add_argument('--no-mmdet-swin', action='store_true',
                   help="with --part backbone: do not add mmdet's Swin-T")
    p.add_argument('--profile', type=int, default=0, metavar='N',
                   help='after timing, profile N steps of each model (0: none)')
    p.add_argument('--out', required=True, help='output directory')
    args = p.parse_args(argv)
    if args.batch < 1 or args.repeat < 1 or args.warmup < 0 or args.profile < 0:
        p.error('--batch and --repeat must be >= 1, --warmup and --profile >= 0')
    if not 0.0 <= args.prepbn_progress <= 1.0:
        p.error(f'--prepbn-progress {args.prepbn_progress}: must lie in [0, 1]')
    for config in args.configs:
        if not osp.isfile(config):
            p.error(f'config {config} not found')
    try:
        args.shape = parse_shape(args.shape)
        args.device = resolve_device(args.device)
        check_autocast_precision(args.precision, args.device, 'tools/benchmark_train.py')
    except (ValueError, RuntimeError) as err:
        p.error(str(err))
    return args


def model_name(config: str) -> str:
    return osp.splitext(osp.basename(config))[0]


def build(config: str, part: str, cfg_options: dict = None):
    """The config's backbone or whole model (``cfg_options`` merged into the config first),
    random weights (no checkpoint is loaded)."""
    cfg, scope = load_config(config, cfg_options)
    registry = model_registry(scope)
    model_cfg = cfg.model.backbone if part == 'backbone' else cfg.model
    model_cfg = Config(model_cfg.to_dict() if hasattr(model_cfg, 'to_dict') else model_cfg)
    if part == 'backbone':
        model_cfg.init_cfg = None
    else:
        model_cfg.backbone.init_cfg = None
    model = registry.build(model_cfg)
    model.init_weights()
    return model, cfg


def mmdet_swin(control_cfg: Config):
    """mmdet's SwinTransformer with the control's architecture and drop path."""
    from mmdet.models.backbones import SwinTransformer
    b = control_cfg.model.backbone
    return SwinTransformer(embed_dims=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24),
                           window_size=b.get('window_size', 7),
                           drop_path_rate=b.get('drop_path_rate', 0.2))


def set_schedule(model, progress: float) -> int:
    """Put every progressive norm ``progress`` of the way through its own decay."""
    count = 0
    for m in model.modules():
        step = getattr(m, 'step', None)
        if callable(getattr(m, 'set_iter', None)) and isinstance(step, int):
            m.set_iter(int(round(progress * (step + getattr(m, 'warmup', 0)))))
            count += 1
    return count


def synthetic_batch(model, shape, batch: int):
    """A training batch for ``model.data_preprocessor``: uint8 images with ground truth."""
    from mmseg.models.segmentors import BaseSegmentor
    h, w = shape
    if isinstance(model, BaseSegmentor):
        from mmengine.structures import PixelData
        from mmseg.structures import SegDataSample
        g = torch.Generator().manual_seed(0)
        num_classes = model.decode_head.num_classes
        inputs, samples = [], []
        for _ in range(batch):
            inputs.append(torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8))
            sample = SegDataSample(metainfo=dict(img_shape=(h, w), ori_shape=(h, w),
                                                 pad_shape=(h, w)))
            labels = torch.randint(0, num_classes, (1, h, w), generator=g)
            sample.gt_sem_seg = PixelData(data=labels)
            samples.append(sample)
        return dict(inputs=inputs, data_samples=samples)
    from mmdet.testing import demo_mm_inputs
    head = getattr(model, 'roi_head', None)
    num_classes = (head.bbox_head.num_classes if head is not None
                   else model.bbox_head.num_classes)
    with_mask = head is not None and getattr(head, 'with_mask', False)
    return demo_mm_inputs(batch_size=batch, image_shapes=[(3, h, w)] * batch,
                          num_items=[5] * batch, num_classes=num_classes, with_mask=with_mask)


def training_step(model, part: str, shape, batch: int, precision: str, device):
    """A zero-argument callable running one training step of ``model`` on ``device``."""
    dtype = PRECISION_DTYPES[precision]
    scaler = torch.amp.GradScaler(device.type) if precision == 'fp16' else None
    if part == 'backbone':
        x = torch.randn(batch, 3, *shape, device=device)

        def loss_fn():
            return sum(o.float().pow(2).mean() for o in model(x))
    else:
        pre = model.data_preprocessor
        if hasattr(pre, 'size_divisor') and pre.size is None and pre.size_divisor is None:
            pre.size = tuple(shape)  # mmseg's training batches need one of them
        data = pre(synthetic_batch(model, shape, batch), True)

        def loss_fn():
            loss, _ = model.parse_losses(model(**data, mode='loss'))
            return loss

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return loss.detach()
    return step


def profile_step(step, count: int, device, top: int = 15) -> dict:
    """Where ``count`` training steps spend their time, per step: the ``top`` operators by
    self time on ``device`` (CUDA kernels on a GPU), the device time in all, and on a GPU the
    kernel launches."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == 'cuda'
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(count):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    events = prof.key_averages()

    def self_us(e):
        if not cuda:
            return e.self_cpu_time_total
        return getattr(e, 'self_device_time_total', None) or getattr(e, 'self_cuda_time_total', 0)
    ranked = sorted(events, key=self_us, reverse=True)
    out = dict(steps=count, time_of='cuda' if cuda else 'cpu',
               total_ms=sum(self_us(e) for e in events) / 1e3 / count,
               operators=[dict(name=e.key, calls=e.count / count, self_ms=self_us(e) / 1e3 / count,
                               cpu_self_ms=e.self_cpu_time_total / 1e3 / count)
                          for e in ranked[:top] if self_us(e) > 0])
    if cuda:
        kernels = [e for e in prof.events() if str(e.device_type).endswith('CUDA')]
        out['kernels_per_step'] = len(kernels) / count
    return out


def print_profile(name: str, prof: dict):
    launches = (f", {prof['kernels_per_step']:.0f} kernels" if 'kernels_per_step' in prof
                else '')
    print(f"\n{name}: {prof['total_ms']:.1f} ms of {prof['time_of']} time per step{launches}")
    for op in prof['operators']:
        print(f"  {op['self_ms']:8.2f} ms {op['calls']:7.1f}x  {op['name'][:90]}")


def spread(values):
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def report_of(times, reference: str, mmdet_name):
    rows = {}
    for name, ms in times.items():
        row = dict(step_ms=spread(ms), times_ms=ms)
        for label, ref in (('vs_reference', reference), ('vs_mmdet_swin', mmdet_name)):
            if ref in times:  # per-round ratios: both timed in the same round
                row[label] = spread([a / b for a, b in zip(ms, times[ref])])
        rows[name] = row
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models, schedules = {}, {}
    control_cfg = None
    for config in args.configs:
        model, cfg = build(config, args.part)
        control_cfg = control_cfg or cfg
        models[model_name(config)] = model
    reference = model_name(args.configs[0])
    mmdet_name = None
    if args.part == 'backbone' and not args.no_mmdet_swin:
        mmdet_name = MMDET_SWIN
        models[mmdet_name] = mmdet_swin(control_cfg)
        models[mmdet_name].init_weights()
    steps = {}
    for name, model in models.items():
        model.to(args.device)
        model.train()
        schedules[name] = set_schedule(model, args.prepbn_progress)
        steps[name] = training_step(model, args.part, args.shape, args.batch, args.precision,
                                    args.device)
    print(f'{len(models)} models, {args.repeat} interleaved rounds of one {args.part} training '
          f'step ({args.batch}x{args.shape[0]}x{args.shape[1]}, {args.precision}) ...')
    peak = {}
    if args.device.type == 'cuda':  # peak memory of each model's own step, measured apart
        for name, step in steps.items():
            torch.cuda.reset_peak_memory_stats(args.device)
            step()
            peak[name] = torch.cuda.max_memory_allocated(args.device) / 2**30
    times = measure_interleaved(steps, args.repeat, args.warmup, device=args.device, grad=True)
    rows = report_of(times, reference, mmdet_name)
    for name in rows:
        rows[name]['progressive_norms'] = schedules[name]
        if name in peak:
            rows[name]['peak_memory_gib'] = peak[name]
        if args.profile:
            rows[name]['profile'] = profile_step(steps[name], args.profile, args.device)
    command = ['python tools/benchmark_train.py'] + list(sys.argv[1:] if argv is None else argv)
    report = dict(command=' '.join(command), date=datetime.date.today().isoformat(),
                  part=args.part, shape=list(args.shape), batch=args.batch,
                  precision=args.precision, device=str(args.device),
                  timing=timing_method(args.device), repeat=args.repeat, warmup=args.warmup,
                  threads=torch.get_num_threads(), prepbn_progress=args.prepbn_progress,
                  configs=args.configs, reference=reference, mmdet_swin=mmdet_name,
                  machine=machine_info(args.device), torch=torch.__version__, models=rows)
    print_table(report)
    for name, row in rows.items():
        if 'profile' in row:
            print_profile(name, row['profile'])
    save_report(report, args.out, 'benchmark_train', plot)
    return report


def _ratio(r) -> str:
    return f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]" if r else '-'


def print_table(report):
    print(f"\n{report['part']} training step, batch {report['batch']} at "
          f"{report['shape'][0]}x{report['shape'][1]}, {report['precision']}, "
          f"{machine_line(report['machine'])}")
    ref = report['reference']
    print(f"{'model':40s} {'median ms':>10s} {'min-max ms':>16s} {'vs ' + ref[:22]:>28s} "
          f"{'vs mmdet Swin-T':>20s}" + ('  peak GiB' if report['device'] != 'cpu' else ''))
    for name, row in report['models'].items():
        s = row['step_ms']
        mem = f"  {row['peak_memory_gib']:8.2f}" if 'peak_memory_gib' in row else ''
        print(f"{name:40s} {s['median']:10.1f} {s['min']:7.1f}-{s['max']:<8.1f} "
              f"{_ratio(row.get('vs_reference')):>28s} "
              f"{_ratio(row.get('vs_mmdet_swin')):>20s}{mem}")
    print('(ratios: step time over the reference\'s, per round; > 1 is slower)')


def plot(report, path):
    names = list(report['models'])
    medians = [report['models'][n]['step_ms']['median'] for n in names]
    low = [m - report['models'][n]['step_ms']['min'] for n, m in zip(names, medians)]
    high = [report['models'][n]['step_ms']['max'] - m for n, m in zip(names, medians)]
    with saved_figure(path, panel_size=(8, 0.5 * len(names) + 1.5)) as (fig, axes):
        ax = axes[0][0]
        ax.barh(range(len(names)), medians, xerr=[low, high], color='tab:blue', capsize=3)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names)
        ax.invert_yaxis()
        ax.set_xlabel('ms per training step (median, min-max)')
        ax.set_title(f"{report['part']} training step, {report['batch']}x{report['shape'][0]}x"
                     f"{report['shape'][1]} {report['precision']}, {report['device']}")


if __name__ == '__main__':
    main()
