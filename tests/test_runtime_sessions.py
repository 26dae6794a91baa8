"""The options every onnxruntime session of the runtime layer is opened with."""
import numpy as np
import pytest

pytest.importorskip('onnxruntime')

from mmslab.deploy.runtimes import ORT_SPIN_STOP, OnnxRuntimeModel  # noqa: E402


def _add_one_model(path: str) -> str:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    graph = helper.make_graph(
        [helper.make_node('Add', ['image', 'one'], ['y'])], 'add_one',
        [helper.make_tensor_value_info('image', TensorProto.FLOAT, [1, 3, 'h', 'w'])],
        [helper.make_tensor_value_info('y', TensorProto.FLOAT, [1, 3, 'h', 'w'])],
        [numpy_helper.from_array(np.array(1.0, np.float32), 'one')])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid('', 17)]), path)
    return path


@pytest.mark.parametrize('threads', [0, 2])
def test_onnxruntime_sessions_stop_spinning_when_a_run_returns(tmp_path, threads):
    """A session's workers spinning after its run hold a core while the next thing runs
    (another session, PyTorch, OpenVINO, pre-processing): the open session carries the
    option, whatever the thread count, and still computes."""
    model = OnnxRuntimeModel(_add_one_model(str(tmp_path / 'add.onnx')), threads=threads)
    key, value = ORT_SPIN_STOP
    assert key == 'session.force_spinning_stop' and value == '1'
    assert model.session.get_session_options().get_session_config_entry(key) == value
    image = np.random.RandomState(0).randn(1, 3, 8, 8).astype(np.float32)
    np.testing.assert_array_equal(model(image)[0], image + 1)
