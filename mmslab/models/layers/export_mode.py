"""How mmslab layers run while a graph is made of them: one state, one context manager.

These choices change the form a layer takes (never its numbers):

* ``layout`` (``packed`` | ``split``): the form window softmax attention takes in graphs
  exported inside the block.

  - ``packed``: ``qkv`` on the tokens, windows gathered from its ``3C`` output, q, k and v
    taken from one 5-D transpose (the eager computation, written out);
  - ``split``: windows gathered from the ``C``-channel tokens (a third of the data), then
    q, k, v as three MatMuls, each followed by the ``(0, 2, 1, 3)`` / ``(0, 2, 3, 1)``
    transpose of the standard multi-head attention pattern (which OpenVINO's CPU plugin
    fuses into its attention kernel), the scale folded into q's weights. A kernel takes it
    when it has the form (``attends_tokens``) and some raw token is what a padded slot holds
    after ``qkv`` (:meth:`~mmslab.models.layers.window_attention.WindowKernelBase.padded_token`).

  Which is faster depends on the runtime, precision and CPU, so ``tools/export_onnx.py``
  records the choice in ``export.json``. Only graphs being traced take it: eager and compiled
  runs always compute the packed form.
* ``head_layout`` (``window_major`` | ``token_major``): how the ``split`` layout's q, k, v
  reach their ``[B', heads, N, d]`` form.

  - ``window_major``: the ``[B', N, C]`` windows go into the three MatMuls and each output
    is transposed: the standard multi-head pattern, which OpenVINO fuses;
  - ``token_major``: the windows are transposed once to ``[N, B', C]`` before the MatMuls,
    and q, k, v are taken with ``(1, 2, 0, 3)`` / ``(1, 2, 3, 0)`` permutations, which
    onnxruntime folds into the attention products (``FusedMatMul`` with ``transBatch``): one
    Transpose of the ``C`` channels instead of three. OpenVINO fuses none of it and runs
    it slower, so each runtime gets its own graph (:data:`RUNTIME_HEAD_LAYOUTS`).
* ``symbolic`` (bool): layers compute every size-dependent quantity (padding, window
  partition, shift mask, pooling bins) from the runtime shape, so a traced graph serves any
  input size (see :mod:`mmslab.models.layers.symbolic`). ``torch.compile`` takes the same
  path while dynamo traces.
* ``linear_attention`` (``auto`` | ``heads`` | ``blockdiag``): how SLA forms its per-head
  products, in eager runs and graphs alike: ``heads`` splits the channels into
  ``[B', heads, N, d]`` (transposes around two small MatMuls), ``blockdiag`` computes
  ``K^T V`` on all ``C`` channels masked to its per-head blocks (``heads``-fold multiply-adds,
  no transposes). ``auto``: ``blockdiag`` for at most :data:`BLOCKDIAG_MAX_HEADS` heads
  (SLAB-Swin-T's 3 and 6), where it was faster in eager PyTorch and OpenVINO on the CPU
  measured (docs/benchmarks.md), ``heads`` above; in a ``token_major`` graph, window SLA
  gathers its windows token-major and takes ``heads`` (``SLA.attend_token_major``: the
  permutations fold into onnxruntime's products, no transposes either). The same numbers
  every way. Under ``auto``, eager CPU inference also runs window SLA in chunks of
  windows (``qkv``, per-head products and ``proj`` per chunk; see
  ``masked_windows``); an explicit form keeps the whole-map computation in that form.
* ``window_softmax`` (``auto`` | ``sdpa`` | ``matmul``): how eager window softmax attention
  is computed; ``auto``: ``sdpa`` (PyTorch's fused attention, as in training), ``matmul``
  in exported and compiled graphs
  (:func:`~mmslab.models.layers.window_attention.choose_window_softmax`).
* ``masked_windows`` (``auto`` | ``compact`` | ``padded`` | either ``_chunked``): how eager
  runs compute the windows of a kernel that masks padding (SLA, BiNorm) on a map the
  windows do not tile:
  ``compact`` crops them to their valid spans, one kernel call per group of equal spans (no
  padded slot computed: least arithmetic), ``padded`` runs every padded window in one call
  with the padded slots masked (fewest kernel launches). Either, suffixed ``_chunked``
  (``compact_chunked``), in chunks of windows small enough to stay in cache, where the
  kernel has that form (SLA) in eager CPU inference, and the whole map elsewhere. ``auto``:
  ``compact`` on the CPU, chunked where chunks apply, ``padded`` on a GPU, in training and
  inference alike (:func:`~mmslab.models.layers.shift_window.choose_masked_windows`);
  traced graphs take ``compact``. The same numbers in every form.

No choice is made by timing: the same input gives the same output in every run.
Use :func:`export_mode` to set any of them for a ``with`` block; :func:`current_export_mode`
reads them.
"""
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

ATTENTION_LAYOUTS = ('packed', 'split')
HEAD_LAYOUTS = ('window_major', 'token_major')
#: The head layout each runtime's graph is traced in (measured: docs/benchmarks.md).
RUNTIME_HEAD_LAYOUTS = dict(onnxruntime='token_major', openvino='window_major')
LINEAR_ATTENTION_FORMS = ('auto', 'heads', 'blockdiag')
WINDOW_SOFTMAX_CHOICES = ('auto', 'sdpa', 'matmul')
MASKED_WINDOWS_CHOICES = ('auto', 'compact', 'padded', 'compact_chunked', 'padded_chunked')
#: ``linear_attention='auto'`` takes the block-diagonal form up to this many heads.
BLOCKDIAG_MAX_HEADS = 6


def _checked_choice(value: str, source: str, choices=WINDOW_SOFTMAX_CHOICES) -> str:
    if value not in choices:
        raise ValueError(f'{source}={value!r}; valid: {", ".join(choices)}')
    return value


_state = dict(layout='packed', head_layout='window_major', symbolic=False,
              linear_attention='auto', window_softmax='auto', masked_windows='auto')


@contextmanager
def export_mode(layout: Optional[str] = None, symbolic: Optional[bool] = None,
                window_softmax: Optional[str] = None,
                linear_attention: Optional[str] = None,
                head_layout: Optional[str] = None,
                masked_windows: Optional[str] = None) -> Iterator[None]:
    """Set the given choices (``None`` keeps the current one) inside the ``with`` block; the
    previous ones are restored on every exit path."""
    if layout is not None:
        check_attention_layout(layout)
    if head_layout is not None and head_layout not in HEAD_LAYOUTS:
        raise ValueError(f'unknown head layout {head_layout!r}; valid: {HEAD_LAYOUTS}')
    if window_softmax is not None:
        _checked_choice(window_softmax, 'window_softmax')
    if masked_windows is not None:
        _checked_choice(masked_windows, 'masked_windows', MASKED_WINDOWS_CHOICES)
    if linear_attention is not None and linear_attention not in LINEAR_ATTENTION_FORMS:
        raise ValueError(f'unknown linear attention form {linear_attention!r}; valid: '
                         f'{LINEAR_ATTENTION_FORMS}')
    changes = {k: v for k, v in dict(layout=layout, head_layout=head_layout, symbolic=symbolic,
                                     window_softmax=window_softmax,
                                     linear_attention=linear_attention,
                                     masked_windows=masked_windows).items()
               if v is not None}
    previous = dict(_state)
    _state.update(changes)
    try:
        yield
    finally:
        _state.clear()
        _state.update(previous)


def current_export_mode() -> dict:
    """``{'layout', 'head_layout', 'symbolic', 'linear_attention', 'window_softmax'}`` as
    set now."""
    return dict(_state)


def check_attention_layout(layout: str) -> str:
    """``layout`` if it is one of :data:`ATTENTION_LAYOUTS`, else a ``ValueError`` naming them."""
    if layout not in ATTENTION_LAYOUTS:
        raise ValueError(f'unknown attention layout {layout!r}; valid: {ATTENTION_LAYOUTS}')
    return layout


def head_layout_setting() -> str:
    return _state['head_layout']


def window_softmax_setting() -> str:
    return _state['window_softmax']


def masked_windows_setting() -> str:
    return _state['masked_windows']


def linear_attention_setting() -> str:
    return _state['linear_attention']


def linear_attention_form(kernel, token_major: bool = False) -> str:
    """``heads`` or ``blockdiag``: the form SLA ``kernel`` computes in under the current
    ``linear_attention`` choice; ``token_major``: on windows gathered token-major (graphs in
    the ``token_major`` head layout), where ``auto`` takes ``heads``, whose permutations
    onnxruntime folds into its products."""
    form = _state['linear_attention']
    if form == 'auto':
        if token_major:
            return 'heads'
        return 'blockdiag' if kernel.num_heads <= BLOCKDIAG_MAX_HEADS else 'heads'
    return form


def compiling() -> bool:
    """Whether dynamo is tracing the call (``torch.compile``, ``torch.export``)."""
    return torch.compiler.is_compiling()


def exporting() -> bool:
    """Whether the call is being traced into a graph (ONNX export, ``torch.jit.trace``)."""
    return torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()


def symbolic_shapes_enabled() -> bool:
    """Layers take the shape-generic path: ``symbolic=True``, or ``torch.compile`` traces."""
    return _state['symbolic'] or compiling()


def _split_token(kernel, layout: str):
    """The padded token ``kernel`` is exported with under ``layout``, or None for the
    ``packed`` form (the other layout, no split form, or a folded norm that no raw token
    maps to zero)."""
    if layout != 'split' or not kernel.attends_tokens:
        return None
    return kernel.padded_token()


def takes_split_layout(kernel, layout: str) -> bool:
    """Whether a window kernel is exported in the ``split`` form under ``layout``."""
    return _split_token(kernel, layout) is not None


def split_layout_token(kernel):
    """``[C]`` padded token of a kernel exported now in the ``split`` layout, or None when it
    takes the ``packed`` form (not exporting, or as :func:`takes_split_layout` says)."""
    return _split_token(kernel, _state['layout']) if exporting() else None
