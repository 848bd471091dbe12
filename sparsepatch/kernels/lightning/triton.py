"""Lightning (linear) attention in Triton: a bandwidth-bound decode step and a fused chunked prefill.

Same functions as `lightning_reference` (read its docstring for the recurrence and layouts):

    lightning_decode(q, k, v, state, decay, *, scale=None, out=None, state_layout="bhkv") -> o (B, 1, H, V)
        state (B, H, K, V) is updated in place: state <- exp(-decay) state + k^T v; o = scale q @ state.
    lightning_prefill(q, k, v, decay, *, scale=None, initial_state=None, cu_seqlens=None, state_layout="bhkv",
                      state_dtype=None) -> (o (B, T, H, V), final_state (N, H, K, V))

The state is fp32 by default; a bf16 (or fp16) state is stored in that dtype and widened to fp32 in registers
(math fp32, one round-to-nearest per step at the store), halving the decode's bytes (drift: lightning_reference).

Decode: each program streams one (K, BV) state tile once (read + write), tile width and warps per regime
(`_decode_config`; a persistent tile loop, cache hints, TMA bulk copies and PDL were measured slower or neutral).
After the first call with given shapes/strides a cached launch plan relaunches the compiled kernel (`_PLANS`). The
only allocation is the output (none with `out=`), there is no host sync after the first call with a given decay
tensor, so it is CUDA-graph capturable. Prefill: one program per (sequence, head, V-block) walks the sequence in
chunks of 64 tokens carrying the fp32 state in registers: o = (q k^T * decay_mask) v + decay_q * (q @ state); the
per-chunk states never touch memory. Tensor-core operands are the input dtype (the state is rounded to it for
q @ state, like fla); accumulation is fp32.

Both ops are registered as torch.library custom ops (`sparsepatch::lightning_decode_`, mutating state/out, and
`sparsepatch::lightning_prefill`) with fake impls for torch.compile; eager calls launch the kernel directly to
save the dispatcher's host time. Inputs: fp16/bf16 (fp32 runs with tf32 dot products on GPU; exact under
TRITON_INTERPRET=1). Any strides (no hidden copies); q/k/v/o last dim should be contiguous for speed.
"""
from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from .._common import current_stream, direct_launcher
from .reference import CHUNK, check_decode_args, check_prefill_args, resolve_state_dtype

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def supports(q: torch.Tensor, **kw) -> bool:
    """Whether the Triton kernels take these inputs (dispatcher hook): fp16/bf16/fp32, head dims <= 256."""
    k = kw.get("k")
    v = kw.get("v")
    dims_ok = q.shape[-1] <= MAX_HEAD_DIM and (v is None or v.shape[-1] <= MAX_HEAD_DIM)
    return q.dtype in SUPPORTED_DTYPES and dims_ok and (k is None or k.dtype == q.dtype)


# ----------------------------------------------------------------------------------------------------------- decode
@triton.jit
def _decode_kernel(Q, Kt, Vt, S, G, O, scale,
                   sqb, sqh, sqd, skb, skh, skd, svb, svh, svd, ssb, ssh, ssk, ssv, sob, soh, sod,
                   K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, EVEN: tl.constexpr,
                   CSK: tl.constexpr, CSV: tl.constexpr):
    """One program per (V-block, head, batch): the (BK, BV) state tile is read once, updated and written back.
    Any strides: Triton specializes the unit ones (== 1) and those divisible by 16, which makes the state accesses
    16-byte vectors on the unit-stride axis (V of "bhkv", K of "bhvk"). CSK / CSV (0: runtime) give a contiguous
    state's row stride at compile time, so the tile's loads are immediate offsets from one address. The state is
    widened to fp32 after the load and rounded to its own dtype at the store. Head and batch are grid axes (no
    pid // H before the first load)."""
    if CSK != 0:
        ssk = CSK
    if CSV != 0:
        ssv = CSV
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    ok = tl.arange(0, BK)
    ov = pid_v * BV + tl.arange(0, BV)
    sp = S + b * ssb + h * ssh + ok[:, None] * ssk + ov[None, :] * ssv
    qp = Q + b * sqb + h * sqh + ok * sqd
    kp = Kt + b * skb + h * skh + ok * skd
    vp = Vt + b * svb + h * svh + ov * svd
    op = O + b * sob + h * soh + ov * sod
    if EVEN:
        s = tl.load(sp).to(tl.float32)
        q = tl.load(qp).to(tl.float32)
        k = tl.load(kp).to(tl.float32)
        v = tl.load(vp).to(tl.float32)
    else:
        mk = ok < K
        mv = ov < V
        s = tl.load(sp, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)
        q = tl.load(qp, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(kp, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(vp, mask=mv, other=0.0).to(tl.float32)
    s = s * tl.exp(-tl.load(G + h)) + k[:, None] * v[None, :]
    o = tl.sum(s * (q * scale)[:, None], axis=0)
    if EVEN:
        tl.store(sp, s.to(S.dtype.element_ty))
        tl.store(op, o.to(O.dtype.element_ty))
    else:
        tl.store(sp, s.to(S.dtype.element_ty), mask=mk[:, None] & mv[None, :])
        tl.store(op, o.to(O.dtype.element_ty), mask=mv)


# Decode launch settings per regime, from the H100 sweeps (benchmarks/NOTES.md, lightning section, v3-v5): one
# program per (K, BV) tile. CS: a contiguous state's row stride as a compile-time constant -- kept for the small
# (latency-bound) grid only: at B >= 64 it measured 0.3-0.5% slower than runtime strides (run 7: 187.7 vs 186.5 us
# at B=64, 729.2 vs 725.6 at B=256); at B=1 per graph step the two tie (4.70 / 4.71 us).
_SMALL_GRID = {"BV": 16, "num_warps": 1, "CS": True}
_LARGE_GRID = {"BV": 64, "num_warps": 2, "CS": False}
_NARROW_GRID = {"BV": 32, "num_warps": 1, "CS": False}


def _decode_config(BH: int, K: int, V: int, state_dtype=torch.float32) -> dict:
    """Launch settings for the decode kernel. fp32 state: a grid under one wave (B=1 at H=64) does best with many
    small 1-warp programs ((K, 16) tiles: latency-bound); large grids stream (K, 64) tiles on 2 warps (H100 v4
    sweep at B=64: 186.3 us vs 187.9 for (K, 128) / 4 warps, 191.6 for (K, 32) / 1 warp).
    bf16/fp16 state: (K, 32) tiles on 1 warp at every B (B=64: 104 us vs 114 for the fp32 choice; B=1 3.8 us per
    graph step) -- the widened fp32 copy of a bigger 2-byte tile needs more registers than one warp holds."""
    bk = triton.next_power_of_2(K)
    if state_dtype in (torch.bfloat16, torch.float16) and bk <= 128:
        return dict(_NARROW_GRID, BV=min(32, triton.next_power_of_2(V)))
    BV = min(triton.next_power_of_2(V), max(16, 8192 // bk))
    if BH * triton.cdiv(V, BV) <= 132 and bk <= 256:
        return dict(_SMALL_GRID, BV=min(16, triton.next_power_of_2(V)))
    return dict(_LARGE_GRID, BV=BV)


_DECODE_OVERRIDE: dict = {}  # BV / num_warps / CS (False: runtime row strides): sweeps only, bypasses the plans
# Launch plans: key (device, B, H, K, V, dtypes, layout, the five stride tuples) -> (launch, constant args). The
# key holds every int argument, so a plan is reused only where Triton would pick the same binary (it specializes
# ints == 1 and % 16, and pointers by 16-byte alignment: plans are made and used for aligned pointers only). The
# hot path is this key, one dict lookup, the alignment test and the launch, with no config arithmetic (Triton's
# next_power_of_2 / cdiv cost microseconds each), grid or argument building (host time: NOTES, lightning v5).
_PLANS: dict = {}
_DIRECT = [os.environ.get("TRITON_INTERPRET") != "1"]   # False after a failed relaunch: Triton's launcher from then on


def _state_strides(t: torch.Tensor, vk: bool):
    """(batch, head, K, V) strides of a state in either layout."""
    s0, s1, s2, s3 = t.stride()
    return (s0, s1, s3, s2) if vk else (s0, s1, s2, s3)


def _decode_args(B, H, K, V, qs, ks, vs, ss, os_, state_dtype):
    """(grid, num_warps, args after `scale`) of _decode_kernel; ss are the (batch, head, K, V) state strides."""
    cfg = _decode_config(B * H, K, V, state_dtype)
    if _DECODE_OVERRIDE:
        cfg = dict(cfg, **_DECODE_OVERRIDE)
    BV, warps = cfg["BV"], cfg["num_warps"]
    BK = triton.next_power_of_2(K)
    grid = ((V + BV - 1) // BV, H, B)
    # contiguous rows of a contiguous state ((K, V) row-major, or (V, K) for "bhvk"): the row stride as a constant
    cs = cfg.get("CS", False)
    csk = V if cs and ss[3] == 1 and ss[2] == V else 0
    csv = K if cs and ss[2] == 1 and ss[3] == K else 0
    tail = (qs[0], qs[2], qs[3], ks[0], ks[2], ks[3], vs[0], vs[2], vs[3], *ss, os_[0], os_[2], os_[3],
            K, V, BK, BV, BK == K and V % BV == 0, csk, csv)
    return grid, warps, tail


def _launch_decode(q, k, v, state, decay, out, scale: float, vk: bool, B: int, H: int, K: int, V: int) -> None:
    aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr() | state.data_ptr() | out.data_ptr()
               | decay.data_ptr()) % 16 == 0
    key = (q.get_device(), B, H, K, V, q.dtype, state.dtype, vk, q.stride(), k.stride(), v.stride(),
           state.stride(), out.stride())
    use_plan = aligned and _DIRECT[0] and not _DECODE_OVERRIDE
    plan = _PLANS.get(key) if use_plan else None
    if plan is not None:
        try:
            plan(current_stream(key[0]), q, k, v, state, decay, out, scale)
            return
        except Exception as exc:  # noqa: BLE001  (a Triton whose launcher differs, or launch hooks: stop trying)
            logger.warning("sparsepatch lightning: direct relaunch failed (%s); using triton's launcher", exc)
            _DIRECT[0] = False
            _PLANS.clear()
            use_plan = False
    grid, warps, tail = _decode_args(B, H, K, V, key[8], key[9], key[10], _state_strides(state, vk), key[12],
                                     state.dtype)
    kern = _decode_kernel[grid](q, k, v, state, decay, out, scale, *tail[:-7], K=K, V=V, BK=tail[-5],
                                BV=tail[-4], EVEN=tail[-3], CSK=tail[-2], CSV=tail[-1], num_warps=warps)
    if use_plan and key[0] == torch.cuda.current_device():
        plan = direct_launcher(kern, grid, tail)   # (stream, *pointer / scale args)
        if plan is not None:
            if len(_PLANS) > 64:
                _PLANS.clear()
            _PLANS[key] = plan


@torch.library.custom_op("sparsepatch::lightning_decode_", mutates_args=("state", "out"))
def _decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, decay: torch.Tensor,
               out: torch.Tensor, scale: float, state_vk: bool) -> None:
    B, _, H, K = q.shape
    _launch_decode(q, k, v, state, decay, out, scale, state_vk, B, H, K, v.shape[3])


@_decode_op.register_fake
def _(q, k, v, state, decay, out, scale, state_vk):
    return None


def lightning_decode(q, k, v, state, decay, *, scale=None, out=None, state_layout: str = "bhkv"):
    """One decode step on the Triton kernel; see the module docstring. Returns o (B, 1, H, V) (= `out` if given)."""
    B, H, K, V, scale, vk = check_decode_args(q, k, v, state, decay, scale, out, state_layout)
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be one of {SUPPORTED_DTYPES} for the Triton kernel, got {q.dtype}")
    if out is None:
        out = torch.empty_like(v, memory_format=torch.contiguous_format)   # (B, 1, H, V), q's dtype (checked)
    if torch.compiler.is_compiling():
        _decode_op(q, k, v, state, decay, out, scale, vk)
    else:
        _launch_decode(q, k, v, state, decay, out, scale, vk, B, H, K, V)
    return out


# ---------------------------------------------------------------------------------------------------------- prefill
@triton.jit
def _prefill_kernel(Q, Kt, Vt, G, H0, HT, O, CU, scale, T, H,
                    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd,
                    sob, sot, soh, sod, s0n, s0h, s0k, s0v, stn, sth, stk, stv,
                    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                    HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr):
    pid_v = tl.program_id(0)
    pid_nh = tl.program_id(1)
    n = pid_nh // H
    h = pid_nh % H
    if IS_VARLEN:
        bos = tl.load(CU + n).to(tl.int64)
        L = tl.load(CU + n + 1).to(tl.int64) - bos
        b = 0
    else:
        bos = 0
        L = T
        b = n.to(tl.int64)
    rate = tl.load(G + h)
    ok = tl.arange(0, BK)
    ov = pid_v * BV + tl.arange(0, BV)
    oc = tl.arange(0, C)
    mk = ok < K
    mv = ov < V
    # decay inside a chunk: D[i, j] = exp(-rate (i - j)) for j <= i; the start state reaches row i as exp(-rate (i+1))
    diff = (oc[:, None] - oc[None, :]).to(tl.float32)
    dmat = tl.where(diff >= 0, tl.exp(-rate * tl.maximum(diff, 0.0)), 0.0)
    qdec = tl.exp(-rate * (oc + 1).to(tl.float32)) * scale

    if HAS_H0:
        s = tl.load(H0 + n * s0n + h * s0h + ok[:, None] * s0k + ov[None, :] * s0v,
                    mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)
    else:
        s = tl.zeros((BK, BV), dtype=tl.float32)

    qp = Q + b * sqb + bos * sqt + h * sqh + oc[:, None] * sqt + ok[None, :] * sqd
    kp = Kt + b * skb + bos * skt + h * skh + oc[:, None] * skt + ok[None, :] * skd
    vp = Vt + b * svb + bos * svt + h * svh + oc[:, None] * svt + ov[None, :] * svd
    op = O + b * sob + bos * sot + h * soh + oc[:, None] * sot + ov[None, :] * sod
    for t0 in range(0, L, C):
        mt = (t0 + oc) < L
        q = tl.load(qp, mask=mt[:, None] & mk[None, :], other=0.0)
        k = tl.load(kp, mask=mt[:, None] & mk[None, :], other=0.0)
        v = tl.load(vp, mask=mt[:, None] & mv[None, :], other=0.0)
        a = tl.dot(q, tl.trans(k)) * (dmat * scale)
        o = tl.dot(a.to(v.dtype), v)
        o += tl.dot(q, s.to(q.dtype)) * qdec[:, None]
        tl.store(op, o.to(O.dtype.element_ty), mask=mt[:, None] & mv[None, :])
        lc = tl.minimum(L - t0, C).to(tl.float32)
        kdec = tl.where(mt, tl.exp(-rate * tl.maximum(lc - 1.0 - oc.to(tl.float32), 0.0)), 0.0)
        kd = (k.to(tl.float32) * kdec[:, None]).to(k.dtype)
        s = s * tl.exp(-rate * lc) + tl.dot(tl.trans(kd), v)
        qp += C * sqt
        kp += C * skt
        vp += C * svt
        op += C * sot
    tl.store(HT + n * stn + h * sth + ok[:, None] * stk + ov[None, :] * stv, s.to(HT.dtype.element_ty),
             mask=mk[:, None] & mv[None, :])


def _prefill_config(N: int, H: int, K: int, V: int) -> tuple[int, int, int]:
    """(BV, num_warps, num_stages) for the prefill kernel; measured on H100 (benchmarks/NOTES.md).

    V >= 64 takes 64-wide V blocks although 32 measured ~8-10% faster (H100 sweep v2): the BV=32, 4-warp,
    3-stage binary for K=V=128 hits an illegal shared-memory address on Triton 3.6 / Hopper once some other
    kernels ran in the process (benchmarks/repro_prefill_fault.py; pattern of triton-lang/triton#11366), while
    BV=64 passes the same reproducer (and num_warps=8 does not)."""
    if V >= 64:
        return 64, 4, 3
    BV = min(32, max(16, triton.next_power_of_2(V)))
    return BV, 4, 3


_PREFILL_OVERRIDE: dict = {}  # {"BV", "num_warps", "num_stages", "C"}: benchmark sweeps only


def _launch_prefill(q, k, v, decay, initial_state, cu_seqlens, scale: float, vk: bool, state_dtype=torch.float32):
    B, T, H, K = q.shape
    V = v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    o = torch.empty((B, T, H, V), dtype=q.dtype, device=q.device)
    final = torch.empty((N, H, V, K) if vk else (N, H, K, V), dtype=state_dtype, device=q.device)
    if N == 0:
        return o, final
    BK = max(16, triton.next_power_of_2(K))
    BV, warps, stages = _prefill_config(N, H, K, V)
    if _PREFILL_OVERRIDE:
        BV = _PREFILL_OVERRIDE.get("BV", BV)
        warps = _PREFILL_OVERRIDE.get("num_warps", warps)
        stages = _PREFILL_OVERRIDE.get("num_stages", stages)
    C = _PREFILL_OVERRIDE.get("C", CHUNK)
    h0 = initial_state if initial_state is not None else final  # dummy pointer when absent
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), o.stride()
    cu = cu_seqlens if cu_seqlens is not None else decay  # dummy pointer when absent
    _prefill_kernel[(triton.cdiv(V, BV), N * H)](
        q, k, v, decay, h0, final, o, cu, scale, T, H,
        *qs, *ks, *vs, *os_, *_state_strides(h0, vk), *_state_strides(final, vk),
        K=K, V=V, BK=BK, BV=BV, C=C, HAS_H0=initial_state is not None, IS_VARLEN=cu_seqlens is not None,
        num_warps=warps, num_stages=stages)
    return o, final


@torch.library.custom_op("sparsepatch::lightning_prefill", mutates_args=())
def _prefill_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float,
                state_vk: bool, state_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_prefill(q, k, v, decay, initial_state, cu_seqlens, scale, state_vk, state_dtype)


@_prefill_op.register_fake
def _(q, k, v, decay, initial_state, cu_seqlens, scale, state_vk, state_dtype=torch.float32):
    B, T, H, K = q.shape
    V = v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    o = q.new_empty((B, T, H, V))
    final = q.new_empty((N, H, V, K) if state_vk else (N, H, K, V), dtype=state_dtype)
    return o, final


def lightning_prefill(q, k, v, decay, *, scale=None, initial_state=None, cu_seqlens=None,
                      state_layout: str = "bhkv", state_dtype=None):
    """Chunked prefill on the Triton kernel; see the module docstring. Returns (o, final_state); the final state's
    dtype is `state_dtype` (None: initial_state's dtype, else fp32), the math fp32 either way."""
    N, T, H, K, V, scale, vk = check_prefill_args(q, k, v, decay, scale, initial_state, cu_seqlens, state_layout)
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be one of {SUPPORTED_DTYPES} for the Triton kernel, got {q.dtype}")
    sdt = resolve_state_dtype(state_dtype, initial_state, q)
    if torch.compiler.is_compiling():
        return _prefill_op(q, k, v, decay, initial_state, cu_seqlens, scale, vk, sdt)
    return _launch_prefill(q, k, v, decay, initial_state, cu_seqlens, scale, vk, sdt)


__all__ = ["lightning_decode", "lightning_prefill", "supports"]
