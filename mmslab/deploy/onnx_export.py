"""Export the fused model, or a part of it, to ONNX.

Parts:

* ``backbone``: image ``[1, 3, H, W]`` -> the backbone's NCHW maps.
* ``features``: detectors, backbone + neck (what ``extract_feat`` returns).
* ``model``: the whole network. Detectors (Mask R-CNN, RetinaNet; see :mod:`.end2end`):
  ``dets [N, 5]`` (boxes in the input's pixels + score), ``labels [N]`` and, for Mask R-CNN,
  ``masks [N, 28, 28]`` (RoI mask probabilities), after NMS. Segmentors: ``seg_logits`` (the
  decode head's logits at 1/4 of the input) or, with ``seg_argmax``, ``seg_label [1, H, W]``
  (logits resized to the input and argmax in the graph).

mmslab's layers read sizes from the traced shape, so a graph computes its window layouts,
shift masks and padding from the runtime size; ``dynamic=True`` leaves height and width free
in the graph's input, a static export fixes them (the runtime folds the size arithmetic).
Each runtime's graph is traced with its rewrites bound (:mod:`.rewriters`: the window
attention's graph forms in :mod:`.window_graphs`, mmdet's own Swin in :mod:`.mmdet_swin`).
"""
from contextlib import contextmanager
import os
import os.path as osp
import warnings
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from mmslab.models.layers.shift_window import ShiftWindowAttention
from .compare import max_relative_error  # noqa: F401  (re-exported)
from .export_info import is_detector, is_segmentor
from .mmdet_swin import foreign_window_msa_classes  # (also registers mmdet's Swin rewrites)
from .rewriters import rewritten
from .window_graphs import RUNTIME_HEAD_LAYOUTS, padded_token

PARTS = ('backbone', 'features', 'model')
#: The window attentions' graph forms: ``split`` takes :mod:`.window_graphs`' rewrites.
ATTENTION_LAYOUTS = ('packed', 'split')
#: Measured faster in OpenVINO (fp32 and INT8) and equal in onnxruntime (docs/benchmarks.md).
DEFAULT_ATTENTION_LAYOUT = 'split'


def check_attention_layout(layout: str) -> str:
    """``layout`` if it is one of :data:`ATTENTION_LAYOUTS`, else a ``ValueError`` naming them."""
    if layout not in ATTENTION_LAYOUTS:
        raise ValueError(f'unknown attention layout {layout!r}; valid: {ATTENTION_LAYOUTS}')
    return layout


def attention_layout_report(model: nn.Module, layout: str) -> dict:
    """For ``export.json``: ``layout`` and how many window attentions of ``model`` an export
    in it runs ``split``, ``packed`` (no split form, or no
    :func:`~.window_graphs.padded_token`), as ``mmdet_window_msa`` (mmdet's / mmseg's own,
    in ``layout``) or ``cropped`` (``masks_padding``)."""
    check_attention_layout(layout)
    foreign_classes = foreign_window_msa_classes()
    split = packed = foreign = cropped = 0
    for m in model.modules():
        if isinstance(m, ShiftWindowAttention):
            if m.w_msa.masks_padding:
                cropped += 1
            elif layout == 'split' and padded_token(m.w_msa) is not None:
                split += 1
            else:
                packed += 1
        elif foreign_classes and isinstance(m, foreign_classes):
            foreign += 1
    return dict(layout=layout, split=split, packed=packed, mmdet_window_msa=foreign,
                cropped=cropped)


def traced_pooling_matrix(size: Tensor, out: int, dtype: torch.dtype) -> Tensor:
    """``[out, size]``: row ``i`` averages input cells ``floor(i*size/out)`` to
    ``ceil((i+1)*size/out) - 1``, the bins of PyTorch's adaptive average pooling, for a
    size read from the traced shape (a 0-d tensor)."""
    i = torch.arange(out, device=size.device).view(-1, 1)
    start = (i * size) // out
    end = ((i + 1) * size + out - 1) // out
    j = torch.arange(size, device=size.device).view(1, -1)
    inside = ((j >= start) & (j < end)).to(dtype)
    return inside / (end - start).to(dtype)


class PoolingProduct(nn.Module):
    """``P_h @ x @ P_w^T``; a module of its own so that exported node names carry
    ``pool_product`` (quantizers are told to leave it in float: its matrices are activations
    in a dynamic graph, and NNCF could not give the pyramid-pooling Concat one scale)."""

    def forward(self, ph: Optional[Tensor], x: Tensor, pw: Optional[Tensor]) -> Tensor:
        # [oh, h] @ [B, C, h, w] @ [w, ow]; None: that axis keeps its size
        if ph is not None:
            x = ph @ x
        return x if pw is None else x @ pw.t()


class ExportableAdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` that exports for any output size.

    ONNX has no adaptive pooling; PyTorch's exporter handles only output sizes that divide
    the input (UperNet's pyramid pooling asks for 3x3 and 6x6 bins of a 16x16 map at
    512x512). Pooling is a linear map on each axis, so the export computes
    ``P_h @ x @ P_w^T`` with bin matrices: constants in a static export, computed from the
    runtime size in a dynamic one. Eager calls are unchanged.
    """

    def __init__(self, output_size):
        super().__init__(output_size)
        self.pool_product = PoolingProduct()

    def forward(self, x: Tensor) -> Tensor:
        if not torch.jit.is_tracing():
            return super().forward(x)
        oh, ow = self.output_size if isinstance(self.output_size, (tuple, list)) else \
            (self.output_size, self.output_size)
        ph = None if oh is None else traced_pooling_matrix(x.shape[-2], oh, x.dtype)
        pw = None if ow is None else traced_pooling_matrix(x.shape[-1], ow, x.dtype)
        return self.pool_product(ph, x, pw)


def make_exportable(model: nn.Module) -> nn.Module:
    """Swap layers the ONNX exporter cannot handle for exportable equivalents (in place;
    eager outputs unchanged)."""
    for name, child in list(model.named_children()):
        if type(child) is nn.AdaptiveAvgPool2d:
            setattr(model, name, ExportableAdaptiveAvgPool2d(child.output_size))
        else:
            make_exportable(child)
    return model


class SegmentorEnd2End(nn.Module):
    """``image [1, 3, H, W] -> seg_logits`` (the decode head's output) or, with ``argmax``,
    ``seg_label [1, H, W]`` int64: logits resized to the input as the head does in
    ``predict_by_feat`` (bilinear, its ``align_corners``), then argmax over classes."""

    def __init__(self, model: nn.Module, argmax: bool = False):
        super().__init__()
        self.model, self.argmax = model, argmax
        head = model.decode_head
        self.align_corners = getattr(head[-1] if isinstance(head, nn.ModuleList) else head,
                                     'align_corners', False)

    def output_names(self) -> List[str]:
        return ['seg_label'] if self.argmax else ['seg_logits']

    def forward(self, image: Tensor) -> Tuple[Tensor, ...]:
        logits = self.model._forward(image)
        if not self.argmax:
            return (logits, )
        logits = F.interpolate(logits, size=image.shape[-2:], mode='bilinear',
                               align_corners=self.align_corners)
        return (logits.argmax(dim=1), )


class ExportWrapper(nn.Module):
    """``forward(image) -> tuple of tensors`` for one part of an mmdet / mmseg model."""

    def __init__(self, model: nn.Module, part: str, seg_argmax: bool = False):
        super().__init__()
        if part not in PARTS:
            raise ValueError(f'unknown part {part!r}; valid: {PARTS}')
        segmentor, detector = is_segmentor(model), is_detector(model)
        if part == 'features' and not detector:
            raise ValueError("part 'features' (backbone + neck) is for detectors; use "
                             "'backbone' or 'model' for a segmentor")
        if part == 'model' and not (detector or segmentor):
            raise ValueError(f"part 'model' needs a detector or a segmentor, not "
                             f'{type(model).__name__}')
        if seg_argmax and not (part == 'model' and segmentor):
            raise ValueError("seg_argmax applies to part 'model' of a segmentor")
        if part == 'backbone':
            # a detector / segmentor, or a bare backbone (mmdet's Swin has a `backbone`
            # attribute of its own that is None)
            self.model = model.backbone if (detector or segmentor) else model
        elif part == 'model' and detector:
            from .end2end import DetectorEnd2End, end2end_output_names
            self.model = DetectorEnd2End(model)
            self._names = end2end_output_names(model)
        elif part == 'model':
            self.model = SegmentorEnd2End(model, seg_argmax)
            self._names = self.model.output_names()
        else:
            self.model = model
        self.part = part

    def output_names(self, num_outputs: int) -> List[str]:
        if self.part == 'model':
            return list(self._names)
        return [f'out{i}' for i in range(num_outputs)]

    def forward(self, image: Tensor) -> Tuple[Tensor, ...]:
        m = self.model
        if self.part == 'features':
            outs = m.extract_feat(image)
        else:
            outs = m(image)
        return tuple(outs) if isinstance(outs, (list, tuple)) else (outs, )


#: Warnings that tracing and exporting mmslab's models always give and that say nothing about
#: the graph: ``(category name, message start, module regex, why it is expected)``.
EXPECTED_EXPORT_WARNINGS = (
    ('TracerWarning', 'Converting a tensor to a NumPy array',
     r'mmslab\.deploy\.window_graphs',
     "the padded token's qkv value is computed from the weights: a constant by design"),
    ('TracerWarning', 'torch.from_numpy results are registered as constants',
     r'mmslab\.deploy\.window_graphs', 'the same constant'),
    ('TracerWarning', 'torch.from_numpy results are registered as constants',
     r'mmslab\.models\.layers\.shift_mask',
     "the shift masks of the four window kinds: constants of the window and shift"),
    ('TracerWarning', 'Converting a tensor to a Python boolean', r'torch$',
     "torchvision's RoI box-shape check (torch._assert: boxes have 5 columns)"),
    ('UserWarning', 'Constant folding - Only steps=1 can be constant folded',
     r'torch\.onnx\.', 'a Slice with a step is left to the runtime'),
    ('UserWarning', 'Exporting aten::index operator of advanced indexing', r'torch\.onnx\.',
     'the index tensors (window gathers) are never negative'),
)


@contextmanager
def expected_export_warnings() -> Iterator[None]:
    """Inside the block, the warnings of :data:`EXPECTED_EXPORT_WARNINGS` are not shown;
    any other warning is (a ``TracerWarning`` elsewhere can mean that a size became a
    constant of the graph)."""
    categories = dict(TracerWarning=torch.jit.TracerWarning, UserWarning=UserWarning)
    with warnings.catch_warnings():
        for category, message, module, _ in EXPECTED_EXPORT_WARNINGS:
            warnings.filterwarnings('ignore', message=message.replace('.', r'\.'),
                                    category=categories[category], module=module)
        yield


def export_onnx(model: nn.Module, part: str, shape: Tuple[int, int], path: str,
                dynamic: bool = False, opset: int = 18, seg_argmax: bool = False,
                attention: str = DEFAULT_ATTENTION_LAYOUT,
                runtime: str = 'onnxruntime') -> List[str]:
    """Write ``part`` of the (already fused, eval-mode) ``model`` to ``path``, traced at
    ``shape``; returns the output names. ``dynamic``: height and width are free.
    ``runtime``: whose graph it is, ``attention``: whether window attention takes its
    ``split`` form there (:mod:`.window_graphs`). The exporter's expected warnings are not
    shown (:func:`expected_export_warnings`)."""
    check_attention_layout(attention)
    wrapper = ExportWrapper(make_exportable(model), part, seg_argmax).eval()
    dummy = torch.randn(1, 3, *shape)
    forms = ('split', ) if attention == 'split' else ()
    with expected_export_warnings(), rewritten(wrapper, runtime, forms), torch.no_grad():
        names = wrapper.output_names(len(wrapper(dummy)))
        axes = None
        if dynamic:
            axes = {'image': {2: 'height', 3: 'width'}}
        if part == 'model' and is_detector(model):
            axes = dict(axes or {}, **{n: {0: 'num_dets'} for n in names})
        elif dynamic and 'seg_label' in names:
            axes['seg_label'] = {1: 'height', 2: 'width'}
        elif dynamic:
            axes.update({n: {2: f'{n}_h', 3: f'{n}_w'} for n in names})
        torch.onnx.export(wrapper, (dummy, ), path, input_names=['image'],
                          output_names=names, dynamic_axes=axes, opset_version=opset,
                          dynamo=False, do_constant_folding=True)
    fold_weight_paths(path)
    return names


def export_runtime_graphs(model: nn.Module, part: str, shape: Tuple[int, int], out_dir: str,
                          runtimes: Sequence[str], dynamic: bool = False,
                          seg_argmax: bool = False,
                          attention: str = DEFAULT_ATTENTION_LAYOUT) -> Tuple[List[str], dict]:
    """The graphs of ``runtimes`` (``onnxruntime`` / ``openvino``) in ``out_dir``, each with
    its runtime's rewrites: ``model.onnx`` (onnxruntime's graph, or OpenVINO's when
    onnxruntime is not asked for) and ``openvino/model.xml``. In the ``split`` form the two
    differ, and OpenVINO's IR is converted from a second trace; otherwise from
    ``model.onnx``. Returns the output names and the attention report of ``export.json``
    (:func:`attention_layout_report`) with ``head_layout``:
    ``{runtime: head layout}``, ``None`` where no attention has heads to lay out."""
    from .runtimes import RUNTIMES, convert_to_openvino
    unknown = set(runtimes) - set(RUNTIMES)
    if unknown or not runtimes:
        raise ValueError(f'runtimes {list(runtimes)}: choose from {RUNTIMES}')
    report = attention_layout_report(model, attention)
    has_heads = attention == 'split' and bool(
        report['split'] or report['mmdet_window_msa'] or report['cropped'])
    layouts = {r: RUNTIME_HEAD_LAYOUTS[r] if has_heads else None for r in runtimes}
    first = 'onnxruntime' if 'onnxruntime' in runtimes else runtimes[0]
    onnx_path = osp.join(out_dir, 'model.onnx')
    kwargs = dict(dynamic=dynamic, seg_argmax=seg_argmax, attention=attention)
    names = export_onnx(model, part, shape, onnx_path, runtime=first, **kwargs)
    if 'openvino' in runtimes:
        ov_dir = osp.join(out_dir, 'openvino')
        source = onnx_path
        if first != 'openvino' and attention == 'split':
            os.makedirs(ov_dir, exist_ok=True)
            source = osp.join(ov_dir, 'model_openvino.onnx')
            export_onnx(model, part, shape, source, runtime='openvino', **kwargs)
        try:
            convert_to_openvino(source, ov_dir)
        finally:
            if source != onnx_path and osp.exists(source):
                os.remove(source)
    return names, dict(report, head_layout=layouts)


#: Layout operators a weight may pass through on its way to a layer.
_WEIGHT_PATH_OPS = ('Transpose', 'Reshape', 'Cast', 'Identity', 'Tile', 'Squeeze', 'Unsqueeze',
                    'Flatten', 'Constant')


def fold_weight_paths(path: str) -> int:
    """Replace layout operators whose inputs are all constants by initializers, in place;
    returns how many were folded.

    Weights the model reshapes or tiles in ``forward`` (PVT's 1x1-conv FFN computed as
    Linears, SLA's head-shared depth-wise kernel, permuted patch-merging weights) reach
    their MatMul / Conv through such operators, which the exporter's folding leaves. INT8
    quantizers take only initializers as weights, so those layers stayed fp32.
    """
    import onnx
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator
    model = onnx.load(path)
    graph = model.graph
    values = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    kept, folded = [], 0
    for node in graph.node:
        inputs = [i for i in node.input if i]
        if node.op_type in _WEIGHT_PATH_OPS and all(i in values for i in inputs):
            single = onnx.helper.make_model(
                onnx.helper.make_graph([node], 'fold', [
                    onnx.helper.make_tensor_value_info(i, onnx.helper.np_dtype_to_tensor_dtype(
                        values[i].dtype), values[i].shape) for i in inputs],
                    [onnx.helper.make_empty_tensor_value_info(o) for o in node.output]),
                opset_imports=model.opset_import)
            outs = ReferenceEvaluator(single).run(None, {i: values[i] for i in inputs})
            for name, value in zip(node.output, outs):
                values[name] = value
                graph.initializer.append(numpy_helper.from_array(value, name))
            folded += 1
        else:
            kept.append(node)
    if folded:
        del graph.node[:]
        graph.node.extend(kept)
        used = {i for n in kept for i in n.input} | {o.name for o in graph.output}
        inits = [init for init in graph.initializer if init.name in used]
        del graph.initializer[:]
        graph.initializer.extend(inits)
        onnx.save(model, path)
    return folded


def torch_outputs(model: nn.Module, part: str, image: Tensor,
                  seg_argmax: bool = False) -> List[np.ndarray]:
    with torch.no_grad():
        return [o.numpy() for o in ExportWrapper(model, part, seg_argmax).eval()(image)]


def onnx_size_mb(path: str) -> float:
    size = osp.getsize(path)
    data = path + '.data'
    if osp.exists(data):
        size += osp.getsize(data)
    return size / 2 ** 20
