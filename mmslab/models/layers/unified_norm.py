"""Unified Normalization (UN, Yang et al., ACM MM 2022): an offline LayerNorm replacement.

Training normalizes by a smoothed per-channel quadratic mean and back-propagates with smoothed
gradient statistics; inference is the fixed affine ``y = w * x / sqrt(running_var + eps) + b``,
which folds into the neighbouring Linear/Conv (see :mod:`mmslab.models.layers.affine`).

The training step follows the authors' reference implementation (GitHub
``hikvision-research/Unified-Normalization``, ``image_classification/models/
unified_normalization/unified_normalization.py``); this is an independent re-implementation.
Per channel, at training iteration ``t`` (0-based, set by :meth:`UN.set_iter`):

Forward

* ``s_t = mean(x^2)`` over every non-channel axis (quadratic mean, no centring).
* Window ``Omega_t``: the last ``M`` recorded statistics, ``s_t`` included.
* The moving averages are *active* once the window held ``M`` statistics before this iteration
  and ``t >= warmup_iters``; then ``var_t = GM(Omega_t)`` (geometric mean), otherwise
  ``var_t = s_t`` (window fill-up and warm-up).
* Outlier filtration (only while active): threshold ``T = M * Var(sqrt(Omega_{t-1}))`` where
  ``Var`` is ONE scalar, the unbiased variance over all ``M x C`` entries of the previous window
  (read before ``s_t`` is recorded). If ``AM(Omega_t) - GM(Omega_t) > T`` in any channel the
  step is an outlier step: ``var_t = s_t``, and the window slot of ``s_t`` is overwritten with
  ``running_var`` (the value before this step's update) to passivate the outlier.
* Gradient scale ``r = clamp(sqrt(var_t + eps) / sqrt(running_var + eps), 1/clamp, clamp)``
  with ``running_var`` from *before* this step's update, from iteration
  ``max(grad_scale_start, warmup_iters)`` on; ``r = 1`` before that and on outlier steps.
* ``z = x / sqrt(var_t + eps)``, ``y = w * z + b``;
  ``running_var <- a * running_var + (1 - a) * var_t`` (``var_t = s_t`` on outlier steps).

Backward, with ``gy = dL/dy``

* ``g = gy * w * r`` (the scale acts on the incoming gradient) and ``gz_t = mean(g * z)``.
* ``gz_t`` is recorded in the gradient window (on outlier steps the slot gets the gradient EMA
  ``psi`` from before this step instead).
* ``psi <- a * psi + (1 - a) * m_t`` with ``m_t = AM(gradient window)`` when the averages are
  active and ``m_t = gz_t`` otherwise (warm-up, fill-up, outlier step). ``psi`` starts at 0.
* ``dL/dx = (g - p * z) / sqrt(var_t + eps)`` with ``p = psi`` (the updated EMA, also during
  warm-up) and ``p = gz_t`` on outlier steps.
* ``dL/dw = sum(gy * r * z)``, ``dL/db = sum(gy)``.

``a`` is ``momentum`` (0.9): the weight of the *old* value, as in the paper (the opposite of
``torch.nn.BatchNorm``'s convention).

Where the paper and the authors' code differ, this module follows the code:

* the paper (Eq. 18-19) can be read as a per-channel variance of the previous window; the code
  compares every channel against the single scalar above, which includes the spread between
  channels, so the filter fires only on large jumps (per-channel thresholds fire on almost
  every step of a wide layer with noisy batches);
* the paper's Algorithm 2 has no warm-up rule for the backward; the code uses the gradient EMA
  throughout (fed with ``gz_t`` during warm-up) and keeps feeding it on outlier steps;
* the gradient scale ``r`` is not in the paper (code: start 1000, clamp 5, here configurable).

Small departures from the code, all outside its default regime: the iteration is 0-based, so
the averages start at ``t = max(M, warmup_iters)`` (the code's 1-based counter starts them one
iteration earlier when ``warmup_iters > M``); the outlier test runs only when the averages are
active (the code also runs it during fill-up when ``warmup_iters < M``, against empty slots);
the window is kept oldest-first instead of as a ring (means and variances do not depend on the
order); several forwards/backwards in one iteration are supported (see :class:`UN`).
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from mmslab.registry import register_model
from .affine import FoldableNorm, _broadcast

# Per-iteration modes of the moving averages. Whether an averaging step is an outlier step
# (current statistics, recorded slots passivated) is a 0-d bool tensor, the outlier test's
# result, which the host never reads back: every choice it makes is a torch.where.
_CURRENT = 'current'  # warm-up or window filling: current statistic, gradient EMA still used
_AVERAGE = 'average'  # geometric-mean variance, EMA of the windowed gradient statistic


class _UNNormalize(torch.autograd.Function):
    """``w * x / sqrt(var + eps)`` with UN's estimated-gradient backward.

    ``var`` is a constant of the forward pass (the gradient does not flow through the
    statistics); the terms it would contribute are replaced by the gradient statistic ``psi``
    that the owning :class:`UN` maintains. ``scale`` is the gradient scale ``r`` (``None``:
    ``r = 1``); it multiplies the incoming gradient, so it also scales the weight gradient.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, inv_std: Tensor, scale: Optional[Tensor],
                module: 'UN', it: int, mode: str, outlier: Optional[Tensor]) -> Tensor:
        ctx.save_for_backward(x, weight, inv_std, scale, outlier)
        ctx.module, ctx.it, ctx.mode = module, it, mode
        fmt = module.data_format
        return x * _broadcast(inv_std * weight, x, fmt)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, weight, inv_std, scale, outlier = ctx.saved_tensors
        module = ctx.module
        fmt = module.data_format
        dims = module._stat_dims(x)
        inv = _broadcast(inv_std, x, fmt)
        z = x * inv
        if scale is not None:
            grad_y = grad_y * _broadcast(scale, x, fmt)
        grad_w = (grad_y * z).sum(dim=dims) if ctx.needs_input_grad[1] else None
        g = grad_y * _broadcast(weight, x, fmt)
        gz = (g * z).mean(dim=dims)
        psi = module._gradient_statistic(gz, ctx.it, ctx.mode, outlier)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (g - z * _broadcast(psi.to(z.dtype), x, fmt)) * inv
        return grad_x, grad_w, None, None, None, None, None, None


@register_model('UN')
class UN(FoldableNorm):
    """Unified Normalization: offline per-channel normalization by a smoothed quadratic mean.

    Args:
        num_features (int): Channels C.
        eps (float): Added to the variance. Default: 1e-5.
        window_size (int): M, number of recent iterations whose statistics are averaged
            (>= 2). Default: 4.
        warmup_iters (int): Iterations during which the current statistics are used
            (paper: 4000). Default: 4000.
        momentum (float): EMA weight of the old value for ``running_var`` and for the
            gradient statistic (paper: 0.9). ``recalibrate_bn`` sets it to ``None``
            temporarily, which makes a training-mode forward a cumulative average of ``s_t``
            into ``running_var`` and nothing else (like ``nn.BatchNorm`` with
            ``momentum=None``). Default: 0.9.
        outlier_filtration (bool): Adaptive outlier filtration (on for vision in the paper).
            Default: True.
        grad_scale_clamp (float, optional): Clamp of the gradient scale ``r`` to
            ``[1/clamp, clamp]``; ``None`` disables the scale. Default: 5.0.
        grad_scale_start (int): First iteration of the gradient scale; the effective start
            is ``max(grad_scale_start, warmup_iters)``. Default: 1000.
        data_format (str): ``'channels_last'`` for ``[..., C]`` tokens, ``'channels_first'``
            for ``[B, C, *spatial]`` maps. Statistics are over every non-channel axis.
            Default: 'channels_last'.
        deploy (bool): Build the fused affine form (parameters ``weight``/``bias`` only)
            directly. Default: False.

    Training iteration: the moving averages advance once per *training iteration*, not per
    forward call. Call :meth:`set_iter` before every iteration (mmslab's iteration hook does it
    for every module with ``set_iter``: ``ProgressiveNormHook`` or
    ``mmslab.set_progressive_iter``). The first training forward of an iteration pushes its
    statistic into the window and updates ``running_var``; further forwards in the same
    iteration (several losses, activation checkpointing recomputation) push nothing and
    normalize with the same smoothed variance when the averages are active, or with their own
    current statistic otherwise; their gradient scale uses the same pre-update ``running_var``.
    Likewise the first backward of an iteration pushes the gradient statistic; later ones reuse
    that iteration's estimate (their own statistic on an outlier step). A training forward
    before any :meth:`set_iter` raises. Call :meth:`reset_iter` when fine-tuning from a
    checkpoint so the warm-up runs again.

    Shape: input and output alike, ``[..., C]`` (channels_last) or ``[B, C, *]``
    (channels_first). Buffers: ``running_var``, ``grad_est`` ``[C]``; ``window``,
    ``grad_window`` ``[M, C]`` (oldest first); long scalars ``cur_iter``, ``last_iter``,
    ``grad_iter``, ``num_filled``, ``grad_filled``.
    """

    _stat_attrs = ('weight', 'bias', 'running_var', 'window', 'grad_window', 'grad_est',
                   'cur_iter', 'last_iter', 'grad_iter', 'num_filled', 'grad_filled')

    def __init__(self, num_features: int, eps: float = 1e-5, window_size: int = 4,
                 warmup_iters: int = 4000, momentum: float = 0.9,
                 outlier_filtration: bool = True, grad_scale_clamp: Optional[float] = 5.0,
                 grad_scale_start: int = 1000, data_format: str = 'channels_last',
                 deploy: bool = False):
        if isinstance(num_features, bool) or int(num_features) != num_features \
                or num_features < 1:
            raise ValueError(f'UN num_features must be a positive integer, got {num_features!r}')
        if not eps > 0:
            raise ValueError(f'UN eps must be > 0, got {eps!r}')
        if int(window_size) != window_size or window_size < 2:
            raise ValueError(f'UN window_size must be an integer >= 2 (the outlier test and the '
                             f'geometric mean need two iterations), got {window_size!r}')
        if int(warmup_iters) != warmup_iters or warmup_iters < 0:
            raise ValueError(f'UN warmup_iters must be an integer >= 0, got {warmup_iters!r}')
        if momentum is None or not 0.0 < momentum < 1.0:
            raise ValueError(f'UN momentum must lie in (0, 1) (weight of the old value), '
                             f'got {momentum!r}')
        if grad_scale_clamp is not None and not grad_scale_clamp >= 1.0:
            raise ValueError(f'UN grad_scale_clamp must be >= 1 (or None to disable), '
                             f'got {grad_scale_clamp!r}')
        if int(grad_scale_start) != grad_scale_start or grad_scale_start < 0:
            raise ValueError(f'UN grad_scale_start must be an integer >= 0, '
                             f'got {grad_scale_start!r}')
        super().__init__(int(num_features), data_format, deploy)
        self.eps = float(eps)
        self.window_size = int(window_size)
        self.warmup_iters = int(warmup_iters)
        self.momentum = float(momentum)
        self.outlier_filtration = bool(outlier_filtration)
        self.grad_scale_clamp = None if grad_scale_clamp is None else float(grad_scale_clamp)
        self.grad_scale_start = int(grad_scale_start)
        self._iter_driven = False  # set by set_iter(); checked by training forwards
        # (iteration, mode, outlier test or None) of the last push
        self._iter_mode: Optional[Tuple[int, str, Optional[Tensor]]] = None
        # The counters that control flow alone moves, as Python numbers: a training step
        # reads none of their buffers back (on a GPU each read waits for the device). The
        # buffers are written alongside and read only by load_state_dict.
        self._iter, self._last_iter, self._grad_iter, self._num_filled = 0, -1, -1, 0
        self._iter_running: Optional[Tensor] = None  # running_var before that push (for r)
        self._num_recal = 0  # batches averaged while momentum is None (recalibration)
        self._loss_scale = 1.0  # factor of this iteration's incoming gradients (fp16 AMP)
        if deploy:
            return
        c, m = self.num_features, self.window_size
        self.weight = nn.Parameter(torch.ones(c))
        self.bias = nn.Parameter(torch.zeros(c))
        self.register_buffer('running_var', torch.ones(c))
        self.register_buffer('window', torch.zeros(m, c))
        self.register_buffer('grad_window', torch.zeros(m, c))
        self.register_buffer('grad_est', torch.zeros(c))
        self.register_buffer('cur_iter', torch.tensor(0, dtype=torch.long))
        # Iterations whose activation / gradient statistics were last pushed (-1: none).
        self.register_buffer('last_iter', torch.tensor(-1, dtype=torch.long))
        self.register_buffer('grad_iter', torch.tensor(-1, dtype=torch.long))
        # Valid entries of window / grad_window (saturate at M).
        self.register_buffer('num_filled', torch.tensor(0, dtype=torch.long))
        self.register_buffer('grad_filled', torch.tensor(0, dtype=torch.long))

    # ------------------------------------------------------------------ iteration control
    @property
    def grad_scale_first_iter(self) -> int:
        return max(self.grad_scale_start, self.warmup_iters)

    def set_iter(self, cur_iter: int) -> None:
        """Set the training iteration (0-based) used by the next training forwards."""
        if self.deploy:
            return
        self._iter = int(cur_iter)
        self.cur_iter.fill_(self._iter)
        self._iter_driven = True

    def set_loss_scale(self, scale) -> None:
        """The factor that scales this iteration's incoming gradients (fp16 mixed precision:
        the ``GradScaler``'s scale, a number or the 0-d tensor it keeps on the device, which
        the host then never reads back; 1 otherwise). Set before each iteration by
        ``ProgressiveNormHook``. The gradient statistics are kept unscaled, so a loss scale
        that changes between iterations does not bias their moving averages."""
        if isinstance(scale, Tensor):
            self._loss_scale = scale.detach()
            return
        if not scale > 0 or not math.isfinite(scale):
            raise ValueError(f'UN loss scale must be a positive finite number, got {scale!r}')
        self._loss_scale = float(scale)

    def reset_iter(self) -> None:
        """Restart from iteration 0 with empty windows, so the warm-up runs again.

        ``running_var``, the gradient EMA ``grad_est`` and the affine are kept (the authors
        restart only the iteration counter when fine-tuning).
        """
        if self.deploy:
            return
        self.cur_iter.zero_()
        self.last_iter.fill_(-1)
        self.grad_iter.fill_(-1)
        self.num_filled.zero_()
        self.grad_filled.zero_()
        self.grad_window.zero_()  # the slots past grad_filled, zero: their mean is a sum
        self._iter, self._last_iter, self._grad_iter, self._num_filled = 0, -1, -1, 0
        self._iter_mode = None
        self._iter_running = None

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        if not self.deploy:
            self._iter, self._last_iter = int(self.cur_iter), int(self.last_iter)
            self._grad_iter, self._num_filled = int(self.grad_iter), int(self.num_filled)
            unfilled = self.window_size - int(self.grad_filled)
            if unfilled > 0:  # see reset_iter
                self.grad_window[:unfilled].zero_()

    @property
    def iteration_mode(self) -> Optional[Tuple[int, str]]:
        """``(iteration, 'current' | 'average' | 'outlier')`` of the last push (None before
        one). For inspection: it reads the outlier test back, which waits for the device."""
        if self._iter_mode is None:
            return None
        it, mode, outlier = self._iter_mode
        return it, 'outlier' if outlier is not None and bool(outlier) else mode

    def reset_running_stats(self) -> None:
        """``running_var`` back to 1 (used by BN recalibration with ``momentum=None``)."""
        if self.deploy:
            return
        self.running_var.fill_(1.0)
        self._num_recal = 0

    # ------------------------------------------------------------------ statistics
    def _stat_dims(self, x: Tensor) -> Tuple[int, ...]:
        if self.data_format == 'channels_last':
            return tuple(range(x.dim() - 1))
        return (0, *range(2, x.dim()))

    def _check_input(self, x: Tensor) -> None:
        axis = -1 if self.data_format == 'channels_last' else 1
        if x.dim() < (1 if axis == -1 else 2) or x.shape[axis] != self.num_features:
            raise ValueError(f'UN({self.num_features}, {self.data_format}) got input of shape '
                             f'{tuple(x.shape)}')

    @staticmethod
    def _geometric_mean(window: Tensor) -> Tensor:
        return window.log().mean(dim=0).exp()

    @torch.no_grad()
    def _push_statistic(self, s: Tensor, it: int) -> Tuple[Tensor, str, Optional[Tensor]]:
        """First forward of iteration ``it``: record ``s``, update running_var, pick var.
        Returns ``(var, mode, outlier)``: the outlier test (a 0-d bool tensor) where the
        averages are active and filter outliers, else None."""
        m = self.window_size
        # The averages start once the window held M statistics before this iteration.
        active = self._num_filled >= m and it >= self.warmup_iters
        threshold = None
        if active and self.outlier_filtration:
            # One scalar for the whole layer: M times the unbiased variance of sqrt(s) over all
            # M x C entries of the previous window (authors' code), read before s is recorded.
            threshold = m * self.window.to(s).sqrt().var()
        self.window.copy_(torch.cat([self.window[1:], s.to(self.window)[None]]))
        self._num_filled = min(self._num_filled + 1, m)
        self.num_filled.fill_(self._num_filled)
        mode, var, outlier = _CURRENT, s, None
        old_running = self.running_var.clone()
        if active:
            win = self.window.to(s)
            mode, var = _AVERAGE, self._geometric_mean(win)
            if threshold is not None:
                outlier = (win.mean(dim=0) - var > threshold).any()
                var = torch.where(outlier, s, var)
                # Passivate an outlier in later windows: its slot takes the running estimate.
                self.window[-1].copy_(torch.where(outlier, old_running, self.window[-1]))
        self.running_var.lerp_(var.to(old_running), 1.0 - self.momentum)
        self._last_iter = it
        self.last_iter.fill_(it)
        self._iter_mode = (it, mode, outlier)
        self._iter_running = old_running
        return var, mode, outlier

    @torch.no_grad()
    def _gradient_statistic(self, gz: Tensor, it: int, mode: str,
                            outlier: Optional[Tensor]) -> Tensor:
        """Return the gradient statistic used by the backward of iteration ``it``.

        ``gz`` carries the loss scale (:meth:`set_loss_scale`); the windows and the EMA hold
        unscaled values and the returned estimate is scaled back. A non-finite ``gz`` (an
        fp16 overflow, whose step the ``GradScaler`` skips) is returned as is and recorded
        nowhere (one overflow would otherwise turn the EMA, and every later backward, NaN;
        ``grad_iter`` keeps its value too); later backwards of that iteration use the
        estimate.
        """
        scale, raw = self._loss_scale, gz  # an outlier step's backward uses its own, raw gz
        if self._grad_iter == it:
            # Another backward in the same iteration: reuse this iteration's estimate.
            est = self._scaled(self.grad_est.to(gz))
            return est if outlier is None else torch.where(outlier, gz, est)
        self._grad_iter = it
        finite = torch.isfinite(gz).all()
        self.grad_iter.masked_fill_(finite, it)
        if isinstance(scale, Tensor) or scale != 1.0:
            gz = gz / scale
        pushed = torch.cat([self.grad_window[1:], gz.to(self.grad_window)[None]])
        if outlier is not None:
            # The slot records the estimate from before this step; the EMA still takes gz.
            pushed[-1] = torch.where(outlier, self.grad_est, pushed[-1])
        self.grad_window.copy_(torch.where(finite, pushed, self.grad_window))
        self.grad_filled.add_(finite).clamp_(max=self.window_size)
        fed = gz.to(self.grad_est)
        if mode == _AVERAGE:
            # The mean of the filled slots: the newest, the others zero (see reset_iter).
            mean = self.grad_window.sum(dim=0) / self.grad_filled.clamp(min=1)
            fed = mean if outlier is None else torch.where(outlier, fed, mean)
        # momentum: the weight of the old value
        self.grad_est.copy_(torch.where(finite, self.grad_est.lerp(fed, 1.0 - self.momentum),
                                        self.grad_est))
        # The EMA is used outside outlier steps, warm-up included; an outlier uses its own gz.
        out = self._scaled(self.grad_est.to(raw))
        if outlier is not None:
            out = torch.where(outlier, raw, out)
        return torch.where(finite, out, raw)

    def _scaled(self, t: Tensor) -> Tensor:
        scale = self._loss_scale
        return t * scale if isinstance(scale, Tensor) or scale != 1.0 else t

    # ------------------------------------------------------------------ forward
    def forward_train(self, x: Tensor) -> Tensor:
        self._check_input(x)
        fmt = self.data_format
        dtype = torch.promote_types(x.dtype, self.running_var.dtype)
        xs = x.to(dtype)
        if not self.training:
            scale, shift = self.weight.to(dtype) * torch.rsqrt(
                self.running_var.to(dtype) + self.eps), self.bias.to(dtype)
            y = torch.addcmul(_broadcast(shift, xs, fmt), xs, _broadcast(scale, xs, fmt))
            return y.to(x.dtype)

        with torch.no_grad():
            s = xs.detach().square().mean(dim=self._stat_dims(xs))
        if self.momentum is None:
            # BN recalibration: cumulative average of the quadratic mean, current statistics.
            with torch.no_grad():
                self._num_recal += 1
                self.running_var.add_((s.to(self.running_var) - self.running_var)
                                      / self._num_recal)
            z = xs * _broadcast(torch.rsqrt(s + self.eps), xs, fmt)
            y = torch.addcmul(_broadcast(self.bias.to(dtype), z, fmt), z,
                              _broadcast(self.weight.to(dtype), z, fmt))
            return y.to(x.dtype)

        if not self._iter_driven:
            raise RuntimeError(
                'UN is training but nothing sets its training iteration. Add '
                "custom_hooks=[dict(type='ProgressiveNormHook')] to the config, or call "
                'mmslab.set_progressive_iter(model, it) before each training iteration.')
        it = self._iter
        if self._last_iter != it:
            var, mode, outlier = self._push_statistic(s, it)
        else:
            same = self._iter_mode is not None and self._iter_mode[0] == it
            mode, outlier = self._iter_mode[1:] if same else (_CURRENT, None)
            # Same smoothed variance as the iteration's first forward, or this call's own
            # statistic when the averages are off (warm-up or outlier iteration).
            var = s
            if mode == _AVERAGE:
                var = self._geometric_mean(self.window.to(s))
                if outlier is not None:
                    var = torch.where(outlier, s, var)
        var = var.to(dtype)
        scale = None
        if self.grad_scale_clamp is not None and it >= self.grad_scale_first_iter:
            # r compares with running_var from before this iteration's update.
            pushed = self._iter_mode is not None and self._iter_mode[0] == it \
                and self._iter_running is not None
            running = self._iter_running if pushed else self.running_var
            c = self.grad_scale_clamp
            scale = torch.sqrt(var + self.eps) / torch.sqrt(running.to(var) + self.eps)
            scale = scale.clamp(1.0 / c, c)
            if outlier is not None:  # r = 1 on an outlier step
                scale = scale.masked_fill(outlier, 1.0)
        # w * z with the estimated-gradient backward (weight gradient sum(dL/dy * r * z)).
        wz = _UNNormalize.apply(xs, self.weight.to(dtype), torch.rsqrt(var + self.eps), scale,
                                self, it, mode, outlier)
        return (wz + _broadcast(self.bias.to(dtype), wz, fmt)).to(x.dtype)

    def _fused_affine(self) -> Tuple[Tensor, Tensor]:
        scale = self.weight.detach().double() * torch.rsqrt(self.running_var.double() + self.eps)
        return scale, self.bias.detach().double()

    def extra_repr(self) -> str:
        s = f'{self.num_features}, data_format={self.data_format}'
        if self.deploy:
            return s + ', deploy=True'
        return (s + f', eps={self.eps}, window_size={self.window_size}, '
                f'warmup_iters={self.warmup_iters}, momentum={self.momentum}, '
                f'outlier_filtration={self.outlier_filtration}, '
                f'grad_scale_clamp={self.grad_scale_clamp}, '
                f'grad_scale_start={self.grad_scale_start}')
