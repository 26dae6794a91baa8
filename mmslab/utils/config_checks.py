"""Checks run on a loaded config before a Runner is built.

``check_data_root(cfg, mode)`` turns the deep, late failure of a missing dataset (an error
from inside a dataloader worker or pycocotools) into one message that says where the data
was expected and how to create the synthetic demo data there.
"""
import os
import os.path as osp
from typing import Iterator, List, Optional, Tuple

__all__ = ['DataNotFoundError', 'check_data_root', 'missing_data_paths']

#: Dataloaders whose datasets must exist, per tool.
MODE_DATALOADERS = {
    'train': ('train_dataloader', 'val_dataloader'),
    'val': ('val_dataloader', ),
    'test': ('test_dataloader', ),
}
_REPO_ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
_PREFIX_KEYS = ('img', 'img_path', 'seg', 'seg_map_path', 'ann', 'sub_data_root')


class DataNotFoundError(FileNotFoundError):
    """A dataset the config needs is not on disk (the message says where and what to do)."""


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
    """The make_demo_data command that fills ``data_root``, or '' if it is no demo layout."""
    root = osp.normpath(data_root)
    if osp.basename(root) == 'coco':
        kind, out = 'coco', osp.dirname(root)
    elif osp.basename(root) == 'ADEChallengeData2016' and \
            osp.basename(osp.dirname(root)) == 'ade':
        kind, out = 'ade', osp.dirname(osp.dirname(root))
    else:
        return ''
    cmd = f'python {script}'
    if osp.normpath(out or '.') != 'data':
        cmd += f' --out {out or "."}'
    return cmd + f' --kind {kind}'


def check_data_root(cfg, mode: str = 'train', config_path: Optional[str] = None) -> None:
    """Raise :class:`DataNotFoundError` unless the datasets ``mode`` needs exist.

    Args:
        cfg: the loaded (and ``--cfg-options``-merged) config.
        mode: ``'train'`` (train and, when ``val_cfg`` is set, val dataloaders), ``'val'`` or
            ``'test'`` (test dataloader and evaluator).
        config_path: named in the message.

    The message names each missing path (as written and resolved against the current
    directory) and the command that creates the synthetic demo data at the standard data
    roots (``data/coco/`` and ``data/ade/ADEChallengeData2016``). Call it in tools/train.py
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
        lines.append(f'The synthetic demo data is made by `python {script}` (into data/coco and '
                     'data/ade/ADEChallengeData2016 under the current directory).')
    lines.append('For real data, put or symlink the dataset at that path, or override it with '
                 '--cfg-options train_dataloader.dataset.data_root=PATH (and the val/test ones).')
    raise DataNotFoundError('\n'.join(lines))
