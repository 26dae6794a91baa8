"""Resizing a converted state dict to the target model's windows and grids."""
from collections import OrderedDict
from typing import Dict, List, Tuple

import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .common import MODEL_BUFFERS, is_square, isqrt, pair


def resize_relative_position_bias_table(table: Tensor, window_size) -> Tensor:
    """Bicubically resize a ``[(2Wh-1)*(2Ww-1), heads]`` table (square source) to a window."""
    wh, ww = pair(window_size)
    n, heads = table.shape
    s = isqrt(n, 'relative_position_bias_table')
    size = (2 * wh - 1, 2 * ww - 1)
    if (s, s) == size:
        return table
    grid = table.t().reshape(1, heads, s, s).float()
    out = F.interpolate(grid, size=size, mode='bicubic', align_corners=False)
    return out.reshape(heads, -1).t().contiguous().to(table.dtype)


def resize_positional_encoding(pos: Tensor, hw) -> Tensor:
    """Bilinearly resize a ``[1, S*S, C]`` token-grid encoding to ``[1, H*W, C]``."""
    h, w = pair(hw)
    _, n, c = pos.shape
    s = isqrt(n, 'positional encoding')
    if (s, s) == (h, w):
        return pos
    grid = pos.reshape(1, s, s, c).permute(0, 3, 1, 2).float()
    out = F.interpolate(grid, size=(h, w), mode='bilinear', align_corners=False)
    return out.flatten(2).transpose(1, 2).contiguous().to(pos.dtype)


def drop_model_owned_buffers(sd: Dict[str, Tensor]) -> List[str]:
    """Remove ``relative_position_index``/``attn_mask`` entries in place; returns their keys."""
    keys = [k for k in sd if k.endswith(MODEL_BUFFERS)]
    for k in keys:
        del sd[k]
    return keys


def adapt_to_model(state_dict: Dict[str, Tensor], model: nn.Module
                   ) -> Tuple['OrderedDict[str, Tensor]', List[str]]:
    """Resize relative-position tables, SLA positional encodings and PVT position embeddings
    whose window/grid differs from ``model``'s, and drop the model-owned buffers.

    Returns ``(state_dict, resized_keys)``.
    """
    sd = OrderedDict(state_dict)
    drop_model_owned_buffers(sd)
    own = model.state_dict()
    resized = []
    for k, v in list(sd.items()):
        if k not in own or own[k].shape == v.shape:
            continue
        owner_name = k.rsplit('.', 1)[0]
        try:
            owner = model.get_submodule(owner_name)
        except AttributeError:
            continue
        if k.endswith('relative_position_bias_table') and v.dim() == 2:
            new = resize_relative_position_bias_table(v, owner.window_size)
        elif k.endswith('positional_encoding') and v.dim() == 3 and is_square(v.shape[1]):
            new = resize_positional_encoding(v, owner.window_size)
        elif k.endswith('pos_embed') and v.dim() == 3 and is_square(v.shape[1]):
            new = resize_positional_encoding(v, owner.pos_shape)
        else:
            continue
        if new.shape == own[k].shape:
            sd[k] = new
            resized.append(k)
    return sd, resized

