"""``export.json``: what an export directory records about itself. This module is its one
owner: :func:`new_export_info` and :func:`write_export_info` write it
(``tools/export_onnx.py``), :func:`read_export_info` reads and validates it (``tools/test.py
--backend``, ``RuntimeBackendHook``, the predictor), and :func:`check_export_matches` keeps
an export and the checkpoint / config it is evaluated with together. Standard library only
at import (the predictor runs without PyTorch).

Keys (schema :data:`SCHEMA_VERSION`):

* required in every export (:data:`REQUIRED_KEYS`): ``schema_version``, ``part``
  (``backbone`` | ``features`` | ``model``), ``task`` (:data:`TASKS`), ``outputs`` (the
  graph's output names, in order; a whole model's hold what its task needs,
  :data:`TASK_OUTPUTS`), ``shape`` (the traced input size ``[h, w]``), ``dynamic`` (height
  and width free);
* required in a whole-model export (part ``model``, what the predictor runs without
  PyTorch): ``pipeline`` (what a caller does before the graph, :data:`PIPELINE_KEYS`, each
  present, ``null`` where allowed; see :mod:`mmslab.deploy.predict`) and ``classes``;
  optional ``palette``, ``mask_thr_binary`` (instance segmentation), ``align_corners``;
* written by ``tools/export_onnx.py`` and read where present: ``config``,
  ``model_config_sha256`` (of the model section), ``checkpoint``, ``checkpoint_sha256``
  (null for ``--random-weights``), ``random_weights``, ``seg_argmax``, ``attention`` (the
  window-attention form in the graph and how many blocks took it, ``cropped``: the blocks
  whose kernel masks padding (windows cropped to their valid tokens), ``head_layout``:
  ``{runtime: layout}`` of q, k, v in each runtime's graph, null where no attention took
  the ``split`` form),
  ``precisions``,
  ``versions``, ``machine``, and the measurements: parity and INT8 deviation per runtime,
  ``tolerance``, ``export_seconds``, ``onnx_mb``, ``int8``, ``parity_images``, ``latency``
  (``tools/export_onnx.py --latency``; its ``deploy``, the form to deploy, is what the
  predictor and ``tools/test.py --export-dir`` run by default: :func:`deployed_form`).

A missing or malformed key is an :class:`ExportInfoError` naming it and the command that
writes a valid directory. Directories written before ``export.json`` had a
``schema_version`` (or by another schema) are refused the same way, even where their keys
happen to be complete: their key set was never checked when they were written, and
exporting again is one command.
"""
import hashlib
import json
import os.path as osp
from typing import Optional

SCHEMA_VERSION = 1
EXPORT_JSON = 'export.json'
#: The command that writes an export directory (``{dir}``: the directory).
EXPORT_HINT = 'tools/export_onnx.py CONFIG CHECKPOINT --out {dir}'
TASKS = ('detection', 'instance_segmentation', 'semantic_segmentation')
#: The outputs a whole model of each task has (semantic segmentation: ``seg_logits`` or
#: ``seg_label``, checked separately).
TASK_OUTPUTS = {
    'detection': ('dets', 'labels'),
    'instance_segmentation': ('dets', 'labels', 'masks'),
    'semantic_segmentation': (),
}
#: key -> what it holds, for the error that names a missing one.
REQUIRED_KEYS = dict(schema_version=f'the export.json schema, {SCHEMA_VERSION}',
                     part='backbone | features | model', task=' | '.join(TASKS),
                     outputs='the output names in order', shape='the traced [h, w]',
                     dynamic='true if height and width are free')
PIPELINE_KEYS = ('resize', 'mean', 'std', 'bgr_to_rgb', 'pad_size_divisor', 'pad_value', 'size')


class ExportInfoError(ValueError):
    """``export.json`` is missing, stale or malformed; the message names the key and the
    command that writes a valid export."""


# ----------------------------------------------------------------------------------------------
# reading and validating
# ----------------------------------------------------------------------------------------------

def read_export_info(export_dir: str, whole_model: bool = False) -> dict:
    """``EXPORT_DIR/export.json``, validated (:func:`check_export_info`).

    Args:
        export_dir: a directory written by ``tools/export_onnx.py --out``.
        whole_model: also require the whole-model contract (part ``model``, ``pipeline``,
            ``classes``): what the predictor runs.

    Returns:
        dict: the keys as written; ``pipeline.resize.scale`` as a list of two numbers.
    """
    hint = EXPORT_HINT.format(dir=export_dir)
    if not osp.isdir(export_dir):
        raise ExportInfoError(f'export directory {export_dir} does not exist; write it with '
                              + hint)
    path = osp.join(export_dir, EXPORT_JSON)
    if not osp.isfile(path):
        raise ExportInfoError(f'{path} does not exist: {export_dir} is not an export '
                              f'directory; write one with {hint}')
    try:
        with open(path) as f:
            info = json.load(f)
    except json.JSONDecodeError as err:
        raise ExportInfoError(f'{path} is not valid JSON: {err}') from None
    return check_export_info(info, path, whole_model, hint)


def check_export_info(info: dict, path: str, whole_model: bool = False,
                      hint: Optional[str] = None) -> dict:
    """``info`` if it holds the keys of its schema version (module docstring) and, with
    ``whole_model``, the whole-model contract; else :class:`ExportInfoError` naming the
    first key that is missing or wrong. ``path``: the file, for the messages; ``hint``: the
    command that writes a valid export (default: for ``path``'s directory)."""
    hint = hint or EXPORT_HINT.format(dir=osp.dirname(path) or '.')
    if not isinstance(info, dict):
        raise ExportInfoError(f'{path} must hold a JSON object')

    def require(obj: dict, key: str, what: str, where: str = ''):
        if key not in obj:
            raise ExportInfoError(f"{path} lacks the key '{where}{key}' ({what}); export "
                                  f'again with {hint}')
        return obj[key]

    version = info.get('schema_version')
    if version is None:
        raise ExportInfoError(f'{path} records no schema_version: it was written before '
                              'export.json had one (or by hand); export again with ' + hint)
    if version != SCHEMA_VERSION:
        newer = isinstance(version, int) and version > SCHEMA_VERSION
        raise ExportInfoError(
            f'{path} has schema_version {version!r}; this mmslab reads {SCHEMA_VERSION}: '
            + ('update mmslab, or ' if newer else '') + 'export again with ' + hint)
    for key, what in REQUIRED_KEYS.items():
        require(info, key, what)
    part, task, outputs = info['part'], info['task'], info['outputs']
    if whole_model and part != 'model':
        raise ExportInfoError(
            f'{path}: part is {part!r}, not "model": a {part} export ends before the heads '
            '(no boxes, masks or labels), it is not a whole model and cannot predict; export '
            f'the whole model with {hint} --part model')
    if task not in TASKS:
        raise ExportInfoError(f'{path}: unknown task {task!r}; known: {", ".join(TASKS)}')
    if not (isinstance(outputs, list) and all(isinstance(o, str) for o in outputs)):
        raise ExportInfoError(f'{path}: outputs must be a list of names, got {outputs!r}')
    shape = info['shape']
    if not (isinstance(shape, list) and len(shape) == 2 and
            all(isinstance(s, int) and s > 0 for s in shape)):
        raise ExportInfoError(f'{path}: shape must be [h, w], got {shape!r}')
    if not isinstance(info['dynamic'], bool):
        raise ExportInfoError(f'{path}: dynamic must be true or false, got {info["dynamic"]!r}')
    if part == 'model':
        missing = [o for o in TASK_OUTPUTS[task] if o not in outputs]
        if task == 'semantic_segmentation' and not {'seg_logits', 'seg_label'} & set(outputs):
            missing = ['seg_logits or seg_label']
        if missing:
            raise ExportInfoError(f'{path}: outputs {outputs} lack {", ".join(missing)}, '
                                  f'needed by task {task}')
    if not whole_model:
        return info

    pipeline = require(info, 'pipeline', 'pre-processing: ' + ', '.join(PIPELINE_KEYS))
    if not isinstance(pipeline, dict):
        raise ExportInfoError(f'{path}: pipeline must be an object')
    for key in PIPELINE_KEYS:
        require(pipeline, key, 'null allowed' if key in ('resize', 'size', 'pad_size_divisor')
                else 'see mmslab/deploy/predict.py', 'pipeline.')
    check_pipeline(pipeline, path)
    classes = require(info, 'classes', 'the class names')
    if not (isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes)):
        raise ExportInfoError(f'{path}: classes must be a non-empty list of names')
    palette = info.get('palette')
    if palette is not None and not (
            isinstance(palette, list) and
            all(isinstance(c, list) and len(c) == 3 for c in palette)):
        raise ExportInfoError(f'{path}: palette must be a list of [r, g, b]')
    return info


def deployed_form(info: dict, path: str = EXPORT_JSON) -> Optional[dict]:
    """The deployed form ``info`` records (``latency.deploy``, written by
    ``tools/export_onnx.py --latency``: :func:`~mmslab.deploy.runtimes.choose_deployment`):
    ``runtime``, ``precision`` and the ``shape`` timed; None where the export was not timed.
    A record naming a runtime or precision that does not exist is an
    :class:`ExportInfoError` naming the valid ones (``path``: the file, for the message)."""
    from .runtimes import RUNTIME_PRECISIONS  # (runtimes imports this module)
    latency = info.get('latency')
    deploy = latency.get('deploy') if isinstance(latency, dict) else None
    if deploy is None:
        return None
    runtime = deploy.get('runtime') if isinstance(deploy, dict) else None
    precision = deploy.get('precision') if isinstance(deploy, dict) else None
    if precision not in RUNTIME_PRECISIONS.get(runtime, ()):
        valid = '; '.join(f'{r}: {", ".join(p)}' for r, p in RUNTIME_PRECISIONS.items())
        raise ExportInfoError(
            f'{path}: latency.deploy must name a runtime and a precision it computes '
            f'({valid}), got {deploy!r}; export again with --latency HxW')
    return dict(runtime=runtime, precision=precision, shape=latency.get('shape'))


def check_pipeline(p: dict, path: str) -> None:
    """The values of a whole model's ``pipeline`` (its keys are there); a bare number as
    ``resize.scale`` becomes ``[s, s]``, as mmcv's ``Resize`` reads it."""
    def bad(msg):
        raise ExportInfoError(f'{path}: pipeline.{msg}')

    resize = p['resize']
    if resize is not None:
        if not (isinstance(resize, dict) and 'scale' in resize and
                isinstance(resize.get('keep_ratio'), bool)):
            bad('resize must be null or {"scale": [a, b], "keep_ratio": bool}')
        scale = resize['scale']
        if isinstance(scale, (int, float)):
            scale = [scale, scale]
        if not (isinstance(scale, list) and len(scale) == 2 and min(scale) > 0):
            bad(f'resize.scale must be two positive numbers, got {resize["scale"]!r}')
        resize['scale'] = scale
    for key in ('mean', 'std'):
        if not (isinstance(p[key], list) and len(p[key]) == 3):
            bad(f'{key} must be 3 numbers, got {p[key]!r}')
    if min(abs(s) for s in p['std']) == 0:
        bad('std must be non-zero')
    if not isinstance(p['bgr_to_rgb'], bool):
        bad(f'bgr_to_rgb must be true or false, got {p["bgr_to_rgb"]!r}')
    if not isinstance(p['pad_value'], (int, float)):
        bad(f'pad_value must be a number, got {p["pad_value"]!r}')
    if p['size'] is not None and not (isinstance(p['size'], list) and len(p['size']) == 2):
        bad(f'size must be null or [h, w], got {p["size"]!r}')
    if p['pad_size_divisor'] is not None and int(p['pad_size_divisor']) < 1:
        bad('pad_size_divisor must be >= 1 or null')


# ----------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------

def new_export_info(cfg, written_cfg, *, config: str, checkpoint: Optional[str], part: str,
                    task: str, outputs: list, shape, dynamic: bool, seg_argmax: bool,
                    attention: dict, precisions: list, **measured) -> dict:
    """The ``export.json`` of an export, before :func:`write_export_info` writes it.

    Args:
        cfg: the config the model was built from; ``written_cfg`` the config as written
            (building a model mutates some of its sections): its model section's digest.
        config, checkpoint: their paths (``checkpoint`` None: random weights).
        part, task, outputs, shape, dynamic, seg_argmax: what was exported.
        attention: the window-attention layout report of the exported model.
        precisions: the artifacts written, ``['fp32']`` or ``['fp32', 'int8']``.
        measured: further keys, in order (``tolerance``, ``export_seconds``, ...).
    """
    from mmslab.utils.machine import machine_info
    info = dict(schema_version=SCHEMA_VERSION, config=config,
                model_config_sha256=model_config_sha256(written_cfg), checkpoint=checkpoint,
                random_weights=checkpoint is None,
                checkpoint_sha256=file_sha256(checkpoint) if checkpoint else None,
                part=part, task=task, outputs=list(outputs), shape=list(shape),
                dynamic=bool(dynamic), seg_argmax=bool(seg_argmax), attention=attention,
                precisions=list(precisions), pipeline=deploy_pipeline(cfg), **dataset_meta(cfg),
                versions=runtime_versions(), machine=machine_info(), **measured)
    if not dynamic:  # callers pad every image to the static size
        info['pipeline']['size'] = list(shape)
    if task == 'instance_segmentation':
        info['mask_thr_binary'] = float(cfg.model.test_cfg.rcnn.get('mask_thr_binary', 0.5))
    # before the minutes of conversion and calibration that follow
    check_export_info(info, EXPORT_JSON, whole_model=part == 'model')
    return info


def write_export_info(export_dir: str, info: dict) -> str:
    """Validate ``info`` (the whole-model contract for part ``model``) and write it to
    ``EXPORT_DIR/export.json``; returns the path. A writer that forgets a key fails here, not
    in the reader."""
    path = osp.join(export_dir, EXPORT_JSON)
    check_export_info(info, path, whole_model=info.get('part') == 'model')
    with open(path, 'w') as f:
        json.dump(info, f, indent=2)
    return path


# ----------------------------------------------------------------------------------------------
# what was exported
# ----------------------------------------------------------------------------------------------


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            digest.update(block)
    return digest.hexdigest()


def model_config_sha256(cfg) -> str:
    """Digest of the config's ``model`` section (the structure the weights belong to)."""
    model = cfg.model.to_dict() if hasattr(cfg.model, 'to_dict') else dict(cfg.model)
    text = json.dumps(model, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def is_segmentor(model) -> bool:
    """An mmseg segmentor (``EncoderDecoder`` and its kin: they have a decode head)."""
    return hasattr(model, 'decode_head')


def is_detector(model) -> bool:
    """An mmdet detector (``extract_feat`` without a decode head)."""
    return hasattr(model, 'extract_feat') and not is_segmentor(model)


def task_of(model) -> str:
    if is_segmentor(model):
        return 'semantic_segmentation'
    roi_head = getattr(model, 'roi_head', None)
    if roi_head is not None and getattr(roi_head, 'with_mask', False):
        return 'instance_segmentation'
    return 'detection'


def _find(pipeline, type_name: str) -> Optional[dict]:
    for step in pipeline:
        if step.get('type') == type_name:
            return dict(step)
    return None


def deploy_pipeline(cfg) -> dict:
    """The pre-processing of the config's test pipeline and data preprocessor, as plain
    values: ``resize`` (``scale`` as (w, h) and ``keep_ratio``, mmcv's ``Resize``), ``mean``,
    ``std``, ``bgr_to_rgb``, ``pad_size_divisor``, ``pad_value``, ``size`` (fixed pad size)."""
    dataset = cfg.test_dataloader.dataset
    while 'pipeline' not in dataset and 'dataset' in dataset:
        dataset = dataset.dataset
    pipeline = list(dataset.get('pipeline', []))
    resize = _find(pipeline, 'Resize')
    if resize is not None:
        scale = resize.get('scale')
        if scale is None:
            raise ValueError('the test pipeline\'s Resize has no fixed scale (scale_factor '
                             'resizing is not recorded for deployment)')
        resize = dict(scale=[int(v) for v in scale], keep_ratio=bool(resize.get('keep_ratio')))
    pre = cfg.model.data_preprocessor
    if 'pad_size_divisor' in pre or pre.get('type') == 'DetDataPreprocessor':  # mmdet
        size, divisor, pad = None, pre.get('pad_size_divisor'), pre.get('pad_value', 0)
    else:  # mmseg pads test images only as its test_cfg says (size / size_divisor: training)
        test_cfg = pre.get('test_cfg') or {}
        size, divisor, pad = test_cfg.get('size'), test_cfg.get('size_divisor'), \
            pre.get('pad_val', 0)
    return dict(resize=resize, mean=[float(v) for v in pre.get('mean', (0, 0, 0))],
                std=[float(v) for v in pre.get('std', (1, 1, 1))],
                bgr_to_rgb=bool(pre.get('bgr_to_rgb', False) or pre.get('rgb_to_bgr', False)),
                pad_size_divisor=int(divisor or 1), pad_value=float(pad or 0),
                size=list(size) if size is not None else None)


def dataset_meta(cfg) -> dict:
    """``classes`` and ``palette`` of the config's test dataset (its class's defaults unless
    the config sets ``metainfo``)."""
    from mmengine.registry import DATASETS
    dataset = cfg.test_dataloader.dataset
    while 'dataset' in dataset and 'type' in dataset and 'Wrapper' in str(dataset.type):
        dataset = dataset.dataset
    dataset_type = dataset.type
    if isinstance(dataset_type, str) and '.' not in dataset_type:
        # the config's codebase: mmengine's root registry alone does not find mmseg's datasets
        dataset_type = f"{cfg.get('default_scope', 'mmdet')}.{dataset_type}"
    cls = DATASETS.get(dataset_type) if isinstance(dataset_type, str) else dataset_type
    meta = dict(getattr(cls, 'METAINFO', {}) or {})
    meta.update(dataset.get('metainfo', None) or {})
    classes = list(meta.get('classes', []))
    palette = [list(map(int, c)) for c in meta.get('palette', [])][:len(classes)]
    return dict(classes=classes, palette=palette or None)


def runtime_versions() -> dict:
    import importlib.metadata as md
    versions = {}
    for name in ('torch', 'torchvision', 'onnx', 'onnxruntime', 'openvino', 'nncf', 'mmdet',
                 'mmsegmentation', 'mmcv'):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    return versions


def check_export_matches(info: dict, export_dir: str, checkpoint: str, cfg=None) -> None:
    """Refuse to evaluate an export with weights or a model other than its own."""
    if info.get('random_weights'):
        raise ValueError(f'{export_dir} holds random weights (exported with --random-weights); '
                         f'export {checkpoint} with tools/export_onnx.py CONFIG CHECKPOINT')
    recorded = info.get('checkpoint_sha256')
    if not recorded:
        raise ValueError(f'{export_dir}/export.json records no checkpoint_sha256: export again '
                         'with this version of tools/export_onnx.py')
    actual = file_sha256(checkpoint)
    if actual != recorded:
        raise ValueError(
            f'{checkpoint} (sha256 {actual[:12]}...) is not the checkpoint exported to '
            f"{export_dir} ({info.get('checkpoint')}, sha256 {recorded[:12]}...): export it "
            'again, or pass the checkpoint it was made from')
    if cfg is not None and info.get('model_config_sha256'):
        if model_config_sha256(cfg) != info['model_config_sha256']:
            raise ValueError(f"the config's model section differs from the one exported to "
                             f"{export_dir} ({info.get('config')}): export again")
