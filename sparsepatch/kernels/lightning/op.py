"""Lightning (linear) attention: the backend lists and the public entries `lightning_decode` / `lightning_prefill`.

Backends (same function): triton (triton.py: CUDA fp16/bf16/fp32, head dims <= 256) and reference.
"""
from __future__ import annotations

import torch

from ..dispatch import Backend, Call, Dispatcher
from . import reference

MAX_HEAD_DIM = 256   # triton.MAX_HEAD_DIM
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _call(op, q, k, v) -> Call:
    arch = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    return Call(op, q.device.type, arch, q.dtype, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2],
                q.shape[-1], v.shape[-1], params=(k.dtype == q.dtype,))


def _triton_supports(call: Call) -> str | None:
    if call.device != "cuda":
        return "needs a CUDA tensor"
    if call.dtype not in _DTYPES or not call.params[0]:
        return f"needs q and k of one dtype in {_DTYPES}"
    if max(call.head_dim, call.head_dim_v) > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM}"
    return None


def _triton(name):
    def run(*args, **kw):
        from . import triton
        return getattr(triton, name)(*args, **kw)
    return run


DECODE = Dispatcher("lightning_decode", [Backend("triton", _triton_supports, _triton("lightning_decode")),
                                         Backend("reference", lambda call: None, reference.lightning_decode)])
PREFILL = Dispatcher("lightning_prefill", [Backend("triton", _triton_supports, _triton("lightning_prefill")),
                                           Backend("reference", lambda call: None, reference.lightning_prefill)])


def lightning_decode(q, k, v, state, decay, *, scale=None, out=None, state_layout: str = "bhkv",
                     backend: str | None = None):
    """One lightning-attention decode step; updates `state` (fp32, or bf16/fp16 storage) in place. See
    `reference.lightning_decode` (q, k (B, 1, H, K), v (B, 1, H, V) -> o (B, 1, H, V))."""
    route = DECODE.route(_call("lightning_decode", q, k, v), backend)
    return DECODE.backends[route.backend].run(q, k, v, state, decay, scale=scale, out=out, state_layout=state_layout)


def lightning_prefill(q, k, v, decay, *, scale=None, initial_state=None, cu_seqlens=None,
                      state_layout: str = "bhkv", state_dtype=None, backend: str | None = None):
    """Chunked lightning-attention prefill -> (o (B, T, H, V), final state; fp32 unless `state_dtype` or a
    bf16/fp16 initial_state says otherwise). See `reference.lightning_prefill`."""
    route = PREFILL.route(_call("lightning_prefill", q, k, v), backend)
    return PREFILL.backends[route.backend].run(q, k, v, decay, scale=scale, initial_state=initial_state,
                                               cu_seqlens=cu_seqlens, state_layout=state_layout,
                                               state_dtype=state_dtype)
