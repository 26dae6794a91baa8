"""Tiny backbone settings shared by the test modules: import them from here.

``test_swin_backbones`` (``TINY``, ``PRESETS``, ``build_preset``) and ``test_pvt_backbones``
(``TINY``) re-export theirs for the modules that import them from there.
"""
#: A Swin small enough for many builds per test (windows of 4, two blocks per stage).
SWIN_TINY = dict(embed_dims=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), window_size=4,
                 drop_path_rate=0.0)
#: A PVT v1 of the same spirit (64x64 pre-training grid).
PVT_TINY = dict(embed_dims=8, num_layers=(1, 1, 2, 1), num_heads=(1, 2, 2, 4),
                mlp_ratios=(2, 2, 2, 2), pretrain_img_size=64, drop_path_rate=0.0)

#: Every Swin variant the tests exercise: registered preset name (or a label, see
#: ``PRESET_TYPE``) -> arguments on top of ``SWIN_TINY``.
PRESETS = {
    'PRepBNSwin': dict(norm_cfg=dict(type='PRepBN', step=4)),
    'SLABSwin': dict(norm_cfg=dict(type='PRepBN', step=4), window_size=(8, 4, 2, 2)),
    'RePaSwin': dict(),
    'RePaSwinPRepBN': dict(norm_cfg=dict(type='PRepBN', step=4)),
    'UNSwin': dict(norm_cfg=dict(type='UN', warmup_iters=1, window_size=2)),
    'BiNormSwin': dict(norm_cfg=dict(type='RepBN'), attn_types=('binorm', 'binorm', 'window',
                                                                'window')),
}
#: Labels of ``PRESETS`` that are not registered names -> the registered type they build.
PRESET_TYPE = {'RePaSwinPRepBN': 'RePaSwin', 'UNSwin': 'ReparamSwinTransformer',
               'BiNormSwin': 'ReparamSwinTransformer'}


def build_swin(type_, **kwargs):
    """A registered Swin type (through mmdet's registry, as configs do) at ``SWIN_TINY``."""
    from mmdet.registry import MODELS
    cfg = dict(type=type_, **SWIN_TINY)
    cfg.update(kwargs)
    return MODELS.build(cfg)


def build_preset(name, **extra):
    """The ``PRESETS`` entry ``name``, with ``extra`` arguments on top."""
    kwargs = dict(PRESETS[name])
    kwargs.update(extra)
    return build_swin(PRESET_TYPE.get(name, name), **kwargs)
