"""Does onnxruntime compute bf16 faster than fp32 on this CPU? A probe in a few seconds.

    python benchmarks/ort_bf16_probe.py [--tokens 16384] [--threads 2] [--repeat 7]
        [--out work_dirs/ort_bf16_probe.json]

The graph is a Swin-T stage-1 MLP at 512x512 (16384 tokens, 96 -> 384 -> ReLU -> 96; the
MatMuls are where these backbones spend their time), run in onnxruntime's CPU execution
provider as:

* fp32;
* fp32 with ``mlas.enable_gemm_fastmath_arm64_bfloat16=1`` (onnxruntime's only bf16 session
  option; ARM64 builds only, an x86 build ignores it);
* the MatMuls in bf16 (Cast around them): does a bf16 MatMul kernel exist?
* the MatMuls in fp16, for comparison;

and, for reference, the same graph in OpenVINO (f32 / bf16 ``INFERENCE_PRECISION_HINT``)
and PyTorch (fp32 / ``torch.autocast`` bf16), which show what the CPU's bf16 units give.
``mmslab.deploy.runtimes.ORT_NO_BF16`` (the refusal of onnxruntime bf16) is this probe's
finding on an Intel Xeon with AMX (onnxruntime 1.32); run it again where that may change.
Sessions take the runtime layer's options (``ort_session_options``, ``openvino_config``),
as every deployed model does.
"""
import argparse
import json
import os
import os.path as osp
import time

import numpy as np

from mmslab.deploy.runtimes import openvino_config, ort_session_options


def mlp_graph(tokens: int, w1: np.ndarray, w2: np.ndarray, dtype: str):
    from onnx import TensorProto, helper, numpy_helper
    f32 = TensorProto.FLOAT
    inits = [numpy_helper.from_array(w1, 'w1f'), numpy_helper.from_array(w2, 'w2f')]
    if dtype == 'fp32':
        nodes = [helper.make_node('MatMul', ['x', 'w1f'], ['h']),
                 helper.make_node('Relu', ['h'], ['r']),
                 helper.make_node('MatMul', ['r', 'w2f'], ['y'])]
    else:
        low = dict(bf16=TensorProto.BFLOAT16, fp16=TensorProto.FLOAT16)[dtype]
        nodes = [helper.make_node('Cast', ['w1f'], ['w1'], to=low),
                 helper.make_node('Cast', ['w2f'], ['w2'], to=low),
                 helper.make_node('Cast', ['x'], ['xl'], to=low),
                 helper.make_node('MatMul', ['xl', 'w1'], ['h']),
                 helper.make_node('Relu', ['h'], ['r']),
                 helper.make_node('MatMul', ['r', 'w2'], ['yl']),
                 helper.make_node('Cast', ['yl'], ['y'], to=f32)]
    c = w1.shape[0]
    graph = helper.make_graph(nodes, f'mlp_{dtype}',
                              [helper.make_tensor_value_info('x', f32, [tokens, c])],
                              [helper.make_tensor_value_info('y', f32, [tokens, c])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid('', 18)])


def interleaved_medians(fns: dict, repeat: int) -> dict:
    """Median ms of each callable: one warm-up each, then ``repeat`` rounds in rotating order
    (the noise of a shared machine spreads over all of them)."""
    names = list(fns)
    times = {n: [] for n in names}
    for n in names:
        fns[n]()
    for r in range(repeat):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            fns[n]()
            times[n].append((time.perf_counter() - t) * 1e3)
    return {n: float(np.median(t)) for n, t in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--tokens', type=int, default=16384)
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--repeat', type=int, default=7)
    p.add_argument('--out', default='work_dirs/ort_bf16_probe.json')
    args = p.parse_args(argv)
    import onnxruntime as ort
    rng = np.random.RandomState(0)
    w1 = (rng.randn(96, 384) * 0.1).astype(np.float32)
    w2 = (rng.randn(384, 96) * 0.1).astype(np.float32)
    x = rng.randn(args.tokens, 96).astype(np.float32)
    ref = np.maximum(x @ w1, 0) @ w2

    def session(model, config=None):
        so = ort_session_options(args.threads)
        for k, v in (config or {}).items():
            so.add_session_config_entry(k, v)
        return ort.InferenceSession(model.SerializeToString(), so,
                                    providers=['CPUExecutionProvider'])

    rows, fns = {}, {}

    def record(name, fn):
        try:
            y = fn()
        except Exception as exc:  # noqa: BLE001  (the finding is the failure)
            rows[name] = dict(error=str(exc).splitlines()[0][:300])
            return
        rows[name] = dict(rel_error=float(np.abs(y - ref).max() / np.abs(ref).max()))
        fns[name] = fn

    arm_key = {'mlas.enable_gemm_fastmath_arm64_bfloat16': '1'}
    for name, dtype, config in (('onnxruntime fp32', 'fp32', None),
                                ('onnxruntime fp32 + ' + next(iter(arm_key)), 'fp32', arm_key),
                                ('onnxruntime bf16 MatMuls', 'bf16', None),
                                ('onnxruntime fp16 MatMuls', 'fp16', None)):
        def run(dtype=dtype, config=config, cache={}):
            if (dtype, str(config)) not in cache:
                cache[(dtype, str(config))] = session(mlp_graph(args.tokens, w1, w2, dtype),
                                                      config)
            return cache[(dtype, str(config))].run(None, {'x': x})[0]
        record(name, run)

    try:
        import openvino as ov
        core = ov.Core()
        model = core.read_model(mlp_graph(args.tokens, w1, w2, 'fp32').SerializeToString(), b'')
        for hint in ('f32', 'bf16'):
            compiled = core.compile_model(model, 'CPU',
                                          openvino_config(args.threads, bf16=hint == 'bf16'))
            request = compiled.create_infer_request()
            record(f'openvino {hint} (reference)',
                   lambda r=request: r.infer({0: x}).to_tuple()[0].copy())
    except ImportError:
        pass
    try:
        import torch
        torch.set_num_threads(args.threads)
        xt, w1t, w2t = (torch.from_numpy(a) for a in (x, w1, w2))

        def torch_run(bf16):
            with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16, enabled=bf16):
                return (torch.relu(xt @ w1t) @ w2t).float().numpy()
        record('torch fp32 (reference)', lambda: torch_run(False))
        record('torch autocast bf16 (reference)', lambda: torch_run(True))
    except ImportError:
        pass

    for name, ms in interleaved_medians(fns, args.repeat).items():
        rows[name]['ms'] = ms
    for name, row in rows.items():
        if 'error' in row:
            print(f'{name:58s} fails: {row["error"]}')
        else:
            print(f'{name:58s} {row["ms"]:8.2f} ms  rel. error {row["rel_error"]:.1e}')

    from mmslab.utils.machine import _cpuinfo, cpu_flags
    report = dict(cpu=_cpuinfo().get('model name', 'unknown'),
                  bf16_flags=[f for f in cpu_flags() if 'bf16' in f or f == 'amx_tile'],
                  onnxruntime=ort.__version__, threads=args.threads, tokens=args.tokens,
                  results=rows)
    os.makedirs(osp.dirname(osp.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(report, f, indent=2)
    print(f"{report['cpu']} ({', '.join(report['bf16_flags']) or 'no bf16 units'}); wrote "
          f'{args.out}')
    return report


if __name__ == '__main__':
    main()
