"""diffusers adapter: route a pipeline's (or model's) attention through sparsepatch.

How it hooks in, without touching any forward():
- a `sparsepatch` member is added to diffusers' closed `AttentionBackendName` enum and registered with the backend
  registry (removed again when the last patch goes); processors that call `dispatch_attention_fn` get it as their
  per-instance `_attention_backend` — the global active backend is never changed;
- each patched attention module's processor is re-classed in place to a subclass whose `__call__` (signature kept
  by functools.wraps: the host filters kwargs by it) tells the backend which layer is calling and, for joint
  text+video attention, how many text tokens there are (they become must_do ranges);
- processors that call F.scaled_dot_product_attention directly (CogVideoX, Mochi) run under a TorchFunctionMode
  that routes those calls (sdpa_mode.py);
- the denoiser's `cache_context` and `_reset_stateful_cache` get instance-level wrappers: the first names the CFG
  branch of the coming call, the second (called by every pipeline at the end of `__call__`) ends the video;
- a forward pre-hook on each denoiser records the latent shape of the call: skip lists are keyed on it, so a
  call with the same token count but another (frames, height, width) grid starts fresh lists.
Instance attributes are deleted and classes restored on unpatch, so the model is bit-exactly what it was.

Processors cloned from a patched one (`type(proc)()`, as diffusers' IP-adapter loaders do) are served too: the
clone finds its module's binding on its first call (and is restored on unpatch); a clone called outside any
patched module turns back into its original class and runs the host's own attention, with a one-time warning.
Private diffusers names are reached only through diffusers_compat.py.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import re
import weakref
from dataclasses import dataclass

import torch

from .. import kernels
from ..config import DenseConfig, LightningConfig, NSAConfig, SkipConfig
from . import diffusers_compat as compat
from . import sdpa_mode
from .state import CallSite, batched_cfg_branches

logger = logging.getLogger("sparsepatch")


@dataclass(frozen=True)
class ModelSpec:
    """What sparsepatch needs to know about one diffusers denoiser class.

    self_attention: regexes (full match on the module's qualified name) of the self/joint attention modules.
    text: where joint attention puts the text tokens in the sequence: None, "prefix" or "suffix".
    batched_cfg: the pipeline batches [uncond, cond] into one call (branch = batch half).
    """

    self_attention: tuple
    text: str | None = None
    batched_cfg: bool = False


_BLOCKS_ATTN1 = (r"blocks\.\d+\.attn1",)
_TRANSFORMER_BLOCKS_ATTN1 = (r"transformer_blocks\.\d+\.attn1",)
_DOUBLE_SINGLE = (r"transformer_blocks\.\d+\.attn", r"single_transformer_blocks\.\d+\.attn")

MODEL_SPECS: dict[str, ModelSpec] = {
    "WanTransformer3DModel": ModelSpec(_BLOCKS_ATTN1),
    "WanVACETransformer3DModel": ModelSpec((r"(vace_)?blocks\.\d+\.attn1",)),
    "WanAnimateTransformer3DModel": ModelSpec(_BLOCKS_ATTN1),
    "HunyuanVideoTransformer3DModel": ModelSpec(_DOUBLE_SINGLE, text="suffix"),
    "HunyuanVideoFramepackTransformer3DModel": ModelSpec(_DOUBLE_SINGLE, text="suffix"),
    "CogVideoXTransformer3DModel": ModelSpec(_TRANSFORMER_BLOCKS_ATTN1, text="prefix", batched_cfg=True),
    "LTXVideoTransformer3DModel": ModelSpec(_TRANSFORMER_BLOCKS_ATTN1, batched_cfg=True),
    "MochiTransformer3DModel": ModelSpec(_TRANSFORMER_BLOCKS_ATTN1, text="suffix", batched_cfg=True),
    "FluxTransformer2DModel": ModelSpec(_DOUBLE_SINGLE, text="prefix"),
}

BACKEND_VALUE = "sparsepatch"
_DENOISER_NAMES = re.compile(r"(transformer|unet|prior)(_\d+)?")


def is_diffusers_object(obj) -> bool:
    try:
        from diffusers import DiffusionPipeline, ModelMixin
    except ImportError:
        return False
    return isinstance(obj, (DiffusionPipeline, ModelMixin))


def _denoisers(obj) -> dict[str, object]:
    """{prefix: denoiser model}: a pipeline's transformer / transformer_2 / unet, or the model itself (prefix "")."""
    from diffusers import DiffusionPipeline, ModelMixin
    if isinstance(obj, ModelMixin):
        return {"": obj}
    assert isinstance(obj, DiffusionPipeline)
    found = {name: comp for name, comp in obj.components.items()
             if isinstance(comp, ModelMixin) and _DENOISER_NAMES.fullmatch(name)}
    if not found:
        raise ValueError(f"pipe_or_model: {type(obj).__name__} has no transformer/unet component to patch")
    return found


def _spec(model) -> ModelSpec | None:
    return MODEL_SPECS.get(type(model).__name__)


def recipe_keys(obj) -> list[str]:
    """Names a recipe may be keyed by: the denoisers' class names."""
    return [type(m).__name__ for m in _denoisers(obj).values()]


def overlaps(obj, other) -> bool:
    if not is_diffusers_object(other):
        return False
    mine = {id(m) for m in _denoisers(obj).values()}
    return any(id(m) in mine for m in _denoisers(other).values())


# --- the backend ----------------------------------------------------------------------------------------------
_ACTIVE: list = []          # stack of _Binding for the processor calls in flight (innermost last)


@dataclass
class _Binding:
    """A patched processor's link to its handle: layer identity and joint-attention text layout."""

    handle: object
    site: CallSite
    prefix: str
    text: str | None
    text_len: int = 0
    member: object = None      # the AttentionBackendName member of the sparsepatch backend

    def attend(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        S = q.shape[1]
        must_do = None
        if self.text and self.text_len:
            must_do = [(0, self.text_len)] if self.text == "prefix" else [(S - self.text_len, S)]
        context = self.handle.contexts.get(self.prefix, "default")
        return self.handle.attend(self.site, context, q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                  scale=scale, dropout_p=dropout_p, must_do=must_do)


def sparsepatch_attention_backend(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                  enable_gqa=False, _parallel_config=None):
    """diffusers attention backend: (B, S, H, D) tensors in and out, like every diffusers backend.

    Registered as context-parallel capable: under `enable_parallelism` (Ulysses / ring) `_parallel_config` is set and
    the call goes through diffusers' templated CP attention with sparsepatch forward ops (parallel.py).
    """
    if _parallel_config is not None and _parallel_config.context_parallel_config is not None:
        from . import parallel
        return parallel.attention(_ACTIVE[-1] if _ACTIVE else None, query, key, value, attn_mask, dropout_p,
                                  is_causal, scale, _parallel_config)
    if not _ACTIVE:   # called by a processor we did not patch (e.g. the user set the backend globally)
        return kernels.attention(query, key, value, causal=is_causal, scale=scale, attn_mask=attn_mask)
    return _ACTIVE[-1].attend(query, key, value, attn_mask, dropout_p, is_causal, scale)


_BACKEND_USERS = [0]


def _backend_member():
    """Add (once) the `sparsepatch` member to AttentionBackendName and register the backend; returns the member."""
    member = compat.backend_member(BACKEND_VALUE)
    if member is None:
        member = compat.add_backend(BACKEND_VALUE, sparsepatch_attention_backend, context_parallel=True)
    _BACKEND_USERS[0] += 1
    return member


def _release_backend_member():
    """One user fewer; the last one removes the enum member and the registry entries."""
    _BACKEND_USERS[0] -= 1
    if _BACKEND_USERS[0] <= 0:
        _BACKEND_USERS[0] = 0
        compat.remove_backend(BACKEND_VALUE)


# --- processor subclasses -------------------------------------------------------------------------------------
_SUBCLASSES: dict[type, type] = {}
# patched attention module -> its _Binding. Weak keys; a binding refers to its handle, never to the model.
_MODULE_BINDINGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_OWN_ATTRS = ("_sparsepatch_binding", "_sparsepatch_route")
_WARNED: set = set()


def _original_class(cls: type):
    return cls.__dict__.get("_sparsepatch_original_class")


def _adopt(proc, attn):
    """A processor of a patched class without a binding: a clone (`type(proc)()`). Bind it to its module's binding,
    or, when the module is not patched (any more), turn it back into its original class. Returns the binding or
    None."""
    binding = _MODULE_BINDINGS.get(attn)
    if binding is None or binding.handle.removed:
        proc.__class__ = _original_class(type(proc))
        if "orphan" not in _WARNED:
            _WARNED.add("orphan")
            logger.warning("sparsepatch: a processor cloned from a patched one runs outside a patched module; it "
                           "runs the host's own attention")
        return None
    try:
        _bind(binding.handle, proc, binding)
    except RuntimeError:   # the patched object is gone (its undo stack with it): serve the call, nothing to undo
        pass
    return binding


def _patched_class(orig_cls: type) -> type:
    """A subclass of a processor class whose __call__ announces its binding to the backend."""
    if orig_cls in _SUBCLASSES:
        return _SUBCLASSES[orig_cls]
    orig_call = orig_cls.__call__
    params = list(inspect.signature(orig_call).parameters)
    ehs_pos = params.index("encoder_hidden_states") - 2 if "encoder_hidden_states" in params else None

    @functools.wraps(orig_call)
    def __call__(self, attn, *args, **kwargs):
        binding = self.__dict__.get("_sparsepatch_binding")
        if binding is None:
            binding = _adopt(self, attn)
            if binding is None:
                return orig_call(self, attn, *args, **kwargs)
        if binding.text:
            ehs = kwargs.get("encoder_hidden_states")
            if ehs is None and ehs_pos is not None and len(args) > ehs_pos:
                ehs = args[ehs_pos]
            if ehs is not None:   # single-stream blocks (already concatenated) reuse the last joint block's length
                binding.handle.contexts[binding.prefix + "#text"] = ehs.shape[1]
            binding.text_len = binding.handle.contexts.get(binding.prefix + "#text", 0)
        _ACTIVE.append(binding)
        try:
            if self._sparsepatch_route == "sdpa":
                with sdpa_mode.route_sdpa(binding.attend):
                    return orig_call(self, attn, *args, **kwargs)
            return orig_call(self, attn, *args, **kwargs)
        finally:
            _ACTIVE.pop()

    sub = type(orig_cls.__name__, (orig_cls,), {"__call__": __call__, "__module__": orig_cls.__module__,
                                                "_sparsepatch_original_class": orig_cls})
    _SUBCLASSES[orig_cls] = sub
    return sub


def _bind(handle, proc, binding) -> None:
    """Re-class `proc` in place and give it the binding (and, for dispatching processors, the sparsepatch backend);
    the undo puts back its class and instance attributes exactly."""
    orig_cls = _original_class(type(proc)) or type(proc)
    route = "dispatch" if compat.calls_dispatch(orig_cls) else "sdpa"
    values = (("_sparsepatch_binding", binding), ("_sparsepatch_route", route))
    if route == "dispatch":
        values += ((compat.PROCESSOR_BACKEND_ATTR, binding.member),)
    undo_attrs = []
    for attr, value in values:
        undo_attrs.append((attr, attr in proc.__dict__, proc.__dict__.get(attr)))
        setattr(proc, attr, value)
    proc.__class__ = _patched_class(orig_cls)

    def undo(proc=proc, orig_cls=orig_cls, undo_attrs=undo_attrs):
        proc.__class__ = orig_cls
        for attr, had, value in reversed(undo_attrs):
            if had:
                proc.__dict__[attr] = value
            else:
                proc.__dict__.pop(attr, None)
    handle.add_undo(undo)


def _unbind_leftover(proc, member) -> None:
    """A processor of a patched class that no undo knows (a clone never called): original class, our attributes
    gone."""
    orig_cls = _original_class(type(proc))
    if orig_cls is None:
        return
    proc.__class__ = orig_cls
    for attr in _OWN_ATTRS:
        proc.__dict__.pop(attr, None)
    if proc.__dict__.get(compat.PROCESSOR_BACKEND_ATTR) is member:
        proc.__dict__.pop(compat.PROCESSOR_BACKEND_ATTR)


def _attention_modules(model, config, spec):
    """[(qualified name, module)] of the attention modules to patch."""
    selected = []
    for name, module in model.named_modules():
        proc = getattr(module, "processor", None)
        if proc is None or not callable(proc) or not hasattr(module, "set_processor"):
            continue
        if isinstance(config, DenseConfig) and config.layers == "all":
            selected.append((name, module))
        elif spec is not None and any(re.fullmatch(p, name) for p in spec.self_attention):
            selected.append((name, module))
        elif spec is None and not getattr(module, "is_cross_attention", True):
            selected.append((name, module))
    return selected


def _patch_processor(handle, module, layer, prefix, spec, member, seen):
    binding = _Binding(handle, CallSite(layer, batched_cfg_branches if spec is not None and spec.batched_cfg else None,
                                        grid_key=prefix + "#grid"),
                       prefix, spec.text if spec else None, member=member)

    def undo_module(module=module, member=member):
        # Runs after the processor's own undo: whatever processor the module holds now (a clone set after the
        # patch, e.g. by an IP-adapter loader) goes back to its original class too.
        _MODULE_BINDINGS.pop(module, None)
        proc = getattr(module, "processor", None)
        if proc is not None:
            _unbind_leftover(proc, member)
    handle.add_undo(undo_module)
    _MODULE_BINDINGS[module] = binding
    proc = module.processor
    if id(proc) in seen:   # a processor shared by several modules: give this module its own copy
        original_proc = proc
        proc = copy.copy(proc)
        module.processor = proc

        def undo_copy(m=module, p=original_proc, mine=proc):
            if m.processor is mine:   # not replaced by the user since
                m.processor = p
        handle.add_undo(undo_copy)
    seen.add(id(proc))
    _bind(handle, proc, binding)


def _wrap_denoiser(handle, model, prefix):
    """Instance-level wrappers of cache_context (names the branch) and _reset_stateful_cache (ends the video)."""
    orig_cache_context = model.cache_context
    orig_reset = getattr(model, compat.RESET_METHOD, None)

    @contextlib.contextmanager
    def cache_context(name, **kwargs):
        previous = handle.contexts.get(prefix)
        handle.contexts[prefix] = name
        try:
            with orig_cache_context(name, **kwargs):
                yield
        finally:
            if previous is None:
                handle.contexts.pop(prefix, None)
            else:
                handle.contexts[prefix] = previous

    def reset_stateful_cache(*args, **kwargs):
        handle.reset()
        if orig_reset is not None:
            return orig_reset(*args, **kwargs)

    grid_key = prefix + "#grid"

    def record_grid(module, args, kwargs):
        # The latent shape of this call (batch excluded) and, for packed-token models (LTX), the grid kwargs:
        # it fixes the (frames, height, width) token grid after patch embedding.
        hs = kwargs.get("hidden_states", args[0] if args else None)
        if isinstance(hs, torch.Tensor):
            grid = tuple(int(n) for n in hs.shape[1:])
            grid += tuple(int(kwargs[n]) for n in ("num_frames", "height", "width") if isinstance(kwargs.get(n), int))
            handle.contexts[grid_key] = grid

    hook = model.register_forward_pre_hook(record_grid, with_kwargs=True)
    handle.add_undo(hook.remove)

    for attr, fn in (("cache_context", cache_context), (compat.RESET_METHOD, reset_stateful_cache)):
        had, value = attr in model.__dict__, model.__dict__.get(attr)
        model.__dict__[attr] = fn

        def undo(attr=attr, had=had, value=value):
            if had:
                model.__dict__[attr] = value
            else:
                model.__dict__.pop(attr, None)
        handle.add_undo(undo)


def patch_model(obj, config, handle) -> None:
    if isinstance(config, (NSAConfig, LightningConfig)):
        raise NotImplementedError(f"{type(config).__name__} is not available for diffusers models yet")
    denoisers = _denoisers(obj)
    if isinstance(config, SkipConfig):
        unknown = [type(m).__name__ for m in denoisers.values() if _spec(m) is None]
        if unknown:
            raise ValueError(f"pipe_or_model: no skip-attention recipe for {unknown}; supported: "
                             f"{sorted(MODEL_SPECS)} (DenseConfig works with any diffusers model)")
    compat.warn_if_untested()
    member = _backend_member()
    # A process-wide registration: released on unpatch, or when the handle dies with a model deleted unpatched.
    getattr(handle, "add_release", handle.add_undo)(_release_backend_member)
    for prefix, model in denoisers.items():
        spec = _spec(model)
        modules = _attention_modules(model, config, spec)
        if not modules:
            raise ValueError(f"pipe_or_model: found no attention modules to patch in {type(model).__name__}")
        seen = set()
        for name, module in modules:
            layer = f"{prefix}.{name}" if prefix else name
            _patch_processor(handle, module, layer, prefix, spec, member, seen)
        _wrap_denoiser(handle, model, prefix)
