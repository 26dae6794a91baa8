"""INT8 artifacts and their calibration: the export side of INT8, beside ``onnx_export``.
They need the model (calibration images go through its data preprocessor) and write the
files that :mod:`mmslab.deploy.runtimes` opens; the runtime layer never imports this module.

Both runtimes read the same ONNX file, but INT8 needs one path per runtime (OpenVINO does not
compile onnxruntime's QDQ model): onnxruntime static quantization (QDQ, per-channel weights)
writes ``model_int8.onnx``; NNCF post-training quantization writes
``openvino/model_int8.xml``. Calibration uses images of the config's dataset, passed through
the model's own data preprocessor, so the statistics are those of real inputs.

numpy only at import: onnx, onnxruntime's quantizer, NNCF, PyTorch and mmengine load in the
functions that use them.
"""
import os
import os.path as osp
import warnings
from typing import List, Optional, Sequence

import numpy as np

from .runtimes import (INT8_WEIGHT_BITS_KEY, OnnxRuntimeModel, import_openvino, int8_weight_bits,
                       pad_to_shape)

WEIGHT_OPS = ('MatMul', 'Gemm', 'Conv')  # the op types ORT INT8 quantizes (with weights)
FLOAT_OUTPUT_OPS = ('MatMul', 'Gemm')  # ... of which these keep a float output


def quantize_onnxruntime(onnx_path: str, out_path: str, calibration: Sequence[np.ndarray],
                         graph_passes: bool = True, weight_bits: Optional[int] = None) -> str:
    """Static INT8 quantization (QDQ, per-channel int8 weights, uint8 activations calibrated
    by MinMax on ``calibration`` images). u8 activations x s8 weights is the combination
    onnxruntime's x86 kernels are fastest with; s8 x s8 ran slower than fp32 here.

    ``weight_bits``: 8, or 7 (weights in [-64, 64]) for x86 CPUs without 8-bit dot products
    (VNNI, AMX), whose kernels add pairs of u8 x s8 products in 16 bits: 8-bit weights can
    saturate those sums, 7-bit ones cannot (2 x 255 x 64 < 2^15; figures in
    docs/deployment.md). None: what this CPU needs (:func:`~.runtimes.int8_weight_bits`).
    The file records it (ONNX metadata ``mmslab_int8_weight_bits``) and
    :class:`~.runtimes.OnnxRuntimeModel` warns where an 8-bit file meets a CPU without them.

    Only the layers with weights (MatMul / Gemm / Conv whose second input is a stored tensor)
    are quantized: they are where the time goes. Quantizing also the activation x activation
    products (attention scores, SLA's K^T V), the residual additions and the normalizers cost
    SLAB-Swin-T 0.027 bbox mAP on the demo (0.001 to 0.006 with weight layers only).

    Calibration covers the tensors of those operator types only: onnxruntime's MinMax
    calibrator keeps every calibrated tensor of a run alive, and calibrating all of them ran
    out of 24 GB at 800x1344 (7.7 GB peak now).

    MatMul / Gemm outputs stay float (:data:`FLOAT_OUTPUT_OPS`): onnxruntime's own graph
    optimizer then runs each ``DequantizeLinear -> MatMul`` as ``MatMulIntegerToFloat``
    (dequantizing in the kernel's epilogue). A quantized output would cost a
    ``QLinearMatMul`` plus a ``DequantizeLinear`` pass before the float consumers and one
    rounding more.

    ``graph_passes``: then :func:`read_float_where_float` and :func:`quantize_before_moves`
    rewrite the quantizer's file (measured with onnxruntime 1.32: docs/benchmarks.md);
    False keeps it as onnxruntime's quantizer wrote it."""
    if weight_bits is None:
        weight_bits = int8_weight_bits()
    if weight_bits not in (7, 8):
        raise ValueError(f'weight_bits={weight_bits!r}; valid: 7, 8 or None (what this CPU '
                         f'needs)')
    import onnx
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                          quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process

    input_name = OnnxRuntimeModel(onnx_path).input_name

    class Reader(CalibrationDataReader):

        def __init__(self):
            self.items = iter([{input_name: x} for x in calibration])

        def get_next(self):
            return next(self.items, None)

    prepared = out_path + '.pre.onnx'
    # ORT graph optimization in the pre-processing mis-folds the shape arithmetic of
    # mmdet's Swin (Reshape to the wrong window count): shape inference only.
    quant_pre_process(onnx_path, prepared, skip_optimization=True, skip_symbolic_shape=True)
    try:
        quantize_static(prepared, out_path, Reader(), quant_format=QuantFormat.QDQ,
                        per_channel=True, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8, nodes_to_quantize=weight_layers(prepared),
                        reduce_range=weight_bits == 7,
                        op_types_to_quantize=list(WEIGHT_OPS),
                        extra_options={'OpTypesToExcludeOutputQuantization':
                                       list(FLOAT_OUTPUT_OPS)})
    finally:
        if osp.exists(prepared):
            os.remove(prepared)
    model = onnx.load(out_path)
    if graph_passes:
        read_float_where_float(model)
        quantize_before_moves(model)
    onnx.helper.set_model_props(model, {INT8_WEIGHT_BITS_KEY: str(weight_bits)})
    onnx.save(model, out_path)
    return out_path


def read_float_where_float(model) -> int:
    """Rewire the operators of the QDQ ``onnx.ModelProto`` (in place) that read a quantized
    activation through its ``QuantizeLinear -> DequantizeLinear`` pair but are not weight
    layers (a residual ``Add``, a ``Gather``) to read the float tensor itself; returns how
    many inputs were rewired.

    onnxruntime's quantizer gives every reader of a quantized tensor the dequantized copy.
    Where a norm is folded into the next layers (PRepBN, SLAB), the residual stream
    itself is the input of the ``qkv`` and ``fc1`` layers, so the residual additions read it
    rounded to 8 bits and a ``DequantizeLinear`` pass over it runs for them alone. The float
    tensor is what the unquantized graph adds: one rounding fewer, one pass fewer."""
    graph = model.graph
    inits = {init.name for init in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}

    def weight_layer(node) -> bool:
        if node.op_type not in WEIGHT_OPS or len(node.input) < 2:
            return False
        weight = producer.get(node.input[1])
        return node.input[1] in inits or (weight is not None and
                                          weight.op_type == 'DequantizeLinear' and
                                          weight.input[0] in inits)

    # DequantizeLinear output -> the float tensor its QuantizeLinear read, for the activations
    # quantized as a weight layer's input (not a quantized output: FLOAT_OUTPUT_OPS empty)
    for_weight_layer = {node.input[0] for node in graph.node if weight_layer(node)}
    rounded = {}
    for node in graph.node:
        if node.op_type != 'DequantizeLinear' or node.output[0] not in for_weight_layer:
            continue
        quant = producer.get(node.input[0])
        if quant is not None and quant.op_type == 'QuantizeLinear':
            rounded[node.output[0]] = quant.input[0]
    rewired = 0
    for node in graph.node:
        if node.op_type in ('QuantizeLinear', 'DequantizeLinear') or weight_layer(node):
            continue
        for i, name in enumerate(node.input):
            if name in rounded:
                node.input[i] = rounded[name]
                rewired += 1
    if rewired:
        outputs = {o.name for o in graph.output}
        read = {name for n in graph.node for name in n.input} | outputs
        for op_type in ('DequantizeLinear', 'QuantizeLinear'):  # pairs nothing reads now
            for node in [n for n in graph.node
                         if n.op_type == op_type and n.output[0] not in read]:
                graph.node.remove(node)
            read = {name for n in graph.node for name in n.input} | outputs
    return rewired


#: Operators that only move, copy or drop elements, and the inputs they move: quantizing
#: their output is quantizing those inputs (``QuantizeLinear`` is elementwise).
MOVE_OPS = dict(Gather=(0, ), Transpose=(0, ), Reshape=(0, ), Squeeze=(0, ),
                Unsqueeze=(0, ), Flatten=(0, ), Expand=(0, ), Slice=(0, ), Concat=None)


def quantize_before_moves(model) -> int:
    """Move each per-tensor ``QuantizeLinear`` of the QDQ ``onnx.ModelProto`` (in place)
    above the operators that only move elements (:data:`MOVE_OPS`) between it and the
    tensor's last computation, when it is their output's only reader; returns how many
    operators now move 8-bit data.

    onnxruntime's quantizer puts the ``QuantizeLinear`` on the weight layer's input, and its
    own propagation moves it above reshapes and transposes but not above a ``Gather`` or
    ``Concat``: the window partition (append the padded token, gather the windows) and the
    way back (heads to channels, windows to token order) then move float32 data, four times
    the bytes, and the quantizer reads the larger, padded tensor. Quantizing first and moving
    the 8-bit values gives the same values (rounding commutes with moving), so the outputs do
    not change."""
    from onnx import helper
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    outputs = {o.name for o in graph.output}
    moved, changed = 0, True
    while changed:
        changed = False
        producer = {out: node for node in graph.node for out in node.output}
        readers = {}
        for node in graph.node:
            for name in node.input:
                readers[name] = readers.get(name, 0) + 1
        for quant in list(graph.node):
            if quant.op_type != 'QuantizeLinear':
                continue
            scale = inits.get(quant.input[1])
            move = producer.get(quant.input[0])
            if scale is None or len(scale.dims) or move is None or \
                    move.op_type not in MOVE_OPS or readers[quant.input[0]] != 1 or \
                    quant.input[0] in outputs:
                continue
            inputs = MOVE_OPS[move.op_type] or range(len(move.input))
            position = list(graph.node).index(move)
            for i in inputs:
                q = helper.make_node('QuantizeLinear', [move.input[i]] + list(quant.input[1:]),
                                     [f'{move.input[i]}_q_{quant.output[0]}'],
                                     name=f'{quant.name}_before_{move.name}_{i}')
                graph.node.insert(position, q)
                position += 1
                move.input[i] = q.output[0]
            move.output[0] = quant.output[0]
            graph.node.remove(quant)
            moved += 1
            changed = True
            break  # the maps above are stale
    return moved


def weight_layers(onnx_path: str) -> List[str]:
    """Names of the MatMul / Gemm / Conv nodes whose weight is an initializer, except
    depth-wise / grouped convs."""
    import onnx
    graph = onnx.load(onnx_path).graph
    weights = {init.name for init in graph.initializer}
    return [n.name for n in graph.node
            if n.op_type in WEIGHT_OPS and len(n.input) > 1 and n.input[1] in weights
            and not _is_grouped_conv(n)]


def _is_grouped_conv(node) -> bool:
    # Depth-wise convs (SLA's DWC branch, a small share of the compute) stay float, as they
    # were in every INT8 accuracy and latency figure measured.
    return node.op_type == 'Conv' and any(a.name == 'group' and a.i > 1 for a in node.attribute)


def quantize_openvino(xml_path: str, out_path: str, calibration: Sequence[np.ndarray]) -> str:
    """NNCF post-training INT8 quantization of the OpenVINO model (transformer preset).

    NNCF averages each quantized tensor's per-image minimum and maximum over the calibration
    images. A tensor that is empty for an image reduces to +-FLT_MAX (the identity of min /
    max): in a detector, the RoIAlign of an FPN level that no RoI was assigned to. The mean of
    two such values overflows float32, which numpy reports as "overflow encountered in
    reduce". Those RoIAlign outputs share one quantization range with the other levels (they
    are merged), whose finite statistics set it, so the model is unaffected: the warning is
    not shown, and every quantizer's range is checked to be finite instead.
    """
    ov = import_openvino()
    nncf = import_openvino('nncf')
    model = ov.Core().read_model(xml_path)
    dataset = nncf.Dataset(list(calibration))
    # adaptive pooling's bin products stay float (see onnx_export.PoolingProduct). Depth-wise
    # convs stay float, as in onnxruntime (_is_grouped_conv): SLA's DWC reads the V that
    # K^T V reads, so a quantized DWC shares V's quantizer with it, and OpenVINO's integer
    # convolutions take unsigned inputs on CPUs without AMX (AVX-512 VNNI), where K^T V
    # takes signed ones; with no precision that suits both, both ran in float, K^T V with
    # its quantizers emulated in fp32.
    ignored = nncf.IgnoredScope(patterns=['.*/pool_product/.*'], types=['GroupConvolution'],
                                validate=False)
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='overflow encountered in reduce',
                                category=RuntimeWarning)
        quantized = nncf.quantize(model, dataset, model_type=nncf.ModelType.TRANSFORMER,
                                  subset_size=len(calibration), ignored_scope=ignored)
    check_quantizer_ranges(quantized)
    ov.save_model(quantized, out_path)
    return out_path


def _constant_node(output):
    """The node behind ``output``, a compressed constant's ``Convert`` looked through."""
    node = output.get_node()
    while node.get_type_name() == 'Convert':
        node = node.input_value(0).get_node()
    return node


def check_quantizer_ranges(model) -> int:
    """Raise if a ``FakeQuantize`` of the OpenVINO ``model`` has a range that is not finite
    (its input / output low and high constants); returns how many were checked."""
    checked = 0
    for op in model.get_ops():
        if op.get_type_name() != 'FakeQuantize':
            continue
        for i in range(1, 5):
            node = _constant_node(op.input_value(i))
            if node.get_type_name() == 'Constant' and \
                    not np.isfinite(node.get_data().astype(np.float64)).all():
                raise RuntimeError(f'INT8 quantization gave {op.get_friendly_name()} a range '
                                   'that is not finite: calibrate on other or more images '
                                   '(--calib-images)')
        checked += 1
    return checked


def preprocessed_images(cfg, model, num: int, split: str = 'train',
                        shape=None) -> List[np.ndarray]:
    """``num`` images of the config's ``split`` ('train' or 'test') set through the test
    pipeline and the model's data preprocessor (normalized, padded to its size divisor) as
    ``[1, 3, H, W]`` float32 arrays, the inputs the deployed model gets; zero-padded to
    ``shape`` for a static export, as inference pads them."""
    import torch
    from mmengine.dataset import pseudo_collate
    from mmengine.registry import DATASETS, init_default_scope
    if split not in ('train', 'test'):
        raise ValueError(f"split {split!r}; valid: 'train', 'test'")
    init_default_scope(cfg.get('default_scope', 'mmdet'))
    ds_cfg = cfg[f'{split}_dataloader'].dataset.copy()
    while 'dataset' in ds_cfg and 'pipeline' not in ds_cfg:  # RepeatDataset & co.
        ds_cfg = ds_cfg.dataset.copy()
    ds_cfg.pipeline = cfg.test_dataloader.dataset.pipeline
    ds_cfg.test_mode = True
    ds_cfg.pop('filter_cfg', None)
    dataset = DATASETS.build(ds_cfg)
    if len(dataset) == 0:
        raise RuntimeError(f'the {split} dataset of the config is empty')
    out = []
    with torch.no_grad():
        for i in range(min(num, len(dataset))):
            data = model.data_preprocessor(pseudo_collate([dataset[i]]), False)
            image = data['inputs'].float().numpy()
            out.append(pad_to_shape(image, shape) if shape is not None else image)
    return out


def calibration_images(cfg, model, num: int, shape=None) -> List[np.ndarray]:
    """INT8 calibration inputs: images of the training set (:func:`preprocessed_images`);
    the INT8 error is then measured on test-set images, which calibration never saw."""
    return preprocessed_images(cfg, model, num, 'train', shape)
