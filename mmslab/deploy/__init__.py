"""Deployment: ONNX export of fused models, onnxruntime / OpenVINO runtimes, INT8, and a
torch-free predictor (``python -m mmslab.deploy.predict``).

The export helpers (``onnx_export``) need PyTorch; they are imported on first use (PEP 562
module ``__getattr__``) so that ``runtimes`` and ``predict`` import without it.
``from mmslab.deploy import export_onnx`` works as before.
"""
import importlib

from .runtimes import (RUNTIMES, artifact_path, calibration_images, convert_to_openvino,
                       load_runtime_model, quantize_onnxruntime, quantize_openvino)

_LAZY = {name: 'onnx_export' for name in
         ('PARTS', 'ExportWrapper', 'export_onnx', 'max_relative_error', 'torch_outputs')}

__all__ = ['PARTS', 'RUNTIMES', 'ExportWrapper', 'artifact_path', 'calibration_images',
           'convert_to_openvino', 'export_onnx', 'load_runtime_model', 'max_relative_error',
           'quantize_onnxruntime', 'quantize_openvino', 'torch_outputs']


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f'.{_LAZY[name]}', __name__), name)
        globals()[name] = value  # resolved once
        return value
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
