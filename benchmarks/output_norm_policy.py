"""Fine-tuning with three policies for the backbone's output norms (new in detection).

    python benchmarks/output_norm_policy.py DEMO_CHECKPOINT [--iters 80] [--out DIR]

Starts from the backbone of a trained demo detector (``bash tools/demo.sh``), saved as a
pretrained file the way a converted SLAB release looks: output norms removed, every other
norm's LN -> RepBN schedule finished. Three short fine-tuning runs of
``configs/demo/mask_rcnn_slab_swin_t_demo.py`` then use the 1x configs' recipe
(``bn_stats='frozen'``, fresh detection heads), the same seed and iterations, and differ only
in the output norms:

* ``old``: PRepBN with ``alpha_init=1`` and frozen statistics (what the 1x configs did);
* ``new``: PRepBN with ``alpha_init=0`` and training statistics (``out_bn_stats='train'``,
  what the configs do now);
* ``layernorm``: plain LayerNorm (the SLAB authors' detection backbone; does not fold).

Each run is evaluated with the fused model through ReparamEvalHook. Because a short run's mAP
is noisy, each run also reports what the neck receives: the per-channel standard deviation of
the backbone's four outputs on validation images (eval mode, median over channels). Outputs of
a norm that normalizes have a spread near its affine weight (about 1 here); outputs of a norm
whose statistics stayed at mean 0 / variance 1 keep the residual stream's raw scale. Prints a
table, writes ``output_norm_policy.json`` and ``.png`` into ``--out``.
"""
import argparse
import glob
import json
import os
import os.path as osp
import subprocess
import sys

import torch

from mmslab.utils.plotting import grouped_bars, saved_figure

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEMO = osp.join(REPO, 'configs', 'demo', 'mask_rcnn_slab_swin_t_demo.py')

POLICIES = {
    'old': "dict(type='PRepBN', step={step}, alpha_init=1.0)",
    'new': "dict(type='PRepBN', step={step}, alpha_init=0.0)",
    'layernorm': "dict(type='LN')",
}
OUT_STATS = {'old': "'frozen'", 'new': "'train'", 'layernorm': "'train'"}


def save_pretrained_backbone(checkpoint: str, path: str) -> None:
    """The detector's backbone without output norms, schedules finished (a converted
    release), in mmslab's layout."""
    from mmslab.utils.checkpoint import load_checkpoint_file
    state = load_checkpoint_file(checkpoint)['state_dict']
    backbone = {}
    for k, v in state.items():
        if not k.startswith('backbone.'):
            continue
        k = k[len('backbone.'):]
        if k.split('.')[0] in ('norm0', 'norm1', 'norm2', 'norm3'):
            continue
        if k.endswith('schedule_offset'):
            v = torch.ones_like(v)
        elif k.endswith('cur_iter'):
            v = torch.zeros_like(v)
        backbone[k] = v
    torch.save({'state_dict': backbone}, path)


def write_config(path: str, policy: str, pretrained: str, iters: int) -> None:
    step = max(1, int(0.8 * iters))
    with open(path, 'w') as f:
        f.write(f"""_base_ = {DEMO!r}
max_iters = {iters}
model = dict(backbone=dict(
    init_cfg=dict(_delete_=True, type='Pretrained', checkpoint={pretrained!r}),
    bn_stats='frozen', out_bn_stats={OUT_STATS[policy]},
    out_norm_cfg=dict(_delete_=True, **{POLICIES[policy].format(step=step)})))
train_cfg = dict(max_iters=max_iters, val_interval=max_iters)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=10),
    dict(type='MultiStepLR', by_epoch=False, begin=0, end=max_iters,
         milestones=[int(0.8 * max_iters)], gamma=0.1)]
default_hooks = dict(checkpoint=dict(interval=max_iters, save_best=None))
randomness = dict(seed=0)
""")


def final_metrics(work_dir: str) -> dict:
    runs = sorted(glob.glob(osp.join(work_dir, '*', 'vis_data', 'scalars.json')))
    with open(runs[-1]) as f:
        records = [json.loads(line) for line in f if line.strip()]
    evals = [r for r in records if 'coco/bbox_mAP' in r]
    return {k: v for k, v in evals[-1].items() if k.startswith('coco/')} if evals else {}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('checkpoint', help='a trained demo detector (work_dirs/.../iter_200.pth)')
    p.add_argument('--iters', type=int, default=80)
    p.add_argument('--policies', nargs='+', default=list(POLICIES), choices=list(POLICIES))
    p.add_argument('--out', default='work_dirs/output_norm_policy')
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    pretrained = osp.abspath(osp.join(args.out, 'demo_backbone_release.pth'))
    save_pretrained_backbone(args.checkpoint, pretrained)
    results = {}
    for policy in args.policies:
        config = osp.join(args.out, f'finetune_{policy}.py')
        write_config(config, policy, pretrained, args.iters)
        work_dir = osp.join(args.out, policy)
        print(f'fine-tuning with output norm policy {policy!r} ({args.iters} iterations)',
              flush=True)
        subprocess.run([sys.executable, osp.join(REPO, 'tools', 'train.py'), config,
                        '--work-dir', work_dir], check=True, cwd=REPO,
                       stdout=subprocess.DEVNULL)
        results[policy] = final_metrics(work_dir)
        results[policy]['output_std'] = output_spread(
            config, open(osp.join(work_dir, 'last_checkpoint')).read().strip())
        print(f'  {policy}: {results[policy]}', flush=True)
    print(f"\n{'output norms':12s} {'bbox mAP':>9s} {'segm mAP':>9s}   per-channel std of "
          f'outputs 0-3 (fused model, {args.iters} iterations, seed 0)')
    for policy, m in results.items():
        spread = ' '.join(f'{v:7.2f}' for v in m['output_std'])
        print(f"{policy:12s} {m.get('coco/bbox_mAP', float('nan')):9.3f} "
              f"{m.get('coco/segm_mAP', float('nan')):9.3f}   {spread}")
    with open(osp.join(args.out, 'output_norm_policy.json'), 'w') as f:
        json.dump(dict(checkpoint=args.checkpoint, iters=args.iters, results=results), f,
                  indent=2)
    plot(results, osp.join(args.out, 'output_norm_policy.png'))
    return results


def output_spread(config: str, checkpoint: str, num_images: int = 8) -> list:
    """Median over channels of the per-channel std of each backbone output (eval mode) on
    the first ``num_images`` validation images."""
    import mmcv
    from mmdet.apis import init_detector
    model = init_detector(config, checkpoint, device='cpu')
    root = osp.join(REPO, model.cfg.val_dataloader.dataset.data_root,
                    model.cfg.val_dataloader.dataset.data_prefix.img)
    files = sorted(os.listdir(root))[:num_images]
    images = [torch.from_numpy(mmcv.imread(osp.join(root, f))).permute(2, 0, 1).contiguous()
              for f in files]
    with torch.no_grad():
        x = model.data_preprocessor(dict(inputs=images), False)['inputs']
        outs = model.backbone(x)
    # [B, C, H, W] -> per-channel std over images and positions -> median over channels
    return [float(o.transpose(0, 1).flatten(1).std(dim=1).median()) for o in outs]


def plot(results, path):
    names = list(results)
    with saved_figure(path, figsize=(6, 3.5)) as (fig, axes):
        ax = axes[0][0]
        grouped_bars(ax, names, {key.split('/')[1]: [results[n].get(key, 0.0) for n in names]
                                 for key in ('coco/bbox_mAP', 'coco/segm_mAP')})
        ax.set_ylabel('mAP (fused model)')
        ax.set_title('output-norm policy when fine-tuning')
        ax.legend()


if __name__ == '__main__':
    main()
