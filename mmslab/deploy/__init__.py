"""Deployment: ONNX export of fused models, onnxruntime / OpenVINO runtimes, INT8, and a
torch-free predictor (``python -m mmslab.deploy.predict``).

* ``export_info``: ``export.json``, its one writer and validator (standard library only);
* ``runtimes``: the runtime layer, opening an exported model in onnxruntime / OpenVINO at a
  precision (numpy only at import; the predictor's and ``tools/test.py --backend``'s);
* ``onnx_export`` (PyTorch) and ``quantize`` (calibration and INT8, needing the model): the
  export side, imported on first use (PEP 562 module ``__getattr__``), so that ``runtimes``
  and ``predict`` import without PyTorch. ``from mmslab.deploy import export_onnx`` works as
  before;
* ``cuda_graph`` (PyTorch, imported on first use too): a fused model's backbone and neck
  replayed from CUDA graphs on a GPU, where batch-1 inference waits on kernel launches.
"""
import importlib

from .runtimes import (PRECISIONS, RUNTIMES, artifact_path, convert_to_openvino,
                       load_runtime_model, open_model, resolve_precision)

_LAZY = dict(
    **{name: 'onnx_export' for name in
       ('PARTS', 'ExportWrapper', 'export_onnx', 'export_runtime_graphs', 'max_relative_error',
        'torch_outputs')},
    **{name: 'quantize' for name in
       ('calibration_images', 'preprocessed_images', 'quantize_onnxruntime',
        'quantize_openvino')},
    **{name: 'cuda_graph' for name in
       ('CUDAGraphModule', 'release_cuda_graphs', 'use_cuda_graphs')})

__all__ = ['PARTS', 'PRECISIONS', 'RUNTIMES', 'CUDAGraphModule', 'ExportWrapper',
           'artifact_path', 'calibration_images', 'convert_to_openvino', 'export_onnx',
           'export_runtime_graphs', 'load_runtime_model', 'max_relative_error', 'open_model',
           'preprocessed_images', 'quantize_onnxruntime', 'quantize_openvino',
           'release_cuda_graphs', 'resolve_precision', 'torch_outputs', 'use_cuda_graphs']


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f'.{_LAZY[name]}', __name__), name)
        globals()[name] = value  # resolved once
        return value
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
