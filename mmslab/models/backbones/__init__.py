from .pvt import PRepBNPVT, ReparamPVT, SLABPVT
from .swin import PRepBNSwin, RePaSwin, ReparamSwinTransformer, SLABSwin

__all__ = ['ReparamSwinTransformer', 'PRepBNSwin', 'SLABSwin', 'RePaSwin', 'ReparamPVT',
           'PRepBNPVT', 'SLABPVT']
