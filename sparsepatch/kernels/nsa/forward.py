"""Native Sparse Attention forward in Triton: the same function (same selected blocks) as `nsa_reference`.

Four kernels per call (plus mean/weighted pooling of k/v in PyTorch, `nsa_reference.compress_kv`):

1. `_cmp_kernel`  compressed-branch attention. One program = a tile of BT consecutive query tokens x the G query
   heads of one KV head (rows = BT * GP, GP = next_pow2(G); GQA heads share every k/v load, and MHA gets BT = 64
   tokens per tile, so it is not padded). Pass 1: online softmax -> o_cmp (fp32) and the row LSE. Pass 2
   (selection scores): the same q.k tiles again, p = exp2(s - lse), summed over the group's heads, mapped to
   selection blocks with the overlap weights w(c, j) (each compressed block overlaps at most two selection blocks
   when compress_block <= block_size): the first part is written to IMP_A[j], the spill into block j+1 to
   IMP_B[j+1] (fp32 (B, Hk, T, n_b + 1) scratch).
2. `_topk_kernel` one program per (token, KV head): score = IMP_A + IMP_B over the visible blocks, local block
   +inf, block 0 3e38, then the num_selected largest with ties to the lower index (as the reference): a chunk-
   maxima filter and one pairwise rank of the few candidates (PARALLEL_TOPK), or num_selected serial arg-max
   rounds; indices written ascending, -1 padded.
3. `_slc_kernel`  selected-block attention, one program per (token, KV head), rows = the group's heads (padded
   to >= 16 for tl.dot); causal mask in the local block; writes g_cmp * o_cmp + g_slc * o_slc (fp32). For MHA,
   small groups at short T and any group at n_b <= 64 blocks (`slc_tile_rows`), `_slc_tile_kernel` instead:
   128-row programs of 128 // G tokens visiting the union of their selected blocks, each row masking the blocks
   its token did not select (the same function; faster where the per-token kernel pads G to 16 rows, or where the
   union is nearly every visible block).
4. `_swa_kernel`  sliding-window attention on the same tiles as (1); adds g_swa * o_swa and stores the output.
   selection="tile" with FUSED_BRANCHES: `_tile_branches_kernel` replaces (3) and (4) by one launch (both
   branches and the gate combine per program; a block in both is loaded and multiplied by q once) that also
   computes the compressed branch, so (1) runs only for the selection tiles' first tokens (importance, no o_cmp).

Supported (else `supports` is False and the dispatcher uses the reference): causal=True, head dim 16..256 power
of two, block_size % compress_stride == 0 with block_size / compress_stride a power of two <= 64, compress_block
<= block_size, fp16/bf16 on CUDA (fp16/fp32 under TRITON_INTERPRET=1). Varlen runs one launch set per sequence.
Backward: `nsa_backward.py` (Triton, autograd registered on `sparsepatch::nsa_fwd` below). When a gradient is
needed the forward also saves, per branch, the LSE (log2 units) and the ungated branch output (see `_forward`).
"""
from __future__ import annotations

import functools
import logging
import math

import torch
import triton
import triton.language as tl

from .._common import bit_or, head_major_desc, popc32
from .._common import interpret as _interpret
from . import reference as ref
from .reference import FORCE_FIRST, NSACache, NSAParams, compress_kv
from . import backward as nsa_backward  # noqa: F401  (defines sparsepatch::nsa_bwd, used by the autograd of nsa_fwd)
from . import decode as nsa_decode

logger = logging.getLogger(__name__)

__all__ = ["nsa_attention", "supports", "supports_config", "NSACache"]

LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _online(acc, l_i, m_i, s, v, qk_scale):
    """One online-softmax step in log2 units; s = the raw scores Q K^T (masked: -inf), qk_scale > 0 (log2 units).
    The row maximum is taken before scaling (max(s) * c = max(s * c) for c > 0, the same fp32 value): one FMUL per
    row instead of one per score, and the exponent's scale-and-subtract is one FFMA."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _token_tile_rows(T, q_off, Hk, G, BT: tl.constexpr, GP: tl.constexpr, tok0, TS: tl.constexpr):
    """Rows of a (token tile, KV head) program (program_id 0: tile of BT row tokens; 1: b * Hk + KV head): row r
    is row token i = t0 + r // GP (of T) with query head hk * G + r % GP (GP = G padded to a power of two; padded
    rows not ok). Row token i is query token tok0 + i * TS (TS > 1: the first token of every selection tile).
    -> (b64, hk, t0, tok, row_ok, head, qpos = the token's position among the keys)."""
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    hk = bh % Hk
    b64 = (bh // Hk).to(tl.int64)
    t0 = pid_t * BT
    r = tl.arange(0, BT * GP)
    ri = t0 + r // GP
    tok = tok0 + ri * TS
    g = r % GP
    row_ok = (ri < T) & (g < G)
    return b64, hk, t0, tok, row_ok, hk * G + g, tok + q_off


@triton.jit
def _kv_tile(desc, base, b, hk, row0, rows, ok, stride, offs_d, N: tl.constexpr, HEAD_DIM: tl.constexpr,
             USE_TMA: tl.constexpr, MASKED: tl.constexpr):
    """(N, HEAD_DIM) rows row0 + arange(N) of one (batch, KV head) of K or V. USE_TMA: through the host descriptor
    `desc` over the (B, Hk, S, D) view (rows past S zero-filled; rows inside S are that sequence's own, so every row
    the box brings in is finite and each kernel's score mask decides whether it counts). Else pointer loads at
    `rows` (row0 + arange(N)), zero where not `ok` (MASKED) or unmasked."""
    if USE_TMA:
        return desc.load([b, hk, row0, 0]).reshape(N, HEAD_DIM)
    ptrs = base + rows[:, None].to(tl.int64) * stride + offs_d[None, :]
    if MASKED:
        return tl.load(ptrs, mask=ok[:, None], other=0.0)
    return tl.load(ptrs)


@triton.jit
def _cmp_kernel(Q, KC, VC, OC, IMPA, IMPB, LSE, KD, VD,
                sqb, sqs, sqh, skb, sks, skh, sob, sos, soh,
                T, n_c, q_off, Hq, Hk, G, NBP, qk_scale, tok0,
                CB: tl.constexpr, CS: tl.constexpr, BS: tl.constexpr, R: tl.constexpr,
                HEAD_DIM: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr,
                SELECT: tl.constexpr, SAVE: tl.constexpr, STORE_O: tl.constexpr, TS: tl.constexpr,
                MASK_SPLIT: tl.constexpr = False, USE_TMA: tl.constexpr = False):
    """T row tokens (query tokens tok0 + i * TS, see `_token_tile_rows`). STORE_O: write o_cmp (and with SAVE the
    LSE); SELECT: write the block importance of every row token to row i of IMP_A / IMP_B (B, Hk, T, NBP).
    MASK_SPLIT: pass 1 runs the key tiles every row token sees completely without the per-element score mask (the
    same values: the mask selects nothing there), the rest with it. USE_TMA: K / V tiles through the host
    descriptors KD, VD (boxes of BLOCK_N keys); the same values as the pointer loads."""
    b64, hk, t0, tok, row_ok, head, qpos = _token_tile_rows(T, q_off, Hk, G, BT, GP, tok0, TS)
    b32 = tl.program_id(1) // Hk
    M: tl.constexpr = BT * GP
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + b64 * sqb + tok[:, None].to(tl.int64) * sqs + head[:, None] * sqh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    nvis = tl.where(qpos + 1 >= CB, (qpos + 1 - CB) // CS + 1, 0)
    nvis = tl.minimum(nvis, n_c)
    maxpos = tok0 + (tl.minimum(t0 + BT, T) - 1) * TS + q_off
    hi = tl.where(maxpos + 1 >= CB, (maxpos + 1 - CB) // CS + 1, 0)
    hi = tl.minimum(hi, n_c)
    minpos = tok0 + t0 * TS + q_off
    kbase = KC + b64 * skb + hk * skh
    vbase = VC + b64 * skb + hk * skh
    acc, l_i, m_i = _cmp_rows(q, kbase, vbase, KD, VD, b32, hk, sks, offs_d, qpos, minpos, maxpos, n_c, qk_scale,
                              CB, CS, BLOCK_N, HEAD_DIM, M, None, USE_TMA, MASK_SPLIT)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    if STORE_O:
        o = acc / l_safe[:, None]
        tl.store(OC + b64 * sob + tok[:, None].to(tl.int64) * sos + head[:, None] * soh + offs_d[None, :], o,
                 mask=row_ok[:, None])
    lse = tl.where(l_i == 0.0, float("inf"), m_i + tl.math.log2(l_safe))   # log2 units; +inf: p = 0 for empty rows
    if SAVE and STORE_O:   # for the backward: LSE (B, T, Hq) fp32 of this branch
        tl.store(LSE + (b64 * T + tok.to(tl.int64)) * Hq + head, lse, mask=row_ok)

    if SELECT:
        # A second sweep, not pass 1's probabilities rescaled at the end: the importance sums p over the group's
        # heads before it is stored, and each head's p needs its own final LSE. Rescaling pass-1 partials
        # (exp2(s - m_running) * exp2(m_running - lse)) would have to keep them per head until the LSE is known:
        # G x the (T, n_b) scratch (17 GB at 64K, G=16) or n_b x rows in shared memory (256 KB per 64-row tile).
        NB: tl.constexpr = BLOCK_N // R
        tt = t0 + tl.arange(0, BT)
        jj = tl.arange(0, NB)
        maxcur = maxpos // BS
        cr = offs_n % R
        w1 = tl.minimum(CB, BS - cr * CS).to(tl.float32)
        w2 = CB - w1
        t_ok = (tt < T)[:, None]
        imp_row = IMPA + ((b64 * Hk + hk) * T + tt[:, None].to(tl.int64)) * NBP
        impb_row = IMPB + ((b64 * Hk + hk) * T + tt[:, None].to(tl.int64)) * NBP
        for j0 in range(0, maxcur + 1, NB):
            c = j0 * R + offs_n
            kv_ok = c < hi
            k = _kv_tile(KD, kbase, b32, hk, j0 * R, c, kv_ok, sks, offs_d, BLOCK_N, HEAD_DIM, USE_TMA, True)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            p = tl.math.exp2(s - lse[:, None])
            p = tl.where((c[None, :] < nvis[:, None]) & row_ok[:, None], p, 0.0)
            _imp_store(p, w1, w2, imp_row, impb_row, j0, jj, t_ok, NBP, BT, GP, BLOCK_N, NB, R)


@triton.jit
def _imp_store(p, w1, w2, imp_row, impb_row, j0, jj, t_ok, NBP, BT: tl.constexpr, GP: tl.constexpr,
               N: tl.constexpr, NB: tl.constexpr, R: tl.constexpr):
    """Importance of one key tile: p (BT * GP, N) summed over each token's heads, then over the R compressed blocks
    of each selection block j = j0 + jj with weights w1 (first part) and w2 (spill into j + 1) -> IMP_A[j] /
    IMP_B[j + 1]."""
    ph = tl.sum(tl.reshape(p, (BT, GP, N)), 1)                                # (BT, N)
    a = tl.sum(tl.reshape(ph * w1[None, :], (BT, NB, R)), 2)                  # (BT, NB)
    bsp = tl.sum(tl.reshape(ph * w2[None, :], (BT, NB, R)), 2)
    j = j0 + jj
    tl.store(imp_row + j[None, :], a, mask=t_ok & (j < NBP)[None, :])
    tl.store(impb_row + (j + 1)[None, :], bsp, mask=t_ok & (j + 1 < NBP)[None, :])


@triton.jit
def _topk_emit(base, pos, jv, chosen, cnt, NSEL: tl.constexpr, NSELP: tl.constexpr):
    """Store block indices jv where `chosen` at slots pos (ascending), then -1 in slots cnt..NSEL-1."""
    tl.store(base + pos, jv, mask=chosen)
    sl = tl.arange(0, NSELP)
    tl.store(base + sl, tl.full([NSELP], -1, tl.int32), mask=(sl >= cnt) & (sl < NSEL))


@triton.jit
def _topk_serial(key, ok, j, base, NSEL: tl.constexpr, NBLK: tl.constexpr, NSELP: tl.constexpr):
    """NSEL arg-max rounds over the packed keys (one max per round); `ok`: the block is visible."""
    chosen = tl.zeros([NBLK], tl.int32)
    for _ in tl.static_range(NSEL):
        kmax = tl.max(key, 0)
        pick = NBLK - 1 - (kmax & 0xFFFFFFFF).to(tl.int32)
        chosen = tl.where((j == pick) & ok, 1, chosen)
        key = tl.where(j == pick, -9223372036854775807, key)
    _topk_emit(base, tl.cumsum(chosen, 0) - 1, j, chosen != 0, tl.sum(chosen, 0), NSEL, NSELP)


@triton.jit
def _topk_rank(key, ok, jv, base, NSEL: tl.constexpr, NSELP: tl.constexpr):
    """Keys are distinct, so block i is among the NSEL largest iff fewer than NSEL keys exceed its own: one
    pairwise comparison of all N entries (N x N), no serial rounds. `ok`: a real, visible entry."""
    key = tl.where(ok, key, -9223372036854775807)
    rank = tl.sum((key[None, :] > key[:, None]).to(tl.int32), 1)
    chosen = ok & (rank < NSEL)
    c32 = chosen.to(tl.int32)
    _topk_emit(base, tl.cumsum(c32, 0) - 1, jv, chosen, tl.sum(c32, 0), NSEL, NSELP)


@triton.jit
def _topk_kernel(IMPA, IMPB, IDX, T, Hk, NBP, n_b, q_off, s_ib, s_it, s_ih, tok0,
                 BS: tl.constexpr, NSEL: tl.constexpr, NBLK: tl.constexpr, NSELP: tl.constexpr, TS: tl.constexpr,
                 PARALLEL: tl.constexpr, NCH: tl.constexpr, CAP: tl.constexpr):
    """Row t of T (query token tok0 + t * TS, as `_cmp_kernel`'s rows): its selected blocks -> IDX row t.

    Every block gets a distinct int64 key: high word = fp32 bits of its score (monotone for scores >= 0, -inf
    sorts below them), low word = NBLK - 1 - j (equal scores: the lower block index has the larger key), so "the
    NSEL largest keys" is exactly the reference's order (stable descending sort, ties to the lower index) and the
    selection is a set, written ascending.
    PARALLEL=False: NSEL serial arg-max rounds over the NBLK keys.
    PARALLEL=True: NBLK <= CAP: one pairwise rank of all keys. Else a filter: the maxima of NCH strided chunks
    (chunk c = blocks j = c mod NCH); L = the NSEL-th largest of them. NSEL distinct keys are >= L (those chunk
    maxima), so the NSEL largest keys are all >= L: the candidates {visible, key >= L} hold the answer. When at
    most CAP blocks are candidates (i.i.d. random scores at NSEL=16, NCH=32, 1024 blocks: 21.5 on average, > 32 in
    ~0.5% of rows; strided chunks spread a run of high-scoring neighbouring blocks over many chunks), they are
    compacted in ascending block order into this row's IMPA / IMPB scratch (already read) and ranked pairwise
    (CAP x CAP); otherwise (adversarial layouts) the serial rounds. Both give the same set."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hk
    hk = bh % Hk
    b64 = b.to(tl.int64)
    cur = (tok0 + t * TS + q_off) // BS
    cur = tl.minimum(cur, n_b - 1)
    j = tl.arange(0, NBLK)
    row = ((b64 * Hk + hk) * T + t) * NBP
    vis = j <= cur
    sa = tl.load(IMPA + row + j, mask=vis, other=0.0)
    sb = tl.load(IMPB + row + j, mask=vis & (j >= 1), other=0.0)
    score = sa + sb
    score = tl.where(j == 0, FORCE_FIRST_C, score)
    score = tl.where(j == cur, float("inf"), score)
    score = tl.where(vis, score, float("-inf"))
    ok = score > float("-inf")
    bits = score.to(tl.int32, bitcast=True).to(tl.int64)
    key = (bits << 32) | (NBLK - 1 - j).to(tl.int64)
    base = IDX + b64 * s_ib + t.to(tl.int64) * s_it + hk * s_ih
    if not PARALLEL:
        _topk_serial(key, ok, j, base, NSEL, NBLK, NSELP)
    elif NBLK <= CAP:
        _topk_rank(key, ok, j, base, NSEL, NSELP)
    else:
        cmax = tl.max(tl.reshape(key, (NBLK // NCH, NCH)), 0)                     # (NCH,) chunk maxima
        crank = tl.sum((cmax[None, :] > cmax[:, None]).to(tl.int32), 1)
        lim = tl.min(tl.where(crank < NSEL, cmax, 9223372036854775807), 0)       # NSEL-th largest chunk maximum
        cand = ok & (key >= lim)
        c32 = cand.to(tl.int32)
        cnt = tl.sum(c32, 0)
        if cnt <= CAP:
            pos = tl.cumsum(c32, 0) - 1
            tl.debug_barrier()   # every thread has read its IMPA / IMPB entries before the row is overwritten
            tl.store(IMPA + row + pos, score, mask=cand)
            tl.store(IMPB + row + pos, j.to(tl.float32), mask=cand)
            tl.debug_barrier()   # the compacted list is read back by other threads
            ci = tl.arange(0, CAP)
            c_ok = ci < cnt
            cs = tl.load(IMPA + row + ci, mask=c_ok, other=0.0)
            cj = tl.load(IMPB + row + ci, mask=c_ok, other=0.0).to(tl.int32)
            ckey = (cs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (NBLK - 1 - cj).to(tl.int64)
            _topk_rank(ckey, c_ok, cj, base, NSEL, NSELP)
        else:
            _topk_serial(key, ok, j, base, NSEL, NBLK, NSELP)


@triton.jit
def _slc_kernel(Q, K, V, IDX, OC, GATES, PART, BO_C, BO_S, LSE, KD, VD,
                sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, s_ib, s_it, s_ih,
                sgb, sgs, sgh, sgc,
                T, S, q_off, Hk, G, qk_scale,
                BS: tl.constexpr, BSP: tl.constexpr, NSEL: tl.constexpr, HEAD_DIM: tl.constexpr,
                GP: tl.constexpr, HAS_GATES: tl.constexpr, SLC_STAGES: tl.constexpr, SAVE: tl.constexpr,
                USE_TMA: tl.constexpr = False):
    """Selected branch of one token x the G query heads of one KV head (rows = G padded to GP): its NSEL selected
    blocks (ascending, -1 padding) of BS keys, each loaded as BSP rows. USE_TMA: K / V blocks through the host
    descriptors KD / VD (boxes of BSP keys from the block's first key; keys past S zero-filled; a padding entry
    loads block 0, which its mask then drops as the pointer path's fully masked load does)."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hk
    hk = bh % Hk
    b64 = b.to(tl.int64)
    t64 = t.to(tl.int64)
    g = tl.arange(0, GP)
    g_ok = g < G
    head = hk * G + g
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BSP)
    qpos = t + q_off
    q = tl.load(Q + b64 * sqb + t64 * sqs + head[:, None] * sqh + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    kbase = K + b64 * skb + hk * skh
    vbase = V + b64 * svb + hk * svh
    ibase = IDX + b64 * s_ib + t64 * s_it + hk * s_ih
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HEAD_DIM], tl.float32)
    # No branch on padding (-1) entries: their keys are all masked (pointer loads: nothing read; TMA: block 0 read,
    # in bounds, and dropped by the mask), so the loop stays software-pipelined.
    for i in tl.range(0, NSEL, num_stages=SLC_STAGES):
        jb = tl.load(ibase + i)
        j0 = tl.maximum(jb, 0) * BS
        key = j0 + offs_n
        lim = S * (jb >= 0).to(tl.int32)                       # padding entry: every key masked
        ok = (offs_n < BS) & (key < lim) & (key <= qpos)
        k = _kv_tile(KD, kbase, b, hk, j0, key, ok, sks, offs_d, BSP, HEAD_DIM, USE_TMA, True)
        v = _kv_tile(VD, vbase, b, hk, j0, key, ok, svs, offs_d, BSP, HEAD_DIM, USE_TMA, True)
        s = tl.dot(q, tl.trans(k))
        s = tl.where(ok[None, :], s, float("-inf"))
        acc, l_i, m_i = _online(acc, l_i, m_i, s, v, qk_scale)
    _slc_epilogue(acc, l_i, m_i, OC, GATES, PART, BO_C, BO_S, LSE, b64, t64, head, g_ok, offs_d,
                  sob, sos, soh, sgb, sgs, sgh, sgc, T, Hk, G, HAS_GATES, SAVE)


@triton.jit
def _slc_epilogue(acc, l_i, m_i, OC, GATES, PART, BO_C, BO_S, LSE, b64, tok64, head, ok, offs_d,
                  sob, sos, soh, sgb, sgs, sgh, sgc, T, Hk, G, HAS_GATES: tl.constexpr, SAVE: tl.constexpr):
    """Selected-branch epilogue for rows (token tok64, query head `head`) where `ok`: o_slc = acc / l, then
    PART = g_cmp * o_cmp + g_slc * o_slc (o_cmp read from OC at the same rows; PART may alias OC)."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    orow = b64 * sob + (tok64 * sos + head * soh)[:, None] + offs_d[None, :]
    oc = tl.load(OC + orow, mask=ok[:, None], other=0.0)
    if SAVE:   # for the backward: o_cmp and o_slc (B, T, Hq, D) in q's dtype (same layout as OC), LSE of o_slc
        tl.store(BO_C + orow, oc.to(BO_C.dtype.element_ty), mask=ok[:, None])
        tl.store(BO_S + orow, o.to(BO_S.dtype.element_ty), mask=ok[:, None])
        tl.store(LSE + (b64 * T + tok64) * (Hk * G) + head, m_i + tl.math.log2(l_safe), mask=ok)
    if HAS_GATES:
        gb = GATES + b64 * sgb + tok64 * sgs + head * sgh
        g0 = tl.load(gb, mask=ok, other=0.0).to(tl.float32)
        g1 = tl.load(gb + sgc, mask=ok, other=0.0).to(tl.float32)
        part = g0[:, None] * oc + g1[:, None] * o
    else:
        part = (oc + o) * (1.0 / 3.0)
    tl.store(PART + orow, part, mask=ok[:, None])


@triton.jit
def _slc_tile_kernel(Q, K, V, IDX, LIST, OC, GATES, PART, BO_C, BO_S, LSE, KD, VD,
                     sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, s_ib, s_it, s_ih,
                     sgb, sgs, sgh, sgc,
                     T, S, q_off, Hk, G, qk_scale, CAP,
                     BS: tl.constexpr, BSP: tl.constexpr, NSEL: tl.constexpr, NSELP: tl.constexpr,
                     NWP: tl.constexpr, HEAD_DIM: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr,
                     HAS_GATES: tl.constexpr, SLC_STAGES: tl.constexpr, SAVE: tl.constexpr, SHARED: tl.constexpr,
                     USE_TMA: tl.constexpr = False):
    """Selected branch for a tile of BT tokens x the G query heads of one KV head (rows = BT * GP).

    The tile visits the union of its tokens' selected blocks (ascending) and every row masks the blocks its own
    token did not select, so each row computes exactly the per-token function of `_slc_kernel` (a block a row did
    not select leaves its m, l and acc unchanged) while K/V loads are shared by the tile's tokens and the MMAs have
    BT * GP rows. The union is built in the prologue: a bitmap of NWP 32-bit words over the blocks, then compacted
    by popcounts into LIST (CAP int32 slots per program, global scratch read back after a CTA barrier).
    SHARED (selection="tile", the host checked that every program's tokens lie in one selection tile): all rows
    share the first token's selection, so there is no union and no per-row block mask (only the causal one).
    USE_TMA: K / V blocks through the host descriptors KD / VD (boxes of BSP keys; keys past S zero-filled, keys
    past the block's BS masked in the scores as with pointer loads)."""
    b64, hk, t0, tok, row_ok, head, qpos = _token_tile_rows(T, q_off, Hk, G, BT, GP, 0, 1)
    b32 = tl.program_id(1) // Hk
    M: tl.constexpr = BT * GP
    tok64 = tok.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BSP)
    offs_s = tl.arange(0, NSELP)
    s_ok = (offs_s < NSEL)[None, :]
    q = tl.load(Q + b64 * sqb + (tok64 * sqs + head * sqh)[:, None] + offs_d[None, :], mask=row_ok[:, None],
                other=0.0)
    ibase = IDX + b64 * s_ib + hk * s_ih
    if SHARED:   # the first token's selection is every row's: ascending, -1 padding last
        lbase = ibase + t0.to(tl.int64) * s_it
        n_u = tl.sum((tl.load(lbase + offs_s, mask=offs_s < NSEL, other=-1) >= 0).to(tl.int32), 0)
    else:
        # Each row's selected blocks (its token's; -1 padding and rows past T match no block).
        sel = tl.load(ibase + tok64[:, None] * s_it + offs_s[None, :], mask=(tok < T)[:, None] & s_ok, other=-1)
        # Union of the tile's selections: bitmap words, then the set bits compacted in ascending order.
        tt = t0 + tl.arange(0, BT)
        trow = ibase + tt.to(tl.int64) * s_it
        wi = tl.arange(0, NWP)
        words = tl.zeros([NWP], tl.int32)
        for si in tl.static_range(NSEL):   # one slot of every token at a time: [BT, NWP] live, not [BT * NSEL, NWP]
            ent = tl.load(trow + si, mask=tt < T, other=-1)
            hitw = tl.where((ent >= 0)[:, None] & ((ent >> 5)[:, None] == wi[None, :]), 1 << (ent & 31)[:, None],
                            0)
            words = words | tl.reduce(hitw, 0, bit_or)
        cnt_w = popc32(words)
        n_u = tl.sum(cnt_w, 0)
        lane = tl.arange(0, 32)
        pos = (tl.cumsum(cnt_w, 0) - cnt_w)[:, None] + popc32(words[:, None] & ((1 << lane[None, :]) - 1))
        lbase = LIST + (tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)) * CAP
        tl.store(lbase + pos, wi[:, None] * 32 + lane[None, :], mask=((words[:, None] >> lane[None, :]) & 1) != 0)
        tl.debug_barrier()   # the list is read back below by other threads of this program

    kbase = K + b64 * skb + hk * skh
    vbase = V + b64 * svb + hk * svh
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_DIM], tl.float32)
    for i in tl.range(0, n_u, num_stages=SLC_STAGES):
        jb = tl.load(lbase + i)
        key = jb * BS + offs_n
        kv_ok = (offs_n < BS) & (key < S)
        k = _kv_tile(KD, kbase, b32, hk, jb * BS, key, kv_ok, sks, offs_d, BSP, HEAD_DIM, USE_TMA, True)
        v = _kv_tile(VD, vbase, b32, hk, jb * BS, key, kv_ok, svs, offs_d, BSP, HEAD_DIM, USE_TMA, True)
        s = tl.dot(q, tl.trans(k))
        ok = kv_ok[None, :] & (key[None, :] <= qpos[:, None])
        if not SHARED:
            ok = ok & (tl.max((sel == jb).to(tl.int32), 1) != 0)[:, None]
        s = tl.where(ok, s, float("-inf"))
        acc, l_i, m_i = _online(acc, l_i, m_i, s, v, qk_scale)
    _slc_epilogue(acc, l_i, m_i, OC, GATES, PART, BO_C, BO_S, LSE, b64, tok64, head, row_ok, offs_d,
                  sob, sos, soh, sgb, sgs, sgh, sgc, T, Hk, G, HAS_GATES, SAVE)


@triton.jit
def _swa_kernel(Q, K, V, PART, GATES, OUT, BO_W, LSE, KD, VD,
                sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, spb, sps, sph, sgb, sgs, sgh, sgc, sob, sos, soh,
                T, S, q_off, Hk, G, qk_scale, window,
                HEAD_DIM: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_GATES: tl.constexpr, SAVE: tl.constexpr, USE_TMA: tl.constexpr = False):
    """Window branch of BT tokens x the group's heads; adds g_swa * o_swa to PART and stores the output. USE_TMA: K / V
    tiles through the host descriptors KD / VD (boxes of BLOCK_N keys; keys past S zero-filled, the rest masked in
    the scores as with pointer loads)."""
    b64, hk, t0, tok, row_ok, head, qpos = _token_tile_rows(T, q_off, Hk, G, BT, GP, 0, 1)
    b32 = tl.program_id(1) // Hk
    M: tl.constexpr = BT * GP
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    tok64 = tok[:, None].to(tl.int64)
    q = tl.load(Q + b64 * sqb + tok64 * sqs + head[:, None] * sqh + offs_d[None, :], mask=row_ok[:, None],
                other=0.0)
    minpos = t0 + q_off
    maxpos = tl.minimum(t0 + BT, T) - 1 + q_off
    lo = tl.maximum(minpos - window + 1, 0) // BLOCK_N * BLOCK_N
    hi = maxpos + 1
    kbase = K + b64 * skb + hk * skh
    vbase = V + b64 * svb + hk * svh
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_DIM], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        key = start + offs_n
        kv_ok = key < hi
        k = _kv_tile(KD, kbase, b32, hk, start, key, kv_ok, sks, offs_d, BLOCK_N, HEAD_DIM, USE_TMA, True)
        v = _kv_tile(VD, vbase, b32, hk, start, key, kv_ok, svs, offs_d, BLOCK_N, HEAD_DIM, USE_TMA, True)
        s = tl.dot(q, tl.trans(k))
        ok = (key[None, :] <= qpos[:, None]) & (key[None, :] > qpos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        acc, l_i, m_i = _online(acc, l_i, m_i, s, v, qk_scale)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if SAVE:   # for the backward: o_swa (B, T, Hq, D) in q's dtype (OUT's layout) and its LSE
        tl.store(BO_W + b64 * sob + tok64 * sos + head[:, None] * soh + offs_d[None, :],
                 o.to(BO_W.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + (b64 * T + tok.to(tl.int64)) * (Hk * G) + head, m_i + tl.math.log2(l_safe), mask=row_ok)
    part = tl.load(PART + b64 * spb + tok64 * sps + head[:, None] * sph + offs_d[None, :], mask=row_ok[:, None],
                   other=0.0)
    if HAS_GATES:
        g2 = tl.load(GATES + b64 * sgb + tok.to(tl.int64) * sgs + head * sgh + 2 * sgc, mask=row_ok,
                     other=0.0).to(tl.float32)
        res = part + g2[:, None] * o
    else:
        res = part + o * (1.0 / 3.0)
    tl.store(OUT + b64 * sob + tok64 * sos + head[:, None] * soh + offs_d[None, :], res.to(OUT.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _block_scores(q, KD, VD, kbase, vbase, b, hk, j0, offs_n, offs_d, S, sks, svs, BS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr, MASKED: tl.constexpr):
    """Keys j0 .. j0 + BS - 1 of one (batch, KV head) (`_kv_tile`): (key positions, key < S, the raw scores
    q K^T (M, BS) fp32, the V tile)."""
    key = j0 + offs_n
    kv_ok = key < S
    k = _kv_tile(KD, kbase, b, hk, j0, key, kv_ok, sks, offs_d, BS, HEAD_DIM, USE_TMA, MASKED)
    v = _kv_tile(VD, vbase, b, hk, j0, key, kv_ok, svs, offs_d, BS, HEAD_DIM, USE_TMA, MASKED)
    return key, kv_ok, tl.dot(q, tl.trans(k)), v


@triton.jit
def _tile_branches_kernel(Q, K, V, IDX, GATES, OUT, BO_C, BO_S, BO_W, LSE_S, LSE_W, KD, VD,
                          KC, VC, LSE_C, KCD, VCD,
                          sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, scb, scs, sch, s_ib, s_it, s_ih,
                          sgb, sgs, sgh, sgc, sob, sos, soh, skcb, skcs, skch,
                          T, S, q_off, Hk, G, qk_scale, window, n_c,
                          BS: tl.constexpr, NSEL: tl.constexpr, NSELP: tl.constexpr, HEAD_DIM: tl.constexpr,
                          GP: tl.constexpr, BT: tl.constexpr, HAS_GATES: tl.constexpr, SAVE: tl.constexpr,
                          WB: tl.constexpr, STAGES: tl.constexpr, USE_TMA: tl.constexpr = False,
                          CB: tl.constexpr = 1, CS: tl.constexpr = 1,
                          CMP_N: tl.constexpr = 64, CMP_TMA: tl.constexpr = False, PIN: tl.constexpr = False,
                          SEL_ROWS: tl.constexpr = 1):
    """selection="tile": the selected, window and compressed branches of BT tokens x the group's heads (rows =
    BT * GP, all tokens inside one selection tile, BS a power of two) in one program, with the gate combine -> OUT.

    The window's key tiles are selection blocks wlo .. whi (the tile's own block). Four loops over K / V, each
    block loaded once: (0) the selected blocks whole inside every row's window (first key + window > maxpos): both
    states have the same causal mask there, so one online-softmax state, copied into both when the loop ends (one
    exponential and one P V per block instead of two); (1) the tile's selected blocks before wlo: every key visible
    to every row, so no mask; selected state only; (2) the other selected blocks inside the window (at its lower
    edge): Q K^T once, both states (masks differ only at the window's lower edge); (3) the window's unselected
    blocks: window state only. Both states sum their blocks in another order than `_slc_tile_kernel` /
    `_swa_kernel` (rounding differences only). WB: a power of two >= the most window blocks of a program
    (window // BS + 2).
    Then the compressed branch of the program's rows (`_cmp_rows`: KC / VC (B, n_c, Hk, D) with strides skc*,
    through KCD / VCD when CMP_TMA, CMP_N keys per tile; the same fp32 operations as `_cmp_kernel`'s pass 1), after
    the selected and window accumulators are folded into the gated result: at most two (M, HEAD_DIM) fp32 states
    are live at any point. n_c = 0: no compressed key, o_cmp = 0.
    OUT, BO_W: strides so*; BO_C, BO_S: strides sc* (B, T, Hq, D). With SAVE: BO_C / BO_S / BO_W = the ungated
    o_cmp / o_slc / o_swa in their dtype, LSE_C / LSE_S / LSE_W their LSEs (B, T, Hq) in log2 units (LSE_C +inf for
    a row that sees no compressed key), as the separate kernels write them."""
    b64, hk, t0, tok, row_ok, head, qpos = _token_tile_rows(T, q_off, Hk, G, BT, GP, 0, 1)
    b32 = tl.program_id(1) // Hk
    M: tl.constexpr = BT * GP
    tok64 = tok.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BS)
    offs_s = tl.arange(0, NSELP)
    q = tl.load(Q + b64 * sqb + (tok64 * sqs + head * sqh)[:, None] + offs_d[None, :], mask=row_ok[:, None],
                other=0.0)
    # the first token's selection is the tile's: IDX row t0 // SEL_ROWS (SEL_ROWS = BS: one row per selection tile)
    lbase = IDX + b64 * s_ib + hk * s_ih + (t0 // SEL_ROWS).to(tl.int64) * s_it
    selv = tl.load(lbase + offs_s, mask=offs_s < NSEL, other=-1)      # ascending, -1 padding last
    minpos = t0 + q_off
    maxpos = tl.minimum(t0 + BT, T) - 1 + q_off
    wlo = tl.maximum(minpos - window + 1, 0) // BS
    whi = maxpos // BS
    n1 = tl.sum(((selv >= 0) & (selv < wlo)).to(tl.int32), 0)
    kbase = K + b64 * skb + hk * skh
    vbase = V + b64 * svb + hk * svh

    n_u = tl.sum((selv >= 0).to(tl.int32), 0)
    # Loop 0: the selected blocks every row sees whole inside its window (first key + window > maxpos; list
    # entries n2 .. n_u - 1): both states have the same (causal) mask there, so one state, copied into both after
    n2 = tl.sum(((selv >= 0) & (selv * BS + window <= maxpos)).to(tl.int32), 0)
    m_b = tl.full([M], float("-inf"), tl.float32)
    l_b = tl.zeros([M], tl.float32)
    acc_b = tl.zeros([M, HEAD_DIM], tl.float32)
    for i in tl.range(n2, n_u, num_stages=STAGES):
        key, kv_ok, s, v = _block_scores(q, KD, VD, kbase, vbase, b32, hk, tl.load(lbase + i) * BS, offs_n, offs_d,
                                         S, sks, svs, BS, HEAD_DIM, USE_TMA, True)
        acc_b, l_b, m_b = _online(acc_b, l_b, m_b, tl.where(key[None, :] <= qpos[:, None], s, float("-inf")), v,
                                  qk_scale)
    m_s, l_s, acc_s = m_b, l_b, acc_b
    m_w, l_w, acc_w = m_b, l_b, acc_b
    # Loop 1: the selected blocks before the window (entries 0 .. n1 - 1), unmasked, selected state only
    for i in tl.range(0, n1, num_stages=STAGES):
        key, kv_ok, s, v = _block_scores(q, KD, VD, kbase, vbase, b32, hk, tl.load(lbase + i) * BS, offs_n, offs_d,
                                         S, sks, svs, BS, HEAD_DIM, USE_TMA, False)
        acc_s, l_s, m_s = _online(acc_s, l_s, m_s, s, v, qk_scale)
    # Loop 2: the other selected blocks inside the window (list entries n1 .. n2 - 1: every selected block is
    # <= whi), one K / V load and one Q K^T for both states
    for i in tl.range(n1, n2, num_stages=STAGES):
        key, kv_ok, s, v = _block_scores(q, KD, VD, kbase, vbase, b32, hk, tl.load(lbase + i) * BS, offs_n, offs_d,
                                         S, sks, svs, BS, HEAD_DIM, USE_TMA, True)
        causal = key[None, :] <= qpos[:, None]
        acc_s, l_s, m_s = _online(acc_s, l_s, m_s, tl.where(causal & kv_ok[None, :], s, float("-inf")), v,
                                  qk_scale)
        acc_w, l_w, m_w = _online(acc_w, l_w, m_w,
                                  tl.where(causal & (key[None, :] > qpos[:, None] - window), s, float("-inf")), v,
                                  qk_scale)
    # Loop 3: the window's other blocks (wlo .. whi, not selected), ascending: the i-th is picked from WB
    # candidates by rank, not by a branch (a branch around the second update serialises every wgmma: ptxas C7513)
    cand = wlo + tl.arange(0, WB)
    hit = tl.max((cand[:, None] == selv[None, :]).to(tl.int32), 1)
    wonly = ((cand <= whi) & (hit == 0)).to(tl.int32)
    rank = tl.cumsum(wonly, 0) - 1
    for i in tl.range(0, tl.sum(wonly, 0), num_stages=STAGES):
        j0 = tl.sum(tl.where((wonly != 0) & (rank == i), cand, 0), 0) * BS
        key, kv_ok, s, v = _block_scores(q, KD, VD, kbase, vbase, b32, hk, j0, offs_n, offs_d, S, sks, svs, BS,
                                         HEAD_DIM, USE_TMA, True)
        # no causal mask: these blocks precede whi (the tile's own block, always selected: the top-k picks the local
        # block first), so every key is < minpos; only the window's lower edge masks
        acc_w, l_w, m_w = _online(acc_w, l_w, m_w, tl.where(key[None, :] > qpos[:, None] - window, s, float("-inf")),
                                  v, qk_scale)

    l_s1 = tl.where(l_s == 0.0, 1.0, l_s)
    l_w1 = tl.where(l_w == 0.0, 1.0, l_w)
    o_s = acc_s / l_s1[:, None]
    o_w = acc_w / l_w1[:, None]
    # selected + window folded into one fp32 result first (acc_s / acc_w die here; `_pin` keeps the compiler
    # from sinking o_s / o_w below the compressed loop, which would keep three accumulators live there and
    # make ptxas serialise every wgmma of the kernel: C7512), then the compressed branch with its own
    # accumulator: two (M, HEAD_DIM) fp32 states live, as in loop 2
    if SAVE:   # for the backward, as the two-launch path: o_slc, o_swa in q's dtype and their LSEs
        crow = b64 * scb + (tok64 * scs + head * sch)[:, None] + offs_d[None, :]
        orow = b64 * sob + (tok64 * sos + head * soh)[:, None] + offs_d[None, :]
        lrow = (b64 * T + tok64) * (Hk * G) + head
        tl.store(BO_S + crow, o_s.to(BO_S.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE_S + lrow, m_s + tl.math.log2(l_s1), mask=row_ok)
        tl.store(BO_W + orow, o_w.to(BO_W.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE_W + lrow, m_w + tl.math.log2(l_w1), mask=row_ok)
    if HAS_GATES:
        gb = GATES + b64 * sgb + tok64 * sgs + head * sgh
        g1 = tl.load(gb + sgc, mask=row_ok, other=0.0).to(tl.float32)
        g2 = tl.load(gb + 2 * sgc, mask=row_ok, other=0.0).to(tl.float32)
        res = g1[:, None] * o_s + g2[:, None] * o_w
    else:
        res = (o_s + o_w) * (1.0 / 3.0)
    res = _pin(res, PIN)
    acc_c, l_c, m_c = _cmp_rows(q, KC + b64 * skcb + hk * skch, VC + b64 * skcb + hk * skch, KCD, VCD, b32, hk,
                                skcs, offs_d, qpos, minpos, maxpos, n_c, qk_scale, CB, CS, CMP_N, HEAD_DIM, M,
                                STAGES, CMP_TMA)
    l_c1 = tl.where(l_c == 0.0, 1.0, l_c)
    o_c = acc_c / l_c1[:, None]
    crow = b64 * scb + (tok64 * scs + head * sch)[:, None] + offs_d[None, :]
    orow = b64 * sob + (tok64 * sos + head * soh)[:, None] + offs_d[None, :]
    if SAVE:   # o_cmp in q's dtype and its LSE (log2 units; +inf: a row that sees no compressed key)
        lrow = (b64 * T + tok64) * (Hk * G) + head
        tl.store(BO_C + crow, o_c.to(BO_C.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE_C + lrow, tl.where(l_c == 0.0, float("inf"), m_c + tl.math.log2(l_c1)), mask=row_ok)
    if HAS_GATES:
        g0 = tl.load(gb, mask=row_ok, other=0.0).to(tl.float32)
        res = res + g0[:, None] * o_c
    else:
        res = res + o_c * (1.0 / 3.0)
    tl.store(OUT + orow, res.to(OUT.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _pin(x, PIN: tl.constexpr):
    """x, computed here: an identity (one mov per element) that the compiler may not move, so values that feed it
    are not sunk below the code after it (PIN; the interpreter has no inline assembly: x itself)."""
    if PIN:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1)
    return x


@triton.jit
def _cmp_rows(q, kbase, vbase, KD, VD, b, hk, sks, offs_d, qpos, minpos, maxpos, n_c, qk_scale,
              CB: tl.constexpr, CS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, M: tl.constexpr,
              STAGES: tl.constexpr, USE_TMA: tl.constexpr, SPLIT: tl.constexpr = True):
    """Compressed-branch online softmax of M rows q at key positions qpos (all in minpos..maxpos) over the
    compressed keys of one (batch b, KV head hk) (kbase / vbase: its first key, rows sks apart; KD / VD: host
    descriptors when USE_TMA): compressed key c is visible to a row iff c < nvis = (qpos + 1 - CB) // CS + 1
    (0 before the first complete compressed block), capped at n_c. SPLIT: the key tiles every row sees completely
    (those of the first row, minpos) run without the per-element mask (the same values: it selects nothing there),
    the rest with it. STAGES: the loops' pipeline depth (None: the launch's num_stages). `_cmp_kernel`'s pass 1 and
    the fused kernel's compressed branch. -> (acc, l, m) in log2 units; a row that sees nothing keeps l = 0,
    acc = 0, m = -inf."""
    offs_n = tl.arange(0, BLOCK_N)
    nvis = tl.minimum(tl.where(qpos + 1 >= CB, (qpos + 1 - CB) // CS + 1, 0), n_c)
    hi = tl.minimum(tl.where(maxpos + 1 >= CB, (maxpos + 1 - CB) // CS + 1, 0), n_c)
    full = 0
    if SPLIT:
        lo_vis = tl.minimum(tl.where(minpos + 1 >= CB, (minpos + 1 - CB) // CS + 1, 0), hi)
        full = lo_vis // BLOCK_N * BLOCK_N
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_DIM], tl.float32)
    for start in tl.range(0, full, BLOCK_N, num_stages=STAGES):
        c = start + offs_n
        k = _kv_tile(KD, kbase, b, hk, start, c, c < hi, sks, offs_d, BLOCK_N, HEAD_DIM, USE_TMA, False)
        v = _kv_tile(VD, vbase, b, hk, start, c, c < hi, sks, offs_d, BLOCK_N, HEAD_DIM, USE_TMA, False)
        s = tl.dot(q, tl.trans(k))
        acc, l_i, m_i = _online(acc, l_i, m_i, s, v, qk_scale)
    for start in tl.range(full, hi, BLOCK_N, num_stages=STAGES):
        c = start + offs_n
        kv_ok = c < hi
        k = _kv_tile(KD, kbase, b, hk, start, c, kv_ok, sks, offs_d, BLOCK_N, HEAD_DIM, USE_TMA, True)
        v = _kv_tile(VD, vbase, b, hk, start, c, kv_ok, sks, offs_d, BLOCK_N, HEAD_DIM, USE_TMA, True)
        s = tl.dot(q, tl.trans(k))
        s = tl.where(c[None, :] < nvis[:, None], s, float("-inf"))
        acc, l_i, m_i = _online(acc, l_i, m_i, s, v, qk_scale)
    return acc, l_i, m_i


FORCE_FIRST_C = tl.constexpr(FORCE_FIRST)

# ---------------------------------------------------------------------------------------------------------- host
# Launch settings (H100, bf16, D=128): rows per program (token tiles x the group's heads) and keys per k-tile of
# the compressed and window kernels, warps and pipeline stages per kernel.
CMP_TILE_ROWS = 64
SWA_TILE_ROWS = 64
CMP_BLOCK_N = 64
SWA_BLOCK_N = 64
# slc_tile_64: SHARED programs of <= 64 rows; topk_small: the top-k below 512 selection blocks
# H200 sweep (session 15, `bench_nsa --phases`, HQ64 H4 D128, results/h200-nsa-phases-s15.json): cmp 3 stages
# -3 to -9% at 16K-64K (same selections), per-token slc 2 warps -1 to -2%; 128-row programs or 128-key tiles for cmp
# and swa were 5-50% slower at every length. Head dim 256 keeps cmp at 2 stages (3 K/V stages of 64 x 256 plus q
# exceed shared memory). fused 3 stages (113 KB, still 2 CTAs per SM): -5 to -26% vs 2 at 4K-64K (session 17).
NUM_WARPS = dict(cmp=4, swa=4, slc=2, topk=4, topk_small=2, slc_tile=8, slc_tile_64=4, fused=4)
NUM_STAGES = dict(cmp=3, swa=2, slc=3, slc_tile=3, fused=3)
# Selected branch: `_slc_kernel` (one program per token: rows = the G heads padded to 16, K/V loaded per token) or
# `_slc_tile_kernel` (R rows per program: R // next_pow2(G) tokens visit the union of their selected blocks; the
# same function). SLC_TILE_ROWS: None = choose by `slc_tile_rows` (measured rule), 0 = always per token, R = always
# tiles of R rows. H100 A/B (`bench_nsa.py --slc-ab 0,64,128`, random inputs, results/h100-nsa-slc-ab-s6.json,
# selected-kernel ms per-token / tile-128): MHA 8.8 / 1.1 (8K) ... 70.5 / 47.4 (64K); G=4 4.5 / 1.9 (8K), 8.9 / 7.3
# (16K), 17.8 / 22.8 (32K); G=16 2.3 / 2.7 (8K) ... 18.3 / 37.7 (64K). On random inputs a tile's tokens select
# nearly disjoint blocks, so the union grows with the blocks visible (benchmarks/NOTES.md, session 6).
# 8 warps: offline sm_90 builds (Triton 3.6, D=128, block 64, 16 selected) spill at 4 warps, not in the loop at 8.
SLC_TILE_ROWS = None
# selection="tile": programs whose tokens lie in one selection tile skip the union and the per-row block masks
SLC_SHARED = True
# Top-k of the selection scores (`_topk_kernel`): True = a chunk-maxima filter, then one pairwise rank of the
# candidates (a few reductions); False = num_selected serial arg-max rounds over all blocks. Same selected set.
# Parallel only for num_selected <= 32 (its CAP x CAP rank tile grows with num_selected squared) and from
# TOPK_PARALLEL_MIN_BLOCKS selection blocks. Measured (H200, HQ64 H4, bench_nsa --phases, session 14): top-k phase
# 8K 0.198 -> 0.070 ms, 16K 0.438 -> 0.155 ms (2 warps; 4 warps 0.090 / 0.200), 64K 3.72 -> 1.44 ms (4 warps; 2
# warps 1.66): parallel at every length, 2 warps below 512 blocks (NUM_WARPS topk_small).
PARALLEL_TOPK = True
TOPK_PARALLEL_MIN_BLOCKS = 0
# NSA_TMA: K / V tiles of the compressed kernel, the window kernel and both selected kernels through host TMA
# descriptors (CUDA sm_90+, and the interpreter) instead of pointer loads; the same values. H200 session 15
# (results/h200-nsa-phases-s15b.json): cmp -10 to -13%, swa -11%, slc_tile -15% at 16K-64K; forward 4K tile
# 0.81 -> 0.71 ms, 64K tile 23.0 -> 20.4 ms, 64K per token 42.3 -> 40.2 ms. The per-token `_slc_kernel` followed
# (offline: 711 -> 412 SASS instructions per selected block, 209 -> 172 registers, the same 72 KB shared; it reads
# ~7.6 TB/s from L2 either way, benchmarks/NOTES.md session 15).
# CMP_MASK_SPLIT: selection="tile"'s compressed launch (o_cmp only, no importance) runs the key tiles every token
# of a program sees completely without the per-element score mask (the same values). Measured with the importance
# pass split too: tile 64K cmp -8 to -9%, 4K +7%; per-token calls slower (their importance pass), so there it is off.
NSA_TMA = True
CMP_MASK_SPLIT = True
# FUSED_BRANCHES (selection="tile", issue 27): `_tile_branches_kernel` runs the selected, window and compressed
# branches of FUSED_ROWS-row programs in one pass (K / V of a block in both the selected and the window branch loaded
# and multiplied by q once, the gate combine in registers, no fp32 partial or o_cmp through memory) instead of
# `_slc_tile_kernel` + `_swa_kernel` + the o_cmp launch of `_cmp_kernel` (which then runs only as the importance
# launch at the selection tiles' first tokens); the same function (`fused_applies`: otherwise the separate kernels).
# The compressed branch runs after the window loop, once the selected and window states are folded into the gated
# result, so at most two 64 x D fp32 states are live. H200, HQ64 H4 D128 bf16, tile-mode forward: the selected and
# window branches fused, 4K / 8K / 16K / 64K: 0.729 -> 0.637, 1.526 -> 1.381, 3.274 -> 3.063, 19.63 -> 19.03 ms
# (session 16); the compressed branch inside it too (3 K/V stages) vs the separate o_cmp launch (2 stages),
# 4K / 8K / 16K / 32K / 64K: 0.740 -> 0.548, 1.334 -> 1.213, 3.025 -> 2.738, 7.319 -> 6.696, 19.48 -> 18.35 ms
# (session 17; `bench_nsa.py --phases --selection tile`, benchmarks/NOTES.md).
FUSED_BRANCHES = True
FUSED_ROWS = 64


def slc_tile_rows(G: int, n_b: int, tile_block: int = 0) -> int:
    """Rows per selected-branch program (0 = the per-token kernel) for GQA group G and n_b selection blocks.
    selection="token" (tile_block=0): token tiles of 128 rows for MHA, for G <= 4 up to 256 blocks (T <= 16K at
    block 64), and for any G up to 64 blocks (T <= 4K at block 64: there the union of 128 // G tokens' blocks is
    nearly every visible block, so a 128-row pass over it beats per-token 16-row programs; H200 G=16 forward 4K
    1.71 -> 1.48 ms, 8K 3.52 -> 3.94, results/h200-nsa-phases.json): where they measured faster.
    selection="tile" (tile_block = block_size): 64-row programs whose tokens lie in one selection tile, so a
    program visits exactly one selection (no union, no padded rows); 64 rows on 4 warps measured faster than 128
    on 8 for G = 4 / MHA and equal for G = 16 (results/h100-nsa-tile-ab-s7r2.json)."""
    if SLC_TILE_ROWS is not None:
        return SLC_TILE_ROWS
    if tile_block:
        return min(64, max(16, tile_block * triton.next_power_of_2(G)))
    return 128 if G == 1 or (G <= 4 and n_b <= 256) or n_b <= 64 else 0


def fused_applies(bs: int, bt: int, q_off: int, D: int) -> bool:
    """`_tile_branches_kernel` runs this call (with FUSED_BRANCHES): selection blocks of a power-of-two size
    16..64 (the window's key tiles are the selection blocks), bt-token programs that each lie inside one selection
    tile (bs % bt == 0 and the first query starts a tile), head dim <= 128 (two fp32 accumulators of 64 x D rows
    per program stay in registers)."""
    return 16 <= bs <= 64 and bs & (bs - 1) == 0 and bs % bt == 0 and q_off % bs == 0 and D <= 128


def supports_config(config) -> bool:
    bs, l, d = config.block_size, config.compress_block, config.compress_stride
    if bs % d or l > bs:
        return False
    R = bs // d
    return R <= CMP_BLOCK_N and (R & (R - 1)) == 0


def supports(q, config=None, causal: bool = True, **kw) -> bool:
    """True when the Triton kernels run these inputs (else the dispatcher uses the reference)."""
    if not causal or q.dim() != 4:
        return False
    D = q.shape[-1]
    if D < 16 or D > 256 or D & (D - 1):
        return False
    if config is not None and not supports_config(config):
        return False
    if _interpret():
        return q.dtype in (torch.float16, torch.float32)
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _tiles(G, rows):
    """(GP, BT): the group padded to a power of two and the tokens per program of `rows` rows."""
    GP = triton.next_power_of_2(G)
    return GP, max(1, rows // GP)


def tma_enabled(device) -> bool:
    """NSA_TMA and the kernels can load through TMA descriptors here: the interpreter (host TensorDescriptor
    emulated), or a CUDA device of compute capability >= 9 with a Triton that has host descriptors."""
    if not NSA_TMA:
        return False
    if _interpret():
        return _has_host_descriptors()
    d = torch.device(device)
    return d.type == "cuda" and _tma_device(d.index if d.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _has_host_descriptors() -> bool:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _tma_device(index: int) -> bool:
    """Device `index` has compute capability >= 9 and Triton host descriptors exist (cached: every forward call
    asks three times, once per descriptor set)."""
    return _has_host_descriptors() and torch.cuda.get_device_capability(index)[0] >= 9


def _descs(q, *specs):
    """Host TMA descriptors, one per (tensor (B, S, H, D), box keys) in specs, over the (B, H, S, D) view; all None
    when TMA is off (`tma_enabled`) or any tensor's base / strides are not 16-byte aligned (pointer loads)."""
    if not tma_enabled(q.device):
        return (None,) * len(specs)
    out = tuple(head_major_desc(t, n) for t, n in specs)
    return (None,) * len(specs) if any(x is None for x in out) else out


def _topk(imp_a, imp_b, n_b: int, q_off: int, tok0: int, ts: int, bs: int, nsel: int) -> torch.Tensor:
    """`_topk_kernel` on selection scores imp_a + imp_b (fp32 (B, Hk, n_rows, NBP), NBP > n_b; imp_b[..., j] is the
    spill into block j, its entry 0 unread). Row i is query position tok0 + i * ts + q_off (its visible blocks:
    j <= that // bs, capped at n_b - 1). Returns int32 (B, n_rows, Hk, nsel): ascending, -1 padded.
    The rows of imp_a / imp_b are overwritten (the parallel top-k compacts its candidates there)."""
    B, Hk, n_rows, NBP = imp_a.shape
    nselp = max(16, triton.next_power_of_2(nsel))
    sel = torch.empty((B, n_rows, Hk, nsel), dtype=torch.int32, device=imp_a.device)
    _topk_kernel[(n_rows, B * Hk)](
        imp_a, imp_b, sel, n_rows, Hk, NBP, n_b, q_off, sel.stride(0), sel.stride(1), sel.stride(2), tok0,
        BS=bs, NSEL=nsel, NBLK=max(16, triton.next_power_of_2(n_b)), NSELP=nselp, TS=ts,
        PARALLEL=PARALLEL_TOPK and nselp <= 32 and n_b >= TOPK_PARALLEL_MIN_BLOCKS, NCH=2 * nselp, CAP=2 * nselp,
        num_warps=NUM_WARPS["topk"] if n_b >= 512 else NUM_WARPS["topk_small"])
    return sel


def _forward(q, k, v, k_cmp, v_cmp, gates, scale, config, save: bool = False, prior=None, need_idx: bool = True):
    """Triton forward for one batch of equal-length sequences; queries are the last T of S positions.
    selection="tile": `prior` (B, Hk, num_selected) is the selection of the tile containing the first query when
    that tile starts before it (`nsa_reference.tile_prior`), else None.

    Returns (out (B, T, Hq, D) q.dtype, idx int32 (B, T, Hk, num_selected), lse, branch_out); idx is None when
    need_idx is False and the fused tile-mode launch ran (it reads the per-tile selection). With save=True
    (a gradient is needed): lse (3, B, T, Hq) fp32 = per-branch (cmp, slc, swa) log2-sum-exp2 of the scaled
    scores (log2 units, +inf for a row that sees nothing) and branch_out (3, B, T, Hq, D) in q's dtype = the
    ungated o_cmp, o_slc, o_swa; the backward needs them for delta = rowsum(dO_b * O_b), the gate gradients and
    to recompute each branch's probabilities. With save=False both are empty (0,) tensors.
    """
    B, T, Hq, D = q.shape
    S, Hk = k.shape[1], k.shape[2]
    G = Hq // Hk
    bs, l, d, nsel = config.block_size, config.compress_block, config.compress_stride, config.num_selected
    n_c = k_cmp.shape[1]
    n_b = -(-S // bs)
    NBP = n_b + 1
    q_off = S - T
    dev = q.device
    qk_scale = scale * LOG2E
    GP, BT = _tiles(G, CMP_TILE_ROWS)
    _, BT_SWA = _tiles(G, SWA_TILE_ROWS)
    k_cmp = k_cmp.contiguous()
    v_cmp = v_cmp.contiguous()
    if n_c == 0:
        k_cmp = v_cmp = q.new_zeros((B, 1, Hk, D))
    tile = config.selection == "tile"
    bt_f = max(1, min(FUSED_ROWS // GP, bs))   # tokens per fused program: inside one selection tile
    fused = tile and FUSED_BRANCHES and fused_applies(bs, bt_f, q_off, D)
    out = torch.empty((B, T, Hq, D), dtype=q.dtype, device=dev)
    # o_cmp (fp32), read back by the selected launch; the fused launch computes the compressed branch itself, so
    # there no launch reads or writes it, and `out` stands in where an argument is unused (its strides, those of
    # every (B, T, Hq, D) tensor here, address bo)
    o_cmp = out if fused else torch.empty((B, T, Hq, D), dtype=torch.float32, device=dev)
    if save:
        lse = torch.empty((3, B, T, Hq), dtype=torch.float32, device=dev)
        bo = torch.empty((3, B, T, Hq, D), dtype=q.dtype, device=dev)
    else:
        lse = torch.empty((0,), dtype=torch.float32, device=dev)
        bo = torch.empty((0,), dtype=q.dtype, device=dev)
    lse_c, lse_s, lse_w = (lse[0], lse[1], lse[2]) if save else (lse, lse, lse)
    bo_c, bo_s, bo_w = (bo[0], bo[1], bo[2]) if save else (bo, bo, bo)
    grid_cmp = (triton.cdiv(T, BT), B * Hk)
    cmp_args = (q, k_cmp, v_cmp, o_cmp)
    cmp_strides = (q.stride(0), q.stride(1), q.stride(2), k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
                   o_cmp.stride(0), o_cmp.stride(1), o_cmp.stride(2))
    R = bs // d
    # TMA descriptors (None: pointer loads): compressed K / V boxes of CMP_BLOCK_N keys
    kd, vd = _descs(q, (k_cmp, CMP_BLOCK_N), (v_cmp, CMP_BLOCK_N))
    cmp_meta = dict(CB=l, CS=d, BS=bs, R=R, HEAD_DIM=D, GP=GP, BT=BT, BLOCK_N=CMP_BLOCK_N, USE_TMA=kd is not None,
                    num_warps=NUM_WARPS["cmp"], num_stages=NUM_STAGES["cmp"] if D <= 128 else 2)
    cmp_descs = (kd, vd) if kd is not None else (o_cmp, o_cmp)

    def select(n_rows, tok0, ts, store_o):
        """Importance and top-k of n_rows row tokens (query tokens tok0 + i * ts) -> idx (B, n_rows, Hk, nsel);
        store_o: the same launch writes o_cmp (and the LSE) of every query token (ts == 1, n_rows == T)."""
        imp_a = torch.empty((B, Hk, n_rows, NBP), dtype=torch.float32, device=dev)
        imp_b = torch.empty((B, Hk, n_rows, NBP), dtype=torch.float32, device=dev)
        _cmp_kernel[(triton.cdiv(n_rows, BT), B * Hk)](
            *cmp_args, imp_a, imp_b, lse_c, *cmp_descs, *cmp_strides, n_rows, n_c, q_off, Hq, Hk, G, NBP,
            qk_scale, tok0, SELECT=True, SAVE=save and store_o, STORE_O=store_o, TS=ts, **cmp_meta)
        return _topk(imp_a, imp_b, n_b, q_off, tok0, ts, bs, nsel)

    if not tile:
        idx = select(T, 0, 1, True)
    else:
        # o_cmp of every token (the fused launch: inside it instead); the importance and top-k only at the
        # selection tiles' first tokens, whose selection every token of the tile then uses
        if not fused:
            _cmp_kernel[grid_cmp](
                *cmp_args, o_cmp, o_cmp, lse_c, *cmp_descs, *cmp_strides, T, n_c, q_off, Hq, Hk, G, NBP, qk_scale,
                0, SELECT=False, SAVE=save, STORE_O=True, TS=1, MASK_SPLIT=CMP_MASK_SPLIT, **cmp_meta)
        first = -(-q_off // bs)                       # first selection tile starting at or after the first query
        tok0 = first * bs - q_off
        n_tiles = max(0, triton.cdiv(T - tok0, bs))
        sel = select(n_tiles, tok0, bs, False) if n_tiles else torch.empty((B, 0, Hk, nsel), dtype=torch.int32,
                                                                                device=dev)
        if tok0:   # the first tok0 queries continue a tile that started before this call
            if prior is None:
                raise ValueError("selection='tile': the first query continues a selection tile started before it: "
                                 "pass its selection (nsa_reference.tile_prior)")
            sel = torch.cat([prior.to(torch.int32).reshape(B, 1, Hk, nsel), sel], 1)
        # sel[:, j] is the selection of tile q_off // bs + j and query i lies in tile (q_off + i) // bs, so the
        # per-token indices are sel repeated bs times, from row q_off % bs: one copy launch, no index tensor; the
        # fused launch reads sel itself, so without need_idx no copy (a short tile-mode call waits on the host)
        n = sel.shape[1]
        r0 = q_off % bs
        idx = None
        if need_idx or not fused:
            idx = sel.unsqueeze(2).expand(B, n, bs, Hk, nsel).reshape(B, n * bs, Hk, nsel)[:, r0:r0 + T].contiguous()
    part = o_cmp  # g_cmp * o_cmp + g_slc * o_slc is written in place of o_cmp (each program reads its own rows)
    gt = gates if gates is not None else o_cmp
    lst = sel if fused else idx     # the fused launch: one selection row per tile (SEL_ROWS = bs)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), o_cmp.stride(0), o_cmp.stride(1), o_cmp.stride(2),
               lst.stride(0), lst.stride(1), lst.stride(2),
               gt.stride(0), gt.stride(1), gt.stride(2), gt.stride(3) if gates is not None else 0)
    common = dict(BS=bs, BSP=max(16, triton.next_power_of_2(bs)), NSEL=nsel, HEAD_DIM=D,
                  HAS_GATES=gates is not None, SAVE=save)
    if fused:
        fkd, fvd = _descs(q, (k, bs), (v, bs))
        _tile_branches_kernel[(triton.cdiv(T, bt_f), B * Hk)](
            q, k, v, sel, gt, out, bo_c, bo_s, bo_w, lse_s, lse_w,
            *((fkd, fvd) if fkd is not None else (out, out)), k_cmp, v_cmp, lse_c,
            *((kd, vd) if kd is not None else (out, out)), *strides,
            out.stride(0), out.stride(1), out.stride(2), k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
            T, S, q_off, Hk, G, qk_scale, config.window, n_c,
            BS=bs, NSEL=nsel, NSELP=triton.next_power_of_2(nsel), HEAD_DIM=D, GP=GP, BT=bt_f,
            WB=triton.next_power_of_2(config.window // bs + 2),
            HAS_GATES=gates is not None, SAVE=save, STAGES=NUM_STAGES["fused"], USE_TMA=fkd is not None,
            CB=l, CS=d, CMP_N=CMP_BLOCK_N, CMP_TMA=kd is not None,
            PIN=not _interpret(), SEL_ROWS=bs,
            num_warps=NUM_WARPS["fused"], num_stages=NUM_STAGES["fused"])
        return out, idx, lse, bo
    rows = slc_tile_rows(G, n_b, bs if tile else 0)
    bsp = common["BSP"]
    skd, svd = _descs(q, (k, bsp), (v, bsp))     # selected blocks: boxes of BSP keys
    slc_descs = (skd, svd) if skd is not None else (o_cmp, o_cmp)
    if rows:
        if rows < 16 or rows & (rows - 1):
            raise ValueError(f"nsa.SLC_TILE_ROWS must be None, 0 or a power of two >= 16, got {rows}")
        bt = max(1, rows // GP)
        n_tiles = triton.cdiv(T, bt)
        shared = tile and SLC_SHARED and q_off % bs == 0 and bs % bt == 0   # each program inside one tile
        cap = 1 if shared else min(n_b, bt * nsel)        # the union of bt tokens' selections
        union = torch.empty((B * Hk * n_tiles * cap,), dtype=torch.int32, device=dev)
        _slc_tile_kernel[(n_tiles, B * Hk)](
            q, k, v, idx, union, o_cmp, gt, part, bo_c, bo_s, lse_s,
            *slc_descs, *strides, T, S, q_off, Hk, G, qk_scale, cap,
            NSELP=triton.next_power_of_2(nsel), NWP=triton.next_power_of_2(triton.cdiv(n_b, 32)), GP=GP, BT=bt,
            SLC_STAGES=NUM_STAGES["slc_tile"], SHARED=shared, USE_TMA=skd is not None,
            num_warps=NUM_WARPS["slc_tile_64"] if shared and rows <= 64 else NUM_WARPS["slc_tile"],
            num_stages=NUM_STAGES["slc_tile"], **common)
    else:
        _slc_kernel[(T, B * Hk)](
            q, k, v, idx, o_cmp, gt, part, bo_c, bo_s, lse_s, *slc_descs, *strides, T, S, q_off, Hk, G, qk_scale,
            GP=max(16, GP), SLC_STAGES=NUM_STAGES["slc"], USE_TMA=skd is not None, num_warps=NUM_WARPS["slc"],
            num_stages=NUM_STAGES["slc"], **common)
    wkd, wvd = _descs(q, (k, SWA_BLOCK_N), (v, SWA_BLOCK_N))
    _swa_kernel[(triton.cdiv(T, BT_SWA), B * Hk)](
        q, k, v, part, gt, out, bo_w, lse_w, *((wkd, wvd) if wkd is not None else (out, out)),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), part.stride(0), part.stride(1), part.stride(2),
        gt.stride(0), gt.stride(1), gt.stride(2), gt.stride(3) if gates is not None else 0,
        out.stride(0), out.stride(1), out.stride(2),
        T, S, q_off, Hk, G, qk_scale, config.window,
        HEAD_DIM=D, GP=GP, BT=BT_SWA, BLOCK_N=SWA_BLOCK_N, HAS_GATES=gates is not None, SAVE=save,
        USE_TMA=wkd is not None,
        num_warps=NUM_WARPS["swa"], num_stages=NUM_STAGES["swa"])
    return out, idx, lse, bo


# ---------------------------------------------------------------------------------------------------------- op
@torch.library.custom_op("sparsepatch::nsa_fwd", mutates_args=())
def _nsa_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
             gates: torch.Tensor | None, scale: float, block_size: int, num_selected: int, window: int,
             compress_block: int, compress_stride: int, tile: bool = False, prior: torch.Tensor | None = None,
             save: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, idx, lse, branch_out) of `_forward`; lse/branch_out are empty unless save (see `_forward`).
    tile: selection="tile", with `prior` as in `_forward`."""
    cfg = NSAParams(block_size, num_selected, window, compress_block, compress_stride,
                    selection="tile" if tile else "token")
    return _forward(q, k, v, k_cmp, v_cmp, gates, scale, cfg, save, prior)


@_nsa_fwd.register_fake
def _(q, k, v, k_cmp, v_cmp, gates, scale, block_size, num_selected, window, compress_block, compress_stride,
      tile=False, prior=None, save=False):
    B, T, Hq, D = q.shape
    out = q.new_empty((B, T, Hq, D))
    idx = q.new_empty((B, T, k.shape[2], num_selected), dtype=torch.int32)
    if save:
        return out, idx, q.new_empty((3, B, T, Hq), dtype=torch.float32), q.new_empty((3, B, T, Hq, D))
    return out, idx, q.new_empty((0,), dtype=torch.float32), q.new_empty((0,))


def _setup_context(ctx, inputs, output):
    q, k, v, k_cmp, v_cmp, gates, scale, *ints, tile, prior, save = inputs
    _out, idx, lse, bo = output
    ctx.save_for_backward(q, k, v, k_cmp, v_cmp, gates, idx, lse, bo, prior)
    ctx.params = (float(scale), tuple(int(x) for x in ints), bool(tile), bool(save))


def _backward(ctx, dout, _didx, _dlse, _dbo):
    """Autograd of `sparsepatch::nsa_fwd`: the Triton backward of `nsa_backward.py` (selection is constant)."""
    q, k, v, k_cmp, v_cmp, gates, idx, lse, bo, prior = ctx.saved_tensors
    scale, ints, tile, saved = ctx.params
    if not saved:   # forward ran without saving the branch LSEs / outputs: run it again with save=True
        _, idx, lse, bo = torch.ops.sparsepatch.nsa_fwd(q, k, v, k_cmp, v_cmp, gates, scale, *ints, tile, prior,
                                                        True)
    if dout is None:
        dout = torch.zeros_like(q)
    dq, dk, dv, dkc, dvc, dg = torch.ops.sparsepatch.nsa_bwd(q, k, v, k_cmp, v_cmp, gates, idx, lse, bo, dout,
                                                             scale, *ints)
    return (dq, dk, dv, dkc, dvc, (dg if gates is not None else None), None, None, None, None, None, None, None,
            None, None)


torch.library.register_autograd("sparsepatch::nsa_fwd", _backward, setup_context=_setup_context)


def _run(q, k, v, k_cmp, v_cmp, gates, scale, cfg, needs_grad: bool = False, prior=None, need_idx: bool = True):
    """(out, idx). Compiled graphs and calls needing a gradient go through the op (autograd attached to it and
    the branch LSEs / outputs saved); eager inference skips the op dispatch, and without need_idx idx may be None
    (selection="tile"'s fused launch reads the per-tile selection, so the per-token copy is skipped)."""
    if torch.compiler.is_compiling() or needs_grad:
        out, idx, _, _ = _nsa_fwd(q, k, v, k_cmp, v_cmp, gates, scale, cfg.block_size, cfg.num_selected,
                                  cfg.window, cfg.compress_block, cfg.compress_stride, cfg.selection == "tile",
                                  prior, bool(needs_grad))
        return out, idx
    out, idx, _, _ = _forward(q, k, v, k_cmp, v_cmp, gates, scale, cfg, prior=prior, need_idx=need_idx)
    return out, idx


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def nsa_attention(q, k, v, config, gates=None, cu_seqlens=None, causal: bool = True, cache=None,
                  compress_weights=None, *, scale=None, return_indices: bool = False):
    """Native Sparse Attention on the Triton kernels; same signature and function as `nsa_reference`.

    Returns out (B, T, Hq, D) [, indices int32 (B, T, Hk, num_selected) ascending, -1 padded].
    Inputs the kernels do not run (causal=False, unsupported config / head dim / dtype) fall back to the
    reference with a logged warning. Differentiable in q, k, v, gates and compress_weights through the Triton
    backward (`nsa_backward.py`; the pooling of compress_kv is differentiated by PyTorch autograd).
    """
    offs = ref._check_common(q, k, v, config, gates, cu_seqlens, causal, cache, compress_weights)
    kw = dict(gates=gates, cu_seqlens=cu_seqlens, causal=causal, cache=cache, compress_weights=compress_weights,
              scale=scale, return_indices=return_indices)
    needs_grad = _needs_grad(q, k, v, gates, compress_weights)
    if not supports(q, config=config, causal=causal):
        logger.warning("sparsepatch NSA: Triton kernels do not run these inputs (causal=%s, dtype=%s, D=%d, "
                       "config=%s); using the PyTorch reference", causal, q.dtype, q.shape[-1], config)
        return ref.nsa_attention(q, k, v, config, **kw)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on the head dim, got strides {tuple(t.stride())}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if gates is not None:
        gates = gates.to(torch.float32) if gates.dtype not in (torch.float16, torch.bfloat16, torch.float32) \
            else gates
    decode = nsa_decode.applies(q, k, cache, needs_grad, offs)   # one token per sequence: split-K decode path
    need_idx = return_indices or cache is not None     # the cache keeps the last tile's selection
    prior = None
    if cache is not None:
        k, v, k_cmp, v_cmp = cache.update(k, v, config, compress_weights,
                                          restart=(k.shape[1] == q.shape[1] and not cache.store_kv))
        if k.shape[1] < q.shape[1]:
            raise ValueError(f"cache holds {k.shape[1]} tokens, fewer than the {q.shape[1]} queries")
        prior = ref.tile_prior(config, k.shape[1] - q.shape[1], cache)
    elif offs is None:
        prior = ref.tile_prior(config, k.shape[1] - q.shape[1])
        k_cmp, v_cmp = compress_kv(k, v, config, compress_weights)
    if decode and prior is None:
        # token selection, or the first token of a selection tile: the decode step selects (and returns the blocks
        # the tile's later tokens reuse)
        out, idx = nsa_decode.nsa_decode(q, k, v, k_cmp, v_cmp, gates, scale, config,
                                         return_indices or config.selection == "tile")
    elif decode:   # a later token of a selection tile: the tile's blocks, no scoring
        out, idx = nsa_decode.nsa_decode(q, k, v, k_cmp, v_cmp, gates, scale, config, return_indices,
                                         indices=prior.to(torch.int32))
    elif offs is None:
        out, idx = _run(q, k, v, k_cmp, v_cmp, gates, scale, config, needs_grad, prior, need_idx)
    else:
        outs, idxs = [], []
        for a, b in zip(offs, offs[1:]):
            if b == a:
                continue
            ks, vs = k[:, a:b], v[:, a:b]
            k_cmp, v_cmp = compress_kv(ks, vs, config, compress_weights)
            o, i = _run(q[:, a:b], ks, vs, k_cmp, v_cmp, None if gates is None else gates[:, a:b], scale, config,
                        needs_grad, need_idx=need_idx)
            outs.append(o)
            idxs.append(i)
        out, idx = torch.cat(outs, 1), (torch.cat(idxs, 1) if need_idx else None)
    if cache is not None and idx is not None:   # None: a decode step that continued the cached tile
        cache.keep_tile_selection(config, k.shape[1], idx)
    return (out, idx) if return_indices else out
