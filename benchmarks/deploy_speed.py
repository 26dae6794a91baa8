"""Latency in every runtime: PyTorch eager, onnxruntime fp32 / INT8, OpenVINO fp32 / INT8,
interleaved in one run, for backbones and for whole models.

    python benchmarks/deploy_speed.py [--shapes 512x512 800x1344] [--repeat 3] [--threads 2]
        [--burst 1] [--models ...] [--runtimes ...] [--maskrcnn [800x1216]] [--upernet [512x2048]]
        [--export static|dynamic|both] [--rotation runtime|all] --out work_dirs/deploy_speed

Kinds of case:

* backbones (``--shapes``): mmdet's LayerNorm ``SwinTransformer``, the LayerNorm Swin-T
  built by mmslab's own code (the control: what the methods buy beyond mmslab's window
  handling) and the fused mmslab T presets;
* ``--maskrcnn SHAPE``: whole Mask R-CNN end to end (``dets``, ``labels``, ``masks`` after
  NMS), mmdet's own ``mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py`` against mmslab's LayerNorm
  control and fused PRepBN / SLAB / RePa-Swin-T configs. Random weights, so every model is
  given the same work after the RPN: ``score_thr`` 0 makes each keep ``max_per_img`` (100)
  detections for the mask head;
* ``--upernet SHAPE``: whole UperNet (logits) with the LayerNorm Swin-T against fused
  RePa-Swin-T.

Exports are dynamic (free H, W: what ``tools/export_onnx.py`` writes by default) unless
``--export static``; ``both`` adds each runtime row of a static export (suffix ``static``)
to compare the two in the same run. OpenVINO runs a dynamic export compiled for the
benchmarked shape (``OpenVINOModel``'s default; the warm-up call compiles), as every mmslab
path that opens an OpenVINO model does. INT8 is calibrated for each runtime on its own path
(onnxruntime static QDQ per-channel; NNCF for OpenVINO) with ``--calib-images`` random
images (latency does not depend on the calibration data; accuracy is measured by
tools/test.py --backend ... --int8). Each runtime's graph has its own head layout
(``export_runtime_graphs``; recorded under ``runtime_head_layouts``, and in each runtime
row's ``graph`` with SLA's product forms), and onnxruntime
sessions are opened as the runtime layer opens them. Batch 1.

Models are interleaved round by round within each runtime and precision (``--rotation
runtime``, the default): a process serving a model runs one runtime, and a runtime's call
right after another runtime's is slower by a similar time for every model, which compresses
the ratios (AMD EPYC, 2 threads, 512x512, onnxruntime INT8: RePa-Swin-T / the control 68 /
92 ms rotated with eager PyTorch and OpenVINO, 53 / 77 ms in a rotation of its own).
``--rotation all`` rotates every form of the case together. With ``--burst 1`` (the
default) each timed call comes right after other models' calls (their data in the caches,
their runtime's threads just stopped); ``--burst N`` times the last of N back-to-back calls
of a form, a model serving a stream of images. Models with more, smaller passes (SLA's
graphs) lose more to the first.
Prints a table and the targets, writes ``deploy_speed.json`` and ``deploy_speed.png``; the
JSON records the CPU, ISA and BLAS.
"""
import argparse
import gc
import json
import os
import os.path as osp
import shutil
import tempfile
from typing import Optional

import numpy as np
import torch
from mmengine.utils import ProgressBar

import mmslab
from mmslab.benchmark import (measure_interleaved, parse_shape, summarize,
                              trained_like_parameters)
from mmslab.deploy.export_info import is_segmentor
from mmslab.deploy.onnx_export import (ATTENTION_LAYOUTS,
                                       DEFAULT_ATTENTION_LAYOUT as DEFAULT_ATTENTION,
                                       export_runtime_graphs)
from mmslab.deploy.quantize import quantize_onnxruntime, quantize_openvino
from mmslab.deploy.runtimes import artifact_path, open_model
from mmslab.deploy.window_graphs import RUNTIME_HEAD_LAYOUTS
from mmslab.utils.allocator import add_allocator_argument, set_allocator_mode
from mmslab.utils.machine import machine_info, machine_line
from mmslab.utils.plotting import grouped_bars, saved_figure

MODELS = ('mmdet Swin-T', 'LN Swin-T', 'PRepBN-Swin-T', 'SLAB-Swin-T', 'RePa-Swin-T')
RUNTIMES = ('eager', 'eager bf16', 'ort fp32', 'ort int8', 'ov fp32', 'ov bf16', 'ov int8')
#: What runs unless --runtimes says otherwise (bf16 forms need a CPU with bf16 units).
DEFAULT_RUNTIMES = ('eager', 'ort fp32', 'ort int8', 'ov fp32', 'ov int8')
ROTATIONS = ('runtime', 'all')  # what rotates together (see the module docstring)
BASELINE = 'mmdet Swin-T'
CONTROL = 'LN Swin-T'  # mmslab's own LayerNorm Swin-T
RUNTIME_PREFIXES = dict(onnxruntime='ort ', openvino='ov ')  # runtime -> its rows' prefix
MMDET_MASK_RCNN = 'swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'  # in mmdet's package
MASK_RCNN_CONFIGS = {
    'mmdet Swin-T': MMDET_MASK_RCNN,
    'LN Swin-T': 'configs/mask_rcnn_swin_t_1x.py',
    'PRepBN-Swin-T': 'configs/mask_rcnn_prepbn_swin_t_1x.py',
    'SLAB-Swin-T': 'configs/mask_rcnn_slab_swin_t_1x.py',
    'RePa-Swin-T': 'configs/mask_rcnn_repa_swin_t_1x.py'}


def build_backbone(name: str) -> torch.nn.Module:
    """A backbone with realistic random weights, fused when it is an mmslab model."""
    from mmdet.models.backbones import SwinTransformer
    from mmslab.models import PRepBNSwin, RePaSwin, SLABSwin
    from mmslab.models.layers.bn_recalibration import recalibrate_bn
    torch.manual_seed(0)
    if name == 'mmdet Swin-T':
        model = SwinTransformer()
        model.init_weights()
        trained_like_parameters(model)
        model.eval()  # mmdet's Swin.train() returns None: no chaining
        return model
    from mmslab.models import ReparamSwinTransformer
    model = {'LN Swin-T': ReparamSwinTransformer, 'PRepBN-Swin-T': PRepBNSwin,
             'SLAB-Swin-T': SLABSwin, 'RePa-Swin-T': RePaSwin}[name]()
    model.init_weights()
    trained_like_parameters(model)  # no zero biases or unit norm scales for runtimes to drop
    with torch.no_grad():  # alpha 0 + BN statistics of real activations: a normalizing model
        for pname, p in model.named_parameters():
            if pname.endswith('.alpha'):
                p.zero_()
    recalibrate_bn(model, [torch.randn(1, 3, 224, 224) for _ in range(2)], 2, logger='silent')
    return mmslab.reparameterize(model.eval())


def mmdet_config(relative: str) -> str:
    """A config shipped inside the mmdet package (``mmdet/.mim/configs``)."""
    import mmdet
    path = osp.join(osp.dirname(mmdet.__file__), '.mim', 'configs', relative)
    if not osp.isfile(path):
        raise FileNotFoundError(f'{path}: mmdet ships no such config')
    return path


def build_detector(name: str) -> torch.nn.Module:
    """A whole Mask R-CNN with random, normalizing weights, fused when it is mmslab's, that
    keeps ``max_per_img`` detections (see the module docstring)."""
    config = MASK_RCNN_CONFIGS[name]
    if config == MMDET_MASK_RCNN:
        config = mmdet_config(config)
    model = build_upernet(config, fuse=name != BASELINE,
                          cfg_options={'model.backbone.init_cfg': None,
                                       'model.test_cfg.rcnn.score_thr': 0.0})
    return model


def share_heads(models: dict) -> None:
    """Give every detector the neck and heads weights of the first (the control when it
    is timed). With random weights and ``score_thr`` 0 the heads' work depends on their
    weights (NMS over the candidates their scores and boxes make), not on the features:
    on an AMD EPYC one Mask R-CNN's RPN and RoI heads took 1541 / 1525 ms on its own / on
    another backbone's features, while the other model's heads took 1647 / 1655 ms on the
    same two, a difference that belongs to neither backbone. The necks and heads of the
    compared configs are the same modules, so the weights load strictly."""
    names = sorted(models, key=lambda n: n != CONTROL)
    source = models[names[0]]
    for name in names[1:]:
        for part, module in source.named_children():
            if part == 'backbone':
                continue
            target = getattr(models[name], part, None)
            if target is None:
                raise ValueError(f'{name} has no {part!r} to share with {names[0]}')
            target.load_state_dict(module.state_dict())


def build_upernet(config: str, fuse: bool, cfg_options=None) -> torch.nn.Module:
    from mmengine.logging import MMLogger
    from mmslab.models.layers.bn_recalibration import recalibrate_bn
    from mmslab.utils.launch import build_model_from_config
    torch.manual_seed(0)
    _, model = build_model_from_config(config, cfg_options)
    logger = MMLogger.get_current_instance()
    level = logger.level
    logger.setLevel('WARNING')  # init_weights logs every parameter at INFO
    try:
        model.init_weights()
    finally:
        logger.setLevel(level)
    trained_like_parameters(model)  # (see build_backbone)
    with torch.no_grad():  # alpha 0 + BN statistics of real activations: a normalizing model
        for pname, p in model.backbone.named_parameters():
            if pname.endswith('.alpha'):
                p.zero_()
    if fuse:
        recalibrate_bn(model.backbone, [torch.randn(1, 3, 224, 224) for _ in range(2)], 2,
                       logger='silent')
    model.eval()
    if fuse:
        mmslab.reparameterize(model)
    return model


def deploy_forms(model, part, shape, runtimes, workdir, threads, calib_images,
                 dynamic: bool = True, attention: str = DEFAULT_ATTENTION):
    """``({runtime: callable(image)}, {runtime name: form of its graph})`` for one model and
    input shape; the form: the head layout of that runtime's graph
    (``export_runtime_graphs``' report)."""
    os.makedirs(workdir, exist_ok=True)
    onnx_path = osp.join(workdir, 'model.onnx')
    used = [name for name, prefix in RUNTIME_PREFIXES.items()
            if any(r.startswith(prefix) for r in runtimes)]
    graph_forms = {}
    if used:  # each runtime's graph in its own head layout
        _, report = export_runtime_graphs(model, part, shape, workdir, used, dynamic=dynamic,
                                          attention=attention)
        graph_forms = {r: dict(head_layout=report['head_layout'][r]) for r in used}
    calib = [np.random.RandomState(i).randn(1, 3, *shape).astype(np.float32)
             for i in range(calib_images)]
    forms = {}
    x = torch.randn(1, 3, *shape)
    if 'eager' in runtimes or 'eager bf16' in runtimes:
        if part == 'model' and not is_segmentor(model):
            eager = eager_detector(model, x)
        else:
            module = model._forward if part == 'model' else model
            eager = lambda: module(x)  # noqa: E731
        if 'eager' in runtimes:
            forms['eager'] = eager
        if 'eager bf16' in runtimes:
            from mmslab.utils.machine import require_bf16
            require_bf16('eager bf16')

            def eager_bf16():
                with torch.autocast('cpu', dtype=torch.bfloat16):
                    return eager()

            forms['eager bf16'] = eager_bf16
    image = x.numpy()
    if 'ort fp32' in runtimes:
        m = open_model(onnx_path, 'onnxruntime', 'fp32', threads)
        forms['ort fp32'] = lambda m=m: m(image)
    if 'ort int8' in runtimes:
        q = quantize_onnxruntime(onnx_path, osp.join(workdir, 'model_int8.onnx'), calib)
        m = open_model(q, 'onnxruntime', 'int8', threads)
        forms['ort int8'] = lambda m=m: m(image)
    if any(r.startswith('ov ') for r in runtimes):
        xml = artifact_path(workdir, 'openvino', 'fp32')
        if 'ov fp32' in runtimes:
            m = open_model(xml, 'openvino', 'fp32', threads)
            forms['ov fp32'] = lambda m=m: m(image)
        if 'ov bf16' in runtimes:
            m = open_model(xml, 'openvino', 'bf16', threads)
            forms['ov bf16'] = lambda m=m: m(image)
        if 'ov int8' in runtimes:
            q = quantize_openvino(xml, osp.join(workdir, 'openvino', 'model_int8.xml'), calib)
            m = open_model(q, 'openvino', 'int8', threads)
            forms['ov int8'] = lambda m=m: m(image)
    return forms, graph_forms


def eager_detector(model, x):
    """mmdet's own ``predict`` as a user runs it (mmcv's NMS and RoIAlign, masks pasted into
    the input-sized image), on one preprocessed image."""
    from mmdet.structures import DetDataSample
    h, w = x.shape[-2:]
    sample = DetDataSample(metainfo=dict(img_shape=(h, w), ori_shape=(h, w), pad_shape=(h, w),
                                         batch_input_shape=(h, w), scale_factor=(1.0, 1.0)))

    def run():
        with torch.no_grad():
            return model.predict(x, [sample], rescale=False)

    return run


#: the backbone size whose targets are the issue's higher ones: SLAB-Swin-T 1.1x the control
#: in OpenVINO bf16 and INT8, RePa-Swin-T's INT8 1.5x (1.4x at other sizes)
HIGH_TARGET_SHAPE = '800x1344'


def targets(res: dict, runtimes, kind: str, amx: Optional[bool] = None,
            shape: Optional[str] = None) -> list:
    """The issues' targets on one case's timings {(model, runtime): [ms per round]}, and the
    two ratios of every fused model (vs mmdet's Swin-T: what a user gets; vs mmslab's
    LayerNorm control: what the method buys), reported with target None. ``shape``: the
    case's ``HxW``; backbones at :data:`HIGH_TARGET_SHAPE` have the higher targets.

    ``ratio`` is the ratio of the medians; ``spread`` the [min, max] of the same ratio within
    each interleaved round (the two forms ran back to back there), so a ratio whose spread
    holds the target is a tie, not a win or a loss (``verdict``). ``amx``: whether this CPU
    has AMX (default: its flags); the bf16-within-1.2x-of-INT8 target is AMX's (elsewhere
    bf16 has no matrix units and INT8 wins by more: reported without a target)."""
    out = []
    repa = 'RePa-Swin-T'
    med = {k: float(np.median(v)) for k, v in res.items()}

    def ratio(a, b):
        if a not in res or b not in res:
            return None
        rounds = [x / y for x, y in zip(res[a], res[b])]
        return med[a] / med[b], [min(rounds), max(rounds)]

    def add(what, value, target):
        if value is not None:
            value, spread = value
            verdict = None
            if target is not None:
                verdict = 'met' if spread[0] >= target else \
                    'NOT met' if spread[1] < target else 'tie' if value >= target else \
                    'tie, below'
            out.append(dict(what=what, ratio=value, spread=spread, target=target,
                            verdict=verdict))

    high = kind == 'backbone' and shape == HIGH_TARGET_SHAPE
    int8 = [rt for rt in ('ort int8', 'ov int8') if rt in runtimes]
    for rt in int8:
        add(f'mmdet Swin-T / RePa-Swin-T, {rt}', ratio((BASELINE, rt), (repa, rt)),
            1.3 if kind == 'maskrcnn' else 1.4)
        add(f'LN control / RePa-Swin-T, {rt}', ratio((CONTROL, rt), (repa, rt)),
            1.5 if high else 1.4)
    best = [(med[(repa, rt)], rt) for rt in int8 if (repa, rt) in res]
    if best and (BASELINE, 'eager') in res:
        rt = min(best)[1]
        add(f'mmdet Swin-T eager / RePa-Swin-T best INT8 ({rt})',
            ratio((BASELINE, 'eager'), (repa, rt)), 3.0)
    bf16 = [(med[(repa, rt)], rt) for rt in ('eager bf16', 'ov bf16') if (repa, rt) in res]
    if bf16 and (repa, 'ov int8') in res:  # on AMX: best bf16 within 1.2x of OpenVINO INT8
        if amx is None:
            from mmslab.utils.machine import cpu_flags
            amx = 'amx_bf16' in cpu_flags()
        rt = min(bf16)[1]
        add(f'RePa-Swin-T ov int8 / best bf16 ({rt})', ratio((repa, 'ov int8'), (repa, rt)),
            1 / 1.2 if amx else None)
    for model in ('PRepBN-Swin-T', 'SLAB-Swin-T'):
        for rt in runtimes:
            add(f'mmdet Swin-T / {model}, {rt}', ratio((BASELINE, rt), (model, rt)), 1.0)
            add(f'LN control / {model}, {rt}', ratio((CONTROL, rt), (model, rt)),
                1.1 if high and model == 'SLAB-Swin-T' and rt in ('ov bf16', 'ov int8')
                else 1.0)
    # dynamic graphs against static graphs of the same size (--export both)
    for (model, rt), ms in res.items():
        if rt.endswith(' static') and (model, rt[:-len(' static')]) in res:
            add(f'{model} dynamic / static, {rt[:-len(" static")]}',
                ratio((model, rt[:-len(' static')]), (model, rt)), None)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--shapes', nargs='*', default=['512x512', '800x1344'],
                   help='backbone cases (none: whole-model cases only)')
    p.add_argument('--models', nargs='+', default=list(MODELS), choices=MODELS,
                   help='backbones / Mask R-CNN backbones to compare')
    p.add_argument('--runtimes', nargs='+', default=list(DEFAULT_RUNTIMES), choices=RUNTIMES,
                   help='bf16 forms: eager torch.autocast, OpenVINO INFERENCE_PRECISION_HINT '
                   '(refused on CPUs without avx512_bf16 / amx_bf16)')
    p.add_argument('--repeat', type=int, default=3)
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--burst', type=int, default=1,
                   help='calls of a form per round, the last one timed (1: each timed '
                        'call follows other models\' calls, caches cold; more: the '
                        'steady state of a model serving a stream)')
    p.add_argument('--rotation', choices=ROTATIONS, default='runtime',
                   help="'runtime': the models rotate within each runtime and precision, "
                   "one runtime after another; 'all': every form of a case in one rotation")
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--calib-images', type=int, default=4)
    p.add_argument('--maskrcnn', nargs='?', const='800x1216', metavar='HxW',
                   help='add whole Mask R-CNN rows (default size 800x1216)')
    p.add_argument('--upernet', nargs='?', const='512x2048', metavar='HxW',
                   help='add whole UperNet rows (default size 512x2048)')
    p.add_argument('--export', choices=('dynamic', 'static', 'both'), default='dynamic',
                   help='exported graphs with free H, W (default), one static size, or both')
    p.add_argument('--attention', choices=ATTENTION_LAYOUTS + ('both', ),
                   default=DEFAULT_ATTENTION,
                   help='layout of window attention in the exported graphs (both: rows of '
                   'each, the non-default one suffixed)')
    add_allocator_argument(p)
    p.add_argument('--out', default='work_dirs/deploy_speed')
    args = p.parse_args(argv)
    if args.burst < 1:  # before minutes of exports, not after them
        p.error(f'--burst {args.burst}: must be >= 1 (1: each timed call after other models\')')
    if args.maskrcnn and 'eager bf16' in args.runtimes:
        p.error("--runtimes 'eager bf16' with --maskrcnn: under bf16 autocast the whole "
                "detector's boxes reach mmcv's CPU NMS in bf16, which takes float32 only; "
                "time 'eager bf16' on backbones (--shapes) or UperNet (--upernet)")
    set_allocator_mode(args.malloc)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix='mmslab_deploy_')  # exported files: GBs at 800x1344
    try:
        report = measure_all(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    burst = 'each timed call after other models\' calls' if args.burst == 1 else \
        f'each timed call after {args.burst - 1} untimed calls of the same form'
    rotated = 'models rotated within each runtime' if args.rotation == 'runtime' else \
        'every form rotated together'
    print(f'\nmachine: {machine_line(report["machine"])}; {rotated}; {burst}')
    for c in report['targets']:
        verdict = '' if c['target'] is None else \
            f" (target >= {c['target']:.2f}: {c['verdict']})"
        lo, hi = c['spread']
        print(f"  {c['kind']:8s} {c['shape']:9s} {c['what']:58s} {c['ratio']:.2f}x "
              f"[{lo:.2f}-{hi:.2f}]{verdict}")
    plot(report, osp.join(args.out, 'deploy_speed.png'))
    print(f"wrote {osp.join(args.out, 'deploy_speed.json')} and deploy_speed.png")
    return report


def save_report(report: dict, out_dir: str) -> None:
    with open(osp.join(out_dir, 'deploy_speed.json'), 'w') as f:
        json.dump(report, f, indent=2)


def measure_all(args, tmp) -> dict:
    """Export, convert, quantize and time every case. The JSON is rewritten after each: a
    long run that fails late keeps the cases it finished."""
    rows, checks = [], []
    report = dict(machine=machine_info(), threads=args.threads, repeat=args.repeat,
                  warmup=args.warmup, burst=args.burst, rotation=args.rotation,
                  calib_images=args.calib_images, rows=rows, targets=checks)
    cases = [(s, 'backbone') for s in args.shapes]
    if args.maskrcnn:
        cases.append((args.maskrcnn, 'maskrcnn'))
    if args.upernet:
        cases.append((args.upernet, 'upernet'))
    for shape_text, kind in cases:
        # One case at a time: its models, sessions and compiled runtimes are freed before
        # the next case is prepared (800x1344 sessions and UperNet calibration together
        # exceeded 24 GB).
        res = measure_case(args, tmp, shape_text, kind, rows)
        gc.collect()
        for t in targets(res, args.runtimes, kind, shape=shape_text):
            checks.append(dict(kind=kind, shape=shape_text, **t))
        print_table(rows, kind, shape_text, sorted({r for _, r in res}, key=runtime_order))
        report['runtime_head_layouts'] = dict(RUNTIME_HEAD_LAYOUTS)
        save_report(report, args.out)
    return report


def measure_case(args, tmp, shape_text: str, kind: str, rows: list) -> dict:
    """Prepare and time one (shape, kind) case; appends its rows, returns
    {(model, rt): [ms per interleaved round]}."""
    shape = parse_shape(shape_text)
    fns, graphs = {}, {}
    if kind == 'backbone':
        builds = {name: (build_backbone(name), 'backbone') for name in args.models}
    elif kind == 'maskrcnn':
        builds = {name: (build_detector(name), 'model') for name in args.models}
        share_heads({name: model for name, (model, _) in builds.items()})
    else:
        builds = {
            'UperNet Swin-T (LN)': (build_upernet(
                'configs/upernet_swin_t_160k_ade20k.py', False), 'model'),
            'UperNet RePa-Swin-T fused': (build_upernet(
                'configs/upernet_repa_swin_t_160k_ade20k.py', True), 'model')}
    print(f'preparing {kind} {shape_text}: export, OpenVINO conversion, INT8 calibration')
    for name, (model, part) in builds.items():
        for i, (dynamic, attention, suffix) in enumerate(export_variants(args)):
            runtimes = args.runtimes if i == 0 else \
                [r for r in args.runtimes if not r.startswith('eager')]
            forms, graph_forms = deploy_forms(model, part, shape, runtimes,
                                              osp.join(tmp, f'{kind}_{shape_text}_{len(fns)}'),
                                              args.threads, args.calib_images, dynamic,
                                              attention)
            for rt, fn in forms.items():
                key = (name, rt if rt.startswith('eager') else rt + suffix)
                fns[key] = fn
                graphs[key] = next((form for r, form in graph_forms.items()
                                    if rt.startswith(RUNTIME_PREFIXES[r])), None)
    bar = ProgressBar(len(fns) * args.repeat)
    times = {}
    for group in rotation_groups(list(fns), args.rotation):
        keyed = {f'{n} | {r}': fns[(n, r)] for n, r in group}
        times.update(measure_interleaved(keyed, args.repeat, args.warmup, bar.update,
                                         burst=args.burst))
    print()
    res = {}
    for key, ms in times.items():
        name, rt = key.split(' | ')
        res[(name, rt)] = ms
        # (every round's time too: the spreads are per-round ratios, and a slow round of
        # every model shows as such)
        row = dict(kind=kind, shape=shape_text, model=name, runtime=rt, **summarize(ms),
                   rounds_ms=[round(t, 2) for t in ms])
        if graphs[(name, rt)] is not None:  # the form of the graph timed
            row['graph'] = graphs[(name, rt)]
        rows.append(row)
    return res


def rotation_groups(keys: list, rotation: str) -> list:
    """The ``(model, runtime)`` keys of a case in the rotations that time them, one after
    another: one per runtime row (``'runtime'``, models interleaved within it), or all at
    once (``'all'``)."""
    if rotation not in ROTATIONS:
        raise ValueError(f'rotation {rotation!r}: expected one of {ROTATIONS}')
    if rotation == 'all':
        return [list(keys)]
    groups = {}
    for key in keys:
        groups.setdefault(key[1], []).append(key)
    return list(groups.values())


def export_variants(args) -> list:
    """``[(dynamic, attention layout, row suffix)]``: the exported graphs each model gets.
    The first is the default form (unsuffixed rows); ``both`` adds the other with a suffix."""
    modes = dict(dynamic=[True], static=[False], both=[True, False])[args.export]
    layouts = [DEFAULT_ATTENTION] if args.attention == 'both' else [args.attention]
    if args.attention == 'both':
        layouts += [a for a in ATTENTION_LAYOUTS if a != DEFAULT_ATTENTION]
    return [(dynamic, layout,
             ('' if dynamic == modes[0] else ' static') +
             ('' if layout == layouts[0] or args.attention != 'both' else f' {layout}'))
            for dynamic in modes for layout in layouts]


def runtime_order(rt: str):
    base = rt.replace(' static', '')
    for layout in ATTENTION_LAYOUTS:
        base = base.replace(f' {layout}', '')
    return (RUNTIMES.index(base) if base in RUNTIMES else len(RUNTIMES), rt)


def print_table(rows, kind, shape, runtimes):
    sel = [r for r in rows if r['kind'] == kind and r['shape'] == shape]
    models = list(dict.fromkeys(r['model'] for r in sel))
    cell = {(r['model'], r['runtime']):
            f"{r['median_ms']:.1f} ({r['min_ms']:.0f}-{r['max_ms']:.0f})" for r in sel}
    print(f'\n{kind} {shape}: median ms (min-max over rounds), batch 1')
    print('  ' + 'model'.ljust(28) + ''.join(rt.rjust(20) for rt in runtimes))
    for m in models:
        print('  ' + m.ljust(28) + ''.join(cell.get((m, rt), '-').rjust(20) for rt in runtimes))


def plot(report, path):
    groups = list(dict.fromkeys((r['kind'], r['shape']) for r in report['rows']))
    with saved_figure(path, ncols=len(groups), panel_size=(6.5, 4.5)) as (fig, axes):
        for ax, (kind, shape) in zip(axes[0], groups):
            sel = [r for r in report['rows'] if r['kind'] == kind and r['shape'] == shape]
            models = list(dict.fromkeys(r['model'] for r in sel))
            runtimes = list(dict.fromkeys(r['runtime'] for r in sel))
            grouped_bars(ax, runtimes, {
                m: [next((r['median_ms'] for r in sel if r['model'] == m and
                          r['runtime'] == rt), 0.0) for rt in runtimes] for m in models})
            ax.set_ylabel('median latency (ms), batch 1')
            ax.set_title(f'{kind} {shape}', fontsize=10)
            ax.legend(fontsize=7)
            ax.grid(axis='y', alpha=0.3)
        fig.suptitle(machine_line(report['machine']), fontsize=9)


if __name__ == '__main__':
    main()
