"""transformers adapter for Native Sparse Attention (NSAConfig) on Llama/Qwen-family decoder LLMs.

`patch_nsa(model, config, handle)` registers `nsa_attention_forward` under `ATTN_NAME` ("sparsepatch_nsa") in
AttentionInterface and transformers' `sdpa_mask` under the same name in AttentionMaskInterface, then switches the
model in place with `set_attn_implementation`. Every attention call then runs NSA over the model's own k/v:

- prefill (q length == k length): causal NSA over the prompt; the layer's `NSACache(store_kv=False)` is rebuilt;
- decode / chunked prefill (q shorter than k, the model's cache already holds the new keys): the compressed keys
  of blocks completed since the last call are added to that layer's NSACache, the rest of NSA runs on the full
  cached k/v (queries are the last L positions).

Masks: NSA applies causality itself. A mask that is exactly causal (bottom-right) is accepted; StaticCache's
padded tail keys (columns no query may see) are dropped; any other mask (left/right padding in a batch) raises
NotImplementedError: NSA's block selection has no notion of padding, and silently ignoring it would be wrong.

Gates: gates="uniform" uses 1/3 per branch. gates="learned" adds a trainable `NSAGate` submodule `nsa_gate` to each
attention module: per query head h, gates = sigmoid(q_h @ W_h + b_h) with W (Hq, head_dim, 3) zero-initialised and
b = log(1/2), so every gate starts at exactly 1/3 (uniform NSA); q is the rotated query the layer attends with.
Unpatch removes the submodule (and everything else) so the model is bit-exact with an unpatched twin.

Kernels: CUDA fp16/bf16 inference runs the Triton forward (kernels/nsa.py); anything else (CPU, training with
grad) runs the differentiable PyTorch reference (kernels/nsa/reference.py).
Each call is recorded as handle.record_call(layer, "prefill" | "decode", density), density = keys scored
(compressed + selected + window) / keys of dense causal attention (`kernels.nsa.nsa_density`).
"""
from __future__ import annotations

import logging
import math
import weakref

import torch

from ..config import NSAConfig
from . import transformers_compat as compat
from .transformers_shared import SharedRegistration, _add_release, wants_attentions
from .. import kernels
from ..kernels import nsa as nsa_kernels

logger = logging.getLogger(__name__)

__all__ = ["ATTN_NAME", "patch_nsa", "nsa_attention_forward", "NSAGate"]

ATTN_NAME = "sparsepatch_nsa"
GATE_ATTR = "nsa_gate"

# attention module -> (handle, name, config, NSACache)
_PATCHED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


class NSAGate(torch.nn.Module):
    """Per-head gate projection q (B, L, Hq, D) -> sigmoid gates (B, L, Hq, 3) for (cmp, slc, swa).

    weight (Hq, D, 3) starts at 0 and bias (Hq, 3) at log(1/2): sigmoid(log(1/2)) = 1/3 exactly.
    """

    def __init__(self, num_heads: int, head_dim: int, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(num_heads, head_dim, 3, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.full((num_heads, 3), math.log(0.5), device=device, dtype=dtype))

    def forward(self, q):
        w = self.weight.to(q.dtype)
        return torch.sigmoid(torch.einsum("blhd,hdc->blhc", q, w).float() + self.bias.float())


def _attention_modules(model):
    """(name, module) of every module with q_proj/k_proj/v_proj and a head_dim (Llama/Mistral/Qwen attention)."""
    out = []
    for name, m in model.named_modules():
        if all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "head_dim")) and hasattr(m, "layer_idx"):
            out.append((name, m))
    return out


def patch_nsa(model, config: NSAConfig, handle) -> None:
    """Route `model`'s attention through NSA (prefill and generate); undos registered on `handle`."""
    from .transformers_shared import _PATCHED as _DENSE_PATCHED
    from .transformers_shared import _all_configs, _check_model

    _check_model(model)
    nsa_kernels.check_config(config)
    layers = _attention_modules(model)
    if not layers:
        raise ValueError(f"model: {type(model).__name__} has no Llama-style attention modules (q_proj/k_proj/"
                         "v_proj/head_dim/layer_idx) to route through NSA")
    if any(m in _PATCHED or m in _DENSE_PATCHED for _, m in layers):
        raise ValueError(f"model: this {type(model).__name__} is already patched by sparsepatch; unpatch it first")
    if not compat.can_set_attn_implementation(type(model)):
        raise ValueError(f"model: {type(model).__name__} does not route attention through AttentionInterface")

    saved = [(cfg, compat.get_impl(cfg)) for cfg in _all_configs(model)]

    def restore_configs():
        for cfg, impl in saved:
            compat.set_impl(cfg, impl)

    _REGISTRATION.acquire()
    try:
        model.set_attn_implementation(ATTN_NAME)
        if model.config._attn_implementation != ATTN_NAME:
            raise ValueError(f"model: {type(model).__name__} refused attn_implementation={ATTN_NAME!r}")
    except BaseException:
        restore_configs()
        _REGISTRATION.release()
        raise

    added = []
    for name, m in layers:
        if config.gates == "learned":
            if GATE_ATTR in m._modules or hasattr(m, GATE_ATTR):
                raise ValueError(f"model: {name} already has an attribute {GATE_ATTR!r}")
            heads = m.config.num_attention_heads
            p = m.q_proj.weight
            m.add_module(GATE_ATTR, NSAGate(heads, m.head_dim, device=p.device, dtype=p.dtype))
            added.append(m)
        _PATCHED[m] = (handle, name or type(m).__name__, config, nsa_kernels.NSACache(store_kv=False))

    def remove_gates():
        for m in added:
            m._modules.pop(GATE_ATTR, None)

    def forget():
        for _, m in layers:
            _PATCHED.pop(m, None)

    _add_release(handle, _REGISTRATION.release)
    handle.add_undo(forget)
    handle.add_undo(remove_gates)
    handle.add_undo(restore_configs)


def _causal_only(mask, L, S):
    """(mask is exactly bottom-right causal over its first S' <= S keys, S'): StaticCache pads keys at the end."""
    if mask.dtype != torch.bool:
        mask = mask == 0
    mask = mask[..., :S]
    cols = mask.reshape(-1, mask.shape[-1]).any(0)
    nz = cols.nonzero()
    Sv = int(nz.max()) + 1 if nz.numel() else 0
    if Sv < L:
        return False, Sv
    qpos = torch.arange(L, device=mask.device)[:, None] + (Sv - L)
    want = torch.arange(Sv, device=mask.device)[None, :] <= qpos
    return bool((mask[..., :Sv] == want).all()), Sv


def nsa_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                          is_causal=None, **kwargs):
    """The AttentionInterface function: query (B, Hq, L, D), key/value (B, Hk, S, D) -> ((B, L, Hq, D), None)."""
    entry = _PATCHED.get(module)
    if entry is None:
        raise RuntimeError(f"sparsepatch NSA: {type(module).__name__} is not a patched attention module")
    handle, name, config, cache = entry
    if dropout and dropout > 0.0:
        raise NotImplementedError(f"sparsepatch NSA has no attention dropout (layer {name}, p={dropout}): call "
                                  "model.eval() or set attention_dropout=0.0")
    for arg in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(arg) is not None:
            raise NotImplementedError(f"sparsepatch NSA does not support `{arg}` (layer {name})")
    if wants_attentions(module, kwargs):
        # NSA attends through three gated branches (compressed, selected, window): there is no single attention
        # matrix that an eager model's `attentions` would match.
        raise NotImplementedError(f"sparsepatch NSA has no attention weights to return (layer {name}): call "
                                  "without output_attentions, or unpatch (or patch with sp.DenseConfig) to get them")
    L, S = query.shape[2], key.shape[2]
    if attention_mask is not None:
        ok, Sv = _causal_only(attention_mask, L, S)
        if not ok:
            raise NotImplementedError(
                f"sparsepatch NSA got a non-causal attention mask in layer {name} (padding in the batch?): NSA "
                "block selection has no padding support; run one sequence per batch or unpadded batches")
        S = Sv
    elif S > L and L > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        S = L   # StaticCache prefill with an empty cache: the keys past L are unwritten padding
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)[:, :S]
    v = value.transpose(1, 2)[:, :S]
    gate = module._modules.get(GATE_ATTR)
    gates = gate(q) if gate is not None else None
    # Triton forward + backward on CUDA where supported, the reference elsewhere (the dispatcher decides).
    out = kernels.nsa_attention(q, k, v, config, gates=gates, cache=cache, scale=scaling)
    handle.record_call(name, "prefill" if L == S else "decode", nsa_kernels.nsa_density(config, L, S))
    return out, None


_REGISTRATION = SharedRegistration(ATTN_NAME, nsa_attention_forward)
