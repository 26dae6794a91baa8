from .progressive_norm_hook import (ProgressiveNormHook, progressive_ratio,
                                    set_progressive_iter)
from .reparam_eval_hook import ReparamEvalHook

__all__ = ['ProgressiveNormHook', 'ReparamEvalHook', 'progressive_ratio',
           'set_progressive_iter']
