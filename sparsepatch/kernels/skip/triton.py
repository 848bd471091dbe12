"""Triton forward kernels: temporal skip-list attention and the dense flash forward (skipping compiled out).

Layout: q (B, Sq, Hq, D), k/v (B, Sk, Hk, D), any strides with unit stride on D; out (B, Sq, Hq, D) contiguous;
LSE (B, Hq, Sq) fp32, natural log. fp16/bf16 on CUDA (fp32 only under TRITON_INTERPRET=1), head dim 64 or 128,
GQA Hq % Hk == 0, any Sq/Sk (partial last tiles are masked).

One program computes one q-tile (BLOCK_M = tm rows) of one (batch, query head). In skip mode it walks the row's
list of k-tiles in ascending order (skipped tiles cost no loads and no math), each k-tile in tn / BLOCK_N
sub-blocks, and applies the keep test of `reference.skip_attention` in log2 units with scale * log2(e) folded:
a tile is kept iff some valid row has tile_max - running_max_before > threshold. Per-row keep bits are gathered
in an int32 word per 32 visited tiles and OR-reduced across rows once per word (no per-tile cross-warp
reduction); the kernel then writes the next list (ascending indices + count) itself.

K/V loads (USE_TMA): 0 pointer loads; 1 TMA descriptors built on the device per program (per (b, kv head) base);
2 host TMA descriptors over the (B, Hk, Sk, D) view of K/V, block (1, 1, BLOCK_N, D), no per-program descriptor
build (the skip default at tile 128x128: it removed ~3 us of the ~8 us fixed cost per q-tile program, which
dominates at low density; benchmarks/NOTES.md). With it, the skip default also loads q and stores out through host
descriptors and loads the list's first 32 indices together with its count (Q_DESC / O_DESC / HEAD_CHUNK), writes
the next list by popcounts (POPC) and prefetches the prologue data of the program one wave ahead into L2 (PF_NEXT).
(A persistent grid, keep bits merged once per word and 2-D loop descriptors were measured neutral or slower and
deleted; benchmarks/NOTES.md, skip forward v4 / v5.)

On an sm_90 GPU with Gluon (Triton 3.6), tile 128x128 skip calls and dense calls (non-causal, and
causal with Sk - Sq a multiple of 128) at head dim 64 / 128 run `gluon.py` instead (cfg keys `gluon`,
`causal_gluon`, on by default there): a persistent warp-specialised kernel with the same function, ~10% faster per
tile than this one's and than cuDNN at non-causal D128, with a cheaper q-tile epilogue and its rho-1 loop within
1-3% of its dense mode (benchmarks/NOTES.md, skip forward v9 / v10 / v12; head dim 64 and causal: session 13); so
does `skip_step` (the stateful patcher path). With must_do, both read the list with the forced tiles added
(`_union`, device ops) and keep them in the next list. Dense calls at head dim 256 (inference) run only there
(64-key tiles; no Triton config). Other tiles / head dims, other causal alignments and the interpreter stay here; a
Gluon compile or launch failure warns once and falls back to this kernel (at head dim 256: a ValueError).

Ops are registered with torch.library.custom_op (+ fake impls): `sparsepatch::skip_fwd`, `sparsepatch::dense_fwd`.
`skip_step` is the CUDA body of `sparsepatch::skip_step` (stateful.py): it reads the call counter on the device,
so it never syncs with the host and can be captured in a CUDA graph.
"""
from __future__ import annotations

import math
import warnings

import torch
import triton
import triton.language as tl

from .._common import DescriptorArgs, bit_or, current_stream, direct_launcher, empty_out_lse, head_major_desc, \
    num_sms, relaunch_or_stop
from .._common import interpret as _interpret
from .._common import list_slots, set_tma_allocator
from . import backward as skip_backward
from . import reference
from ..dense.reference import LOG2E, check_qkv
from .nextlist import CHUNK, CHUNK_C, write_next_list
from .reference import check_threshold
from .skiplist import DEFAULT_TILE, SkipList, check_tile, num_tiles

__all__ = ["supports", "supports_tile", "attention", "skip_attention", "skip_step", "CONFIGS", "SKIP_CONFIGS"]

LN2 = 0.6931471805599453

# Launch configs, keyed by (head_dim, BLOCK_M): BLOCK_N, num_warps, num_stages, use_tma.
# Chosen from benchmarks/bench_skip.py sweeps on an H100 (see benchmarks/NOTES.md).
CONFIGS = {
    (128, 128): dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=True, ws=True, gluon=True, causal_gluon=True),
    (128, 64): dict(BLOCK_N=64, num_warps=4, num_stages=3, tma=False),
    (64, 128): dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=True, gluon=True, causal_gluon=True),
    (64, 64): dict(BLOCK_N=64, num_warps=4, num_stages=3, tma=False),
    (256, 128): dict(gluon=True, causal_gluon=True),   # the Gluon kernel only (no Triton config at head dim 256)
}
# The skip loop (indirect k-tile index per iteration) has its own best settings. host_desc: K/V TMA descriptors built
# on the host (USE_TMA=2, falls back to device descriptors when strides are not 16-byte multiples). q_desc / o_desc
# / head_chunk (tile 128x128, with host_desc): q load and out store through host descriptors, list head loaded with
# its count (H100: rho=1 11.86 -> 11.30 ms, rho 0.05 0.698 -> 0.671 ms; benchmarks/NOTES.md v5). popc: next-list
# compaction by popcounts; pf_next: each program prefetches the prologue data of the program one wave ahead into L2
# (phase clocks, one-tile lists: 7.5 -> 5.8 us per q-tile program; neutral at 13-tile random lists; NOTES v6).
SKIP_CONFIGS = {
    (128, 128): dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=True, prefetch_j=True, host_desc=True, q_desc=True,
                     o_desc=True, head_chunk=True, popc=True, pf_next=True, gluon=True),
    (128, 64): dict(BLOCK_N=64, num_warps=4, num_stages=3, tma=False, prefetch_j=True),
    (64, 128): dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=False, prefetch_j=True, gluon=True),
    (64, 64): dict(BLOCK_N=64, num_warps=4, num_stages=3, tma=False, prefetch_j=True),
}


# ----------------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _clk(dep):
    """PROBE builds only: %clock64 once `dep` (an int32 scalar the phase produced) is known."""
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _gclk():
    """PROBE builds only: %globaltimer (ns, device-wide)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _smid():
    """PROBE builds only: the SM this program runs on."""
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _prefetch_l2(ptrs):
    """PF_NEXT builds only (CUDA): prefetch.global.L2 of the line at each address (no result, no wait)."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _block(acc, l_i, m_i, q, k_ptrs, v_ptrs, k_desc, v_desc, kv_b, kv_h, start_n, offs_n, rows, Sk, causal_off,
           qk_scale, stride_ks, stride_vs,
           BLOCK_N: tl.constexpr, MASK_N: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) step of the online softmax; returns (acc, l_i, m_i, scaled row max of the block)."""
    cols = start_n + offs_n
    if USE_TMA == 2:  # host descriptors over (B, Hk, Sk, D) views
        k = k_desc.load([kv_b, kv_h, start_n, 0]).reshape(BLOCK_N, k_desc.block_shape[3])
        v = v_desc.load([kv_b, kv_h, start_n, 0]).reshape(BLOCK_N, v_desc.block_shape[3])
    elif USE_TMA:
        k = k_desc.load([start_n, 0])
        v = v_desc.load([start_n, 0])
    elif MASK_N:
        k = tl.load(k_ptrs + start_n * stride_ks, mask=(cols < Sk)[:, None], other=0.0)
        v = tl.load(v_ptrs + start_n * stride_vs, mask=(cols < Sk)[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs + start_n * stride_ks)
        v = tl.load(v_ptrs + start_n * stride_vs)
    qk = tl.dot(q, tl.trans(k))
    if MASK_N or CAUSAL:
        valid = (cols < Sk)[None, :]
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None] + causal_off)
        qk = tl.where(valid, qk * qk_scale, float("-inf"))
        rmax = tl.max(qk, 1)
        m_new = tl.maximum(m_i, rmax)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_use[:, None])
    else:
        rmax = tl.max(qk, 1) * qk_scale
        m_new = tl.maximum(m_i, rmax)
        m_use = m_new
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new, rmax


@triton.jit
def _tile(acc, l_i, m_i, q, k_ptrs, v_ptrs, k_desc, v_desc, kv_b, kv_h, j, offs_n, rows, Sk, qk_scale, stride_ks,
          stride_vs, TILE_N: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr, USE_TMA: tl.constexpr):
    """All sub-blocks of skip tile j; returns (acc, l_i, m_i, scaled row max over the whole tile)."""
    acc, l_i, m_i, tmax = _block(acc, l_i, m_i, q, k_ptrs, v_ptrs, k_desc, v_desc, kv_b, kv_h, j * TILE_N, offs_n,
                                 rows, Sk, 0, qk_scale, stride_ks, stride_vs, BLOCK_N, MASK_N, False, USE_TMA)
    for s in tl.static_range(1, TILE_N // BLOCK_N):  # (a max with -inf would cost an instruction per row)
        acc, l_i, m_i, rmax = _block(acc, l_i, m_i, q, k_ptrs, v_ptrs, k_desc, v_desc, kv_b, kv_h,
                                     j * TILE_N + s * BLOCK_N, offs_n, rows, Sk, 0, qk_scale, stride_ks, stride_vs,
                                     BLOCK_N, MASK_N, False, USE_TMA)
        tmax = tl.maximum(tmax, rmax)
    return acc, l_i, m_i, tmax


@triton.jit
def _store_out(acc, l_i, m_i, O, LSE, OD, b, b64, h, pid_m, rows, row_ok, offs_d, stride_ob, stride_os, stride_oh,
               Sq, Hq, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, WRITE_LSE: tl.constexpr,
               O_DESC: tl.constexpr):
    """Epilogue: out = acc / l (O dtype) and, with WRITE_LSE, the row LSE (natural log)."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if O_DESC:  # rows past Sq are clipped by the descriptor's bounds
        OD.store([b, h, pid_m * TILE_M, 0], out.to(O.dtype.element_ty).reshape(1, 1, BLOCK_M, HEAD_DIM))
    else:
        o_ptrs = O + b64 * stride_ob + h * stride_oh + rows[:, None] * stride_os + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2_C)
        tl.store(LSE + (b64 * Hq + h) * Sq + rows, lse, mask=row_ok)


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, CNT_IN, IDX_IN, CNT_OUT, IDX_OUT, FROW, FCOL, STEP, QD, OD,
                stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                stride_ob, stride_os, stride_oh,
                Sq, Sk, Hq, n_rep, Tq, Tk, slot_stride_cnt, slot_stride_idx, warmup,
                qk_scale, threshold, causal_off, KD, VD,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr,
                TILE_N: tl.constexpr, SKIP: tl.constexpr, STATEFUL: tl.constexpr, HAS_FORCED: tl.constexpr,
                LAST_PARTIAL: tl.constexpr, CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr, USE_TMA: tl.constexpr,
                WARP_SPEC: tl.constexpr, NWORDS: tl.constexpr, PREFETCH_J: tl.constexpr = False,
                DIRECT_J: tl.constexpr = False, NO_KEEP: tl.constexpr = False, HEAD_CHUNK: tl.constexpr = False,
                Q_DESC: tl.constexpr = False, O_DESC: tl.constexpr = False, POPC: tl.constexpr = False,
                PF_NEXT: tl.constexpr = False, n_pf=0, PRB=None, PROBE: tl.constexpr = False):
    """One q-tile (program_id 0) of one (batch, query head) (program_id 1).

    HEAD_CHUNK: the list's first CHUNK indices are loaded together with its count (no count -> last-index load
    chain before the loop; the compaction reuses them). Q_DESC / O_DESC: q load / out store through host TMA
    descriptors over the (B, H, S, D) views (tm == BLOCK_M only). POPC: the next-list compaction places each kept
    index by a popcount of the keep word below its lane (no scan, no cross-thread sum; not with forced tiles).
    PF_NEXT (CUDA only): L2 prefetch of q tile, list head and count of program pid + n_pf (n_pf = SM count).
    PROBE (debug builds, benchmarks only): per program, %clock64 at the phase ends, %globaltimer at entry / exit
    and %smid go to PRB[program, 0:16] (int64; layout in benchmarks/bench_skip.py `probe`)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    if PROBE:
        pr_g0 = _gclk()
        pr_c0 = _clk(pid_m)
    b = bh // Hq
    h = bh % Hq
    hk = h // n_rep
    b64 = b.to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = pid_m * TILE_M + offs_m
    row_ok = (rows < Sq) & (offs_m < TILE_M)

    q_base = Q + b64 * stride_qb + h * stride_qh
    k_base = K + b64 * stride_kb + hk * stride_kh
    v_base = V + b64 * stride_vb + hk * stride_vh
    if Q_DESC:
        q = QD.load([b, h, pid_m * TILE_M, 0]).reshape(BLOCK_M, HEAD_DIM)
    else:
        q = tl.load(q_base + rows[:, None] * stride_qs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    k_ptrs = k_base + offs_n[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = v_base + offs_n[:, None] * stride_vs + offs_d[None, :]
    if USE_TMA == 2:
        k_desc = KD
        v_desc = VD
    elif USE_TMA:
        k_desc = tl.make_tensor_descriptor(k_base, shape=[Sk, HEAD_DIM], strides=[stride_ks, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[Sk, HEAD_DIM], strides=[stride_vs, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
    else:
        k_desc = k_ptrs
        v_desc = v_ptrs

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    if SKIP:
        row = (b64 * Hq + h) * Tq + pid_m
        cnt_in, idx_in, cnt_out, idx_out, warm, write_ok = list_slots(
            CNT_IN, IDX_IN, CNT_OUT, IDX_OUT, row, Tk, STEP, warmup, slot_stride_cnt, slot_stride_idx, STATEFUL)
        offs_c = tl.arange(0, CHUNK_C)
        if HEAD_CHUNK:
            head = tl.load(idx_in + offs_c, mask=offs_c < Tk, other=0)
        else:
            head = offs_c
        j_next = tl.load(idx_in)
        cnt = tl.load(cnt_in)
        if PF_NEXT:
            # Program pid + n_pf (n_pf = SM count) starts about when this one ends, on some SM: pull its q tile,
            # list head and count into L2 now, so its prologue (list head -> first K/V load; q) waits on L2, not
            # DRAM (one-tile lists: 0.184 -> 0.153 ms at H12 S32760; benchmarks/NOTES.md v6).
            lin = bh * Tq + pid_m
            nxt = tl.minimum(lin + n_pf, Tq * tl.num_programs(1) - 1)
            bn_ = nxt // Tq
            pm_ = nxt % Tq
            d_row = (bn_ - bh).to(tl.int64) * Tq + (pm_ - pid_m)
            offs_l = tl.arange(0, 2 * BLOCK_M)
            r_ = tl.minimum(pm_ * TILE_M + offs_l // 2, Sq - 1)
            qn = (Q + (bn_ // Hq).to(tl.int64) * stride_qb + (bn_ % Hq) * stride_qh + r_.to(tl.int64) * stride_qs
                  + (offs_l % 2) * (HEAD_DIM // 2))
            _prefetch_l2(qn)
            offs_2 = tl.arange(0, 2)
            _prefetch_l2(tl.where(offs_2 == 0, idx_in + d_row * Tk, cnt_in + d_row))
        if STATEFUL:
            cnt = tl.where(warm, Tk, cnt)           # a warm-up call reads every tile
        # n_plain: listed tiles before a partial last k-tile (index Tk - 1), which the loop masks separately
        n_plain = cnt
        if LAST_PARTIAL:
            if HEAD_CHUNK:          # the last index is in the head unless the list is longer than it
                far = cnt > CHUNK_C
                last = tl.where(far, tl.load(idx_in + tl.maximum(cnt - 1, 0), mask=far, other=0),
                                tl.sum(tl.where(offs_c == cnt - 1, head, 0), 0))
            else:
                last = tl.load(idx_in + tl.maximum(cnt - 1, 0))
            if STATEFUL:
                last = tl.where(warm, Tk - 1, last)
            n_plain = tl.where((cnt > 0) & (last == Tk - 1), cnt - 1, cnt)
        frow = tl.full([], 0, tl.int32)
        if HAS_FORCED:
            frow = (tl.load(FROW + pid_m) != 0).to(tl.int32)
        if PROBE:
            pr_c1 = _clk(n_plain)
        widx = tl.arange(0, NWORDS)
        # One flat, software-pipelined loop over the listed tiles; per-row keep bits go into word it // 32.
        bits = tl.zeros([BLOCK_M, NWORDS], tl.int32)
        for it in tl.range(0, n_plain, warp_specialize=WARP_SPEC):
            if PREFETCH_J:  # the index of the next visited tile is loaded one iteration ahead
                j = j_next
                j_next = tl.load(idx_in + tl.minimum(it + 1, Tk - 1))
            elif DIRECT_J:  # ablation only (benchmarks): ignore the list's indices
                j = it
            else:
                j = tl.load(idx_in + it)
            if STATEFUL:
                j = tl.where(warm, it, j)
            m_before = m_i
            acc, l_i, m_i, tmax = _tile(acc, l_i, m_i, q, k_ptrs, v_ptrs, k_desc, v_desc, b, hk, j, offs_n, rows,
                                        Sk, qk_scale, stride_ks, stride_vs, TILE_N, BLOCK_N, False, USE_TMA)
            if not NO_KEEP:  # NO_KEEP: ablation only (benchmarks)
                hit = (((tmax - m_before) > threshold) & row_ok).to(tl.int32) << (it & 31)
                bits = bits | tl.where((widx == (it >> 5))[None, :], hit[:, None], 0)
        # The partial last k-tile (masked columns), if listed (at most one iteration).
        keep1 = tl.full([], 0, tl.int32)
        for it in range(n_plain, cnt):
            m_before = m_i
            acc, l_i, m_i, tmax = _tile(acc, l_i, m_i, q, k_ptrs, v_ptrs, k_desc, v_desc, b, hk, Tk - 1, offs_n, rows,
                                        Sk, qk_scale, stride_ks, stride_vs, TILE_N, BLOCK_N, True, USE_TMA)
            hit = ((tmax - m_before) > threshold) & row_ok
            keep1 = tl.max(hit.to(tl.int32), 0)
            if HAS_FORCED:
                keep1 = keep1 | frow | (tl.load(FCOL + Tk - 1) != 0).to(tl.int32)
        if PROBE:
            pr_c2 = _clk(tl.sum(l_i, 0).to(tl.int32, bitcast=True))
        # One cross-row OR reduction for all tiles, then compact the kept indices into the next list.
        words = tl.reduce(bits, 0, bit_or)
        if PROBE:
            pr_c3 = _clk(tl.sum(words, 0))
        out_cnt = write_next_list(words, keep1, head, idx_in, idx_out, cnt_out, FCOL, n_plain, Tk, warm, write_ok,
                                  frow, NWORDS, STATEFUL, HAS_FORCED, HEAD_CHUNK, POPC, False)
        if PROBE:
            pr_c4 = _clk(out_cnt)
    else:
        if CAUSAL:
            hi = tl.minimum(Sk, pid_m * TILE_M + BLOCK_M + causal_off)
            hi = tl.maximum(hi, 0)
            hi_full = tl.minimum(tl.maximum(pid_m * TILE_M + causal_off + 1, 0), hi) // BLOCK_N * BLOCK_N
        else:
            hi = Sk
            hi_full = Sk // BLOCK_N * BLOCK_N
        for start_n in tl.range(0, hi_full, BLOCK_N, warp_specialize=WARP_SPEC):
            acc, l_i, m_i, _r = _block(acc, l_i, m_i, q, k_ptrs, v_ptrs, k_desc, v_desc, b, hk, start_n, offs_n, rows,
                                       Sk, causal_off, qk_scale, stride_ks, stride_vs, BLOCK_N, False, False, USE_TMA)
        for start_n in range(hi_full, hi, BLOCK_N):
            acc, l_i, m_i, _r = _block(acc, l_i, m_i, q, k_ptrs, v_ptrs, k_desc, v_desc, b, hk, start_n, offs_n, rows,
                                       Sk, causal_off, qk_scale, stride_ks, stride_vs, BLOCK_N, True, CAUSAL, USE_TMA)

    _store_out(acc, l_i, m_i, O, LSE, OD, b, b64, h, pid_m, rows, row_ok, offs_d, stride_ob, stride_os, stride_oh,
               Sq, Hq, TILE_M, BLOCK_M, HEAD_DIM, WRITE_LSE, O_DESC)
    if PROBE:  # SKIP builds only
        pr_c6 = _clk(pid_m)
        pr_g1 = _gclk()
        offs_p = tl.arange(0, 16)
        vals = tl.where(offs_p == 0, pr_c0, 0)
        vals = tl.where(offs_p == 1, pr_c1, vals)
        vals = tl.where(offs_p == 2, pr_c2, vals)
        vals = tl.where(offs_p == 3, pr_c3, vals)
        vals = tl.where(offs_p == 4, pr_c4, vals)
        vals = tl.where(offs_p == 5, pr_c4, vals)
        vals = tl.where(offs_p == 6, pr_c6, vals)
        vals = tl.where(offs_p == 7, pr_g0, vals)
        vals = tl.where(offs_p == 8, pr_g1, vals)
        vals = tl.where(offs_p == 9, _smid().to(tl.int64), vals)
        tl.store(PRB + ((bh.to(tl.int64) * Tq + pid_m) * 16 + offs_p), vals)


LN2_C = tl.constexpr(LN2)

# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------

def supports_tile(tile) -> bool:
    """Skip tiles the kernel runs: tm in {16, 32, 64, 128}, tn a multiple of 16 up to 512."""
    try:
        tm, tn = check_tile(tile)
    except ValueError:
        return False
    return tm in (16, 32, 64, 128) and tn <= 512


def supports(q, attn_mask=None, causal: bool = False, tile=None) -> bool:
    """True when the Triton kernels run these inputs (else the dispatcher uses the reference)."""
    if attn_mask is not None or q.dim() != 4 or q.shape[-1] not in (64, 128):
        return False
    if tile is not None and not supports_tile(tile):
        return False
    if _interpret():
        return q.dtype in (torch.float16, torch.float32)
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _check_inputs(q, k, v, dims_ok=(64, 128)):
    dims = check_qkv(q, k, v)
    D = q.shape[-1]
    if D not in dims_ok:
        raise ValueError(f"q/k/v head dim must be one of {dims_ok} here, got {D} "
                         "(use sparsepatch.kernels.attention / skip_attention to fall back to the reference)")
    ok = (torch.float16, torch.float32) if _interpret() else (torch.float16, torch.bfloat16)
    if q.dtype not in ok:
        raise ValueError(f"q dtype must be one of {ok} for the Triton kernel, got {q.dtype}")
    if not _interpret() and not q.is_cuda:
        raise ValueError("q/k/v must be CUDA tensors for the Triton kernel (or set TRITON_INTERPRET=1)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on the head dim, got strides {t.stride()}")
    return dims


def _config(D, block_m, tn=None):
    table = CONFIGS if tn is None else SKIP_CONFIGS
    cfg = dict(table.get((D, block_m)) or table[(D, 64 if block_m <= 64 else 128)])
    bn = cfg["BLOCK_N"]
    if tn is not None:
        while tn % bn:
            bn //= 2
    cfg["BLOCK_N"] = bn
    return cfg


def _tma_ok(cfg, *ts):
    return (cfg.get("tma") and not _interpret() and hasattr(tl, "make_tensor_descriptor")
            and all(t.data_ptr() % 16 == 0 and (t.stride(1) * t.element_size()) % 16 == 0 for t in ts))


# Launch plans (host time: benchmarks/NOTES.md, skip forward v7). Key: every int / float / dtype / shape / stride
# argument and the config, so a plan is reused only where Triton would pick the same binary (ints are specialised
# on == 1 and % 16, pointers on 16-byte alignment: plans are made and used for aligned pointers only). A hit costs
# the key, one dict lookup and the direct launch; a miss runs the full path below and records the plan.
_PLANS: dict = {}
_DIRECT = [not _interpret()]   # False after a failed direct relaunch: Triton's launcher from then on
# per-call kernel parameters: name -> index into _launch's tensor tuple (None inputs are replaced by `out`)
_TENSOR_PARAMS = dict(Q=0, K=1, V=2, O=3, LSE=4, CNT_IN=5, IDX_IN=6, CNT_OUT=7, IDX_OUT=8, FROW=9, FCOL=10, STEP=11)
_DESC_PARAMS = dict(QD=0, KD=1, VD=2, OD=3)   # host descriptors over these tensors (or `out` as a dummy pointer)


def _launch(q, k, v, out, lse, *, cnt_in, idx_in, cnt_out, idx_out, frow, fcol, step, Tq, Tk, slot_cnt, slot_idx,
            warmup, scale, threshold, tm, tn, skip, stateful, causal, cfg):
    tensors = (q, k, v, out, lse, cnt_in, idx_in, cnt_out, idx_out, frow, fcol, step)
    key = None
    if _DIRECT[0] and "probe" not in cfg:
        aligned = all(t is None or t.data_ptr() % 16 == 0 for t in tensors)
        key = (q.get_device(), q.dtype, q.shape, k.shape, q.stride(), k.stride(), v.stride(), out.stride(),
               tuple(t is None for t in tensors[4:]), Tq, Tk, slot_cnt, slot_idx, warmup, scale, threshold, tm, tn,
               skip, stateful, causal, tuple(cfg.items())) if aligned else None
        plan = _PLANS.get(key) if key is not None else None
        if plan is not None:
            relaunch, template, tslots, dslots = plan
            args = list(template)
            for pos, i in tslots:
                t = tensors[i]
                args[pos] = out if t is None else t
            for pos, i, geometry in dslots:
                args[pos] = DescriptorArgs(tensors[i], *geometry)
            if relaunch_or_stop(relaunch, key[0], args, _DIRECT, _PLANS, "skip"):
                return
            key = None

    B, Sq, Hq, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    block_m = triton.next_power_of_2(tm)
    dummy = out
    kd = vd = None
    if cfg.get("host_desc") and (_interpret() or cfg.get("tma")):
        kd, vd = head_major_desc(k, cfg["BLOCK_N"]), head_major_desc(v, cfg["BLOCK_N"])
    if kd is not None and vd is not None:
        use_tma = 2
    else:
        kd = vd = dummy
        use_tma = int(bool(_tma_ok(cfg, k, v)))
    if use_tma == 1:
        set_tma_allocator()
    qd = od = None
    if use_tma == 2 and tm == block_m:
        if cfg.get("q_desc"):
            qd = head_major_desc(q, block_m)
        if cfg.get("o_desc"):
            od = head_major_desc(out, block_m)
    nwords = max(1, triton.next_power_of_2(num_tiles(Tk, CHUNK))) if skip else 1
    # pf_next: inline PTX prefetch, so CUDA only (the interpreter runs the same kernel without it)
    pf_next = bool(cfg.get("pf_next")) and skip and not _interpret()
    n_pf = num_sms(q.device) if pf_next else 0
    probe = cfg.get("probe") if skip else None  # benchmarks only: int64 (B * Hq * Tq, 16) phase clocks
    if probe is not None and (probe.numel() < B * Hq * Tq * 16 or probe.dtype != torch.int64):
        raise ValueError(f"cfg['probe'] must be an int64 tensor of >= {B * Hq * Tq * 16} elements")
    params = dict(
        Q=q, K=k, V=v, O=out, LSE=lse if lse is not None else dummy,
        CNT_IN=cnt_in if cnt_in is not None else dummy, IDX_IN=idx_in if idx_in is not None else dummy,
        CNT_OUT=cnt_out if cnt_out is not None else dummy, IDX_OUT=idx_out if idx_out is not None else dummy,
        FROW=frow if frow is not None else dummy, FCOL=fcol if fcol is not None else dummy,
        STEP=step if step is not None else dummy, QD=dummy if qd is None else qd, OD=dummy if od is None else od,
        stride_qb=q.stride(0), stride_qs=q.stride(1), stride_qh=q.stride(2), stride_kb=k.stride(0),
        stride_ks=k.stride(1), stride_kh=k.stride(2), stride_vb=v.stride(0), stride_vs=v.stride(1),
        stride_vh=v.stride(2), stride_ob=out.stride(0), stride_os=out.stride(1), stride_oh=out.stride(2),
        Sq=Sq, Sk=Sk, Hq=Hq, n_rep=Hq // Hk, Tq=Tq, Tk=Tk, slot_stride_cnt=slot_cnt, slot_stride_idx=slot_idx,
        warmup=warmup, qk_scale=scale * LOG2E, threshold=threshold, causal_off=Sk - Sq, KD=kd, VD=vd,
        HEAD_DIM=D, BLOCK_M=block_m, TILE_M=tm, BLOCK_N=cfg["BLOCK_N"], TILE_N=tn, SKIP=skip, STATEFUL=stateful,
        HAS_FORCED=frow is not None, LAST_PARTIAL=bool(skip and Sk % tn), CAUSAL=causal, WRITE_LSE=lse is not None,
        USE_TMA=use_tma, WARP_SPEC=bool(cfg.get("ws", False)),
        NWORDS=nwords,
        PREFETCH_J=bool(cfg.get("prefetch_j", False)), DIRECT_J=bool(cfg.get("ablate_direct_j", False)),
        NO_KEEP=bool(cfg.get("ablate_keep", False)),
        HEAD_CHUNK=bool(skip and cfg.get("head_chunk", False)), Q_DESC=qd is not None, O_DESC=od is not None,
        POPC=bool(skip and cfg.get("popc", False)), PF_NEXT=pf_next, n_pf=n_pf,
        PRB=probe if probe is not None else dummy, PROBE=probe is not None,
    )
    grid = (Tq, B * Hq)
    names = _fwd_kernel.arg_names
    # positional: the kernel's `warmup` parameter would clash with JITFunction.run's keyword of that name
    kern = _fwd_kernel[grid](*[params[n] for n in names], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if key is not None and use_tma != 1 and key[0] == torch.cuda.current_device():
        relaunch = direct_launcher(kern, grid)
        if relaunch is not None:
            tslots = [(pos, _TENSOR_PARAMS[n]) for pos, n in enumerate(names) if n in _TENSOR_PARAMS]
            tslots += [(names.index("PRB"), 3)]
            dslots = []
            for n, i in _DESC_PARAMS.items():
                pos = names.index(n)
                if params[n] is dummy:
                    tslots.append((pos, 3))
                else:
                    d = params[n]
                    dslots.append((pos, i, (d.shape, d.strides, d.block_shape, d.padding)))
            # the plan holds no tensor: per-call slots are filled at each launch
            per_call = {pos for pos, _ in tslots} | {pos for pos, _, _ in dslots}
            template = [None if pos in per_call else params[n] for pos, n in enumerate(names)]
            if len(_PLANS) > 64:
                _PLANS.clear()
            _PLANS[key] = (relaunch, template, tslots, dslots)


def _ranges_to_tiles(must_do, S, t):
    """Half-open tile ranges [lo, hi) covered by must_do token ranges along a sequence of S tokens, tile t."""
    out = []
    for start, end in must_do:
        if end > start and start < S:
            out.append((start // t, num_tiles(min(end, S), t)))
    return out


def _forced_flags(must_do, Sq, Sk, tm, tn, device):
    """int8 (Tq,) row flags and (Tk,) column flags of must_do tiles, built on the device (no host->device copy)."""
    if not must_do:
        return None, None
    reference.must_do_tiles(must_do, Sq, Sk, (tm, tn))  # validation, same errors as the reference
    tq, tk = num_tiles(Sq, tm), num_tiles(Sk, tn)
    must_do = [(int(a), int(b)) for a, b in must_do]
    ar = torch.arange(tq, device=device)
    ac = torch.arange(tk, device=device)
    frow = torch.zeros(tq, dtype=torch.bool, device=device)
    fcol = torch.zeros(tk, dtype=torch.bool, device=device)
    for lo, hi in _ranges_to_tiles(must_do, Sq, tm):
        frow |= (ar >= lo) & (ar < hi)
    for lo, hi in _ranges_to_tiles(must_do, Sk, tn):
        fcol |= (ac >= lo) & (ac < hi)
    return frow.to(torch.int8), fcol.to(torch.int8)


def _union(counts, indices, frow, fcol):
    """counts/indices (..., Tq[, Tk]) with every forced tile added, ascending; device ops only."""
    tk = indices.shape[-1]
    slot = torch.arange(tk, device=indices.device)
    valid = slot < counts.unsqueeze(-1)
    # add, not assign: the unused slots (pointed at tile 0 here) must not overwrite a listed tile 0 (scatter_ with
    # duplicate indices keeps an unspecified one of the values)
    hits = torch.zeros(indices.shape, dtype=torch.int32, device=indices.device)
    hits.scatter_add_(-1, torch.where(valid, indices.long(), 0), valid.to(torch.int32))
    mask = (hits > 0) | frow.bool()[:, None] | fcol.bool()[None, :]
    ucounts = mask.sum(-1, dtype=torch.int32)
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return ucounts, order


# ----------------------------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------------------------

_GLUON_OK = [True]   # False after a failed Gluon launch (another Triton's Gluon API): the Triton kernels from then on


class GluonUnavailable(ValueError):
    """A head-dim-256 dense call that only the Gluon kernel runs, which cannot take it here (no Gluon build, a
    failed launch, an unaligned pointer): the dense op's flash backend then runs it on the split-D kernel."""


def _gluon_call(fn, *args, **kwargs):
    """fn(*args) on the Gluon kernel (gluon.py), or None after warning once if it cannot run here."""
    try:
        return fn(*args, **kwargs)
    except torch.OutOfMemoryError:   # not the kernel's fault: the Triton path would need the same memory
        raise
    except Exception as exc:  # noqa: BLE001  (compile / launch failure: same function on the Triton kernel)
        warnings.warn(f"sparsepatch: the Gluon attention kernel failed ({type(exc).__name__}: {str(exc)[:200]}); "
                      "using the Triton kernels")
        _GLUON_OK[0] = False
        return None


def _gluon_options(cfg):
    """The Gluon kernel's options in a CONFIGS / SKIP_CONFIGS entry (keys `gluon_<option>`; benchmarks and tests set
    them), or None for its defaults (skip_gluon.GLUON_SKIP_CONFIG)."""
    return {kk[6:]: vv for kk, vv in cfg.items() if kk.startswith("gluon_")} or None


def _skip_fwd_impl(q, k, v, counts, indices, threshold, scale, tm, tn, must_do_flat, return_lse):
    B, Sq, Hq, D = q.shape
    Sk = k.shape[1]
    Tq, Tk = num_tiles(Sq, tm), num_tiles(Sk, tn)
    must_do = list(zip(must_do_flat[0::2], must_do_flat[1::2]))
    frow, fcol = _forced_flags(must_do, Sq, Sk, tm, tn, q.device)
    counts = counts.contiguous()
    indices = indices.contiguous()
    if frow is not None:
        counts, indices = _union(counts, indices, frow, fcol)
    cfg = _config(D, triton.next_power_of_2(tm), tn)
    if cfg.get("gluon") and _GLUON_OK[0] and not _interpret():
        from . import gluon as skip_gluon
        if skip_gluon.supported(q, k, v, (tm, tn)):
            res = _gluon_call(skip_gluon.skip_fwd, q, k, v, counts, indices, threshold, scale, return_lse,
                              cfg=_gluon_options(cfg), forced=None if frow is None else (frow, fcol))
            if res is not None:
                return res
    out = torch.empty((B, Sq, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device) if return_lse else None
    next_counts = torch.empty((B, Hq, Tq), dtype=torch.int32, device=q.device)
    next_indices = torch.empty((B, Hq, Tq, Tk), dtype=torch.int32, device=q.device)
    _launch(q, k, v, out, lse, cnt_in=counts, idx_in=indices, cnt_out=next_counts, idx_out=next_indices,
            frow=frow, fcol=fcol, step=None, Tq=Tq, Tk=Tk, slot_cnt=0, slot_idx=0, warmup=0, scale=scale,
            threshold=threshold, tm=tm, tn=tn, skip=True, stateful=False, causal=False, cfg=cfg)
    if lse is None:
        lse = q.new_empty((0,), dtype=torch.float32)
    return out, next_counts, next_indices, lse


@torch.library.custom_op("sparsepatch::skip_fwd", mutates_args=())
def _skip_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor, indices: torch.Tensor,
              threshold: float, scale: float, tm: int, tn: int, must_do_flat: list[int],
              return_lse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _skip_fwd_impl(q, k, v, counts, indices, threshold, scale, tm, tn, must_do_flat, return_lse)


@_skip_fwd.register_fake
def _(q, k, v, counts, indices, threshold, scale, tm, tn, must_do_flat, return_lse):
    B, Sq, Hq, D = q.shape
    Tq, Tk = num_tiles(Sq, tm), num_tiles(k.shape[1], tn)
    out, lse = empty_out_lse(q, return_lse)
    return (out, q.new_empty((B, Hq, Tq), dtype=torch.int32), q.new_empty((B, Hq, Tq, Tk), dtype=torch.int32), lse)


def _dense_block_m(Sq):
    return 64 if Sq <= 64 else 128


def _dense_fwd_impl(q, k, v, causal, scale, return_lse):
    B, Sq, Hq, D = q.shape
    gcfg = CONFIGS.get((D, 128), {})
    if gcfg.get("gluon") and (not causal or gcfg.get("causal_gluon")) and _GLUON_OK[0] and not _interpret():
        from . import gluon as skip_gluon
        if skip_gluon.supported(q, k, v, (128, 128), dense=True) and (
                not causal or skip_gluon.supports_causal(q, k)):
            res = _gluon_call(skip_gluon.dense_fwd, q, k, v, scale, return_lse, cfg=_gluon_options(gcfg),
                              causal=causal)
            if res is not None:
                return res
    if D not in (64, 128):
        raise GluonUnavailable(f"head dim {D} runs on the Gluon kernel only (sm_90, sequence- or head-major inputs, "
                               f"causal with Sk - Sq a multiple of 128), which cannot take this call here")
    out = torch.empty((B, Sq, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device) if return_lse else None
    bm = _dense_block_m(Sq)
    _launch(q, k, v, out, lse, cnt_in=None, idx_in=None, cnt_out=None, idx_out=None, frow=None, fcol=None,
            step=None, Tq=num_tiles(Sq, bm), Tk=0, slot_cnt=0, slot_idx=0, warmup=0, scale=scale, threshold=-1.0,
            tm=bm, tn=_config(D, bm)["BLOCK_N"], skip=False, stateful=False, causal=causal, cfg=_config(D, bm))
    if lse is None:
        lse = q.new_empty((0,), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("sparsepatch::dense_fwd", mutates_args=())
def _dense_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
               return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _dense_fwd_impl(q, k, v, causal, scale, return_lse)


@_dense_fwd.register_fake
def _(q, k, v, causal, scale, return_lse):
    return empty_out_lse(q, return_lse)


# ----------------------------------------------------------------------------------------------------------------
# Public entries
# ----------------------------------------------------------------------------------------------------------------

def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def attention(q, k, v, *, causal: bool = False, scale=None, return_lse: bool = False):
    """Dense flash forward. q (B, Sq, Hq, D), k/v (B, Sk, Hk, D) -> out (B, Sq, Hq, D) [, lse (B, Hq, Sq) fp32].

    causal: bottom-right aligned (query i sees keys <= Sk - Sq + i), as in `reference.attention`. Head dim 256:
    inference only, on the Gluon kernel (`gluon.supported(..., dense=True)` inputs).
    """
    _check_inputs(q, k, v, (64, 128, 256))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    # Eager inference calls skip the custom-op dispatch (tens of us of host time); compiled graphs and calls that
    # need a gradient go through the op, whose autograd (skip_backward.py) needs the LSE.
    needs_grad = _needs_grad(q, k, v)
    if needs_grad and q.shape[-1] == 256:
        raise ValueError("head dim 256 is inference only here (no backward kernel): q/k/v must not require grad")
    fwd = _dense_fwd if (torch.compiler.is_compiling() or needs_grad) else _dense_fwd_impl
    out, lse = fwd(q, k, v, bool(causal), scale, bool(return_lse) or needs_grad)
    return (out, lse) if return_lse else out


def skip_attention(q, k, v, skip_list: SkipList | None = None, threshold: float = -5.0, *, scale=None,
                   must_do=None, return_lse: bool = False, tile=DEFAULT_TILE):
    """Temporal skip-list attention: the same function as `reference.skip_attention`, on the Triton kernel.

    Returns (out (B, Sq, Hq, D), next_list) or (out, next_list, lse (B, Hq, Sq) fp32).
    """
    B, Sq, Sk, Hq, Hk, D = _check_inputs(q, k, v)
    threshold = check_threshold(threshold)
    if skip_list is None:
        tm, tn = check_tile(tile)
    else:
        reference.check_skip_list(skip_list, B, Hq, Sq, Sk)
        tm, tn = skip_list.tile
    if not supports_tile((tm, tn)):
        raise ValueError(f"tile must have tm in (16, 32, 64, 128) and tn a multiple of 16 <= 512 for the Triton "
                         f"kernel, got {(tm, tn)}")
    if skip_list is None:
        skip_list = SkipList.full(B, Hq, Sq, Sk, (tm, tn), device=q.device)
    must_do_flat = [int(x) for rng in (must_do or []) for x in rng]
    if must_do:
        reference.must_do_tiles(must_do, Sq, Sk, (tm, tn))
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    needs_grad = _needs_grad(q, k, v)
    fwd = _skip_fwd if (torch.compiler.is_compiling() or needs_grad) else _skip_fwd_impl
    out, nc, ni, lse = fwd(q, k, v, skip_list.counts, skip_list.indices, threshold, scale, tm, tn,
                           must_do_flat, bool(return_lse) or needs_grad)
    nxt = SkipList(nc, ni, (tm, tn), Sq, Sk)
    return (out, nxt, lse) if return_lse else (out, nxt)


def skip_step(q, k, v, counts, indices, step, density, threshold, warmup_steps, tm, tn, scale, must_do_flat):
    """CUDA body of `sparsepatch::skip_step`: same semantics as `stateful._skip_step_portable` (the reference backend), no host sync.

    counts (2, B, H, Tq) / indices (2, B, H, Tq, Tk) are the list slots, step int64 (1,), density fp32 (N, B).
    The kernel reads `step` itself: calls < warmup_steps run dense and leave the lists alone; later calls read
    slot (step - warmup) % 2 and write the other one. The density record and the step increment follow in one
    launch (`_step_density`).
    """
    B, Sq, Sk, Hq, Hk, D = _check_inputs(q, k, v)
    threshold = check_threshold(threshold)
    if not supports_tile((tm, tn)):
        raise ValueError(f"tile {(tm, tn)} is not supported by the Triton kernel")
    Tq, Tk = num_tiles(Sq, tm), num_tiles(Sk, tn)
    must_do = list(zip(must_do_flat[0::2], must_do_flat[1::2]))
    frow, fcol = _forced_flags(must_do, Sq, Sk, tm, tn, q.device)
    cnt_in, idx_in = counts, indices
    if frow is not None:
        cnt_in, idx_in = _union(counts, indices, frow, fcol)
    cfg = _config(D, triton.next_power_of_2(tm), tn)
    out = None
    if cfg.get("gluon") and _GLUON_OK[0] and not _interpret():
        from . import gluon as skip_gluon
        # (must_do: the kernel reads the union's slots and writes the buffers', so their slot strides must agree)
        slots_ok = counts[0].is_contiguous() and indices[0].is_contiguous() and (
            frow is None or (counts.stride(0), indices.stride(0)) == (cnt_in.stride(0), idx_in.stride(0)))
        if skip_gluon.supported(q, k, v, (tm, tn)) and slots_ok:
            out = _gluon_call(skip_gluon.skip_step, q, k, v, counts, indices, step, warmup_steps, threshold,
                              float(scale), cfg=_gluon_options(cfg),
                              read=None if frow is None else (cnt_in, idx_in),
                              forced=None if frow is None else (frow, fcol))
    if out is None:
        out = torch.empty((B, Sq, Hq, D), dtype=q.dtype, device=q.device)
        _launch(q, k, v, out, None, cnt_in=cnt_in, idx_in=idx_in, cnt_out=counts, idx_out=indices, frow=frow,
                fcol=fcol, step=step, Tq=Tq, Tk=Tk, slot_cnt=counts.stride(0), slot_idx=indices.stride(0),
                warmup=int(warmup_steps), scale=float(scale), threshold=threshold, tm=tm, tn=tn, skip=True,
                stateful=True, causal=False, cfg=cfg)
    # the call's density (from the slot it read, which the kernel did not write) and step += 1, in one launch
    _step_density(cnt_in, step, density, int(warmup_steps), Tk)
    return out


@triton.jit
def _step_density_kernel(CNT, STEP, DENS, slot_stride, per_batch, B, cap, n_warmup, Tk, stride_d, stride_b,
                         BLOCK: tl.constexpr):
    """One program, after the attention kernel (which reads *STEP): the fraction of tiles the call computed per
    batch element (its read slot's counts / (H * Tq * Tk); 1 for a warm-up call) into DENS[step, b] while
    step < cap, then *STEP += 1."""
    n = tl.load(STEP)
    warm = n < n_warmup
    rd = tl.where(warm, 0, (n - n_warmup) % 2)
    offs = tl.arange(0, BLOCK)
    for b in range(B):
        base = CNT + rd * slot_stride + b * per_batch
        acc = tl.zeros([BLOCK], tl.int32)
        for off in range(0, per_batch, BLOCK):
            acc += tl.load(base + off + offs, mask=off + offs < per_batch, other=0)
        dens = tl.sum(acc, 0).to(tl.float32) / per_batch / Tk
        tl.store(DENS + n * stride_d + b * stride_b, tl.where(warm, 1.0, dens), mask=n < cap)
    tl.store(STEP, n + 1)


_STEP_PLANS: dict = {}


def _step_density(cnt, step, density, warmup, Tk):
    """Launch `_step_density_kernel` on cnt (2, B, H, Tq) int32 list counts (the slots the call reads), step int64
    (1,), density fp32 (cap, B). A launch plan per geometry (Triton's C launcher: ~10 us of host time instead of the
    ~12 small torch ops this replaced)."""
    cnt = cnt.contiguous()   # (read only; already contiguous for the patcher's buffers and the must_do union)
    B = cnt.shape[1]
    per_batch = cnt.shape[2] * cnt.shape[3]
    args = [cnt, step, density, cnt.stride(0), per_batch, B, density.shape[0], warmup, Tk, density.stride(0),
            density.stride(1)]
    key = (cnt.device.index, *args[3:], *(t.data_ptr() % 16 == 0 for t in args[:3]))   # (pointer alignment too)
    relaunch = _STEP_PLANS.get(key) if _DIRECT[0] else None
    if relaunch is not None:
        relaunch(current_stream(cnt.device.index), *args, 1024)
    else:
        kern = _step_density_kernel[(1,)](*args, BLOCK=1024, num_warps=4)
        if _DIRECT[0] and cnt.is_cuda and cnt.device.index == torch.cuda.current_device():
            relaunch = direct_launcher(kern, (1,))
            if relaunch is not None:
                if len(_STEP_PLANS) > 64:
                    _STEP_PLANS.clear()
                _STEP_PLANS[key] = relaunch


@triton.jit
def _repair_nonfinite_kernel(O, CNT, IDX, STEP, NF, stride_ob, stride_os, stride_oh, Sq, Hq, Tq, Tk, D, n_warmup,
                             slot_cnt, slot_idx, TM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_T: tl.constexpr):
    """One program per (b, h, q-tile), after a stateful call (*STEP already counts it): if the call was past warm-up
    and this q-tile's output (B, Sq, Hq, D) holds a NaN / inf, the slot the call wrote gets the list it read
    (those rows' keep tests saw non-finite scores); NF[0] counts such calls once each (NF[1] = 1 + the last call
    counted, so the first program to see a bad tile of call n counts it)."""
    pid = tl.program_id(0)
    t = pid % Tq
    bh = pid // Tq
    h = bh % Hq
    b = bh // Hq
    n = tl.load(STEP) - 1
    base = O + b.to(tl.int64) * stride_ob + h * stride_oh
    cols = tl.arange(0, BLOCK_D)
    bad = tl.zeros([], tl.int32)
    for r0 in range(0, TM, ROWS):
        rows = t * TM + r0 + tl.arange(0, ROWS)
        ok = (rows < Sq)[:, None] & (cols < D)[None, :]
        x = tl.load(base + rows[:, None].to(tl.int64) * stride_os + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        finite = (x == x) & (tl.abs(x) < float("inf"))
        bad += tl.sum(tl.sum((~finite).to(tl.int32), 1), 0)
    if (bad > 0) & (n >= n_warmup):
        rd = (n - n_warmup) % 2
        wr = 1 - rd
        tl.store(CNT + wr * slot_cnt + pid, tl.load(CNT + rd * slot_cnt + pid))
        offs = tl.arange(0, BLOCK_T)
        for j0 in range(0, Tk, BLOCK_T):
            jm = j0 + offs < Tk
            row = IDX + pid.to(tl.int64) * Tk + j0 + offs
            tl.store(row + wr * slot_idx, tl.load(row + rd * slot_idx, mask=jm, other=0), mask=jm)
        prev = tl.atomic_max(NF + 1, n + 1)
        if prev < n + 1:
            tl.atomic_add(NF, 1)


def repair_nonfinite(out, counts, indices, step, warmup, tm, nonfinite) -> None:
    """Launch `_repair_nonfinite_kernel`: out (B, Sq, Hq, D) with unit stride in D, counts int32 (2, B, Hq, Tq) /
    indices int32 (2, B, Hq, Tq, Tk) the list slots (each slot contiguous), step int64 (1,) already incremented,
    nonfinite int64 (2,). One launch instead of ~15 small torch ops (~0.4 ms of host time per patched call)."""
    B, Sq, Hq, D = out.shape
    Tq, Tk = counts.shape[3], indices.shape[4]
    rows = min(tm, max(1, 4096 // triton.next_power_of_2(D)))
    _repair_nonfinite_kernel[(B * Hq * Tq,)](
        out, counts, indices, step, nonfinite, out.stride(0), out.stride(1), out.stride(2), Sq, Hq, Tq, Tk, D,
        warmup, counts.stride(0), indices.stride(0), TM=tm, ROWS=rows, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_T=min(1024, triton.next_power_of_2(Tk)), num_warps=4)


# The autograd of sparsepatch::skip_fwd / dense_fwd: the backward kernels live in their own module.
skip_backward.make_differentiable("sparsepatch::skip_fwd")
skip_backward.make_differentiable("sparsepatch::dense_fwd")
