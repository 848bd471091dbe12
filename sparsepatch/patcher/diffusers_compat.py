"""Every reach into diffusers internals (names that are private or undocumented) lives here, and only here.

The diffusers adapter (diffusers.py) and the context-parallel path (parallel.py) call these functions instead of
touching diffusers' private names. `check()` lists what a diffusers release moved; tests/test_trust_patcher.py
asserts it is empty for the installed diffusers, so CI on each supported version fails with a message naming the
moved piece instead of a patched model failing later.

Supported: TESTED_VERSIONS (oldest and newest the adapter tests were run against). Context parallelism
(`enable_parallelism`) needs the templated CP attention of diffusers >= 0.36; with older releases only that path
raises NotImplementedError.
"""
from __future__ import annotations

import inspect
import logging

logger = logging.getLogger("sparsepatch")

#: diffusers releases the adapter tests ran against (oldest, newest).
TESTED_VERSIONS = ("0.35.0", "0.42.1")

#: Model method every pipeline calls at the end of __call__ (the end of a video).
RESET_METHOD = "_reset_stateful_cache"
#: Per-processor attribute naming the attention backend; processors that have it call `dispatch_attention_fn`.
PROCESSOR_BACKEND_ATTR = "_attention_backend"

_ENUM_NAME = "SPARSEPATCH"


def _ad():
    from diffusers.models import attention_dispatch
    return attention_dispatch


def _parse(version: str) -> tuple:
    out = []
    for part in version.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def version() -> str:
    import diffusers
    return diffusers.__version__


def warn_if_untested() -> None:
    """Log once when the installed diffusers is outside TESTED_VERSIONS (it may still work: check() passed)."""
    v = _parse(version())[:2]
    if not _parse(TESTED_VERSIONS[0])[:2] <= v <= _parse(TESTED_VERSIONS[1])[:2]:
        logger.warning("sparsepatch: diffusers %s is outside the tested range %s-%s", version(), *TESTED_VERSIONS)


# --- attention backend registry ---------------------------------------------------------------------------------
def backend_member(value: str):
    """The AttentionBackendName member with this value, or None."""
    return _ad().AttentionBackendName._value2member_map_.get(value)


def add_backend(value: str, fn, context_parallel: bool):
    """Add a member `value` to the closed AttentionBackendName enum and register fn as its backend.

    fn: (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, _parallel_config) with (B, S, H, D)
    tensors, like every diffusers backend. context_parallel: declare it context-parallel capable (where the registry
    knows the flag). Returns the member.
    """
    ad = _ad()
    enum_cls = ad.AttentionBackendName
    member = str.__new__(enum_cls, value)
    member._name_, member._value_ = _ENUM_NAME, value
    member.__objclass__ = enum_cls
    enum_cls._member_map_[_ENUM_NAME] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(_ENUM_NAME)
    reg = ad._AttentionBackendRegistry
    if "supports_context_parallel" in inspect.signature(reg.register).parameters:
        reg.register(member, supports_context_parallel=context_parallel)(fn)
    else:
        reg.register(member)(fn)
    return member


def remove_backend(value: str) -> None:
    """Undo add_backend: the enum member and every registry table entry go."""
    ad = _ad()
    enum_cls = ad.AttentionBackendName
    member = enum_cls._value2member_map_.pop(value, None)
    if member is None:
        return
    enum_cls._member_map_.pop(_ENUM_NAME, None)
    if _ENUM_NAME in enum_cls._member_names_:
        enum_cls._member_names_.remove(_ENUM_NAME)
    reg = ad._AttentionBackendRegistry
    for table in ("_backends", "_constraints", "_supported_arg_names"):
        getattr(reg, table).pop(member, None)
    getattr(reg, "_supports_context_parallel", set()).discard(value)


# --- processors and models --------------------------------------------------------------------------------------
def calls_dispatch(proc_cls: type) -> bool:
    """The processor class routes attention through dispatch_attention_fn (has a per-instance backend)."""
    return hasattr(proc_cls, PROCESSOR_BACKEND_ATTR)


# --- context parallelism (parallel.py) --------------------------------------------------------------------------
def templated_cp_attention():
    """diffusers' `_templated_context_parallel_attention(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa,
    return_lse, forward_op=, backward_op=, _parallel_config=)`."""
    fn = getattr(_ad(), "_templated_context_parallel_attention", None)
    if fn is None:
        raise NotImplementedError(f"sparsepatch: context parallelism needs diffusers >= 0.36 (found {version()})")
    return fn


def templated_ulysses_attention():
    """diffusers' TemplatedUlyssesAttention autograd Function (Ulysses all-to-all around a forward_op)."""
    cls = getattr(_ad(), "TemplatedUlyssesAttention", None)
    if cls is None:
        raise NotImplementedError(f"sparsepatch: context parallelism needs diffusers >= 0.36 (found {version()})")
    return cls


def ring_group(cp_config):
    """The process group of the ring dimension of a ContextParallelConfig."""
    return cp_config._ring_mesh.get_group()


def ring_rank(cp_config) -> int:
    """This process's rank within its ring group."""
    return cp_config._ring_local_rank


# --- self-check -------------------------------------------------------------------------------------------------
def check() -> list[str]:
    """What the installed diffusers moved, one line per private piece this module relies on ([] = all in place)."""
    problems = []
    try:
        ad = _ad()
    except ImportError as e:
        return [f"diffusers.models.attention_dispatch: {e}"]
    enum_cls = getattr(ad, "AttentionBackendName", None)
    if enum_cls is None:
        problems.append("attention_dispatch.AttentionBackendName is gone")
    else:
        for attr in ("_value2member_map_", "_member_map_", "_member_names_"):
            if not hasattr(enum_cls, attr):
                problems.append(f"AttentionBackendName.{attr} is gone (enum internals changed)")
        if not issubclass(enum_cls, str):
            problems.append("AttentionBackendName is no longer a str Enum")
    reg = getattr(ad, "_AttentionBackendRegistry", None)
    if reg is None:
        problems.append("attention_dispatch._AttentionBackendRegistry is gone")
    else:
        for table in ("_backends", "_constraints", "_supported_arg_names"):
            if not isinstance(getattr(reg, table, None), dict):
                problems.append(f"_AttentionBackendRegistry.{table} is not a dict any more")
        if not callable(getattr(reg, "register", None)):
            problems.append("_AttentionBackendRegistry.register is gone")
    if not callable(getattr(ad, "dispatch_attention_fn", None)):
        problems.append("attention_dispatch.dispatch_attention_fn is gone")
    else:
        params = inspect.signature(ad.dispatch_attention_fn).parameters
        if "backend" not in params:
            problems.append("dispatch_attention_fn no longer takes backend=")
    try:
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor, WanTransformer3DModel
    except ImportError as e:
        problems.append(f"WanTransformer3DModel / WanAttnProcessor: {e}")
    else:
        for attr in ("cache_context", RESET_METHOD):   # CacheMixin methods the pipelines call
            if not callable(getattr(WanTransformer3DModel, attr, None)):
                problems.append(f"WanTransformer3DModel.{attr} is gone")
        if not calls_dispatch(WanAttnProcessor):
            problems.append(f"WanAttnProcessor has no {PROCESSOR_BACKEND_ATTR} (processors no longer carry a "
                            "per-instance backend)")
        if "encoder_hidden_states" not in inspect.signature(WanAttnProcessor.__call__).parameters:
            problems.append("WanAttnProcessor.__call__ no longer takes encoder_hidden_states")
    if hasattr(ad, "_templated_context_parallel_attention"):
        try:
            from diffusers import ContextParallelConfig
        except ImportError:
            problems.append("_templated_context_parallel_attention exists but ContextParallelConfig is gone")
        else:
            src = inspect.getsource(ContextParallelConfig)
            for attr in ("_ring_mesh", "_ring_local_rank"):
                if attr not in src:
                    problems.append(f"ContextParallelConfig.{attr} is gone")
        if not hasattr(reg, "_supports_context_parallel"):
            problems.append("_AttentionBackendRegistry._supports_context_parallel is gone")
    return problems
