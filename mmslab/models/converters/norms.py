"""Norm forms: the authors' progressive norms (LN + RepBN + counters) and pure RepBN to
mmslab's PRepBN/RepBN buffers, the schedule carried over as ``schedule_offset``."""
from collections import OrderedDict
from typing import Dict, List, Optional

import torch
from torch import Tensor

from ..layers.repbn import SLAB_PREPBN_STEPS
from .common import strip_wrappers


def _target_form(prefix: str, target_norm) -> Optional[str]:
    if target_norm is None or isinstance(target_norm, str):
        return target_norm
    if f'{prefix}.norm2.alpha' in target_norm:
        return 'PRepBN'
    if f'{prefix}.alpha' in target_norm:
        return 'RepBN'
    return None


def _move(sd: Dict[str, Tensor], src: str, dst: str) -> None:
    for k in [k for k in sd if k.startswith(src + '.')]:
        sd[dst + k[len(src):]] = sd.pop(k)


def convert_norms(sd: 'OrderedDict', dropped: List[str], reset_schedule: bool,
                   target_norm) -> 'OrderedDict':
    """Authors' progressive norms -> PRepBN buffers; RepBN <-> PRepBN as the target asks."""
    def is_progressive_half(p: str) -> bool:
        parent = p[:-len('.norm2')]
        return p.endswith('.norm2') and (f'{parent}.total_step' in sd or
                                         f'{parent}.schedule_offset' in sd)

    pure = [k[:-6] for k in sd if k.endswith('.alpha') and f'{k[:-6]}.bn.running_mean' in sd
            and not is_progressive_half(k[:-6])]
    progressive = [k[:-11] for k in sd if k.endswith('.total_step')]
    for p in progressive:
        total = float(sd.pop(f'{p}.total_step'))
        remaining = float(sd.pop(f'{p}.iter', torch.tensor(total)))
        sd.pop(f'{p}.warm', None)
        done = 0.0 if reset_schedule or total <= 0 else min(max(1.0 - remaining / total, 0.0),
                                                             1.0)
        alpha = f'{p}.norm2.alpha'
        if alpha in sd:
            sd[alpha] = sd[alpha].reshape(())
        if _target_form(p, target_norm) == 'RepBN':
            for k in [k for k in sd if k.startswith(f'{p}.norm1.')]:
                dropped.append(k)
                del sd[k]
            _move(sd, f'{p}.norm2', p)
        else:
            sd[f'{p}.cur_iter'] = torch.tensor(0, dtype=torch.long)
            sd[f'{p}.schedule_offset'] = torch.tensor(done, dtype=torch.float64)
    if reset_schedule:  # progressive norms already in mmslab form
        for k in [k for k in sd if k.endswith('.schedule_offset')]:
            sd[k] = torch.tensor(0.0, dtype=torch.float64)
            sd[k[:-16] + '.cur_iter'] = torch.tensor(0, dtype=torch.long)
    for p in pure:
        sd[f'{p}.alpha'] = sd[f'{p}.alpha'].reshape(())
        if _target_form(p, target_norm) != 'PRepBN':
            continue
        # A finished schedule: RepBN in norm2, an identity LayerNorm that eval never uses.
        c = sd[f'{p}.bn.running_mean'].numel()
        ref = sd[f'{p}.bn.running_mean']
        _move(sd, p, f'{p}.norm2')
        sd[f'{p}.norm1.weight'] = torch.ones(c, dtype=ref.dtype)
        sd[f'{p}.norm1.bias'] = torch.zeros(c, dtype=ref.dtype)
        sd[f'{p}.cur_iter'] = torch.tensor(0, dtype=torch.long)
        sd[f'{p}.schedule_offset'] = torch.tensor(0.0 if reset_schedule else 1.0,
                                                  dtype=torch.float64)
    return sd


def progressive_schedule_info(state_dict: Dict[str, Tensor]) -> List[dict]:
    """The distinct ``(iter, total_step, warm)`` states of the authors' progressive norms, with
    the number of norms in each and the fraction of the decay already done."""
    groups: Dict[tuple, int] = {}
    sd = strip_wrappers(state_dict)
    for k in sd:
        if k.endswith('.total_step'):
            p = k[:-11]
            total = int(sd[k])
            remaining = int(sd.get(f'{p}.iter', sd[k]))
            warm = int(sd[f'{p}.warm']) if f'{p}.warm' in sd else None
            key = (remaining, total, warm)
            groups[key] = groups.get(key, 0) + 1
    return [dict(iter=r, total_step=t, warm=w, count=n,
                 schedule_offset=0.0 if t <= 0 else min(max(1 - r / t, 0.0), 1.0))
            for (r, t, w), n in sorted(groups.items(), key=lambda kv: kv[0][:2])]



def norm_form(sd: Dict[str, Tensor], prefix: str) -> Optional[str]:
    if f'{prefix}.schedule_offset' in sd or f'{prefix}.norm2.alpha' in sd:
        return 'PRepBN'
    if f'{prefix}.alpha' in sd:
        return 'RepBN'
    if f'{prefix}.weight' in sd:
        return 'LN'
    return None


def norm_cfg(form: str, eps: Optional[float] = None) -> dict:
    if form == 'PRepBN':
        return dict(type='PRepBN', step=SLAB_PREPBN_STEPS)
    if form == 'RepBN':
        return dict(type='RepBN')
    return dict(type='LN') if eps is None else dict(type='LN', eps=eps)

