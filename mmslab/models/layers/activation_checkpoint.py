"""Activation checkpointing of a block whose BatchNorms keep running statistics.

``torch.utils.checkpoint`` runs a block's forward again in the backward pass; each
BatchNorm in training mode would then update its running statistics (and
``num_batches_tracked``) a second time per step, an effective momentum of about twice the
configured one. The recomputation here normalizes with the batch statistics as the first
forward did (SyncBatchNorm synchronizing them again) and leaves the statistics as the
first forward left them.
"""
import contextlib
from typing import Iterator

import torch.nn as nn
import torch.utils.checkpoint as cp
from torch.nn.modules.batchnorm import _BatchNorm


@contextlib.contextmanager
def running_stats_untouched(module: nn.Module) -> Iterator[None]:
    """Inside: the training-mode BatchNorms of ``module`` normalize with batch statistics
    as usual and move their running statistics by a factor of zero; their counters are
    restored on exit. (They keep passing their running statistics, so the recomputation
    saves the same tensors for backward as the first forward.)"""
    bns = [m for m in module.modules()
           if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
    saved = [(m.momentum, None if m.num_batches_tracked is None else
              m.num_batches_tracked.clone()) for m in bns]
    for m in bns:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(bns, saved):
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)


def checkpoint_block(module: nn.Module, fn, *args):
    """``fn(*args)`` (a forward of ``module``) with its activations recomputed in the
    backward pass, the recomputation leaving ``module``'s running statistics untouched."""
    return cp.checkpoint(fn, *args, use_reentrant=False,
                         context_fn=lambda: (contextlib.nullcontext(),
                                             running_stats_untouched(module)))
