"""MiniMax lightning (linear) attention layers routed through sparsepatch's lightning kernels.

`patch_lightning_layers(model, config, handle)` gives every `MiniMaxLightningAttention` of a MiniMaxForCausalLM an
instance-level forward (the class is untouched) that keeps the layer's own projections, norm and gate and replaces
its PyTorch block loop / per-token decode loop with `lightning_prefill` / `lightning_decode`:

- no linear cache yet (first forward): prefill from a zero state;
- a cached state and one new token: one in-place decode step on the cached state;
- a cached state and several tokens (chunked prefill, assisted decoding): prefill from the cached state.

The recurrent state lives in the model's own `MiniMaxCache.linear_cache[layer_idx]` as (B, H, K, V), the same
(K, V) layout the model uses, stored in `LightningConfig.state_dtype`: fp32 by default (the unpatched model keeps it
in the model dtype; fp32 is at least as accurate), or bf16/fp16 (half the decode bytes; fp32 math, one rounding per
step). A cached state of another dtype (written by the unpatched model) is converted once.
Decay per head is the layer's `slope_rate`, scale 1.0 (MiniMax does not scale q). CUDA tensors run the Triton
kernels; anything else runs the PyTorch reference. A layer in training mode with grad enabled runs the model's own
forward (the Triton ops have no backward). The state tensor the layer returns as its second output is updated in
place by later decode steps.

Unpatch (`handle` undos) deletes the instance attribute (or puts back a prior one, e.g. accelerate's hook), so the
restored model is bit-exact.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_PATCH_FLAG = "_sparsepatch_lightning"


def _lightning_class():
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention
    return MiniMaxLightningAttention


def _kernels(q: torch.Tensor):
    """(decode, prefill): the dispatchers pick Triton on CUDA and the PyTorch reference elsewhere."""
    from .. import kernels
    return kernels.lightning_decode, kernels.lightning_prefill


def _make_forward(module, layer_name: str, handle, original, state_dtype: torch.dtype):
    from transformers.models.minimax.modeling_minimax import apply_mask_to_padding_states

    H, D = module.num_attention_heads, module.head_dim
    decay_cache: dict = {}

    def decay_of(slope: torch.Tensor) -> torch.Tensor:
        key = (slope.device, slope.data_ptr(), slope.dtype, slope._version)
        d = decay_cache.get(key)
        if d is None:
            decay_cache.clear()
            d = slope.detach().reshape(H).to(torch.float32).contiguous()
            decay_cache[key] = d
        return d

    def forward(hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        if module.training and torch.is_grad_enabled():
            return original(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        B, T, _ = hidden_states.shape
        qkv = module.act_fn(module.qkv_proj(hidden_states))
        qkv = apply_mask_to_padding_states(qkv, attention_mask)
        qkv = qkv.reshape(B, T, H, 3 * D)
        q, k, v = torch.split(qkv, D, dim=3)                         # (B, T, H, D) strided views, no copies
        decay = decay_of(module.slope_rate)
        decode, prefill = _kernels(q)

        state = past_key_values.get_linear_cache(module.layer_idx) if past_key_values is not None else None
        if state is None or (isinstance(state, list) and not state):
            out, state = prefill(q, k, v, decay, scale=1.0, state_dtype=state_dtype)
            branch = "prefill"
        else:
            if state.dtype != state_dtype:                            # written by the unpatched model
                state = state.to(state_dtype)
            if T == 1:
                out = decode(q, k, v, state, decay, scale=1.0)       # state updated in place
                branch = "decode"
            else:
                out, state = prefill(q, k, v, decay, scale=1.0, initial_state=state)
                branch = "prefill"

        out = out.reshape(B, T, H * D)
        out = module.norm(out)
        out = F.sigmoid(module.output_gate(hidden_states)) * out
        out = module.out_proj(out)
        if past_key_values is not None:
            past_key_values.set_linear_cache(module.layer_idx, state)
        handle.record_call(layer_name, branch, 1.0)
        return out, state

    return forward


def patch_lightning_layers(model, config, handle) -> None:
    """Route `model`'s MiniMax lightning layers through sparsepatch's lightning kernels; undo registered on handle.

    model: a transformers MiniMax model (any module tree holding `MiniMaxLightningAttention` layers).
    config: sp.LightningConfig (state_dtype "float32", "bfloat16" or "float16") or None (fp32 state).
    handle: `add_undo(fn)` (zero-arg, run on unpatch), `record_call(layer_name, branch, density)`;
    branch is "prefill" or "decode", density 1.0.
    """
    name = getattr(config, "state_dtype", "float32") if config is not None else "float32"
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"config.state_dtype must be one of {sorted(dtypes)}, got {name!r}")
    state_dtype = dtypes[name]
    cls = _lightning_class()
    layers = [(lname, m) for lname, m in model.named_modules() if isinstance(m, cls)]
    if not layers:
        raise ValueError(f"model: {type(model).__name__} has no MiniMaxLightningAttention layers to patch")
    if any(getattr(m, _PATCH_FLAG, False) for _, m in layers):
        raise ValueError(f"model: the lightning layers of this {type(model).__name__} are already patched; "
                         "unpatch first")
    for lname, m in layers:
        # accelerate's hooks keep the real forward in `_old_forward` and call it from an instance `forward`:
        # replace the inner one so the hook (device moves, offload) keeps running.
        attr = "_old_forward" if hasattr(m, "_hf_hook") and "_old_forward" in m.__dict__ else "forward"
        had = attr in m.__dict__
        prev = m.__dict__.get(attr)
        original = prev if had else type(m).forward.__get__(m)
        m.__dict__[attr] = _make_forward(m, lname or type(m).__name__, handle, original, state_dtype)
        m.__dict__[_PATCH_FLAG] = True

        def undo(m=m, attr=attr, had=had, prev=prev):
            if had:
                m.__dict__[attr] = prev
            else:
                m.__dict__.pop(attr, None)
            m.__dict__.pop(_PATCH_FLAG, None)

        handle.add_undo(undo)


__all__ = ["patch_lightning_layers"]
