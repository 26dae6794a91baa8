"""Converters from published checkpoints to mmslab backbone state dicts: pure functions of
tensor dicts (no model is built, no file is read; file I/O and model building live in
:mod:`mmslab.models.checkpoint_utils`).

Source layouts (``FORMATS``; ``docs/checkpoint_formats.md`` describes each key by key):

``slab``
    The SLAB authors' ImageNet checkpoints (``{'model': ...}``), Swin style
    (PRepBN-Swin, SLAB-Swin: ``layers.{i}.blocks.{j}...``) or PVT style (PRepBN-PVT, SLAB-PVT:
    ``patch_embed{s}``, ``pos_embed{s}``, ``block{s}.{j}``). Their progressive norm at prefix
    ``p`` holds ``p.norm1.*`` (LayerNorm), ``p.norm2.{alpha,bn.*}`` (RepBN) and the counters
    ``p.iter`` (remaining decay steps), ``p.total_step`` and ``p.warm``; a pure RepBN holds
    ``p.alpha`` and ``p.bn.*``.
``repavit``
    RePaViT's RePa-Swin (``mlp.{norm1,fc1,norm2,fc2}``: BatchNorms inside the FFN).
``swin``
    Microsoft's official Swin (downsample at the end of stages ``0..n-2``).
``timm``
    timm's ``SwinTransformer`` (downsample at the start of stages ``1..n-1``, ``head.fc``).
``pvt``
    The official PVT v1 (``cls_token``, stage-4 position embedding with the class token).
``mmslab``
    Already in mmslab's (= mmdet's) names; only the norm forms and schedule are adapted.

The pipeline, one module a step: :func:`detect_format` and :func:`convert` (``formats``) ->
key maps (``swin_keys``, ``pvt_keys``) -> norm forms and schedule (``norms``) -> resizing to
the target model (``resize``); ``infer`` reads the backbone config a state dict fits.

The progressive-norm schedule of the authors counts *down*: ``iter`` is the number of decay
steps left out of ``total_step``, so the fraction done is ``1 - iter / total_step``; it becomes
mmslab's ``schedule_offset`` (``cur_iter`` restarts at 0).
"""
from .common import strip_wrappers
from .formats import FORMATS, convert, detect_format
from .infer import ARCHS, infer_backbone_cfg, model_owned_keys
from .norms import progressive_schedule_info
from .resize import (adapt_to_model, drop_model_owned_buffers, resize_positional_encoding,
                     resize_relative_position_bias_table)

__all__ = ['FORMATS', 'ARCHS', 'detect_format', 'convert', 'strip_wrappers',
           'resize_relative_position_bias_table', 'resize_positional_encoding',
           'adapt_to_model', 'infer_backbone_cfg', 'progressive_schedule_info',
           'model_owned_keys', 'drop_model_owned_buffers']
