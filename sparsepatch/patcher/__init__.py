"""Model knowledge: which attention calls to intercept and how. `patch` picks the adapter for the host library."""
from __future__ import annotations

import weakref

from ..config import DenseConfig, LightningConfig, NSAConfig, SkipConfig
from .state import PatchHandle

# patched object -> its PatchHandle. Weak keys, and a handle refers to its object only weakly: an entry never
# keeps a model alive (the model owns its undo closures, see PatchHandle).
_HANDLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_CONFIG_TYPES = (SkipConfig, DenseConfig, NSAConfig, LightningConfig)


def _adapter_for(obj):
    from . import diffusers as diffusers_adapter
    if diffusers_adapter.is_diffusers_object(obj):
        return diffusers_adapter
    from . import transformers as transformers_adapter
    if transformers_adapter.is_transformers_model(obj):
        return transformers_adapter
    raise ValueError(
        f"pipe_or_model: unsupported model type {type(obj).__name__}; sparsepatch patches diffusers pipelines and "
        "models (ModelMixin) and transformers PreTrainedModels"
    )


def recipe_keys(obj) -> list[str]:
    """Names (model class, model_type) under which sparsepatch.recipes may hold a default config for obj."""
    return _adapter_for(obj).recipe_keys(obj)


def handle_of(obj) -> PatchHandle | None:
    """The live PatchHandle of a patched pipeline/model, or None (also for objects that cannot be patched)."""
    try:
        return _HANDLES.get(obj)
    except TypeError:   # not weak-referenceable (str, None, ...): never patched
        return None


def patch(pipe_or_model, config) -> PatchHandle:
    """Swap the attention of a diffusers pipeline/model or a transformers model for sparsepatch kernels.

    `sparsepatch.patch` fills a None config from sparsepatch.recipes before calling this. Returns a PatchHandle; `unpatch` (or
    `handle.remove()`) restores the model bit-exactly. Patching an already patched object raises ValueError.
    """
    adapter = _adapter_for(pipe_or_model)
    if handle_of(pipe_or_model) is not None:
        raise ValueError("pipe_or_model is already patched; call sp.unpatch(pipe_or_model) first")
    if not isinstance(config, _CONFIG_TYPES):
        raise ValueError(f"config must be one of {[c.__name__ for c in _CONFIG_TYPES]}, got {type(config).__name__}")
    for other in list(_HANDLES.keys()):
        if hasattr(adapter, "overlaps") and adapter.overlaps(pipe_or_model, other):
            raise ValueError("pipe_or_model shares modules with an already patched object; unpatch that first")
    handle = PatchHandle(pipe_or_model, config)
    try:
        adapter.patch_model(pipe_or_model, config, handle)
    except BaseException:
        handle.remove()
        raise
    _HANDLES[pipe_or_model] = handle
    return handle


def unpatch(pipe_or_model) -> None:
    """Restore a patched object bit-exactly. Unpatching an object that is not patched (anything else: None, a
    string, an unpatched model) is a no-op."""
    handle = handle_of(pipe_or_model)
    if handle is not None:
        handle.remove()


__all__ = ["patch", "unpatch", "handle_of", "recipe_keys", "PatchHandle"]
