"""Graph forms of layers, registered per layer class and runtime and bound to one model's
layers only while exporting (:func:`rewritten`), as mmdeploy's function rewriters. A rewrite
gives the layer's own numbers in a form the runtime runs faster.
"""
from contextlib import contextmanager
from types import MethodType
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch.nn as nn

#: ``(layer class, method name) -> {(runtime, form): function}``; form None: every export.
REWRITERS: Dict[Tuple[type, str], Dict[Tuple[str, Optional[str]], Callable]] = {}
#: The runtimes a rewrite may target.
RUNTIMES = ('onnxruntime', 'openvino')


def register_rewriter(layer: type, method: str, runtimes: Sequence[str] = RUNTIMES,
                      form: Optional[str] = None):
    """Decorator: ``fn(self, ...)`` becomes ``layer.method`` in graphs exported for each of
    ``runtimes``: in every export, or with ``form`` only in those that ask for that form
    (:func:`rewritten`'s ``forms``)."""
    unknown = set(runtimes) - set(RUNTIMES)
    if unknown:
        raise ValueError(f'unknown runtimes {sorted(unknown)}; valid: {RUNTIMES}')

    def register(fn: Callable) -> Callable:
        for runtime in runtimes:
            REWRITERS.setdefault((layer, method), {})[runtime, form] = fn
        return fn
    return register


@contextmanager
def rewritten(model: nn.Module, runtime: str, forms: Sequence[str] = ()) -> Iterator[int]:
    """Inside the block, every module of ``model`` whose class has a rewrite for ``runtime``
    (of every export, or of one of ``forms``) runs it, bound to the instance (the class and
    other models are untouched); a form's rewrite wins over the plain one. Yields the number
    of methods bound. The instances' own attributes are restored on every exit path."""
    if runtime not in RUNTIMES:
        raise ValueError(f'unknown runtime {runtime!r}; valid: {RUNTIMES}')
    bound = []
    try:
        for module in model.modules():
            for (layer, method), fns in REWRITERS.items():
                if not isinstance(module, layer):
                    continue
                chosen = [fns[k] for k in [(runtime, f) for f in forms] + [(runtime, None)]
                          if k in fns]
                if chosen and not any(o is module and m == method for o, m, _ in bound):
                    bound.append((module, method, module.__dict__.get(method)))
                    setattr(module, method, MethodType(chosen[0], module))
        yield len(bound)
    finally:
        for module, method, own in reversed(bound):
            if own is None:
                delattr(module, method)
            else:
                setattr(module, method, own)
