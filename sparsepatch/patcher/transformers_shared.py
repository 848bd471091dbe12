"""What the transformers adapter and its NSA adapter share: the registry of patched attention modules, the
model checks, the reference-counted AttentionInterface registration, and the output_attentions test. Both
adapters import it; neither imports the other's internals."""
from __future__ import annotations

import threading
import weakref

import torch

from . import transformers_compat as compat

# Attention-calling module -> (handle, qualified name). Weak keys: a deleted model must not be kept alive here.
_PATCHED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def is_transformers_model(obj) -> bool:
    """True for a transformers `PreTrainedModel` (without importing transformers when it is not loaded)."""
    import sys

    if "transformers" not in sys.modules:
        return False
    try:
        from transformers import PreTrainedModel
    except ImportError:  # a broken / partial install: not ours to patch
        return False
    return isinstance(obj, PreTrainedModel)


def _check_model(model) -> None:
    if not is_transformers_model(model):
        raise ValueError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")


def _all_configs(model) -> list:
    """Every config object whose `_attn_implementation` set_attn_implementation may touch, deduplicated by id:
    the model's config, every sub-model's config, and their declared sub_configs (recursively)."""
    from transformers import PreTrainedModel

    seen, out = set(), []
    todo = [model.config] + [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    while todo:
        cfg = todo.pop()
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        out.append(cfg)
        for key in getattr(cfg, "sub_configs", {}) or {}:
            todo.append(getattr(cfg, key, None))
    return out


_MISSING = object()


class SharedRegistration:
    """An attention function (and transformers' sdpa_mask) registered under `name` in AttentionInterface and
    AttentionMaskInterface, reference-counted so several patched models share it; the last release puts back
    exactly what held the name before (normally nothing)."""

    def __init__(self, name: str, attention_fn):
        self.name, self.fn = name, attention_fn
        self.count, self.previous = 0, None
        self.lock = threading.Lock()

    def acquire(self) -> None:
        with self.lock:
            if self.count == 0:
                self.previous = compat.registered(self.name)
                compat.register(self.name, self.fn)
            self.count += 1

    def release(self) -> None:
        with self.lock:
            if self.count <= 0:
                return
            self.count -= 1
            if self.count == 0:
                compat.restore(self.name, self.previous)
                self.previous = None


def _add_release(handle, fn) -> None:
    """A process-wide release: run on unpatch, or when the handle dies with its model deleted unpatched."""
    getattr(handle, "add_release", handle.add_undo)(fn)


def wants_attentions(module, kwargs) -> bool:
    """The caller asked for attention weights: `output_attentions=True` in the call or in the model config."""
    flag = kwargs.get("output_attentions")
    if flag is None:
        flag = getattr(getattr(module, "config", None), "output_attentions", False)
    return bool(flag)
