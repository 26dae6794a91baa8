"""Loading the shipped configs and shrinking their backbones, shared by the config tests
(import them from here)."""
import copy
import functools
import os.path as osp

from mmengine.config import Config

from mmslab.models.backbones.pvt import ReparamPVT
from mmslab.models.backbones.swin import ReparamSwinTransformer
from mmslab.utils.launch import model_registry, resolve_scope

CONFIG_DIR = osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))), 'configs')

#: Input size of the tiny models.
SIZE = 64
#: Widths and depths that shrink a config's backbone (its structure is kept).
TINY_SWIN = dict(embed_dims=16, depths=(1, 1, 2, 1), num_heads=(1, 1, 2, 2),
                 window_size=(8, 4, 2, 2), mlp_ratio=2)
TINY_PVT = dict(embed_dims=8, num_layers=(1, 1, 1, 1), num_heads=(1, 2, 4, 4),
                mlp_ratios=(2, 2, 2, 2), pretrain_img_size=SIZE)


@functools.lru_cache(maxsize=None)
def _load(path) -> Config:
    return Config.fromfile(path)


def load(path) -> Config:
    """The config (parsed once per session; a copy, so tests may modify it)."""
    return copy.deepcopy(_load(path))


def registry(cfg):
    """The MODELS registry of the config's scope, made the default (as the tools do)."""
    return model_registry(resolve_scope(cfg))


def tiny_backbone_cfg(backbone: dict, models) -> dict:
    """The config's backbone with tiny widths/depths; everything else kept."""
    bb = copy.deepcopy(dict(backbone))
    bb['init_cfg'] = None
    cls = models.get(bb['type'])
    if issubclass(cls, ReparamSwinTransformer):
        bb.update(TINY_SWIN)
    elif issubclass(cls, ReparamPVT):
        bb.update(TINY_PVT)
    else:
        raise AssertionError(f'no tiny override for backbone type {bb["type"]}; add one here')
    return bb
