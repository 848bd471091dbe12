"""Split-D dense flash attention (forward + backward) for head dims beyond 128, up to 1024 (FFPA-style tiling).

Layout: q (B, Sq, Hq, D), k/v (B, Sk, Hk, D), any strides with unit stride on D; out (B, Sq, Hq, D) contiguous;
LSE (B, Hq, Sq) fp32, natural log (-inf for rows that see no key). D a multiple of 32 in [32, 1024]; fp16/bf16 on
CUDA (fp32 only under TRITON_INTERPRET=1); GQA Hq % Hk == 0; causal is bottom-right aligned (query i sees keys
<= Sk - Sq + i), as in `reference.attention`; any Sq/Sk (rows/columns past the end are clamped on load, masked
in the scores, never stored).

Split-D, so no tile grows with D:
  * S = Q K^T is accumulated over D in BLOCK_D chunks; P @ V is produced per DC-wide output chunk.
  * The output is split into groups of NC chunks of DC columns (NC <= 8, held as separate named accumulators
    acc0..acc7 so D need not be a power of two: 320 = 5 x 64). A program owns one (q-tile, output group); with
    more than one group each group re-walks the k-tiles and recomputes S (cost: one QK^T per group).
  * Forward Q handling (config "q"), chosen per head dim from H100 sweeps (benchmarks/NOTES.md):
    "res" (D <= 384): the Q chunks are loaded once and stay in shared memory; the k-block loop pipelines K/V
    num_stages deep. "flat2" (D >= 512): one run-time loop over (k-block, D chunk) pairs loads a Q chunk and a K
    chunk per iteration through a qk_stages-deep ring that never drains between k-blocks; softmax and P @ V run on
    each k-block's last chunk. ("flat": the chunk loop per k-block, also flat2's masked tail. The unrolled "v1"
    mode and the "pin" / "tma" config switches were measured slower or neutral and deleted: benchmarks/NOTES.md.)
  * "mat" (D 768, 1024): materialised forward, `_lse_kernel` (row LSE, one QK^T pass over D), then per scratch chunk
    `_pds_kernel` writes the normalised P (QK^T again) and O = P @ V runs as one batched cuBLAS GEMM: 3 units of
    S^2 D matmul instead of the split forward's G + 1 (G = D / 256 output groups).
Backward (materialised P / dS, bounded scratch): `_prep_kernel` (delta = rowsum(dO * O) - dlse, lse2 = lse*log2e),
then per chunk of (batch, kv head) pairs and keys `_pds_kernel` computes S = Q K^T and dP = dO V^T over D in one
pipelined loop of BLOCK_D chunks and writes P and dS = P * (dP - delta) in the input dtype to a scratch of at most
cfg["scratch_mb"] MiB; dV = P^T dO, dK = scale dS^T Q, dQ = scale dS K are three batched cuBLAS GEMMs over it (GQA
query heads stacked along the rows, so no reduction pass). 5 units of S^2 D matmul, as credited; the split-D
flash backward it replaced (one dK/dV program per (k-block, output group), S/dP recomputed per group, dQ by fp32
atomics: 2G + 3 units) ran 5-19x slower at D 320-1024 (benchmarks/NOTES.md).

Ops: `sparsepatch::dense_splitd_fwd` (autograd attached with torch.library.register_autograd) and
`sparsepatch::dense_splitd_bwd`, both with fake impls. `attention` calls the op body directly in eager inference.

`attention_fp8` (head dim 64/128, inference): int8 Q K^T (or e4m3) and e4m3 P V with per-block q/k and
per-channel v scales, inputs quantized inside the call; see the section at the end of this file.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._common import empty_out_lse, key_range, store_delta_lse2
from .._common import interpret as _interpret
from .._common import set_tma_allocator
from .reference import LOG2E, check_qkv

__all__ = ["supports", "attention", "attention_backward", "FWD_CONFIGS", "BWD_CONFIGS", "fwd_config", "bwd_config",
           "MAX_HEAD_DIM"]

LN2 = 0.6931471805599453
MAX_HEAD_DIM = 1024
NC_MAX = 8    # forward output chunks per program

# Forward launch configs keyed by head dim (H100 sweeps in benchmarks/bench_dense.py, benchmarks/NOTES.md).
# BLOCK_D: QK^T contraction chunk; DC x NC: output columns per program (D / (DC * NC) groups); q: "res" keeps the
# Q chunks resident in shared memory so the k-block loop pipelines K/V num_stages deep (fits while
# ~(BLOCK_M + 2 * num_stages * BLOCK_N) * D * 2 B <= 227 KB), "flat" runs a pipelined loop over the D chunks of
# QK^T (Q and K chunk per iteration, qk_stages deep) and loads V per k-block.
_MAT = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_D=64, num_warps=8, num_stages=4, q="mat", lse_stages=4, lse_block_n=128,
            scratch_mb=512)
FWD_CONFIGS = {  # v2 runs 1-3 and v3 runs 1-2 sweeps (benchmarks/NOTES.md): TFLOP/s at B1 H48 S8192 fp16
    # 128 rows per program (two warpgroups of m64) with 64-column output chunks (v3 run 3 sweep): D256 472 vs 238
    # (generic M64), D320 at 3 K/V stages 407 vs 347 at 2 (238 for M64 N64), D384 383 vs 212 (M64 DC128).
    256: dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=128, DC=64, NC=4, num_warps=8, num_stages=2, q="res"),
    320: dict(BLOCK_M=128, BLOCK_N=32, BLOCK_D=64, DC=64, NC=5, num_warps=8, num_stages=3, q="res"),
    384: dict(BLOCK_M=128, BLOCK_N=32, BLOCK_D=64, DC=64, NC=6, num_warps=8, num_stages=2, q="res"),
    512: dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=128, DC=256, NC=1, num_warps=8, num_stages=1, q="flat2",
              qk_stages=3),  # 246-260 (mat 250)
    # Materialised: row LSE pass, normalised P per scratch chunk, O = P V by cuBLAS (v3 run 2: flat2 W256 196 /
    # 152 at D 768 / 1024).
    768: dict(_MAT),  # 288
    1024: dict(_MAT),  # 292-303
}
BWD_CONFIGS = {}  # per head dim overrides of bwd_config


def _pow2_divisor(D: int, cap: int) -> int:
    """Largest power of two <= cap dividing D (D is a multiple of 32)."""
    b = cap
    while D % b:
        b //= 2
    return b


def fwd_config(D: int, Sq: int = 1 << 30) -> dict:
    """Forward launch config for head dim D (table entry, else a generic one of the same families)."""
    cfg = FWD_CONFIGS.get(D)
    if cfg is None:
        bd = _pow2_divisor(D, 128)
        if D <= 384 and D // bd <= 8:
            # Resident Q (64 x D) + num_stages (K, V) blocks: (64 + 4 * BLOCK_N) * D * 2 B <= ~227 KB.
            dc = _pow2_divisor(D, 64)
            bn, st = (64, 2) if D <= 352 else (32, 3)
            cfg = dict(BLOCK_M=64, BLOCK_N=bn, BLOCK_D=bd, DC=dc, NC=-(-D // dc) if D // dc <= NC_MAX else NC_MAX,
                       num_warps=8 if D > 128 else 4, num_stages=st, q="res")
        else:
            # Flat (k-block, chunk) loop, 128 rows, 256 output columns per program (D / 256 groups).
            dc = _pow2_divisor(D, 256)
            cfg = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=bd, DC=dc, NC=max(1, 256 // dc), num_warps=8, num_stages=1,
                       q="flat2", qk_stages=3)
    cfg = dict(cfg)
    if _interpret():
        cfg.update(BLOCK_M=16 if Sq <= 16 else 32, BLOCK_N=16)
    return cfg


def bwd_config(D: int) -> dict:
    """Backward launch config: `_pds_kernel` tile (BLOCK_M rows x BLOCK_N keys, BLOCK_D contraction chunk) and the
    P / dS scratch budget (scratch_mb)."""
    cfg = BWD_CONFIGS.get(D)
    if cfg is None:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_D=_pow2_divisor(D, 64), num_warps=8, num_stages=3, scratch_mb=512)
    cfg = dict(cfg)
    if _interpret():
        cfg.update(BLOCK_M=16, BLOCK_N=16)
    return cfg


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _rows_desc(base, S, D, stride_s, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, USE_TMA: tl.constexpr):
    """The (S, D) row-major view at `base` (unit column stride): a TMA descriptor with (BLOCK_R, BLOCK_C) boxes, or
    `base` itself for the pointer-load path (`_ld`)."""
    if USE_TMA:
        return tl.make_tensor_descriptor(base, shape=[S, D], strides=[stride_s, 1], block_shape=[BLOCK_R, BLOCK_C])
    else:
        return base


@triton.jit
def _ld(desc, base, row0, rows, stride, d0, offs_d, D, MASK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """(len(rows), len(offs_d)) tile at rows row0.., columns d0 + offs_d. TMA: the descriptor's block, zero-filled
    out of bounds; else pointers with `rows` already clamped in range (no materialised pointer tensors with TMA,
    which matters: loop-invariant Q pointers hoisted by the compiler cost ~32 registers per chunk)."""
    if USE_TMA:
        return desc.load([row0, d0])
    cols = d0 + offs_d
    ptrs = base + rows[:, None] * stride + cols[None, :]
    if MASK_D:
        x = tl.load(ptrs, mask=(cols < D)[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _pv(acc, alpha, p, v_desc, v_base, start_n, cols, stride_vs, d0, offs_c, D, MASK_D: tl.constexpr,
        USE_TMA: tl.constexpr):
    v = _ld(v_desc, v_base, start_n, cols, stride_vs, d0, offs_c, D, MASK_D, USE_TMA)
    return tl.dot(p.to(v.dtype), v, acc * alpha[:, None])


@triton.jit
def _qk(s, q, k_desc, k_base, start_n, cols_ld, stride_ks, d0, offs_bd, D, USE_TMA: tl.constexpr):
    k = _ld(k_desc, k_base, start_n, cols_ld, stride_ks, d0, offs_bd, D, False, USE_TMA)
    return tl.dot(q, tl.trans(k), s)


@triton.jit
def _fwd_step(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, l_i, m_i, q0, q1, q2, q3, q4, q5, q6, q7,
              q_desc, k_desc, v_desc, q_base, k_base, v_base, start_m, rows, rows_ld,
              start_n, offs_n, offs_bd, offs_c, Sk, D, d_lo, causal_off, qk_scale, stride_qs, stride_ks, stride_vs,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NKD: tl.constexpr,
              DC: tl.constexpr, NC: tl.constexpr, MASK_D: tl.constexpr, MASK_N: tl.constexpr,
              CAUSAL: tl.constexpr, USE_TMA: tl.constexpr, QMODE: tl.constexpr, QK_STAGES: tl.constexpr):
    cols = start_n + offs_n
    if MASK_N:
        cols_ld = tl.minimum(cols, Sk - 1)
    else:
        cols_ld = cols
    # S = Q K^T over D in BLOCK_D chunks. QMODE 1: the Q chunks q0..q{NKD-1} were loaded once per program (kept
    # in shared memory), only K chunks stream, so the k-block loop pipelines one (K, V) set per stage.
    # QMODE 2: a run-time loop over the chunks (Q and K chunk per iteration), pipelined QK_STAGES deep on its own.
    if QMODE == 1:
        s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        s = _qk(s, q0, k_desc, k_base, start_n, cols_ld, stride_ks, 0, offs_bd, D, USE_TMA)
        if NKD > 1:
            s = _qk(s, q1, k_desc, k_base, start_n, cols_ld, stride_ks, BLOCK_D, offs_bd, D, USE_TMA)
        if NKD > 2:
            s = _qk(s, q2, k_desc, k_base, start_n, cols_ld, stride_ks, 2 * BLOCK_D, offs_bd, D, USE_TMA)
        if NKD > 3:
            s = _qk(s, q3, k_desc, k_base, start_n, cols_ld, stride_ks, 3 * BLOCK_D, offs_bd, D, USE_TMA)
        if NKD > 4:
            s = _qk(s, q4, k_desc, k_base, start_n, cols_ld, stride_ks, 4 * BLOCK_D, offs_bd, D, USE_TMA)
        if NKD > 5:
            s = _qk(s, q5, k_desc, k_base, start_n, cols_ld, stride_ks, 5 * BLOCK_D, offs_bd, D, USE_TMA)
        if NKD > 6:
            s = _qk(s, q6, k_desc, k_base, start_n, cols_ld, stride_ks, 6 * BLOCK_D, offs_bd, D, USE_TMA)
        if NKD > 7:
            s = _qk(s, q7, k_desc, k_base, start_n, cols_ld, stride_ks, 7 * BLOCK_D, offs_bd, D, USE_TMA)
    else:
        s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kd in tl.range(0, NKD, num_stages=QK_STAGES):
            q = _ld(q_desc, q_base, start_m, rows_ld, stride_qs, kd * BLOCK_D, offs_bd, D, False, USE_TMA)
            s = _qk(s, q, k_desc, k_base, start_n, cols_ld, stride_ks, kd * BLOCK_D, offs_bd, D, USE_TMA)
    return _softmax_pv(s, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, l_i, m_i, v_desc, v_base, rows, start_n,
                       cols, cols_ld, Sk, D, d_lo, causal_off, qk_scale, stride_vs, offs_c, DC, NC, MASK_D, MASK_N, CAUSAL,
                       USE_TMA)


@triton.jit
def _softmax_pv(s, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, l_i, m_i, v_desc, v_base, rows, start_n, cols,
                cols_ld, Sk,
                D, d_lo, causal_off, qk_scale, stride_vs, offs_c, DC: tl.constexpr, NC: tl.constexpr,
                MASK_D: tl.constexpr, MASK_N: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr):
    """Online-softmax update with the raw scores s of one k-block, then acc_c = acc_c * alpha + P @ V[:, chunk c]."""
    if MASK_N:
        valid = (cols < Sk)[None, :]
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None] + causal_off)
        s = tl.where(valid, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = m_new
        p = tl.math.exp2(s * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc0 = _pv(acc0, alpha, p, v_desc, v_base, start_n, cols_ld, stride_vs, d_lo, offs_c, D, MASK_D, USE_TMA)
    if NC > 1:
        acc1 = _pv(acc1, alpha, p, v_desc, v_base, start_n, cols_ld, stride_vs, d_lo + DC, offs_c, D, MASK_D, USE_TMA)
    if NC > 2:
        acc2 = _pv(acc2, alpha, p, v_desc, v_base, start_n, cols_ld, stride_vs, d_lo + 2 * DC, offs_c, D, MASK_D, USE_TMA)
    if NC > 3:
        acc3 = _pv(acc3, alpha, p, v_desc, v_base, start_n, cols_ld, stride_vs, d_lo + 3 * DC, offs_c, D, MASK_D, USE_TMA)
    if NC > 4:
        acc4 = _pv(acc4, alpha, p, v_desc, v_base, start_n, cols_ld, stride_vs, d_lo + 4 * DC, offs_c, D, MASK_D, USE_TMA)
    if NC > 5:
        acc5 = _pv(acc5, alpha, p, v_desc, v_base, start_n, cols_ld, stride_vs, d_lo + 5 * DC, offs_c, D, MASK_D, USE_TMA)
    if NC > 6:
        acc6 = _pv(acc6, alpha, p, v_desc, v_base, start_n, cols_ld, stride_vs, d_lo + 6 * DC, offs_c, D, MASK_D, USE_TMA)
    if NC > 7:
        acc7 = _pv(acc7, alpha, p, v_desc, v_base, start_n, cols_ld, stride_vs, d_lo + 7 * DC, offs_c, D, MASK_D, USE_TMA)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, l_i, m_new


@triton.jit
def _st(o_base, acc, inv_l, rows, row_ok, stride_os, d0, offs_c, D, MASK_D: tl.constexpr):
    cols = d0 + offs_c
    ptrs = o_base + rows[:, None] * stride_os + cols[None, :]
    mask = row_ok[:, None]
    if MASK_D:
        mask = mask & (cols < D)[None, :]
    tl.store(ptrs, (acc * inv_l[:, None]).to(o_base.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE,
                stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                stride_ob, stride_os, stride_oh, Sq, Sk, Hq, n_rep, D, qk_scale, causal_off,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NKD: tl.constexpr,
                DC: tl.constexpr, NC: tl.constexpr, MASK_D: tl.constexpr, CAUSAL: tl.constexpr,
                WRITE_LSE: tl.constexpr, USE_TMA: tl.constexpr, QMODE: tl.constexpr, QK_STAGES: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:  # longest rows first
        pid_m = tl.num_programs(0) - 1 - pid_m
    g = tl.program_id(1)
    bh = tl.program_id(2)
    b = (bh // Hq).to(tl.int64)
    h = bh % Hq
    hk = h // n_rep
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_bd = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, DC)
    start_m = pid_m * BLOCK_M
    rows = start_m + offs_m
    row_ok = rows < Sq
    rows_ld = tl.minimum(rows, Sq - 1)
    d_lo = g * (NC * DC)
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    # Q/K boxes are BLOCK_D wide (the QK^T contraction chunk), V boxes DC wide (output chunk)
    q_desc = _rows_desc(q_base, Sq, D, stride_qs, BLOCK_M, BLOCK_D, USE_TMA)
    k_desc = _rows_desc(k_base, Sk, D, stride_ks, BLOCK_N, BLOCK_D, USE_TMA)
    v_desc = _rows_desc(v_base, Sk, D, stride_vs, BLOCK_N, DC, USE_TMA)

    q0 = tl.zeros([BLOCK_M, BLOCK_D], Q.dtype.element_ty)
    q1 = q0
    q2 = q0
    q3 = q0
    q4 = q0
    q5 = q0
    q6 = q0
    q7 = q0
    if QMODE == 1:  # resident Q: NKD <= 8 chunks, loaded once
        q0 = _ld(q_desc, q_base, start_m, rows_ld, stride_qs, 0, offs_bd, D, False, USE_TMA)
        if NKD > 1:
            q1 = _ld(q_desc, q_base, start_m, rows_ld, stride_qs, BLOCK_D, offs_bd, D, False, USE_TMA)
        if NKD > 2:
            q2 = _ld(q_desc, q_base, start_m, rows_ld, stride_qs, 2 * BLOCK_D, offs_bd, D, False, USE_TMA)
        if NKD > 3:
            q3 = _ld(q_desc, q_base, start_m, rows_ld, stride_qs, 3 * BLOCK_D, offs_bd, D, False, USE_TMA)
        if NKD > 4:
            q4 = _ld(q_desc, q_base, start_m, rows_ld, stride_qs, 4 * BLOCK_D, offs_bd, D, False, USE_TMA)
        if NKD > 5:
            q5 = _ld(q_desc, q_base, start_m, rows_ld, stride_qs, 5 * BLOCK_D, offs_bd, D, False, USE_TMA)
        if NKD > 6:
            q6 = _ld(q_desc, q_base, start_m, rows_ld, stride_qs, 6 * BLOCK_D, offs_bd, D, False, USE_TMA)
        if NKD > 7:
            q7 = _ld(q_desc, q_base, start_m, rows_ld, stride_qs, 7 * BLOCK_D, offs_bd, D, False, USE_TMA)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, DC], tl.float32)
    acc1 = tl.zeros([BLOCK_M, DC], tl.float32)
    acc2 = tl.zeros([BLOCK_M, DC], tl.float32)
    acc3 = tl.zeros([BLOCK_M, DC], tl.float32)
    acc4 = tl.zeros([BLOCK_M, DC], tl.float32)
    acc5 = tl.zeros([BLOCK_M, DC], tl.float32)
    acc6 = tl.zeros([BLOCK_M, DC], tl.float32)
    acc7 = tl.zeros([BLOCK_M, DC], tl.float32)

    hi, hi_full = key_range(start_m, Sk, causal_off, BLOCK_M, BLOCK_N, CAUSAL)
    if QMODE == 3:
        # One flat loop over (k-block, D-chunk) pairs: every iteration loads one Q chunk and one K chunk (pipelined
        # QK_STAGES deep across k-block boundaries, so no per-k-block pipeline refill); the softmax and P @ V run
        # on the last chunk of each k-block.
        s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for it in tl.range(0, (hi_full // BLOCK_N) * NKD, num_stages=QK_STAGES):
            kd = it % NKD
            start_n = (it // NKD) * BLOCK_N
            q = _ld(q_desc, q_base, start_m, rows_ld, stride_qs, kd * BLOCK_D, offs_bd, D, False, USE_TMA)
            s = tl.where(kd == 0, 0.0, s)
            s = _qk(s, q, k_desc, k_base, start_n, offs_n + start_n, stride_ks, kd * BLOCK_D, offs_bd, D, USE_TMA)
            if kd == NKD - 1:
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, l_i, m_i = _softmax_pv(
                    s, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, l_i, m_i, v_desc, v_base, rows, start_n,
                    start_n + offs_n, offs_n + start_n, Sk, D, d_lo, causal_off, qk_scale, stride_vs, offs_c,
                    DC, NC, MASK_D, False, False, USE_TMA)
    for start_n in range(0, hi_full if QMODE != 3 else 0, BLOCK_N):  # pipelined num_stages deep (launch option)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, l_i, m_i = _fwd_step(
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, l_i, m_i, q0, q1, q2, q3, q4, q5, q6, q7,
            q_desc, k_desc, v_desc, q_base, k_base, v_base, start_m, rows, rows_ld,
            start_n, offs_n, offs_bd, offs_c, Sk, D, d_lo, causal_off, qk_scale, stride_qs, stride_ks, stride_vs,
            BLOCK_M, BLOCK_N, BLOCK_D, NKD, DC, NC, MASK_D, False, False, USE_TMA, QMODE, QK_STAGES)
    # The diagonal / partial blocks (at most BLOCK_M / BLOCK_N + 1 of them): no pipelining buffers for these.
    for start_n in tl.range(hi_full, hi, BLOCK_N, num_stages=1):
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, l_i, m_i = _fwd_step(
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, l_i, m_i, q0, q1, q2, q3, q4, q5, q6, q7,
            q_desc, k_desc, v_desc, q_base, k_base, v_base, start_m, rows, rows_ld,
            start_n, offs_n, offs_bd, offs_c, Sk, D, d_lo, causal_off, qk_scale, stride_qs, stride_ks, stride_vs,
            BLOCK_M, BLOCK_N, BLOCK_D, NKD, DC, NC, MASK_D, True, CAUSAL, USE_TMA, QMODE if QMODE != 3 else 2,
            QK_STAGES)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    inv_l = 1.0 / l_safe
    o_base = O + b * stride_ob + h * stride_oh
    _st(o_base, acc0, inv_l, rows, row_ok, stride_os, d_lo, offs_c, D, MASK_D)
    if NC > 1:
        _st(o_base, acc1, inv_l, rows, row_ok, stride_os, d_lo + DC, offs_c, D, MASK_D)
    if NC > 2:
        _st(o_base, acc2, inv_l, rows, row_ok, stride_os, d_lo + 2 * DC, offs_c, D, MASK_D)
    if NC > 3:
        _st(o_base, acc3, inv_l, rows, row_ok, stride_os, d_lo + 3 * DC, offs_c, D, MASK_D)
    if NC > 4:
        _st(o_base, acc4, inv_l, rows, row_ok, stride_os, d_lo + 4 * DC, offs_c, D, MASK_D)
    if NC > 5:
        _st(o_base, acc5, inv_l, rows, row_ok, stride_os, d_lo + 5 * DC, offs_c, D, MASK_D)
    if NC > 6:
        _st(o_base, acc6, inv_l, rows, row_ok, stride_os, d_lo + 6 * DC, offs_c, D, MASK_D)
    if NC > 7:
        _st(o_base, acc7, inv_l, rows, row_ok, stride_os, d_lo + 7 * DC, offs_c, D, MASK_D)
    if WRITE_LSE:
        if g == 0:
            lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2_C)
            tl.store(LSE + (b * Hq + h) * Sq + rows, lse, mask=row_ok)


LN2_C = tl.constexpr(LN2)


@triton.jit
def _prep_kernel(O, DO, LSE, DLSE, DELTA, LSE2, stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
                 Sq, Hq, D, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, NKD: tl.constexpr, HAS_DLSE: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    h = bh % Hq
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    ok = rows < Sq
    rows_ld = tl.minimum(rows, Sq - 1)
    offs_d = tl.arange(0, BLOCK_D)
    delta = tl.zeros([BLOCK], tl.float32)
    for kd in tl.static_range(NKD):
        o = _ld(O, O + b * stride_ob + h * stride_oh, 0, rows_ld, stride_os, kd * BLOCK_D, offs_d, D, False, False)
        do = _ld(DO, DO + b * stride_db + h * stride_dh, 0, rows_ld, stride_ds, kd * BLOCK_D, offs_d, D, False,
                 False)
        delta += tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    base = bh.to(tl.int64) * Sq + rows
    store_delta_lse2(DELTA, LSE2, LSE, DLSE, base, ok, delta, HAS_DLSE)


@triton.jit
def _pds_kernel(Q, K, V, DO, LSE2, DELTA, P, DS,
                stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                stride_db, stride_ds, stride_dh, stride_pp, stride_pr,
                Sq, Sk, Hq, Hk, n_rep, D, qk_scale, causal_off, p0, n0, Nc, n_mt,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NKD: tl.constexpr,
                CAUSAL: tl.constexpr, USE_TMA: tl.constexpr, STAGES: tl.constexpr, WITH_DP: tl.constexpr):
    """One (BLOCK_M query rows, BLOCK_N keys) tile of P and dS for (b, kv head) pair p0 + program_id(2), query head
    r = program_id(0) // n_mt of its GQA group, keys n0 + program_id(1) * BLOCK_N.. of the chunk [n0, n0 + Nc).
    S = Q K^T and dP = dO V^T are accumulated together over D in BLOCK_D chunks (one pipelined loop, four TMA
    loads per step), then P = exp2(S * qk_scale - lse2), dS = P * (dP - delta) are written in the input dtype to
    P / DS (pairs, n_rep * Sq, >= Nc) at rows r * Sq + m, columns local to the chunk. Causal tiles that no query
    row of the tile can see skip the loop and write zeros. WITH_DP False (the materialised forward): P only (DO, V,
    DELTA, DS unused), with LSE2 the final row log-sum-exp, so P is the normalised attention."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pc = tl.program_id(2)
    r = pid_m // n_mt
    start_m = (pid_m % n_mt) * BLOCK_M
    bhk = p0 + pc
    b = (bhk // Hk).to(tl.int64)
    hk = bhk % Hk
    h = hk * n_rep + r
    loc_n = pid_n * BLOCK_N
    start_n = n0 + loc_n
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = start_m + offs_m
    cols = start_n + offs_n
    rows_ld = tl.minimum(rows, Sq - 1)
    cols_ld = tl.minimum(cols, Sk - 1)
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_db + h * stride_dh
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    q_desc = _rows_desc(q_base, Sq, D, stride_qs, BLOCK_M, BLOCK_D, USE_TMA)
    do_desc = _rows_desc(do_base, Sq, D, stride_ds, BLOCK_M, BLOCK_D, USE_TMA)
    k_desc = _rows_desc(k_base, Sk, D, stride_ks, BLOCK_N, BLOCK_D, USE_TMA)
    v_desc = _rows_desc(v_base, Sk, D, stride_vs, BLOCK_N, BLOCK_D, USE_TMA)
    n_iter = NKD
    if CAUSAL:  # key start_n is visible to row i iff start_n <= i + causal_off
        n_iter = tl.where(start_n > start_m + BLOCK_M - 1 + causal_off, 0, NKD)
    s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    dp = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kd in tl.range(0, n_iter, num_stages=STAGES):
        d0 = kd * BLOCK_D
        q = _ld(q_desc, q_base, start_m, rows_ld, stride_qs, d0, offs_d, D, False, USE_TMA)
        k = _ld(k_desc, k_base, start_n, cols_ld, stride_ks, d0, offs_d, D, False, USE_TMA)
        s = tl.dot(q, tl.trans(k), s)
        if WITH_DP:
            do = _ld(do_desc, do_base, start_m, rows_ld, stride_ds, d0, offs_d, D, False, USE_TMA)
            v = _ld(v_desc, v_base, start_n, cols_ld, stride_vs, d0, offs_d, D, False, USE_TMA)
            dp = tl.dot(do, tl.trans(v), dp)
    row_base = (b * Hq + h) * Sq
    row_ok = rows < Sq
    lse2 = tl.where(row_ok, tl.load(LSE2 + row_base + rows_ld), float("inf"))  # inf: rows that see no key -> P 0
    p = tl.math.exp2(s * qk_scale - lse2[:, None])
    valid = (loc_n + offs_n < Nc)[None, :]
    if CAUSAL:
        valid = valid & (cols[None, :] <= rows[:, None] + causal_off)
    p = tl.where(valid, p, 0.0)
    off = pc.to(tl.int64) * stride_pp + (r * Sq).to(tl.int64) * stride_pr
    if USE_TMA:
        p_desc = tl.make_tensor_descriptor(P + off, shape=[Sq, Nc], strides=[stride_pr, 1],
                                           block_shape=[BLOCK_M, BLOCK_N])
        p_desc.store([start_m, loc_n], p.to(P.dtype.element_ty))
    else:
        o = off + rows[:, None] * stride_pr + (loc_n + offs_n)[None, :]
        msk = row_ok[:, None] & (loc_n + offs_n < Nc)[None, :]
        tl.store(P + o, p.to(P.dtype.element_ty), mask=msk)
    if WITH_DP:
        delta = tl.load(DELTA + row_base + rows_ld)
        ds = p * (dp - delta[:, None])
        if USE_TMA:
            ds_desc = tl.make_tensor_descriptor(DS + off, shape=[Sq, Nc], strides=[stride_pr, 1],
                                                block_shape=[BLOCK_M, BLOCK_N])
            ds_desc.store([start_m, loc_n], ds.to(DS.dtype.element_ty))
        else:
            tl.store(DS + o, ds.to(DS.dtype.element_ty), mask=msk)


@triton.jit
def _lse_kernel(Q, K, LSE2, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                Sq, Sk, Hq, n_rep, D, qk_scale, causal_off,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NKD: tl.constexpr,
                CAUSAL: tl.constexpr, USE_TMA: tl.constexpr, STAGES: tl.constexpr):
    """Row log-sum-exp of S * qk_scale (log2 units; +inf for rows that see no key) of one (BLOCK_M rows, query head)
    tile into LSE2 (B, Hq, Sq): one flat loop over (k-block, D chunk) pairs, a Q and a K chunk per step, pipelined
    STAGES deep across k-blocks; the running max / sum update on each k-block's last chunk."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    h = bh % Hq
    hk = h // n_rep
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    start_m = pid_m * BLOCK_M
    rows = start_m + offs_m
    rows_ld = tl.minimum(rows, Sq - 1)
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + hk * stride_kh
    q_desc = _rows_desc(q_base, Sq, D, stride_qs, BLOCK_M, BLOCK_D, USE_TMA)
    k_desc = _rows_desc(k_base, Sk, D, stride_ks, BLOCK_N, BLOCK_D, USE_TMA)
    hi, hi_full = key_range(start_m, Sk, causal_off, BLOCK_M, BLOCK_N, CAUSAL)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for it in tl.range(0, (hi + BLOCK_N - 1) // BLOCK_N * NKD, num_stages=STAGES):
        kd = it % NKD
        start_n = (it // NKD) * BLOCK_N
        cols = start_n + offs_n
        q = _ld(q_desc, q_base, start_m, rows_ld, stride_qs, kd * BLOCK_D, offs_d, D, False, USE_TMA)
        k = _ld(k_desc, k_base, start_n, tl.minimum(cols, Sk - 1), stride_ks, kd * BLOCK_D, offs_d, D, False,
                USE_TMA)
        s = tl.where(kd == 0, 0.0, s)
        s = tl.dot(q, tl.trans(k), s)
        if kd == NKD - 1:
            valid = (cols < Sk)[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= rows[:, None] + causal_off)
            x = tl.where(valid, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(x, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.math.exp2(m_i - m_use) + tl.sum(tl.math.exp2(x - m_use[:, None]), 1)
            m_i = m_new
    lse2 = tl.where(l_i == 0.0, float("inf"), m_i + tl.math.log2(tl.where(l_i == 0.0, 1.0, l_i)))
    tl.store(LSE2 + bh.to(tl.int64) * Sq + rows, lse2, mask=rows < Sq)


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------

def supports(q, attn_mask=None, causal: bool = False) -> bool:
    """True when this module's Triton kernels run q: 4-D, D a multiple of 32 in [32, 1024], no attn_mask,
    fp16/bf16 CUDA tensors (fp16/fp32 under TRITON_INTERPRET=1)."""
    if attn_mask is not None or q.dim() != 4:
        return False
    D = q.shape[-1]
    if D % 32 or not 32 <= D <= MAX_HEAD_DIM:
        return False
    if _interpret():
        return q.dtype in (torch.float16, torch.float32)
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _check_inputs(q, k, v):
    dims = check_qkv(q, k, v)
    D = q.shape[-1]
    if D % 32 or not 32 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"q/k/v head dim must be a multiple of 32 in [32, {MAX_HEAD_DIM}] for the split-D kernel, "
                         f"got {D} (use sparsepatch.kernels.attention to fall back to the reference)")
    ok = (torch.float16, torch.float32) if _interpret() else (torch.float16, torch.bfloat16)
    if q.dtype not in ok:
        raise ValueError(f"q dtype must be one of {ok} for the split-D kernel, got {q.dtype}")
    if not _interpret() and not q.is_cuda:
        raise ValueError("q/k/v must be CUDA tensors for the split-D kernel (or set TRITON_INTERPRET=1)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on the head dim, got strides {t.stride()}")
    return dims


def _use_tma(cfg, *ts, same_box=True) -> bool:
    """TMA loads when available (Hopper+), every (batch, head) base/row stride is 16-B aligned, and (same_box: the
    backward, whose Q/K/V descriptors serve both the BLOCK_D and the DC chunks) BLOCK_D == DC."""
    if _interpret() or (same_box and cfg["BLOCK_D"] != cfg["DC"]):
        return False
    if not hasattr(tl, "make_tensor_descriptor") or torch.cuda.get_device_capability(ts[0].device)[0] < 9:
        return False
    for t in ts:
        es = t.element_size()
        if t.data_ptr() % 16 or any((t.stride(i) * es) % 16 for i in (0, 1, 2)):
            return False
    set_tma_allocator()
    return True


def _qmode(cfg, D) -> int:
    """Q handling in the forward: "res" 1 (resident, at most 8 chunks), "flat" 2 (run-time chunk loop per
    k-block), "flat2" 3 (one loop over (k-block, chunk) pairs)."""
    mode = {"res": 1, "flat": 2, "flat2": 3}.get(cfg.get("q"))
    if mode is None:
        raise ValueError(f"cfg['q'] must be 'res', 'flat' or 'flat2', got {cfg.get('q')!r}")
    if mode == 1 and D // cfg["BLOCK_D"] > 8:
        raise ValueError(f"resident Q needs D / BLOCK_D <= 8, got D={D}, BLOCK_D={cfg['BLOCK_D']}")
    return mode


def _groups(D, cfg):
    width = cfg["DC"] * cfg["NC"]
    return -(-D // width), (D % width) != 0 and True


RESOLVED = {}  # (kernel, D, dtype, causal, use_tma) -> the config that launched (after any shared-memory fallback)


def _fallbacks(cfg):
    """cfg, then cheaper variants: one pipeline stage, then half the output chunks per program (more groups);
    only cfg itself when cfg["strict"] (benchmark sweeps)."""
    if cfg.get("strict"):
        return [dict(cfg)]
    out = [dict(cfg), dict(cfg, num_stages=1)]
    nc = cfg["NC"]
    while nc > 1:
        nc = (nc + 1) // 2
        out.append(dict(cfg, NC=nc, num_stages=1))
    out.append(dict(cfg, NC=1, BLOCK_N=32, num_stages=1))
    return out


def _run(name, key, cfg, launch, fallbacks=None):
    """launch(cfg) with the first config of (fallbacks or _fallbacks)(cfg) that fits the device (Triton raises
    OutOfResources at launch); the winner is remembered in RESOLVED under (name,) + key."""
    hit = RESOLVED.get((name,) + key)
    if hit is not None:
        return launch(hit)
    err = None
    for c in (fallbacks or _fallbacks)(cfg):
        try:
            r = launch(c)
        except triton.runtime.errors.OutOfResources as exc:
            err = exc
            continue
        RESOLVED[(name,) + key] = c
        return r
    raise err


def _fwd_impl(q, k, v, causal, scale, return_lse, cfg=None):
    B, Sq, Sk, Hq, Hk, D = check_qkv(q, k, v)
    cfg = fwd_config(D, Sq) if cfg is None else dict(cfg)
    out = torch.empty((B, Sq, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device) if return_lse else out.new_empty(
        (0,), dtype=torch.float32)
    if B * Sq * Hq == 0:
        return out, lse
    if Sk == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    tma = _use_tma(cfg, q, k, v, same_box=False)
    if cfg.get("q") == "mat":
        _fwd_mat(q, k, v, causal, scale, return_lse, cfg, tma, out, lse)
        return out, lse

    def launch(cfg):
        n_g, mask_d = _groups(D, cfg)
        bd = cfg["BLOCK_D"]
        grid = (triton.cdiv(Sq, cfg["BLOCK_M"]), n_g, B * Hq)
        _fwd_kernel[grid](
            q, k, v, out, lse,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            Sq, Sk, Hq, Hq // Hk, D, scale * LOG2E, Sk - Sq,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=bd, NKD=D // bd, DC=cfg["DC"], NC=cfg["NC"],
            MASK_D=mask_d, CAUSAL=bool(causal), WRITE_LSE=bool(return_lse), USE_TMA=tma,
            QMODE=_qmode(cfg, D), QK_STAGES=int(cfg.get("qk_stages", 3)), num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])

    _run("fwd", (D, q.dtype, bool(causal), tma, bool(return_lse), str(sorted(cfg.items()))), cfg, launch)
    return out, lse


def _stage_fallbacks(cfg):
    """cfg, then fewer pipeline stages (block sizes fixed)."""
    if cfg.get("strict"):
        return [dict(cfg)]
    return [dict(cfg, num_stages=st) for st in range(cfg["num_stages"], 0, -1)]


def _launch_pds(c, q, k, v, dout, lse2, delta, ps, dss, p0, n0, np_, nc, scale, causal, tma, *, with_dp):
    """`_pds_kernel` with launch config c over (b, kv head) pairs [p0, p0 + np_) and keys [n0, n0 + nc): P into ps
    and, with_dp, dS into dss (scratch (pairs, n_rep * Sq, keys)); q/dout (B, Sq, Hq, D), k/v (B, Sk, Hk, D)."""
    Sq, Hq, D = q.shape[1], q.shape[2], q.shape[3]
    Sk, Hk = k.shape[1], k.shape[2]
    n_rep, bd = Hq // Hk, c["BLOCK_D"]
    n_mt = triton.cdiv(Sq, c["BLOCK_M"])
    _pds_kernel[(n_rep * n_mt, triton.cdiv(nc, c["BLOCK_N"]), np_)](
        q, k, v, dout, lse2, delta, ps, dss,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        ps.stride(0), ps.stride(1), Sq, Sk, Hq, Hk, n_rep, D, scale * LOG2E, Sk - Sq, p0, n0, nc, n_mt,
        BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_D=bd, NKD=D // bd, CAUSAL=bool(causal),
        USE_TMA=tma, STAGES=c["num_stages"], WITH_DP=with_dp, num_warps=c["num_warps"], num_stages=c["num_stages"])


def _fwd_mat(q, k, v, causal, scale, return_lse, cfg, tma, out, lse):
    """Materialised forward (cfg q "mat"): `_lse_kernel` (row LSE, one QK^T pass), then per scratch chunk
    `_pds_kernel` (WITH_DP False: QK^T again, P = exp2(S * c - lse2) normalised, written in the input dtype) and
    O = P V as one batched GEMM (GQA query heads stacked along the rows as in the backward). 3 units of S^2 D
    matmul against the split-D forward's G + 1 (G output groups)."""
    B, Sq, Sk, Hq, Hk, D = check_qkv(q, k, v)
    dev, dt = q.device, q.dtype
    n_rep = Hq // Hk
    bd = cfg["BLOCK_D"]
    lse2 = torch.empty((B, Hq, Sq), dtype=torch.float32, device=dev)

    def launch_lse(c):
        _lse_kernel[(triton.cdiv(Sq, c["BLOCK_M"]), B * Hq)](
            q, k, lse2, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            Sq, Sk, Hq, n_rep, D, scale * LOG2E, Sk - Sq,
            BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_D=bd, NKD=D // bd, CAUSAL=bool(causal), USE_TMA=tma,
            STAGES=c["num_stages"], num_warps=c["num_warps"], num_stages=c["num_stages"])

    key = (D, dt, bool(causal), tma, str(sorted(cfg.items())))
    lcfg = dict(cfg, BLOCK_N=cfg.get("lse_block_n", cfg["BLOCK_N"]), num_stages=cfg.get("lse_stages", 4))
    _run("fwd_lse", key, lcfg, launch_lse, _stage_fallbacks)

    n_pairs, R, es = B * Hk, n_rep * Sq, q.element_size()
    npc, nkc = _bwd_chunks(n_pairs, R, Sk, es, 2 * (int(cfg["scratch_mb"]) << 20), cfg["BLOCK_N"])
    ps = torch.empty((npc, R, _pad8(nkc)), dtype=dt, device=dev)
    vg = _pairs_view(v, Hk)
    direct = B == 1 and n_rep == 1 and nkc == Sk and out.is_contiguous()  # GEMM writes out through a view
    og = out[0].transpose(0, 1) if direct else torch.empty((n_pairs, R, D), dtype=dt if nkc == Sk else torch.float32,
                                                            device=dev)

    def launch_p(c, p0, n0, np_, nc):   # P only: k / q / lse2 / ps stand in for the unused v / dO / delta / dS
        _launch_pds(c, q, k, k, q, lse2, lse2, ps, ps, p0, n0, np_, nc, scale, causal, tma, with_dp=False)

    for p0 in range(0, n_pairs, npc):
        np_ = min(npc, n_pairs - p0)
        sl = slice(p0, p0 + np_)
        for n0 in range(0, Sk, nkc):
            nc = min(nkc, Sk - n0)
            _run("fwd_p", key, cfg, lambda c: launch_p(c, p0, n0, np_, nc), _stage_fallbacks)
            P = ps[:np_, :, :nc]
            if nkc == Sk:
                og[sl].baddbmm_(P, vg[sl, n0:n0 + nc], beta=0.0)
            elif n0 == 0:
                og[sl].copy_(torch.bmm(P, vg[sl, n0:n0 + nc]))
            else:
                og[sl].add_(torch.bmm(P, vg[sl, n0:n0 + nc]))
    if not direct:
        out.copy_(og.view(B, Hk, n_rep, Sq, D).permute(0, 3, 1, 2, 4).reshape(B, Sq, Hq, D))
    if return_lse:
        torch.mul(lse2, LN2, out=lse)
        lse.masked_fill_(lse2 == float("inf"), float("-inf"))


def unit_stride(t):
    """t, or a copy with unit stride on the last axis (the kernels index D with stride 1)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _bwd_fallbacks(cfg):
    """cfg, then fewer pipeline stages, then 64-key tiles (Triton raises OutOfResources at launch)."""
    if cfg.get("strict"):
        return [dict(cfg)]
    out = [dict(cfg)]
    for st in range(cfg["num_stages"] - 1, 0, -1):
        out.append(dict(cfg, num_stages=st))
    out.append(dict(cfg, BLOCK_N=64, num_stages=2))
    out.append(dict(cfg, BLOCK_M=64, BLOCK_N=64, num_stages=1))
    return out


def _bwd_chunks(n_pairs, R, Sk, es, budget, block_n):
    """(pairs per chunk, keys per chunk): P and dS scratch 2 * pairs * R * keys * es bytes <= budget when possible
    (whole (b, kv head) pairs first; one pair with the keys cut into multiples of block_n when a pair alone is over)."""
    full = 2 * R * _pad8(Sk) * es
    if full <= budget:
        return max(1, min(n_pairs, budget // full)), Sk
    keys = max(block_n, (budget // (2 * R * es)) // block_n * block_n)
    return 1, min(keys, Sk)


def _pad8(n):
    return -(-n // 8) * 8


def _pairs_view(t, H):
    """(B, S, H, D) -> (B * H, S, D) (a view when B == 1, else a copy)."""
    B, S, _, D = t.shape
    return t.permute(0, 2, 1, 3).reshape(B * H, S, D)


def _bwd_impl(q, k, v, out, lse, dout, dlse, causal, scale, cfg=None):
    """Gradients by materialised P / dS tiles: `_prep_kernel` (delta, lse2), then per chunk of (b, kv head) pairs
    and keys `_pds_kernel` writes P and dS (the only D-long contractions done here, S and dP, split over D), and
    three batched GEMMs (cuBLAS through torch) form dV = P^T dO, dK = scale dS^T Q, dQ = scale dS K. The GQA
    group's query heads are stacked along the rows (n_rep * Sq), so dK/dV of a pair come out of one GEMM.
    Scratch: 2 x pairs x (n_rep * Sq) x keys elements in the input dtype, at most cfg["scratch_mb"] MiB unless one
    pair's BLOCK_N keys already exceed it; dQ accumulates in fp32 over key chunks when a pair's keys are cut."""
    B, Sq, Sk, Hq, Hk, D = check_qkv(q, k, v)
    cfg = bwd_config(D) if cfg is None else dict(cfg)
    q, k, v, out, dout = (unit_stride(t) for t in (q, k, v, out, dout))
    dev, dt = q.device, q.dtype
    if B * Sq * Hq * Sk == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    n_rep = Hq // Hk
    delta = torch.empty((B, Hq, Sq), dtype=torch.float32, device=dev)
    lse2 = torch.empty((B, Hq, Sq), dtype=torch.float32, device=dev)
    lse = lse.contiguous()
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    PB = 16 if _interpret() else 64
    pbd = _pow2_divisor(D, 128)
    _prep_kernel[(triton.cdiv(Sq, PB), B * Hq)](
        out, dout, lse, dlse if dlse is not None else lse, delta, lse2,
        out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        Sq, Hq, D, BLOCK=PB, BLOCK_D=pbd, NKD=D // pbd, HAS_DLSE=dlse is not None, num_warps=4)
    tma = _use_tma(cfg, q, k, v, dout, same_box=False)

    n_pairs, R, es = B * Hk, n_rep * Sq, q.element_size()
    npc, nkc = _bwd_chunks(n_pairs, R, Sk, es, int(cfg["scratch_mb"]) << 20, cfg["BLOCK_N"])
    ps = torch.empty((npc, R, _pad8(nkc)), dtype=dt, device=dev)
    dss = torch.empty_like(ps)
    # Row-stacked (pair, n_rep * Sq, D) operands for the GEMMs: row r * Sq + m is query head hk * n_rep + r.
    qg = q.view(B, Sq, Hk, n_rep, D).permute(0, 2, 3, 1, 4).reshape(n_pairs, R, D)
    dog = dout.view(B, Sq, Hk, n_rep, D).permute(0, 2, 3, 1, 4).reshape(n_pairs, R, D)
    kg = _pairs_view(k, Hk)
    # Outputs in (B, S, H, D); with B == 1 the GEMMs write them through (H, S, D) views (row stride H * D), else
    # into head-major buffers copied once at the end.
    dk = torch.empty((B, Sk, Hk, D), dtype=dt, device=dev)
    dv = torch.empty_like(dk)
    dq = torch.empty((B, Sq, Hq, D), dtype=dt, device=dev)
    direct = B == 1
    dkg = dk[0].transpose(0, 1) if direct else torch.empty((n_pairs, Sk, D), dtype=dt, device=dev)
    dvg = dv[0].transpose(0, 1) if direct else torch.empty_like(dkg)
    direct_q = direct and n_rep == 1 and nkc == Sk
    dqg = dq[0].transpose(0, 1) if direct_q else torch.empty((n_pairs, R, D), dtype=dt if nkc == Sk else torch.float32,
                                                             device=dev)

    def launch(c, p0, n0, np_, nc):
        _launch_pds(c, q, k, v, dout, lse2, delta, ps, dss, p0, n0, np_, nc, scale, causal, tma, with_dp=True)

    key = (D, dt, bool(causal), tma, str(sorted(cfg.items())))
    for p0 in range(0, n_pairs, npc):
        np_ = min(npc, n_pairs - p0)
        for n0 in range(0, Sk, nkc):
            nc = min(nkc, Sk - n0)
            _run("bwd", key, cfg, lambda c: launch(c, p0, n0, np_, nc), _bwd_fallbacks)
            P, dS = ps[:np_, :, :nc], dss[:np_, :, :nc]
            sl = slice(p0, p0 + np_)
            dvg[sl, n0:n0 + nc].baddbmm_(P.transpose(1, 2), dog[sl], beta=0.0)
            dkg[sl, n0:n0 + nc].baddbmm_(dS.transpose(1, 2), qg[sl], beta=0.0, alpha=scale)
            if nkc == Sk:
                dqg[sl].baddbmm_(dS, kg[sl, n0:n0 + nc], beta=0.0, alpha=scale)
            else:  # fp32 accumulation over key chunks
                part = torch.bmm(dS, kg[sl, n0:n0 + nc])
                if n0 == 0:
                    dqg[sl].copy_(part).mul_(scale)
                else:
                    dqg[sl].add_(part, alpha=scale)
    if not direct_q:
        dq.copy_(dqg.view(B, Hk, n_rep, Sq, D).permute(0, 3, 1, 2, 4).reshape(B, Sq, Hq, D))
    if not direct:
        dk.copy_(dkg.view(B, Hk, Sk, D).transpose(1, 2))
        dv.copy_(dvg.view(B, Hk, Sk, D).transpose(1, 2))
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------------
# Custom ops + autograd
# ----------------------------------------------------------------------------------------------------------------

@torch.library.custom_op("sparsepatch::dense_splitd_fwd", mutates_args=())
def _dense_splitd_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                      return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(q, k, v, causal, scale, return_lse)


@_dense_splitd_fwd.register_fake
def _(q, k, v, causal, scale, return_lse):
    return empty_out_lse(q, return_lse)


@torch.library.custom_op("sparsepatch::dense_splitd_bwd", mutates_args=())
def _dense_splitd_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      dout: torch.Tensor, dlse: torch.Tensor | None, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(q, k, v, out, lse, dout, dlse, causal, scale)


@_dense_splitd_bwd.register_fake
def _(q, k, v, out, lse, dout, dlse, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, return_lse = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.params = (bool(causal), float(scale), bool(return_lse))


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    causal, scale, has_lse = ctx.params
    if not has_lse:  # forward ran without the LSE: recompute it (one extra forward)
        lse = torch.ops.sparsepatch.dense_splitd_fwd(q, k, v, causal, scale, True)[1]
        dlse = None
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _dense_splitd_bwd(q, k, v, out, lse, dout, dlse, causal, scale)
    return dq, dk, dv, None, None, None


torch.library.register_autograd("sparsepatch::dense_splitd_fwd", _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------------
# Public entries
# ----------------------------------------------------------------------------------------------------------------

def attention(q, k, v, *, causal: bool = False, scale=None, return_lse: bool = False):
    """Split-D dense flash attention. q (B, Sq, Hq, D), k/v (B, Sk, Hk, D), D % 32 == 0, D <= 1024
    -> out (B, Sq, Hq, D) [, lse (B, Hq, Sq) fp32 natural log]. Differentiable in q, k, v (and through lse).

    causal: bottom-right aligned (query i sees keys <= Sk - Sq + i), as in `reference.attention`.
    """
    _check_inputs(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    # Eager inference skips the custom-op dispatch; compiled graphs and calls needing a gradient go through the op
    # (its autograd needs the LSE, so it is always kept then).
    fwd = _dense_splitd_fwd if (torch.compiler.is_compiling() or needs_grad) else _fwd_impl
    out, lse = fwd(q, k, v, bool(causal), scale, bool(return_lse) or needs_grad)
    return (out, lse) if return_lse else out


def attention_backward(q, k, v, out, lse, dout, *, causal: bool = False, scale=None, dlse=None):
    """Gradients (dq, dk, dv) of `attention` given its out and lse (B, Hq, Sq) fp32; dlse: optional upstream
    gradient of lse. Returns tensors in the input dtype, dq (B, Sq, Hq, D), dk/dv (B, Sk, Hk, D)."""
    B, Sq, Sk, Hq, Hk, D = _check_inputs(q, k, v)
    if out.shape != q.shape or dout.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} and dout {tuple(dout.shape)} must have q's shape {tuple(q.shape)}")
    if lse.shape != (B, Hq, Sq) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be fp32 (B, Hq, Sq) = {(B, Hq, Sq)}, got {lse.dtype} {tuple(lse.shape)}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    return _dense_splitd_bwd(q, k, v, out, lse, dout, dlse, bool(causal), scale)
