"""Triton backward kernels for dense and skip-list attention (FlashAttention-2 style, no atomics).

Layout: q (B, Sq, Hq, D), k/v (B, Sk, Hk, D) with any strides (unit stride on D), out/dout (B, Sq, Hq, D),
lse (B, Hq, Sq) fp32 natural log as written by `skip.py` (-inf for rows that attend to nothing).
fp16/bf16 on CUDA (fp32 only under TRITON_INTERPRET=1), head dim 64 or 128, GQA Hq % Hk == 0, any Sq/Sk.

Three launches (plus the list transpose in skip mode):
  1. `_prep_kernel`: delta = rowsum(dout * out) - dlse and lse2 = lse * log2(e) (+inf for empty rows), fp32.
  2. `_dkdv_kernel`: one program per (BLOCK_N keys, batch, kv head). It loops over the query heads of its GQA
     group inside the program (no atomics, no fp32 scratch) and over the q-tiles that see its k-tile: all of
     them (dense, causal-trimmed) or the transposed list (skip mode), in BLOCK_M sub-blocks.
  3. `_dq_kernel`: one program per (BLOCK_M queries, batch, query head), walking the q-tile's own list.
Only tiles in the list contribute, so the gradient is exactly that of the sparse forward (`reference.skip_attention`
with the same list). Partial tiles need no score masking except in the dQ kernel's last (partial) k-tile:
padded rows/columns load as zeros and padded rows get lse2 = +inf, so their probabilities are 0.

Autograd wiring: `make_differentiable` calls `torch.library.register_autograd` on `sparsepatch::skip_fwd` and
`sparsepatch::dense_fwd` (skip/triton.py, which defines the ops, calls it once for each).
  skip_fwd(q, k, v, counts, indices, threshold, scale, tm, tn, must_do_flat, return_lse)
      -> (out, next_counts, next_indices, lse): setup_context saves q, k, v, out, lse and a clone of the list
      it read (counts, indices; must_do tiles are re-added in backward exactly as the forward adds them).
  dense_fwd(q, k, v, causal, scale, return_lse) -> (out, lse): saves q, k, v, out, lse.
Backward = `sparsepatch::attention_bwd` (a custom op, so torch.compile traces it) with dlse folded into delta.
If the forward ran with return_lse=False the saved lse is empty and backward RECOMPUTES it with one extra forward
call (correct, ~1 forward slower). Eager inference calls of the forward entries bypass the op (and autograd); calls
that need a gradient go through it with return_lse forced on, so the lse is saved and not recomputed.

Training mode: `attention_backward(..., extra_skip=SkipList)` walks only the tiles of `extra_skip` (those the
forward's keep test did not mark negligible; intersected with skip_list) — an approximate gradient.
"""
from __future__ import annotations

import logging
import math

import torch
import triton
import triton.language as tl

from .._common import head_major_desc, key_range, store_delta_lse2
from .._common import interpret as _interpret
from ..dense import reference as dense_reference
from . import reference
from ..dense.reference import LOG2E, check_qkv
from .skiplist import SkipList

__all__ = ["transpose_list", "transpose_list_torch", "attention_backward", "make_differentiable",
           "CONFIGS", "supports"]

logger = logging.getLogger(__name__)

# Launch configs keyed by head dim: BLOCK sizes of the dK/dV kernel (keys per program N1, query sub-block M1) and
# of the dQ kernel (queries per program M2, key sub-block N2). Block sizes shrink to divide the skip tile.
# flat=True: the skip loops walk (listed tile, sub-block) pairs with the next tile index loaded one iteration ahead.
# tma=True: the loop loads (q/dO in dK/dV, k/v in dQ) through host TMA descriptors over the (B, H, S, D) views.
# (Atomic dq in the dK/dV kernel -- per-element in round 2, one TMA reduce-add per block in round 3 --, one fused
# dK/dV + dQ launch, the dQ kernel on a side stream, and 4-warp 64-query dQ programs were measured slower or
# neutral and deleted; NOTES.md.)
# D=128 is the H100 sweep winner of benchmarks/bench_backward.py (2026-11-23 round 3: 4-warp dK/dV programs of 64
# keys at 2 stages, ~99 KB shared memory and 255 registers x 128 threads, so two run per SM and one's softmax
# overlaps the other's wgmma: bwd 37.9 ms dense, 37.7 / 18.8 / 5.18 / 2.26 ms at 0 / 50 / 87.5 / 95 % skip in the
# peer table, B1 H12 S32768; the round-2 default with one 8-warp 128-key program per SM: 40.4 / 39.9 / 19.6 / 5.44
# / 2.38). D=64 is unswept.
CONFIGS = {
    128: dict(M1=64, N1=64, w1=4, s1=2, M2=128, N2=64, w2=8, s2=3, flat=True, tma=True),
    64: dict(M1=64, N1=128, w1=8, s1=3, M2=128, N2=64, w2=8, s2=3),
}


# ----------------------------------------------------------------------------------------------------------------
# List transpose
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _scatter_kernel(CNT, IDX, MASK_T, Tq, Tk, BLOCK_K: tl.constexpr):
    """maskT[bh, j, i] = 1 for every listed (i, j): one program per (bh, q-tile i)."""
    i = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    cnt = tl.load(CNT + bh * Tq + i)
    offs = tl.arange(0, BLOCK_K)
    for s0 in range(0, cnt, BLOCK_K):
        ok = (s0 + offs) < cnt
        j = tl.load(IDX + (bh * Tq + i) * Tk + s0 + offs, mask=ok, other=0)
        tl.store(MASK_T + (bh * Tk + j) * Tq + i, tl.full([BLOCK_K], 1, tl.int8), mask=ok)


@triton.jit
def _compact_kernel(MASK_T, CNT_T, IDX_T, Tq, Tk, BLOCK_Q: tl.constexpr):
    """Ascending q-tiles of k-tile j: one program per (bh, j)."""
    j = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    row = bh * Tk + j
    offs = tl.arange(0, BLOCK_Q)
    total = tl.full([], 0, tl.int32)
    for i0 in range(0, Tq, BLOCK_Q):
        ok = (i0 + offs) < Tq
        m = tl.load(MASK_T + row * Tq + i0 + offs, mask=ok, other=0).to(tl.int32)
        pos = total + tl.cumsum(m, 0) - m
        tl.store(IDX_T + row * Tq + pos, i0 + offs, mask=m != 0)
        total += tl.sum(m, 0)
    tl.store(CNT_T + row, total)


def transpose_list_torch(skip_list: SkipList) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference transpose: counts_t int32 (B, H, Tk), indices_t int32 (B, H, Tk, Tq), ascending q-tiles first."""
    mask_t = skip_list.to_mask().transpose(-1, -2)
    counts_t = mask_t.sum(-1, dtype=torch.int32)
    order = torch.argsort((~mask_t).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts_t, order.contiguous()


def _transpose_raw(counts, indices, zero_tail=True):
    """zero_tail=False leaves the slots after counts_t uninitialised (the backward kernels never read them)."""
    B, H, Tq, Tk = indices.shape
    counts = counts.contiguous()
    indices = indices.contiguous()
    mask_t = torch.zeros((B, H, Tk, Tq), dtype=torch.int8, device=indices.device)
    counts_t = torch.empty((B, H, Tk), dtype=torch.int32, device=indices.device)
    indices_t = (torch.zeros if zero_tail else torch.empty)((B, H, Tk, Tq), dtype=torch.int32, device=indices.device)
    if B * H * Tq * Tk == 0:
        counts_t.zero_()
        return counts_t, indices_t
    _scatter_kernel[(Tq, B * H)](counts, indices, mask_t, Tq, Tk, BLOCK_K=min(triton.next_power_of_2(Tk), 256))
    _compact_kernel[(Tk, B * H)](mask_t, counts_t, indices_t, Tq, Tk, BLOCK_Q=min(triton.next_power_of_2(Tq), 256))
    return counts_t, indices_t


def transpose_list(skip_list: SkipList) -> tuple[torch.Tensor, torch.Tensor]:
    """For each k-tile, the ascending q-tiles whose lists contain it.

    Returns counts_t int32 (B, H, Tk) and indices_t int32 (B, H, Tk, Tq) (slots after counts_t are 0).
    Triton kernels on CUDA / under TRITON_INTERPRET=1, the torch version otherwise.
    """
    if not (skip_list.indices.is_cuda or _interpret()):
        return transpose_list_torch(skip_list)
    return _transpose_raw(skip_list.counts, skip_list.indices)


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _prep_kernel(O, DO, LSE, DLSE, DELTA, LSE2, stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
                 Sq, Hq, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_DLSE: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    h = bh % Hq
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    ok = rows < Sq
    offs_d = tl.arange(0, HEAD_DIM)
    o = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_os + offs_d[None, :], mask=ok[:, None],
                other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_db + h * stride_dh + rows[:, None] * stride_ds + offs_d[None, :], mask=ok[:, None],
                 other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    base = bh.to(tl.int64) * Sq + rows
    store_delta_lse2(DELTA, LSE2, LSE, DLSE, base, ok, delta, HAS_DLSE)


@triton.jit
def _dkdv_block(dk, dv, k, v, Q, DO, LSE2, DELTA, start_m, offs_m, offs_d, cols, Sq, stride_qs, stride_ds,
                qk_scale, causal_off, MASK: tl.constexpr, CAUSAL: tl.constexpr, QD, DOD, tb, th,
                USE_TMA: tl.constexpr):
    """Add the contribution of queries [start_m, start_m + BLOCK_M) of one head to dk, dv (BLOCK_N, D).
    USE_TMA: q/dO come through host TMA descriptors QD/DOD over the (B, H, S, D) views (rows past Sq read 0)."""
    rows = start_m + offs_m
    if USE_TMA:
        q = QD.load([tb, th, start_m, 0]).reshape(offs_m.shape[0], offs_d.shape[0])
        do = DOD.load([tb, th, start_m, 0]).reshape(offs_m.shape[0], offs_d.shape[0])
        if MASK:
            ok = rows < Sq
            lse2 = tl.load(LSE2 + rows, mask=ok, other=float("inf"))
            delta = tl.load(DELTA + rows, mask=ok, other=0.0)
        else:
            lse2 = tl.load(LSE2 + rows)
            delta = tl.load(DELTA + rows)
    elif MASK:
        ok = rows < Sq
        q = tl.load(Q + rows[:, None] * stride_qs + offs_d[None, :], mask=ok[:, None], other=0.0)
        do = tl.load(DO + rows[:, None] * stride_ds + offs_d[None, :], mask=ok[:, None], other=0.0)
        lse2 = tl.load(LSE2 + rows, mask=ok, other=float("inf"))
        delta = tl.load(DELTA + rows, mask=ok, other=0.0)
    else:
        q = tl.load(Q + rows[:, None] * stride_qs + offs_d[None, :])
        do = tl.load(DO + rows[:, None] * stride_ds + offs_d[None, :])
        lse2 = tl.load(LSE2 + rows)
        delta = tl.load(DELTA + rows)
    qkT = tl.dot(k, tl.trans(q))                                   # (BLOCK_N, BLOCK_M)
    pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
    if CAUSAL:
        pT = tl.where(cols[:, None] <= rows[None, :] + causal_off, pT, 0.0)
    dv = tl.dot(pT.to(do.dtype), do, dv)
    dpT = tl.dot(v, tl.trans(do))
    dsT = pT * (dpT - delta[None, :])
    dsT16 = dsT.to(q.dtype)
    dk = tl.dot(dsT16, q, dk)
    return dk, dv


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE2, DELTA, DK, DV, CNT_T, IDX_T,
                 stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 stride_db, stride_ds, stride_dh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs,
                 stride_dvh, Sq, Sk, Hq, Hk, n_rep, Tq, Tk, scale, qk_scale,
                 causal_off, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 TILE_M: tl.constexpr, TILE_N: tl.constexpr, SKIP: tl.constexpr, CAUSAL: tl.constexpr,
                 Q_PARTIAL: tl.constexpr, FLAT: tl.constexpr, QD, DOD, USE_TMA: tl.constexpr):
    """dK/dV of keys [program_id(0) * BLOCK_N, +BLOCK_N) of (batch, kv head) program_id(1)."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hk).to(tl.int64)
    tb = (bh // Hk).to(tl.int32)
    hk = bh % Hk
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    start_n = pid_n * BLOCK_N
    cols = start_n + offs_n
    col_ok = cols < Sk
    k = tl.load(K + b * stride_kb + hk * stride_kh + cols[:, None] * stride_ks + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + cols[:, None] * stride_vs + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for r in range(0, n_rep):
        h = hk * n_rep + r
        th = h
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_db + h * stride_dh
        row_base = (b * Hq + h) * Sq
        lse_base = LSE2 + row_base
        dl_base = DELTA + row_base
        if SKIP:
            j = start_n // TILE_N
            trow = (b * Hq + h) * Tk + j
            cnt = tl.load(CNT_T + trow)
            idx = IDX_T + trow * Tq
            n_plain = cnt
            if Q_PARTIAL:
                last = tl.load(idx + tl.maximum(cnt - 1, 0))
                n_plain = tl.where((cnt > 0) & (last == Tq - 1), cnt - 1, cnt)
            if FLAT:
                # One loop over (listed q-tile, BLOCK_M sub-block) pairs with the q-tile index loaded one
                # iteration ahead, so the next q/dO addresses never wait on an index load in the same iteration.
                i_nxt = tl.load(idx)
                for t in range(0, n_plain * (TILE_M // BLOCK_M)):
                    i = i_nxt
                    i_nxt = tl.load(idx + tl.minimum((t + 1) // (TILE_M // BLOCK_M), Tq - 1))
                    dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, dl_base,
                                         i * TILE_M + (t % (TILE_M // BLOCK_M)) * BLOCK_M, offs_m, offs_d, cols,
                                         Sq, stride_qs, stride_ds, qk_scale, 0, False, False, QD,
                                         DOD, tb, th, USE_TMA)
            else:
                for it in range(0, n_plain):
                    i = tl.load(idx + it)
                    for s in tl.static_range(TILE_M // BLOCK_M):
                        dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, dl_base,
                                             i * TILE_M + s * BLOCK_M, offs_m, offs_d, cols, Sq, stride_qs,
                                             stride_ds, qk_scale, 0, False, False, QD, DOD, tb, th,
                                             USE_TMA)
            if Q_PARTIAL:  # the partial last q-tile (masked, pointer loads; compiled only when there is one)
                for it in range(n_plain, cnt):
                    for s in tl.static_range(TILE_M // BLOCK_M):
                        dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, dl_base,
                                             (Tq - 1) * TILE_M + s * BLOCK_M, offs_m, offs_d, cols, Sq, stride_qs,
                                             stride_ds, qk_scale, 0, True, False, QD, DOD,
                                             tb, th, False)
        else:
            full = Sq // BLOCK_M * BLOCK_M
            if CAUSAL:
                # Query row r sees key c iff c <= r + causal_off. Rows below lo see none of this block; blocks
                # starting before mid straddle the diagonal and need the causal mask.
                lo = tl.maximum(start_n - causal_off, 0) // BLOCK_M * BLOCK_M
                mid = tl.minimum(tl.maximum(start_n + BLOCK_N - 1 - causal_off, 0), Sq)
                mid = tl.maximum((mid + BLOCK_M - 1) // BLOCK_M * BLOCK_M, lo)
                for start_m in range(lo, mid, BLOCK_M):
                    dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, dl_base, start_m,
                                         offs_m, offs_d, cols, Sq, stride_qs, stride_ds, qk_scale,
                                         causal_off, True, True, QD, DOD, tb, th, False)
                tail = tl.maximum(mid, full)
            else:
                mid = 0
                tail = full
            for start_m in range(mid, full, BLOCK_M):
                dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, dl_base, start_m, offs_m,
                                     offs_d, cols, Sq, stride_qs, stride_ds, qk_scale, causal_off,
                                     False, False, QD, DOD, tb, th, USE_TMA)
            for start_m in range(tail, Sq, BLOCK_M):
                dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, dl_base, start_m, offs_m,
                                     offs_d, cols, Sq, stride_qs, stride_ds, qk_scale, causal_off,
                                     True, CAUSAL, QD, DOD, tb, th, False)
    dk = dk * scale
    tl.store(DK + b * stride_dkb + hk * stride_dkh + cols[:, None] * stride_dks + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + b * stride_dvb + hk * stride_dvh + cols[:, None] * stride_dvs + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _dq_block(dq, q, do, lse2, delta, K, V, start_n, offs_n, offs_d, rows, Sk, stride_ks, stride_vs, qk_scale,
              causal_off, MASK: tl.constexpr, CAUSAL: tl.constexpr, KD, VD, tb, th, USE_TMA: tl.constexpr):
    """Add the contribution of keys [start_n, start_n + BLOCK_N) to dq (BLOCK_M, D).
    USE_TMA: k/v through host TMA descriptors KD/VD over the (B, Hk, S, D) views (rows past Sk read 0)."""
    cols = start_n + offs_n
    if USE_TMA:
        k = KD.load([tb, th, start_n, 0]).reshape(offs_n.shape[0], offs_d.shape[0])
        v = VD.load([tb, th, start_n, 0]).reshape(offs_n.shape[0], offs_d.shape[0])
    elif MASK:
        ok = cols < Sk
        k = tl.load(K + cols[:, None] * stride_ks + offs_d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(V + cols[:, None] * stride_vs + offs_d[None, :], mask=ok[:, None], other=0.0)
    else:
        k = tl.load(K + cols[:, None] * stride_ks + offs_d[None, :])
        v = tl.load(V + cols[:, None] * stride_vs + offs_d[None, :])
    qk = tl.dot(q, tl.trans(k))                                    # (BLOCK_M, BLOCK_N)
    if MASK:
        valid = (cols < Sk)[None, :]
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None] + causal_off)
        p = tl.math.exp2(tl.where(valid, qk * qk_scale - lse2[:, None], float("-inf")))
    else:
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE2, DELTA, DQ, CNT, IDX,
               stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
               stride_db, stride_ds, stride_dh, stride_dqb, stride_dqs, stride_dqh,
               Sq, Sk, Hq, n_rep, Tq, Tk, scale, qk_scale, causal_off,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_M: tl.constexpr,
               TILE_N: tl.constexpr, SKIP: tl.constexpr, CAUSAL: tl.constexpr, K_PARTIAL: tl.constexpr,
               FLAT: tl.constexpr, KD, VD, USE_TMA: tl.constexpr):
    """dQ of queries [program_id(0) * BLOCK_M, +BLOCK_M) of (batch, query head) program_id(1)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    tb = (bh // Hq).to(tl.int32)
    h = bh % Hq
    hk = h // n_rep
    thk = hk
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    start_m = pid_m * BLOCK_M
    rows = start_m + offs_m
    row_ok = rows < Sq
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qs + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_db + h * stride_dh + rows[:, None] * stride_ds + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    row_base = (b * Hq + h) * Sq
    lse2 = tl.load(LSE2 + row_base + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + row_base + rows, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if SKIP:
        i = start_m // TILE_M
        lrow = (b * Hq + h) * Tq + i
        cnt = tl.load(CNT + lrow)
        idx = IDX + lrow * Tk
        n_plain = cnt
        if K_PARTIAL:
            last = tl.load(idx + tl.maximum(cnt - 1, 0))
            n_plain = tl.where((cnt > 0) & (last == Tk - 1), cnt - 1, cnt)
        if FLAT:  # (listed k-tile, BLOCK_N sub-block) pairs, k-tile index loaded one iteration ahead
            j_nxt = tl.load(idx)
            for t in range(0, n_plain * (TILE_N // BLOCK_N)):
                j = j_nxt
                j_nxt = tl.load(idx + tl.minimum((t + 1) // (TILE_N // BLOCK_N), Tk - 1))
                dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base,
                               j * TILE_N + (t % (TILE_N // BLOCK_N)) * BLOCK_N, offs_n, offs_d, rows, Sk,
                               stride_ks, stride_vs, qk_scale, 0, False, False, KD, VD, tb, thk, USE_TMA)
        else:
            for it in range(0, n_plain):
                j = tl.load(idx + it)
                for s in tl.static_range(TILE_N // BLOCK_N):
                    dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, j * TILE_N + s * BLOCK_N, offs_n,
                                   offs_d, rows, Sk, stride_ks, stride_vs, qk_scale, 0, False, False, KD, VD, tb, thk,
                                   USE_TMA)
        if K_PARTIAL:  # the partial last k-tile (masked, pointer loads; compiled only when there is one)
            for it in range(n_plain, cnt):
                for s in tl.static_range(TILE_N // BLOCK_N):
                    dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, (Tk - 1) * TILE_N + s * BLOCK_N, offs_n,
                                   offs_d, rows, Sk, stride_ks, stride_vs, qk_scale, 0, True, False, KD, VD, tb, thk,
                                   False)
    else:
        hi, full = key_range(start_m, Sk, causal_off, BLOCK_M, BLOCK_N, CAUSAL)
        for start_n in range(0, full, BLOCK_N):
            dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, start_n, offs_n, offs_d, rows, Sk, stride_ks,
                           stride_vs, qk_scale, causal_off, False, False, KD, VD, tb, thk, USE_TMA)
        for start_n in range(full, hi, BLOCK_N):
            dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, start_n, offs_n, offs_d, rows, Sk, stride_ks,
                           stride_vs, qk_scale, causal_off, True, CAUSAL, KD, VD, tb, thk, False)
    dq = dq * scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqs + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------

def supports(q) -> bool:
    """True when the Triton backward runs these inputs (CUDA fp16/bf16 or interpreter fp16/fp32, D 64/128)."""
    if q.dim() != 4 or q.shape[-1] not in (64, 128):
        return False
    if _interpret():
        return q.dtype in (torch.float16, torch.float32)
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _fit(block: int, tile: int) -> int:
    """Largest power of two <= block dividing tile (tiles are multiples of 16)."""
    while tile % block:
        block //= 2
    return block


def _unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _list_mask(counts, indices):
    """Bool (B, H, Tq, Tk) of listed tiles (device ops)."""
    tk = indices.shape[-1]
    slot = torch.arange(tk, device=indices.device)
    valid = slot < counts.unsqueeze(-1)
    hits = torch.zeros(indices.shape, dtype=torch.int32, device=indices.device)
    hits.scatter_add_(-1, torch.where(valid, indices.long(), 0), valid.to(torch.int32))
    return hits > 0


def _from_mask(mask):
    counts = mask.sum(-1, dtype=torch.int32)
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts, order


def _backward_impl(q, k, v, out, lse, dout, dlse, counts, indices, tm, tn, scale, causal, cfg=None):
    B, Sq, Sk, Hq, Hk, D = check_qkv(q, k, v)
    cfg = dict(CONFIGS[D] if cfg is None else cfg)
    q, k, v, out, dout = (_unit(t) for t in (q, k, v, out, dout))
    dev = q.device
    skip = counts is not None
    delta = torch.empty((B, Hq, Sq), dtype=torch.float32, device=dev)
    lse2 = torch.empty((B, Hq, Sq), dtype=torch.float32, device=dev)
    lse = lse.contiguous()
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    PB = 64
    _prep_kernel[(triton.cdiv(Sq, PB), B * Hq)](
        out, dout, lse, dlse if dlse is not None else lse, delta, lse2,
        out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        Sq, Hq, HEAD_DIM=D, BLOCK=PB, HAS_DLSE=dlse is not None, num_warps=4)

    dq = torch.empty((B, Sq, Hq, D), dtype=q.dtype, device=dev)
    dk = torch.empty((B, Sk, Hk, D), dtype=k.dtype, device=dev)
    dv = torch.empty((B, Sk, Hk, D), dtype=v.dtype, device=dev)
    qk_scale = scale * LOG2E
    causal_off = Sk - Sq
    if skip:
        counts = counts.contiguous()
        indices = indices.contiguous()
        counts_t, indices_t = _transpose_raw(counts, indices, zero_tail=False)
        Tq, Tk = indices.shape[2:]
        m1, n1 = _fit(cfg["M1"], tm), _fit(cfg["N1"], tn)
        m2, n2 = _fit(cfg["M2"], tm), _fit(cfg["N2"], tn)
    else:
        counts_t = indices_t = counts = indices = dq  # unused pointers
        Tq = Tk = 1
        m1, n1, m2, n2 = cfg["M1"], cfg["N1"], cfg["M2"], cfg["N2"]
        tm, tn = m2, n1
    flat = bool(cfg.get("flat", False))
    qd = dod = kd = vd = None
    if cfg.get("tma", False):
        qd, dod = head_major_desc(q, m1), head_major_desc(dout, m1)
        kd, vd = head_major_desc(k, n2), head_major_desc(v, n2)
    use_tma = all(x is not None for x in (qd, dod, kd, vd))
    if not use_tma:
        qd = dod = kd = vd = dq  # unused pointers
    _dkdv_kernel[(triton.cdiv(Sk, n1), B * Hk)](
        q, k, v, dout, lse2, delta, dk, dv, counts_t, indices_t,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        Sq, Sk, Hq, Hk, Hq // Hk, Tq, Tk, scale, qk_scale, causal_off,
        HEAD_DIM=D, BLOCK_M=m1, BLOCK_N=n1, TILE_M=tm, TILE_N=tn, SKIP=skip, CAUSAL=bool(causal),
        Q_PARTIAL=bool(skip and Sq % tm), FLAT=flat, QD=qd, DOD=dod, USE_TMA=use_tma,
        num_warps=cfg["w1"], num_stages=cfg["s1"])
    _dq_kernel[(triton.cdiv(Sq, m2), B * Hq)](
        q, k, v, dout, lse2, delta, dq, counts, indices,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        Sq, Sk, Hq, Hq // Hk, Tq, Tk, scale, qk_scale, causal_off,
        HEAD_DIM=D, BLOCK_M=m2, BLOCK_N=n2, TILE_M=tm, TILE_N=tn, SKIP=skip, CAUSAL=bool(causal),
        K_PARTIAL=bool(skip and Sk % tn), FLAT=flat, KD=kd, VD=vd, USE_TMA=use_tma, num_warps=cfg["w2"],
        num_stages=cfg["s2"])
    return dq, dk, dv


@torch.library.custom_op("sparsepatch::attention_bwd", mutates_args=())
def _attention_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      dout: torch.Tensor, dlse: torch.Tensor | None, counts: torch.Tensor | None,
                      indices: torch.Tensor | None, tm: int, tn: int, scale: float,
                      causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(q, k, v, out, lse, dout, dlse, counts, indices, tm, tn, scale, causal)


@_attention_bwd_op.register_fake
def _(q, k, v, out, lse, dout, dlse, counts, indices, tm, tn, scale, causal):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _check_bwd_inputs(q, k, v, out, lse, dout):
    B, Sq, Sk, Hq, Hk, D = check_qkv(q, k, v)
    if out.shape != q.shape or dout.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} and dout {tuple(dout.shape)} must have q's shape {tuple(q.shape)}")
    if lse.shape != (B, Hq, Sq) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be fp32 (B, Hq, Sq) = {(B, Hq, Sq)}, got {lse.dtype} {tuple(lse.shape)}")
    return B, Sq, Sk, Hq, Hk, D


def _reference_backward(q, k, v, dout, skip_list, scale, causal):
    """Autograd through the reference (CPU / unsupported inputs)."""
    with torch.enable_grad():
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        if skip_list is None:
            o = dense_reference.attention(qq, kk, vv, causal=causal, scale=scale)
        else:
            o, _ = reference.skip_attention(qq, kk, vv, skip_list, -1.0, scale=scale)
        return torch.autograd.grad(o, (qq, kk, vv), dout.to(o.dtype))


def attention_backward(q, k, v, out, lse, dout, *, skip_list: SkipList | None = None, scale=None,
                       causal: bool = False, extra_skip: SkipList | None = None, dlse=None):
    """Gradients (dq, dk, dv) of dense (skip_list None) or skip-list attention.

    q (B, Sq, Hq, D), k/v (B, Sk, Hk, D), out/dout (B, Sq, Hq, D), lse (B, Hq, Sq) fp32 natural log from the
    forward. skip_list: the list the forward READ (tiles computed), with must_do tiles already included.
    causal: bottom-right aligned, dense only. extra_skip: training mode, the tiles the backward keeps (a subset
    of skip_list; only tiles in both are walked — approximate gradient). dlse: optional upstream gradient of lse.
    Returns dq (B, Sq, Hq, D), dk, dv (B, Sk, Hk, D) in the input dtype.
    """
    B, Sq, Sk, Hq, Hk, D = _check_bwd_inputs(q, k, v, out, lse, dout)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if skip_list is None and extra_skip is not None:
        skip_list = SkipList.full(B, Hq, Sq, Sk, extra_skip.tile, device=q.device)
    if skip_list is not None:
        if causal:
            raise ValueError("causal=True is only supported with skip_list=None (dense)")
        reference.check_skip_list(skip_list, B, Hq, Sq, Sk)
        if extra_skip is not None and not supports(q):
            # Training mode off-kernel: the same function (forward's lse, kept tiles only), not a renormalised
            # attention over the smaller list.
            logger.warning("attention_backward: Triton kernel does not support %s %s on %s; using the reference",
                           q.dtype, tuple(q.shape), q.device)
            return reference.skip_attention_grads(q, k, v, out, lse, dout, skip_list, extra_skip, scale=scale)
        if extra_skip is not None:
            reference.check_skip_list(extra_skip, B, Hq, Sq, Sk)
            if extra_skip.tile != skip_list.tile:
                raise ValueError(f"extra_skip tile {extra_skip.tile} must equal skip_list tile {skip_list.tile}")
            mask = _list_mask(skip_list.counts.to(q.device), skip_list.indices.to(q.device)) & \
                _list_mask(extra_skip.counts.to(q.device), extra_skip.indices.to(q.device))
            c, i = _from_mask(mask)
            skip_list = SkipList(c, i, skip_list.tile, Sq, Sk)
    if not supports(q):
        logger.warning("attention_backward: Triton kernel does not support %s %s on %s; using the reference",
                       q.dtype, tuple(q.shape), q.device)
        return _reference_backward(q, k, v, dout, skip_list, scale, causal)
    if skip_list is None:
        return _attention_bwd_op(q, k, v, out, lse, dout, dlse, None, None, 0, 0, scale, bool(causal))
    tm, tn = skip_list.tile
    return _attention_bwd_op(q, k, v, out, lse, dout, dlse, skip_list.counts.to(q.device),
                             skip_list.indices.to(q.device), tm, tn, scale, False)


# ----------------------------------------------------------------------------------------------------------------
# Autograd for the forward custom ops of skip.py
# ----------------------------------------------------------------------------------------------------------------

def _must_do_union(counts, indices, Sq, Sk, tm, tn, must_do_flat):
    """The list the forward actually computed: the read list plus must_do tiles (as skip._union does)."""
    must_do = list(zip(must_do_flat[0::2], must_do_flat[1::2]))
    forced = reference.must_do_tiles(must_do, Sq, Sk, (tm, tn))
    if forced is None:
        return counts, indices
    return _from_mask(_list_mask(counts, indices) | forced.to(indices.device))


def _skip_setup_context(ctx, inputs, output):
    q, k, v, counts, indices, threshold, scale, tm, tn, must_do_flat, return_lse = inputs
    out, _nc, _ni, lse = output
    ctx.save_for_backward(q, k, v, out, lse, counts.clone(), indices.clone())
    ctx.params = (float(threshold), float(scale), int(tm), int(tn), list(must_do_flat))
    ctx.has_lse = bool(return_lse)


def _skip_backward(ctx, dout, _dnc, _dni, dlse):
    q, k, v, out, lse, counts, indices = ctx.saved_tensors
    threshold, scale, tm, tn, must_do_flat = ctx.params
    if not ctx.has_lse:
        lse = torch.ops.sparsepatch.skip_fwd(q, k, v, counts, indices, threshold, scale, tm, tn, must_do_flat,
                                             True)[3]
        dlse = None
    ucounts, uindices = _must_do_union(counts, indices, q.shape[1], k.shape[1], tm, tn, must_do_flat)
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _attention_bwd_op(q, k, v, out, lse, dout, dlse, ucounts, uindices, tm, tn, scale, False)
    return dq, dk, dv, None, None, None, None, None, None, None, None


def _dense_setup_context(ctx, inputs, output):
    q, k, v, causal, scale, return_lse = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.params = (bool(causal), float(scale), bool(return_lse))


def _dense_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    causal, scale, has_lse = ctx.params
    if not has_lse:
        lse = torch.ops.sparsepatch.dense_fwd(q, k, v, causal, scale, True)[1]
        dlse = None
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _attention_bwd_op(q, k, v, out, lse, dout, dlse, None, None, 0, 0, scale, causal)
    return dq, dk, dv, None, None, None


_REGISTERED = set()


def make_differentiable(op_name: str = "sparsepatch::skip_fwd") -> bool:
    """Attach this backward to a forward custom op of skip.py (`sparsepatch::skip_fwd` or `sparsepatch::dense_fwd`)
    via torch.library.register_autograd. Idempotent; returns False if the op is not defined (skip.py missing)."""
    if op_name in _REGISTERED:
        return True
    ns, name = op_name.split("::")
    if not hasattr(getattr(torch.ops, ns), name):
        return False
    if name == "skip_fwd":
        torch.library.register_autograd(op_name, _skip_backward, setup_context=_skip_setup_context)
    elif name == "dense_fwd":
        torch.library.register_autograd(op_name, _dense_backward, setup_context=_dense_setup_context)
    else:
        raise ValueError(f"op_name must be sparsepatch::skip_fwd or sparsepatch::dense_fwd, got {op_name!r}")
    _REGISTERED.add(op_name)
    return True
