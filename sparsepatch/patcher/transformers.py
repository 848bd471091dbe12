"""transformers adapter: route a PreTrainedModel's attention through `sparsepatch.kernels`.

How it hooks in (transformers 5.6-5.24, README "Tested versions"; private names only through
transformers_compat.py): one attention function is registered under `ATTN_NAME` in `AttentionInterface` (and
`sdpa_mask` under the same name in `AttentionMaskInterface`, so the model still builds boolean padding / causal /
sliding-window masks for it), then `model.set_attn_implementation(ATTN_NAME)` switches the model in place. No
model code is copied or wrapped: every architecture whose attention layers call
`ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)` is served.

Unpatch (the undo registered on the handle) restores `_attn_implementation` on the model config and on every
sub-config / sub-model config exactly as it was, and unregisters `ATTN_NAME` once no patched model uses it.

Decisions:
- Masks: the model's own `sdpa_mask` builds them (bool, True = attend), so padding, left padding in batched
  generate, sliding-window layers and StaticCache's padded keys all arrive as a mask the kernel applies. A mask
  of None means no padding: causality then comes from `module.is_causal` (decode, L == 1, sees every key).
- Attention dropout (training with attention_dropout > 0) raises NotImplementedError rather than falling back to
  SDPA: a silent fallback would train with a different kernel than the one the user asked for.
- DenseConfig.layers is not consulted: every call routed through AttentionInterface is served (decoder-only LLMs
  have self-attention only). LightningConfig re-routes MiniMax's lightning layers (transformers_lightning.py);
  NSAConfig routes through transformers_nsa.py (its own registered attention function).
- On CUDA, calls with a mask (padding, sliding-window layers, StaticCache decode) currently take the reference
  path, because the Triton dense kernel takes no mask.
- `output_attentions=True`: the output still comes from the kernel (same logits as without the flag); the weights
  are computed beside it with transformers' eager math (scores * scaling + additive mask, fp32 softmax, cast to the
  query dtype), so they equal an eager model's.
- Ownership: module-level maps hold attention modules by weak key and values that never refer to the model, so a
  patched model that is deleted is freed (the shared registration is released with its handle).
"""
from __future__ import annotations

import logging

import torch

from ..config import DenseConfig, LightningConfig, NSAConfig, SkipConfig
from . import transformers_compat as compat
from .state import dense_kernel, dense_route
from .transformers_shared import (_PATCHED, SharedRegistration, _add_release, _all_configs, _check_model,  # noqa: F401
                                  is_transformers_model, wants_attentions)

logger = logging.getLogger(__name__)

__all__ = ["ATTN_NAME", "is_transformers_model", "patch_model", "recipe_keys", "attention_forward"]

#: Name under which the attention function (and its mask function) is registered in transformers.
ATTN_NAME = "sparsepatch"

# model_types whose attention call site was checked against this adapter (same call site as Llama: q/k/v
# (B, H, L, D), mask from create_causal_mask / create_sliding_window_causal_mask, scaling=module.scaling).
TESTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

def recipe_keys(model) -> list[str]:
    """Names a recipe may be keyed by: the model class name, then its config's model_type."""
    _check_model(model)
    return [type(model).__name__, str(getattr(model.config, "model_type", None))]


def patch_model(model, config, handle) -> None:
    """Switch `model` (a PreTrainedModel) to sparsepatch attention in place; register its undo on `handle`.

    config: DenseConfig, NSAConfig (transformers_nsa.py), or LightningConfig for MiniMax.
    handle: the PatchHandle: `add_undo(fn)`, `record_call(layer_name, branch, density)`.
    """
    _check_model(model)
    compat.warn_if_untested()
    if isinstance(config, LightningConfig):
        # MiniMax's lightning layers do not go through AttentionInterface: they are re-routed module by module.
        # Its softmax layers keep their implementation (patch them with DenseConfig on a separate model if wanted).
        from .transformers_lightning import patch_lightning_layers
        patch_lightning_layers(model, config, handle)
        return
    if isinstance(config, NSAConfig):
        from .transformers_nsa import patch_nsa
        patch_nsa(model, config, handle)
        return
    if isinstance(config, SkipConfig):
        raise ValueError("config: SkipConfig keeps skip lists across diffusion denoising steps and has no meaning "
                         f"for {type(model).__name__}; use sp.DenseConfig() (or sp.NSAConfig once issue 5 lands)")
    if not isinstance(config, DenseConfig):
        raise ValueError(f"config must be a sparsepatch DenseConfig / NSAConfig / LightningConfig, "
                         f"got {type(config).__name__}")
    model_type = getattr(model.config, "model_type", None)
    if model_type not in TESTED_MODEL_TYPES:
        logger.warning("sparsepatch: %s (model_type=%r) is not in the tested table %s; patching it through "
                       "AttentionInterface anyway", type(model).__name__, model_type, TESTED_MODEL_TYPES)
    if not compat.can_set_attn_implementation(type(model)):
        raise ValueError(f"model: {type(model).__name__} does not route attention through transformers' "
                         "AttentionInterface, so it cannot be patched in place")
    modules = list(model.named_modules())
    if any(m in _PATCHED for _, m in modules):
        raise ValueError(f"model: this {type(model).__name__} is already patched by sparsepatch; unpatch it first")

    # Snapshot every config's implementation before anything changes: set_attn_implementation recurses into
    # sub-models / sub-configs, and unpatch must put each one back as it was (not just the top-level one).
    saved = [(cfg, compat.get_impl(cfg)) for cfg in _all_configs(model)]

    def restore_configs():
        for cfg, impl in saved:
            compat.set_impl(cfg, impl)

    def forget_modules():
        for _, m in modules:
            _PATCHED.pop(m, None)

    _REGISTRATION.acquire()
    try:
        model.set_attn_implementation(ATTN_NAME)
        if model.config._attn_implementation != ATTN_NAME:  # transformers only warned and left it unchanged
            raise ValueError(f"model: {type(model).__name__} refused attn_implementation={ATTN_NAME!r}")
    except BaseException:
        restore_configs()
        _REGISTRATION.release()
        raise
    # Layer identity: the function receives the attention module itself; map it to its qualified name. All
    # modules are mapped (cheap) so that any layer that calls the interface is found, whatever its class.
    for name, m in modules:
        _PATCHED[m] = (handle, name or type(m).__name__, config)
    # Undos run in reverse: configs first (so no later forward reaches us), then the map; the registry last.
    _add_release(handle, _REGISTRATION.release)
    handle.add_undo(forget_modules)
    handle.add_undo(restore_configs)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """The function transformers calls in place of sdpa.

    query (B, Hq, L, D), key/value (B, Hk, S, D) — S includes the cache (StaticCache: padded to its max length);
    attention_mask: None, bool (B|1, 1|H, L, S') with True = attend, or additive float; S' >= S is cut to S.
    Returns ((B, L, Hq, D) output, None).
    """
    entry = _PATCHED.get(module)
    if dropout and dropout > 0.0:
        # The kernels have no dropout. Falling back to SDPA would silently change which kernel trains the model
        # (and what the stats say), so refuse instead: most LLM configs train with attention_dropout=0.0.
        name = entry[1] if entry else type(module).__name__
        raise NotImplementedError(
            f"sparsepatch attention does not implement attention dropout (layer {name}, p={dropout}): set "
            f"model.config.attention_dropout=0.0 (and the layers' attention_dropout) or call model.eval()")
    for arg in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(arg) is not None:
            raise NotImplementedError(f"sparsepatch attention does not support `{arg}` (layer "
                                      f"{entry[1] if entry else type(module).__name__})")

    L, S = query.shape[2], key.shape[2]
    # Views into the kernel layout (B, S, H, D): no copies. GQA is left to the kernel (Hq % Hk == 0).
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    causal = False
    mask = attention_mask
    if mask is not None:
        if mask.shape[-1] > S:  # masks sized for a longer cache than this layer returned
            mask = mask[..., :S]
    else:
        # No mask means no padding (and, on sliding layers, S < window): causality comes from the module.
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        if causal and L == 1:
            causal = False  # decode: the single new query sees every cached key
        elif causal and S > L:
            # sdpa_mask only skips the mask with S > L when the cache was empty (StaticCache prefill): the keys
            # past L are unwritten padding and SDPA's top-left `is_causal` never reaches them. Drop them, which
            # also makes top-left and the kernel's bottom-right alignment agree.
            k, v = k[:, :L], v[:, :L]
    out = dense_kernel(entry[2] if entry else None)(q, k, v, causal=causal, scale=scaling, attn_mask=mask)
    if entry is not None:
        handle, name, _ = entry
        handle.record_call(name, "default", 1.0)
        handle.count_backend(name, dense_route(entry[2], q, k, v, causal=causal, attn_mask=mask))
    else:
        # E.g. a deep copy of a patched model: still correct, just not counted.
        logger.debug("sparsepatch: call from an unmapped module %s", type(module).__name__)
    weights = None
    if wants_attentions(module, kwargs):
        weights = eager_attention_weights(query, key[:, :, :k.shape[1]], mask, scaling, causal)
    return out, weights


def eager_attention_weights(query, key, mask, scaling, causal: bool):
    """The attention probabilities transformers' eager attention returns, by the same math.

    query (B, Hq, L, D), key (B, Hk, S, D) (GQA keys repeated per group, like `repeat_kv`); mask None, bool
    (True = attend; masked scores get the dtype's min added, as `eager_mask` builds them) or additive float,
    broadcastable to (B, Hq, L, S); causal (only with mask None): bottom-right causal over the S keys.
    Returns (B, Hq, L, S) in query.dtype (softmax in fp32).
    """
    B, Hq, L, D = query.shape
    Hk, S = key.shape[1], key.shape[2]
    if Hq != Hk:
        key = key[:, :, None].expand(B, Hk, Hq // Hk, S, D).reshape(B, Hq, S, D)
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling if scaling is not None else D ** -0.5)
    if mask is None and causal:
        mask = torch.ones(L, S, dtype=torch.bool, device=query.device).tril(S - L)
    if mask is not None:
        if mask.dtype == torch.bool:
            zero = torch.zeros((), dtype=query.dtype, device=query.device)
            mask = torch.where(mask, zero, torch.finfo(query.dtype).min)
        scores = scores + mask
    return torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)


# How many patched models use the global registration, and what (if anything) the name held before it.
_REGISTRATION = SharedRegistration(ATTN_NAME, attention_forward)
