"""RepBN and progressive PRepBN (SLAB, ICML 2024)."""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from mmslab.registry import register_model
from .affine import FoldableNorm
from .token_bn import bn_affine

#: PRepBN decay length (iterations) of the SLAB authors' ImageNet training, the ``step`` of
#: mmslab's SLAB presets and of converted checkpoints.
SLAB_PREPBN_STEPS = 300000


@register_model()
class RepBN(FoldableNorm):
    """Re-parameterizable BatchNorm: ``BN(x) + alpha * x`` with a learnable scalar ``alpha``.

    Statistics are taken over every axis but the channel axis, so token tensors need no
    transpose. At inference it is the affine ``a * x + b`` with ``a = w / sqrt(var + eps) + alpha``
    and ``b = beta - w * mean / sqrt(var + eps)``.

    Args:
        num_features (int): Channels C.
        eps (float): ``eps`` of the inner ``nn.BatchNorm1d`` (named ``bn`` as in the authors'
            files). Default: 1e-5.
        momentum (float): ``momentum`` of the inner ``nn.BatchNorm1d``. Default: 0.1.
        alpha_init (float): Initial ``alpha`` (1 in the paper). Default: 1.0.
        data_format (str): ``'channels_last'`` for ``[..., C]``, ``'channels_first'`` for
            ``[B, C, *]``. Default: 'channels_last'.
        deploy (bool): Build the fused affine form directly. Default: False.

    Shape: input and output alike, ``[..., C]`` or ``[B, C, *]``.
    """

    _stat_attrs = ('bn', 'alpha')

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 alpha_init: float = 1.0, data_format: str = 'channels_last',
                 deploy: bool = False):
        super().__init__(num_features, data_format, deploy)
        if not deploy:
            self.bn = nn.BatchNorm1d(num_features, eps=eps, momentum=momentum)
            self.alpha = nn.Parameter(torch.tensor(float(alpha_init)))

    def forward_train(self, x: Tensor, alpha_offset: Optional[Tensor] = None) -> Tensor:
        """``alpha_offset`` (a zero scalar) lets :class:`PRepBN` route the idle LayerNorm's
        parameters into the graph at no cost (see ``PRepBN.forward_train``)."""
        if x.shape[-1 if self.data_format == 'channels_last' else 1] != self.num_features:
            raise ValueError(f'RepBN({self.num_features}, {self.data_format}) got input of shape '
                             f'{tuple(x.shape)}')
        if self.data_format == 'channels_last':
            y = self.bn(x.reshape(-1, self.num_features)).view_as(x)
        else:
            y = self.bn(x.flatten(2)).view_as(x)
        alpha = self.alpha if alpha_offset is None else self.alpha + alpha_offset
        return rep_mix(y, x, alpha, 0.0)

    def _fused_affine(self) -> Tuple[Tensor, Tensor]:
        scale, shift = bn_affine(self.bn)
        return scale + self.alpha.double(), shift


@register_model()
class PRepBN(FoldableNorm):
    """Progressive re-parameterized BatchNorm: ``g * LN(x) + (1 - g) * RepBN(x)``.

    ``g`` is 1 for ``warmup`` training iterations, then decays linearly from ``r0`` to 0 over
    ``step`` iterations (``schedule_offset`` shifts the start, see the buffer's comment). The
    schedule is a function of the *training iteration*, stored in the ``cur_iter`` buffer (so
    it is saved and resumed with the model) and set before each iteration by
    :class:`~mmslab.engine.ProgressiveNormHook` (or by calling :meth:`set_iter`); extra forward
    calls never move it. Training without anything driving the schedule raises
    instead of silently training with a frozen ``g``. Eval mode is pure RepBN, as in the paper.

    Sub-module names follow the authors' files: ``norm1`` is the LayerNorm branch, ``norm2``
    the RepBN branch (not a block's two pre-norms, which are also called ``norm1``/``norm2``:
    ``blocks.0.norm1.norm2.bn`` is the BN of the RepBN branch of a block's first pre-norm).

    Shape: ``[..., C]`` channels-last, or ``[B, C, *]`` with ``data_format='channels_first'``.

    Args:
        num_features (int): Channels C.
        step (int): Iterations of the linear decay of ``g`` from ``r0`` to 0 (the SLAB
            presets use :data:`SLAB_PREPBN_STEPS`). Default: 60000.
        r0 (float): ``g`` at the start of the decay, in [0, 1]. Default: 1.0.
        warmup (int): Training iterations at ``g = 1`` before the decay. Default: 0.
        eps (float): ``eps`` of the LayerNorm branch. Default: 1e-5.
        bn_eps (float): ``eps`` of the RepBN branch's BatchNorm. Default: 1e-5.
        bn_momentum (float): ``momentum`` of the RepBN branch's BatchNorm. Default: 0.1.
        alpha_init (float): Initial ``alpha`` of the RepBN branch. Default: 1.0.
        data_format (str): ``'channels_last'`` for ``[..., C]``, ``'channels_first'`` for
            ``[B, C, *]``. Default: 'channels_last'.
        deploy (bool): Build the fused affine form directly. Default: False.
    """

    _stat_attrs = ('norm1', 'norm2', 'cur_iter', 'schedule_offset')
    #: Keep the idle branch's parameters in the autograd graph at g = 1 / g = 0 (for DDP).
    #: None: only when a process group with more than one process is running.
    keep_idle_in_graph: Optional[bool] = None

    def __init__(self, num_features: int, step: int = 60000, r0: float = 1.0, warmup: int = 0,
                 eps: float = 1e-5, bn_eps: float = 1e-5, bn_momentum: float = 0.1,
                 alpha_init: float = 1.0, data_format: str = 'channels_last',
                 deploy: bool = False):
        if int(step) <= 0:
            raise ValueError(f'PRepBN step must be a positive number of iterations, got {step}')
        if int(warmup) < 0:
            raise ValueError(f'PRepBN warmup must be >= 0, got {warmup}')
        if not 0.0 <= float(r0) <= 1.0:
            raise ValueError(f'PRepBN r0 must lie in [0, 1], got {r0}')
        super().__init__(num_features, data_format, deploy)
        # Schedule length is configuration; position in it is state (saved and resumed).
        self.step, self.r0, self.warmup = int(step), float(r0), int(warmup)
        if deploy:
            return
        self.norm1 = nn.LayerNorm(num_features, eps=eps)
        self.norm2 = RepBN(num_features, eps=bn_eps, momentum=bn_momentum,
                           alpha_init=alpha_init, data_format='channels_last')
        # Training iteration of the current run, set by set_iter().
        self.register_buffer('cur_iter', torch.tensor(0, dtype=torch.long))
        # Fraction of the LN -> RepBN decay already done before this run (e.g. in ImageNet
        # pre-training): 1.0 keeps a finished schedule finished when fine-tuning.
        self.register_buffer('schedule_offset', torch.tensor(0.0, dtype=torch.float64))
        # The two buffers as Python numbers, read back only where the buffers are written
        # from outside (load_state_dict): set_iter() then waits for no device.
        self._iter, self._offset = 0, 0.0
        # Set by set_iter(); a training forward without it means nothing drives the schedule.
        self._schedule_driven = False
        # The schedule as set_iter() evaluated it (see _schedule): the branch taken, g, and g
        # as a 0-d tensor filled in place for torch.compile.
        self._phase, self._ratio, self._g = 'ln', 1.0, None

    def set_iter(self, cur_iter: int) -> None:
        """Set the training iteration the schedule is evaluated at (called once per iteration)."""
        if self.deploy:
            return
        self._iter = int(cur_iter)
        self.cur_iter.fill_(self._iter)
        self._schedule_driven = True
        self._evaluate_schedule()

    def _evaluate_schedule(self) -> None:
        """Evaluate the schedule from the buffers for the training forwards that follow."""
        if self.deploy:
            return
        g = self._ratio = self.ratio
        self._phase = 'ln' if g >= 1.0 else 'bn' if g <= 0.0 else 'mix'
        if self._g is None or self._g.device != self.cur_iter.device:
            self._g = torch.tensor(g, dtype=torch.float32, device=self.cur_iter.device)
        else:
            self._g.fill_(g)  # in place: a compiled graph keeps reading the same tensor

    def _schedule(self) -> Tuple[str, object]:
        """``(branch, g)`` of a training forward, as :meth:`set_iter` evaluated them: a
        forward reads no buffer, which on a GPU would wait for the device twice per norm,
        and under ``torch.compile`` would break the graph. There a Python ``g`` would be a
        constant of the graph (a recompilation every iteration): ``g`` is a tensor and the
        branch a Python value, so a compiled model gets a new graph only where the branch
        changes (end of warm-up, end of the decay)."""
        if self._phase == 'mix' and torch.compiler.is_compiling():
            return 'mix', self._g
        return self._phase, self._ratio

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        if not self.deploy:  # the loaded buffers' schedule
            self._iter, self._offset = int(self.cur_iter), float(self.schedule_offset)
            self._evaluate_schedule()

    def reset_schedule(self) -> None:
        """Start the schedule from scratch (g = r0 again) at the next set_iter()."""
        if not self.deploy:
            self._offset = 0.0
            self.schedule_offset.fill_(0.0)
            self._evaluate_schedule()

    @property
    def ratio(self) -> float:
        """The LayerNorm weight ``g`` at the current training iteration (of the last
        :meth:`set_iter` or loaded state dict: the buffers are not read back)."""
        if self.deploy:
            return 0.0
        offset, t = self._offset, self._iter
        if offset <= 0.0:
            if t < self.warmup:
                return 1.0
            t -= self.warmup
        done = offset + t / self.step
        return max(0.0, self.r0 * (1.0 - done))

    def forward_train(self, x: Tensor) -> Tensor:
        channels_first = self.data_format == 'channels_first'
        if channels_first:
            x = x.movedim(1, -1)
        if not self.training:
            y = self.norm2(x)
        else:
            if not self._schedule_driven:
                raise RuntimeError(
                    'PRepBN is training but nothing sets its schedule. Add '
                    "custom_hooks=[dict(type='ProgressiveNormHook')] to the config, or call "
                    'mmslab.set_progressive_iter(model, it) before each training iteration.')
            branch, g = self._schedule()
            # At g = 1 (warm-up) or g = 0 (finished) one branch has weight 0 and is not
            # computed. DDP (find_unused_parameters=False) aborts when a parameter gets no
            # gradient, so under a multi-process group the idle branch's parameters enter the
            # graph through a zero scalar added to one O(C) parameter of the active branch:
            # no pass over the tokens, and no find_unused_parameters graph walk. The idle
            # branch gets a zero gradient, what the authors' always-both-branches form gives
            # it (with the configs' zero weight decay on norms and alpha, a zero gradient
            # moves nothing). A single process skips the ~6 tiny ops per norm.
            keep = self.keep_idle_in_graph
            if keep is None:
                keep = _multi_process()
            if branch == 'ln':
                # warm-up: pure LayerNorm, BN statistics untouched
                ln, anchor = self.norm1, _zero_anchor(self.norm2) if keep else None
                if anchor is None or ln.weight is None:
                    y = ln(x) if anchor is None else ln(x) + anchor
                else:
                    y = F.layer_norm(x, ln.normalized_shape, ln.weight + anchor, ln.bias,
                                     ln.eps)
            elif branch == 'bn':
                # schedule finished: skip the LayerNorm branch
                y = self.norm2.forward_train(
                    x, alpha_offset=_zero_anchor(self.norm1) if keep else None)
            else:
                y = self._mix(x, g)
        return y.movedim(-1, 1) if channels_first else y

    def _mix(self, x: Tensor, g) -> Tensor:
        """``g * LN(x) + (1 - g) * (BN(x) + alpha * x)`` in at least float32 (LayerNorm's
        dtype under autocast: one cast of ``x`` for both norms), handed on in ``x``'s dtype;
        the BatchNorm runs as its module (a SyncBatchNorm stays one)."""
        rep = self.norm2
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        bn = rep.bn(x32.reshape(-1, self.num_features)).view_as(x32)
        return rep_mix(bn, x32, rep.alpha, g, ln=self.norm1, dtype=x.dtype)

    def _fused_affine(self) -> Tuple[Tensor, Tensor]:
        return self.norm2._fused_affine()

    def extra_repr(self) -> str:
        return f'{self.num_features}, step={self.step}, r0={self.r0}, warmup={self.warmup}'


def rep_mix(bn: Tensor, x: Tensor, alpha: Tensor, g, ln: Optional[nn.LayerNorm] = None,
            dtype: Optional[torch.dtype] = None) -> Tensor:
    """``g * ln(x) + (1 - g) * (bn + alpha * x)`` in ``dtype`` (default: ``x``'s), where
    ``bn`` is the BatchNorm module's output on ``x`` and ``ln`` the LayerNorm (None:
    ``g = 0``, RepBN). With gradients and a Python ``g`` it runs as :class:`RepMix`."""
    if torch.is_grad_enabled() and not isinstance(g, Tensor):
        weight, bias = (None, None) if ln is None else (ln.weight, ln.bias)
        return RepMix.apply(bn, x, alpha, weight, bias, float(g), ln, dtype or x.dtype)
    h = 1.0 - g
    if ln is None:
        y = bn
    else:
        y = ln(x)
        dtype_mix = torch.promote_types(y.dtype, bn.dtype)  # lerp does not promote
        y = torch.lerp(y.to(dtype_mix), bn.to(dtype_mix), h)  # g * ln + h * bn
    if isinstance(h, Tensor):  # a compiled mix (PRepBN._schedule)
        y = torch.addcmul(y, x, alpha * h)
    else:
        y = torch.addcmul(y, x, alpha, value=h)
    return y.to(dtype or x.dtype)


class RepMix(torch.autograd.Function):
    """:func:`rep_mix` for a Python ``g``, the LayerNorm inside: the forward is the
    LayerNorm, one ``lerp`` and one ``addcmul`` written in the output dtype; the backward
    is ``ln``'s ``g * grad``, the LayerNorm's backward, ``bn``'s ``h * grad``, ``alpha``'s
    dot product and ``x``'s ``dx_ln + alpha * h * grad`` in one ``addcmul_`` (``h = 1 - g``;
    at ``g = 0`` ``bn`` takes ``grad`` itself): about half of autograd's kernels for the
    same expression, and no cast of the output or of its gradient."""

    @staticmethod
    def forward(ctx, bn, x, alpha, weight, bias, g: float, ln, dtype):
        h = 1.0 - g
        ctx.g, ctx.bn_dtype = g, bn.dtype
        out = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
        if ln is None:
            ctx.save_for_backward(x, alpha)
            return torch.addcmul(bn, x, alpha, value=h, out=out)
        ctx.normalized_shape = ln.normalized_shape
        y, mean, rstd = torch.native_layer_norm(x, ln.normalized_shape, weight, bias, ln.eps)
        ctx.save_for_backward(x, alpha, weight, bias, mean, rstd)
        return torch.addcmul(torch.lerp(y, bn.to(y.dtype), h), x, alpha, value=h, out=out)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, alpha, *ln_saved = ctx.saved_tensors
        need_bn, need_x, need_alpha, need_w, need_b = ctx.needs_input_grad[:5]
        g = ctx.g
        # contiguous: BatchNorm's backward reads it as [N, C] (else a copy of its own)
        if g == 0.0 and grad.dtype == ctx.bn_dtype:
            grad_bn = grad.contiguous()
        else:
            grad_bn = torch.mul(grad, 1.0 - g, out=torch.empty_like(
                x, dtype=ctx.bn_dtype, memory_format=torch.contiguous_format))
        grad_x = grad_w = grad_b = None
        if ln_saved and (need_x or need_w or need_b):
            weight, bias, mean, rstd = ln_saved
            grad_ln = torch.mul(grad, g, out=torch.empty_like(
                x, memory_format=torch.contiguous_format))
            grad_x, grad_w, grad_b = torch.ops.aten.native_layer_norm_backward(
                grad_ln, x, ctx.normalized_shape, mean, rstd, weight, bias,
                [need_x, need_w and weight is not None, need_b and bias is not None])
        if need_x:
            grad_x = grad_bn * alpha if grad_x is None else grad_x.addcmul_(grad_bn, alpha)
        grad_alpha = None
        if need_alpha:
            grad_alpha = torch.dot(grad_bn.reshape(-1), x.reshape(-1).to(grad_bn.dtype))
        return (grad_bn if need_bn else None, grad_x, grad_alpha, grad_w, grad_b, None, None,
                None)


def _zero_anchor(module: nn.Module) -> Optional[Tensor]:
    """A scalar zero that depends on every trainable parameter of ``module`` (None if it has
    none), so those parameters receive a (zero) gradient without their module running."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return None
    return torch.stack([p.sum() for p in params]).sum() * 0.0


def _multi_process() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
