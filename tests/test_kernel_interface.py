"""Adding an attention type: one class, one registration.

A kernel defined in this file (normalized linear attention with a learned temperature per
head, nothing of mmslab's own) goes through everything a built-in one does: training in a
Swin and a PVT backbone (every parameter gets a gradient), fusion, the ``deploy=True``
structure loading the fused weights, and export to onnxruntime and OpenVINO at several input
sizes, each checked against the unfused model.
"""
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mmslab
from conftest import randomize_weights
from mmslab.engine.hooks import set_progressive_iter
from mmslab.models import ReparamPVT, ReparamSwinTransformer
from mmslab.models.layers import WindowKernelBase
from mmslab.registry import MODELS, register_model
from presets import PVT_TINY, SWIN_TINY

NAME = 'TestCosineAttention'


class CosineAttention(WindowKernelBase):
    """Per head ``t * q^ (k^T v) / N`` with ``q^``, ``k^`` L2-normalized and ``t`` learned."""

    def __init__(self, embed_dims, num_heads, window_size, qkv_bias=True, proj_drop=0.0,
                 deploy=False):
        super().__init__(embed_dims, num_heads, window_size, qkv_bias, proj_drop)
        self.temperature = nn.Parameter(torch.ones(num_heads, 1, 1))
        self.deploy = deploy

    def attend(self, qkv, window_hw, shift_mask=None, valid=None, origin=(0, 0)):
        q, k, v = qkv.split(self.embed_dims, dim=-1) if torch.is_tensor(qkv) else qkv
        b, n, c = q.shape
        q, k, v = (t.reshape(b, n, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        kv = F.normalize(k, dim=-1).transpose(-2, -1) @ v / n
        out = self.temperature * (F.normalize(q, dim=-1) @ kv)
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
