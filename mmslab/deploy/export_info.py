"""What an export directory records about itself (``export.json``), and the checks that keep
an export and the checkpoint / config it is evaluated with together.

``export.json`` keys written by ``tools/export_onnx.py``:

* ``part`` (``backbone`` | ``features`` | ``model``), ``task`` (``detection`` |
  ``instance_segmentation`` | ``semantic_segmentation``), ``outputs`` (names, in order);
* ``shape`` (the traced input size), ``dynamic`` (height and width free), ``attention``
  (the window-attention layout in the graph and how many blocks took it);
* ``config``, ``model_config_sha256`` (of the model section), ``checkpoint``,
  ``checkpoint_sha256`` (null for ``--random-weights``), ``random_weights``;
* ``pipeline``: what a caller does before the graph (resize, mean, std, channel order,
  padding), ``classes``, ``palette``, ``mask_thr_binary``: enough for
  :mod:`mmslab.deploy.predict` to run the model without PyTorch;
* ``precisions`` (``fp32``, ``int8``), ``versions`` (torch, onnx, runtimes), ``machine``,
  parity and INT8 deviation per runtime.
"""
import hashlib
import json
import os.path as osp
from typing import Optional

TASKS = ('detection', 'instance_segmentation', 'semantic_segmentation')


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
    cls = DATASETS.get(dataset.type)
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


def read_export_info(export_dir: str) -> dict:
    """``export.json`` of a directory written by ``tools/export_onnx.py``."""
    path = osp.join(export_dir, 'export.json')
    if not osp.isfile(path):
        raise FileNotFoundError(f'{path} not found: --export-dir must be a directory written by '
                                'tools/export_onnx.py --out DIR')
    with open(path) as f:
        info = json.load(f)
    for key in ('part', 'shape', 'dynamic'):
        if key not in info:
            raise ValueError(f'{path} has no {key!r}: not written by this version of '
                             'tools/export_onnx.py; export again')
    return info


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
