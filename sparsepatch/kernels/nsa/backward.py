"""Native Sparse Attention backward in Triton: gradients of `nsa.py`'s forward (same function as `nsa_reference`).

Forward being differentiated (per query row = (token t, query head h), queries at positions t + S - T):
    out = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa,    o_b = softmax_b(scale * q k_b^T) v_b
with branch b's keys: compressed k_cmp/v_cmp (B, n_c, Hk, D) (complete blocks ending at or before the query),
the selected blocks of `idx` (causal inside the local block) and the causal sliding window. The selection is a
discrete choice made from detached compressed probabilities in the reference (`torch.no_grad` around the
importance / top-k), so no gradient flows through it here either: `idx` is a constant of the backward.
Gradients of k_cmp/v_cmp are returned; autograd of the PyTorch pooling `compress_kv` carries them to k, v and
compress_weights. Gates g (B, T, Hq, 3) (or None = uniform 1/3, no gradient).

Per branch b with P = the branch's probabilities (recomputed from q, k and the saved LSE) and r_b = rowsum(dout *
o_b) (fp32, from the saved ungated branch outputs):
    dgates[..., b] = r_b
    dO_b = g_b * dout,  delta_b = rowsum(dO_b * o_b) = g_b * r_b
    dV += P^T dO_b = (g_b P)^T dout
    dS  = P * (dO_b V^T - delta_b) = g_b P * (dout V^T - r_b)
    dQ += scale * dS K,   dK += scale * dS^T Q
so the kernels only need dout, r (B, T, Hq, 3) and the gates: the gate multiplies P row-wise and no scaled copy of
dout is materialised. Scores use exp2 with scale * log2(e) folded in, as the forward; the saved LSE is in log2 units
(+inf for a row that sees nothing, so its probabilities are exactly 0).

Launches (one set per batch of equal-length sequences; varlen calls this once per sequence, as the forward):
  1. `_slc_bwd_kernel`  one program per (token, KV head), rows = the group's query heads (padded to >= 16 for
     tl.dot): first r = rowsum(dout * o_b) of its rows for the 3 branches -> R (B, T, Hq, 3) fp32 (= dgates; was
     a launch of its own, 2 ms at 64K, before session 5), then over its selected blocks -> dq_slc (fp32 scratch,
     plain store: the program owns those rows).
     Selected-branch dk/dv, two modes (BWD["slc_dkdv"]), both into zero-initialised fp32 (B, S, Hk, D) scratch:
     "list" (default): `_transpose_selection` (PyTorch sort of the indices) builds, per (batch, KV head, block j),
       the ascending list of tokens that selected j, cut into chunks; `_slc_dkdv_kernel` runs one program per
       chunk, gathers those tokens' q/dout rows, accumulates the block's dk/dv in registers and adds them with ONE
       fp32 atomic add per chunk. Chunks (not one program per block) because block 0 and every local block are
       selected by (nearly) all queries: a single program per block would serialise ~T tokens.
     "atomic": the per-token program above also forms its dk/dv blocks and adds them with fp32 `tl.atomic_add`
       (simplest; NSEL * BS * D atomic adds per (token, KV head) for each of dk and dv, contended on block 0 and
       the local blocks; ~34G atomic adds at T=32K, Hk=4, NSEL=16, BS=64, D=128).
     Either way dk/dv are not bitwise deterministic (fp32 atomics, order-dependent).
  2. `_dq_kernel`       query tiles (BT tokens x the G heads of one KV head, as the forward's tile kernels):
     compressed-branch and window-branch dq, plus the selected-branch scratch -> dq (q's dtype).
  3. `_swa_dkdv_kernel` one program per (BLOCK_N keys, KV head): loops over the query tiles whose window covers
     the keys, adds the selected-branch scratch -> dk, dv (k's / v's dtype).
  4. `_cmp_dkdv_kernel` one program per (BLOCK_N compressed blocks, KV head, query-range split): loops over the
     query tiles that see them -> dk_cmp, dv_cmp (splits summed by fp32 atomics when there are several).
GQA: the dK/dV programs fold the group's heads into the rows of their query tiles, so dk/dv come out already
summed over the group (no atomics across heads). Their steps (`_dkdv_step`) work on S^T (keys on the rows).
Runs under TRITON_INTERPRET=1 on CPU (fp16/fp32) and on CUDA (fp16/bf16).
"""
from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

from .reference import NSAParams

__all__ = ["nsa_backward", "BWD"]

LOG2E = 1.4426950408889634

# Launch settings (sm_90, bf16, D=128; tuned on an H100 at HQ64/H4, T=16K and 64K, see benchmarks/NOTES.md; the
# dK/dV tiles of session 5: 128 keys x 64 rows on 8 warps for the window and compressed kernels, spill-free loops).
# Per kernel: *_rows = query-tile rows (BT tokens x GP heads), *_block_n = key-tile width, warps_* / stages_*.
#   dq_*   : `_dq_kernel` (compressed + window dq on query tiles)
#   swa_*  : `_swa_dkdv_kernel` (window dk/dv on key tiles)
#   cmp_*  : `_cmp_dkdv_kernel`; cmp_programs / cmp_min_tiles: it splits its query range until about cmp_programs
#            programs run, each keeping at least cmp_min_tiles query tiles (parts summed by fp32 atomics)
#   slc_*  : `_slc_bwd_kernel` (selected dq per token; warps_slc / stages_slc) and, in "list" mode,
#            `_slc_dkdv_kernel` (slc_rows query rows per step, chunks of <= slc_chunk_rows / GP tokens,
#            warps_slc_dkdv / stages_slc_dkdv)
# slc_dkdv: how the selected branch's dk/dv are formed, "list" (transposed selection, one atomic add per chunk) or
# "atomic" (per token and selected block; simplest, ~NSEL * BS * D fp32 atomic adds per (token, KV head) for each
# of dk and dv, contended on block 0 and the local blocks).
BWD = dict(dq_rows=128, dq_block_n=64, warps_dq=8, stages_dq=3,
           swa_rows=64, swa_block_n=128, warps_swa=8, stages_swa=3,
           cmp_rows=64, cmp_block_n=128, warps_cmp=8, stages_cmp=2, cmp_programs=1056, cmp_min_tiles=4,
           warps_slc=2, stages_slc=2,
           slc_dkdv="list", slc_chunk_rows=8192, slc_rows=32, warps_slc_dkdv=4, stages_slc_dkdv=2)
# Overrides as JSON in SPARSEPATCH_NSA_BWD (tuning runs: the GPU tests check the settings a sweep picked).
if os.environ.get("SPARSEPATCH_NSA_BWD"):
    BWD.update(json.loads(os.environ["SPARSEPATCH_NSA_BWD"]))

# Per-stage timing hook (benchmarks): set to a list and nsa_backward appends (stage, start, end) CUDA events.
PROFILE = None


class _Stages:
    def __init__(self, dev):
        self.on = PROFILE is not None and dev.type == "cuda"
        self.last = None
        self.mark(None)

    def mark(self, name):
        if not self.on:
            return
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        if self.last is not None:
            PROFILE.append((name, self.last, e))
        self.last = e


# ---------------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _branch_rows(Q, DO, LSE, R, GATES, b64, tok64, head, row_ok, offs_d, T, Hq,
                 sqb, sqs, sqh, sdb, sds, sdh, sgb, sgs, sgh, sgc, BRANCH: tl.constexpr, HAS_GATES: tl.constexpr):
    """The (token, query head) rows of one dK/dV step of branch BRANCH (0 compressed, 1 selected, 2 window):
    q, dO (q's dtype), lse (log2 units, +inf on masked rows), the branch's delta term r and its gate (fp32; 1/3
    without gates, 0 on masked rows)."""
    q = tl.load(Q + b64 * sqb + tok64[:, None] * sqs + head[:, None] * sqh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b64 * sdb + tok64[:, None] * sds + head[:, None] * sdh + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0).to(q.dtype)
    row = (b64 * T + tok64) * Hq + head
    lse = tl.load(LSE + row, mask=row_ok, other=float("inf"))
    r = tl.load(R + row * 3 + BRANCH, mask=row_ok, other=0.0)
    if HAS_GATES:
        gate = tl.load(GATES + b64 * sgb + tok64 * sgs + head * sgh + BRANCH * sgc, mask=row_ok,
                       other=0.0).to(tl.float32)
    else:
        gate = tl.where(row_ok, 1.0 / 3.0, 0.0)
    return q, do, lse, r, gate


@triton.jit
def _dkdv_step(q, do, lse, r, gate, k, v, ok, qk_scale, dk, dv):
    """dK (unscaled) and dV of one key tile (k, v: (N, D)) accumulated over these query rows (q, do: (M, D));
    ok (N, M): the (key, row) pairs the branch attends (masked rows included as False).
    Transposed form: S^T = K Q^T and dP^T = V dO^T put the keys on the rows, so P^T and dS^T come out of the
    matrix unit already as the register A operands of the dV and dK products (the (rows, keys) form transposes
    both through shared memory on every step; session 5: 29 -> 25 ms compressed dK/dV at 64K with 128-key tiles)."""
    st = tl.dot(k, tl.trans(q)) * qk_scale
    pgt = tl.where(ok, tl.math.exp2(st - lse[None, :]), 0.0) * gate[None, :]
    dv = tl.dot(pgt.to(do.dtype), do, dv)
    dpt = tl.dot(v, tl.trans(do))
    dst = pgt * (dpt - r[None, :])
    dk = tl.dot(dst.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _slc_bwd_kernel(Q, K, V, DO, IDX, GATES, LSE, R, DQS, DKS, DVS, BO_C, BO_S, BO_W,
                    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, s_ib, s_it, s_ih,
                    sgb, sgs, sgh, sgc,
                    T, S, q_off, Hk, G, qk_scale, scale,
                    BS: tl.constexpr, BSP: tl.constexpr, NSEL: tl.constexpr, HEAD_DIM: tl.constexpr,
                    GP: tl.constexpr, HAS_GATES: tl.constexpr, DKDV: tl.constexpr, STAGES: tl.constexpr):
    """Selected branch, one program per (token t, batch x KV head). DQS (B, T, Hq, D) fp32 is stored; with DKDV
    (the "atomic" mode) DKS/DVS (B, S, Hk, D) fp32 (zero-initialised) also receive this token's dk/dv by atomic
    adds, else `_slc_dkdv_kernel` computes them. LSE: (B, T, Hq) log2 units of this branch. The program also
    writes, for its rows, R[row, br] = rowsum(dout * o_br) (fp32, R (B, T, Hq, 3)) of the three branches from
    BO_C/BO_S/BO_W (B, T, Hq, D) contiguous: the launches after it read R."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hk
    hk = bh % Hk
    b64 = b.to(tl.int64)
    t64 = t.to(tl.int64)
    Hq = Hk * G
    g = tl.arange(0, GP)
    g_ok = g < G
    head = hk * G + g
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BSP)
    qpos = t + q_off
    q = tl.load(Q + b64 * sqb + t64 * sqs + head[:, None] * sqh + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    do = tl.load(DO + b64 * sdb + t64 * sds + head[:, None] * sdh + offs_d[None, :], mask=g_ok[:, None],
                 other=0.0).to(q.dtype)
    row = (b64 * T + t64) * Hq + head
    lse = tl.load(LSE + row, mask=g_ok, other=float("inf"))
    # r = rowsum(dout * o_b) per branch (also the gate gradients); this branch's r is used below
    boff = row[:, None] * HEAD_DIM + offs_d[None, :]
    dof = do.to(tl.float32)
    o_b = tl.load(BO_C + boff, mask=g_ok[:, None], other=0.0).to(tl.float32)
    tl.store(R + row * 3, tl.sum(dof * o_b, 1), mask=g_ok)
    o_b = tl.load(BO_W + boff, mask=g_ok[:, None], other=0.0).to(tl.float32)
    tl.store(R + row * 3 + 2, tl.sum(dof * o_b, 1), mask=g_ok)
    o_b = tl.load(BO_S + boff, mask=g_ok[:, None], other=0.0).to(tl.float32)
    r = tl.sum(dof * o_b, 1)
    tl.store(R + row * 3 + 1, r, mask=g_ok)
    if HAS_GATES:   # gate of branch 1 per row (fp32); uniform 1/3 without gates
        gs = tl.load(GATES + b64 * sgb + t64 * sgs + head * sgh + sgc, mask=g_ok, other=0.0).to(tl.float32)
    else:
        gs = tl.where(g_ok, 1.0 / 3.0, 0.0)
    kbase = K + b64 * skb + hk * skh
    vbase = V + b64 * svb + hk * svh
    ibase = IDX + b64 * s_ib + t64 * s_it + hk * s_ih
    dq = tl.zeros([GP, HEAD_DIM], tl.float32)
    for i in tl.range(0, NSEL, num_stages=STAGES):
        jb = tl.load(ibase + i)
        key = tl.maximum(jb, 0) * BS + offs_n
        lim = S * (jb >= 0).to(tl.int32)                       # padding entry (-1): every key masked
        ok = (offs_n < BS) & (key < lim) & (key <= qpos)
        key64 = key[:, None].to(tl.int64)
        k = tl.load(kbase + key64 * sks + offs_d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(vbase + key64 * svs + offs_d[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        p = tl.where(ok[None, :] & g_ok[:, None], tl.math.exp2(s - lse[:, None]), 0.0)
        pg = p * gs[:, None]                                    # g_slc P (rows)
        dp = tl.dot(do, tl.trans(v))
        ds = pg * (dp - r[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
        if DKDV:
            dv_blk = tl.dot(tl.trans(pg).to(do.dtype), do)      # (BSP, D), summed over the group's heads
            dk_blk = tl.dot(tl.trans(ds).to(q.dtype), q) * scale
            kv_off = ((b64 * S + key64) * Hk + hk) * HEAD_DIM + offs_d[None, :]
            tl.atomic_add(DKS + kv_off, dk_blk, mask=ok[:, None], sem="relaxed")
            tl.atomic_add(DVS + kv_off, dv_blk, mask=ok[:, None], sem="relaxed")
    tl.store(DQS + row[:, None] * HEAD_DIM + offs_d[None, :], dq * scale, mask=g_ok[:, None])


@triton.jit
def _slc_dkdv_kernel(Q, K, V, DO, GATES, LSE, R, DKS, DVS, CH_SEG, CH_START, CH_LEN, TOKS,
                     sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, sgb, sgs, sgh, sgc,
                     T, S, q_off, Hk, G, n_b, qk_scale, scale,
                     BS: tl.constexpr, BSP: tl.constexpr, HEAD_DIM: tl.constexpr, GP: tl.constexpr,
                     BT: tl.constexpr, HAS_GATES: tl.constexpr):
    """Selected-branch dk/dv through the transposed selection ("list" mode): one program per chunk of the token
    list of one (batch, KV head, selection block j) segment. TOKS holds, per segment, the tokens that selected the
    block (ascending); chunk = (segment CH_SEG, first entry CH_START, length CH_LEN). The program gathers those
    tokens' q / dout rows (BT tokens x the G heads per step), accumulates the block's dk/dv in registers and adds
    them once into DKS/DVS (fp32, zeroed): one atomic add per chunk instead of one per token."""
    pid = tl.program_id(0)
    seg = tl.load(CH_SEG + pid)
    start = tl.load(CH_START + pid).to(tl.int64)
    n = tl.load(CH_LEN + pid)
    b64 = (seg // (Hk * n_b)).to(tl.int64)
    hk = (seg // n_b) % Hk
    j = seg % n_b
    Hq = Hk * G
    M: tl.constexpr = BT * GP
    offs_n = tl.arange(0, BSP)
    offs_d = tl.arange(0, HEAD_DIM)
    key = j * BS + offs_n
    key_ok = (offs_n < BS) & (key < S)
    key64 = key.to(tl.int64)
    k = tl.load(K + b64 * skb + key64[:, None] * sks + hk * skh + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    v = tl.load(V + b64 * svb + key64[:, None] * svs + hk * svh + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    dk = tl.zeros([BSP, HEAD_DIM], tl.float32)
    dv = tl.zeros([BSP, HEAD_DIM], tl.float32)
    rr = tl.arange(0, M)
    g = rr % GP
    head = hk * G + g
    for i0 in range(0, n, BT):
        e = i0 + rr // GP
        e_ok = e < n
        tok = tl.load(TOKS + start + e, mask=e_ok, other=0)
        row_ok = e_ok & (g < G)
        qpos = tok + q_off
        q, do, lse, r, gate = _branch_rows(Q, DO, LSE, R, GATES, b64, tok.to(tl.int64), head, row_ok, offs_d, T, Hq,
                                           sqb, sqs, sqh, sdb, sds, sdh, sgb, sgs, sgh, sgc, 1, HAS_GATES)
        ok = (key[:, None] <= qpos[None, :]) & key_ok[:, None] & row_ok[None, :]
        dk, dv = _dkdv_step(q, do, lse, r, gate, k, v, ok, qk_scale, dk, dv)
    off = ((b64 * S + key64[:, None]) * Hk + hk) * HEAD_DIM + offs_d[None, :]
    tl.atomic_add(DKS + off, dk * scale, mask=key_ok[:, None], sem="relaxed")
    tl.atomic_add(DVS + off, dv, mask=key_ok[:, None], sem="relaxed")


@triton.jit
def _dq_kernel(Q, K, V, KC, VC, DO, GATES, LSE_C, LSE_W, R, DQS, DQ,
               sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, scb, scs, sch, sdb, sds, sdh, sgb, sgs, sgh, sgc,
               T, n_c, q_off, Hk, G, qk_scale, scale, window,
               CB: tl.constexpr, CS: tl.constexpr, HEAD_DIM: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr,
               BLOCK_N: tl.constexpr, HAS_GATES: tl.constexpr):
    """dq of the compressed and window branches for a tile of BT tokens x the G heads of one KV head, plus the
    selected branch's DQS -> DQ (B, T, Hq, D) contiguous, q's dtype."""
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hk
    hk = bh % Hk
    b64 = b.to(tl.int64)
    Hq = Hk * G
    M: tl.constexpr = BT * GP
    t0 = pid_t * BT
    rr = tl.arange(0, M)
    tok = t0 + rr // GP
    g = rr % GP
    row_ok = (tok < T) & (g < G)
    head = hk * G + g
    qpos = tok + q_off
    tok64 = tok.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + b64 * sqb + tok64[:, None] * sqs + head[:, None] * sqh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b64 * sdb + tok64[:, None] * sds + head[:, None] * sdh + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0).to(q.dtype)
    row = (b64 * T + tok64) * Hq + head
    goff = b64 * sgb + tok64 * sgs + head * sgh
    maxpos = tl.minimum(t0 + BT, T) - 1 + q_off

    # One fp32 accumulator for both branches (register pressure): each branch's gate is folded into its dS rows.
    dq = tl.zeros([M, HEAD_DIM], tl.float32)

    # compressed branch: blocks c < nvis(row) (complete and ending at or before the query)
    if HAS_GATES:   # gate of branch 0 per row (fp32); uniform 1/3 without gates
        gc = tl.load(GATES + goff, mask=row_ok, other=0.0).to(tl.float32)
    else:
        gc = tl.where(row_ok, 1.0 / 3.0, 0.0)
    lse = tl.load(LSE_C + row, mask=row_ok, other=float("inf"))
    r = tl.load(R + row * 3, mask=row_ok, other=0.0)
    nvis = tl.minimum(tl.where(qpos + 1 >= CB, (qpos + 1 - CB) // CS + 1, 0), n_c)
    hi = tl.minimum(tl.where(maxpos + 1 >= CB, (maxpos + 1 - CB) // CS + 1, 0), n_c)
    kcb = KC + b64 * scb + hk * sch
    vcb = VC + b64 * scb + hk * sch
    for start in range(0, hi, BLOCK_N):
        c = start + offs_n
        c_ok = c < hi
        kc = tl.load(kcb + c[:, None].to(tl.int64) * scs + offs_d[None, :], mask=c_ok[:, None], other=0.0)
        vc = tl.load(vcb + c[:, None].to(tl.int64) * scs + offs_d[None, :], mask=c_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(kc)) * qk_scale
        pg = tl.where(c[None, :] < nvis[:, None], tl.math.exp2(s - lse[:, None]), 0.0) * gc[:, None]
        dp = tl.dot(do, tl.trans(vc))
        ds = pg * (dp - r[:, None])
        dq = tl.dot(ds.to(kc.dtype), kc, dq)

    # sliding window: keys (qpos - window, qpos]
    if HAS_GATES:
        gw = tl.load(GATES + goff + 2 * sgc, mask=row_ok, other=0.0).to(tl.float32)
    else:
        gw = tl.where(row_ok, 1.0 / 3.0, 0.0)
    lse = tl.load(LSE_W + row, mask=row_ok, other=float("inf"))
    r = tl.load(R + row * 3 + 2, mask=row_ok, other=0.0)
    lo = tl.maximum(t0 + q_off - window + 1, 0) // BLOCK_N * BLOCK_N
    kbase = K + b64 * skb + hk * skh
    vbase = V + b64 * svb + hk * svh
    for start in range(lo, maxpos + 1, BLOCK_N):
        key = start + offs_n
        kv_ok = key <= maxpos
        k = tl.load(kbase + key[:, None].to(tl.int64) * sks + offs_d[None, :], mask=kv_ok[:, None], other=0.0)
        v = tl.load(vbase + key[:, None].to(tl.int64) * svs + offs_d[None, :], mask=kv_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        ok = (key[None, :] <= qpos[:, None]) & (key[None, :] > qpos[:, None] - window)
        pg = tl.where(ok, tl.math.exp2(s - lse[:, None]), 0.0) * gw[:, None]
        dp = tl.dot(do, tl.trans(v))
        ds = pg * (dp - r[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)

    dq_off = row[:, None] * HEAD_DIM + offs_d[None, :]
    dq = dq * scale + tl.load(DQS + dq_off, mask=row_ok[:, None], other=0.0)
    tl.store(DQ + dq_off, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _swa_dkdv_kernel(Q, K, V, DO, GATES, LSE, R, DKS, DVS, DK, DV,
                     sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, sgb, sgs, sgh, sgc,
                     T, S, q_off, Hk, G, qk_scale, scale, window,
                     HEAD_DIM: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_GATES: tl.constexpr):
    """Window-branch dk/dv of BLOCK_N keys of one KV head, plus the selected branch's DKS/DVS -> DK/DV
    (B, S, Hk, D) contiguous. Query positions that see key n: n <= qpos <= n + window - 1."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hk
    hk = bh % Hk
    b64 = b.to(tl.int64)
    Hq = Hk * G
    M: tl.constexpr = BT * GP
    n0 = pid_n * BLOCK_N
    key = n0 + tl.arange(0, BLOCK_N)
    key_ok = key < S
    key64 = key.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(K + b64 * skb + key64[:, None] * sks + hk * skh + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    v = tl.load(V + b64 * svb + key64[:, None] * svs + hk * svh + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    tok_lo = tl.maximum(n0 - q_off, 0)
    tok_hi = tl.minimum(n0 + BLOCK_N - 1 + window - q_off, T)    # exclusive: last query pos n0+BLOCK_N-2+window
    rr = tl.arange(0, M)
    g = rr % GP
    head = hk * G + g
    for t0 in range(tok_lo, tok_hi, BT):
        tok = t0 + rr // GP
        row_ok = (tok < T) & (g < G)
        qpos = tok + q_off
        q, do, lse, r, gate = _branch_rows(Q, DO, LSE, R, GATES, b64, tok.to(tl.int64), head, row_ok, offs_d, T, Hq,
                                           sqb, sqs, sqh, sdb, sds, sdh, sgb, sgs, sgh, sgc, 2, HAS_GATES)
        ok = (key[:, None] <= qpos[None, :]) & (key[:, None] > qpos[None, :] - window) & row_ok[None, :]
        dk, dv = _dkdv_step(q, do, lse, r, gate, k, v, ok, qk_scale, dk, dv)
    off = ((b64 * S + key64[:, None]) * Hk + hk) * HEAD_DIM + offs_d[None, :]
    dk = dk * scale + tl.load(DKS + off, mask=key_ok[:, None], other=0.0)
    dv = dv + tl.load(DVS + off, mask=key_ok[:, None], other=0.0)
    tl.store(DK + off, dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + off, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


@triton.jit
def _cmp_dkdv_kernel(Q, KC, VC, DO, GATES, LSE, R, DKC, DVC,
                     sqb, sqs, sqh, scb, scs, sch, sdb, sds, sdh, sgb, sgs, sgh, sgc,
                     T, n_c, q_off, Hk, G, qk_scale, scale, NSPLIT,
                     CB: tl.constexpr, CS: tl.constexpr, HEAD_DIM: tl.constexpr, GP: tl.constexpr,
                     BT: tl.constexpr, BLOCK_N: tl.constexpr, HAS_GATES: tl.constexpr, ATOMIC: tl.constexpr):
    """Compressed-branch dk_cmp/dv_cmp of BLOCK_N compressed blocks of one KV head -> DKC/DVC (B, n_c, Hk, D)
    contiguous. Block c is seen by query positions >= c * CS + CB - 1, i.e. by every later query: the program's
    query range is split in NSPLIT contiguous parts (grid axis 2) so that long sequences with few KV heads still
    fill the GPU; with NSPLIT > 1 (ATOMIC) the parts are summed by fp32 atomic adds into zeroed DKC/DVC."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    sp = tl.program_id(2)
    b = bh // Hk
    hk = bh % Hk
    b64 = b.to(tl.int64)
    Hq = Hk * G
    M: tl.constexpr = BT * GP
    c0 = pid_n * BLOCK_N
    c = c0 + tl.arange(0, BLOCK_N)
    c_ok = c < n_c
    c64 = c.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    kc = tl.load(KC + b64 * scb + c64[:, None] * scs + hk * sch + offs_d[None, :], mask=c_ok[:, None], other=0.0)
    vc = tl.load(VC + b64 * scb + c64[:, None] * scs + hk * sch + offs_d[None, :], mask=c_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    tok_lo = tl.maximum(c0 * CS + CB - 1 - q_off, 0)
    per = tl.cdiv(tl.cdiv(tl.maximum(T - tok_lo, 0), BT), NSPLIT) * BT      # tokens per split
    t_begin = tok_lo + sp * per
    t_end = tl.minimum(t_begin + per, T)
    rr = tl.arange(0, M)
    g = rr % GP
    head = hk * G + g
    for t0 in range(t_begin, t_end, BT):
        tok = t0 + rr // GP
        row_ok = (tok < T) & (g < G)
        qpos = tok + q_off
        q, do, lse, r, gate = _branch_rows(Q, DO, LSE, R, GATES, b64, tok.to(tl.int64), head, row_ok, offs_d, T, Hq,
                                           sqb, sqs, sqh, sdb, sds, sdh, sgb, sgs, sgh, sgc, 0, HAS_GATES)
        nvis = tl.minimum(tl.where(qpos + 1 >= CB, (qpos + 1 - CB) // CS + 1, 0), n_c)
        ok = (c[:, None] < nvis[None, :]) & row_ok[None, :]
        dk, dv = _dkdv_step(q, do, lse, r, gate, kc, vc, ok, qk_scale, dk, dv)
    off = ((b64 * n_c + c64[:, None]) * Hk + hk) * HEAD_DIM + offs_d[None, :]
    if ATOMIC:
        tl.atomic_add(DKC + off, dk * scale, mask=c_ok[:, None], sem="relaxed")
        tl.atomic_add(DVC + off, dv, mask=c_ok[:, None], sem="relaxed")
    else:
        tl.store(DKC + off, (dk * scale).to(DKC.dtype.element_ty), mask=c_ok[:, None])
        tl.store(DVC + off, dv.to(DVC.dtype.element_ty), mask=c_ok[:, None])


# ---------------------------------------------------------------------------------------------------------- host
def _gate_args(gates, fallback):
    """(tensor, strides b, t, h, branch) for the kernels; a dummy pointer and zero strides without gates."""
    if gates is None:
        return fallback, 0, 0, 0, 0
    return gates, gates.stride(0), gates.stride(1), gates.stride(2), gates.stride(3)


def _transpose_selection(idx, n_b: int, chunk: int):
    """Block -> tokens lists of the selection, cut into chunks of <= chunk tokens (PyTorch, on idx's device).

    idx int (B, T, Hk, NSEL), -1 padded. Segment id = (b * Hk + hk) * n_b + j. Returns int32 tensors
    (ch_seg, ch_start, ch_len) per chunk and toks (the tokens of every segment, ascending within a segment,
    segments in id order); ch_start indexes toks. One host sync (the number of chunks sizes the grid).
    """
    B, T, Hk, nsel = idx.shape
    dev = idx.device
    j = idx.long()
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(Hk, device=dev).view(1, 1, Hk, 1)
    seg = torch.where(j >= 0, (b * Hk + h) * n_b + j, B * Hk * n_b).flatten()
    # flattened order is (b, t, hk, slot): a stable sort by segment keeps each segment's tokens ascending
    order = torch.sort(seg, stable=True).indices
    nseg = B * Hk * n_b
    counts = torch.bincount(seg, minlength=nseg + 1)[:nseg]
    valid = int(counts.sum())
    toks = ((order[:valid] // (Hk * nsel)) % T).to(torch.int32)
    offs = torch.cumsum(counts, 0) - counts
    nch = (counts + chunk - 1) // chunk
    ch_seg = torch.repeat_interleave(torch.arange(nseg, device=dev), nch)
    first = torch.repeat_interleave(torch.cumsum(nch, 0) - nch, nch)
    i = torch.arange(ch_seg.numel(), device=dev) - first
    ch_start = offs[ch_seg] + i * chunk
    ch_len = torch.minimum(counts[ch_seg] - i * chunk, torch.full_like(ch_start, chunk))
    return ch_seg.to(torch.int32), ch_start.to(torch.int32), ch_len.to(torch.int32), toks


def nsa_backward(q, k, v, k_cmp, v_cmp, gates, idx, lse, branch_out, dout, scale, config):
    """Gradients of `nsa._forward` for one batch of equal-length sequences (queries = the last T of S positions).

    q (B, T, Hq, D); k, v (B, S, Hk, D); k_cmp, v_cmp (B, n_c, Hk, D); gates (B, T, Hq, 3) or None;
    idx int32 (B, T, Hk, num_selected) (the forward's selection, -1 padded); lse (3, B, T, Hq) fp32 (log2 units)
    and branch_out (3, B, T, Hq, D) as saved by `nsa._forward(save=True)`; dout (B, T, Hq, D); scale: softmax
    scale (natural units); config: NSAConfig. Unit stride on D for q, k, v, dout (other strides are free).
    Returns (dq, dk, dv, dk_cmp, dv_cmp, dgates) in the dtypes of q, k, v, k_cmp, v_cmp, gates (dgates None
    without gates).
    """
    B, T, Hq, D = q.shape
    S, Hk = k.shape[1], k.shape[2]
    G = Hq // Hk
    n_c = k_cmp.shape[1]
    bs, l, d, nsel = config.block_size, config.compress_block, config.compress_stride, config.num_selected
    q_off = S - T
    dev = q.device
    qk_scale = scale * LOG2E
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    branch_out = branch_out.contiguous()
    lse = lse.contiguous()
    GP = triton.next_power_of_2(G)
    C = BWD
    BT_Q, BN_Q = max(1, C["dq_rows"] // GP), C["dq_block_n"]             # dq kernel tiles
    BT_W, BN_W = max(1, C["swa_rows"] // GP), C["swa_block_n"]           # window dK/dV tiles
    BT_C, BN_C = max(1, C["cmp_rows"] // GP), C["cmp_block_n"]           # compressed dK/dV tiles
    HAS_GATES = gates is not None
    gt, sgb, sgs, sgh, sgc = _gate_args(gates, lse)
    qs = (q.stride(0), q.stride(1), q.stride(2))
    ks = (k.stride(0), k.stride(1), k.stride(2))
    vs = (v.stride(0), v.stride(1), v.stride(2))
    ds_ = (dout.stride(0), dout.stride(1), dout.stride(2))
    gs = (sgb, sgs, sgh, sgc)
    st = _Stages(dev)

    # 1. selected branch: r = rowsum(dout * o_b) of the 3 branches (= dgates, read by every later launch), dq
    #    scratch (stored, one program per token), dk/dv scratch (fp32, atomics: per token in "atomic" mode, per
    #    chunk of the transposed selection in "list" mode)
    r = torch.empty((B, T, Hq, 3), dtype=torch.float32, device=dev)
    dqs = torch.empty((B, T, Hq, D), dtype=torch.float32, device=dev)
    dks = torch.zeros((B, S, Hk, D), dtype=torch.float32, device=dev)
    dvs = torch.zeros((B, S, Hk, D), dtype=torch.float32, device=dev)
    st.mark("alloc")
    mode = C["slc_dkdv"]
    if mode not in ("list", "atomic"):
        raise ValueError(f"BWD['slc_dkdv'] must be 'list' or 'atomic', got {mode!r}")
    BSP = max(16, triton.next_power_of_2(bs))
    _slc_bwd_kernel[(T, B * Hk)](
        q, k, v, dout, idx, gt, lse[1], r, dqs, dks, dvs, branch_out[0], branch_out[1], branch_out[2],
        *qs, *ks, *vs, *ds_, idx.stride(0), idx.stride(1), idx.stride(2), *gs,
        T, S, q_off, Hk, G, qk_scale, scale,
        BS=bs, BSP=BSP, NSEL=nsel, HEAD_DIM=D, GP=max(16, GP), HAS_GATES=HAS_GATES, DKDV=mode == "atomic",
        STAGES=C["stages_slc"], num_warps=C["warps_slc"], num_stages=C["stages_slc"])
    st.mark("slc_dq")
    if mode == "list":
        n_b = triton.cdiv(S, bs)
        ch_seg, ch_start, ch_len, toks = _transpose_selection(idx, n_b, max(1, C["slc_chunk_rows"] // GP))
        st.mark("slc_sort")
        if ch_seg.numel():
            _slc_dkdv_kernel[(ch_seg.numel(),)](
                q, k, v, dout, gt, lse[1], r, dks, dvs, ch_seg, ch_start, ch_len, toks,
                *qs, *ks, *vs, *ds_, *gs,
                T, S, q_off, Hk, G, n_b, qk_scale, scale,
                BS=bs, BSP=BSP, HEAD_DIM=D, GP=GP, BT=max(1, C["slc_rows"] // GP), HAS_GATES=HAS_GATES,
                num_warps=C["warps_slc_dkdv"], num_stages=C["stages_slc_dkdv"])
        st.mark("slc_dkdv")

    # 3. dq: compressed + window branches on query tiles, plus the selected scratch
    kc = k_cmp.contiguous() if n_c else q.new_zeros((B, 1, Hk, D))
    vc = v_cmp.contiguous() if n_c else kc
    dq = torch.empty((B, T, Hq, D), dtype=q.dtype, device=dev)
    _dq_kernel[(triton.cdiv(T, BT_Q), B * Hk)](
        q, k, v, kc, vc, dout, gt, lse[0], lse[2], r, dqs, dq,
        *qs, *ks, *vs, kc.stride(0), kc.stride(1), kc.stride(2), *ds_, *gs,
        T, n_c, q_off, Hk, G, qk_scale, scale, config.window,
        CB=l, CS=d, HEAD_DIM=D, GP=GP, BT=BT_Q, BLOCK_N=BN_Q, HAS_GATES=HAS_GATES,
        num_warps=C["warps_dq"], num_stages=C["stages_dq"])
    st.mark("dq")

    # 4. dk, dv: window branch on key tiles, plus the selected scratch
    dk = torch.empty((B, S, Hk, D), dtype=k.dtype, device=dev)
    dv = torch.empty((B, S, Hk, D), dtype=v.dtype, device=dev)
    _swa_dkdv_kernel[(triton.cdiv(S, BN_W), B * Hk)](
        q, k, v, dout, gt, lse[2], r, dks, dvs, dk, dv,
        *qs, *ks, *vs, *ds_, *gs,
        T, S, q_off, Hk, G, qk_scale, scale, config.window,
        HEAD_DIM=D, GP=GP, BT=BT_W, BLOCK_N=BN_W, HAS_GATES=HAS_GATES,
        num_warps=C["warps_swa"], num_stages=C["stages_swa"])
    st.mark("swa_dkdv")

    # 5. dk_cmp, dv_cmp: split the query range when (compressed tiles x KV heads) alone would not fill the GPU
    progs = triton.cdiv(n_c, BN_C) * B * Hk
    nsplit = max(1, min(triton.cdiv(C["cmp_programs"], max(progs, 1)),
                        triton.cdiv(T, BT_C * C["cmp_min_tiles"])))
    atomic = nsplit > 1
    dt32 = torch.float32
    dkc = (torch.zeros if atomic else torch.empty)((B, n_c, Hk, D), dtype=dt32 if atomic else k_cmp.dtype,
                                                   device=dev)
    dvc = (torch.zeros if atomic else torch.empty)((B, n_c, Hk, D), dtype=dt32 if atomic else v_cmp.dtype,
                                                   device=dev)
    if n_c:
        _cmp_dkdv_kernel[(triton.cdiv(n_c, BN_C), B * Hk, nsplit)](
            q, kc, vc, dout, gt, lse[0], r, dkc, dvc,
            *qs, kc.stride(0), kc.stride(1), kc.stride(2), *ds_, *gs,
            T, n_c, q_off, Hk, G, qk_scale, scale, nsplit,
            CB=l, CS=d, HEAD_DIM=D, GP=GP, BT=BT_C, BLOCK_N=BN_C, HAS_GATES=HAS_GATES, ATOMIC=atomic,
            num_warps=C["warps_cmp"], num_stages=C["stages_cmp"])
    if atomic:
        dkc, dvc = dkc.to(k_cmp.dtype), dvc.to(v_cmp.dtype)
    dgates = r.to(gates.dtype) if HAS_GATES else None
    st.mark("cmp_dkdv")
    return dq, dk, dv, dkc, dvc, dgates


# ---------------------------------------------------------------------------------------------------------- op
@torch.library.custom_op("sparsepatch::nsa_bwd", mutates_args=())
def _nsa_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
             gates: torch.Tensor | None, idx: torch.Tensor, lse: torch.Tensor, branch_out: torch.Tensor,
             dout: torch.Tensor, scale: float, block_size: int, num_selected: int, window: int,
             compress_block: int, compress_stride: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 torch.Tensor, torch.Tensor, torch.Tensor]:
    """`nsa_backward` as a custom op (torch.compile traces it); dgates is an empty (0,) tensor without gates."""
    cfg = NSAParams(block_size, num_selected, window, compress_block, compress_stride)
    dq, dk, dv, dkc, dvc, dg = nsa_backward(q, k, v, k_cmp, v_cmp, gates, idx, lse, branch_out, dout, scale, cfg)
    return dq, dk, dv, dkc, dvc, (dg if dg is not None else q.new_empty((0,)))


@_nsa_bwd.register_fake
def _(q, k, v, k_cmp, v_cmp, gates, idx, lse, branch_out, dout, scale, block_size, num_selected, window,
      compress_block, compress_stride):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), k_cmp.new_empty(k_cmp.shape),
            v_cmp.new_empty(v_cmp.shape), gates.new_empty(gates.shape) if gates is not None else q.new_empty((0,)))
