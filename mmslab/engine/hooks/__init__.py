from .progressive_norm_hook import (ProgressiveNormHook, progressive_ratio,
                                    set_progressive_iter)
from .precision_hook import PrecisionHook
from .reparam_eval_hook import ReparamEvalHook
from .runtime_backend_hook import RuntimeBackendHook, read_export_info

__all__ = ['PrecisionHook', 'ProgressiveNormHook', 'ReparamEvalHook', 'RuntimeBackendHook',
           'progressive_ratio', 'read_export_info', 'set_progressive_iter']
