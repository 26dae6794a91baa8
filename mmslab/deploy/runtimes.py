"""Running an exported model in onnxruntime or OpenVINO: fp32, bf16 or INT8.

Both runtimes read the same ONNX file. INT8 needs one path per runtime (OpenVINO does not
compile onnxruntime's QDQ model): onnxruntime static quantization (QDQ, per-channel weights)
writes ``model_int8.onnx``; NNCF post-training quantization writes ``openvino/model_int8.xml``.
Calibration uses images of the config's dataset, passed through the model's own data
preprocessor, so the statistics are those of real inputs.

Precisions (:data:`PRECISIONS`): ``fp32`` runs the fp32 artifact in fp32 arithmetic;
``int8`` the INT8 artifact; ``bf16`` (OpenVINO only, CPUs with avx512_bf16 / amx_bf16) the
fp32 artifact with OpenVINO's ``INFERENCE_PRECISION_HINT=bf16``. onnxruntime has no bf16 path
on x86 CPUs (:data:`ORT_NO_BF16`).
"""
import os
import os.path as osp
import warnings
from typing import List, Optional, Sequence

import numpy as np

RUNTIMES = ('onnxruntime', 'openvino')
PRECISIONS = ('fp32', 'bf16', 'int8')
WEIGHT_OPS = ('MatMul', 'Gemm', 'Conv')  # the op types ORT INT8 quantizes (with weights)

#: Why onnxruntime refuses bf16 (measured with onnxruntime 1.32 on an Intel Xeon with AMX;
#: ``benchmarks/ort_bf16_probe.py`` repeats the measurement on the machine at hand).
ORT_NO_BF16 = ('onnxruntime has no bf16 compute on x86 CPUs: its CPU execution provider has no '
               'bf16 MatMul / Conv kernels (a graph with bf16 MatMuls fails to load: '
               'NOT_IMPLEMENTED), its only bf16 option, mlas.enable_gemm_fastmath_arm64_bfloat16, '
               'is for ARM64 CPUs, and fp16 MatMuls are no faster than fp32. Use OpenVINO bf16, '
               'eager PyTorch bf16, or onnxruntime fp32 / int8')


class RuntimeModel:
    """``__call__(image: np.ndarray [1, 3, H, W] float32) -> list of np.ndarray``;
    ``precision``: 'fp32', 'bf16' or 'int8' (what :func:`load_runtime_model` loaded)."""

    precision = 'fp32'

    def __init__(self, runtime: str, path: str, threads: int):
        self.runtime, self.path, self.threads = runtime, path, threads

    def __call__(self, image: np.ndarray) -> List[np.ndarray]:
        raise NotImplementedError


class OnnxRuntimeModel(RuntimeModel):

    def __init__(self, path: str, threads: int = 0):
        import onnxruntime as ort
        super().__init__('onnxruntime', path, threads)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(path, opts, providers=['CPUExecutionProvider'])
        self.input_name = self.session.get_inputs()[0].name

    def __call__(self, image: np.ndarray) -> List[np.ndarray]:
        return self.session.run(None, {self.input_name: np.ascontiguousarray(image)})


class OpenVINOModel(RuntimeModel):
    """``bf16``: OpenVINO computes the float parts in bf16 (``INFERENCE_PRECISION_HINT``);
    refused on CPUs without bf16 units."""

    def __init__(self, path: str, threads: int = 0, bf16: bool = False):
        import openvino as ov
        super().__init__('openvino', path, threads)
        core = ov.Core()
        if bf16:
            from mmslab.utils.machine import require_bf16
            require_bf16('OpenVINO bf16')
        # fp32 means fp32: on CPUs with bf16 units OpenVINO otherwise computes in bf16.
        config = {'PERFORMANCE_HINT': 'LATENCY',
                  'INFERENCE_PRECISION_HINT': 'bf16' if bf16 else 'f32'}
        if threads:
            config['INFERENCE_NUM_THREADS'] = threads
        self.compiled = core.compile_model(core.read_model(path), 'CPU', config)
        self.request = self.compiled.create_infer_request()
        self.precision = 'bf16' if bf16 else 'fp32'

    def __call__(self, image: np.ndarray) -> List[np.ndarray]:
        self.request.infer({0: np.ascontiguousarray(image)})
        return [self.request.get_output_tensor(i).data.copy()
                for i in range(len(self.compiled.outputs))]


def check_runtime(runtime: str) -> str:
    if runtime not in RUNTIMES:
        raise ValueError(f'unknown runtime {runtime!r}; valid: {RUNTIMES}')
    return runtime


def resolve_precision(precision: Optional[str] = None, int8: bool = False,
                      bf16: bool = False) -> str:
    """The one precision of ``precision`` and the older ``int8=`` / ``bf16=`` flags (either
    form works; contradicting each other is an error)."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f'unknown precision {precision!r}; valid: {", ".join(PRECISIONS)}')
    if int8 and bf16:
        raise ValueError('int8 and bf16 exclude each other: bf16 runs the fp32 export in '
                         'OpenVINO (INFERENCE_PRECISION_HINT), INT8 is its own precision')
    flagged = 'int8' if int8 else 'bf16' if bf16 else None
    if precision is not None and flagged is not None and precision != flagged:
        raise ValueError(f'precision={precision!r} contradicts {flagged}=True')
    return precision or flagged or 'fp32'


def check_runtime_precision(runtime: str, precision: str) -> str:
    """``precision`` if ``runtime`` offers it; ValueError with the reason otherwise."""
    check_runtime(runtime)
    precision = resolve_precision(precision)
    if precision == 'bf16' and runtime == 'onnxruntime':
        raise ValueError('bf16 runs the fp32 export in OpenVINO (INFERENCE_PRECISION_HINT); '
                         + ORT_NO_BF16)
    return precision


def artifact_path(out_dir: str, runtime: str, int8: bool) -> str:
    """Where ``tools/export_onnx.py`` writes each form (``int8``: a bool, or a precision:
    only 'int8' has its own artifact; 'bf16' computes the fp32 one in bf16)."""
    check_runtime(runtime)
    if isinstance(int8, str):
        int8 = resolve_precision(int8) == 'int8'
    if runtime == 'onnxruntime':
        return osp.join(out_dir, 'model_int8.onnx' if int8 else 'model.onnx')
    return osp.join(out_dir, 'openvino', 'model_int8.xml' if int8 else 'model.xml')


def load_runtime_model(out_dir: str, runtime: str, int8: bool = False,
                       threads: int = 0, bf16: bool = False,
                       precision: Optional[str] = None) -> RuntimeModel:
    """The exported model of ``out_dir`` in ``runtime`` at ``precision`` ('fp32', 'bf16',
    'int8'; or the older flags ``int8=True`` / ``bf16=True``). bf16 (OpenVINO only, CPUs
    with bf16 units): the fp32 model computed in bf16."""
    precision = check_runtime_precision(runtime, resolve_precision(precision, int8, bf16))
    int8 = precision == 'int8'
    path = artifact_path(out_dir, runtime, int8)
    if not osp.exists(path):
        what = 'INT8 ' if int8 else ''
        raise FileNotFoundError(f'no {what}{runtime} model at {path}; run tools/export_onnx.py '
                                f'--out {out_dir}' + (' --int8' if int8 else ''))
    if runtime == 'onnxruntime':
        model = OnnxRuntimeModel(path, threads)
    else:
        model = OpenVINOModel(path, threads, bf16=precision == 'bf16')
    model.precision = precision
    return model


def convert_to_openvino(onnx_path: str, out_dir: str) -> str:
    """The OpenVINO IR (``model.xml`` + ``.bin``) of an ONNX file, fp32 weights."""
    import openvino as ov
    os.makedirs(out_dir, exist_ok=True)
    xml = osp.join(out_dir, 'model.xml')
    ov.save_model(ov.convert_model(onnx_path), xml, compress_to_fp16=False)
    return xml


def quantize_onnxruntime(onnx_path: str, out_path: str,
                         calibration: Sequence[np.ndarray]) -> str:
    """Static INT8 quantization (QDQ, per-channel int8 weights, uint8 activations calibrated
    by MinMax on ``calibration`` images). u8 activations x s8 weights is the combination
    onnxruntime's x86 kernels are fastest with; s8 x s8 ran slower than fp32 here.

    Only the layers with weights (MatMul / Gemm / Conv whose second input is a stored tensor)
    are quantized: they are where the time goes. Quantizing also the activation x activation
    products (attention scores, SLA's K^T V), the residual additions and the normalizers cost
    SLAB-Swin-T 0.027 bbox mAP on the demo (0.001 to 0.006 with weight layers only).

    Calibration covers the tensors of those operator types only: onnxruntime's MinMax
    calibrator keeps every calibrated tensor of a run alive, and calibrating all of them ran
    out of 24 GB at 800x1344 (7.7 GB peak now)."""
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                          quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process

    import onnxruntime as ort
    input_name = ort.InferenceSession(
        onnx_path, providers=['CPUExecutionProvider']).get_inputs()[0].name

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
                        op_types_to_quantize=list(WEIGHT_OPS))
    finally:
        if osp.exists(prepared):
            os.remove(prepared)
    return out_path


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
    import nncf
    import openvino as ov
    model = ov.Core().read_model(xml_path)
    dataset = nncf.Dataset(list(calibration))
    # adaptive pooling's bin products stay float (see onnx_export.PoolingProduct)
    ignored = nncf.IgnoredScope(patterns=['.*/pool_product/.*'], validate=False)
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='overflow encountered in reduce',
                                category=RuntimeWarning)
        quantized = nncf.quantize(model, dataset, model_type=nncf.ModelType.TRANSFORMER,
                                  subset_size=len(calibration), ignored_scope=ignored)
    check_quantizer_ranges(quantized)
    ov.save_model(quantized, out_path)
    return out_path


def check_quantizer_ranges(model) -> int:
    """Raise if a ``FakeQuantize`` of the OpenVINO ``model`` has a range that is not finite
    (its input / output low and high constants); returns how many were checked."""
    checked = 0
    for op in model.get_ops():
        if op.get_type_name() != 'FakeQuantize':
            continue
        for i in range(1, 5):
            node = op.input_value(i).get_node()
            while node.get_type_name() == 'Convert':  # a compressed constant
                node = node.input_value(0).get_node()
            if node.get_type_name() == 'Constant' and \
                    not np.isfinite(node.get_data().astype(np.float64)).all():
                raise RuntimeError(f'INT8 quantization gave {op.get_friendly_name()} a range '
                                   'that is not finite: calibrate on other or more images '
                                   '(--calib-images)')
        checked += 1
    return checked


def pad_to_shape(image, shape) -> 'np.ndarray':
    """``[1, 3, h, w]`` zero-padded at the bottom/right to a static export's ``shape``, as
    inference pads it (an image larger than ``shape`` cannot run in that export)."""
    h, w = image.shape[-2:]
    eh, ew = shape
    if h > eh or w > ew:
        raise ValueError(f'input of {h}x{w} (after the data preprocessor) is larger than the '
                         f'exported static shape {eh}x{ew}: export with --dynamic, or with '
                         '--shape H W at least as large as the images')
    return np.pad(image, ((0, 0), (0, 0), (0, eh - h), (0, ew - w)))


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
