"""Layer-level figures: attention cost against tokens, channel-idle FFN fusion gain.

    python benchmarks/layer_scaling.py [--threads 2] [--repeat 5] --out work_dirs/layers

1. SLA, BiNorm and softmax attention over one window of N tokens (N = 1k .. 64k, C = 96,
   3 heads, batch 1): median time and peak memory (tracemalloc of the CPU allocator is not
   available for torch, so peak memory is measured with torch.profiler's memory events).
   Softmax materializes no N x N matrix inside PyTorch's fused kernel, but its time is
   quadratic; it is skipped where it would take longer than ``--max-softmax-s``.
2. Channel-idle FFN block (with its residual) fused vs unfused for C = 96 .. 768 on 56x56
   tokens, interleaved; the ratio unfused / fused.
Writes ``layer_scaling.json`` and ``layer_scaling.png``.
"""
import argparse
import json
import os
import os.path as osp

import torch
import torch.nn.functional as F
from mmengine.utils import ProgressBar

from mmslab.benchmark import measure_interleaved, summarize
from mmslab.utils.machine import machine_info
from mmslab.models.layers import SLA, BiNormAttention, ChannelIdleFFN
from mmslab.utils.plotting import saved_figure


def peak_memory_mb(fn) -> float:
    """Peak bytes allocated by the CPU allocator during ``fn()`` (profiler memory events)."""
    with torch.profiler.profile(profile_memory=True) as prof:
        fn()
    current = peak = 0
    events = sorted((e for e in prof.events() if e.cpu_memory_usage),
                    key=lambda e: e.time_range.start)
    for e in events:
        current += e.cpu_memory_usage
        peak = max(peak, current)
    return peak / 2 ** 20


def attention_scaling(tokens, repeat, max_softmax_s, bar):
    c, heads = 96, 3
    sla = SLA(c, heads, 1).eval()  # window size irrelevant: attend() gets the grid
    binorm = BiNormAttention(c, heads, 1).eval()
    rows = []
    for n in tokens:
        side = int(round(n ** 0.5))
        n = side * side
        qkv = torch.randn(1, n, 3 * c)
        q, k, v = qkv.view(1, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
        sla.positional_encoding = torch.nn.Parameter(torch.zeros(1, n, c))
        sla.window_size = (side, side)
        fns = {'SLA': lambda: sla.attend(qkv, (side, side)),
               'BiNorm': lambda: binorm.attend(qkv, (side, side))}
        est = 2.0 * n * n * c / 5e10  # softmax: 2 N^2 C flops at ~50 GFLOP/s (fused kernel)
        if est <= max_softmax_s:
            fns['softmax'] = lambda: F.scaled_dot_product_attention(q, k, v)
        with torch.inference_mode():
            times = measure_interleaved(fns, repeat, 1)
            for name, fn in fns.items():
                rows.append(dict(layer=name, tokens=n, **summarize(times[name]),
                                 peak_mb=peak_memory_mb(fn)))
        bar.update()
    return rows


def ffn_fusion(widths, repeat, bar):
    rows = []
    x_tokens = 56 * 56
    for c in widths:
        ffn = ChannelIdleFFN(c, 4 * c, idle_ratio=0.75).eval()
        fused = ChannelIdleFFN(c, 4 * c, idle_ratio=0.75).eval()
        fused.load_state_dict(ffn.state_dict())
        fused.switch_to_deploy()
        x = torch.randn(1, x_tokens, c)
        with torch.inference_mode():
            times = measure_interleaved({'unfused': lambda: ffn(x), 'fused': lambda: fused(x)},
                                        repeat, 2)
        u, f = summarize(times['unfused']), summarize(times['fused'])
        rows.append(dict(channels=c, tokens=x_tokens, unfused_ms=u['median_ms'],
                         fused_ms=f['median_ms'], ratio=u['median_ms'] / f['median_ms'],
                         params_unfused=sum(p.numel() for p in ffn.parameters()),
                         params_fused=sum(p.numel() for p in fused.parameters())))
        bar.update()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--repeat', type=int, default=5)
    p.add_argument('--tokens', type=int, nargs='+', default=[1024, 4096, 16384, 65536])
    p.add_argument('--widths', type=int, nargs='+', default=[96, 192, 384, 768])
    p.add_argument('--max-softmax-s', type=float, default=20.0)
    p.add_argument('--out', default='work_dirs/layers')
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    bar = ProgressBar(len(args.tokens) + len(args.widths))
    attn = attention_scaling(args.tokens, args.repeat, args.max_softmax_s, bar)
    ffn = ffn_fusion(args.widths, args.repeat, bar)
    print('\nattention over one window (C=96, 3 heads, batch 1)')
    print(f"  {'layer':8s}{'tokens':>8s}{'median ms':>12s}{'peak MB':>10s}")
    for r in attn:
        print(f"  {r['layer']:8s}{r['tokens']:8d}{r['median_ms']:12.2f}{r['peak_mb']:10.1f}")
    print('\nchannel-idle FFN block, 56x56 tokens: unfused / fused (same run, interleaved)')
    for r in ffn:
        print(f"  C={r['channels']:4d}  unfused {r['unfused_ms']:8.2f} ms  fused "
              f"{r['fused_ms']:8.2f} ms  ratio {r['ratio']:.2f}x  params "
              f"{r['params_unfused']} -> {r['params_fused']}")
    report = dict(machine=machine_info(), threads=args.threads, repeat=args.repeat,
                  attention=attn, ffn=ffn)
    with open(osp.join(args.out, 'layer_scaling.json'), 'w') as f:
        json.dump(report, f, indent=2)
    plot(report, osp.join(args.out, 'layer_scaling.png'))
    print(f"wrote {osp.join(args.out, 'layer_scaling.json')} and layer_scaling.png")


def plot(report, path):
    with saved_figure(path, ncols=3, panel_size=(5, 4)) as (fig, axes):
        axes = axes[0]
        for layer in dict.fromkeys(r['layer'] for r in report['attention']):
            rows = [r for r in report['attention'] if r['layer'] == layer]
            axes[0].loglog([r['tokens'] for r in rows], [r['median_ms'] for r in rows], 'o-',
                           label=layer)
            axes[1].loglog([r['tokens'] for r in rows],
                           [max(r['peak_mb'], 1e-3) for r in rows], 'o-', label=layer)
        axes[0].set(xlabel='tokens', ylabel='median ms', title='attention time')
        axes[1].set(xlabel='tokens', ylabel='peak MB', title='attention peak memory')
        widths = [r['channels'] for r in report['ffn']]
        axes[2].plot(widths, [r['ratio'] for r in report['ffn']], 'o-')
        axes[2].set(xlabel='channels C', ylabel='unfused / fused time',
                    title='channel-idle FFN fusion speed-up')
        for ax in axes:
            ax.grid(alpha=0.3)
        axes[0].legend()
        axes[1].legend()


if __name__ == '__main__':
    main()
