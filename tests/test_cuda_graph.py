"""CUDA-graph replay (mmslab.deploy.cuda_graph) on the CPU: what does not need a GPU (the
wrapper's contract, its refusals, the structures it flattens, the caches it keeps alive).
Replay itself is tested on a GPU in tests/test_cuda.py."""
import pytest
import torch
import torch.nn as nn

import mmslab
from presets import build_preset
from mmslab.deploy.cuda_graph import (CUDAGraphModule, _cached_tensors, _flatten, _unflatten,
                                      graph_captures, release_cuda_graphs, use_cuda_graphs)


def test_outputs_round_trip_through_their_structure():
    a, b, c = torch.randn(2), torch.randn(3), torch.randn(1)
    for value in [a, (a, b), [a, (b, c)], ((a,), [b, c])]:
        tensors, spec = _flatten(value)
        back = _unflatten(tensors, spec)
        assert type(back) is type(value)
        assert [t is u for t, u in zip(_flatten(back)[0], tensors)] == [True] * len(tensors)
    with pytest.raises(TypeError, match='dict'):
        _flatten({'x': a})


def test_refusals_name_the_problem():
    with pytest.raises(TypeError, match='nn.Module'):
        CUDAGraphModule(lambda x: x)
    with pytest.raises(ValueError, match='max_graphs=0'):
        CUDAGraphModule(nn.Identity(), max_graphs=0)
    graphed = CUDAGraphModule(nn.Linear(4, 4).eval())
    assert not graphed.training  # the wrapped module's mode: an eval model replays
    with torch.no_grad(), pytest.raises(ValueError, match='CUDA tensors.*cpu'):
        graphed(torch.randn(2, 4))
    with pytest.raises(ValueError, match='none of the parts'):
        use_cuda_graphs(nn.Linear(2, 2))
    with pytest.raises(ValueError, match='attribute names'):
        use_cuda_graphs(nn.Linear(2, 2), parts=[None])


def test_training_and_gradient_calls_run_eagerly():
    """Graphs serve inference only: a training call, or one that records gradients, is the
    module's own forward (on the CPU too: nothing is captured, gradients flow)."""
    lin = nn.Linear(4, 3)
    graphed = CUDAGraphModule(lin)
    x = torch.randn(2, 4)
    out = graphed.train()(x)
    out.sum().backward()
    assert lin.weight.grad is not None and torch.equal(out, lin(x))
    assert torch.equal(graphed.eval()(x), lin(x))  # grad mode on: eager as well
    assert graphed.captures == 0


def test_wrapping_and_releasing_keep_the_model_and_its_keys():
    model = nn.Module()
    model.backbone = nn.Linear(4, 4)
    model.neck = nn.Linear(4, 2)
    model.head = nn.Linear(2, 1)
    keys = list(model.state_dict())
    backbone = model.backbone
    use_cuda_graphs(model)
    assert isinstance(model.backbone, CUDAGraphModule) and model.backbone.module is backbone
    assert not isinstance(model.head, CUDAGraphModule)
    use_cuda_graphs(model)  # idempotent: no wrapper around a wrapper
    assert model.backbone.module is backbone
    assert graph_captures(model) == 0
    release_cuda_graphs(model)
    assert model.backbone is backbone and list(model.state_dict()) == keys
    assert graph_captures(model) is None
    model.neck = None  # a part set to None (a model without a neck) is skipped
    use_cuda_graphs(model)
    assert model.neck is None and isinstance(model.backbone, CUDAGraphModule)


def test_the_caches_a_graph_may_read_are_found():
    """After an inference call, a fused SLAB-Swin's cached constants (window layouts, the
    window attention's masks) are tensors outside its parameters and buffers: the wrapper
    keeps them alive with a graph, whatever the modules' caches drop later."""
    torch.manual_seed(0)
    model = build_preset('SLABSwin')
    model.init_weights()
    mmslab.reparameterize(model.eval())
    before = _cached_tensors(model)
    with torch.no_grad():
        model(torch.randn(1, 3, 61, 83))
    found = _cached_tensors(model)
    assert len(found) > len(before)
    owned = {t.data_ptr() for t in (*model.parameters(), *model.buffers())}
    assert sum(t.data_ptr() not in owned for t in found) > 0
    sla = next(m for m in model.modules() if hasattr(m, '_layouts') and m.w_msa.masks_padding)
    (layout, ) = sla._layouts.values()
    assert any(t is layout['groups'][-1]['gather'] for t in found)


def test_a_weight_change_is_seen_whatever_makes_it():
    """The graphs read the weights' storage as it was at capture: the wrapper must notice
    an in-place update (load_state_dict, an optimizer step), a swapped storage (``.to()``)
    and a replaced parameter, and nothing else."""
    lin = nn.Linear(4, 3)
    graphed = CUDAGraphModule(lin.eval())
    assert graphed._weights_changed()  # first call: nothing recorded
    assert not graphed._weights_changed()
    with torch.no_grad():
        lin.weight.mul_(2)
    assert graphed._weights_changed() and not graphed._weights_changed()
    lin.load_state_dict(nn.Linear(4, 3).state_dict())
    assert graphed._weights_changed() and not graphed._weights_changed()
    lin.double()
    assert graphed._weights_changed() and not graphed._weights_changed()
    lin.bias = nn.Parameter(lin.bias.detach().clone())
    assert graphed._weights_changed() and not graphed._weights_changed()
    graphed.release()
    assert graphed._weights_changed()


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: counts its captures."""

    captures = 0

    def replay(self):
        pass


def test_a_capture_records_the_models_own_forward(monkeypatch):
    """The CUDA calls of a capture replaced by CPU stand-ins: one capture per call, whose
    outputs are the model's own forward's (no form is chosen by timing replays)."""
    import contextlib

    class Stream:
        def __init__(self, *args):
            pass

        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def capture(graph):
        graph.captures += 1
        yield

    null = lambda *args, **kwargs: contextlib.nullcontext()  # noqa: E731
    for name, value in dict(Stream=Stream, current_stream=lambda *a: Stream(), device=null,
                            stream=null, CUDAGraph=_FakeGraph, graph=capture).items():
        monkeypatch.setattr(torch.cuda, name, value)
    model = build_preset('SLABSwin').eval()
    graphed = CUDAGraphModule(model)
    untiled = [torch.randn(1, 3, 61, 83)]
    with torch.inference_mode():
        entry = graphed._capture(untiled, None, torch.device('cpu'))
        assert entry.graph.captures == 1 and len(entry.outputs) == 4
        for out, ref in zip(entry.outputs, model(*untiled)):
            assert torch.equal(out, ref)
