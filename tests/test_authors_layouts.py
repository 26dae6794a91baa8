"""Converters against the authors' models written out here, independently of mmslab.

Each source model below is a transcription of the authors' module structure and forward pass
(official Swin, the SLAB authors' progressive norm, RepBN and simplified linear attention,
RePaViT's channel-idle MLP, official PVT v1 in its detection form, SLAB-PVT), with their
parameter and buffer names (see
docs/checkpoint_formats.md). Its own ``state_dict()`` is the source layout, so a key map or a
reshape that is wrong in the same way in both directions cannot pass: the converted weights
must make mmslab's backbone compute what the transcription computes.
"""
import math
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mmslab  # noqa: F401  (registers everything)
from conftest import explicit_shifted_window_attention, randomize_weights, rel_err
from mmslab.models import (PRepBNPVT, PRepBNSwin, RePaSwin, ReparamPVT, ReparamSwinTransformer,
                           SLABPVT, SLABSwin)
from mmslab.models.converters import convert, detect_format
from layouts import PVT, SWIN, load_converted


# ------------------------------------------------------------------------------------------
# Norms: LayerNorm, or the SLAB authors' RepBN and progressive LinearNorm
# ------------------------------------------------------------------------------------------
class AuthorsRepBN(nn.Module):
    """``BN(x) + alpha * x`` over ``[B, N, C]`` tokens, BN on the transposed tokens."""

    def __init__(self, channels):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1))
        self.bn = nn.BatchNorm1d(channels)

    def forward(self, x):
        x = x.transpose(1, 2)
        return (self.bn(x) + self.alpha * x).transpose(1, 2)


class AuthorsLinearNorm(nn.Module):
    """LayerNorm decaying into RepBN; counters ``warm``, ``iter`` (decay steps left) and
    ``total_step``. Eval mode is the RepBN half."""

    def __init__(self, dim, warm=0, step=300000, remaining=75000):
        super().__init__()
        self.register_buffer('warm', torch.tensor(warm))
        self.register_buffer('iter', torch.tensor(remaining))
        self.register_buffer('total_step', torch.tensor(step))
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = AuthorsRepBN(dim)

    def forward(self, x):
        assert not self.training, 'only the eval form is transcribed'
        return self.norm2(x)


class AuthorsSLA(nn.Module):
    """SLAB's simplified linear attention over ``[B, N, C]`` tokens of one square window (or
    map): ReLU kernel on ``q`` and on ``k`` + positional encoding, per head
    ``q (k^T v) / (q sum(k) + 1e-6)``, plus a depth-wise conv of ``v`` shared by the heads.
    Swin windows hold one ``qkv``; PVT splits it into ``q`` and ``kv``."""

    def __init__(self, dim, heads, tokens, split_qkv=False):
        super().__init__()
        self.heads = heads
        if split_qkv:
            self.q, self.kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)
        else:
            self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        d = dim // heads
        self.dwc = nn.Conv2d(d, d, 5, padding=2, groups=d)
        self.positional_encoding = nn.Parameter(torch.zeros(1, tokens, dim))

    def forward(self, x):
        b, n, c = x.shape
        h, d, s = self.heads, c // self.heads, math.isqrt(n)
        if hasattr(self, 'qkv'):
            q, k, v = self.qkv(x).reshape(b, n, 3, c).unbind(2)
        else:
            q = self.q(x)
            k, v = self.kv(x).reshape(b, n, 2, c).unbind(2)
        q, k = F.relu(q), F.relu(k + self.positional_encoding)
        q, k, v = (t.reshape(b, n, h, d).transpose(1, 2).reshape(b * h, n, d) for t in (q, k, v))
        z = 1 / (torch.einsum('bic,bc->bi', q, k.sum(dim=1)) + 1e-6)
        out = torch.einsum('bic,bcd,bi->bid', q, torch.einsum('bjc,bjd->bcd', k, v), z)
        out = out + self.dwc(v.transpose(1, 2).reshape(b * h, d, s, s)).flatten(2).transpose(1, 2)
        return self.proj(out.reshape(b, h, n, d).transpose(1, 2).reshape(b, n, c))


# ------------------------------------------------------------------------------------------
# Official Swin (with SLAB's norms and attention, or RePaViT's MLP)
# ------------------------------------------------------------------------------------------
class Mlp(nn.Module):

    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class ChannelIdleMlp(nn.Module):
    """RePaViT: ``fc2(BN2(act_k(fc1(BN1(x)))))``, the activation on the first
    ``ceil(hidden * (1 - idle_ratio))`` hidden channels only."""

    def __init__(self, dim, hidden, idle_ratio=0.75):
        super().__init__()
        self.norm1, self.fc1 = nn.BatchNorm1d(dim), nn.Linear(dim, hidden)
        self.norm2, self.fc2 = nn.BatchNorm1d(hidden), nn.Linear(hidden, dim)
        self.active = math.ceil(hidden * (1 - idle_ratio))

    def forward(self, x):
        h = self.fc1(self.norm1(x.transpose(1, 2)).transpose(1, 2))
        h = torch.cat([F.gelu(h[..., :self.active]), h[..., self.active:]], dim=-1)
        return self.fc2(self.norm2(h.transpose(1, 2)).transpose(1, 2))


class WindowAttention(nn.Module):

    def __init__(self, dim, window, heads):
        super().__init__()
        self.window, self.heads = window, heads
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * window - 1) ** 2, heads))
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window),
                                            indexing='ij')).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + window - 1
        self.register_buffer('relative_position_index', rel[..., 0] * (2 * window - 1) +
                             rel[..., 1])
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)


class SwinBlock(nn.Module):

    def __init__(self, dim, heads, window, shift, norm, channel_idle, attn_type='window'):
        super().__init__()
        self.shift, self.window = shift, window
        self.norm1 = norm(dim)
        if attn_type == 'sla':
            assert not shift, 'shifted SLA windows are not transcribed'
            self.attn = AuthorsSLA(dim, heads, window * window)
        else:
            self.attn = WindowAttention(dim, window, heads)
        if channel_idle:  # RePaViT: the MLP's BatchNorms replace the second norm
            self.mlp = ChannelIdleMlp(dim, 4 * dim)
        else:
            self.norm2 = norm(dim)
            self.mlp = Mlp(dim, 4 * dim)
        if shift:  # the official code keeps its shift mask as a (persistent) buffer
            self.register_buffer('attn_mask', torch.zeros(1))

    def forward(self, x, hw):
        a = self.attn
        if isinstance(a, AuthorsSLA):
            x = x + self._in_windows(a, self.norm1(x), hw)
        else:
            x = x + explicit_shifted_window_attention(
                self.norm1(x), hw, a.window, a.window // 2 if self.shift else 0, a.qkv, a.proj,
                a.relative_position_bias_table, a.heads)
        return x + self.mlp(self.norm2(x) if hasattr(self, 'norm2') else x)

    def _in_windows(self, attn, x, hw):
        """``attn`` on each (unshifted) ``window x window`` window of ``[B, H*W, C]``."""
        b, _, c = x.shape
        (h, w), s = hw, self.window
        windows = x.view(b, h // s, s, w // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, c)
        out = attn(windows).view(b, h // s, w // s, s, s, c).permute(0, 1, 3, 2, 4, 5)
        return out.reshape(b, h * w, c)


class PatchMerging(nn.Module):

    def __init__(self, dim, norm):
        super().__init__()
        self.norm = norm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x, hw):
        b, _, c = x.shape
        x = x.view(b, *hw, c)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]],
                      dim=-1)
        return self.reduction(self.norm(x.view(b, -1, 4 * c)))


class OfficialSwin(nn.Module):
    """``forward`` returns the stage features ``[B, H*W, C]`` before patch merging."""

    def __init__(self, dim, depths, heads, window, norm=nn.LayerNorm, channel_idle=False,
                 attn_types=('window', ) * 4):
        super().__init__()
        windows = window if isinstance(window, tuple) else (window, ) * len(depths)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, dim, 4, 4)
        self.patch_embed.norm = norm(dim)
        self.layers = nn.ModuleList()
        for i, depth in enumerate(depths):
            layer = nn.Module()
            layer.blocks = nn.ModuleList(
                SwinBlock(dim * 2 ** i, heads[i], windows[i], j % 2 == 1, norm, channel_idle,
                          attn_types[i]) for j in range(depth))
            if i < len(depths) - 1:
                layer.downsample = PatchMerging(dim * 2 ** i, norm)
            self.layers.append(layer)
        self.norm = norm(dim * 2 ** (len(depths) - 1))
        self.head = nn.Linear(dim * 2 ** (len(depths) - 1), 10)

    def forward(self, img):
        x = self.patch_embed.proj(img)
        hw = x.shape[-2:]
        x = self.patch_embed.norm(x.flatten(2).transpose(1, 2))
        feats = []
        for layer in self.layers:
            for block in layer.blocks:
                x = block(x, hw)
            feats.append(x)
            if hasattr(layer, 'downsample'):
                x = layer.downsample(x, hw)
                hw = (hw[0] // 2, hw[1] // 2)
        return feats


def assert_same_stage_features(ours, feats, img, tol=1e-4):
    with torch.no_grad():
        got = ours(img)
    assert len(got) == len(feats)
    for i, (g, f) in enumerate(zip(got, feats)):
        f = getattr(ours, f'norm{i}')(f)  # the dense-prediction output norm is mmslab's own
        f = f.transpose(1, 2).reshape(g.shape)
        assert rel_err(g, f) < tol, i


SWIN_ARGS = dict(dim=SWIN['embed_dims'], depths=SWIN['depths'], heads=SWIN['num_heads'],
                 window=4)


SLA_STAGES = dict(attn_types=('sla', 'sla', 'window', 'window'), window=(8, 4, 4, 4))


@pytest.mark.parametrize('fmt,src_args,cls', [
    ('swin', dict(), ReparamSwinTransformer),
    ('slab', dict(norm=AuthorsLinearNorm), PRepBNSwin),
    ('slab', dict(norm=AuthorsRepBN), partial(ReparamSwinTransformer,
                                              norm_cfg=dict(type='RepBN'))),
    ('slab', dict(norm=AuthorsLinearNorm, **SLA_STAGES), SLABSwin),
    ('repavit', dict(channel_idle=True), RePaSwin),
])
def test_swin_family_converts_to_the_same_features(fmt, src_args, cls):
    torch.manual_seed(0)
    src = randomize_weights(OfficialSwin(**{**SWIN_ARGS, **src_args}), seed=1)
    sd = src.state_dict()
    assert detect_format(sd) == fmt
    new, dropped = convert(sd, fmt)
    assert {'head.weight', 'head.bias'} <= set(dropped)
    assert 'layers.2.blocks.1.attn_mask' in dropped
    ours = load_converted(randomize_weights(cls(**SWIN, window_size=src_args.get('window', 4)),
                                            seed=2), new)
    img = torch.randn(2, 3, 128, 128)
    with torch.no_grad():
        feats = src(img)
    assert_same_stage_features(ours, feats, img)


# ------------------------------------------------------------------------------------------
# Official PVT v1, detection form (no class token in the forward pass)
# ------------------------------------------------------------------------------------------
class PVTAttention(nn.Module):

    def __init__(self, dim, heads, sr_ratio, norm):
        super().__init__()
        self.heads, self.sr_ratio = heads, sr_ratio
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        if sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, sr_ratio, sr_ratio)
            self.norm = norm(dim)

    def forward(self, x, hw):
        b, n, c = x.shape
        d = c // self.heads
        q = self.q(x).reshape(b, n, self.heads, d).permute(0, 2, 1, 3)
        if self.sr_ratio > 1:
            x = self.sr(x.permute(0, 2, 1).reshape(b, c, *hw)).reshape(b, c, -1).permute(0, 2, 1)
            x = self.norm(x)
        k, v = self.kv(x).reshape(b, -1, 2, self.heads, d).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) * d ** -0.5).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class PVTBlock(nn.Module):

    def __init__(self, dim, heads, sr_ratio, mlp_ratio, norm, tokens, attn_type='softmax'):
        super().__init__()
        self.norm1 = norm(dim)
        if attn_type == 'sla':  # global, no spatial reduction
            self.attn = AuthorsSLA(dim, heads, tokens, split_qkv=True)
        else:
            self.attn = PVTAttention(dim, heads, sr_ratio, norm)
        self.norm2 = norm(dim)
        self.mlp = Mlp(dim, dim * mlp_ratio)

    def forward(self, x, hw):
        x = x + (self.attn(self.norm1(x)) if isinstance(self.attn, AuthorsSLA) else
                 self.attn(self.norm1(x), hw))
        return x + self.mlp(self.norm2(x))


class OfficialPVT(nn.Module):
    """``forward`` returns the four NCHW stage maps. The official classification model
    (``cls_token``) keeps the class token's row first in stage 4's position embedding, which
    the detection forward skips; the SLAB authors' PVT has neither."""

    # One norm for all, as the SLAB authors' PVT (the official patch embeddings' LayerNorm has
    # eps 1e-5; mmdet's and mmslab's PVT use one norm config everywhere).
    def __init__(self, img_size, widths, depths, heads, patches, sr_ratios, mlp_ratios,
                 norm=partial(nn.LayerNorm, eps=1e-6), attn_types=('softmax', ) * 4,
                 cls_token=True):
        super().__init__()
        self.depths = depths
        grid = img_size
        for s in range(1, 5):
            grid //= patches[s - 1]
            embed = nn.Module()
            embed.proj = nn.Conv2d(3 if s == 1 else widths[s - 2], widths[s - 1],
                                   patches[s - 1], patches[s - 1])
            embed.norm = norm(widths[s - 1])
            setattr(self, f'patch_embed{s}', embed)
            tokens = grid * grid + (1 if s == 4 and cls_token else 0)
            setattr(self, f'pos_embed{s}', nn.Parameter(torch.zeros(1, tokens, widths[s - 1])))
            setattr(self, f'block{s}', nn.ModuleList(
                PVTBlock(widths[s - 1], heads[s - 1], sr_ratios[s - 1], mlp_ratios[s - 1], norm,
                         grid * grid, attn_types[s - 1]) for _ in range(depths[s - 1])))
        if cls_token:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, widths[3]))
            self.norm = norm(widths[3])
        self.head = nn.Linear(widths[3], 10)

    def forward(self, img):
        x, outs = img, []
        for s in range(1, 5):
            embed = getattr(self, f'patch_embed{s}')
            x = embed.proj(x)
            b, c, h, w = x.shape
            x = embed.norm(x.flatten(2).transpose(1, 2))
            pos = getattr(self, f'pos_embed{s}')
            x = x + (pos[:, 1:] if pos.shape[1] > h * w else pos)
            for block in getattr(self, f'block{s}'):
                x = block(x, (h, w))
            x = x.reshape(b, h, w, c).permute(0, 3, 1, 2)
            outs.append(x)
        return outs


PVT_ARGS = dict(img_size=PVT['pretrain_img_size'],
                widths=tuple(PVT['embed_dims'] * h for h in PVT['num_heads']),
                depths=PVT['num_layers'], heads=PVT['num_heads'], patches=(4, 2, 2, 2),
                sr_ratios=(8, 4, 2, 1), mlp_ratios=(8, 8, 4, 4))


@pytest.mark.parametrize('fmt,src_args,cls', [
    ('pvt', dict(), ReparamPVT),
    ('slab', dict(norm=AuthorsLinearNorm, cls_token=False), PRepBNPVT),
    ('slab', dict(norm=AuthorsLinearNorm, cls_token=False, attn_types=('sla', ) * 4), SLABPVT),
])
def test_pvt_family_converts_to_the_same_features(fmt, src_args, cls):
    torch.manual_seed(0)
    src = randomize_weights(OfficialPVT(**PVT_ARGS, **src_args), seed=1)
    sd = src.state_dict()
    assert detect_format(sd) == fmt
    new, dropped = convert(sd, fmt)
    assert {'head.weight', 'head.bias'} <= set(dropped)
    assert ('cls_token' in dropped) == src_args.get('cls_token', True)
    ours = load_converted(randomize_weights(cls(**PVT), seed=2), new)
    img = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        for i, (g, r) in enumerate(zip(ours(img), src(img))):
            assert g.shape == r.shape and rel_err(g, r) < 1e-4, i
    if fmt == 'slab':  # 75000 of 300000 decay steps left: three quarters done
        offsets = {float(m.schedule_offset) for m in ours.modules() if hasattr(m, 'cur_iter')}
        assert offsets == {0.75}
