"""Key map of PVT v1 (official, SLAB authors' PRepBN/SLAB-PVT) to mmslab's (= mmdet's)
names: ``patch_embed{s}``/``pos_embed{s}``/``block{s}.{j}`` -> ``layers.{s-1}.{0,1,2}``, q + kv
-> one in-projection, 1x1-conv FFN."""
import re
from collections import OrderedDict
from typing import Dict, List

import torch
from torch import Tensor

from .common import any_key_matches, is_square


def convert_pvt_keys(sd: Dict[str, Tensor], dropped: List[str]) -> 'OrderedDict':
    """Map a PVT v1 ``sd`` to mmslab names; appends the keys it drops to ``dropped``."""
    if any_key_matches(sd, r'\.mlp\.dwconv\.'):
        raise ValueError('PVT v2 checkpoints (mlp.dwconv) are not supported: mmslab has PVT v1')
    # blocks follow the position embedding
    offset = 1 if any_key_matches(sd, r'^pos_embed\d+$') else 0
    sla_blocks = set()
    for k in sd:
        m = re.match(r'block(\d+)\.(\d+)\.attn\.(dwc\.|positional_encoding$)', k)
        if m:
            sla_blocks.add((m.group(1), m.group(2)))
    new = OrderedDict()
    for k, v in sd.items():
        if k == 'cls_token' or k.startswith('head.') or k.startswith('norm.'):
            dropped.append(k)
            continue
        m = re.match(r'patch_embed(\d+)\.(proj|norm)\.(.*)$', k)
        if m:
            name = 'projection' if m.group(2) == 'proj' else 'norm'
            new[f'layers.{int(m.group(1)) - 1}.0.{name}.{m.group(3)}'] = v
            continue
        m = re.match(r'pos_embed(\d+)$', k)
        if m:
            n = v.shape[1]
            if not is_square(n) and is_square(n - 1):
                v = v[:, 1:]  # PVT v1 stage 4: drop the class token's embedding
            new[f'layers.{int(m.group(1)) - 1}.1.0.pos_embed'] = v
            continue
        m = re.match(r'block(\d+)\.(\d+)\.(.*)$', k)
        if not m:
            new[k] = v  # unknown: reported as unexpected when loading
            continue
        s, j, sub = m.group(1), m.group(2), m.group(3)
        base = f'layers.{int(s) - 1}.1.{int(j) + offset}.'
        sla = (s, j) in sla_blocks
        if sub.startswith('attn.kv.'):
            if f'block{s}.{j}.attn.q.{sub[8:]}' not in sd:
                raise ValueError(f'{k} has no matching attn.q entry')
            continue  # consumed together with attn.q
        if sub.startswith('attn.q.'):
            what = sub[7:]
            kv = sd.get(f'block{s}.{j}.attn.kv.{what}')
            if kv is None:
                raise ValueError(f'{k} has no matching attn.kv entry')
            qkv = torch.cat([v, kv], dim=0)
            if sla:
                new[base + f'attn.kernel.qkv.{what}'] = qkv
            else:
                new[base + f'attn.attn.in_proj_{what}'] = qkv
        elif sub.startswith('attn.proj.'):
            new[base + ('attn.kernel.proj.' if sla else 'attn.attn.out_proj.') + sub[10:]] = v
        elif sub.startswith('attn.dwc.') or sub == 'attn.positional_encoding':
            new[base + 'attn.kernel.' + sub[5:]] = v
        elif sub.startswith('attn.sr.') or sub.startswith('attn.norm.'):
            if sla:
                raise ValueError(f'{k}: SLA with spatial reduction (sr_ratio > 1) is not '
                                 'supported (mmslab SLA-PVT stages use sr=1)')
            new[base + sub] = v
        elif sub.startswith('mlp.fc1.') or sub.startswith('mlp.fc2.'):
            idx = 0 if sub.startswith('mlp.fc1.') else 3
            if sub.endswith('.weight'):
                v = v.reshape(*v.shape, 1, 1)  # 1x1 convs in mmdet's FFN
            new[base + f'ffn.layers.{idx}.' + sub[8:]] = v
        else:
            new[base + sub] = v  # norm1 / norm2
    return new

