"""Shared set-up of mmslab's command-line tools (config and scope, work dir, CPU distributed
runs, models).

Every tool picks the codebase the same way: :func:`load_config` reads the config, applies
``--cfg-options`` and makes its ``default_scope`` (``'mmdet'`` or ``'mmseg'``) the default;
:func:`model_registry` is that codebase's ``MODELS``; :func:`build_model_from_config` builds the
model there.
"""
import datetime
import importlib
import os
import os.path as osp
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from mmengine.config import Config
from mmengine.registry import Registry, init_default_scope

SCOPES = ('mmdet', 'mmseg')


def resolve_scope(cfg: Config, config_path: Optional[str] = None) -> str:
    """The config's ``default_scope``, made the default; exits clearly if missing or unknown."""
    config_path = config_path or cfg.filename
    scope = cfg.get('default_scope', None)
    if scope not in SCOPES:
        what = 'has no default_scope' if scope is None else f'has default_scope={scope!r}'
        raise SystemExit(f'error: config {config_path} {what}; mmslab tools need '
                         f"default_scope = 'mmdet' (detection) or 'mmseg' (segmentation).")
    init_default_scope(scope)
    return scope


def load_config(config_path: str, cfg_options: Optional[dict] = None) -> Tuple[Config, str]:
    """``(cfg, scope)``: the config with ``cfg_options`` merged, its scope made the default."""
    cfg = Config.fromfile(config_path)  # also imports cfg.custom_imports (mmslab)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    return cfg, resolve_scope(cfg, config_path)


def model_registry(scope: str) -> Registry:
    """The ``MODELS`` registry of ``scope`` (``'mmdet'`` or ``'mmseg'``)."""
    if scope not in SCOPES:
        raise ValueError(f'scope must be one of {SCOPES}, got {scope!r}')
    return importlib.import_module(f'{scope}.registry').MODELS


def set_work_dir(cfg: Config, work_dir: Optional[str], config_path: str) -> None:
    """``--work-dir``, else the config's ``work_dir``, else ``./work_dirs/<config name>``."""
    if work_dir is not None:
        cfg.work_dir = work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs', config_stem(config_path))


def add_launcher_args(parser) -> None:
    """``--launcher`` and ``--local_rank``/``--local-rank`` (torch.distributed.launch passes
    either spelling); call :func:`export_local_rank` after parsing."""
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)


def export_local_rank(args) -> None:
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)


def setup_cpu_distributed(cfg: Config, launcher: str) -> bool:
    """Prepare ``launcher='pytorch'`` runs on a machine without CUDA.

    mmengine's own initialisation calls ``torch.cuda.set_device`` and its default DDP wrapper
    passes ``device_ids=[LOCAL_RANK]``; both fail without CUDA. Initialise a gloo process group
    here (the Runner skips its own initialisation when a group exists) and wrap with
    ``device_ids=None`` unless the config sets its own wrapper. Nothing changes when CUDA exists.
    Returns whether a process group was created here.
    """
    if launcher != 'pytorch' or torch.cuda.is_available():
        return False
    cfg.merge_from_dict({'env_cfg.dist_cfg.backend': 'gloo'})
    if cfg.get('model_wrapper_cfg', None) is None:
        cfg.model_wrapper_cfg = dict(type='MMDistributedDataParallel', device_ids=None)
    if dist.is_initialized():
        return False
    kwargs = {}
    timeout = cfg.env_cfg.dist_cfg.get('timeout', None)
    if timeout is not None:
        kwargs['timeout'] = datetime.timedelta(seconds=timeout)
    dist.init_process_group(backend='gloo', init_method='env://', **kwargs)
    return True


def teardown_cpu_distributed(own_group: bool) -> None:
    """Destroy the process group :func:`setup_cpu_distributed` created, after a barrier so
    no rank tears gloo down while another still uses it (that aborted a rank at exit)."""
    if own_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def build_model_from_config(config: str, cfg_options=None, pretrained: bool = False,
                            backbone: dict = None):
    """``(cfg, model)`` built in the config's scope, without loading pretrained weights
    unless ``pretrained`` (inference tools load their own checkpoint). ``backbone`` replaces
    the config's backbone as a whole (e.g. by a baseline of another type)."""
    cfg, scope = load_config(config, cfg_options)
    model_cfg = cfg.model.copy()
    if backbone is not None:
        model_cfg.backbone = dict(backbone)
    if not pretrained:
        model_cfg.backbone = dict(model_cfg.backbone, init_cfg=None)
        model_cfg.backbone.pop('pretrained', None)
    return cfg, model_registry(scope).build(model_cfg)


def config_stem(config: str) -> str:
    return osp.splitext(osp.basename(config))[0]
