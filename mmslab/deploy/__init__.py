"""Deployment: ONNX export of fused models, onnxruntime / OpenVINO runtimes, INT8."""
from .onnx_export import PARTS, ExportWrapper, export_onnx, max_relative_error, torch_outputs
from .runtimes import (RUNTIMES, artifact_path, calibration_images, convert_to_openvino,
                       load_runtime_model, quantize_onnxruntime, quantize_openvino)

__all__ = ['PARTS', 'RUNTIMES', 'ExportWrapper', 'artifact_path', 'calibration_images',
           'convert_to_openvino', 'export_onnx', 'load_runtime_model', 'max_relative_error',
           'quantize_onnxruntime', 'quantize_openvino', 'torch_outputs']
