"""Lightning (linear) attention in plain PyTorch: the oracle for kernels/lightning.py and the CPU path.

Recurrence per batch element b and head h, with a per-head decay rate decay[h] >= 0 (MiniMax's `slope_rate`):

    state_t = exp(-decay[h]) * state_{t-1} + k_t^T v_t          state (K, V), k_t (1, K), v_t (1, V)
    o_t     = (scale * q_t) @ state_t                            o_t (1, V)

The output reads the state AFTER the update (token t attends to itself), exactly as
`MiniMaxLightningAttention` does in transformers' decode branch (`ratio * kv + k^T v`, then `q @ kv`) and,
equivalently, in its block loop (diagonal decay exp(-s * (i - j)) for j <= i, inter-block term decayed by
exp(-s * (i + 1))). MiniMax uses scale = 1.0; scale=None means 1 / sqrt(K) (the fla convention).

Layouts: q, k (B, T, H, K); v (B, T, H, V); o (B, T, H, V) in q's dtype; decay (H,) fp32; state fp32 (B, H, K, V),
or (B, H, V, K) with state_layout="bhvk" (V-first, the transposed matrix). Math is fp32 (fp64 inputs stay fp64).

Reduced-precision state storage: a bf16 (or fp16) state is accepted wherever an fp32 one is. The math stays fp32
(the stored state is widened, updated, used for o, and rounded to nearest-even once when stored), so a decode step
moves half the bytes. Each step adds one rounding of relative size <= 2^-9 (bf16) to every state element; the
decay damps old errors, so the drift stays bounded (measured numbers: BENCHMARKS.md, lightning section). fp16 has
the finer mantissa but overflows past 65504 (a slowly decaying head accumulating large k^T v can get there); bf16
is the recommended reduced format. The prefill's final state takes `state_dtype` (default: initial_state's dtype,
else fp32).
"""
from __future__ import annotations

import math
import weakref

import torch

STATE_LAYOUTS = ("bhkv", "bhvk")
CHUNK = 64  # prefill chunk length (tokens) of the reference and of the Triton kernel
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # storage dtypes of the state (math is fp32)

# id(decay) -> (weakref to it, its version when checked): decay tensors already checked for >= 0, so the hot
# decode path syncs once per tensor. Keyed by the live object (not its data pointer, which the caching allocator
# reuses for new tensors) and invalidated by in-place writes (the version counter).
_checked_decay: dict = {}


def _check_decay_values(decay: torch.Tensor) -> None:
    """decay >= 0 and finite. Syncs a CUDA tensor once per (tensor, version); skipped under graph capture/compile."""
    if torch.compiler.is_compiling():
        return
    seen = _checked_decay.get(id(decay))
    if (seen is not None and seen[0]() is decay and seen[1] == decay._version) or decay.numel() == 0:
        return
    if decay.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    bad = ~torch.isfinite(decay) | (decay < 0)
    if bool(bad.any()):
        raise ValueError(f"decay must be finite and >= 0 (per-head decay rate; the state is scaled by exp(-decay) "
                         f"per token), got min {decay.min().item()}")
    if len(_checked_decay) > 256:
        _checked_decay.clear()
    _checked_decay[id(decay)] = (weakref.ref(decay), decay._version)


def check_state_layout(state_layout: str) -> bool:
    """True for the V-first (B, H, V, K) layout."""
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    return state_layout == "bhvk"


def _check_state(name: str, state: torch.Tensor, want: tuple, vk: bool, q: torch.Tensor) -> None:
    if not isinstance(state, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(state).__name__}")
    allowed = (torch.float32, torch.float64) if q.dtype == torch.float64 else STATE_DTYPES
    if state.dtype not in allowed:
        raise ValueError(f"{name} must be float32, bfloat16 or float16 (fp64 only with fp64 q), got {state.dtype}")
    shape = want[:2] + (want[3], want[2]) if vk else want
    if tuple(state.shape) != shape:
        lay = "(B, H, V, K)" if vk else "(B, H, K, V)"
        raise ValueError(f"{name} must have shape {lay} = {shape}, got {tuple(state.shape)}")
    if state.device != q.device:
        raise ValueError(f"{name} is on {state.device} but q is on {q.device}")


def check_inputs(q, k, v, decay, *, decode: bool) -> tuple[int, int, int, int, int]:
    """Validate q, k (B, T, H, K), v (B, T, H, V), decay (H,); returns (B, T, H, K, V)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, T, H, D), got shape {tuple(t.shape)}")
    B, T, H, K = q.shape
    if tuple(k.shape) != (B, T, H, K):
        raise ValueError(f"k must have q's shape (B, T, H, K) = {(B, T, H, K)}, got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must have shape (B, T, H, V) with (B, T, H) = {(B, T, H)}, got {tuple(v.shape)}")
    V = v.shape[3]
    if decode and T != 1:
        raise ValueError(f"q, k, v must hold one token for decode (B, 1, H, D), got T = {T}")
    if K == 0 or V == 0 or H == 0:
        raise ValueError(f"head dims and heads must be > 0, got H={H}, K={K}, V={V}")
    if not q.dtype.is_floating_point or q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not isinstance(decay, torch.Tensor):
        raise ValueError(f"decay must be a torch.Tensor of shape (H,) = ({H},), got {type(decay).__name__}")
    if tuple(decay.shape) != (H,):
        raise ValueError(f"decay must have shape (H,) = ({H},), got {tuple(decay.shape)}")
    if decay.dtype not in (torch.float32, torch.float64) or (decay.dtype == torch.float64 and q.dtype != torch.float64):
        raise ValueError(f"decay must be float32 (fp64 only with fp64 q), got {decay.dtype}")
    if decay.device != q.device:
        raise ValueError(f"decay is on {decay.device} but q is on {q.device}")
    _check_decay_values(decay)
    return B, T, H, K, V


def resolve_scale(scale, K: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(K)
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale}")
    return scale


def check_decode_args(q, k, v, state, decay, scale, out, state_layout):
    """Validate decode arguments; returns (B, H, K, V, scale, vk). A lean fast path for the common valid call."""
    try:
        B, T, H, K = q.shape
        V = v.shape[3]
        dt = q.dtype
        vk = state_layout == "bhvk"
        ok = (T == 1 and k.shape == q.shape and v.shape[:3] == q.shape[:3] and k.dtype == dt and v.dtype == dt
              and decay.dtype == torch.float32 and decay.shape == (H,) and state.dtype in STATE_DTYPES
              and state.shape == ((B, H, V, K) if vk else (B, H, K, V)) and (vk or state_layout == "bhkv")
              and (out is None or (out.shape == (B, 1, H, V) and out.dtype == dt))
              and q.is_cuda == k.is_cuda == v.is_cuda == state.is_cuda == decay.is_cuda and K > 0 and V > 0 and H > 0)
    except (AttributeError, TypeError, ValueError, IndexError):
        ok = False
    if ok and (not q.is_cuda or q.get_device() == state.get_device() == decay.get_device()):
        _check_decay_values(decay)
        if scale is None:
            scale = 1.0 / math.sqrt(K)
        return B, H, K, V, float(scale), vk
    return _check_decode_args_slow(q, k, v, state, decay, scale, out, state_layout)


def _check_decode_args_slow(q, k, v, state, decay, scale, out, state_layout):
    B, _, H, K, V = check_inputs(q, k, v, decay, decode=True)
    vk = check_state_layout(state_layout)
    _check_state("state", state, (B, H, K, V), vk, q)
    if out is not None:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (B, 1, H, V) or out.dtype != q.dtype \
                or out.device != q.device:
            raise ValueError(f"out must be a {q.dtype} tensor of shape (B, 1, H, V) = {(B, 1, H, V)} on {q.device}, "
                             f"got {getattr(out, 'dtype', type(out))} {tuple(getattr(out, 'shape', ()))}")
    return B, H, K, V, resolve_scale(scale, K), vk


def resolve_state_dtype(state_dtype, initial_state, q) -> torch.dtype:
    """dtype of the prefill's final state: `state_dtype`, else initial_state's dtype, else fp32 (fp64 for fp64 q)."""
    if state_dtype is None:
        if initial_state is not None:
            return initial_state.dtype
        return torch.float64 if q.dtype == torch.float64 else torch.float32
    allowed = STATE_DTYPES + ((torch.float64,) if q.dtype == torch.float64 else ())
    if state_dtype not in allowed:
        raise ValueError(f"state_dtype must be one of {allowed} (storage of the final state), got {state_dtype!r}")
    return state_dtype


def check_prefill_args(q, k, v, decay, scale, initial_state, cu_seqlens, state_layout):
    """Validate prefill arguments; returns (N, T, H, K, V, scale, vk), N = number of sequences."""
    B, T, H, K, V = check_inputs(q, k, v, decay, decode=False)
    vk = check_state_layout(state_layout)
    N = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
                or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor of N + 1 cumulative sequence offsets "
                             f"(starting at 0, ending at T), got {getattr(cu_seqlens, 'shape', cu_seqlens)}")
        if B != 1:
            raise ValueError(f"with cu_seqlens, q/k/v must be packed with batch 1 (1, T_total, H, D), got B = {B}")
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
        N = cu_seqlens.numel() - 1
        if not torch.compiler.is_compiling() and not (cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()):
            c = cu_seqlens.cpu()
            if int(c[0]) != 0 or int(c[-1]) != T or bool((c[1:] < c[:-1]).any()):
                raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T = {T}, got {c.tolist()}")
    if initial_state is not None:
        _check_state("initial_state", initial_state, (N, H, K, V), vk, q)
    return N, T, H, K, V, resolve_scale(scale, K), vk


def lightning_decode(q, k, v, state, decay, *, scale=None, out=None, state_layout: str = "bhkv"):
    """One decode step. q, k (B, 1, H, K), v (B, 1, H, V), decay (H,), state (B, H, K, V) UPDATED IN PLACE.

    state <- exp(-decay) * state + k^T v; o = (scale * q) @ state (new state). Returns o (B, 1, H, V), written into
    `out` when given. state_layout="bhvk": state is (B, H, V, K) (the same matrix transposed). A bf16/fp16 state is
    widened to fp32, updated, used for o in fp32, and stored rounded (o sees the unrounded new state, as the
    Triton kernel does).
    """
    B, H, K, V, scale, vk = check_decode_args(q, k, v, state, decay, scale, out, state_layout)
    S = state.transpose(-1, -2) if vk else state                      # (B, H, K, V) view
    narrow = S.dtype in (torch.bfloat16, torch.float16)
    Sc = S.float() if narrow else S
    g = torch.exp(-decay.to(Sc.dtype))[None, :, None, None]
    kt = k[:, 0].to(Sc.dtype)
    vt = v[:, 0].to(Sc.dtype)
    Sc.mul_(g).add_(kt[..., :, None] * vt[..., None, :])
    o = torch.einsum("bhk,bhkv->bhv", q[:, 0].to(Sc.dtype) * scale, Sc)[:, None]
    if narrow:
        S.copy_(Sc)
    if out is None:
        return o.to(q.dtype)
    out.copy_(o)
    return out


def _prefill_one(q, k, v, decay, scale, S, chunk):
    """q, k (H, T, K), v (H, T, V) compute dtype; S (H, K, V) start state. Returns (o (H, T, V), final S)."""
    H, T, _ = q.shape
    s = decay.to(q.dtype)[:, None]                                    # (H, 1)
    idx = torch.arange(chunk, device=q.device, dtype=q.dtype)
    qdec_full = torch.exp(-s * (idx + 1))                             # (H, C): decay of the start state at row i
    diff = idx[:, None] - idx[None, :]
    dmat_full = torch.where(diff >= 0, torch.exp(-s[:, :, None] * diff.clamp(min=0)), torch.zeros((), dtype=q.dtype,
                                                                                                  device=q.device))
    outs = []
    for t0 in range(0, T, chunk):
        L = min(chunk, T - t0)
        qc, kc, vc = q[:, t0:t0 + L] * scale, k[:, t0:t0 + L], v[:, t0:t0 + L]
        intra = torch.matmul(torch.matmul(qc, kc.transpose(-1, -2)) * dmat_full[:, :L, :L], vc)
        inter = torch.matmul(qc * qdec_full[:, :L, None], S)
        outs.append(intra + inter)
        kdec = torch.exp(-s * (L - 1 - idx[:L]))                      # (H, L)
        S = S * torch.exp(-s * L)[:, :, None] + torch.matmul((kc * kdec[:, :, None]).transpose(-1, -2), vc)
    o = torch.cat(outs, dim=1) if outs else q.new_zeros(H, 0, v.shape[-1])
    return o, S


def lightning_prefill(q, k, v, decay, *, scale=None, initial_state=None, cu_seqlens=None,
                      state_layout: str = "bhkv", state_dtype=None, chunk_size: int = CHUNK):
    """Chunked prefill. q, k (B, T, H, K), v (B, T, H, V), decay (H,) -> (o (B, T, H, V), final_state).

    initial_state: fp32/bf16/fp16 (N, H, K, V) (or (N, H, V, K) with state_layout="bhvk"), None = zeros.
    cu_seqlens: int (N + 1,) offsets of N packed sequences in q of batch 1 (varlen); otherwise N = B. final_state
    has initial_state's layout and dtype `state_dtype` (None: initial_state's dtype, else fp32; fp64 for fp64
    inputs); the math is fp32. Same function as T decode steps from initial_state.
    """
    N, T, H, K, V, scale, vk = check_prefill_args(q, k, v, decay, scale, initial_state, cu_seqlens, state_layout)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    sdtype = resolve_state_dtype(state_dtype, initial_state, q)
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(N)]
    else:
        c = cu_seqlens.tolist()
        spans = [(0, c[n], c[n + 1]) for n in range(N)]
    o = torch.empty(q.shape[0], T, H, V, dtype=q.dtype, device=q.device)
    finals = []
    for n, (b, t0, t1) in enumerate(spans):
        if initial_state is None:
            S = torch.zeros(H, K, V, dtype=compute, device=q.device)
        else:
            S = initial_state[n].to(compute)
            S = S.transpose(-1, -2) if vk else S
        qh, kh, vh = (x[b, t0:t1].transpose(0, 1).to(compute) for x in (q, k, v))
        on, S = _prefill_one(qh, kh, vh, decay, scale, S, chunk_size)
        o[b, t0:t1] = on.transpose(0, 1).to(q.dtype)
        finals.append(S.transpose(-1, -2) if vk else S)
    final = torch.stack(finals).to(sdtype).contiguous()
    return o, final


__all__ = ["lightning_decode", "lightning_prefill", "check_decode_args", "check_prefill_args", "resolve_state_dtype",
           "STATE_LAYOUTS", "STATE_DTYPES", "CHUNK"]
