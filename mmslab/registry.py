"""Dual registration of mmslab components into mmdet's and mmseg's registries.

mmdet's and mmseg's ``MODELS`` registries are siblings under mmengine's root registry, so a
class registered in one is invisible from a config of the other. Every mmslab model component is
therefore registered in three places: mmslab's own ``MODELS`` (a child of the root, used when
mmslab builds its own sub-layers with no default scope), mmdet's and mmseg's ``MODELS``.
Hooks go into mmengine's root ``HOOKS`` and optimizer wrappers into its root
``OPTIM_WRAPPERS``, so both codebases find them.

Registering a name that mmdet, mmseg or mmslab already has is an error at import time.
"""
from typing import Callable, Optional

from mmengine.registry import HOOKS as MMENGINE_HOOKS
from mmengine.registry import MODELS as MMENGINE_MODELS
from mmengine.registry import OPTIM_WRAPPERS as MMENGINE_OPTIM_WRAPPERS
from mmengine.registry import Registry

MODELS = Registry('model', parent=MMENGINE_MODELS, scope='mmslab', locations=['mmslab.models'])
HOOKS = MMENGINE_HOOKS
OPTIM_WRAPPERS = MMENGINE_OPTIM_WRAPPERS

_SIBLINGS = None


def _sibling_registries():
    """mmdet's and mmseg's MODELS registries with their lazily-registered modules imported."""
    global _SIBLINGS
    if _SIBLINGS is None:
        from mmdet.registry import MODELS as MMDET_MODELS
        from mmseg.registry import MODELS as MMSEG_MODELS
        # Their modules register on import; import them now so clashes are seen.
        MMDET_MODELS.import_from_location()
        MMSEG_MODELS.import_from_location()
        _SIBLINGS = (MMDET_MODELS, MMSEG_MODELS)
    return _SIBLINGS


def _check_free(name: str, registries) -> None:
    for registry in registries:
        if name in registry.module_dict:
            raise KeyError(f'mmslab cannot register {name!r}: the name is already taken in the '
                           f'{registry.scope!r} registry {registry.name!r}. Choose another name.')


def register_model(name: Optional[str] = None) -> Callable[[type], type]:
    """Class decorator: register a model component in mmslab, mmdet and mmseg ``MODELS``.

    The root registry is checked too, so names such as ``LN`` or ``BN`` from mmcv cannot be
    shadowed.
    """

    def _register(cls: type) -> type:
        key = name or cls.__name__
        registries = (MODELS, *_sibling_registries())
        _check_free(key, (*registries, MMENGINE_MODELS))
        for registry in registries:
            registry.register_module(name=key, module=cls)
        return cls

    return _register


def _register_in_root(root, registry_name: str, name: Optional[str]) -> Callable[[type], type]:
    """Class decorator registering in mmengine's root registry ``root``, after checking that
    neither it nor mmdet's / mmseg's registry of the same name (its children, which find it)
    has the name."""

    def _register(cls: type) -> type:
        key = name or cls.__name__
        import mmdet.registry
        import mmseg.registry
        children = (getattr(mmdet.registry, registry_name),
                    getattr(mmseg.registry, registry_name))
        for child in children:
            child.import_from_location()
        _check_free(key, (root, *children))
        root.register_module(name=key, module=cls)
        return cls

    return _register


def register_hook(name: Optional[str] = None) -> Callable[[type], type]:
    """Class decorator: register a hook in mmengine's root ``HOOKS`` (found from mmdet and
    mmseg)."""
    return _register_in_root(HOOKS, 'HOOKS', name)


def register_optim_wrapper(name: Optional[str] = None) -> Callable[[type], type]:
    """Class decorator: register an optimizer wrapper in mmengine's root ``OPTIM_WRAPPERS``
    (found from mmdet's and mmseg's configs, whose registries are its children)."""
    return _register_in_root(OPTIM_WRAPPERS, 'OPTIM_WRAPPERS', name)
