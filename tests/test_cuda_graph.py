"""CUDA-graph replay (mmslab.deploy.cuda_graph) on the CPU: what does not need a GPU (the
wrapper's contract, its refusals, the structures it flattens, the caches it keeps alive).
Replay itself is tested on a GPU in tests/test_cuda.py."""
import pytest
import torch
import torch.nn as nn

import mmslab
from presets import build_preset
from mmslab.deploy.cuda_graph import (CUDAGraphModule, _cached_tensors, _flatten, _unflatten,
                                      graph_captures, graph_window_forms, release_cuda_graphs,
                                      use_cuda_graphs)
from mmslab.models.layers.export_mode import export_mode
from mmslab.models.layers.shift_window import recording_masked_windows


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
    """After an inference call, a fused SLAB-Swin's cached constants (window layouts, SLA's
    tiled DWC weights) are tensors outside its parameters and buffers: the wrapper keeps
    them alive with a graph, whatever the modules' caches drop later."""
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
    sla = next(m for m in model.modules() if type(m).__name__ == 'SLA')
    tiled = sla._tiled_cache[3][0]
    assert any(t is tiled for t in found)


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



def test_the_masked_window_choices_a_forward_makes_are_recorded():
    """What the wrapper learns before deciding to time graphs of each masked-window form:
    the forms ``auto`` took on a map SLA's windows (8 in stage 1) do not tile; nothing on a
    map they tile, nothing where a form is set."""
    model = build_preset('SLABSwin').eval()
    with torch.no_grad():
        with recording_masked_windows() as seen:
            model(torch.randn(1, 3, 61, 83))
        # stage 1 (16x21 tokens) and 2 (8x11) hold two SLA blocks each, every one untiled
        assert len(seen) == 4 and set(seen) <= {'compact', 'padded'}
        with recording_masked_windows() as seen:
            model(torch.randn(1, 3, 64, 64))
        assert seen == []
        with recording_masked_windows() as seen, export_mode(masked_windows='padded'):
            model(torch.randn(1, 3, 61, 83))
        assert seen == []
    graphed = CUDAGraphModule(nn.Identity())
    graphed.window_forms['1x3x8x8 float32'] = dict(impl='padded', auto_ms=2.0, padded_ms=1.0)
    model = nn.Module()
    model.backbone = graphed
    assert graph_window_forms(model) == {
        'backbone: 1x3x8x8 float32': dict(impl='padded', auto_ms=2.0, padded_ms=1.0)}


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: records the masked-windows setting it
    was captured under."""

    def __init__(self):
        self.setting = None

    def replay(self):
        pass


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    """The CUDA calls of a capture replaced by CPU stand-ins, so that the wrapper's choice
    between graphs of each masked-window form runs here; ``times`` sets each candidate's
    replay time."""
    import contextlib

    import mmslab.deploy.cuda_graph as cuda_graph
    from mmslab.models.layers.export_mode import masked_windows_setting

    class Stream:
        def __init__(self, *args):
            pass

        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def capture(graph):
        graph.setting = masked_windows_setting()
        yield

    null = lambda *args, **kwargs: contextlib.nullcontext()  # noqa: E731
    for name, value in dict(Stream=Stream, current_stream=lambda *a: Stream(), device=null,
                            stream=null, CUDAGraph=_FakeGraph, graph=capture).items():
        monkeypatch.setattr(torch.cuda, name, value)
    times = {}

    def fastest_ms(fns, device, repeat):
        assert repeat >= 3
        return {form: times[form] for form in fns}

    monkeypatch.setattr(cuda_graph, 'fastest_ms', fastest_ms)
    return times


def test_graphs_of_each_masked_window_form_are_timed_and_the_fastest_kept(fake_cuda_graphs,
                                                                          monkeypatch):
    import mmslab.models.layers.shift_window as shift_window

    # the eager timing made to take the cropped windows in every block
    monkeypatch.setattr(shift_window, '_MASKED_CHOICES', {})
    monkeypatch.setattr(shift_window, 'fastest_ms', lambda fns, device: {
        form: 1.0 if form.startswith('compact') else 2.0 for form in fns})
    model = build_preset('SLABSwin').eval()
    graphed = CUDAGraphModule(model)
    untiled = [torch.randn(1, 3, 61, 83)]
    with torch.inference_mode():
        # padded replays 2x faster than the eager choices: kept, captured as padded
        fake_cuda_graphs.update(auto=2.0, compact=2.5, padded=1.0)
        entry = graphed._capture(untiled, None, torch.device('cpu'))
        assert entry.form == 'padded' and entry.graph.setting == 'padded'
        (record, ) = graphed.window_forms.values()
        assert record['impl'] == 'padded' and record['padded_ms'] == 1.0
        # (all-compact is the eager choices' graph: not captured twice)
        assert record['eager'] == ['compact'] and 'compact_ms' not in record
        # 5 % is no clear win: the eager choices' graph stays
        fake_cuda_graphs.update(auto=1.0, padded=0.95)
        entry = graphed._capture(untiled, None, torch.device('cpu'))
        assert entry.form == 'auto' and entry.graph.setting == 'auto'
        # a map the windows tile: one graph, no choice recorded
        entry = graphed._capture([torch.randn(1, 3, 64, 64)], None, torch.device('cpu'))
        assert entry.form is None and len(graphed.window_forms) == 1
        # a form set by the user: captured as set, untimed
        fake_cuda_graphs.clear()
        with export_mode(masked_windows='compact'):
            entry = graphed._capture(untiled, None, torch.device('cpu'))
        assert entry.form is None and entry.graph.setting == 'compact'
