"""Denormal floats flushed to zero in onnxruntime sessions, on every computing thread."""
import numpy as np
import pytest

from mmslab.deploy.denormals import can_flush_denormals, flushed_denormals
from mmslab.deploy.runtimes import OnnxRuntimeModel

pytestmark = pytest.mark.skipif(not can_flush_denormals(),
                                reason='flushing needs x86-64 with glibc')

TINY = np.float32(1e-20)  # TINY * TINY_FACTOR = 1e-39: a denormal float32
TINY_FACTOR = np.float32(1e-19)


def _denormal_products() -> np.ndarray:
    return np.full(64, TINY, np.float32) * TINY_FACTOR


def test_flushed_denormals_sets_and_restores_the_calling_thread():
    assert (_denormal_products() > 0).all()  # the process default keeps denormals
    with flushed_denormals():
        assert (_denormal_products() == 0).all()
        with flushed_denormals(enabled=False):  # disabled: leaves the state alone
            assert (_denormal_products() == 0).all()
    assert (_denormal_products() > 0).all()
    with pytest.raises(RuntimeError):
        with flushed_denormals():
            raise RuntimeError('inside')
    assert (_denormal_products() > 0).all()  # restored on the error path too


def _multiply_model(path: str) -> str:
    """``y = x * TINY_FACTOR``: one element-wise product, split across threads."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    graph = helper.make_graph(
        [helper.make_node('Mul', ['image', 'factor'], ['y'])], 'denormal_products',
        [helper.make_tensor_value_info('image', TensorProto.FLOAT, [1, 3, 'h', 'w'])],
        [helper.make_tensor_value_info('y', TensorProto.FLOAT, [1, 3, 'h', 'w'])],
        [numpy_helper.from_array(np.array(TINY_FACTOR), 'factor')])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid('', 17)]), path)
    return path


def test_onnxruntime_model_flushes_on_the_workers_and_the_calling_thread(tmp_path):
    """onnxruntime's own option flushes only on its worker threads: with two threads the
    calling thread's share of a large product stays denormal. The model flushes all of it,
    keeps denormals when asked to, and leaves the calling thread's state as it was (creating
    a session with the option can set the flags on the creating thread)."""
    path = _multiply_model(str(tmp_path / 'mul.onnx'))
    image = np.full((1, 3, 512, 683), TINY, np.float32)  # 2^20 elements: split in chunks
    model = OnnxRuntimeModel(path, threads=2)
    assert (_denormal_products() > 0).all(), 'the session left the flags set on this thread'
    flushed = model(image)[0]
    assert flushed.shape == image.shape
    assert (flushed == 0).all(), f'{(flushed != 0).mean():.1%} of the products are denormal'
    kept = OnnxRuntimeModel(path, threads=2, flush_denormals=False)(image)[0]
    assert (kept > 0).all() and (kept < np.finfo(np.float32).tiny).all()
    # the calling thread is as it was after the runs
    assert (_denormal_products() > 0).all()
