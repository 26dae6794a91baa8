"""Checkpoint converters: authors' SLAB / RePaViT files, official and timm Swin, official PVT v1.

Every author-layout state dict here is written by the helpers below, which rename a tiny mmslab
model's weights into the layouts described in docs/checkpoint_formats.md (independently of
mmslab.models.converters), so a conversion can be checked numerically against its source.
"""
import os
import pickle
import re
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F

import mmslab  # noqa: F401  (registers everything)
from conftest import randomize_weights, rel_err
from mmslab.engine.hooks import set_progressive_iter
from mmslab.models import PRepBNPVT, PRepBNSwin, RePaSwin, ReparamPVT, ReparamSwinTransformer, \
    SLABPVT, SLABSwin
from mmslab.models.checkpoint_utils import convert_checkpoint_file, load_pretrained_backbone
from mmslab.models.converters import FORMATS, convert, detect_format, \
    infer_backbone_cfg, resize_positional_encoding, resize_relative_position_bias_table
from mmslab.models.layers.repbn import PRepBN
from layouts import (PVT, SWIN, assert_same_outputs, load_converted, outputs, slab_swin,
                     to_authors_pvt, to_authors_swin)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prepbn_modules(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, PRepBN)
            and not re.match(r'norm\d+$', n)]


# ------------------------------------------------------------------------------------------
# Swin family
# ------------------------------------------------------------------------------------------
def timm_swin():
    from timm.models.swin_transformer import SwinTransformer
    torch.manual_seed(0)
    m = SwinTransformer(img_size=128, patch_size=4, embed_dim=16, depths=(1, 1, 2, 1),
                        num_heads=(1, 2, 2, 4), window_size=4, num_classes=10)
    return randomize_weights(m, seed=1)


def test_timm_swin_gives_the_same_stage_features():
    src = timm_swin()
    sd = src.state_dict()
    assert detect_format(sd) == 'timm'
    new, dropped = convert(sd, 'timm')
    assert set(dropped) == {'norm.weight', 'norm.bias', 'head.fc.weight', 'head.fc.bias'}
    ours = load_converted(randomize_weights(ReparamSwinTransformer(**SWIN, window_size=4), seed=2),
                          new)
    x = torch.randn(1, 3, 128, 128)
    with torch.no_grad():
        ref = src.forward_intermediates(x, norm=False, intermediates_only=True)  # NCHW, pre-norm
        got = ours(x)
    for i, (r, g) in enumerate(zip(ref, got)):
        norm = getattr(ours, f'norm{i}')
        r = F.layer_norm(r.permute(0, 2, 3, 1), r.shape[1:2], norm.weight, norm.bias,
                         norm.eps).permute(0, 3, 1, 2)
        assert g.shape == r.shape
        assert rel_err(g, r) < 1e-4, i


def test_official_swin_matches_timm_and_mmdet_converter():
    from mmdet.models.backbones.swin import swin_converter
    sd = timm_swin().state_dict()
    official = OrderedDict()
    for k, v in sd.items():  # official: merging at the end of stage i-1, plain 'head'
        k = re.sub(r'^layers\.(\d+)\.downsample',
                   lambda m: f'layers.{int(m.group(1)) - 1}.downsample', k)
        official[k.replace('head.fc.', 'head.')] = v
    official['layers.2.blocks.1.attn_mask'] = torch.zeros(4, 16, 16)  # persistent upstream
    official['layers.0.blocks.0.attn.relative_position_index'] = torch.zeros(16, 16).long()
    assert detect_format(official) == 'swin'
    from_official, dropped = convert(official, 'swin')
    from_timm, _ = convert(sd, 'timm')
    assert 'layers.2.blocks.1.attn_mask' in dropped and 'head.weight' in dropped
    assert from_official.keys() == from_timm.keys()
    for k in from_timm:
        assert torch.equal(from_official[k], from_timm[k]), k
    mmdet = {k[len('backbone.'):]: v for k, v in swin_converter(official).items()}
    for k, v in from_official.items():
        assert torch.equal(mmdet[k], v), k


def test_slab_swin_progressive_norms_convert_to_the_same_eval_output():
    src = slab_swin()
    authors = to_authors_swin(src.state_dict(), schedule=(15000, 60000, 0))
    assert detect_format(authors) == 'slab'
    assert 'layers.0.blocks.0.attn.dwc.weight' in authors
    assert 'layers.0.downsample.norm.norm2.alpha' in authors
    new, dropped = convert(authors, 'slab')
    assert {'head.weight', 'head.bias', 'norm.iter', 'norm.norm1.weight'} <= set(dropped)
    dst = load_converted(slab_swin(seed=5), new, source=src)
    x = torch.randn(1, 3, 64, 64)
    assert_same_outputs(outputs(dst, x), outputs(src, x))
    norms = prepbn_modules(dst)
    assert norms and all(float(m.schedule_offset) == pytest.approx(0.75) and
                         int(m.cur_iter) == 0 for _, m in norms)


def test_slab_swin_pure_repbn_loads_into_repbn_and_into_prepbn_as_finished():
    src = slab_swin(norm_cfg=dict(type='RepBN'))
    authors = to_authors_swin(src.state_dict())
    assert 'layers.0.blocks.0.norm1.alpha' in authors
    assert detect_format(authors) == 'slab'
    x = torch.randn(2, 3, 64, 64)
    ref = outputs(src, x)

    as_repbn, _ = convert(authors, 'slab')
    dst = load_converted(slab_swin(norm_cfg=dict(type='RepBN'), seed=3), as_repbn, source=src)
    assert_same_outputs(outputs(dst, x), ref)

    as_prepbn, _ = convert(authors, 'slab', arch='slab_swin_t')
    prep = slab_swin(seed=4)
    load_converted(prep, as_prepbn)
    for name, m in prepbn_modules(prep):
        assert float(m.schedule_offset) == 1.0
        assert torch.equal(m.norm1.weight, torch.ones_like(m.norm1.weight))
        assert torch.equal(m.norm1.bias, torch.zeros_like(m.norm1.bias))
    with torch.no_grad():  # same output norms, so the same features as the RepBN model
        for i in range(4):
            getattr(prep, f'norm{i}').norm2.load_state_dict(
                getattr(src, f'norm{i}').state_dict())
    assert_same_outputs(outputs(prep, x), ref)
    prep.train()
    set_progressive_iter(prep, 0)
    assert all(m.ratio == 0.0 for _, m in prepbn_modules(prep))


@pytest.mark.parametrize('reset', [False, True])
def test_finished_authors_schedule_stays_finished_unless_reset(reset):
    src = slab_swin(cls=PRepBNSwin, window_size=4)
    authors = to_authors_swin(src.state_dict(), schedule=(0, 60000, 0))
    new, _ = convert(authors, 'slab', reset_schedule=reset)
    dst = load_converted(slab_swin(cls=PRepBNSwin, window_size=4, seed=7), new)
    dst.train()
    set_progressive_iter(dst, 0)
    ratios = {m.ratio for _, m in prepbn_modules(dst)}
    assert ratios == ({1.0} if reset else {0.0})
    set_progressive_iter(dst, 100)
    assert all(m.ratio == (1.0 - 100 / m.step if reset else 0.0)
               for _, m in prepbn_modules(dst))
    y = dst(torch.randn(2, 3, 64, 64))  # a training step runs with the converted state
    assert all(torch.isfinite(t).all() for t in y)


def test_repavit_layout_gives_the_same_outputs():
    src = randomize_weights(RePaSwin(**SWIN, window_size=4), seed=3)
    authors = to_authors_swin(src.state_dict())
    assert 'layers.0.blocks.0.mlp.norm1.running_var' in authors
    assert 'layers.0.blocks.0.mlp.fc2.weight' in authors
    assert detect_format(authors) == 'repavit'
    new, _ = convert(authors, 'repavit')
    dst = load_converted(randomize_weights(RePaSwin(**SWIN, window_size=4), seed=9), new,
                         source=src)
    x = torch.randn(2, 3, 64, 64)
    assert_same_outputs(outputs(dst, x), outputs(src, x))


# ------------------------------------------------------------------------------------------
# PVT family
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize('cls,kwargs', [
    (PRepBNPVT, {}),
    (SLABPVT, dict(attn_types=('sla', 'sla', 'softmax', 'softmax'))),
])
def test_slab_pvt_layouts_give_the_same_outputs(cls, kwargs):
    src = randomize_weights(cls(**PVT, **kwargs), seed=1)
    authors = to_authors_pvt(src.state_dict(), schedule=(300000, 300000, 5))
    assert detect_format(authors) == 'slab'
    new, _ = convert(authors, 'slab')
    dst = load_converted(randomize_weights(cls(**PVT, **kwargs), seed=2), new)
    x = torch.randn(2, 3, 64, 64)
    assert_same_outputs(outputs(dst, x), outputs(src, x))
    assert all(float(m.schedule_offset) == 0.0 for _, m in prepbn_modules(dst))
    cfg = infer_backbone_cfg(new)
    assert cfg['type'] == cls.__name__
    assert cfg['num_layers'] == PVT['num_layers'] and cfg['num_heads'] == PVT['num_heads']


def test_official_pvt_gives_the_same_outputs():
    src = randomize_weights(ReparamPVT(**PVT), seed=4)
    official = to_authors_pvt(src.state_dict(), official=True)
    assert detect_format(official) == 'pvt'
    new, dropped = convert(official, 'pvt')
    assert set(dropped) == {'cls_token', 'norm.weight', 'norm.bias', 'head.weight', 'head.bias'}
    dst = load_converted(randomize_weights(ReparamPVT(**PVT), seed=5), new)
    x = torch.randn(1, 3, 64, 64)
    assert_same_outputs(outputs(dst, x), outputs(src, x))


# ------------------------------------------------------------------------------------------
# Detection, resizing, loading
# ------------------------------------------------------------------------------------------
def test_detection_of_every_format_and_refusal_of_unknown_layouts():
    swin = ReparamSwinTransformer(**SWIN, window_size=4)
    assert detect_format(swin.state_dict()) == 'mmslab'
    assert detect_format({'backbone.' + k: v for k, v in swin.state_dict().items()}) == 'mmslab'
    assert detect_format(ReparamPVT(**PVT).state_dict()) == 'mmslab'
    assert detect_format(to_authors_swin(swin.state_dict())) == 'swin'
    with pytest.raises(ValueError) as err:
        detect_format({'features.0.weight': torch.zeros(3), 'classifier.bias': torch.zeros(2)})
    for fmt in FORMATS:
        assert fmt in str(err.value)
    with pytest.raises(ValueError, match='known formats'):
        convert({'a': torch.zeros(1)}, 'caffe')


def test_resizing_helpers():
    table = torch.randn(13 * 13, 3)
    assert resize_relative_position_bias_table(table, 7) is table
    assert resize_relative_position_bias_table(table, 12).shape == (23 * 23, 3)
    assert resize_relative_position_bias_table(table, (4, 6)).shape == (7 * 11, 3)
    const = torch.full((1, 49, 5), 2.0)
    out = resize_positional_encoding(const, 12)
    assert out.shape == (1, 144, 5) and torch.allclose(out, torch.full_like(out, 2.0))


def test_window7_checkpoint_loads_into_window12_backbone(tmp_path):
    src = slab_swin(window_size=7)
    path = str(tmp_path / 'slab_w7.pth')
    torch.save({'model': to_authors_swin(src.state_dict())}, path)
    dst = SLABSwin(**SWIN, window_size=12)
    info = load_pretrained_backbone(dst, path)
    assert info['format'] == 'slab'
    assert any(k.endswith('positional_encoding') for k in info['resized'])
    assert any(k.endswith('relative_position_bias_table') for k in info['resized'])
    assert not info['unexpected'] and not info['shape_mismatch']
    assert all(re.match(r'norm\d+\.', k) for k in info['missing'])
    table = dst.stages[2].blocks[0].attn.w_msa.relative_position_bias_table
    assert table.shape == (23 * 23, 2)
    y = outputs(dst.eval(), torch.randn(1, 3, 64, 64))
    assert all(torch.isfinite(t).all() for t in y)


def test_loading_the_wrong_architecture_is_an_error(tmp_path):
    path = str(tmp_path / 'pvt.pth')
    torch.save({'model': to_authors_pvt(PRepBNPVT(**PVT).state_dict())}, path)
    with pytest.raises(ValueError, match='wrong architecture'):
        load_pretrained_backbone(SLABSwin(**SWIN, window_size=4), path)
    info = load_pretrained_backbone(PRepBNPVT(**PVT), path)  # the right one loads fully
    assert info['format'] == 'slab' and not info['missing'] and not info['unexpected']


class _Evil:
    def __reduce__(self):
        return (print, ('unpickled!', ))


def test_a_pickled_object_is_ignored_not_executed(tmp_path, capsys):
    # (tests/test_foreign_checkpoints.py covers foreign objects in depth)
    path = str(tmp_path / 'evil.pth')
    sd = to_authors_swin(slab_swin(cls=PRepBNSwin, window_size=4).state_dict())
    torch.save({'model': sd, 'config': _Evil()}, path)
    with pytest.raises(pickle.UnpicklingError):  # torch alone refuses it
        torch.load(path, map_location='cpu', weights_only=True)
    meta = convert_checkpoint_file(path, str(tmp_path / 'out.pth'), log=None)
    assert meta['source_format'] == 'slab' and os.path.exists(tmp_path / 'out.pth')
    assert 'unpickled!' not in capsys.readouterr().out


@pytest.mark.slow  # tools/convert_checkpoint.py in a subprocess
def test_convert_tool_end_to_end(tmp_path):
    src = slab_swin()
    authors = to_authors_swin(src.state_dict(), schedule=(0, 60000, 0))
    path, out = str(tmp_path / 'slab.pth'), str(tmp_path / 'mmslab.pth')
    torch.save({'model': authors, 'epoch': 300}, path)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'tools', 'convert_checkpoint.py'),
                           path, out], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert 'dropped' in proc.stdout and 'schedule_offset 1.0000' in proc.stdout
    ckpt = torch.load(out, map_location='cpu', weights_only=True)
    meta = ckpt['meta']
    assert meta['source_format'] == 'slab' and 'head.weight' in meta['dropped_keys']
    assert meta['backbone_cfg']['type'] == 'SLABSwin'
    assert meta['backbone_cfg']['window_size'] == (8, 4, 4, 4)
    dst = SLABSwin(**SWIN, window_size=(8, 4, 4, 4))
    info = load_pretrained_backbone(dst, out)
    assert info['format'] == 'mmslab' and not info['missing'] and not info['unexpected']
    assert all(float(m.schedule_offset) == 1.0 for _, m in prepbn_modules(dst))  # finished
    for i in range(4):  # same output norms, then the same features
        getattr(dst, f'norm{i}').load_state_dict(getattr(src, f'norm{i}').state_dict())
    x = torch.randn(1, 3, 64, 64)
    assert_same_outputs(outputs(dst.eval(), x), outputs(src, x))
    via_cfg = SLABSwin(**SWIN, window_size=(8, 4, 4, 4), pretrained=out)
    via_cfg.init_weights()  # init_cfg Pretrained goes through load_pretrained_backbone
    for k, v in via_cfg.state_dict().items():
        if not re.match(r'norm\d+\.', k):
            assert torch.equal(v, dst.state_dict()[k]), k
    # --arch checks the geometry: this tiny model is no Swin-T
    with pytest.raises(ValueError, match='does not match --arch slab_swin_t'):
        convert_checkpoint_file(path, out, arch='slab_swin_t', log=None)
