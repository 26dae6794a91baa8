"""Adding an attention type: one class, one registration.

A kernel defined in this file (normalized linear attention with a learned temperature per
head, nothing of mmslab's own) goes through everything a built-in one does: training in a
Swin and a PVT backbone (every parameter gets a gradient), fusion, the ``deploy=True``
structure loading the fused weights, and export to onnxruntime and OpenVINO at several input
sizes, each checked against the unfused model.
"""
import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mmslab
from conftest import randomize_weights
from mmslab.engine.hooks import set_progressive_iter
from mmslab.models import ReparamPVT, ReparamSwinTransformer
from mmslab.models.layers import ShiftWindowAttention, WindowKernelBase
from mmslab.models.layers.shift_mask import ShiftMaskByType
from mmslab.registry import MODELS, register_model
from presets import PVT_TINY, SWIN_TINY

NAME = 'TestCosineAttention'


class CosineAttention(WindowKernelBase):
    """Per head ``t * (q^ k^T / N  * M) v`` with ``q^``, ``k^`` L2-normalized, ``t`` learned
    and ``M`` 1 between tokens the cyclic shift left neighbours (Swin's shift mask is 0
    there), 0 elsewhere."""

    uses_shift_mask = True

    def __init__(self, embed_dims, num_heads, window_size, qkv_bias=True, proj_drop=0.0,
                 deploy=False):
        super().__init__(embed_dims, num_heads, window_size, qkv_bias, proj_drop)
        self.temperature = nn.Parameter(torch.ones(num_heads, 1, 1))
        self.deploy = deploy

    def attend(self, qkv, window_hw, shift_mask=None, valid=None, origin=(0, 0)):
        q, k, v = qkv.split(self.embed_dims, dim=-1) if torch.is_tensor(qkv) else qkv
        b, n, c = q.shape  # [B*nW, N, C] each
        q, k, v = (t.reshape(b, n, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1) / n
        if shift_mask is not None:  # [nW, N, N], 0 between neighbours
            keep = (shift_mask.dense() == 0).to(attn.dtype).unsqueeze(1)
            attn = (attn.view(-1, keep.shape[0], self.num_heads, n, n) * keep).view(
                b, self.num_heads, n, n)
        out = self.temperature * attn @ v
        return out.transpose(1, 2).reshape(b, n, c)


@pytest.fixture(scope='module')
def kernel_name():
    register_model(NAME)(CosineAttention)
    yield NAME
    registries = [MODELS]
    for scope in ('mmdet', 'mmseg'):
        registries.append(__import__(f'{scope}.registry', fromlist=['MODELS']).MODELS)
    for registry in registries:
        registry._module_dict.pop(NAME, None)


def swin(name, **kwargs):
    return ReparamSwinTransformer(**SWIN_TINY, norm_cfg=dict(type='PRepBN', step=4),
                                  attn_types=(name, name, 'window', name), **kwargs)


def pvt(name, **kwargs):
    return ReparamPVT(**PVT_TINY, norm_cfg=dict(type='PRepBN', step=4),
                      attn_types=(name, 'softmax', name, name), **kwargs)


@pytest.mark.parametrize('build', [swin, pvt])
def test_a_kernel_defined_here_trains_fuses_deploys_and_exports(build, kernel_name, tmp_path):
    from mmslab.deploy.onnx_export import export_runtime_graphs
    from mmslab.deploy.runtimes import open_model
    torch.manual_seed(0)
    model = build(kernel_name)
    model.init_weights()
    kernels = [m for m in model.modules() if isinstance(m, CosineAttention)]
    assert len(kernels) >= 3
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model.train()
    for it in (1, 2, 3):  # the progressive norms in their decay (4 steps): both branches
        set_progressive_iter(model, it)
        optimizer.zero_grad()
        sum(o.square().mean() for o in model(torch.randn(2, 3, 64, 80))).backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        optimizer.step()
    assert all((k.temperature != 1).any() for k in kernels)  # trained
    set_progressive_iter(model, 4)
    randomize_weights(model.eval())
    sizes = [(64, 80), (75, 106), (48, 48)]  # (75 x 106: windows padded, PVT's grid resized)
    inputs = [torch.randn(1, 3, *s) for s in sizes]
    with torch.no_grad():
        refs = [[o.numpy() for o in model(x)] for x in inputs]
        mmslab.reparameterize(model)
        deployed = build(kernel_name, deploy=True).eval()
        deployed.load_state_dict(model.state_dict())
        for x, ref in zip(inputs, refs):
            for m in (model, deployed):
                for r, o in zip(ref, m(x)):
                    assert np.abs(o.numpy() - r).max() / np.abs(r).max() < 1e-5
    export_runtime_graphs(model, 'backbone', sizes[0], str(tmp_path),
                          ['onnxruntime', 'openvino'], dynamic=True)
    for runtime, path in (('onnxruntime', tmp_path / 'model.onnx'),
                          ('openvino', tmp_path / 'openvino' / 'model.xml')):
        session = open_model(str(path), runtime, threads=2)
        for x, ref in zip(inputs, refs):
            for r, o in zip(ref, session(x.numpy())):
                assert np.abs(o - r).max() / np.abs(r).max() < 1e-4, (runtime, x.shape)


def swin_region_mask(hp, wp, wh, ww, s):
    """``[hp // wh, wp // ww, N, N]`` additive masks of the shifted windows, Swin's way: the
    shifted padded map cut into regions by slices, tokens of different regions masked."""
    regions = torch.zeros(hp, wp)
    label = 0
    for rows in (slice(0, -wh), slice(-wh, -s), slice(-s, None)):
        for cols in (slice(0, -ww), slice(-ww, -s), slice(-s, None)):
            regions[rows, cols] = label
            label += 1
    windows = regions.view(hp // wh, wh, wp // ww, ww).permute(0, 2, 1, 3).reshape(
        hp // wh, wp // ww, wh * ww)
    return (windows[..., :, None] != windows[..., None, :]).float() * -1e4


def reference_shift_window(attn, x, hw):
    """mmdet-style shifted-window attention written as a loop: pad with zero tokens,
    ``torch.roll``, then the kernel on each window alone (padded tokens' q, k, v zero and
    marked invalid for kernels that mask padding; the window's own shift mask for those that
    use it), the windows put back, rolled back, cropped, ``proj``."""
    kernel = attn.w_msa
    (h, w), (wh, ww), s = hw, attn.window_size, attn.shift_size
    b, _, c = x.shape
    hp, wp = -(-h // wh) * wh, -(-w // ww) * ww
    tokens = F.pad(x.view(b, h, w, c), (0, 0, 0, wp - w, 0, hp - h))
    valid = F.pad(torch.ones(h, w, dtype=torch.bool), (0, wp - w, 0, hp - h))
    if s:
        tokens = torch.roll(tokens, (-s, -s), dims=(1, 2))
        valid = torch.roll(valid, (-s, -s), dims=(0, 1))
        masks = swin_region_mask(hp, wp, wh, ww, s)
    out = torch.zeros(b, hp, wp, c)
    for i in range(hp // wh):
        for j in range(wp // ww):
            rows, cols = slice(i * wh, (i + 1) * wh), slice(j * ww, (j + 1) * ww)
            qkv = kernel.qkv(tokens[:, rows, cols].reshape(b, wh * ww, c))
            window_valid = valid[rows, cols].reshape(1, -1)
            kwargs = {}
            if kernel.masks_padding:
                qkv = qkv * window_valid.view(1, -1, 1)
                kwargs['valid'] = window_valid
            if s and kernel.uses_shift_mask:
                kwargs['shift_mask'] = ShiftMaskByType(masks[i, j][None], torch.zeros(
                    1, dtype=torch.long))
            window = kernel.attend(qkv, (wh, ww), **kwargs)
            out[:, rows, cols] = window.view(b, wh, ww, c)
    if s:
        out = torch.roll(out, (s, s), dims=(1, 2))
    return kernel.proj(out[:, :h, :w].reshape(b, h * w, c))


@pytest.mark.parametrize('attn_type', ['window', 'sla', 'binorm', NAME])
def test_shifted_windows_match_a_loop_over_rolled_windows(attn_type, kernel_name):
    """Every code path of a shifted (and an unshifted) block, at a size that needs padding,
    against :func:`reference_shift_window`: the CPU's (cropped windows for kernels that mask
    padding, in chunks without gradients), the GPU's (padded windows) and the fused form."""
    torch.manual_seed(0)
    hw = (13, 18)  # windows of 4: padded to 16 x 20
    x = torch.randn(2, hw[0] * hw[1], 32)
    for shift in (True, False):
        attn = ShiftWindowAttention(32, 2, 4, shift=shift, attn_type=attn_type).eval()
        for p in attn.parameters():  # no parameter at its constructor value
            p.data.normal_(0, 0.5)
        with torch.no_grad():
            ref = reference_shift_window(attn, x, hw)
            outs = {'cpu, chunks': attn(x, hw)}
            with mmslab.run_code_path('cuda'):
                outs['gpu'] = attn(x, hw)
        outs['cpu, with gradients'] = attn(x, hw).detach()
        mmslab.reparameterize(attn)
        with torch.no_grad():
            outs['fused'] = attn(x, hw)
        for path, out in outs.items():
            err = (out - ref).abs().max() / ref.abs().max()
            assert err < 1e-5, (attn_type, shift, path, float(err))
        if shift and attn.w_msa.uses_shift_mask:  # the mask matters here: without it, off
            unmasked = copy.deepcopy(attn)
            unmasked.shift_size = 0
            with torch.no_grad():
                rolled = torch.roll(x.view(2, *hw, 32), (-2, -2), (1, 2)).reshape(x.shape)
                wrong = torch.roll(unmasked(rolled, hw).view(2, *hw, 32), (2, 2), (1, 2))
            assert (wrong.reshape(ref.shape) - ref).abs().max() / ref.abs().max() > 1e-2


class IgnoresTheMask(CosineAttention):
    def attend(self, qkv, window_hw, shift_mask=None, valid=None, origin=(0, 0)):
        return super().attend(qkv, window_hw, None, valid, origin)


class SaysNothing(CosineAttention):
    uses_shift_mask = None


@pytest.mark.parametrize('cls, match', [
    (IgnoresTheMask, 'ignores the shift mask'),
    (SaysNothing, r'uses_shift_mask is None.*True \(attend\(\) applies'),
])
def test_a_kernel_that_would_drop_the_shift_mask_fails_at_build_time(cls, match):
    with pytest.raises(ValueError, match=match):
        ShiftWindowAttention(16, 2, 4, shift=True, attn_type=cls)
    ShiftWindowAttention(16, 2, 4, shift=False, attn_type=cls)  # unshifted: nothing to drop


class InitializedCosine(CosineAttention):
    """A kernel with an initialization of its own."""

    def init_weights(self):
        nn.init.uniform_(self.temperature, 0.5, 1.5)


@pytest.mark.parametrize('backbone', ['swin', 'pvt'])
def test_every_kernel_is_initialized_its_own_way_in_every_backbone(backbone):
    """Each registered window kernel (and one defined here) placed in a Swin or a PVT stage:
    after ``init_weights`` every parameter of every kernel that defines an initialization
    differs from its constructor value."""
    kernels = [name for name, cls in MODELS.module_dict.items()
               if isinstance(cls, type) and issubclass(cls, WindowKernelBase)]
    assert {'WindowMSA', 'SLA', 'BiNormAttention'} <= set(kernels)
    checked = set()
    for kernel in [*kernels, InitializedCosine]:
        torch.manual_seed(0)
        if backbone == 'swin':
            model = ReparamSwinTransformer(**SWIN_TINY, attn_types=(kernel, ) * 4)
        else:
            model = ReparamPVT(**PVT_TINY, attn_types=(kernel, ) * 4)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        model.init_weights()
        for name, m in model.named_modules():
            if not isinstance(m, WindowKernelBase) or 'init_weights' not in vars(type(m)):
                continue
            for pname, p in m.named_parameters():
                key = f'{name}.{pname}'
                assert not torch.equal(p, before[key]), f'{key} kept its constructor value'
            checked.add(type(m).__name__)
    assert {'WindowMSA', 'SLA', 'InitializedCosine'} <= checked
