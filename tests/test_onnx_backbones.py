"""The exported graph of each fused backbone against the *unfused* PyTorch model.

Export takes its own code paths (padded window slots from an appended row and one gather,
offset-major patch merging against permuted weights, matmul softmax); the unfused model
takes the training-form paths (gather, qkv, index_put; unfold-ordered merging; norms
applied). Shapes with padded windows, odd merges and a map smaller than a window.
"""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import mmslab
from conftest import randomize_weights
from mmslab.deploy import export_onnx
from mmslab.deploy.onnx_export import make_exportable
from mmslab.deploy.quantize import weight_layers
from mmslab.deploy.onnx_export import attention_layout_report
from presets import PRESETS, PVT_TINY, build_preset


def build_pvt(type_):
    from mmseg.registry import MODELS
    return MODELS.build(dict(type=type_, **PVT_TINY, norm_cfg=dict(type='PRepBN', step=4)))


CASES = [(name, (75, 106)) for name in PRESETS]  # 19x27 tokens: padded windows, odd merges
CASES += [('PRepBNPVT', (80, 112)), ('SLABPVT', (80, 112))]  # SLA's resized encoding
# the longest exports, whose layers the other presets also have: not in the fast lane
CASES = [pytest.param(*c, marks=pytest.mark.slow)
         if c[0] in ('UNSwin', 'RePaSwinPRepBN', 'BiNormSwin') else c for c in CASES]


def scalar_onto_unit_last_axis(path: str) -> list:
    """Element-wise nodes of the graph at ``path`` that broadcast a scalar onto a tensor whose
    last axis is 1, which onnxruntime does one element at a time (an ``Add`` of ``eps`` onto
    ``[4, 3136, 3, 1]`` took 40x as long as onto ``[4, 3136, 3]``)."""
    model = onnx.shape_inference.infer_shapes(onnx.load(path))
    graph = model.graph
    shapes = {v.name: [d.dim_value if d.HasField('dim_value') else None
                       for d in v.type.tensor_type.shape.dim]
              for v in list(graph.value_info) + list(graph.input) + list(graph.output)}
    shapes.update({i.name: list(i.dims) for i in graph.initializer})
    for node in graph.node:
        if node.op_type == 'Constant':
            value = next(a.t for a in node.attribute if a.name == 'value')
            shapes[node.output[0]] = list(value.dims)
    slow = []
    for node in graph.node:
        if node.op_type not in ('Add', 'Sub', 'Mul', 'Div', 'Max', 'Min'):
            continue
        ins = [shapes.get(name) for name in node.input]
        if any(s is None for s in ins):
            continue
        scalar = any(all(d == 1 for d in s) for s in ins)  # (0-d included)
        if scalar and any(len(s) > 1 and s[-1] == 1 and any(d != 1 for d in s) for s in ins):
            slow.append(node.name)  # (an unknown dim counts as more than 1)
    return slow


@pytest.mark.parametrize('name,shape', CASES)
def test_fused_onnx_backbone_matches_unfused_model(name, shape, tmp_path):
    torch.manual_seed(0)
    model = build_pvt(name) if name.endswith('PVT') else build_preset(name)
    model.init_weights()
    randomize_weights(model)  # biases too: padded slots carry qkv's bias
    x = torch.randn(1, 3, *shape)
    with torch.no_grad():
        ref = [o.numpy() for o in model(x)]
    mmslab.reparameterize(model)
    path = str(tmp_path / 'backbone.onnx')
    export_onnx(model, 'backbone', shape, path)
    sess = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
    outs = sess.run(None, {'image': x.numpy()})
    assert [o.shape for o in outs] == [r.shape for r in ref]
    for r, o in zip(ref, outs):
        assert np.abs(o - r).max() / np.abs(r).max() <= 1e-4
    # Every layer weight is an initializer: INT8 quantizers take only those as weights (a
    # Constant-node weight left patch merging in fp32).
    graph = onnx.load(path).graph
    constants = {o for n in graph.node if n.op_type == 'Constant' for o in n.output}
    layers = [n for n in graph.node if n.op_type in ('MatMul', 'Gemm', 'Conv')]
    assert not [n.name for n in layers if n.input[1] in constants]
    # (the default 'split' form writes each window softmax block's qkv as three MatMuls;
    # the kernels that mask padding run theirs once per group of windows, on one
    # initializer)
    assert not scalar_onto_unit_last_axis(path)
    split_blocks = attention_layout_report(model, 'split')['split']
    layer_names = set(weight_layers(path))
    weights = {n.input[1] for n in graph.node if n.name in layer_names}
    assert len(weights) == 2 * split_blocks + sum(
        isinstance(m, torch.nn.Linear) or (isinstance(m, torch.nn.Conv2d) and m.groups == 1)
        for m in model.modules())


@pytest.mark.parametrize('size,out', [((16, 16), 3), ((16, 16), 6), ((25, 42), (6, 4)),
                                      ((7, 9), (None, 2))])
def test_adaptive_pooling_exports_for_any_bins(size, out, tmp_path):
    """UperNet's pyramid pooling at 512x512 asks for 3x3 / 6x6 bins of a 16x16 map, which
    PyTorch's exporter refuses; the exported form must give PyTorch's bins."""
    model = make_exportable(torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(out))).eval()
    x = torch.randn(2, 4, *size)
    ref = torch.nn.functional.adaptive_avg_pool2d(x, out).numpy()
    path = str(tmp_path / 'pool.onnx')
    torch.onnx.export(model, (x, ), path, input_names=['x'], dynamo=False, opset_version=18)
    y = ort.InferenceSession(path, providers=['CPUExecutionProvider']).run(None, {'x': x.numpy()})
    assert y[0].shape == ref.shape
    assert np.abs(y[0] - ref).max() <= 1e-5


def test_expected_export_warnings_are_hidden_and_only_those():
    """``export_onnx`` hides the warnings tracing always gives (constants by design, the
    exporter's notes), matched by category, message and module: the same message from other
    code is still shown (a size that became a constant of the graph would be)."""
    import warnings

    from mmslab.deploy.onnx_export import EXPECTED_EXPORT_WARNINGS, expected_export_warnings

    def shown(category, message, module):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            with expected_export_warnings():
                warnings.warn_explicit(message + ' (...)', category, 'x.py', 1, module=module)
        return len(caught)

    tracer = torch.jit.TracerWarning
    categories = dict(TracerWarning=tracer, UserWarning=UserWarning)
    modules = {r'mmslab\.deploy\.window_graphs': 'mmslab.deploy.window_graphs',
               r'mmslab\.models\.layers\.shift_mask': 'mmslab.models.layers.shift_mask',
               r'torch$': 'torch',
               r'torch\.onnx\.': 'torch.onnx._internal.torchscript_exporter.utils'}
    for category, message, module, _ in EXPECTED_EXPORT_WARNINGS:
        assert shown(categories[category], message, modules[module]) == 0, message
    assert shown(tracer, 'Converting a tensor to a NumPy array', 'mmslab.deploy.end2end') == 1
    assert shown(tracer, 'Converting a tensor to a Python boolean', 'torchvision.ops') == 1
    assert shown(UserWarning, 'Exporting aten::index operator', 'mmslab.models') == 1
    assert shown(UserWarning, 'Any other warning', 'torch.onnx.utils') == 1
