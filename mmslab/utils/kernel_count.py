"""Count the ATen operators that launch device work, and the host syncs, of any PyTorch code.

Where a GPU spends a step launching kernels rather than computing (small per-kernel work,
as in a Swin backbone's training step at detection sizes), the number of kernels a step
launches is its cost; it does not depend on the device the code runs on, so a CPU can
count it::

    with mmslab.run_code_path('cuda'), KernelCounter() as counter:
        with torch.autocast('cpu', dtype=torch.bfloat16):
            loss = model(x).mean()
        loss.backward()
    counter.kernels          # e.g. 1234
    counter.ops.most_common(10)

The rule (:class:`KernelCounter`; docs/benchmarks.md, "GPU kernels per training step"):

* A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every ATen operator below
  autograd: the forward's, the backward operators the autograd engine runs (gradient
  accumulation included) and autocast's casts (``_to_copy``). An operator the mode sees is
  one call; what a kernel calls internally is not seen again.
* **Kernels**: every call except the metadata-only ones: views (``func.is_view``, the
  schema's output aliases an input: ``view``, ``t``, ``transpose``, ``permute``, ``expand``,
  ``unsqueeze``, ``select``, ``slice``, ``split``, ``detach``, ``alias``, ``as_strided``,
  ``_reshape_alias``, ``lift_fresh``, ...), :data:`METADATA_OPS` (allocations without a
  fill, in-place metadata changes, ``_unsafe_view``, size queries) and operators that
  return values only (``promote_types``) unless they are host syncs. One operator stands for
  one launch; a few launch two or three on a GPU (a convolution's backward, a fused
  attention), which the count does not split.
* **Host syncs**: the calls :func:`host_sync` names, where the host waits for the device
  (a value read back, or an output whose size depends on the data): ``_local_scalar_dense``
  (``.item()``, ``int()`` / ``float()`` / ``bool()`` of a tensor), ``nonzero``,
  ``masked_select``, ``unique`` forms, ``bincount``, ``repeat_interleave`` without
  ``output_size``, ``equal``, ``allclose``, ``is_nonzero``, and ``index`` / ``index_put_``
  with a bool or uint8 index (a ``nonzero`` inside). Each is counted as a kernel too.

Stand-ins, for counting on a CPU what a GPU runs: the tensors are CPU tensors (inside
:func:`mmslab.run_code_path` ``('cuda')`` the layers take their GPU forms), and
``torch.autocast('cpu', torch.bfloat16)`` stands in for CUDA autocast: the same kind of
casts, though CUDA's autocast runs more operators in float32 (``layer_norm``, ``softmax``,
reductions) and so casts more. Not seen: PyTorch extensions called outside the dispatcher
(mmcv's compiled ops are seen only through the ATen operators their CPU code calls) and the
device-to-host copies a CUDA model makes by hand (``.cpu()``, ``.tolist()``, ``.numpy()``
are no-ops on CPU tensors).

The mode changes nothing it counts: each operator runs as called, with the same arguments.
"""
import contextlib
import functools
import os.path as osp
import traceback
from collections import Counter
from typing import Dict, Iterable, Iterator, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten

#: Operators that are no view by their schema and launch no device work: allocations
#: without a fill, in-place changes of sizes / strides, ``_unsafe_view`` (a view that
#: reshape returns as a new tensor) and size queries.
METADATA_OPS = frozenset({
    'empty', 'empty_strided', 'empty_like', 'new_empty', 'new_empty_strided', '_unsafe_view',
    'set_', 'resize_', 'resize_as_', 'as_strided_', 't_', 'transpose_', 'squeeze_',
    'unsqueeze_', 'detach_', 'sym_size', 'sym_stride', 'sym_numel', 'sym_storage_offset',
    'is_same_size', '_has_compatible_shallow_copy_type',
})

#: Operators that make the host wait for the device whatever their arguments.
SYNC_OPS = frozenset({
    '_local_scalar_dense', 'nonzero', 'masked_select', 'unique', '_unique', '_unique2',
    'unique_dim', 'unique_consecutive', 'unique_dim_consecutive', 'bincount', 'equal',
    'allclose', 'is_nonzero',
})

#: Indexing operators that sync when an index is a mask (bool / uint8): they call nonzero.
MASK_INDEX_OPS = frozenset({'index', 'index_put', 'index_put_', '_index_put_impl_'})

#: The rule in one line, recorded with every count.
RULE = ('ATen operators seen by a TorchDispatchMode below autograd (forward, backward, '
        'autocast casts); kernels: every call but views (func.is_view), '
        'mmslab.utils.kernel_count.METADATA_OPS and value-only queries (promote_types) '
        'other than host syncs; host syncs: mmslab.utils.kernel_count.host_sync '
        '(_local_scalar_dense, nonzero, masked_select, unique*, bincount, repeat_interleave '
        'without output_size, equal, allclose, is_nonzero, index / index_put_ with a bool '
        "or uint8 index); mmcv's compiled ops one kernel per call, NMS a host sync")


def op_name(func) -> str:
    """``'mm'`` for ``aten.mm.default``; other namespaces keep theirs (``'mmcv::nms'``)."""
    namespace = func.namespace
    name = func._schema.name.split('::', 1)[-1]
    return name if namespace == 'aten' else f'{namespace}::{name}'


@functools.lru_cache(maxsize=None)
def launches_work(func) -> bool:
    """Whether ``func`` (an ATen overload) counts as a kernel: not a view, not in
    :data:`METADATA_OPS`, not a TorchScript ``prim`` query, and not a query that returns
    values only (a dtype, a size: ``promote_types``) unless it reads the device (a host
    sync: ``_local_scalar_dense``, ``equal``)."""
    if func.is_view or func.namespace == 'prim' or op_name(func) in METADATA_OPS:
        return False
    returns = func._schema.returns
    values_only = bool(returns) and not any('Tensor' in str(r.type) for r in returns)
    return not values_only or op_name(func) in SYNC_OPS


def _has_mask_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


def host_sync(func, args, kwargs) -> bool:
    """Whether calling ``func(*args, **kwargs)`` makes the host wait for the device."""
    name = op_name(func)
    if name in SYNC_OPS:
        return True
    if name == 'repeat_interleave':  # Tensor repeats: the output's size is their sum
        return func._overloadname in ('Tensor', 'self_Tensor') and \
            kwargs.get('output_size') is None
    return name in MASK_INDEX_OPS and _has_mask_index(args)


_THIS_FILE = osp.abspath(__file__)
_TORCH_DIR = osp.dirname(osp.abspath(torch.__file__))


def call_site() -> str:
    """Where a host sync comes from: ``'package/file.py:line (function)'`` of the innermost
    caller outside torch and this module, or in a backward ``'backward of <node>'``."""
    node = torch._C._current_autograd_node()
    if node is not None:
        return f'backward of {type(node).__name__}'
    for frame in reversed(traceback.extract_stack()):
        path = osp.abspath(frame.filename)
        if path == _THIS_FILE or path.startswith(_TORCH_DIR + osp.sep):
            continue
        short = path.split('site-packages' + osp.sep, 1)[-1]
        for root in ('mmslab', 'tests', 'tools', 'benchmarks'):
            marker = osp.sep + root + osp.sep
            if marker in short and 'site-packages' not in path:
                short = root + osp.sep + short.rsplit(marker, 1)[-1]
                break
        return f'{short}:{frame.lineno} ({frame.name})'
    return 'unknown'


class KernelCounter(TorchDispatchMode):
    """Counts kernels and host syncs (the module docstring's rule) of the code run inside it.

    Counts are kept per *region*: a forward operator goes to :attr:`region` (set it between
    calls, or let :class:`ModuleRegions` set it per submodule); a backward operator to the
    region of the autograd node that runs it (:attr:`node_regions`), else to
    :attr:`backward_region`.

    Args:
        region (str): The region of forward operators until changed. Default: 'forward'.
        backward_region (str): The region of backward operators of nodes no region took.
            Default: 'backward'.
        sync_sites (bool): Also record where each host sync is called from
            (:func:`call_site`, in :attr:`sync_sites`). Default: True.

    Attributes:
        ops (Counter): kernels per operator name, all regions.
        sync_ops (Counter): host syncs per operator name, all regions.
        sync_sites (Counter): host syncs per call site.
        regions (dict): region -> ``{'ops': Counter, 'sync_ops': Counter}``.
    """

    def __init__(self, region: str = 'forward', backward_region: str = 'backward',
                 sync_sites: bool = True):
        super().__init__()
        self.region, self.backward_region = region, backward_region
        self.record_sites = sync_sites
        self.ops: Counter = Counter()
        self.sync_ops: Counter = Counter()
        self.sync_sites: Counter = Counter()
        self.regions: Dict[str, dict] = {}
        self.node_regions: Dict[object, str] = {}

    @property
    def kernels(self) -> int:
        return sum(self.ops.values())

    @property
    def syncs(self) -> int:
        return sum(self.sync_ops.values())

    def _region_now(self) -> str:
        node = torch._C._current_autograd_node()
        if node is None:
            return self.region
        return self.node_regions.get(node, self.backward_region)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        work = launches_work(func)
        sync = host_sync(func, args, kwargs)
        if work or sync:
            self.record(op_name(func), work, sync)
        return func(*args, **kwargs)

    def record(self, name: str, work: bool = True, sync: bool = False) -> None:
        """Count one call of ``name``: a kernel where ``work``, a host sync where ``sync``."""
        region = self.regions.setdefault(self._region_now(),
                                         dict(ops=Counter(), sync_ops=Counter()))
        if work:
            self.ops[name] += 1
            region['ops'][name] += 1
        if sync:
            self.sync_ops[name] += 1
            region['sync_ops'][name] += 1
            if self.record_sites:
                self.sync_sites[call_site()] += 1

    def summary(self, top: Optional[int] = 20) -> dict:
        """``kernels``, ``syncs``, the ``top`` operators (None: all), host syncs by operator
        and call site, and per region the same counts (not the sites)."""
        out = dict(kernels=self.kernels, syncs=self.syncs, ops=dict(self.ops.most_common(top)),
                   sync_ops=dict(self.sync_ops.most_common()))
        if self.record_sites:
            out['sync_sites'] = dict(self.sync_sites.most_common())
        if self.regions:
            out['regions'] = {
                name: dict(kernels=sum(r['ops'].values()), syncs=sum(r['sync_ops'].values()),
                           ops=dict(r['ops'].most_common(top)),
                           sync_ops=dict(r['sync_ops'].most_common()))
                for name, r in sorted(self.regions.items())}
        return out


#: Matrix products and convolutions: :class:`Float32Products` computes them in float32.
PRODUCT_OPS = frozenset({'mm', 'addmm', 'bmm', 'baddbmm', 'addbmm', 'mv', 'addmv', 'dot',
                         'convolution', 'convolution_backward'})
_LOW_FLOATS = frozenset({torch.bfloat16, torch.float16})


class Float32Products(TorchDispatchMode):
    """Compute the bf16 / fp16 matrix products and convolutions (:data:`PRODUCT_OPS`) in
    float32, their outputs rounded to the input dtype, as a GPU's tensor cores accumulate.

    A CPU without bf16 / fp16 instructions emulates these operators, hundreds of times more
    slowly than in float32, which makes a counted step at the real input size take hours.
    Entered *outside* a :class:`KernelCounter`, it computes below the counter: the counter
    sees each operator once, as called, so the counts are those of the low-precision run;
    the values differ from the CPU's low-precision kernels by rounding only."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if op_name(func) in PRODUCT_OPS and func._overloadname == 'default':  # no out=
            dtypes = {t.dtype for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.is_floating_point()}
            if len(dtypes) == 1 and dtypes <= _LOW_FLOATS:
                low = dtypes.pop()

                def up(t):
                    return t.float() if isinstance(t, torch.Tensor) and t.dtype == low else t

                def down(t):
                    return t.to(low) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 \
                        else t
                out = func(*pytree.tree_map(up, args), **pytree.tree_map(up, kwargs))
                return pytree.tree_map(down, out)
        return func(*args, **kwargs)


#: mmcv's compiled ops whose output size depends on the data: on a GPU they read a mask or
#: a count back to the host.
MMCV_SYNC_OPS = frozenset({'nms', 'softnms', 'nms_match', 'nms_rotated', 'nms_quadri',
                           'iou3d_nms3d_forward', 'iou3d_nms3d_normal_forward'})


@contextlib.contextmanager
def mmcv_ext_calls(counter: KernelCounter) -> Iterator[None]:
    """Count each call of mmcv's compiled ops (``mmcv._ext``: RoIAlign, NMS, ...) as one
    kernel of ``counter`` (``'mmcv::<name>'``), NMS forms (:data:`MMCV_SYNC_OPS`) as host
    syncs too. They are called outside PyTorch's dispatcher, so the mode sees them only
    through the ATen operators their CPU code calls, which are not counted in their place.
    Inside the block ``mmcv._ext``'s functions are wrappers that make the same calls; nothing
    where mmcv's extension is absent."""
    try:
        import mmcv._ext as ext
    except ImportError:
        yield
        return
    originals = {name: getattr(ext, name) for name in dir(ext)
                 if not name.startswith('_') and callable(getattr(ext, name))}

    def counted(name, fn):
        def call(*args, **kwargs):
            counter.record(f'mmcv::{name}', sync=name in MMCV_SYNC_OPS)
            with _disable_current_modes():  # its CPU code's operators stand for nothing
                return fn(*args, **kwargs)
        return call
    try:
        for name, fn in originals.items():
            setattr(ext, name, counted(name, fn))
        yield
    finally:
        for name, fn in originals.items():
            setattr(ext, name, fn)


def graph_nodes(outputs) -> Iterable:
    """Every autograd node reachable from the ``grad_fn`` of the tensors in ``outputs`` (any
    nesting of tuples, lists and dicts)."""
    stack, seen = [], set()

    def add(obj):
        if isinstance(obj, torch.Tensor):
            if obj.grad_fn is not None:
                stack.append(obj.grad_fn)
        elif isinstance(obj, (tuple, list)):
            for o in obj:
                add(o)
        elif isinstance(obj, dict):
            for o in obj.values():
                add(o)
    add(outputs)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(n for n, _ in node.next_functions if n is not None)


class ModuleRegions:
    """Give the forward and backward operators of named submodules their own regions of a
    :class:`KernelCounter`, through forward hooks (nothing of the modules changes).

    A submodule's forward operators go to its region; its backward operators are those of
    the autograd nodes its forward made (the graph reachable from its outputs, less nodes
    an earlier region took). Operators outside the submodules (losses, label assignment,
    the heads' code that is no ``forward``) stay in the counter's own region.

    Args:
        counter (KernelCounter): Where the counts go.
        model (nn.Module): The model.
        names (Sequence[str]): Submodule names (``'backbone'``, ``'neck'``, ...); ones the
            model lacks are skipped. Nested names are not supported in one call.
    """

    def __init__(self, counter: KernelCounter, model: nn.Module, names: Sequence[str]):
        self.counter, self.model, self.names = counter, model, list(names)
        self._handles = []
        self._outer = []

    def __enter__(self):
        for name in self.names:
            module = getattr(self.model, name, None)
            if isinstance(module, nn.Module):
                self._handles.append(module.register_forward_pre_hook(self._enter(name)))
                self._handles.append(module.register_forward_hook(self._exit(name)))
        return self

    def _enter(self, name):
        def hook(module, args):
            self._outer.append(self.counter.region)
            self.counter.region = name
        return hook

    def _exit(self, name):
        def hook(module, args, output):
            self.counter.region = self._outer.pop()
            for node in graph_nodes(output):
                self.counter.node_regions.setdefault(node, name)
        return hook

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return False
