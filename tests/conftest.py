"""Helpers shared by the tests (import them with ``from conftest import ...``).

As mmdet's ``tests/test_models/test_backbones/utils.py``: small functions, no fixtures with
hidden state.
"""
import importlib.util
import os.path as osp

import numpy as np
import torch
import torch.nn as nn
# mmengine's ProgressBar binds its default output, sys.stdout, when it is first imported: at
# collection, pytest's session-long capture; first imported inside a test with capsys, the
# stream of that test, closed before any later test's progress bar writes to it.
import mmengine.utils.progressbar  # noqa: F401

#: Fixtures built once a session, shared by several test modules.
pytest_plugins = ['deployed_models']

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
TOOLS = osp.join(REPO, 'tools')


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|``: the relative error of ``a`` against the reference ``b``."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def randomize_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random weights everywhere, incl. BN statistics, alphas and LayerNorm affines; returns
    the model in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.05 if p.dim() > 1 else 0.2) +
                    (1.0 if name.endswith(('weight', 'alpha')) and p.dim() <= 1 else 0.0))
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.3)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model.eval()


def randomize_bn_statistics(model: nn.Module, seed: int = 0, alpha: float = 0.5) -> nn.Module:
    """Random BatchNorm statistics and affines, and RepBN ``alpha`` set to ``alpha``, so folds
    are tested away from the identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.normal_(0, 0.3, generator=g)
                m.running_var.uniform_(0.5, 2.0, generator=g)
                m.weight.normal_(1, 0.2, generator=g)
                m.bias.normal_(0, 0.2, generator=g)
            if isinstance(getattr(m, 'alpha', None), nn.Parameter):
                m.alpha.fill_(alpha)
    return model


def explicit_shifted_window_attention(x, hw, window, shift, qkv, proj, table, num_heads):
    """Swin's shifted-window attention written out step by step (the paper's algorithm, as
    mmdet's ``ShiftWindowMSA`` computes it), for ``[B, H*W, C]`` tokens with ``H, W``
    multiples of ``window``: cyclic shift, window partition, per window
    ``softmax(q k^T * scale + relative position bias + shift mask) v``, merge, reverse shift.
    """
    b, n, c = x.shape
    h, w = hw
    d = c // num_heads
    grid = torch.roll(x.view(b, h, w, c), shifts=(-shift, -shift), dims=(1, 2))
    # Region id of every pixel of the shifted map: 3 x 3 regions the roll brought together.
    region = torch.zeros(h, w, dtype=torch.long)
    bounds = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for i, hs in enumerate(bounds):
        for j, ws in enumerate(bounds):
            region[hs, ws] = 3 * i + j
    out = torch.zeros_like(grid)
    for wy in range(0, h, window):
        for wx in range(0, w, window):
            coords = [(wy + i, wx + j) for i in range(window) for j in range(window)]
            tokens = torch.stack([grid[:, y, xx] for y, xx in coords], dim=1)  # [B, N, C]
            q, k, v = qkv(tokens).view(b, len(coords), 3, num_heads, d).permute(2, 0, 3, 1, 4)
            bias = torch.empty(num_heads, len(coords), len(coords), dtype=x.dtype)
            mask = torch.zeros(len(coords), len(coords), dtype=x.dtype)
            for p, (yp, xp) in enumerate(coords):
                for r, (yr, xr) in enumerate(coords):
                    dy, dx = yp - yr + window - 1, xp - xr + window - 1
                    bias[:, p, r] = table[dy * (2 * window - 1) + dx]
                    if shift and region[yp, xp] != region[yr, xr]:
                        mask[p, r] = -100.0
            logits = q @ k.transpose(-2, -1) * d ** -0.5 + bias + mask  # [B, heads, N, N]
            attended = (logits.softmax(-1) @ v).transpose(1, 2).reshape(b, len(coords), c)
            for t, (y, xx) in enumerate(coords):
                out[:, y, xx] = attended[:, t]
    out = torch.roll(out, shifts=(shift, shift), dims=(1, 2))
    return proj(out.reshape(b, n, c))


def load_script(rel_path: str):
    """Import a script of the repository (``'tools/test.py'``, ``'benchmarks/x.py'``) as a
    module, without running its ``__main__`` block: the scripts are not a package."""
    name = 'mmslab_script_' + osp.splitext(rel_path)[0].replace('/', '_')
    spec = importlib.util.spec_from_file_location(name, osp.join(REPO, rel_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_tool(name: str):
    """``tools/<name>.py`` as a module."""
    return load_script(f'tools/{name}.py')


def make_photo_coco(root: str, classes) -> str:
    """A COCO-format set of real photographs in ``root`` (``val2017/`` and
    ``annotations/instances_val2017.json``): matplotlib's sample photograph (512x600,
    portrait) and crops / transposes of it, landscape and panorama, with one annotation each
    (so mmdet's CocoDataset and CocoMetric accept them). Returns ``root``."""
    import json
    import os

    import cv2
    import matplotlib
    photo = cv2.imread(osp.join(matplotlib.get_data_path(), 'sample_data', 'grace_hopper.jpg'))
    if photo is None:
        raise FileNotFoundError("matplotlib's sample photograph grace_hopper.jpg is missing")
    images = {'portrait.jpg': photo,                                   # 600 x 512 (h x w)
              'landscape.jpg': np.ascontiguousarray(photo.transpose(1, 0, 2))[:380],  # 380 x 600
              'panorama.jpg': photo[200:330]}                          # 130 x 512
    os.makedirs(osp.join(root, 'val2017'), exist_ok=True)
    os.makedirs(osp.join(root, 'annotations'), exist_ok=True)
    coco = dict(images=[], annotations=[],
                categories=[dict(id=i + 1, name=c) for i, c in enumerate(classes)])
    for i, (name, image) in enumerate(images.items()):
        cv2.imwrite(osp.join(root, 'val2017', name), image)
        h, w = image.shape[:2]
        coco['images'].append(dict(id=i + 1, file_name=name, height=h, width=w))
        x, y, bw, bh = w // 4, h // 4, w // 2, h // 2
        coco['annotations'].append(dict(
            id=i + 1, image_id=i + 1, category_id=1, bbox=[x, y, bw, bh], area=bw * bh,
            iscrowd=0, segmentation=[[x, y, x + bw, y, x + bw, y + bh, x, y + bh]]))
    with open(osp.join(root, 'annotations', 'instances_val2017.json'), 'w') as f:
        json.dump(coco, f)
    return root


def wrong_fold(fold, stage: int, factor: float):
    """``fold`` (a ``reparameterize``) followed by a wrong weight: the fused ``proj`` of the
    first block of ``stage`` scaled by ``factor``, the fault the fusion checks must name."""
    def folded_wrong(model):
        model = fold(model)
        with torch.no_grad():
            model.backbone.stages[stage].blocks[0].attn.w_msa.proj.weight.mul_(factor)
        return model
    return folded_wrong
