"""Native Sparse Attention: the backend list and the public entry `nsa_attention`.

Backends (same selected blocks, same output): triton (forward.py, backward.py, decode.py; causal, head dims
16..256 powers of two, CUDA fp16/bf16) and reference. NSA is never replaced by dense attention.
"""
from __future__ import annotations

import torch

from ..dispatch import Backend, Call, Dispatcher
from . import reference

CMP_BLOCK_N = 64   # compressed keys per selection block the Triton kernel scores at once (forward.CMP_BLOCK_N)


def _triton_supports(call: Call) -> str | None:
    block_size, compress_block, compress_stride = call.params
    if not call.causal:
        return "runs causal attention only"
    if call.device != "cuda":
        return "needs a CUDA tensor"
    if call.dtype not in (torch.float16, torch.bfloat16):
        return f"needs float16/bfloat16, got {call.dtype}"
    D = call.head_dim
    if D < 16 or D > 256 or D & (D - 1):
        return f"head dim {D} (runs powers of two in 16..256)"
    R = block_size // compress_stride
    if block_size % compress_stride or compress_block > block_size or R > CMP_BLOCK_N or R & (R - 1):
        return "block sizes (block_size / compress_stride must be a power of two <= 64, compress_block <= block_size)"
    return None


def _triton_run(*args, **kw):
    from . import forward
    return forward.nsa_attention(*args, **kw)


BACKENDS = [Backend("triton", _triton_supports, _triton_run),
            Backend("reference", lambda call: None, reference.nsa_attention)]
DISPATCH = Dispatcher("nsa_attention", BACKENDS)


def nsa_attention(q, k, v, config, gates=None, cu_seqlens=None, causal: bool = True, cache=None,
                  compress_weights=None, *, scale=None, return_indices: bool = False, backend: str | None = None):
    """Native Sparse Attention (compressed + selected + sliding window, gated); see `reference.nsa_attention`.

    q (B, T, Hq, D), k/v (B, T, Hk, D) -> (B, T, Hq, D). config: sparsepatch.NSAConfig or NSAParams.
    """
    params = reference.check_config(config)
    call = Call.of("nsa_attention", q, k, v, causal=causal, params=(params.block_size, params.compress_block,
                                                                      params.compress_stride))
    route = DISPATCH.route(call, backend)
    return DISPATCH.backends[route.backend].run(q, k, v, config, gates=gates, cu_seqlens=cu_seqlens, causal=causal,
                                                cache=cache, compress_weights=compress_weights, scale=scale,
                                                return_indices=return_indices)
