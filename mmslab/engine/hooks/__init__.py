from .progressive_norm_hook import (ProgressiveNormHook, progressive_ratio,
                                    set_progressive_iter)

__all__ = ['ProgressiveNormHook', 'progressive_ratio', 'set_progressive_iter']
