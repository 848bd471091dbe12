"""Every reach into transformers internals (private or undocumented names) lives here, and only here.

transformers.py and transformers_nsa.py call these functions. `check()` lists what a transformers release moved;
tests/test_trust_patcher.py asserts it is empty for the installed transformers, so CI on each supported version fails
with a message naming the moved piece. (transformers_lightning.py reaches into MiniMax's modeling code, which it
documents itself.)
"""
from __future__ import annotations

import inspect
import logging

logger = logging.getLogger("sparsepatch")

#: transformers releases the adapter tests ran against (oldest, newest).
TESTED_VERSIONS = ("5.0.0", "5.23.0")

_MISSING = object()


def version() -> str:
    import transformers
    return transformers.__version__


def _interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    return AttentionInterface, AttentionMaskInterface


def registered(name: str) -> tuple:
    """(attention function, mask function) registered globally under `name`; MISSING where none is."""
    return tuple(iface._global_mapping.get(name, _MISSING) for iface in _interfaces())


def register(name: str, attention_fn) -> None:
    """Register attention_fn under `name` in AttentionInterface and transformers' sdpa_mask (boolean masks, True =
    attend) under the same name in AttentionMaskInterface (without it the model passes no mask at all)."""
    from transformers.masking_utils import sdpa_mask
    attention_iface, mask_iface = _interfaces()
    attention_iface.register(name, attention_fn)
    mask_iface.register(name, sdpa_mask)


def restore(name: str, previous: tuple) -> None:
    """Put back what `registered(name)` returned before `register` (unregister where it was MISSING)."""
    for iface, prev in zip(_interfaces(), previous):
        if prev is _MISSING:
            iface._global_mapping.pop(name, None)
        else:
            iface._global_mapping[name] = prev


def get_impl(config):
    """The config's own attention implementation as stored (None = not set), without the resolution the public
    property performs."""
    return config._attn_implementation_internal


def set_impl(config, impl) -> None:
    """Store an implementation exactly as get_impl returned it (no validation, no recursion into sub-configs)."""
    config._attn_implementation_internal = impl


def can_set_attn_implementation(model_cls) -> bool:
    """False when the model class cannot switch attention implementation in place (absent check: try anyway)."""
    can_set = getattr(model_cls, "_can_set_attn_implementation", None)
    return True if can_set is None else bool(can_set())


def check() -> list[str]:
    """What the installed transformers moved, one line per private piece used ([] = all in place)."""
    problems = []
    try:
        attention_iface, mask_iface = _interfaces()
    except ImportError as e:
        return [f"AttentionInterface / masking_utils.AttentionMaskInterface: {e}"]
    for iface in (attention_iface, mask_iface):
        if not isinstance(getattr(iface, "_global_mapping", None), dict):
            problems.append(f"{iface.__name__}._global_mapping is not a dict any more")
        if not callable(getattr(iface, "register", None)):
            problems.append(f"{iface.__name__}.register is gone")
    try:
        from transformers.masking_utils import sdpa_mask
    except ImportError:
        problems.append("masking_utils.sdpa_mask is gone")
    else:
        if "allow_is_causal_skip" not in inspect.signature(sdpa_mask).parameters:
            problems.append("sdpa_mask no longer takes allow_is_causal_skip (mask may not be skipped any more)")
    try:
        from transformers import LlamaConfig, PreTrainedModel
    except ImportError as e:
        return problems + [f"PreTrainedModel / LlamaConfig: {e}"]
    cfg = LlamaConfig()
    if not hasattr(cfg, "_attn_implementation_internal"):
        problems.append("PretrainedConfig._attn_implementation_internal is gone")
    if not callable(getattr(PreTrainedModel, "set_attn_implementation", None)):
        problems.append("PreTrainedModel.set_attn_implementation is gone")
    return problems
