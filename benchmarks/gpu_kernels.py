"""GPU kernels and host syncs per training step and per inference call, counted on the CPU.

    python benchmarks/gpu_kernels.py [--parts train infer model] [--backbones NAME ...]
        [--shape 400x608] [--batch 2] [--infer-batches 1 8] [--configs CONFIG ...]
        [--precision {bf16,fp32}] [--threads N] [--top 25] [--out benchmarks/results]

Where a GPU waits on kernel launches rather than on arithmetic (a Swin backbone's training
step at detection sizes), the kernels a step launches are its cost. This counts them, and the
host syncs, with :class:`mmslab.utils.kernel_count.KernelCounter` (the rule is in its module
docstring and docs/benchmarks.md), running the code a CUDA tensor runs on CPU tensors
(``mmslab.run_code_path('cuda')``). The bf16 matrix products and convolutions are computed
in float32 below the counter (:class:`mmslab.utils.kernel_count.Float32Products`): the same
operators are counted, and a CPU without bf16 instructions, which emulates them, counts the
whole-model iterations in minutes.

Parts (``--parts``, default all):

* ``train``: one backbone training step (forward, the mean square of every output summed as
  the loss, backward; no optimizer update), batch ``--batch`` at ``--shape``, under bf16
  autocast (:func:`mmslab.engine.optim_wrapper.cpu_autocast`: CPU autocast with LayerNorm
  in float32, standing in for CUDA autocast), with the progressive norms mid-decay and after
  the decay (PRepBN: iteration ``warmup + step / 2`` and ``warmup + step``; UN: in its
  warm-up and after it, with the averages and the gradient-scale clamp on);
* ``infer``: the fused backbone (``mmslab.reparameterize``; mmdet's as it is), eval,
  ``no_grad``, float32, at each of ``--infer-batches``;
* ``model``: a whole training iteration of each of ``--configs`` and of its family's
  LayerNorm control, at the config's training input (its ``Resize`` scale or crop, its
  ``train_dataloader.batch_size``): the data preprocessor, the losses with the network parts
  in bf16 (``CPUAmpOptimWrapper.optim_context``, as ``tools/train.py --amp`` on a CPU), the
  backward; progressive norms mid-decay. Counted per part (data preprocessor, backbone,
  neck, heads with their losses and label assignment), mmcv's compiled ops one kernel per
  call (NMS a host sync too), host syncs by call site.

Backbones (``--backbones``): mmdet's Swin-T with the control's settings, the LayerNorm control
(``LN Swin-T``: mmslab's own Swin with LayerNorm), PRepBN-, SLAB-, RePa-, UN-Swin-T and
PRepBN-PVT-T, each the backbone of its Mask R-CNN 1x config, and SLAB-PVT-T (PRepBN-PVT-T's
with ``type='SLABPVT'``), built as ``tools/benchmark_train.py`` builds them. Every count is
of a step in the steady state: first a no-grad forward at the counted size (eager layers
keep the layouts of an input size: built once, not every step), and for UN the training
steps that fill its windows (at a small input: its statistics are per channel).

Prints the tables (each count against the control's and mmdet's Swin-T's) and writes
``<out>/<machine>-gpu_kernels.json`` (``mmslab.utils.machine.machine_slug``) with the
command, date, machine, git commit (and the files that differ from it), torch version, the
rule and the top operators of every count; ``benchmarks/make_tables.py`` renders it.
"""
import argparse
import contextlib
import copy
import datetime
import json
import os
import os.path as osp
import subprocess
import sys
import time

import torch

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, osp.join(REPO, 'tools'))
sys.path.insert(0, osp.join(REPO, 'benchmarks'))

import mmslab  # noqa: E402
from benchmark_train import build, mmdet_swin, synthetic_batch  # noqa: E402
from make_tables import fmt_times, nested  # noqa: E402
from mmslab.benchmark import fused_copy, parse_shape  # noqa: E402
from mmslab.utils.kernel_count import (RULE, Float32Products, KernelCounter,  # noqa: E402
                                       ModuleRegions, mmcv_ext_calls)
from mmslab.utils.launch import load_config  # noqa: E402
from mmslab.utils.machine import machine_info, machine_line, machine_slug  # noqa: E402

PARTS = ('train', 'infer', 'model')
MMDET = 'mmdet Swin-T'
CONTROL = 'LN Swin-T'
#: name -> (config whose model.backbone it is, cfg_options); mmdet's Swin-T takes the
#: control's settings (``benchmark_train.mmdet_swin``).
BACKBONES = {
    MMDET: ('configs/mask_rcnn_swin_t_1x.py', None),
    CONTROL: ('configs/mask_rcnn_swin_t_1x.py', None),
    'PRepBN-Swin-T': ('configs/mask_rcnn_prepbn_swin_t_1x.py', None),
    'SLAB-Swin-T': ('configs/mask_rcnn_slab_swin_t_1x.py', None),
    'RePa-Swin-T': ('configs/mask_rcnn_repa_swin_t_1x.py', None),
    'UN-Swin-T': ('configs/mask_rcnn_un_swin_t_1x.py', None),
    'PRepBN-PVT-T': ('configs/mask_rcnn_prepbn_pvt_t_1x.py', None),
    'SLAB-PVT-T': ('configs/mask_rcnn_prepbn_pvt_t_1x.py', {'model.backbone.type': 'SLABPVT'}),
}
#: The whole models counted by default (each with its family's control).
DEFAULT_CONFIGS = ['configs/mask_rcnn_slab_swin_t_1x.py',
                   'configs/upernet_slab_swin_t_160k_ade20k.py']
#: family (the config name before the backbone) -> its LayerNorm control.
CONTROL_CONFIGS = {'mask_rcnn': 'configs/mask_rcnn_swin_t_1x.py',
                   'retinanet': 'configs/retinanet_swin_t_1x.py',
                   'upernet': 'configs/upernet_swin_t_160k_ade20k.py'}
PHASES = ('mid', 'after')  # of the progressive norms' schedules
#: The small input of UN's window-filling steps.
PRIME_SHAPE = (64, 96)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--parts', nargs='+', default=list(PARTS), choices=PARTS,
                   help='what to count (default: all)')
    p.add_argument('--backbones', nargs='+', default=list(BACKBONES), choices=list(BACKBONES),
                   help='backbones of the train and infer parts (default: all)')
    p.add_argument('--shape', default='400x608',
                   help='input HEIGHTxWIDTH of the train and infer parts (default 400x608)')
    p.add_argument('--batch', type=int, default=2, help='images per training step (default 2)')
    p.add_argument('--infer-batches', type=int, nargs='+', default=[1, 8],
                   help='batch sizes of the infer part (default 1 8)')
    p.add_argument('--configs', nargs='+', default=DEFAULT_CONFIGS,
                   help='whole models of the model part, each counted with its family\'s '
                   'control (default: SLAB-Swin-T Mask R-CNN 1x and UperNet 160k)')
    p.add_argument('--precision', default='bf16', choices=['bf16', 'fp32'],
                   help='training steps in bf16 autocast (default) or float32')
    p.add_argument('--threads', type=int, default=None, help='torch threads (default: as is)')
    p.add_argument('--top', type=int, default=25, help='operators kept per count in the JSON')
    p.add_argument('--out', default=osp.join(REPO, 'benchmarks', 'results'),
                   help='directory of <machine>-gpu_kernels.json (default benchmarks/results)')
    args = p.parse_args(argv)
    try:
        args.shape = parse_shape(args.shape)
    except ValueError as err:
        p.error(str(err))
    if args.batch < 1 or min(args.infer_batches) < 1 or args.top < 1:
        p.error('--batch, --infer-batches and --top must be >= 1')
    for config in args.configs:
        if not osp.isfile(config):
            p.error(f'config {config} not found')
        if family(config) not in CONTROL_CONFIGS:
            p.error(f'{config}: no LayerNorm control of its family; known families: '
                    f'{", ".join(CONTROL_CONFIGS)}')
    return args


def family(config: str) -> str:
    """``'mask_rcnn'`` for ``configs/mask_rcnn_slab_swin_t_1x.py``."""
    stem = osp.splitext(osp.basename(config))[0]
    return next((f for f in CONTROL_CONFIGS if stem.startswith(f + '_')), stem)


# -- models and their steps --------------------------------------------------------------------

def build_backbone(name: str) -> torch.nn.Module:
    """The backbone ``name`` of :data:`BACKBONES`, random weights, in training mode."""
    config, options = BACKBONES[name]
    torch.manual_seed(0)
    if name == MMDET:
        model = mmdet_swin(load_config(config)[0])
        model.init_weights()
    else:
        model, _ = build(config, 'backbone', options)
    model.train()
    return model


def schedule_points(model: torch.nn.Module):
    """``({'mid': it, 'after': it}, prime)``: the iterations of the progressive norms'
    phases (the earliest mid-point, the latest end) and the training steps that fill UN's
    windows before a count; None without progressive norms."""
    from mmslab.models.layers.repbn import PRepBN
    from mmslab.models.layers.unified_norm import UN
    mids, afters, prime = [], [], 0
    for m in model.modules():
        if getattr(m, 'deploy', False):
            continue
        if isinstance(m, PRepBN):
            mids.append(m.warmup + m.step // 2)
            afters.append(m.warmup + m.step)
        elif isinstance(m, UN):
            mids.append(m.warmup_iters // 2)
            afters.append(m.grad_scale_first_iter + m.window_size)
            prime = max(prime, m.window_size)
    if not mids:
        return None
    return dict(mid=min(mids), after=max(afters)), prime


def autocast(precision: str):
    """The context the network runs in: :func:`cpu_autocast` for bf16."""
    if precision == 'fp32':
        return contextlib.nullcontext()
    from mmslab.engine.optim_wrapper import cpu_autocast
    return cpu_autocast(torch.bfloat16)


def backbone_step(model, shape, batch: int, precision: str):
    """One backbone training step on a random batch (a zero-argument callable)."""
    x = torch.randn(batch, 3, *shape)

    def step():
        model.zero_grad(set_to_none=True)
        with autocast(precision):
            loss = sum(o.float().pow(2).mean() for o in model(x))
        loss.backward()
    return step


def warm_layouts(module, inputs) -> None:
    """A no-grad forward: what eager layers keep per input size is built before a count."""
    with torch.no_grad():
        module(inputs)


def counted(fn, what: str, top: int, **counter_args) -> dict:
    """:meth:`KernelCounter.summary` of ``fn(counter)``; says what it counted."""
    t0 = time.time()
    with Float32Products(), KernelCounter(**counter_args) as counter:
        fn(counter)
    print(f'  {what}: {counter.kernels} kernels, {counter.syncs} host syncs '
          f'({time.time() - t0:.0f} s)', flush=True)
    return counter.summary(top)


def train_counts(model, name: str, args, points) -> dict:
    """phase -> the counts of one training step (one count for both phases where the
    model has no progressive norm)."""
    phases, prime = points if points else ({'mid': 0}, 0)
    out = {}
    for phase, it in phases.items():
        mmslab.set_progressive_iter(model, it - prime - 1)
        warm_layouts(model, torch.randn(1, 3, *args.shape))
        prime_step = backbone_step(model, PRIME_SHAPE, args.batch, args.precision)
        with Float32Products():  # uncounted: products in float32, as in the counts
            for j in range(prime):  # UN: its windows filled, as after `prime` iterations
                mmslab.set_progressive_iter(model, it - prime + j)
                prime_step()
        mmslab.set_progressive_iter(model, it)
        step = backbone_step(model, args.shape, args.batch, args.precision)
        what = f'{name} training step' + (f', {phase} (iteration {it})' if points else '')
        out[phase] = dict(counted(lambda c: step(), what, args.top), iteration=it)
    if points is None:
        out['after'] = out['mid']
    return out


def infer_counts(model, name: str, args) -> dict:
    """batch -> the counts of one inference forward of the fused backbone."""
    if name == MMDET:
        fused = copy.deepcopy(model)
        fused.eval()  # mmdet's Swin returns None from train(): no chaining
    else:
        fused = fused_copy(model)
    out = {}
    for batch in args.infer_batches:
        x = torch.randn(batch, 3, *args.shape)
        warm_layouts(fused, x[:1])

        def forward(counter):
            with torch.no_grad():
                fused(x)
        out[str(batch)] = counted(forward, f'{name} fused inference, batch {batch}', args.top)
    return out


def train_input(cfg):
    """``((height, width), batch)`` of a config's training batches: its crop, else its
    ``Resize`` scale (mmdet's ``(w, h)``), and ``train_dataloader.batch_size``."""
    loader = cfg.train_dataloader
    dataset = loader.dataset
    while 'pipeline' not in dataset and 'dataset' in dataset:  # dataset wrappers
        dataset = dataset.dataset
    for step in dataset.pipeline:
        if 'crop_size' in step:
            return tuple(step['crop_size']), loader.batch_size
    for step in dataset.pipeline:
        if 'Resize' in step['type'] and 'scale' in step:
            w, h = step['scale']
            return (h, w), loader.batch_size
    raise ValueError(f'{cfg.filename}: no crop_size or Resize scale in the training pipeline')


def model_counts(config: str, args) -> dict:
    """The counts of one whole training iteration of ``config``'s model, per part."""
    from mmslab.engine.optim_wrapper import CPUAmpOptimWrapper
    torch.manual_seed(0)
    model, cfg = build(config, 'model')
    model.train()
    shape, batch = train_input(cfg)
    points = schedule_points(model.backbone)
    it = points[0]['mid'] if points else 0
    pre = model.data_preprocessor
    if hasattr(pre, 'size_divisor') and pre.size is None and pre.size_divisor is None:
        pre.size = tuple(shape)  # mmseg's training batches need one of them
    raw = synthetic_batch(model, shape, batch)
    wrapper = None
    if args.precision == 'bf16':
        wrapper = CPUAmpOptimWrapper(optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                     allow_emulated=True)
    inputs = pre(raw, True)['inputs']
    mmslab.set_progressive_iter(model, it - 1)
    warm_layouts(model.backbone, inputs[:1])
    mmslab.set_progressive_iter(model, it)

    def iteration(counter):
        model.zero_grad(set_to_none=True)
        counter.region = 'data_preprocessor'
        data = pre(raw, True)
        counter.region = 'heads'
        with wrapper.optim_context(model) if wrapper else contextlib.nullcontext():
            losses = model(**data, mode='loss')
        loss, _ = model.parse_losses(losses)
        loss.backward()

    def regions(counter):
        with ModuleRegions(counter, model, ('backbone', 'neck')), mmcv_ext_calls(counter):
            iteration(counter)
    what = f"{osp.basename(config)} training iteration, {batch}x{'x'.join(map(str, shape))}"
    return dict(counted(regions, what, args.top, backward_region='heads'), config=config,
                family=family(config), control=config == CONTROL_CONFIGS[family(config)],
                iteration=it, shape=list(shape), padded_shape=list(inputs.shape[-2:]),
                batch=batch)


# -- the report -------------------------------------------------------------------------------

def git_state() -> dict:
    """The commit of the tree, and the tracked files that differ from it."""
    def git(*cmd):
        return subprocess.run(['git', *cmd], cwd=REPO, capture_output=True, text=True,
                              check=False).stdout
    changed = [line[3:] for line in git('status', '--porcelain', '--untracked-files=no')
               .splitlines() if line.strip()]
    return dict(commit=git('rev-parse', 'HEAD').strip() or None, changed_files=changed)


def ratio(a, b) -> str:
    return fmt_times(a, b) or '-'


def print_table(header, rows) -> None:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows:
        print('  '.join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths))))


def print_tables(report: dict) -> None:
    if report['backbones']:
        print_backbone_table(report)
    if report['models']:
        print_model_table(report['models'])
    print(f"\nrule: {report['rule']}\nmachine: {machine_line(report['machine'])}; "
          f"{report['wall_s']:.0f} s in all")


def print_backbone_table(report: dict) -> None:
    rows = report['backbones']
    ctrl, mmdet = rows.get(CONTROL), rows.get(MMDET)
    batches = [str(b) for b in report['infer_batches']]
    print(f"\nGPU kernels of a backbone training step (batch {report['batch']} at "
          f"{'x'.join(map(str, report['shape']))}, {report['precision']}), its host syncs, "
          "and the fused backbone's inference forward; x: over the control's / mmdet "
          "Swin-T's count")
    table = []
    for name, row in rows.items():
        cells = [name]
        for phase in PHASES:
            k = nested(row, 'train', phase, 'kernels')
            cells += [k if k is not None else '-',
                      ratio(k, nested(ctrl, 'train', phase, 'kernels')),
                      ratio(k, nested(mmdet, 'train', phase, 'kernels'))]
        syncs = [nested(row, 'train', p, 'syncs') for p in PHASES]
        cells.append(max(syncs) if None not in syncs else '-')
        for b in batches:
            k = nested(row, 'infer', b, 'kernels')
            cells += [k if k is not None else '-', ratio(k, nested(ctrl, 'infer', b, 'kernels'))]
        table.append(cells)
    print_table(['backbone', 'mid-decay', 'x ctrl', 'x mmdet', 'after', 'x ctrl', 'x mmdet',
                 'syncs'] + [c for b in batches for c in (f'infer b{b}', 'x ctrl')], table)


def print_model_table(models: dict) -> None:
    print('\nWhole training iteration (data preprocessor, losses, backward): kernels and host '
          "syncs, x: over the family's control")
    table = []
    for name, row in models.items():
        ref = next(r for r in models.values() if r['family'] == row['family'] and r['control'])
        parts, ref_parts = row['regions'], ref['regions']
        table.append([
            name, f"{row['batch']}x{'x'.join(map(str, row['padded_shape']))}", row['kernels'],
            ratio(row['kernels'], ref['kernels']), row['syncs'],
            nested(parts, 'backbone', 'kernels'),
            ratio(nested(parts, 'backbone', 'kernels'), nested(ref_parts, 'backbone', 'kernels')),
            nested(parts, 'backbone', 'syncs'), nested(parts, 'heads', 'kernels'),
            nested(parts, 'heads', 'syncs')])
    print_table(['config', 'input', 'kernels', 'x ctrl', 'syncs', 'backbone', 'x ctrl', 'syncs',
                 'heads', 'syncs'], table)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.time()
    backbones, models = {}, {}
    configs = []
    for config in args.configs if 'model' in args.parts else []:
        configs += [CONTROL_CONFIGS[family(config)], config]
    configs = list(dict.fromkeys(configs))
    names = args.backbones if {'train', 'infer'} & set(args.parts) else []
    total = len(names) + len(configs)
    with mmslab.run_code_path('cuda'):
        for i, name in enumerate(names):
            print(f'[{i + 1}/{total}] {name}', flush=True)
            model = build_backbone(name)
            points = schedule_points(model)
            row = dict(config=BACKBONES[name][0], options=BACKBONES[name][1],
                       progressive_norms=points[0] if points else None)
            if 'train' in args.parts:
                row['train'] = train_counts(model, name, args, points)
            if 'infer' in args.parts:
                row['infer'] = infer_counts(model, name, args)
            backbones[name] = row
        for i, config in enumerate(configs):
            print(f'[{len(names) + i + 1}/{total}] {config}', flush=True)
            models[osp.splitext(osp.basename(config))[0]] = model_counts(config, args)
    command = ['python benchmarks/gpu_kernels.py'] + list(sys.argv[1:] if argv is None else argv)
    report = dict(tool='gpu_kernels', command=' '.join(command),
                  date=datetime.date.today().isoformat(), machine=machine_info(),
                  git=git_state(), torch=torch.__version__, rule=RULE, code_path='cuda',
                  products='float32 (Float32Products)',
                  precision=args.precision, shape=list(args.shape), batch=args.batch,
                  infer_batches=args.infer_batches, reference=CONTROL, mmdet=MMDET,
                  backbones=backbones, models=models, wall_s=time.time() - start)
    print_tables(report)
    os.makedirs(args.out, exist_ok=True)
    path = osp.join(args.out, f"{machine_slug(report['machine'])}-gpu_kernels.json")
    with open(path, 'w') as f:
        json.dump(report, f, indent=1)
    print(f'wrote {osp.relpath(path)}')
    return report


if __name__ == '__main__':
    main()
