"""Shared set-up of mmslab's command-line tools (scope, CPU distributed runs, models)."""
import datetime
import os
import os.path as osp

import torch
from mmengine.config import Config
from mmengine.registry import init_default_scope

SCOPES = ('mmdet', 'mmseg')


def resolve_scope(cfg: Config, config_path: str) -> str:
    """The config's ``default_scope``, made the default; exits clearly if missing or unknown."""
    scope = cfg.get('default_scope', None)
    if scope not in SCOPES:
        what = 'has no default_scope' if scope is None else f'has default_scope={scope!r}'
        raise SystemExit(f'error: config {config_path} {what}; mmslab tools need '
                         f"default_scope = 'mmdet' (detection) or 'mmseg' (segmentation).")
    init_default_scope(scope)
    return scope


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
    import torch.distributed as dist
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
    import torch.distributed as dist
    if own_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def build_model_from_config(config: str, cfg_options=None, pretrained: bool = False,
                            backbone: dict = None):
    """``(cfg, model)`` built in the config's scope, without loading pretrained weights
    unless ``pretrained`` (inference tools load their own checkpoint). ``backbone`` replaces
    the config's backbone as a whole (e.g. by a baseline of another type)."""
    cfg = Config.fromfile(config)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    scope = resolve_scope(cfg, config)
    if scope == 'mmdet':
        from mmdet.registry import MODELS
    else:
        from mmseg.registry import MODELS
    model_cfg = cfg.model.copy()
    if backbone is not None:
        model_cfg.backbone = dict(backbone)
    if not pretrained:
        model_cfg.backbone = dict(model_cfg.backbone, init_cfg=None)
        model_cfg.backbone.pop('pretrained', None)
    return cfg, MODELS.build(model_cfg)


def model_registry(scope: str):
    if scope == 'mmdet':
        from mmdet.registry import MODELS
    else:
        from mmseg.registry import MODELS
    return MODELS


def config_stem(config: str) -> str:
    return osp.splitext(osp.basename(config))[0]
