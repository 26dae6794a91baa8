"""Checks run on a loaded config before a Runner is built.

``check_data_root(cfg, mode)`` turns the deep, late failure of a missing dataset (an error
from inside a dataloader worker or pycocotools) into one message that says where the data
was expected and how to create the synthetic demo data there.

``check_dataset_classes(cfg, mode)`` stops a config whose dataset holds none of the classes it
trains (a 1x COCO config pointed at the synthetic demo set, say), which mmdet only reports
once every image has been filtered out, as mmengine's ``ValueError: need at least one array
to concatenate``.
"""
import importlib
import json
import os
import os.path as osp
from typing import Iterator, List, Optional, Sequence, Tuple

__all__ = [
    'DEMO_DATA_ROOT', 'DataCheckError', 'DataNotFoundError', 'DatasetClassesError',
    'check_data_root', 'check_dataset_classes', 'missing_data_paths'
]

#: Dataloaders whose datasets must exist, per tool.
MODE_DATALOADERS = {
    'train': ('train_dataloader', 'val_dataloader'),
    'val': ('val_dataloader', ),
    'test': ('test_dataloader', ),
}
_REPO_ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
#: Where tools/make_demo_data.py puts the synthetic sets (``<root>/coco``,
#: ``<root>/ade/ADEChallengeData2016``) and where the demo configs read them: a root of their
#: own, apart from the standard ``data/coco`` and ``data/ade`` of the real datasets (defined
#: here, below ``mmslab.datasets``, which re-exports it, so the checks can name it).
DEMO_DATA_ROOT = 'data/mmslab_demo'
_PREFIX_KEYS = ('img', 'img_path', 'seg', 'seg_map_path', 'ann', 'sub_data_root')


class DataCheckError(Exception):
    """A config's data fails a check before training (the message says what and what to do)."""


class DataNotFoundError(DataCheckError, FileNotFoundError):
    """A dataset the config needs is not on disk (the message says where and what to do)."""


class DatasetClassesError(DataCheckError, ValueError):
    """A dataset holds no image of the classes its config expects."""


def _get(obj, key, default=None):
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _is_remote(path: str) -> bool:
    return '://' in path


def _join(root: Optional[str], path: str) -> str:
    if not root or osp.isabs(path) or _is_remote(path):
        return path
    return osp.join(root, path)


def _leaf_datasets(dataset_cfg) -> Iterator[dict]:
    """Datasets inside wrappers (RepeatDataset, ClassBalancedDataset, ConcatDataset, ...)."""
    if dataset_cfg is None:
        return
    inner = _get(dataset_cfg, 'dataset')
    inners = _get(dataset_cfg, 'datasets')
    if inner is not None:
        yield from _leaf_datasets(inner)
    elif inners is not None:
        for d in inners:
            yield from _leaf_datasets(d)
    else:
        yield dataset_cfg


def _required_paths(dataset_cfg) -> Tuple[Optional[str], List[str]]:
    """``(data_root, [paths that must exist])`` of one dataset config (mmengine's joining
    rules: relative ``ann_file`` and ``data_prefix`` entries live under ``data_root``)."""
    root = _get(dataset_cfg, 'data_root') or None
    paths = []
    ann_file = _get(dataset_cfg, 'ann_file')
    if isinstance(ann_file, str) and ann_file:
        paths.append(_join(root, ann_file))
    prefix = _get(dataset_cfg, 'data_prefix') or {}
    for key in _PREFIX_KEYS:
        value = _get(prefix, key)
        if isinstance(value, str) and value:
            paths.append(_join(root, value))
    return root, paths


def _evaluator_ann_files(evaluator) -> List[str]:
    if evaluator is None:
        return []
    if isinstance(evaluator, (list, tuple)):
        return [p for e in evaluator for p in _evaluator_ann_files(e)]
    metrics = _get(evaluator, 'metrics')
    if metrics is not None:
        return _evaluator_ann_files(metrics)
    ann_file = _get(evaluator, 'ann_file')
    return [ann_file] if isinstance(ann_file, str) and ann_file else []


def missing_data_paths(cfg, mode: str = 'train') -> List[Tuple[str, str, str]]:
    """``(dataloader, data_root, missing path)`` for every dataset path ``mode`` needs.

    A missing ``data_root`` is reported alone (not each file under it). Remote paths
    (``s3://``...) are not checked. Relative paths are relative to the current directory,
    as when mmengine opens them.
    """
    if mode not in MODE_DATALOADERS:
        raise ValueError(f'mode must be one of {tuple(MODE_DATALOADERS)}, got {mode!r}')
    missing = []
    seen = set()

    def report(loader, root, path):
        if path not in seen:
            seen.add(path)
            missing.append((loader, root or '', path))

    for loader in MODE_DATALOADERS[mode]:
        if loader == 'val_dataloader' and mode == 'train' and not cfg.get('val_cfg', None):
            continue  # no validation during training
        loader_cfg = cfg.get(loader, None)
        if not loader_cfg:
            continue
        for dataset in _leaf_datasets(_get(loader_cfg, 'dataset')):
            root, paths = _required_paths(dataset)
            if root and not _is_remote(root) and not osp.isdir(root):
                report(loader, root, root)
                continue
            for path in paths:
                if not _is_remote(path) and not osp.exists(path):
                    report(loader, root, path)
        evaluator_key = loader.replace('_dataloader', '_evaluator')
        for path in _evaluator_ann_files(cfg.get(evaluator_key, None)):
            under_missing_root = any(path.startswith(m[2]) for m in missing)
            if not _is_remote(path) and not osp.exists(path) and not under_missing_root:
                report(evaluator_key, '', path)
    return missing


def _demo_command(data_root: str, script: str) -> str:
    """The make_demo_data command that fills ``data_root``, or '' if it is no demo root.

    A demo root is ``<out>/coco`` or ``<out>/ade/ADEChallengeData2016`` with an ``<out>`` named
    as :data:`DEMO_DATA_ROOT`: the standard roots (``data/coco``) are the real datasets', and
    synthetic data there would only make a real config fail later, on the wrong classes.
    """
    root = osp.normpath(data_root)
    if osp.basename(root) == 'coco':
        kind, out = 'coco', osp.dirname(root)
    elif osp.basename(root) == 'ADEChallengeData2016' and \
            osp.basename(osp.dirname(root)) == 'ade':
        kind, out = 'ade', osp.dirname(osp.dirname(root))
    else:
        return ''
    if osp.basename(out) != osp.basename(DEMO_DATA_ROOT):
        return ''
    cmd = f'python {script}'
    if osp.normpath(out) != osp.normpath(DEMO_DATA_ROOT):
        cmd += f' --out {out}'
    return cmd + f' --kind {kind}'


def check_data_root(cfg, mode: str = 'train', config_path: Optional[str] = None) -> None:
    """Raise :class:`DataNotFoundError` unless the datasets ``mode`` needs exist.

    Args:
        cfg: the loaded (and ``--cfg-options``-merged) config.
        mode: ``'train'`` (train and, when ``val_cfg`` is set, val dataloaders), ``'val'`` or
            ``'test'`` (test dataloader and evaluator).
        config_path: named in the message.

    The message names each missing path (as written and resolved against the current
    directory) and, for the demo configs' roots (under ``data/mmslab_demo``), the command that
    creates the synthetic demo data there. Call it in tools/train.py
    and tools/test.py right after loading the config, e.g.::

        try:
            check_data_root(cfg, 'train', args.config)
        except DataNotFoundError as err:
            raise SystemExit(f'error: {err}')
    """
    missing = missing_data_paths(cfg, mode)
    if not missing:
        return
    cwd = os.getcwd()
    what = f' for {config_path}' if config_path else ''
    lines = [f'dataset not found{what} (relative paths are taken from the current directory '
             f'{cwd}):']
    for loader, root, path in missing[:6]:
        kind = 'data root' if path == root else 'path'
        lines.append(f'  - {loader}: {kind} {path!r} -> {osp.abspath(path)} does not exist')
    if len(missing) > 6:
        lines.append(f'  ... and {len(missing) - 6} more')
    script = osp.join(_REPO_ROOT, 'tools', 'make_demo_data.py')
    if osp.abspath(cwd) == _REPO_ROOT:
        script = osp.join('tools', 'make_demo_data.py')
    commands = []
    for _, root, _ in missing:
        cmd = _demo_command(root, script) if root else ''
        if cmd and cmd not in commands:
            commands.append(cmd)
    if commands:
        lines.append(f'To create the synthetic demo data there, run in {cwd}:')
        lines.extend(f'    {cmd}' for cmd in commands)
    else:
        lines.append(f'(The synthetic demo data of configs/demo/ is made by `python {script}`, '
                     f'into {DEMO_DATA_ROOT}/coco and {DEMO_DATA_ROOT}/ade/ADEChallengeData2016 '
                     'under the current directory; it holds none of the real classes.)')
    lines.append('For real data, put or symlink the dataset at that path, or override it with '
                 '--cfg-options train_dataloader.dataset.data_root=PATH (and the val/test ones).')
    raise DataNotFoundError('\n'.join(lines))


def _registered_dataset(name: str, scope: Optional[str]):
    """The dataset class registered as ``name`` (``'scope.Name'`` or in ``scope``), or None."""
    if '.' in name:
        scope, name = name.split('.', 1)
    if not scope:
        return None
    try:
        registry = importlib.import_module(f'{scope}.registry').DATASETS
    except (ImportError, AttributeError):
        return None
    return registry.get(name)


def _expected_classes(dataset_cfg, scope: Optional[str]) -> Tuple[Optional[Tuple[str, ...]], str]:
    """``(classes, where they come from)`` of a dataset config: its ``metainfo.classes``, else
    its dataset class's ``METAINFO['classes']``; ``(None, '')`` when neither is known."""
    classes = _get(_get(dataset_cfg, 'metainfo'), 'classes')
    if classes:
        return ((classes, ) if isinstance(classes, str) else tuple(classes)), 'metainfo.classes'
    dataset_type = _get(dataset_cfg, 'type')
    if isinstance(dataset_type, str):
        dataset_type = _registered_dataset(dataset_type, scope)
    classes = (getattr(dataset_type, 'METAINFO', None) or {}).get('classes')
    if not classes:
        return None, ''
    return tuple(classes), (f'{dataset_type.__name__}.METAINFO; the config sets no '
                            'metainfo.classes')


def _load_coco_categories(path: str) -> Optional[Tuple[dict, set, int, bool]]:
    """``(category id -> name, ids annotated on a listed image, annotation count, made by
    mmslab's demo generator)`` of a COCO-style file, or None when it has no ``categories`` list
    (not COCO-style; its dataset's own loader judges it)."""
    try:
        with open(path) as f:
            coco = json.load(f)
    except ValueError as err:
        raise DataCheckError(f'annotation file {path} ({osp.abspath(path)}) is not valid JSON: '
                             f'{err}') from None
    if not isinstance(coco, dict) or not isinstance(coco.get('categories'), list):
        return None
    names = {c.get('id'): str(c.get('name')) for c in coco['categories'] if isinstance(c, dict)}
    image_ids = {img.get('id') for img in coco.get('images') or [] if isinstance(img, dict)}
    annotations = [a for a in coco.get('annotations') or [] if isinstance(a, dict)]
    annotated = {a.get('category_id') for a in annotations if a.get('image_id') in image_ids}
    made_by_demo = _get(coco.get('info'), 'contributor') == 'mmslab'
    return names, annotated, len(annotations), made_by_demo


def _listing(names: Sequence[str], limit: int = 12) -> str:
    shown = ', '.join(names[:limit])
    return shown + (f', ... ({len(names)} in all)' if len(names) > limit else '')


def _first_file(directory: str) -> Optional[str]:
    """A file anywhere under ``directory`` (the first the walk meets), or None."""
    for parent, _, files in os.walk(directory):
        if files:
            return osp.join(parent, files[0])
    return None


def check_dataset_classes(cfg, mode: str = 'train', config_path: Optional[str] = None) -> None:
    """Raise a :class:`DataCheckError` unless each dataset ``mode`` needs yields images of the
    classes its config expects.

    Datasets with a COCO-style annotation file (``.json`` with a ``categories`` list): its
    category names must overlap the expected classes (the dataset's ``metainfo.classes``, or
    its dataset class's ``METAINFO`` classes, e.g. mmdet's 80 COCO classes, when the config
    sets none), and for a training dataset (no ``test_mode``) at least one listed image must
    carry an annotation of one of them; otherwise :class:`DatasetClassesError` names the file,
    the classes found and the classes expected. Every image or label folder of the
    ``data_prefix`` (ADE20K's ``images/training``, say) must hold a file; otherwise
    :class:`DataNotFoundError` names it, as it does a missing annotation file or folder.

    Only the annotation files are read (plain ``json.load``, once each); no dataset is built.
    Loaders and the meaning of ``mode`` are those of :func:`check_data_root`; call it after
    that one, e.g. in tools/train.py::

        try:
            check_data_root(cfg, 'train', args.config)
            check_dataset_classes(cfg, 'train', args.config)
        except DataCheckError as err:
            raise SystemExit(f'error: {err}')
    """
    if mode not in MODE_DATALOADERS:
        raise ValueError(f'mode must be one of {tuple(MODE_DATALOADERS)}, got {mode!r}')
    what = f' of {config_path}' if config_path else ''
    scope = cfg.get('default_scope', None)
    loaded = {}
    for loader in MODE_DATALOADERS[mode]:
        if loader == 'val_dataloader' and mode == 'train' and not cfg.get('val_cfg', None):
            continue
        loader_cfg = cfg.get(loader, None)
        if not loader_cfg:
            continue
        for dataset in _leaf_datasets(_get(loader_cfg, 'dataset')):
            root = _get(dataset, 'data_root') or None
            if root and _is_remote(root):
                continue
            prefix = _get(dataset, 'data_prefix') or {}
            for key in _PREFIX_KEYS:
                value = _get(prefix, key)
                if not isinstance(value, str) or not value or _is_remote(value):
                    continue
                folder = _join(root, value)
                if osp.isdir(folder) and _first_file(folder) is None:
                    raise DataNotFoundError(
                        f'{loader}{what}: data_prefix.{key} folder {folder!r} -> '
                        f'{osp.abspath(folder)} is empty: the dataset would have no samples. '
                        'Put the dataset there or point data_root at it.')
            ann_file = _get(dataset, 'ann_file')
            if not isinstance(ann_file, str) or not ann_file.endswith('.json') or \
                    _is_remote(ann_file):
                continue
            path = _join(root, ann_file)
            if not osp.isfile(path):
                raise DataNotFoundError(f'{loader}{what}: annotation file {path!r} -> '
                                        f'{osp.abspath(path)} does not exist.')
            if path not in loaded:
                loaded[path] = _load_coco_categories(path)
            if loaded[path] is None:
                continue
            names, annotated, num_annotations, made_by_demo = loaded[path]
            expected, source = _expected_classes(dataset, scope)
            if not expected:
                continue
            wanted = set(expected)
            matching = {cid for cid, name in names.items() if name in wanted}
            found = list(names.values())
            if matching and (_get(dataset, 'test_mode') or matching & annotated):
                continue
            lines = [f'{loader}{what}: the dataset yields no image of the classes the config '
                     f'expects.',
                     f'  annotation file: {path} ({osp.abspath(path)})']
            if not matching:
                lines.append(f'  classes found there ({len(found)}): {_listing(found) or "none"}')
            else:
                lines.append(f'  classes found there ({len(found)}): {_listing(found)}; none of '
                             f'its {num_annotations} annotations on its images is of a class '
                             'the config expects')
            lines.append(f'  classes the config expects ({len(expected)}, from {source}): '
                         f'{_listing(list(expected))}')
            if made_by_demo:
                lines.append('This is the synthetic demo set of tools/make_demo_data.py: only '
                             'the configs in configs/demo/ train on it.')
            lines.append('Point data_root (and ann_file) at a dataset of the expected classes, or '
                         "set the dataset's metainfo=dict(classes=...) and the heads' num_classes "
                         'to the classes of that file.')
            raise DatasetClassesError('\n'.join(lines))
