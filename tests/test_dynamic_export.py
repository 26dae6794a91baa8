"""Dynamic-size export: one graph, traced at one size, run at others.

Each exported graph is compared with an independent eager model at sizes other than the
traced one: mmslab's backbones against the *unfused* PyTorch model (training-form paths:
cached layouts, index_put padding, unfold-ordered merging), mmdet's / mmseg's Swin against
their own unpatched eager forward. Sizes cover portrait and landscape inputs, padded
windows, odd patch merges, maps smaller than a window (SLA's cropped window) and a wide
ADE20K-like aspect ratio.
"""
import numpy as np
import onnxruntime as ort
import pytest
import torch

import mmslab
from conftest import randomize_weights
from mmslab.deploy import export_onnx
from mmslab.deploy.rewriters import rewritten
from test_pvt_backbones import TINY as PVT_TINY
from test_swin_backbones import PRESETS, build_preset

TRACE = (75, 106)
SIZES = [(75, 106), (106, 75), (33, 130), (32, 32), (64, 256)]


def run_onnx(path, x):
    sess = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
    return sess.run(None, {'image': x.numpy()})


def assert_close(ref, outs, tol=1e-4):
    assert [o.shape for o in outs] == [r.shape for r in ref]
    for r, o in zip(ref, outs):
        assert np.abs(o - r).max() / np.abs(r).max() <= tol


def build_pvt(type_):
    from mmseg.registry import MODELS
    return MODELS.build(dict(type=type_, **PVT_TINY, norm_cfg=dict(type='PRepBN', step=4)))


def slow_unless(fast, *cases):
    """The cases as parameters, each not in ``fast`` marked slow (the fast lane keeps one
    Swin per layout and a PVT)."""
    return [case if case in fast else pytest.param(*case, marks=pytest.mark.slow)
            for case in cases]


@pytest.mark.parametrize('name,attention', slow_unless(
    [('RePaSwin', 'split'), ('PRepBNSwin', 'packed'), ('PRepBNPVT', 'split')],
    *[(n, 'split') for n in PRESETS], ('PRepBNSwin', 'packed'), ('RePaSwin', 'packed'),
    ('SLABSwin', 'packed'), ('PRepBNPVT', 'split'), ('SLABPVT', 'split')))
def test_dynamic_backbone_graph_matches_unfused_model_at_every_size(name, attention,
                                                                    tmp_path):
    torch.manual_seed(0)
    model = build_pvt(name) if name.endswith('PVT') else build_preset(name)
    model.init_weights()
    randomize_weights(model)  # biases too: padded slots carry qkv's bias
    inputs = [torch.randn(1, 3, *s) for s in SIZES]
    with torch.no_grad():
        refs = [[o.numpy() for o in model(x)] for x in inputs]
    mmslab.reparameterize(model)
    path = str(tmp_path / 'backbone.onnx')
    export_onnx(model, 'backbone', TRACE, path, dynamic=True, attention=attention)
    for x, ref in zip(inputs, refs):
        assert_close(ref, run_onnx(path, x))


def test_dynamic_sla_graph_in_openvino_compiled_for_each_size(tmp_path):
    """SLAB-Swin's free-size graph (windows cropped into runtime-sized groups) in OpenVINO,
    compiled for each input shape as deployment runs it: the unfused model's outputs at
    every size, where shape-fixed compiles see the group sizes as constants."""
    pytest.importorskip('openvino')
    from mmslab.deploy.runtimes import convert_to_openvino, open_model
    torch.manual_seed(0)
    model = randomize_weights(build_preset('SLABSwin'))
    inputs = [torch.randn(1, 3, *s) for s in SIZES + [(16, 24)]]
    with torch.no_grad():
        refs = [[o.numpy() for o in model(x)] for x in inputs]
    mmslab.reparameterize(model)
    path = str(tmp_path / 'backbone.onnx')
    export_onnx(model, 'backbone', TRACE, path, dynamic=True, runtime='openvino')
    ov_model = open_model(convert_to_openvino(path, str(tmp_path / 'openvino')), 'openvino')
    for x, ref in zip(inputs, refs):
        assert_close(ref, ov_model(x.numpy()), 1e-4)
    assert ov_model.compiles == len(set(SIZES + [(16, 24)]))


def mmdet_swin():
    from mmdet.models.backbones import SwinTransformer
    return SwinTransformer(embed_dims=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4),
                           window_size=4, out_indices=(0, 1, 2, 3))


@pytest.mark.parametrize('attention', ['split', pytest.param('packed', marks=pytest.mark.slow)])
def test_mmdet_swin_dynamic_forward_equals_mmdet(attention, tmp_path):
    """mmdet's own Swin: the shape-generic rewrites give mmdet's numbers in eager mode, and
    the dynamic graph gives them at every size."""
    torch.manual_seed(0)
    model = mmdet_swin()
    randomize_weights(model)  # (mmdet's Swin.train() returns None: no chaining)
    inputs = [torch.randn(1, 3, *s) for s in SIZES]
    with torch.no_grad():
        refs = [[o.numpy() for o in model(x)] for x in inputs]
        with rewritten(model, 'onnxruntime'):
            assert_close(refs[0], [o.numpy() for o in model(inputs[0])], 1e-5)
    path = str(tmp_path / 'mmdet_swin.onnx')
    export_onnx(model, 'backbone', TRACE, path, dynamic=True, attention=attention)
    for x, ref in zip(inputs, refs):
        assert_close(ref, run_onnx(path, x))


def graph_float_constants(path):
    import onnx
    from onnx import numpy_helper
    graph = onnx.load(path).graph
    arrays = [numpy_helper.to_array(t) for t in graph.initializer]
    arrays += [numpy_helper.to_array(a.t) for n in graph.node if n.op_type == 'Constant'
               for a in n.attribute if a.name == 'value']
    return [a for a in arrays if a.dtype == np.float32]


def test_mmdet_swin_static_export_has_the_denormal_free_shift_mask(tmp_path):
    """A fixed-size export of mmdet's Swin takes mmslab's shift mask too: no -100 fill
    (denormal softmax probabilities, slow in onnxruntime), mmdet's numbers all the same."""
    from mmslab.models.layers.shift_mask import SHIFT_MASK_FILL
    torch.manual_seed(0)
    model = mmdet_swin()
    randomize_weights(model)
    x = torch.randn(1, 3, *TRACE)  # padded and shifted windows in every stage
    with torch.no_grad():
        ref = [o.numpy() for o in model(x)]
    path = str(tmp_path / 'mmdet_swin_static.onnx')
    export_onnx(model, 'backbone', TRACE, path, dynamic=False)
    assert_close(ref, run_onnx(path, x))
    constants = graph_float_constants(path)
    assert not any((a == -100).any() for a in constants)
    assert any((a == SHIFT_MASK_FILL).any() for a in constants)


@pytest.mark.slow
def test_dynamic_upernet_logits_and_argmax(tmp_path):
    """A whole segmentor (pyramid pooling bins computed from the runtime size) at square and
    wide inputs; the argmax variant gives PyTorch's label map at the input size."""
    from mmseg.registry import MODELS
    from mmengine.registry import init_default_scope
    init_default_scope('mmseg')
    model = MODELS.build(dict(
        type='EncoderDecoder',
        data_preprocessor=dict(type='SegDataPreProcessor'),
        backbone=dict(type='PRepBNSwin', embed_dims=16, depths=(1, 1, 1, 1),
                      num_heads=(1, 2, 2, 4), window_size=4, norm_cfg=dict(type='PRepBN', step=4)),
        decode_head=dict(type='UPerHead', in_channels=[16, 32, 64, 128], in_index=[0, 1, 2, 3],
                         pool_scales=(1, 2, 3, 6), channels=16, num_classes=5,
                         norm_cfg=dict(type='BN'), align_corners=False,
                         loss_decode=dict(type='CrossEntropyLoss')),
        test_cfg=dict(mode='whole')))
    torch.manual_seed(0)
    randomize_weights(model)
    inputs = [torch.randn(1, 3, *s) for s in [(64, 64), (96, 384), (160, 96)]]
    with torch.no_grad():
        refs = [model._forward(x).numpy() for x in inputs]
    mmslab.reparameterize(model)
    logits = str(tmp_path / 'logits.onnx')
    labels = str(tmp_path / 'labels.onnx')
    export_onnx(model, 'model', (64, 64), logits, dynamic=True)
    export_onnx(model, 'model', (64, 64), labels, dynamic=True, seg_argmax=True)
    for x, ref in zip(inputs, refs):
        assert_close([ref], run_onnx(logits, x))
        full = torch.nn.functional.interpolate(torch.from_numpy(ref), size=x.shape[-2:],
                                               mode='bilinear', align_corners=False)
        label = run_onnx(labels, x)[0]
        assert label.shape == (1, *x.shape[-2:])
        assert (label == full.argmax(1).numpy()).mean() >= 0.999


def test_rewrites_bind_to_the_instances_and_are_undone():
    """Inside ``rewritten`` the model's modules run their runtime's rewrite (mmdet's shifted
    windows here, bound to each instance: the class and other models keep their forward);
    after it, normally or by an exception, every module runs its own forward again, an
    attribute the instance had of its own restored."""
    from mmdet.models.backbones.swin import ShiftWindowMSA
    from mmslab.deploy.mmdet_swin import _shift_window_msa_forward
    model, other = mmdet_swin(), mmdet_swin()
    blocks = [m for m in model.modules() if isinstance(m, ShiftWindowMSA)]
    own = lambda *a: 'own'  # noqa: E731
    blocks[0].forward = own

    def assert_restored():
        assert blocks[0].forward is own
        assert all('forward' not in vars(m) for m in blocks[1:])
        assert ShiftWindowMSA.forward is not _shift_window_msa_forward

    with rewritten(model, 'openvino') as count:
        assert count >= len(blocks)
        assert all(m.forward.__func__ is _shift_window_msa_forward for m in blocks)
        assert all('forward' not in vars(m) for m in other.modules())
    assert_restored()
    with pytest.raises(ZeroDivisionError):
        with rewritten(model, 'onnxruntime'):
            1 / 0
    assert_restored()
    with pytest.raises(ValueError, match="valid: \\('onnxruntime', 'openvino'\\)"):
        with rewritten(model, 'tensorrt'):
            pass
