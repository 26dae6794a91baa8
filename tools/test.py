"""Evaluate a checkpoint of an mmdet or mmseg model with mmslab's components registered.

    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR] [--out FILE_OR_DIR] [--show]
                         [--show-dir DIR] [--wait-time S] [--cfg-options KEY=VALUE ...]
                         [--launcher {none,pytorch,slurm,mpi}] [--tta] [--latency]
                         [--precision {fp32,bf16,int8,auto}]
                         [--export-dir DIR [--backend {deployed,onnxruntime,openvino}]]

The config's ``default_scope`` ('mmdet' or 'mmseg') selects the codebase. ``--out`` is a pickle
file of raw detections (mmdet) or a directory of predicted label maps (mmseg). The metrics are
logged as usual and, on the main process, printed as one JSON line starting with
``mmslab-test-metrics:`` and written to ``WORK_DIR/metrics.json``. Multi-process testing:
``tools/dist_test.sh CONFIG CKPT NPROC [args]``.

``--precision``: what the model computes in (``metrics.json`` records it as ``precision``):

* ``fp32`` (default);
* ``bf16`` (CPUs with avx512_bf16 / amx_bf16, GPUs of compute capability 8.0+; refused
  elsewhere): PyTorch runs the backbone, neck and heads under ``torch.autocast(device,
  torch.bfloat16)`` with float32 in between and in the post-processing (NMS, mask pasting,
  resizing); ``--backend openvino`` computes the fp32 export in bf16
  (``INFERENCE_PRECISION_HINT``); onnxruntime has no bf16 on x86 CPUs;
* ``int8`` (with ``--export-dir``): the export's INT8 artifact (``tools/export_onnx.py --int8``);
* ``auto``: times fp32 and, where the CPU (and runtime) has it, bf16 on the first test batch
  and evaluates in bf16 only if it is at least 1.05x faster; never INT8, which changes the
  model. The times and the choice are logged and written to ``metrics.json``
  (``precision_auto``).

``--int8`` and ``--bf16`` are short for ``--precision int8`` / ``--precision bf16``.

``--latency``: ``ReparamEvalHook`` times every test step (pre-processing, model,
post-processing; after 2 warm-up batches) of the fused model and of the unfused one, both
in the precision evaluated, with CUDA events on a GPU (``time.perf_counter`` on the CPU),
and writes ``WORK_DIR/latency.json`` (medians, speed-up, ``device``, ``precision``,
``machine`` with the GPU's name, driver, CUDA and cuDNN versions). fp16 on a GPU:
``dict(type='ReparamEvalHook', precision='fp16')`` in the config (evaluated and timed in
fp16), or ``tools/benchmark.py --device cuda --precisions fp32 fp16`` for timing alone.

``--export-dir DIR [--backend deployed|onnxruntime|openvino]``: the model that
``tools/export_onnx.py CONFIG CHECKPOINT --out DIR`` exported runs in a runtime
(``--precision int8``: its INT8 artifact), chosen as the predictor chooses it
(:func:`mmslab.deploy.runtimes.choose_runtime_form`), and a logged line says which and why:

* ``--backend`` omitted: the deployed form ``DIR/export.json`` records (``latency.deploy``:
  what ``tools/export_onnx.py --latency`` chose on the export's machine), onnxruntime fp32
  where the export was not timed; ``--backend deployed``: the same, and an export without
  a deployed form is an error;
* ``--backend onnxruntime|openvino``: that runtime, at the deployed precision if it is the
  deployed runtime, else fp32;
* ``--precision`` (``--int8``, ``--bf16``) names the precision; with the backend omitted
  or ``deployed``, in the deployed runtime.

Where the deployed form cannot run here (its INT8 artifact missing, OpenVINO not installed,
bf16 on a CPU without bf16 units) the same runtime's fp32, else onnxruntime, is evaluated,
and the logged line says why. ``metrics.json`` records what ran (``backend``,
``precision``), ``form_source`` (``export.json``, ``fallback``, ``command line`` or
``default``) and ``deployed_form`` (the recorded ``runtime`` / ``precision``, null where
none is).

For a whole-model export (the default) only data loading and pre-processing stay in
Python, so the metrics are those of the deployed model; a ``features`` / ``backbone``
export runs the heads in PyTorch. The export must come from CHECKPOINT (SHA-256 recorded in
DIR/export.json) and the config's model section; anything else is refused. fp32 exports of
a part / a segmentor are also compared with the unfused PyTorch model on the first batch
(ReparamEvalHook); INT8 differs by design, its error is bounded by the metrics (and
``export.json``'s deviation on held-out images).
"""
import argparse
import copy
import json
import os.path as osp
import warnings

import numpy as np
import torch
from mmengine.config import Config, ConfigDict, DictAction
from mmengine.dist import is_main_process
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

import mmslab  # noqa: F401  (registers mmslab's components)
import mmslab.engine  # noqa: F401  (weights-only checkpoint loading for mmengine)
from mmslab.deploy.runtimes import (PRECISIONS, RUNTIMES, choose_runtime_form,
                                    resolve_precision)
from mmslab.utils import DataNotFoundError, check_data_root
from mmslab.utils.launch import (add_launcher_args, export_local_rank, load_config,
                                 set_work_dir, setup_cpu_distributed,
                                 teardown_cpu_distributed)

METRICS_PREFIX = 'mmslab-test-metrics: '
#: ``deployed``: the form ``export.json`` records (``--backend`` omitted with ``--export-dir``:
#: that form where one is recorded).
DEPLOYED = 'deployed'
BACKENDS = ('pytorch', DEPLOYED) + RUNTIMES
PRECISION_CHOICES = PRECISIONS + ('auto', )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Test (and evaluate) an mmdet/mmseg model')
    parser.add_argument('config', help='test config file path')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--work-dir', help='the directory to save the evaluation metrics')
    parser.add_argument('--out', type=str,
                        help='mmdet: dump predictions to this .pkl file for offline evaluation; '
                        'mmseg: save predicted label maps to this directory')
    parser.add_argument('--show', action='store_true', help='show prediction results')
    parser.add_argument('--show-dir', help='directory where painted images are saved')
    parser.add_argument('--wait-time', type=float, default=2,
                        help='the interval of show (s)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, e.g. test_dataloader.batch_size=2')
    parser.add_argument('--tta', action='store_true', help='test-time augmentation (flip)')
    parser.add_argument('--reparam', action=argparse.BooleanOptionalAction, default=None,
                        help='evaluate the fused (re-parameterized) model through '
                        'ReparamEvalHook (default: as the config says; mmslab configs fuse)')
    parser.add_argument('--latency', action='store_true',
                        help='measure per-image latency (fused and unfused, both in the '
                        '--precision evaluated; CUDA events on a GPU) into latency.json, with '
                        'the device, precision and machine (GPU name, driver, CUDA, cuDNN)')
    parser.add_argument('--backend', choices=BACKENDS, default=None,
                        help='pytorch (default without --export-dir); with --export-dir: '
                        'deployed (default: the form export.json records, onnxruntime fp32 '
                        'where none is; given: an export without one is an error), '
                        'onnxruntime or openvino')
    parser.add_argument('--export-dir', help='directory written by tools/export_onnx.py --out')
    parser.add_argument('--precision', choices=PRECISION_CHOICES, default=None,
                        help='fp32 (default; with --export-dir: the deployed precision in the '
                        'deployed runtime); bf16: PyTorch autocast or OpenVINO bf16 (CPUs '
                        'with avx512_bf16 / amx_bf16); int8: the INT8 artifact (needs '
                        '--export-dir); auto: the faster of fp32 and bf16, measured here')
    parser.add_argument('--int8', action='store_true', help='the same as --precision int8')
    parser.add_argument('--bf16', action='store_true', help='the same as --precision bf16')
    parser.add_argument('--runtime-threads', type=int, default=0,
                        help='runtime threads (default: the runtime\'s own)')
    add_launcher_args(parser)
    args = parser.parse_args(argv)
    args.backend_requested = args.backend
    if args.backend is None:
        args.backend = DEPLOYED if args.export_dir else 'pytorch'
    args.form = None  # the runtime form (RuntimeForm) of a runtime backend
    if args.backend != 'pytorch':
        if not args.export_dir:
            parser.error(f'--backend {args.backend} needs --export-dir DIR (the directory '
                         'written by tools/export_onnx.py --out DIR)')
        if not osp.isfile(osp.join(args.export_dir, 'export.json')):
            parser.error(f'--export-dir {args.export_dir}: no export.json there; run '
                         f'tools/export_onnx.py CONFIG CKPT --out {args.export_dir} first')
        if args.tta:
            parser.error('--tta is not supported with a runtime backend (the runtime runs '
                         'the exported single-pass model)')
    elif args.export_dir:
        parser.error(f'--export-dir needs a runtime backend: --backend '
                     f'{", ".join(b for b in BACKENDS if b != "pytorch")}, or no --backend '
                     '(the deployed form)')
    resolve_precision_args(parser, args)
    export_local_rank(args)
    return args


def resolve_precision_args(parser, args) -> None:
    """``args.precision`` from ``--precision`` and its short forms ``--int8`` / ``--bf16``
    (:func:`mmslab.deploy.runtimes.resolve_precision`), checked against the backend (an
    error names the valid choices). A runtime backend: ``args.backend`` and
    ``args.precision`` become the form that runs and ``args.form`` says where it came from
    (:func:`resolve_runtime_form`)."""
    runtime = None if args.backend in ('pytorch', DEPLOYED) else args.backend
    named = args.precision is not None or args.int8 or args.bf16
    try:
        args.precision = resolve_precision(args.precision, args.int8, args.bf16, runtime,
                                           auto=True)
    except ValueError as err:
        parser.error(str(err))
    if args.backend == 'pytorch' and args.precision == 'int8':
        parser.error('INT8 is an exported artifact: --precision int8 needs --backend '
                     'onnxruntime or openvino --export-dir DIR (tools/export_onnx.py --int8; '
                     '--export-dir DIR alone: the deployed runtime). '
                     'Valid with pytorch: fp32, bf16, auto')
    if args.backend != 'pytorch':
        resolve_runtime_form(parser, args, args.precision if named else None)
    args.int8, args.bf16 = args.precision == 'int8', args.precision == 'bf16'


def resolve_runtime_form(parser, args, precision) -> None:
    """``args.backend`` (a runtime) and ``args.precision`` of a runtime backend from what
    the command line names (``precision`` None: not named) and the deployed form
    ``export.json`` records (:func:`mmslab.deploy.runtimes.choose_runtime_form`);
    ``args.form`` keeps the choice and the line that says so. An ``export.json`` that does
    not validate is reported here where the deployed form is asked for, else by
    :func:`setup_runtime_backend`."""
    from mmslab.deploy.export_info import ExportInfoError, read_export_info
    deployed = args.backend == DEPLOYED
    try:
        info = read_export_info(args.export_dir)
    except ExportInfoError as err:
        if deployed:
            parser.error(str(err))
        info = None
    try:
        args.form = choose_runtime_form(
            args.export_dir, info, None if deployed else args.backend, precision,
            flags=('--backend', '--precision'), auto=True,
            require_deployed=args.backend_requested == DEPLOYED)
    except ValueError as err:
        backend = f'--backend {args.backend_requested}' if args.backend_requested else \
            'no --backend (the deployed form)'
        parser.error(f'{backend}, --export-dir {args.export_dir}: {err}')
    args.backend, args.precision = args.form.runtime, args.form.precision


def trigger_visualization_hook(cfg: Config, args, scope: str) -> None:
    hooks = cfg.get('default_hooks', None) or {}
    if 'visualization' not in hooks:
        raise SystemExit('error: --show/--show-dir need a visualization hook in default_hooks, '
                         "e.g. visualization=dict(type='DetVisualizationHook') or "
                         "dict(type='SegVisualizationHook').")
    hook = hooks['visualization']
    hook['draw'] = True
    if args.show:
        hook['show'] = True
        hook['wait_time'] = args.wait_time
    if args.show_dir:
        if scope == 'mmdet':
            hook['test_out_dir'] = args.show_dir
        else:
            cfg.visualizer['save_dir'] = args.show_dir


def _innermost_dataset(dataset_cfg):
    while 'dataset' in dataset_cfg:
        dataset_cfg = dataset_cfg['dataset']
    return dataset_cfg


def setup_tta(cfg: Config, scope: str) -> None:
    """Wrap the model in the codebase's TTA model; default: horizontal flip, no flip."""
    test_data_cfg = _innermost_dataset(cfg.test_dataloader.dataset)
    if 'tta_model' not in cfg:
        warnings.warn('Cannot find tta_model in the config; using a default one.')
        if scope == 'mmdet':
            cfg.tta_model = dict(type='DetTTAModel',
                                 tta_cfg=dict(nms=dict(type='nms', iou_threshold=0.5),
                                              max_per_img=100))
        else:
            cfg.tta_model = dict(type='SegTTAModel')
    if 'tta_pipeline' not in cfg:
        warnings.warn('Cannot find tta_pipeline in the config; using a flip pipeline.')
        pipeline = copy.deepcopy(test_data_cfg.pipeline)
        pack = pipeline[-1]
        if scope == 'mmdet':
            # flipping back needs flip / flip_direction in the packed meta information
            meta_keys = list(pack.get('meta_keys', ('img_id', 'img_path', 'ori_shape',
                                                    'img_shape', 'scale_factor')))
            meta_keys += [k for k in ('flip', 'flip_direction') if k not in meta_keys]
            pack = dict(pack, meta_keys=tuple(meta_keys))
        flips = [dict(type='RandomFlip', prob=1.), dict(type='RandomFlip', prob=0.)]
        pipeline[-1] = dict(type='TestTimeAug', transforms=[flips, [pack]])
        cfg.tta_pipeline = pipeline
    cfg.model = ConfigDict(**cfg.tta_model, module=cfg.model)
    test_data_cfg.pipeline = cfg.tta_pipeline
    if 'batch_shapes_cfg' in test_data_cfg:
        test_data_cfg.batch_shapes_cfg = None


def setup_seg_out(cfg: Config, out_dir: str) -> None:
    evaluators = cfg.test_evaluator
    for evaluator in evaluators if isinstance(evaluators, (list, tuple)) else [evaluators]:
        evaluator['output_dir'] = out_dir
        evaluator['keep_results'] = True


def _jsonable(value):
    if isinstance(value, (np.generic, torch.Tensor)) and np.size(value) == 1:
        return value.item()
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.tolist()
    return str(value)


def setup_reparam_hook(cfg: Config, reparam, latency: bool) -> None:
    """Add or configure ``ReparamEvalHook`` for ``--reparam/--no-reparam`` and ``--latency``."""
    if reparam is None and not latency:
        return
    hooks = list(cfg.get('custom_hooks', None) or [])
    hook = next((h for h in hooks if h.get('type') == 'ReparamEvalHook'), None)
    if hook is None:
        hook = dict(type='ReparamEvalHook', measure_latency=False)
        hooks.append(hook)
    if reparam is not None:
        hook['reparam'] = reparam
    if latency:
        hook['measure_latency'] = True
        hook['compare_unfused'] = bool(hook.get('reparam', True))
    cfg.custom_hooks = hooks


def setup_runtime_backend(cfg: Config, args, scope: str) -> None:
    """Add ``RuntimeBackendHook`` for ``--backend onnxruntime/openvino`` after checking the
    export belongs to the checkpoint and config. INT8: turn off ReparamEvalHook's
    fused-vs-unfused check where it would compare the runtime (INT8 differs by design; a
    whole detector's check compares PyTorch features and stays on)."""
    if args.backend == 'pytorch':
        return
    from mmslab.engine.hooks import read_export_info
    try:
        info = read_export_info(args.export_dir)
    except (OSError, ValueError) as err:
        raise SystemExit(f'error: {err}')
    from mmslab.deploy.export_info import check_export_matches
    try:
        check_export_matches(info, args.export_dir, args.checkpoint, cfg)
    except ValueError as err:
        raise SystemExit(f'error: {err}')
    part = info['part']
    if scope == 'mmdet' and info.get('task') == 'semantic_segmentation':
        raise SystemExit(f'error: {args.export_dir} holds a segmentor; the config is a detector')
    if scope == 'mmseg' and part == 'features':
        raise SystemExit(f"error: {args.export_dir} holds part 'features' (detector backbone + "
                         "neck); a segmentor needs part 'model' or 'backbone'")
    hooks = [h for h in (cfg.get('custom_hooks', None) or [])
             if h.get('type') != 'RuntimeBackendHook']
    lowered = args.precision in ('int8', 'bf16') or (args.precision == 'auto' and
                                                     args.backend == 'openvino')
    if lowered and not (scope == 'mmdet' and part == 'model'):
        for h in hooks:
            if h.get('type') == 'ReparamEvalHook':
                h['check_equivalence'] = False
    hooks.append(dict(type='RuntimeBackendHook', export_dir=args.export_dir,
                      runtime=args.backend, precision=args.precision,
                      threads=args.runtime_threads))
    cfg.custom_hooks = hooks


def setup_precision(cfg: Config, args) -> None:
    """bf16: refuse where it is not computed natively (before anything is built): eager
    PyTorch on the device the runner evaluates on (a CPU without avx512_bf16 / amx_bf16, a
    GPU below compute capability 8.0), a runtime on a CPU without bf16 units. PyTorch bf16 /
    auto: add ``PrecisionHook`` (after ReparamEvalHook, on the fused copy; ``--latency`` then
    times the fused and the unfused model in that precision)."""
    if args.precision == 'bf16':
        try:
            if args.backend == 'pytorch':
                from mmslab.engine.hooks.precision_hook import eval_device
                from mmslab.utils.precision import check_autocast_precision
                check_autocast_precision('bf16', eval_device(), 'eager PyTorch')
            else:
                from mmslab.utils.machine import require_bf16
                require_bf16(f'{args.backend} bf16')
        except RuntimeError as err:
            raise SystemExit(f'error: {err}')
    if args.backend != 'pytorch' or args.precision == 'fp32':
        return
    hooks = [h for h in (cfg.get('custom_hooks', None) or []) if h.get('type') != 'PrecisionHook']
    for hook in hooks:
        if hook.get('type') == 'ReparamEvalHook' and hook.get('precision', 'fp32') != 'fp32':
            raise SystemExit(f"error: --precision {args.precision} and the config's "
                             f"ReparamEvalHook(precision={hook['precision']!r}) exclude each "
                             'other; drop one (--cfg-options or the config)')
    hooks.append(dict(type='PrecisionHook', precision=args.precision))
    cfg.custom_hooks = hooks


def precision_report(runner, args) -> dict:
    """What the model ran in (``precision``; ``int8`` / ``bf16`` as booleans, as before) and
    ``auto``'s measurement (``precision_auto``), from the hooks that applied it."""
    from mmslab.engine.hooks import PrecisionHook, RuntimeBackendHook
    precision, record = args.precision, None
    for hook in runner.hooks:
        if isinstance(hook, PrecisionHook) and hook.result:
            precision, record = hook.result['precision'], hook.result.get('auto')
        elif isinstance(hook, RuntimeBackendHook):
            precision, record = hook.precision, hook.auto_record
    out = dict(precision=precision, precision_requested=args.precision,
               int8=precision == 'int8', bf16=precision == 'bf16')
    if record is not None:
        out['precision_auto'] = record
    return out


def form_report(args) -> dict:
    """For ``metrics.json``, with a runtime backend: where the runtime form came from
    (``form_source``) and the deployed form ``export.json`` records (``deployed_form``,
    ``runtime`` and ``precision``; None where none is)."""
    if args.form is None:
        return {}
    deployed = args.form.deployed
    return dict(form_source=args.form.source, deployed_form=deployed and dict(
        runtime=deployed['runtime'], precision=deployed['precision']))


def main(argv=None):
    args = parse_args(argv)
    # launcher first, so that --cfg-options may still override it
    cfg, scope = load_config(args.config,
                             {'launcher': args.launcher, **(args.cfg_options or {})})
    try:
        check_data_root(cfg, 'test', args.config)
    except DataNotFoundError as err:
        raise SystemExit(f'error: {err}')

    set_work_dir(cfg, args.work_dir, args.config)

    cfg.load_from = args.checkpoint
    cfg.resume = False

    if args.show or args.show_dir:
        trigger_visualization_hook(cfg, args, scope)
    if args.tta:
        setup_tta(cfg, scope)
    if args.out is not None and scope == 'mmseg':
        setup_seg_out(cfg, args.out)

    setup_reparam_hook(cfg, args.reparam, args.latency)
    setup_precision(cfg, args)
    setup_runtime_backend(cfg, args, scope)
    own_group = setup_cpu_distributed(cfg, args.launcher)

    if 'runner_type' not in cfg:
        runner = Runner.from_cfg(cfg)
    else:
        runner = RUNNERS.build(cfg)
    if args.form is not None and args.form.note:  # which runtime form, and why
        runner.logger.info(args.form.note)

    if args.out is not None and scope == 'mmdet':
        if not args.out.endswith(('.pkl', '.pickle')):
            raise SystemExit('error: --out must be a .pkl or .pickle file for mmdet configs.')
        from mmdet.evaluation import DumpDetResults
        runner.test_evaluator.metrics.append(DumpDetResults(out_file_path=args.out))

    metrics = runner.test()
    if is_main_process():
        line = dict(metrics or {})
        line.update(backend=args.backend, **precision_report(runner, args),
                    **form_report(args))
        print(METRICS_PREFIX + json.dumps(line, default=_jsonable), flush=True)
        with open(osp.join(cfg.work_dir, 'metrics.json'), 'w') as f:
            json.dump(line, f, indent=2, default=_jsonable)
    teardown_cpu_distributed(own_group)
    return metrics


if __name__ == '__main__':
    main()
