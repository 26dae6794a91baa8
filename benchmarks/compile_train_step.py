"""Training step (forward + backward) of a backbone in eager PyTorch and under torch.compile,
interleaved in one run, with the compilation timed apart.

    python benchmarks/compile_train_step.py [--model PRepBNSwin] [--depths 2 2 2 2]
        [--shape 256x256] [--batch 2] [--steps 6] [--threads 2] --out work_dirs/compile_train

Both copies start from the same weights and follow the same PRepBN schedule (set before every
step, in the blend: ``step`` 1000), without drop path, so their losses must agree; the loss is
the mean square of every output. Writes ``compile_train_step.json`` with the machine.
"""
import argparse
import copy
import json
import os
import os.path as osp
import statistics

import torch

import mmslab
from mmslab.benchmark import parse_shape
from mmslab.utils.machine import machine_info, machine_line
from mmslab.utils.timing import timed_ms


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--model', default='PRepBNSwin', help='registered mmslab backbone')
    p.add_argument('--depths', type=int, nargs='+', default=None,
                   help='blocks per stage (default: the model\'s; fewer compile faster)')
    p.add_argument('--shape', default='256x256')
    p.add_argument('--batch', type=int, default=2)
    p.add_argument('--steps', type=int, default=6, help='timed steps per form')
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--out', default='work_dirs/compile_train')
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from mmdet.registry import MODELS
    cfg = dict(type=args.model, drop_path_rate=0.0)
    if args.depths:
        cfg['depths'] = tuple(args.depths)
    if 'PRepBN' in args.model or 'SLAB' in args.model:
        cfg['norm_cfg'] = dict(type='PRepBN', step=1000)
    eager = MODELS.build(cfg)
    eager.init_weights()
    eager.train()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model)
    x = torch.randn(args.batch, 3, *parse_shape(args.shape))

    def step(module, fn, it):
        mmslab.set_progressive_iter(module, it)
        module.zero_grad(set_to_none=True)
        loss = sum(o.float().pow(2).mean() for o in fn(x))
        loss.backward()
        return loss.item()

    _, compile_ms = timed_ms(lambda: step(model, compiled, 1))
    step(eager, eager, 1)
    times = {'eager': [], 'compiled': []}
    losses = {'eager': [], 'compiled': []}
    for it in range(2, 2 + args.steps):
        for name, (module, fn) in (('eager', (eager, eager)), ('compiled', (model, compiled))):
            loss, ms = timed_ms(lambda: step(module, fn, it))
            times[name].append(ms)
            losses[name].append(loss)
    med = {k: statistics.median(v) for k, v in times.items()}
    report = dict(model=args.model, depths=args.depths, shape=args.shape, batch=args.batch,
                  machine=machine_info(), threads=args.threads, torch=torch.__version__,
                  first_compiled_step_s=compile_ms / 1000.0, median_ms=med, times_ms=times,
                  losses=losses, compiled_over_eager=med['compiled'] / med['eager'])
    print(f"{args.model} train step, {args.batch}x{args.shape}: eager {med['eager']:.0f} ms, "
          f"compiled {med['compiled']:.0f} ms (x{report['compiled_over_eager']:.2f}); first "
          f"compiled step {report['first_compiled_step_s']:.0f} s; max loss difference "
          f"{max(abs(a - b) for a, b in zip(losses['eager'], losses['compiled'])):.1e}")
    print(f'machine: {machine_line(report["machine"])}')
    os.makedirs(args.out, exist_ok=True)
    with open(osp.join(args.out, 'compile_train_step.json'), 'w') as f:
        json.dump(report, f, indent=2)
    return report


if __name__ == '__main__':
    main()
