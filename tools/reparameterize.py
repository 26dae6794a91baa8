"""Export a fused (re-parameterized) checkpoint and the deploy config that builds it.

    python tools/reparameterize.py CONFIG CHECKPOINT OUT_DIR [--cfg-options ...]

Writes ``OUT_DIR/<config>_deploy.pth`` (fused weights) and ``OUT_DIR/<config>_deploy.py``
(the same model built with ``deploy=True``), so that

    python tools/test.py OUT_DIR/<config>_deploy.py OUT_DIR/<config>_deploy.pth

evaluates the fused model directly. This is the only way mmslab writes fused weights; a
training run's checkpoints always hold the unfused model.
"""
import argparse
import copy
import os
import os.path as osp

import torch
from mmengine.config import Config, DictAction
from mmengine.runner import load_checkpoint

import mmslab
from mmslab.engine.hooks.reparam_eval_hook import verify_fusion
from mmslab.models import statistic_modules
from mmslab.utils.launch import build_model_from_config, model_registry


def parse_args(argv=None):
    p = argparse.ArgumentParser(description='Export a fused checkpoint and deploy config')
    p.add_argument('config')
    p.add_argument('checkpoint')
    p.add_argument('out_dir')
    p.add_argument('--cfg-options', nargs='+', action=DictAction)
    return p.parse_args(argv)


def deploy_config(cfg: Config, backbone) -> Config:
    """The config with the backbone built fused and the training-only hooks removed."""
    cfg = Config(cfg.to_dict())
    cfg.model.backbone.deploy = True
    cfg.model.backbone.init_cfg = None
    cfg.model.backbone.pop('pretrained', None)
    folded = getattr(backbone, 'folded_out_norms', ())
    if folded:
        cfg.model.backbone.folded_out_norms = list(folded)
    hooks = []
    for hook in cfg.get('custom_hooks', None) or []:
        if hook.get('type') == 'ProgressiveNormHook':
            continue  # nothing progressive is left in a fused model
        if hook.get('type') == 'ReparamEvalHook':
            hook = dict(hook, reparam=False)  # already fused: keep only the latency report
        hooks.append(hook)
    cfg.custom_hooks = hooks
    return cfg


def check_fusion(cfg, unfused, fused) -> None:
    """Compare the fused model with the unfused one on a test-set image (a random one where
    the config's data is not there), in float32; exit with an error on a wrong fold."""
    from mmslab.deploy.quantize import preprocessed_images
    try:
        images, source = preprocessed_images(cfg, unfused, 1, 'test'), 'a test-set image'
    except (FileNotFoundError, RuntimeError, ValueError) as err:
        images = [torch.randn(1, 3, 512, 512, generator=torch.Generator().manual_seed(0))]
        source = f'a random 512x512 image ({err})'
    try:
        diff = verify_fusion(unfused, fused, images)
    except RuntimeError as err:
        raise SystemExit(f'error: {err}; nothing was written') from None
    print(f'fusion check: fused vs unfused {diff:.2e} (relative, float32) on {source}')


def main(argv=None):
    args = parse_args(argv)
    cfg, model = build_model_from_config(args.config, args.cfg_options)
    MODELS = model_registry(cfg.default_scope)
    ckpt = load_checkpoint(model, args.checkpoint, map_location='cpu', strict=True)
    model.eval()
    unfused = copy.deepcopy(model)
    mmslab.reparameterize(model)
    check_fusion(cfg, unfused, model)
    del unfused
    left = statistic_modules(model.backbone)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = osp.splitext(osp.basename(args.config))[0] + '_deploy'
    ckpt_path = osp.join(args.out_dir, stem + '.pth')
    meta = dict(ckpt.get('meta', {})) if isinstance(ckpt, dict) else {}
    meta.update(mmslab_deploy=True, source_checkpoint=osp.abspath(args.checkpoint),
                source_config=osp.abspath(args.config))
    torch.save(dict(state_dict=model.state_dict(), meta=meta), ckpt_path)
    cfg_path = osp.join(args.out_dir, stem + '.py')
    deploy_config(cfg, model.backbone).dump(cfg_path)
    # The deploy config must rebuild exactly this structure.
    rebuilt = MODELS.build(Config.fromfile(cfg_path).model)
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    n_before = sum(v.numel() for v in ckpt['state_dict'].values()) if 'state_dict' in ckpt \
        else None
    n_after = sum(p.numel() for p in model.state_dict().values())
    print(f'fused checkpoint: {ckpt_path}\ndeploy config:    {cfg_path}')
    print(f'tensor elements: {n_before} -> {n_after}; backbone modules still computing '
          f'statistics: {left or "none"}')
    return ckpt_path, cfg_path


if __name__ == '__main__':
    main()
