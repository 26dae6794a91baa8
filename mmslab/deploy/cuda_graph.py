"""CUDA graphs for inference on a GPU: a module's forward captured once per input signature
and replayed, so that a call costs one graph launch instead of hundreds of kernel launches.

At batch 1 a fast GPU spends most of a Swin-T backbone's forward waiting for the host to
launch its kernels (about 200 of them); the methods' savings in arithmetic then hide behind
launch time. A replayed graph launches all of them at once. Detectors and
segmentors graph their backbone and neck (:func:`use_cuda_graphs`): fixed-shape tensor
programs, where the heads' proposal and box counts vary from image to image.

A graph replays the exact kernels captured, on the same memory:

* inputs are copied into the graph's own input tensors and outputs come back as copies
  (``clone_outputs``, default) or as the graph's output tensors, which the next replay of
  that graph overwrites;
* one graph per input signature (shapes, dtypes, strides, device, autocast state, grad and
  inference mode), up to ``max_graphs`` (the oldest is released first);
* the module's parameters and buffers are checked on every call (the same tensors, storage
  and version counters): a change (``load_state_dict``, ``reparameterize``, ``.to()``, an
  in-place update) releases every graph and captures anew, because the graph would read the
  old storage or keep constants derived from the old values;
* constants that modules cache between calls (window layouts, masks, tiled weights) are
  referenced by the graph: the wrapper keeps them alive for as long as the graph lives, even
  if a module's cache drops them;
* training mode, or a call that records gradients, runs the module eagerly: graphs serve
  inference only;
"""
from collections import OrderedDict
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch import Tensor

from mmslab.utils.tensor_state import tensor_state

__all__ = ['CUDAGraphModule', 'use_cuda_graphs', 'release_cuda_graphs']

Inputs = Union[Tensor, Sequence[Tensor]]


def _flatten(outputs) -> Tuple[List[Tensor], object]:
    """A tensor or a (nested) list / tuple of tensors -> its tensors and the structure."""
    if isinstance(outputs, Tensor):
        return [outputs], None
    if isinstance(outputs, (list, tuple)):
        tensors, spec = [], []
        for item in outputs:
            t, s = _flatten(item)
            spec.append((len(t), s))
            tensors += t
        return tensors, (type(outputs), spec)
    raise TypeError(f'CUDA graphs capture modules whose outputs are tensors or lists / tuples '
                    f'of tensors; got {type(outputs).__name__}')


def _unflatten(tensors: List[Tensor], spec):
    if spec is None:
        return tensors[0]
    kind, parts = spec
    out, i = [], 0
    for n, s in parts:
        out.append(_unflatten(tensors[i:i + n], s))
        i += n
    return kind(out)


def _cached_tensors(module: nn.Module) -> List[Tensor]:
    """Every tensor ``module``'s submodules hold outside their parameters, buffers and
    children (their caches), in attributes that are tensors or dicts / lists / tuples of
    them, nested."""
    found = []

    def collect(value, depth):
        if isinstance(value, Tensor):
            found.append(value)
        elif depth < 4 and isinstance(value, dict):
            for v in value.values():
                collect(v, depth + 1)
        elif depth < 4 and isinstance(value, (list, tuple)):
            for v in value:
                collect(v, depth + 1)

    for m in module.modules():
        for name, value in vars(m).items():
            if name not in ('_parameters', '_buffers', '_modules') and not name.endswith('hooks'):
                collect(value, 0)
    return found


class CUDAGraphModule(nn.Module):
    """``module``'s inference forward replayed from CUDA graphs (see the module docstring).

    Args:
        module: a module on a CUDA device whose forward takes one tensor or a list / tuple
            of tensors and returns tensors (a tensor or nested lists / tuples of them).
        max_graphs: graphs kept at once (each holds its own memory pool).
        warmup: eager calls before a capture, on a side stream (they fill the module's
            caches and make its timed choices, which cannot run inside a capture).
        clone_outputs: return copies of the graph's outputs (default), or the graph's own
            output tensors, valid until the next call with the same input signature.

    ``module`` stays a registered child, so ``state_dict`` keys gain a ``module.`` prefix:
    :func:`release_cuda_graphs` takes the wrappers out again before a checkpoint is saved.
    """

    def __init__(self, module: nn.Module, max_graphs: int = 4, warmup: int = 2,
                 clone_outputs: bool = True):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f'CUDAGraphModule wraps an nn.Module, got {type(module).__name__}')
        if max_graphs < 1 or warmup < 1:
            raise ValueError(f'max_graphs={max_graphs}, warmup={warmup}: both must be >= 1 '
                             '(a capture needs one eager call before it)')
        self.module = module
        self.train(module.training)  # (a new Module starts in training mode)
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.clone_outputs = clone_outputs
        self._graphs = OrderedDict()  # signature -> _Graph
        self._weights = None
        self.captures = 0  # graphs kept so far (re-captures included), for reports

    def extra_repr(self) -> str:
        return f'max_graphs={self.max_graphs}, graphs={len(self._graphs)}'

    def release(self) -> None:
        """Drop every captured graph (and the memory they hold)."""
        self._graphs.clear()
        self._weights = None

    def _weights_changed(self) -> bool:
        """Whether the parameters and buffers are other tensors, or theirs changed
        (:func:`~mmslab.utils.tensor_state.tensor_state`), since the last call; records
        them."""
        tensors = (*self.module.parameters(), *self.module.buffers())
        key = (tensors, tensor_state(*tensors))
        old, self._weights = self._weights, key
        return old is None or len(old[0]) != len(tensors) or old[1] != key[1] or any(
            a is not b for a, b in zip(old[0], tensors))

    def forward(self, inputs: Inputs):
        if self.module.training or (torch.is_grad_enabled() and any(
                p.requires_grad for p in self.module.parameters())):
            return self.module(inputs)  # graphs serve inference only (module docstring)
        flat, spec = _flatten(inputs)
        for t in flat:
            if t.device.type != 'cuda':
                raise ValueError(f'CUDAGraphModule: inputs must be CUDA tensors, got one on '
                                 f'{t.device} (move the model and its inputs to a GPU, or '
                                 'run the module without CUDA graphs)')
        if self._weights_changed():
            self._graphs.clear()
        device = flat[0].device
        signature = self._signature(flat)
        entry = self._graphs.get(signature)
        if entry is None:
            entry = self._capture(flat, spec, device)
            self.captures += 1
            self._graphs[signature] = entry
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(signature)
        for dst, src in zip(entry.inputs, flat):
            dst.copy_(src)
        entry.graph.replay()
        outs = [t.clone() for t in entry.outputs] if self.clone_outputs else list(entry.outputs)
        return _unflatten(outs, entry.out_spec)

    @staticmethod
    def _signature(flat: List[Tensor]) -> tuple:
        return (tuple((tuple(t.shape), t.dtype, t.stride(), t.device) for t in flat),
                torch.is_autocast_enabled('cuda'), torch.get_autocast_dtype('cuda'),
                torch.is_inference_mode_enabled())

    def _capture(self, flat: List[Tensor], spec, device: torch.device) -> '_Graph':
        """Eager warm-up calls and one capture on a copy of ``flat``."""
        static_in = [t.clone() for t in flat]
        # Autocast's cast cache must not feed a capture: a weight cast cached by an earlier
        # call is freed when that autocast region ends, and the graph would read freed memory.
        autocast = torch.autocast('cuda', enabled=torch.is_autocast_enabled('cuda'),
                                  dtype=torch.get_autocast_dtype('cuda'), cache_enabled=False)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.device(device), autocast:
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self.module(_unflatten(static_in, spec))
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs = self.module(_unflatten(static_in, spec))
        static_out, out_spec = _flatten(outputs)
        # (the caches' tensors the graph may read, kept alive with it)
        return _Graph(graph, static_in, static_out, out_spec, _cached_tensors(self.module))


class _Graph:
    """One captured graph: its static inputs and outputs, the output structure and the
    cached tensors it may read."""

    def __init__(self, graph, inputs, outputs, out_spec, kept):
        self.graph, self.inputs, self.outputs, self.out_spec = graph, inputs, outputs, out_spec
        self.kept = kept


GRAPHED_PARTS = ('backbone', 'neck')


def use_cuda_graphs(model: nn.Module, parts: Sequence[str] = GRAPHED_PARTS,
                    **kwargs) -> nn.Module:
    """Wrap ``model``'s ``parts`` (attributes: a detector's or segmentor's ``backbone`` and
    ``neck``) in :class:`CUDAGraphModule`, in place; parts the model lacks or has as None
    are skipped, parts already wrapped are kept. ``kwargs`` go to :class:`CUDAGraphModule`.
    Returns ``model``."""
    unknown = [p for p in parts if not isinstance(p, str) or not p]
    if unknown:
        raise ValueError(f'parts must be attribute names such as {GRAPHED_PARTS}, got {unknown}')
    wrapped = 0
    for name in parts:
        part = getattr(model, name, None)
        if isinstance(part, CUDAGraphModule):
            wrapped += 1
        elif isinstance(part, nn.Module):
            setattr(model, name, CUDAGraphModule(part, **kwargs))
            wrapped += 1
    if not wrapped:
        raise ValueError(f'{type(model).__name__} has none of the parts {list(parts)} to run '
                         'from CUDA graphs')
    return model


def release_cuda_graphs(model: nn.Module) -> nn.Module:
    """Undo :func:`use_cuda_graphs`: every :class:`CUDAGraphModule` child of ``model``
    replaced by the module it wraps (graphs released). Returns ``model``."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, CUDAGraphModule):
                child.release()
                setattr(parent, name, child.module)
    return model


def graph_captures(model: nn.Module) -> Optional[int]:
    """Graphs captured by ``model``'s :class:`CUDAGraphModule` parts so far, None if it has
    none."""
    counts = [m.captures for m in model.modules() if isinstance(m, CUDAGraphModule)]
    return sum(counts) if counts else None

