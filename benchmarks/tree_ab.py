"""Two checkouts of mmslab side by side: the same backbone (or detector) built by each, timed
interleaved.

    python benchmarks/tree_ab.py OLD_TREE NEW_TREE --models control slab \
        --mode infer --precision fp32 --shape 800x1344 --rounds 5
    python benchmarks/tree_ab.py OLD_TREE NEW_TREE --mode runtime --shape 512x512 \
        --variants ort_fp32 ort_int8 ov_fp32 ov_bf16 ov_int8

``--models``: the Mask R-CNN configs' backbones (``control``: the LayerNorm Swin-T) and
``mmdet``: the control config with mmdet's own Swin-T.

Both trees register the same classes, so each (tree, model) runs in a worker process of its
own, built once; every round each worker runs one timed call, in rotating order, and only
one runs at a time. ``--mode infer``: the fused backbone at batch 1 in eager PyTorch;
``train``: a backbone training step at batch 2, progressive norms in the middle of their
decay; ``runtime``: the fused backbone exported by each tree for onnxruntime and OpenVINO
(free height and width), INT8 calibrated on two random images. ``--part model``: the whole
fused detector instead (``predict`` at batch 1 in eager PyTorch, post-processing in
float32; the whole exported graph in the runtimes). Prints new/old medians with
[min-max] and writes the times to ``--out`` (JSON).
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = dict(control='configs/mask_rcnn_swin_t_1x.py',
               prepbn='configs/mask_rcnn_prepbn_swin_t_1x.py',
               slab='configs/mask_rcnn_slab_swin_t_1x.py',
               repa='configs/mask_rcnn_repa_swin_t_1x.py',
               mmdet='mmdet:configs/mask_rcnn_swin_t_1x.py')
#: ``mmdet:CONFIG``: the config with mmdet's own Swin-T as its backbone (the control's
#: architecture and outputs), which each tree exports with its own rewrites.
MMDET_SWIN_T = dict(type='SwinTransformer', embed_dims=96, depths=(2, 2, 6, 2),
                    num_heads=(3, 6, 12, 24), window_size=7, drop_path_rate=0.0,
                    out_indices=(0, 1, 2, 3))
VARIANTS = ('ort_fp32', 'ort_int8', 'ov_fp32', 'ov_bf16', 'ov_int8')


def worker(tree: str, config: str, mode: str, part: str, precision: str, threads: int,
           variants=VARIANTS) -> None:
    """Build, print 'ready', then time one call per stdin line ('VARIANT HxW')."""
    sys.path.insert(0, tree)
    import numpy as np
    import torch
    torch.set_num_threads(threads)
    from mmslab.benchmark import fused_copy, trained_like_parameters
    from mmslab.utils.launch import load_config, model_registry
    torch.manual_seed(0)
    backbone = None
    if config.startswith('mmdet:'):
        config, backbone = config[len('mmdet:'):], MMDET_SWIN_T
    if part == 'model':
        from mmslab.utils.launch import build_model_from_config
        whole = build_model_from_config(f'{tree}/{config}', backbone=backbone)[1]
        whole.init_weights()
        model = whole.backbone
    else:
        cfg, scope = load_config(f'{tree}/{config}')
        cfg.model.backbone = dict(backbone or cfg.model.backbone, init_cfg=None)
        model = model_registry(scope).build(cfg.model.backbone)
        model.init_weights()
    trained_like_parameters(model)
    inputs = {}

    def fuse(module):
        """The fused copy; mmdet's Swin backbone as it is (nothing to fuse, and its
        ``train()`` returns None)."""
        if backbone is not None and part == 'backbone':
            module.eval()
            return module
        return fused_copy(module.eval())

    def image(shape, batch=1):
        if shape not in inputs:
            h, w = map(int, shape.split('x'))
            inputs[shape] = np.random.RandomState(9).randn(batch, 3, h, w).astype(np.float32)
        return inputs[shape]

    if mode == 'runtime':
        from mmslab.deploy.onnx_export import export_runtime_graphs
        from mmslab.deploy.quantize import quantize_onnxruntime, quantize_openvino
        from mmslab.deploy.runtimes import open_model
        model, out = fuse(whole if part == 'model' else model), tempfile.mkdtemp()
        export_runtime_graphs(model, part, (320, 320), out, ['onnxruntime', 'openvino'],
                              dynamic=True)
        calib = [np.random.RandomState(i).randn(1, 3, 512, 512).astype(np.float32)
                 for i in range(2)]
        xml = f'{out}/openvino/model.xml'
        # only the variants asked for (bf16 needs a bf16 CPU), opened before 'ready'
        openers = dict(
            ort_fp32=lambda: open_model(f'{out}/model.onnx', 'onnxruntime', 'fp32', threads),
            ort_int8=lambda: open_model(quantize_onnxruntime(
                f'{out}/model.onnx', f'{out}/int8.onnx', calib), 'onnxruntime', 'int8', threads),
            ov_fp32=lambda: open_model(xml, 'openvino', 'fp32', threads),
            ov_bf16=lambda: open_model(xml, 'openvino', 'bf16', threads),
            ov_int8=lambda: open_model(quantize_openvino(
                xml, f'{out}/openvino/int8.xml', calib), 'openvino', 'int8', threads))
        runs = {v: openers[v]() for v in variants}

        def call(variant, shape):
            runs[variant](image(shape))
    elif part == 'model':
        from mmslab.benchmark import make_runners
        whole, runners = fuse(whole), {}

        def call(variant, shape):
            key = (variant, shape)
            if key not in runners:
                runners[key] = make_runners(whole, tuple(map(int, shape.split('x'))), 'model',
                                            precision=variant)
            with torch.inference_mode():
                runners[key]()
    elif mode == 'infer':
        model = fuse(model)

        def call(variant, shape):
            with torch.inference_mode(), torch.autocast(
                    'cpu', dtype=torch.bfloat16, enabled=precision == 'bf16'):
                model(torch.from_numpy(image(shape)))
    else:
        model.train()
        for m in model.modules():  # progressive norms in the middle of their decay
            step = getattr(m, 'step', None)
            if callable(getattr(m, 'set_iter', None)) and isinstance(step, int):
                m.set_iter((step + getattr(m, 'warmup', 0)) // 2)

        def call(variant, shape):
            model.zero_grad(set_to_none=True)
            outs = model(torch.from_numpy(image(shape, batch=2)))
            sum(o.float().pow(2).mean() for o in outs).backward()
    print('ready', flush=True)
    for line in sys.stdin:
        start = time.perf_counter()
        call(*line.split())
        print((time.perf_counter() - start) * 1000, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('old')
    p.add_argument('new')
    p.add_argument('--models', nargs='+', default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument('--mode', choices=('infer', 'train', 'runtime'), default='infer')
    p.add_argument('--part', choices=('backbone', 'model'), default='backbone',
                   help='the backbone, or the whole detector (infer, runtime)')
    p.add_argument('--precision', choices=('fp32', 'bf16'), default='fp32')
    p.add_argument('--variants', nargs='+', choices=VARIANTS, default=list(VARIANTS))
    p.add_argument('--shape', default='512x512')
    p.add_argument('--rounds', type=int, default=5)
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--out', default='tree_ab.json')
    p.add_argument('--worker', nargs=2, help=argparse.SUPPRESS)  # tree, config
    args = p.parse_args()
    if args.mode == 'train' and args.part == 'model':
        p.error('--mode train times backbones (tools/benchmark_train.py --part model: whole '
                'models)')
    if args.worker:
        return worker(*args.worker, args.mode, args.part, args.precision, args.threads,
                      args.variants)
    variants = args.variants if args.mode == 'runtime' else [args.precision]
    workers = {}
    for name in args.models:
        for tree in ('old', 'new'):
            cmd = [sys.executable, __file__, args.old, args.new, '--mode', args.mode,
                   '--part', args.part,
                   '--precision', args.precision, '--threads', str(args.threads),
                   '--variants', *args.variants, '--worker', getattr(args, tree), CONFIGS[name]]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    text=True, cwd=tempfile.gettempdir())
            while proc.stdout.readline().strip() != 'ready':  # (tools print progress)
                if proc.poll() is not None:
                    raise SystemExit(f'{name} ({tree}) failed to start')
            workers[name, tree] = proc
            print(f'{name} ({tree}) ready', flush=True)

    def run(key, variant):
        proc = workers[key]
        proc.stdin.write(f'{variant} {args.shape}\n')
        proc.stdin.flush()
        return float(proc.stdout.readline())

    from mmslab.utils.machine import machine_info
    report = dict(command=' '.join(['python benchmarks/tree_ab.py'] + sys.argv[1:]),
                  date=time.strftime('%Y-%m-%d'), machine=machine_info('cpu'), times_ms={})
    print(report['machine'])
    keys = list(workers)
    for variant in variants:
        for key in keys:  # warm-up (OpenVINO compiles for the shape)
            run(key, variant)
        times = {key: [] for key in keys}
        for r in range(args.rounds):
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                times[key].append(run(key, variant))
        for name in args.models:
            old, new = times[name, 'old'], times[name, 'new']
            ratio = [b / a for a, b in zip(old, new)]
            print(f'{args.mode} {variant} {args.shape} {name}: old {statistics.median(old):.1f}'
                  f' ms, new {statistics.median(new):.1f} ms, new/old '
                  f'{statistics.median(ratio):.3f} [{min(ratio):.3f}-{max(ratio):.3f}]')
        report['times_ms'][variant] = {f'{n}|{t}': v for (n, t), v in times.items()}
    with open(args.out, 'w') as f:
        json.dump(report, f, indent=1)
    for proc in workers.values():
        proc.stdin.close()
        proc.wait()


if __name__ == '__main__':
    main()
