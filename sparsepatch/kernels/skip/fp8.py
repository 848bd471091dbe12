"""fp8 temporal skip-list forward (inference, Hopper, head dim 64 / 128): the listed-tile loop and in-kernel next
list of `triton.py` on the quantized operands of `dense/fp8.py` (int8 or e4m3 Q K^T with per-block q/k scales,
e4m3 P V with per-channel v scales, the inputs quantized inside the call), plus the CPU emulation
(`skip_attention_emulated`).

Layout as every skip backend: q (B, Sq, Hq, D), k/v (B, Sk, Hk, D); lists in the `SkipList` format (counts
(B, Hq, Tq), indices (B, Hq, Tq, Tk) ascending), so `stateful.py`'s slots are read and written unchanged.

Semantics: `reference.skip_attention` applied to the dequantized q/k/v (`quantize_fp8_reference` with q blocks
of the kernel's program rows): the keep test `(tile_max - running_max_before) * scale * log2(e) > threshold`
runs on the dequantized scores (q8 . k8) * s_q * s_k. Where the lists can differ from bf16 lists: a tile whose
gain lies within the score error of the quantization of the threshold flips (int8 Q K^T, per-128-row scales:
score error ~ |q| |k| / 127 per element, i.e. a few 1e-2 in log2 units at Wan-like magnitudes; BENCHMARKS.md /
NOTES give the measured fraction). The kernel's q8 / k8 / v8 and scales are the emulation's bit for bit
(`dense.fp8._quant_tile`), so the two differ only by fp32 rounding of the same scores (exact int32 dot products
times the scales vs a dot of dequantized values), the kernel's exp2 / log2 approximations and P's e4m3 rounding.

Tiles: tm in {64, 128}, tn a multiple of 64 up to 512 (the k scale blocks are 128 rows: a sub-block of 64 keys
reads its block's scale). Programs are BLOCK_M = 64 rows (4 warps, two programs per SM, as `attention_fp8`'s
default): a 128-row skip q-tile is served by two programs that read the same list; each ORs its rows' keep bits
into its own half of a scratch row, and the second to finish (an acq_rel arrival counter) merges both halves and
writes the next list. cfg block_m=128 runs one 8-warp program per q-tile instead (no scratch, no counter).
"""
from __future__ import annotations

import math
import warnings

import torch
import triton
import triton.language as tl

from .._common import DescriptorArgs, LaunchPlans, bit_or, interpret, list_slots, set_tma_allocator
from ..dense.fp8 import _QINV, FP8_BLOCK, FP8_LOG2_P_SCALE, QK_FORMATS, _qk_scores, _quant_tile, quantize_fp8, \
    quantize_fp8_reference
from ..dense.reference import LOG2E, check_qkv
from . import reference
from .nextlist import CHUNK, write_next_list
from .reference import check_threshold
from .skiplist import DEFAULT_TILE, SkipList, check_tile, num_tiles

LN2 = 0.6931471805599453
LN2_C = tl.constexpr(LN2)

# Launch settings: 64-row programs of one warpgroup (two per SM: one's softmax overlaps the other's wgmma, as in
# attention_fp8), 3 stages; host_desc: K8 / V^T8 TMA descriptors built on the host (no per-program descriptor
# build: it is part of the fixed cost per q-tile program that dominates at low density, skip NOTES v5), over the
# 4-D (B, Hk, Sk, D) / (B, Hk, D, Sk) views.
# keep_row: keep bits accumulated per row (one int32 per row, layout of m_i) and OR-reduced across rows once per
# 32 visited tiles; False: the round-1 [BLOCK_M, NWORDS] select per tile, one reduction at the end (measured 2.7%
# slower at density 1, skip fp8 round 2; kept for the A/B). diag: timing diagnostics only, wrong results at
# density < 1: "seqidx" visits tiles 0..cnt-1 instead of the listed ones (no index loads), "nokeep" skips the keep
# test (empty next list).
# Schedule (always on; measured kernel alone, H200, B1 H12 S32760 D128, density 1 / 0.5 / 0.13, paired ratios,
# results/h200-skip-fp8-s15.json): the P V wgmma of a listed tile waits for the row sum (an exact
# fma(l, 0, alpha) dependency), so the sum's adds and shuffles run before the P V issue as in attention_fp8's loop
# (-3.6 to -5.4%); the list's count / first / last index are loaded at the program's start, under q's load, not
# after q's quantization (-0.4 to -2.4%).
FP8_SKIP_CONFIG = dict(block_m=64, num_warps=4, num_stages=3, host_desc=True, keep_row=True, diag="")
_DIAGS = ("", "seqidx", "nokeep")


def supports_tile(tile) -> bool:
    """Tiles the fp8 skip kernel runs: tm in {64, 128}, tn a multiple of 64 up to 512."""
    try:
        tm, tn = check_tile(tile)
    except ValueError:
        return False
    return tm in (64, 128) and tn % 64 == 0 and tn <= 512


@triton.jit
def _sub_block(acc, l_i, m_i, q, cq, k_desc, v_desc, ks_base, b, hk, start_n, offs_n, Sk,
               D: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr, QK_ACC: tl.constexpr,
               LOG2_PS: tl.constexpr, DESC: tl.constexpr, FBLK: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) step of the online softmax on the quantized operands; returns (acc, l_i, m_i, the
    block's row max of the dequantized scores in log2 units). (b, hk) = (batch, kv head)."""
    if DESC == 1:      # host descriptors over the 4-D (B, Hk, Sk, D) / (B, Hk, D, Sk) views
        k = k_desc.load([b, hk, start_n, 0]).reshape(BLOCK_N, D)
        vt = v_desc.load([b, hk, 0, start_n]).reshape(D, BLOCK_N)
    else:              # descriptors built in the kernel, per (batch, kv head)
        k = k_desc.load([start_n, 0])
        vt = v_desc.load([0, start_n])
    c = cq * tl.load(ks_base + start_n // FBLK)
    if MASK_N:
        cols = start_n + offs_n
        s = tl.where((cols < Sk)[None, :], _qk_scores(q, k, QK_ACC) * c, float("-inf"))
        rmax = tl.max(s, 1)
        m_new = tl.maximum(m_i, rmax)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - (m_use - LOG2_PS)[:, None])
    else:
        s = _qk_scores(q, k, QK_ACC)
        rmax = tl.max(s, 1) * c       # c > 0: max(s) * c == max(s * c) (rounding is monotonic)
        m_new = tl.maximum(m_i, rmax)
        m_use = m_new
        # P is produced already scaled by 2^LOG2_PS (exponent offset, no multiply); l carries the same factor.
        p = tl.math.exp2(s * c - (m_use - LOG2_PS)[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if not MASK_N:
        # alpha + 0 * l_i is alpha exactly (l_i is finite: P <= 2^LOG2_PS per key), but the P V wgmma now depends
        # on the row sum, so the compiler finishes the sum before issuing it (dense/fp8.py's order) instead of
        # leaving its adds and shuffles between the P V issue and the next Q K^T issue (the masked tile runs at
        # most once, after the loop: nothing to overlap)
        alpha = tl.fma(l_i, 0.0, alpha)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(vt.dtype), tl.trans(vt), acc)
    return acc, l_i, m_new, rmax


@triton.jit
def _tile(acc, l_i, m_i, q, cq, k_desc, v_desc, ks_base, b, hk, j, offs_n, Sk,
          D: tl.constexpr, TILE_N: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr,
          QK_ACC: tl.constexpr, LOG2_PS: tl.constexpr, DESC: tl.constexpr, FBLK: tl.constexpr):
    """All sub-blocks of skip tile j; returns (acc, l_i, m_i, row max over the tile, log2 units)."""
    acc, l_i, m_i, tmax = _sub_block(acc, l_i, m_i, q, cq, k_desc, v_desc, ks_base, b, hk, j * TILE_N, offs_n, Sk,
                                     D, BLOCK_N, MASK_N, QK_ACC, LOG2_PS, DESC, FBLK)
    for sb in tl.static_range(1, TILE_N // BLOCK_N):
        acc, l_i, m_i, rmax = _sub_block(acc, l_i, m_i, q, cq, k_desc, v_desc, ks_base, b, hk,
                                         j * TILE_N + sb * BLOCK_N, offs_n, Sk, D, BLOCK_N, MASK_N, QK_ACC, LOG2_PS,
                                         DESC, FBLK)
        tmax = tl.maximum(tmax, rmax)
    return acc, l_i, m_i, tmax


@triton.jit
def _listed_tiles(acc, l_i, m_i, q, cq, k_desc, v_desc, ks_base, b, hk, idx_in, j0, n_plain, Tk, warm, row_ok,
                  offs_n, Sk, threshold,
                  D: tl.constexpr, TILE_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  QK_ACC: tl.constexpr, LOG2_PS: tl.constexpr, DESC: tl.constexpr, FBLK: tl.constexpr,
                  NWORDS: tl.constexpr, STATEFUL: tl.constexpr, SEQ: tl.constexpr, KEEP_ROW: tl.constexpr,
                  NO_KEEP: tl.constexpr):
    """The listed full k-tiles 0 .. n_plain - 1 of a row (idx_in: its list, j0 = its first index) -> (acc, l_i,
    m_i, keep words: bit it % 32 of word it // 32 set iff visited tile `it` passes the keep test in some row of
    the program). SEQ (diagnostic "seqidx"): tile `it` at step `it` for every row, the list unread. NO_KEEP
    (diagnostic): no keep test, no words."""
    widx = tl.arange(0, NWORDS)
    words = tl.zeros([NWORDS], tl.int32)
    rbits = tl.zeros([BLOCK_M], tl.int32)
    if not KEEP_ROW:
        bits = tl.zeros([BLOCK_M, NWORDS], tl.int32)
    j_next = j0
    for it in range(0, n_plain):
        if SEQ:
            j = it
        else:
            j = j_next       # the index of the next visited tile is loaded one iteration ahead
            j_next = tl.load(idx_in + tl.minimum(it + 1, Tk - 1))
            if STATEFUL:
                j = tl.where(warm, it, j)
        m_before = m_i
        acc, l_i, m_i, tmax = _tile(acc, l_i, m_i, q, cq, k_desc, v_desc, ks_base, b, hk, j, offs_n, Sk, D,
                                    TILE_N, BLOCK_N, False, QK_ACC, LOG2_PS, DESC, FBLK)
        if not NO_KEEP:
            hit = (((tmax - m_before) > threshold) & row_ok).to(tl.int32) << (it & 31)
            if KEEP_ROW:
                # keep bits per row in the layout of the row statistics (no [BLOCK_M, NWORDS] select and no layout
                # change per tile); the cross-row OR runs once per 32 visited tiles
                rbits = rbits | hit
                if ((it & 31) == 31) | (it + 1 == n_plain):
                    w = tl.reduce(rbits, 0, bit_or)
                    words = words | tl.where(widx == (it >> 5), w, 0)
                    rbits = tl.zeros([BLOCK_M], tl.int32)
            else:
                bits = bits | tl.where((widx == (it >> 5))[None, :], hit[:, None], 0)
    if not KEEP_ROW:
        words = tl.reduce(bits, 0, bit_or)
    return acc, l_i, m_i, words


@triton.jit
def _list_head(CNT_IN, IDX_IN, CNT_OUT, IDX_OUT, FROW, STEP, row, pid_m, Tk, n_warmup, slot_stride_cnt,
               slot_stride_idx, STATEFUL: tl.constexpr, LAST_PARTIAL: tl.constexpr, HAS_FORCED: tl.constexpr):
    """The list slots of q-tile `row` and what the loop needs before it starts -> (cnt_in, idx_in, cnt_out,
    idx_out, warm, write_ok, cnt, n_plain (listed tiles before a partial last k-tile, index Tk - 1, which the
    masked loop visits), j0 (first listed index), frow (must_do row flag, 0 without must_do))."""
    cnt_in, idx_in, cnt_out, idx_out, warm, write_ok = list_slots(
        CNT_IN, IDX_IN, CNT_OUT, IDX_OUT, row, Tk, STEP, n_warmup, slot_stride_cnt, slot_stride_idx, STATEFUL)
    cnt = tl.load(cnt_in)
    j0 = tl.load(idx_in)
    if STATEFUL:
        cnt = tl.where(warm, Tk, cnt)           # a warm-up call reads every tile
        j0 = tl.where(warm, 0, j0)
    n_plain = cnt
    if LAST_PARTIAL:
        last = tl.load(idx_in + tl.maximum(cnt - 1, 0))
        if STATEFUL:
            last = tl.where(warm, Tk - 1, last)
        n_plain = tl.where((cnt > 0) & (last == Tk - 1), cnt - 1, cnt)
    frow = tl.full([], 0, tl.int32)
    if HAS_FORCED:
        frow = (tl.load(FROW + pid_m) != 0).to(tl.int32)
    return cnt_in, idx_in, cnt_out, idx_out, warm, write_ok, cnt, n_plain, j0, frow


@triton.jit
def _skip_fp8_kernel(Q, K8, VT8, KS, VS, O, LSE, CNT_IN, IDX_IN, CNT_OUT, IDX_OUT, FROW, FCOL, STEP, KW, ARRIVE,
                     KD, VD, stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh,
                     Sq, Sk, Sk_pad, Hq, Hk, n_rep, nkb, Tq, Tk, slot_stride_cnt, slot_stride_idx, n_warmup,
                     qk_scale, threshold,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                     TILE_N: tl.constexpr, STATEFUL: tl.constexpr, HAS_FORCED: tl.constexpr,
                     LAST_PARTIAL: tl.constexpr, WRITE_LSE: tl.constexpr, LOG2_PS: tl.constexpr,
                     QK_ACC: tl.constexpr, QINV: tl.constexpr, NWORDS: tl.constexpr, DESC: tl.constexpr,
                     FBLK: tl.constexpr, KEEP_ROW: tl.constexpr, DIAG: tl.constexpr):
    """Program (pid, bh): rows [pid * BLOCK_M, +BLOCK_M) of (batch, query head) bh, part pid % SPLIT of skip q-tile
    pid // SPLIT (TILE_M = SPLIT * BLOCK_M rows). q is quantized here, one scale per program (as attention_fp8's
    fused q). KW (B * Hq * Tq, SPLIT, NWORDS + 1) int32 and ARRIVE (B * Hq * Tq,) int32 (zeroed): with SPLIT 2,
    each program stores its keep words (and the partial last tile's keep bit) in its part's row of KW, then counts
    itself in ARRIVE; the program that arrives last merges the parts and writes the next list.
    DESC: 0 descriptors built here per (batch, kv head), 1 host descriptors KD / VD over the 4-D views."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    pid_m = pid // SPLIT
    part = pid % SPLIT
    b = bh // Hq
    h = bh % Hq
    hk = h // n_rep
    bhk = (b * Hk + hk).to(tl.int64)
    b64 = b.to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Sq
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    row = (b64 * Hq + h) * Tq + pid_m
    # the list's loads (count -> last index: two dependent round trips) overlap q's load instead of following q's
    # quantization (whose CTA barrier keeps later loads behind it)
    cnt_in, idx_in, cnt_out, idx_out, warm, write_ok, cnt, n_plain, j0, frow = _list_head(
        CNT_IN, IDX_IN, CNT_OUT, IDX_OUT, FROW, STEP, row, pid_m, Tk, n_warmup, slot_stride_cnt,
        slot_stride_idx, STATEFUL, LAST_PARTIAL, HAS_FORCED)
    if DESC == 0:
        k_desc = tl.make_tensor_descriptor(K8 + bhk * Sk * D, shape=[Sk, D], strides=[D, 1],
                                           block_shape=[BLOCK_N, D])
        v_desc = tl.make_tensor_descriptor(VT8 + bhk * D * Sk_pad, shape=[D, Sk], strides=[Sk_pad, 1],
                                           block_shape=[D, BLOCK_N])
    else:
        k_desc = KD
        v_desc = VD
    qf = tl.load(Q + b64 * stride_qb + h * stride_qh + rows[:, None] * stride_qs + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0).to(tl.float32)
    qy, sq = _quant_tile(qf, QINV, QK_ACC == tl.int32)    # bit for bit `quantize_fp8_reference`'s q
    q = qy.to(K8.dtype.element_ty)
    cq = sq * qk_scale
    ks_base = KS + bhk * nkb

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)

    widx = tl.arange(0, NWORDS)
    # DIAG 1 (diagnostic "seqidx"): every row walks tiles 0 .. n_plain - 1 (= its list only at density 1);
    # DIAG 2 ("nokeep"): no keep test, empty next list
    acc, l_i, m_i, words = _listed_tiles(
        acc, l_i, m_i, q, cq, k_desc, v_desc, ks_base, b, hk, idx_in, j0, n_plain, Tk, warm, row_ok, offs_n,
        Sk, threshold, D, TILE_N, BLOCK_M, BLOCK_N, QK_ACC, LOG2_PS, DESC, FBLK, NWORDS, STATEFUL, DIAG == 1,
        KEEP_ROW, DIAG == 2)
    # The partial last k-tile (masked columns), if listed (at most one iteration).
    keep1 = tl.full([], 0, tl.int32)
    for it in range(n_plain, cnt):
        m_before = m_i
        acc, l_i, m_i, tmax = _tile(acc, l_i, m_i, q, cq, k_desc, v_desc, ks_base, b, hk, Tk - 1, offs_n, Sk, D,
                                    TILE_N, BLOCK_N, True, QK_ACC, LOG2_PS, DESC, FBLK)
        hit = ((tmax - m_before) > threshold) & row_ok
        keep1 = tl.max(hit.to(tl.int32), 0)

    # out and LSE of this program's rows
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    sv = tl.load(VS + bhk * D + offs_d)
    out = acc * (1.0 / l_safe)[:, None] * sv[None, :]
    o_ptrs = O + b64 * stride_ob + h * stride_oh + rows[:, None] * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe) - LOG2_PS) * LN2_C)
        tl.store(LSE + (b64 * Hq + h) * Sq + rows, lse, mask=row_ok)

    # With SPLIT 2 the parts of the q-tile are merged by the last one to finish.
    writer = True
    if SPLIT > 1:
        kw_row = KW + row * (SPLIT * (NWORDS + 1))
        tl.store(kw_row + part * (NWORDS + 1) + widx, words)
        tl.store(kw_row + part * (NWORDS + 1) + NWORDS, keep1)
        # every thread's stores are performed (CTA barrier) before the release of the arrival; the last arriver
        # acquires it, so the other part's stores are visible to its loads below
        tl.debug_barrier()
        arrived = tl.atomic_add(ARRIVE + row, 1, sem="acq_rel")
        writer = arrived == SPLIT - 1
        # (every program loads the parts; only the last one's loads are complete, and only it uses them)
        for pp in tl.static_range(SPLIT):
            words = words | tl.load(kw_row + pp * (NWORDS + 1) + widx, volatile=True)
            keep1 = keep1 | tl.load(kw_row + pp * (NWORDS + 1) + NWORDS, volatile=True)
    if writer:
        if HAS_FORCED and LAST_PARTIAL:
            keep1 = keep1 | ((cnt > n_plain) & ((frow | (tl.load(FCOL + Tk - 1) != 0).to(tl.int32)) != 0)).to(
                tl.int32)
        write_next_list(words, keep1, widx, idx_in, idx_out, cnt_out, FCOL, n_plain, Tk, warm, write_ok, frow,
                        NWORDS, STATEFUL, HAS_FORCED, False, False, True)


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------

def fp8_skip_supported(q, tile=DEFAULT_TILE) -> bool:
    """True when the fp8 skip kernel runs q at `tile`: CUDA sm_90+, fp16/bf16, head dim 64 / 128, a supported tile."""
    return (q.dim() == 4 and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in (64, 128)
            and supports_tile(tile) and torch.cuda.get_device_capability(q.device)[0] >= 9
            and hasattr(tl, "make_tensor_descriptor"))


def _cfg(cfg, tm):
    unknown = sorted(set(cfg or {}) - set(FP8_SKIP_CONFIG))
    if unknown:
        raise ValueError(f"cfg: unknown keys {unknown} (known: {sorted(FP8_SKIP_CONFIG)})")
    given = dict(cfg or {})
    cfg = dict(FP8_SKIP_CONFIG, **given)
    if cfg["block_m"] not in (64, 128):
        raise ValueError(f"cfg['block_m'] must be 64 or 128, got {cfg['block_m']!r}")
    if cfg["diag"] not in _DIAGS:
        raise ValueError(f"cfg['diag'] must be one of {_DIAGS}, got {cfg['diag']!r}")
    cfg["block_m"] = min(cfg["block_m"], tm)
    if cfg["block_m"] == 128 and "num_warps" not in given:   # two warpgroups for a 128-row program
        cfg["num_warps"] = 8
    return cfg


def q_block(tile=DEFAULT_TILE, cfg=None) -> int:
    """Rows per q scale of the kernel at `tile` (its program rows): the emulation's `quantize_fp8_reference`
    q_block."""
    return _cfg(cfg, check_tile(tile)[0])["block_m"]


def _host_descs(k8, vt8, block_n):
    """Host TMA descriptors (as `DescriptorArgs`) over K8 (B, Hk, Sk, D) and V^T8 (B, Hk, D, Sk_pad) as 4-D views
    (V^T's columns past Sk read as zeros) -> (kd, vd, DESC constexpr 1), or (None, None, 0) without host
    descriptors in this Triton."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401  (this Triton has host descriptors)
    except ImportError:
        return None, None, 0
    B, Hk, Sk, D = k8.shape
    kd = DescriptorArgs(k8, [B, Hk, Sk, D], list(k8.stride()), [1, 1, block_n, D], "zero")
    vd = DescriptorArgs(vt8, [B, Hk, D, Sk], list(vt8.stride()), [1, 1, D, block_n], "zero")
    return kd, vd, 1


# Direct-launch plans of the kernel (`_common.LaunchPlans`; the quantize launches have theirs in dense/fp8.py).
_PLANS = LaunchPlans("fp8 skip")


def _launch(q, k8, ks, vt8, vs, out, lse, *, cnt_in, idx_in, cnt_out, idx_out, frow, fcol, step, slot_cnt,
            slot_idx, warmup, scale, threshold, tm, tn, stateful, cfg):
    B, Sq, Hq, D = q.shape
    Hk, Sk = k8.shape[1], k8.shape[2]
    Tq, Tk = num_tiles(Sq, tm), num_tiles(Sk, tn)
    bm = cfg["block_m"]
    split = tm // bm
    block_n = 128 if tn % 128 == 0 else 64
    nwords = max(1, triton.next_power_of_2(num_tiles(Tk, CHUNK)))
    if split > 1:
        kw = torch.empty((B * Hq * Tq, split, nwords + 1), dtype=torch.int32, device=q.device)
        arrive = torch.zeros((B * Hq * Tq,), dtype=torch.int32, device=q.device)
    else:
        kw = arrive = out
    int8 = k8.dtype == torch.int8
    dummy = out

    def run(host_desc):
        kd = vd = None
        desc = 0
        if host_desc:
            kd, vd, desc = _host_descs(k8, vt8, block_n)
        if desc == 0:
            set_tma_allocator()
            kd = vd = dummy
        params = dict(
            Q=q, K8=k8, VT8=vt8, KS=ks, VS=vs, O=out, LSE=lse if lse is not None else dummy, CNT_IN=cnt_in,
            IDX_IN=idx_in, CNT_OUT=cnt_out, IDX_OUT=idx_out, FROW=frow if frow is not None else dummy,
            FCOL=fcol if fcol is not None else dummy, STEP=step if step is not None else dummy, KW=kw, ARRIVE=arrive,
            KD=kd, VD=vd, stride_qb=q.stride(0), stride_qs=q.stride(1), stride_qh=q.stride(2),
            stride_ob=out.stride(0), stride_os=out.stride(1), stride_oh=out.stride(2), Sq=Sq, Sk=Sk,
            Sk_pad=vt8.shape[-1], Hq=Hq, Hk=Hk, n_rep=Hq // Hk, nkb=ks.shape[-1], Tq=Tq, Tk=Tk,
            slot_stride_cnt=slot_cnt, slot_stride_idx=slot_idx, n_warmup=warmup, qk_scale=scale * LOG2E,
            threshold=threshold,
            D=D, BLOCK_M=bm, SPLIT=split, BLOCK_N=block_n, TILE_N=tn, STATEFUL=bool(stateful),
            HAS_FORCED=frow is not None, LAST_PARTIAL=bool(Sk % tn), WRITE_LSE=lse is not None,
            LOG2_PS=FP8_LOG2_P_SCALE, QK_ACC=tl.int32 if int8 else tl.float32, QINV=_QINV["int8" if int8 else "e4m3"],
            NWORDS=nwords, DESC=desc, FBLK=FP8_BLOCK, KEEP_ROW=bool(cfg["keep_row"]),
            DIAG=_DIAGS.index(cfg["diag"]))
        _PLANS.launch(_skip_fp8_kernel, (Tq * split, B * Hq), [params[n] for n in _skip_fp8_kernel.arg_names],
                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    if cfg["host_desc"] and _HOST_DESC_OK[0]:
        try:
            return run(True)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001  (compile failure of the host-descriptor build: same function)
            if interpret():
                raise
            warnings.warn(f"sparsepatch: the fp8 skip kernel with host TMA descriptors failed ({type(exc).__name__}: "
                          f"{str(exc)[:200]}); using device-side descriptors")
            _HOST_DESC_OK[0] = False
    run(False)


_HOST_DESC_OK = [True]


def _check(q, k, v, tile):
    B, Sq, Sk, Hq, Hk, D = check_qkv(q, k, v)
    if not fp8_skip_supported(q, tile):
        raise ValueError("the fp8 skip kernel needs fp16/bf16 CUDA q/k/v with head dim 64 or 128 on a Hopper-class "
                         f"GPU and a tile with tm in (64, 128), tn a multiple of 64 <= 512; got {q.dtype} "
                         f"{tuple(q.shape)} on {q.device}, tile {tuple(tile)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q/k/v dtypes must match, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on the head dim, got strides {t.stride()}")
    return B, Sq, Sk, Hq, Hk, D


def skip_attention_fp8(q, k, v, skip_list: SkipList | None = None, threshold: float = -5.0, *, scale=None,
                       must_do=None, return_lse: bool = False, tile=DEFAULT_TILE, qk_format: str = "int8",
                       cfg=None, quantized=None):
    """fp8 skip-list forward on the kernel (inference only): q (B, Sq, Hq, D), k/v (B, Sk, Hk, D) fp16/bf16 CUDA ->
    (out (B, Sq, Hq, D) q's dtype, next_list) or (out, next_list, lse (B, Hq, Sq) fp32, natural log).

    k and v are quantized by `dense.fp8.quantize_fp8` (part of the call) unless `quantized` = its (k8, k_scale,
    vt8, v_scale) outputs are given (benchmarks); q inside the kernel. Same function as `skip_attention_emulated`
    up to fp32 rounding of the scores and P's e4m3 rounding."""
    from .triton import _forced_flags, _union
    B, Sq, Sk, Hq, Hk, D = _check(q, k, v, tile if skip_list is None else skip_list.tile)
    threshold = check_threshold(threshold)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("precision='fp8' skip attention is inference-only: q/k/v require grad")
    if skip_list is None:
        tm, tn = check_tile(tile)
        skip_list = SkipList.full(B, Hq, Sq, Sk, (tm, tn), device=q.device)
    else:
        reference.check_skip_list(skip_list, B, Hq, Sq, Sk)
        tm, tn = skip_list.tile
    cfg = _cfg(cfg, tm)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if quantized is None:
        _, _, k8, ks, vt8, vs = quantize_fp8(q, k, v, qk_format, quantize_q=False)
    else:
        k8, ks, vt8, vs = quantized
    frow, fcol = _forced_flags(must_do, Sq, Sk, tm, tn, q.device)
    counts, indices = skip_list.counts.contiguous(), skip_list.indices.contiguous()
    if frow is not None:
        counts, indices = _union(counts, indices, frow, fcol)
    Tq, Tk = num_tiles(Sq, tm), num_tiles(Sk, tn)
    out = torch.empty((B, Sq, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device) if return_lse else None
    nc = torch.empty((B, Hq, Tq), dtype=torch.int32, device=q.device)
    ni = torch.empty((B, Hq, Tq, Tk), dtype=torch.int32, device=q.device)
    _launch(q, k8, ks, vt8, vs, out, lse, cnt_in=counts, idx_in=indices, cnt_out=nc, idx_out=ni, frow=frow,
            fcol=fcol, step=None, slot_cnt=0, slot_idx=0, warmup=0, scale=scale, threshold=threshold, tm=tm, tn=tn,
            stateful=False, cfg=cfg)
    nxt = SkipList(nc, ni, (tm, tn), Sq, Sk)
    return (out, nxt, lse) if return_lse else (out, nxt)


def skip_step_fp8(q, k, v, counts, indices, step, density, threshold, warmup_steps, tm, tn, scale, must_do_flat,
                  qk_format: str = "int8", cfg=None):
    """CUDA body of the fp8 `sparsepatch::skip_step`: `triton.skip_step`'s contract (slots, device-side step
    counter, warm-up calls dense over every tile, density record + step increment) on the fp8 kernel."""
    from .triton import _forced_flags, _step_density, _union
    B, Sq, Sk, Hq, Hk, D = _check(q, k, v, (tm, tn))
    threshold = check_threshold(threshold)
    cfg = _cfg(cfg, tm)
    must_do = list(zip(must_do_flat[0::2], must_do_flat[1::2]))
    frow, fcol = _forced_flags(must_do, Sq, Sk, tm, tn, q.device)
    cnt_in, idx_in = counts, indices
    if frow is not None:
        cnt_in, idx_in = _union(counts, indices, frow, fcol)
    elif not (counts[0].is_contiguous() and indices[0].is_contiguous()):
        raise ValueError("counts / indices slots must be contiguous")
    _, _, k8, ks, vt8, vs = quantize_fp8(q, k, v, qk_format, quantize_q=False)
    out = torch.empty((B, Sq, Hq, D), dtype=q.dtype, device=q.device)
    _launch(q, k8, ks, vt8, vs, out, None, cnt_in=cnt_in, idx_in=idx_in, cnt_out=counts, idx_out=indices,
            frow=frow, fcol=fcol, step=step, slot_cnt=counts.stride(0), slot_idx=indices.stride(0),
            warmup=int(warmup_steps), scale=float(scale), threshold=threshold, tm=tm, tn=tn, stateful=True, cfg=cfg)
    _step_density(cnt_in, step, density, int(warmup_steps), num_tiles(Sk, tn))
    return out


def quantize_skip_reference(q, k, v, tile=DEFAULT_TILE, qk_format: str = "int8", cfg=None):
    """The dequantized (q, k, v) fp32 (B, S, H, D) the fp8 skip kernel multiplies at `tile` (q scales per program
    tile of `q_block(tile)` rows, k per 128 rows, v per channel)."""
    return quantize_fp8_reference(q, k, v, qk_format, q_block=q_block(tile, cfg))


def skip_attention_emulated(q, k, v, skip_list: SkipList | None = None, threshold: float = -5.0, *, scale=None,
                            must_do=None, return_lse: bool = False, tile=DEFAULT_TILE, qk_format: str = "int8",
                            attn_mask=None):
    """CPU emulation of the fp8 skip forward (any device): `reference.skip_attention` on q/k/v rounded exactly as
    the kernel quantizes them (P's e4m3 rounding not modelled). Output in q's dtype; same returns as the kernel."""
    if qk_format not in QK_FORMATS:
        raise ValueError(f"qk_format must be one of {QK_FORMATS}, got {qk_format!r}")
    t = tile if skip_list is None else skip_list.tile
    if not supports_tile(t):
        t = (128, 128)   # q-block of the closest kernel config; the list's own tile still defines the skip
    qd, kd, vd = quantize_skip_reference(q, k, v, t, qk_format)
    res = reference.skip_attention(qd, kd, vd, skip_list, threshold, scale=scale, must_do=must_do,
                                   return_lse=return_lse, tile=tile, attn_mask=attn_mask)
    return (res[0].to(q.dtype),) + tuple(res[1:])


__all__ = ["skip_attention_fp8", "skip_step_fp8", "skip_attention_emulated", "quantize_skip_reference",
           "fp8_skip_supported", "supports_tile", "q_block", "FP8_SKIP_CONFIG"]
