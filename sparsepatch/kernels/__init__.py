"""Attention kernels: tensors in, tensors out. Nothing here knows what a model is.

One package per op (dense/, skip/, nsa/, lightning/), each with its `reference.py` oracle beside its backends and
one dispatcher (`dispatch.py`) that runs, per call, the cheapest backend that supports it: for dense attention that
includes torch SDPA (cuDNN, flash, efficient), so a call never runs slower than SDPA where the cost table has a
measurement. `explain(q, k, v, ...)` says which backend a call gets and why; `tune()` measures the table on this GPU.
Every public entry takes `backend=` to force one backend (a ValueError if it cannot run the call).
"""
from __future__ import annotations

from .dense import attention, attention_fp8, backend_for
from .dense import explain as _explain_dense
from .dispatch import Route, cost_table, set_cost_table
from .lightning import lightning_decode, lightning_prefill
from .nsa import NSACache, NSAParams, nsa_attention
from .skip import (DEFAULT_TILE, SkipList, SkipListBuffers, skip_attention, skip_step, skip_step_differentiable)
from .skip import explain as _explain_skip


def explain(q, k, v, *, op: str = "attention", causal: bool = False, attn_mask=None, return_lse: bool = False,
            skip_list=None, tile=DEFAULT_TILE, must_do=None, precision: str = "native") -> Route:
    """Which backend `attention` (op="attention") or `skip_attention` (op="skip_attention") runs for these inputs,
    and why: a Route with the chosen backend, the reason, and every candidate with its cost or why it cannot run.
    precision ("native" / "fp8"): skip_attention's precision argument."""
    if op == "attention":
        return _explain_dense(q, k, v, causal=causal, attn_mask=attn_mask, return_lse=return_lse)
    if op == "skip_attention":
        return _explain_skip(q, k, v, skip_list, attn_mask=attn_mask, tile=tile, must_do=must_do,
                             return_lse=return_lse, precision=precision)
    raise ValueError(f"op must be 'attention' or 'skip_attention', got {op!r}")


def tune(**kwargs):
    """Measure the dense dispatcher's cost table on this GPU and cache it (see `tuning.tune`)."""
    from .tuning import tune as _tune
    return _tune(**kwargs)


__all__ = ["attention", "attention_fp8", "backend_for", "skip_attention", "skip_step", "skip_step_differentiable", "nsa_attention",
           "lightning_decode", "lightning_prefill", "SkipList", "SkipListBuffers", "DEFAULT_TILE", "NSACache",
           "NSAParams", "explain", "tune", "Route", "cost_table", "set_cost_table"]
