from .backbones import *  # noqa: F401,F403
from .layers import *  # noqa: F401,F403
from .reparam import reparameterize, statistic_modules

__all__ = ['reparameterize', 'statistic_modules']
