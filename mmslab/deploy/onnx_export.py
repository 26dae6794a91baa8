"""Export the fused backbone / features / segmentor logits to ONNX and check it in a runtime.

Parts:

* ``backbone``: image ``[1, 3, H, W]`` -> the backbone's NCHW maps.
* ``features``: detectors, backbone + neck (what ``extract_feat`` returns). The heads stay in
  PyTorch: Mask R-CNN and RetinaNet post-processing (NMS, RoIAlign on a data-dependent number
  of boxes, mask pasting) needs mmdeploy-style custom operators, which mmdeploy provides
  only for its own backbones; running backbone + neck in the runtime is where the backbone
  speed-up lives.
* ``model``: segmentors, the whole network up to the decode head's logits (at 1/4 of the
  input; resizing to the image and argmax stay in the caller).
"""
import os.path as osp
from typing import List, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
from torch import Tensor

PARTS = ('backbone', 'features', 'model')


def pooling_matrix(size: int, out: int) -> Tensor:
    """``[out, size]``: row ``i`` averages input cells ``floor(i*size/out)`` to
    ``ceil((i+1)*size/out) - 1``, the bins of PyTorch's adaptive average pooling."""
    m = torch.zeros(out, size)
    for i in range(out):
        start, end = (i * size) // out, -(-(i + 1) * size // out)
        m[i, start:end] = 1.0 / (end - start)
    return m


class ExportableAdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` that exports for any output size.

    ONNX has no adaptive pooling; PyTorch's exporter handles only output sizes that divide
    the input (UperNet's pyramid pooling asks for 3x3 and 6x6 bins of a 16x16 map at
    512x512). For a static input size the pooling is a fixed linear map on each axis, so the
    export computes ``P_h @ x @ P_w^T`` with constant bin matrices. Eager calls are unchanged.
    """

    def forward(self, x: Tensor) -> Tensor:
        if not (torch.onnx.is_in_onnx_export() or torch.jit.is_tracing()):
            return super().forward(x)
        h, w = int(x.shape[-2]), int(x.shape[-1])
        oh, ow = self.output_size if isinstance(self.output_size, (tuple, list)) else \
            (self.output_size, self.output_size)
        oh, ow = oh or h, ow or w  # None keeps that size
        ph = pooling_matrix(h, oh).to(x)
        pw = pooling_matrix(w, ow).to(x)
        return ph @ x @ pw.t()  # [oh, h] @ [B, C, h, w] @ [w, ow]


def make_exportable(model: nn.Module) -> nn.Module:
    """Swap layers the ONNX exporter cannot handle for exportable equivalents (in place;
    eager outputs unchanged)."""
    for name, child in list(model.named_children()):
        if type(child) is nn.AdaptiveAvgPool2d:
            setattr(model, name, ExportableAdaptiveAvgPool2d(child.output_size))
        else:
            make_exportable(child)
    return model


class ExportWrapper(nn.Module):
    """``forward(image) -> tuple of tensors`` for one part of an mmdet / mmseg model."""

    def __init__(self, model: nn.Module, part: str):
        super().__init__()
        if part not in PARTS:
            raise ValueError(f'unknown part {part!r}; valid: {PARTS}')
        is_segmentor = hasattr(model, 'decode_head')
        is_detector = hasattr(model, 'extract_feat') and not is_segmentor
        if part == 'features' and not is_detector:
            raise ValueError("part 'features' (backbone + neck) is for detectors; use "
                             "'backbone' or 'model' for a segmentor")
        if part == 'model' and not is_segmentor:
            raise ValueError(
                "part 'model' is for segmentors. A detector's post-processing (NMS, RoIAlign "
                "over a data-dependent number of boxes) has no ONNX form without custom "
                "operators: export 'features' and run the heads in PyTorch")
        if part == 'backbone':
            # a detector / segmentor, or a bare backbone (mmdet's Swin has a `backbone`
            # attribute of its own that is None)
            self.model = model.backbone if (is_detector or is_segmentor) else model
        else:
            self.model = model
        self.part = part

    def forward(self, image: Tensor) -> Tuple[Tensor, ...]:
        m = self.model
        if self.part == 'backbone':
            outs = m(image)
        elif self.part == 'features':
            outs = m.extract_feat(image)
        else:
            outs = m._forward(image)
        return tuple(outs) if isinstance(outs, (list, tuple)) else (outs, )


def output_names(n: int) -> List[str]:
    return [f'out{i}' for i in range(n)]


def export_onnx(model: nn.Module, part: str, shape: Tuple[int, int], path: str,
                dynamic: bool = False, opset: int = 18) -> List[str]:
    """Write ``part`` of the (already fused, eval-mode) ``model`` to ``path``; returns the
    output names. ``dynamic``: height and width are free (multiples of 32)."""
    wrapper = ExportWrapper(make_exportable(model), part).eval()
    dummy = torch.randn(1, 3, *shape)
    with torch.no_grad():
        n_out = len(wrapper(dummy))
    names = output_names(n_out)
    axes = None
    if dynamic:
        axes = {'image': {2: 'height', 3: 'width'}}
        axes.update({n: {2: f'{n}_h', 3: f'{n}_w'} for n in names})
    with torch.no_grad():
        torch.onnx.export(wrapper, (dummy, ), path, input_names=['image'], output_names=names,
                          dynamic_axes=axes, opset_version=opset, dynamo=False,
                          do_constant_folding=True)
    fold_weight_paths(path)
    return names


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


def torch_outputs(model: nn.Module, part: str, image: Tensor) -> List[np.ndarray]:
    with torch.no_grad():
        return [o.numpy() for o in ExportWrapper(model, part).eval()(image)]


def max_relative_error(ref: Sequence[np.ndarray], out: Sequence[np.ndarray]) -> float:
    """Largest ``max|a - b| / max|a|`` over the outputs (shapes must match)."""
    if len(ref) != len(out):
        raise RuntimeError(f'runtime returned {len(out)} outputs, PyTorch {len(ref)}')
    worst = 0.0
    for a, b in zip(ref, out):
        if a.shape != b.shape:
            raise RuntimeError(f'runtime output shape {b.shape} != PyTorch {a.shape}')
        scale = max(float(np.abs(a).max()), 1e-6)
        worst = max(worst, float(np.abs(a.astype(np.float64) - b).max()) / scale)
    return worst


def onnx_size_mb(path: str) -> float:
    size = osp.getsize(path)
    data = path + '.data'
    if osp.exists(data):
        size += osp.getsize(data)
    return size / 2 ** 20
