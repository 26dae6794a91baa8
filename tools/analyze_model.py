"""Parameters and FLOPs of a model before and after re-parameterization.

    python tools/analyze_model.py CONFIG [--shape 800 1344] [--part backbone|model] [--out F]

Uses mmengine's complexity analysis (``mmengine.analysis.get_model_complexity_info``) on the
unfused model and on ``mmslab.reparameterize`` of a copy, prints a table and writes JSON.
FLOPs count multiply-adds of the operators mmengine knows (linear, conv, matmul, norms); fused
attention kernels (``scaled_dot_product_attention``) are counted by our own handle below.
"""
import argparse
import copy
import json

import torch
from mmengine.analysis import FlopAnalyzer
from mmengine.config import DictAction

import mmslab
from mmslab.utils.launch import build_model_from_config


def sdpa_flop(inputs, outputs):
    """Multiply-adds of softmax attention: Q K^T and A V."""
    q = inputs[0].type().sizes()
    k = inputs[1].type().sizes()
    v = inputs[2].type().sizes()
    if q is None or k is None or v is None:
        return 0
    batch = 1
    for s in q[:-2]:
        batch *= s
    return batch * q[-2] * k[-2] * (q[-1] + v[-1])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description='Parameters and FLOPs before/after fusion')
    p.add_argument('config')
    p.add_argument('--shape', type=int, nargs=2, default=[800, 1344], metavar=('H', 'W'))
    p.add_argument('--part', choices=['backbone', 'model'], default='backbone')
    p.add_argument('--cfg-options', nargs='+', action=DictAction)
    p.add_argument('--out', help='JSON file (default: print only)')
    return p.parse_args(argv)


def analyze(module, inputs):
    params = sum(p.numel() for p in module.parameters())
    analyzer = FlopAnalyzer(module, inputs)
    analyzer.set_op_handle('aten::scaled_dot_product_attention', sdpa_flop)
    analyzer.unsupported_ops_warnings(False)
    analyzer.uncalled_modules_warnings(False)
    return dict(params=params, flops=int(analyzer.total()))


def main(argv=None):
    args = parse_args(argv)
    _, model = build_model_from_config(args.config, args.cfg_options)
    model.eval()
    fused = mmslab.reparameterize(copy.deepcopy(model))
    h, w = args.shape
    x = torch.randn(1, 3, -(-h // 32) * 32, -(-w // 32) * 32)

    class TensorMode(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, inp):
            return self.m(inp, mode='tensor')

    rows = {}
    for name, m in (('unfused', model), ('fused', fused)):
        target = m.backbone if args.part == 'backbone' else TensorMode(m)
        with torch.no_grad():
            rows[name] = analyze(target, (x, ))
    result = dict(config=args.config, part=args.part, shape=[h, w], **rows,
                  params_ratio=rows['fused']['params'] / rows['unfused']['params'],
                  flops_ratio=rows['fused']['flops'] / max(rows['unfused']['flops'], 1))
    print(f"{'':10s}{'params (M)':>12s}{'GFLOPs':>10s}   ({args.part}, {h}x{w})")
    for name in ('unfused', 'fused'):
        print(f"{name:10s}{rows[name]['params'] / 1e6:12.2f}{rows[name]['flops'] / 1e9:10.2f}")
    print(f"{'fused/unf.':10s}{result['params_ratio']:12.3f}{result['flops_ratio']:10.3f}")
    if args.out:
        with open(args.out, 'w') as f:
            json.dump(result, f, indent=2)
        print(f'wrote {args.out}')
    return result


if __name__ == '__main__':
    main()
