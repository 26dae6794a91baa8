"""The two exported layouts of window softmax attention (``packed`` and ``split``).

Each graph is compared with an independent eager model (the unfused mmslab model; mmdet's
own Swin), the split graph's structure is checked (three q/k/v MatMuls per block with the
standard multi-head transposes, no 5-D transpose), and the padded token of the split layout
is checked against the definition it replaces: the value a padded slot has after ``qkv``.
"""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import mmslab
from conftest import randomize_weights
from mmslab.deploy import export_onnx
from mmslab.deploy.onnx_export import attention_layout_report, check_attention_layout
from mmslab.deploy.window_graphs import padded_token
from mmslab.models.layers.window_attention import WindowMSA
from test_swin_backbones import build_preset


def run_onnx(path, x):
    sess = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
    return sess.run(None, {'image': x.numpy()})


def transposes(path):
    perms = []
    for node in onnx.load(path).graph.node:
        if node.op_type == 'Transpose':
            perms += [tuple(a.ints) for a in node.attribute if a.name == 'perm']
    return perms


def fused_with_reference(name, sizes, seed=0):
    torch.manual_seed(seed)
    model = randomize_weights(build_preset(name), seed)
    inputs = [torch.randn(1, 3, *s) for s in sizes]
    with torch.no_grad():
        refs = [[o.numpy() for o in model(x)] for x in inputs]
    return mmslab.reparameterize(model), inputs, refs


@pytest.mark.parametrize('dynamic', [False, pytest.param(True, marks=pytest.mark.slow)])
def test_split_layout_matches_unfused_model_and_has_the_multi_head_pattern(dynamic, tmp_path):
    """PRepBN-Swin: its norm is folded into qkv, so padded slots need the solved token."""
    sizes = [(75, 106)] + ([(106, 75), (32, 32)] if dynamic else [])
    model, inputs, refs = fused_with_reference('PRepBNSwin', sizes)
    paths = {}
    for layout in ('packed', 'split'):
        paths[layout] = str(tmp_path / f'{layout}.onnx')
        # (OpenVINO's graph: the window-major heads of the standard multi-head pattern)
        export_onnx(model, 'backbone', (75, 106), paths[layout], dynamic=dynamic,
                    attention=layout, runtime='openvino')
        for x, ref in zip(inputs, refs):
            for r, o in zip(ref, run_onnx(paths[layout], x)):
                assert np.abs(o - r).max() / np.abs(r).max() < 1e-4
    blocks = sum(isinstance(m, WindowMSA) for m in model.modules())
    split, packed = transposes(paths['split']), transposes(paths['packed'])
    # packed: a 5-D transpose (qkv -> [3, B', heads, N, d]) and k^T per block; split:
    # (0, 2, 3, 1) for k and (0, 2, 1, 3) for q, v and the output instead
    five_d = {k: sum(len(p) == 5 for p in v) for k, v in (('split', split), ('packed', packed))}
    assert five_d['packed'] - five_d['split'] == blocks
    assert split.count((0, 2, 3, 1)) - packed.count((0, 2, 3, 1)) == blocks
    assert split.count((0, 2, 1, 3)) >= 3 * blocks
    assert packed.count((0, 1, 3, 2)) - split.count((0, 1, 3, 2)) == blocks  # k^T
    matmuls = [n for n in onnx.load(paths['split']).graph.node if n.op_type == 'MatMul']
    weights = {i.name for i in onnx.load(paths['split']).graph.initializer}
    assert sum(n.input[1] in weights for n in matmuls) >= 3 * blocks + 2 * blocks


def test_split_token_pad_is_the_value_padding_has_after_qkv():
    model, _, _ = fused_with_reference('PRepBNSwin', [])
    kernels = [m for m in model.modules() if isinstance(m, WindowMSA)]
    assert kernels and all(k.qkv_pad is not None for k in kernels)  # folded norms
    for k in kernels:
        token = padded_token(k)
        with torch.no_grad():
            after_qkv = k.qkv(token)
        assert torch.allclose(after_qkv, k.qkv_pad, atol=1e-5, rtol=1e-4)
        assert not torch.allclose(k.qkv(torch.zeros_like(token)), k.qkv_pad, atol=1e-3)


@pytest.mark.slow
def test_kernel_without_a_padding_token_stays_packed_and_exact(tmp_path):
    """A folded norm with a zero scale maps no raw token to zero: that block keeps the packed
    form, the graph stays exact, and export.json's report counts it."""
    model, inputs, refs = fused_with_reference('PRepBNSwin', [(75, 106)])
    kernel = next(m for m in model.modules() if isinstance(m, WindowMSA))
    with torch.no_grad():  # the qkv_pad target is no longer in the span of the weights
        kernel.qkv.weight[:, 0] = 0.0
        kernel.qkv_pad.add_(torch.linspace(-1.0, 1.0, kernel.qkv_pad.numel()))
        refs = [[o.numpy() for o in model(x)] for x in inputs]
    assert padded_token(kernel) is None
    report = attention_layout_report(model, 'split')
    total = sum(isinstance(m, WindowMSA) for m in model.modules())
    assert report == dict(layout='split', split=total - 1, packed=1, mmdet_window_msa=0,
                          cropped=0)
    path = str(tmp_path / 'split.onnx')
    export_onnx(model, 'backbone', (75, 106), path, dynamic=True, attention='split',
                runtime='openvino')
    for r, o in zip(refs[0], run_onnx(path, inputs[0])):
        assert np.abs(o - r).max() / np.abs(r).max() < 1e-4
    packed = str(tmp_path / 'packed.onnx')
    export_onnx(model, 'backbone', (75, 106), packed, dynamic=True, attention='packed',
                runtime='openvino')
    assert sum(len(p) == 5 for p in transposes(packed)) - \
        sum(len(p) == 5 for p in transposes(path)) == total - 1


def test_linear_attention_kernels_report_cropped():
    """SLA's windows are cropped to their valid tokens (no split form: padding is masked);
    the softmax blocks take the split form."""
    from mmslab.models.layers.shift_window import ShiftWindowAttention
    model = build_preset('SLABSwin')
    report = attention_layout_report(model, 'split')
    blocks = [m.w_msa for m in model.modules() if isinstance(m, ShiftWindowAttention)]
    assert report['cropped'] == sum(k.masks_padding for k in blocks) > 0
    assert report['split'] == sum(not k.masks_padding for k in blocks) > 0
    assert attention_layout_report(model, 'packed')['packed'] == report['split']


def test_unknown_layout_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="valid: \\('packed', 'split'\\)"):
        check_attention_layout('fused')
    with pytest.raises(ValueError, match='packed'):
        attention_layout_report(build_preset('RePaSwin'), 'mha')
    with pytest.raises(ValueError, match='packed'):
        export_onnx(build_preset('RePaSwin').eval(), 'backbone', (32, 32),
                    str(tmp_path / 'x.onnx'), attention='mha')


def test_token_major_heads_fold_into_onnxruntimes_products_and_openvino_keeps_its_own(
        tmp_path):
    """onnxruntime's graph takes q, k, v token-major: one transpose of the windows, and
    permutations onnxruntime folds into its attention products (no Transpose left of
    them); OpenVINO's IR comes from a second trace with the standard multi-head pattern.
    Both equal the unfused model."""
    from mmslab.deploy.onnx_export import export_runtime_graphs
    from mmslab.deploy.runtimes import open_model
    sizes = [(75, 106)]
    model, inputs, refs = fused_with_reference('PRepBNSwin', sizes)
    _, report = export_runtime_graphs(model, 'backbone', sizes[0], str(tmp_path),
                                      ['onnxruntime', 'openvino'])
    assert report['head_layout'] == dict(onnxruntime='token_major', openvino='window_major')
    assert report['split'] == sum(isinstance(m, WindowMSA) for m in model.modules())
    assert sorted(p.name for p in (tmp_path / 'openvino').iterdir()) == ['model.bin',
                                                                         'model.xml']
    path = str(tmp_path / 'model.onnx')
    for runtime, model_path in (('onnxruntime', path),
                                ('openvino', str(tmp_path / 'openvino' / 'model.xml'))):
        outputs = open_model(model_path, runtime, threads=2)(inputs[0].numpy())
        for r, o in zip(refs[0], outputs):
            assert np.abs(o - r).max() / np.abs(r).max() < 1e-4, runtime
    blocks = sum(isinstance(m, WindowMSA) for m in model.modules())
    perms = transposes(path)
    assert perms.count((1, 0, 2)) == blocks  # the windows, once per block
    assert perms.count((1, 2, 0, 3)) == 2 * blocks and perms.count((1, 2, 3, 0)) == blocks
    # what onnxruntime runs: the head permutations folded into FusedMatMul (transBatch)
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / 'ort_optimized.onnx')
    ort.InferenceSession(path, opts, providers=['CPUExecutionProvider'])
    optimized = onnx.load(opts.optimized_model_filepath).graph.node
    fused = [{a.name: a.i for a in n.attribute} for n in optimized
             if n.op_type == 'FusedMatMul']
    assert sum(f.get('transBatchA', 0) and f.get('transBatchB', 0) and f.get('transB', 0)
               for f in fused) == blocks  # q k^T
    assert sum(f.get('transBatchB', 0) and not f.get('transBatchA', 0) for f in fused) == blocks
    left = [tuple(a.ints) for n in optimized if n.op_type == 'Transpose' for a in n.attribute]
    assert (1, 2, 0, 3) not in left and (1, 2, 3, 0) not in left
    # OpenVINO's graph has the multi-head transposes
    ov_perms = transposes_in_ir(str(tmp_path / 'openvino' / 'model.xml'))
    # (the converter merges some of them into neighbouring operations)
    assert ov_perms.count((0, 2, 1, 3)) >= 2 * blocks
    assert not {(1, 0, 2), (1, 2, 0, 3), (1, 2, 3, 0)} & set(ov_perms)


def test_token_major_sla_windows_fold_into_onnxruntimes_products(tmp_path):
    """Window SLA in onnxruntime's (token-major) graph: windows gathered token-major, the
    per-head products with no transpose left of them (``FusedMatMul`` with ``transBatch``), at
    every input size equal to the unfused model (several heads, padded and cropped windows,
    shifted and not); OpenVINO's graph keeps the model's form. export.json's report says
    which head layout each runtime's graph has."""
    from mmslab.deploy.onnx_export import export_runtime_graphs
    from mmslab.deploy.runtimes import open_model
    from mmslab.models.layers import SLA
    from mmslab.models.layers.shift_window import ShiftWindowAttention
    torch.manual_seed(0)
    model = randomize_weights(build_preset('SLABSwin', num_heads=(2, 4, 2, 4)), 0)
    # (28 rows: 7 tokens in stage 1, fewer than the window: one window along that axis,
    # holding padding, which an unshifted block computes but never reads back)
    sizes = [(75, 106), (64, 64), (106, 41), (28, 106)]
    inputs = [torch.randn(1, 3, *s) for s in sizes]
    with torch.no_grad():
        refs = [[o.numpy() for o in model(x)] for x in inputs]
    mmslab.reparameterize(model)
    _, report = export_runtime_graphs(model, 'backbone', sizes[0], str(tmp_path),
                                      ['onnxruntime', 'openvino'], dynamic=True)
    sla = sum(isinstance(m, SLA) for m in model.modules())
    assert report['head_layout'] == dict(onnxruntime='token_major', openvino='window_major')
    path = str(tmp_path / 'model.onnx')
    for runtime, model_path in (('onnxruntime', path),
                                ('openvino', str(tmp_path / 'openvino' / 'model.xml'))):
        session = open_model(model_path, runtime, threads=2)
        for x, ref in zip(inputs, refs):
            for r, o in zip(ref, session(x.numpy())):
                assert np.abs(o - r).max() / np.abs(r).max() < 1e-4, (runtime, x.shape)
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / 'ort_optimized.onnx')
    ort.InferenceSession(path, opts, providers=['CPUExecutionProvider'])
    optimized = onnx.load(opts.optimized_model_filepath).graph
    weights = {i.name for i in optimized.initializer}
    optimized = optimized.node
    sla_nodes = [n for n in optimized if any(
        f'stages.{i}/' in n.name for i, s in enumerate(model.stages)
        if isinstance(s.blocks[0].attn.w_msa, SLA))]
    # four window groups per block, three per-head products each (S^T, numerator, normalizer)
    # and in shifted blocks the masked key sum: all FusedMatMul, none a plain MatMul behind a
    # Transpose (unshifted, no window read back holds padding: a plain sum, no V mask)
    shifted = sum(isinstance(m, ShiftWindowAttention) and isinstance(m.w_msa, SLA) and
                  m.shift_size > 0 for m in model.modules())
    products = [n for n in sla_nodes if n.op_type in ('MatMul', 'FusedMatMul')
                and not weights & set(n.input)]
    assert 0 < shifted < sla
    assert len(products) == 4 * (3 * sla + shifted)
    assert all(n.op_type == 'FusedMatMul' for n in products)
    # each group's tokens gathered once, q, k, v projected there (no zero row padded onto V,
    # no gather of q, k or v), and the group's output gathered back to the tokens
    assert not [n for n in sla_nodes if n.op_type == 'Pad' and '/attn/' in n.name]
    gathers = [n for n in sla_nodes if n.op_type == 'Gather' and '/attn/' in n.name and
               n.attribute[0].i == 1 and not weights & set(n.input)]  # (token gathers)
    assert len(gathers) == 5 * sla, [n.name for n in gathers]
    left = [tuple(a.ints) for n in sla_nodes if n.op_type == 'Transpose' for a in n.attribute]
    assert not {(1, 2, 0, 3), (1, 2, 3, 0)} & set(left)


def transposes_in_ir(xml_path):
    """The permutations of the Transpose operations of an OpenVINO IR."""
    from mmslab.deploy.runtimes import import_openvino
    ov = import_openvino()
    perms = []
    for op in ov.Core().read_model(xml_path).get_ordered_ops():
        if op.get_type_name() == 'Transpose':
            source = op.input_value(1).get_node()
            if source.get_type_name() == 'Constant':
                perms.append(tuple(int(v) for v in source.get_vector()))
    return perms
