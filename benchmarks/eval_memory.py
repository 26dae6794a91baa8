"""Peak memory of evaluation over many input sizes, fused against unfused, each in a process
of its own (eager PyTorch on the CPU).

    python benchmarks/eval_memory.py [--part backbone model] [--num-sizes 20]
        [--batch-sizes 1 2] [--config configs/mask_rcnn_prepbn_swin_t_1x.py] --out DIR

COCO images come in hundreds of sizes; mmdet's keep-ratio resize to 1333x800 and the pad to
32 give almost every validation image its own input shape, so whatever a model keeps per
input size grows over an evaluation. Each case (part, fused or not, batch size) runs in a
fresh process that builds the model, then runs every size of :func:`coco_like_shapes` in
turn, recording the process's resident memory after each and its peak (``ru_maxrss``).
Prints the peaks with fused / unfused ratios, writes ``eval_memory.json`` and
``eval_memory.png`` (resident memory against the sizes run).
"""
import argparse
import json
import os
import os.path as osp
import resource
import subprocess
import sys
from typing import List, Tuple

PARTS = ('backbone', 'model')
DEFAULT_CONFIG = 'configs/mask_rcnn_prepbn_swin_t_1x.py'


def coco_like_shapes(num: int, scale: Tuple[int, int] = (1333, 800)) -> List[Tuple[int, int]]:
    """``num`` distinct padded input shapes (h, w) of mmdet's test pipeline (keep-ratio
    resize to ``scale``, pad to 32) for images of aspect ratios spread from portrait 1:2 to
    landscape 2:1, alternating orientation."""
    long_side, short_side = max(scale), min(scale)
    shapes = []
    for i in range(num):
        ratio = 1.0 + i / max(num - 1, 1)  # long / short side, 1 .. 2
        w, h = (640, round(640 / ratio)) if i % 2 == 0 else (round(640 / ratio), 640)
        factor = min(long_side / max(h, w), short_side / min(h, w))
        rh, rw = round(h * factor), round(w * factor)
        shapes.append((-(-rh // 32) * 32, -(-rw // 32) * 32))
    return shapes


def rss_bytes() -> int:
    """The process's resident memory now."""
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


def build(part: str, fused: bool, config: str):
    """The PRepBN-Swin-T backbone or the whole model of ``config``, with normalizing random
    weights, in eval mode, fused or not."""
    import torch

    import mmslab
    from mmslab.models import PRepBNSwin
    if part == 'model':
        sys.path.insert(0, osp.dirname(osp.abspath(__file__)))
        from deploy_speed import build_upernet
        return build_upernet(config, fuse=fused, cfg_options={'model.backbone.init_cfg': None})
    torch.manual_seed(0)
    model = PRepBNSwin()
    model.init_weights()
    model.eval()
    return mmslab.reparameterize(model) if fused else model


def run_case(part: str, fused: bool, batch_size: int, shapes, config: str) -> dict:
    """One case in this process: the model built, then every shape in turn."""
    import torch

    from mmslab.benchmark import fake_batch
    torch.manual_seed(0)
    model = build(part, fused, config)
    after_build = rss_bytes()
    rss = []
    with torch.no_grad():
        for shape in shapes:
            if part == 'backbone':
                model(torch.randn(batch_size, 3, *shape))
            else:
                inputs, samples = fake_batch(model, shape, batch_size)
                model.predict(inputs, samples, rescale=False)
            rss.append(rss_bytes())
    return dict(part=part, fused=fused, batch_size=batch_size, rss_after_build=after_build,
                rss=rss, peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--part', nargs='+', choices=PARTS, default=list(PARTS))
    p.add_argument('--num-sizes', type=int, default=20)
    p.add_argument('--batch-sizes', type=int, nargs='+', default=[1, 2])
    p.add_argument('--config', default=DEFAULT_CONFIG,
                   help=f'the whole model (--part model); default {DEFAULT_CONFIG}')
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--out', required=True, help='output directory')
    p.add_argument('--case', help=argparse.SUPPRESS)  # internal: run one case, print JSON
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    shapes = coco_like_shapes(args.num_sizes)
    if args.case:
        import torch
        torch.set_num_threads(args.threads)
        part, fused, batch = args.case.split(':')
        print(json.dumps(run_case(part, fused == 'fused', int(batch), shapes, args.config)))
        return
    from mmslab.utils.machine import machine_info, machine_line
    os.makedirs(args.out, exist_ok=True)
    cases = [(part, fused, b) for part in args.part for b in args.batch_sizes
             for fused in (False, True)]
    results = []
    for i, (part, fused, batch) in enumerate(cases):
        label = f'{part} {"fused" if fused else "unfused"} batch {batch}'
        print(f'[{i + 1}/{len(cases)}] {label}: {len(shapes)} sizes ...', flush=True)
        cmd = [sys.executable, __file__, '--case', f'{part}:{"fused" if fused else "un"}:{batch}',
               '--num-sizes', str(args.num_sizes), '--config', args.config,
               '--threads', str(args.threads), '--out', args.out]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    rows = []
    for part in args.part:
        for b in args.batch_sizes:
            pair = {r['fused']: r for r in results if r['part'] == part and r['batch_size'] == b}
            rows.append(dict(part=part, batch_size=b, unfused_peak=pair[False]['peak'],
                             fused_peak=pair[True]['peak'],
                             ratio=pair[True]['peak'] / pair[False]['peak']))
    print(f'\n{machine_line()}; {len(shapes)} sizes {shapes[0]} .. {shapes[-1]}')
    print(f'{"part":9s} {"batch":>5s} {"unfused MiB":>12s} {"fused MiB":>10s} '
          f'{"fused/unfused":>14s}')
    for r in rows:
        print(f'{r["part"]:9s} {r["batch_size"]:5d} {r["unfused_peak"] / 2**20:12.0f} '
              f'{r["fused_peak"] / 2**20:10.0f} {r["ratio"]:14.3f}')
    report = dict(machine=machine_info(), shapes=shapes, config=args.config, cases=results,
                  peaks=rows, threads=args.threads)
    with open(osp.join(args.out, 'eval_memory.json'), 'w') as f:
        json.dump(report, f, indent=1)
    plot(results, osp.join(args.out, 'eval_memory.png'))


def plot(results, path):
    from mmslab.utils.plotting import saved_figure
    with saved_figure(path, panel_size=(7, 4)) as (_, axes):
        ax = axes[0][0]
        for r in results:
            label = f'{r["part"]} {"fused" if r["fused"] else "unfused"} b{r["batch_size"]}'
            ax.plot(range(1, len(r['rss']) + 1), [v / 2**20 for v in r['rss']], label=label,
                    linestyle='-' if r['fused'] else '--')
        ax.set_xlabel('input sizes run')
        ax.set_ylabel('resident memory (MiB)')
        ax.legend(fontsize=7)


if __name__ == '__main__':
    main()
