"""Native Sparse Attention decode (one query token per sequence) in Triton: flash-decoding split-K.

Same function as `nsa_reference` (and `nsa._forward`) for T == 1, causal, no gradient. The prefill kernels of
`nsa.py` launch one program per (token tile, KV head), so a decode token gets B * Hk programs that each stream
every compressed key (S / 16 of them at the default config). Here the work is split over the keys instead:

1. `_dec_cmp_kernel`  grid (n_splits, B * Hk). A split = `tps` tiles of CMP_BLOCK_N compressed keys; rows = the
   G query heads of the KV head (padded to GP >= 16 for tl.dot). Per split: the online-softmax partial (m, l, acc)
   of the compressed branch (log2 units). Per tile: its row max mt and, per head, the tile's share of the block
   importance sum_c exp2(s - mt) * w(c, j) (overlap weights; a compressed block overlaps its own selection block
   (IMP_A[j]) and spills into the next (IMP_B[j + 1])). Nothing global is needed, so there is no second pass:
   exp2(s - lse) = exp2(s - mt) * exp2(mt - lse) is finished by (2).
2. `_dec_score_kernel` grid (n_chunks, B * Hk), top-k first stage. LSE of the compressed branch per head (merge of
   the split partials), block importance of a chunk of SCORE_CHUNK blocks = sum over the group's heads of
   IMP_A[h, j] * exp2(mt(tile(j)) - lse_h) + IMP_B[h, j] * exp2(mt(tile(j - 1)) - lse_h), local block +inf, block 0
   3e38, future blocks -inf; the chunk's best CW = min(chunk, next_pow2(num_selected)) blocks are written as
   candidates (int64 keys: score bits, reversed block index). Ranking is by pairwise comparison of keys (rank = number
   of candidates with a larger key: higher score, ties to the lower index, as the reference), so there are no
   sequential arg-max rounds: the single-program top-k
   this replaces took 11.8 of a 27 us step at 64K (benchmarks/profile_nsa_decode.py).
3. `_dec_attn_kernel` grid (num_selected + n_win, B * Hk): every program ranks the n_chunks * CW candidates (top-k
   second stage); program p < num_selected attends to the block of rank p (keys <= the query position; nothing
   when that rank holds no selectable block), the others to one chunk of the sliding window; each writes a
   partial (m, l, acc). With return_indices, program 0 also writes the selected blocks ascending, -1 padded.
4. `_dec_combine_kernel` grid (B * Hq): LSE merge of the three branches' partials, gates, output in q's dtype.

Host work: no sync, no .item(); a step allocates its fp32 scratch and its output from PyTorch's caching allocator
(no process-wide buffer, so concurrent streams and several captured graphs are safe). The step is CUDA-graph
capturable for a fixed context length. Supported inputs: those of `nsa.supports` (same config constraints).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .nsa_reference import FORCE_FIRST

__all__ = ["nsa_decode", "applies"]

LOG2E = 1.4426950408889634
FORCE_FIRST_C = tl.constexpr(FORCE_FIRST)

# Launch settings (H100, bf16, D=128, HQ64/H4).
CMP_BLOCK_N = 64          # compressed keys per tile (a multiple of block_size / compress_stride, which is <= 64)
TARGET_PROGRAMS = 160     # compressed-branch programs aimed at (tiles per split = cdiv(tiles * B * Hk, this))
NUM_WARPS = dict(cmp=4, score=4, attn=4, combine=4)
SCORE_CHUNK = 128         # selection blocks scored per program (the first top-k stage ranks within a chunk)
NUM_STAGES = dict(cmp=2)


# ---------------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _group_query(Q, sqb, sqh, Hk, G, GP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program axis 1 = b * Hk + kv head: (b64, hk, bh64, g, g_ok, offs_d, q) with q the (GP, HEAD_DIM) query rows
    of the kv head's G query heads (rows >= G zero)."""
    bh = tl.program_id(1)
    b64 = (bh // Hk).to(tl.int64)
    hk = bh % Hk
    g = tl.arange(0, GP)
    g_ok = g < G
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b64 * sqb + (hk * G + g)[:, None] * sqh + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    return b64, hk, bh.to(tl.int64), g, g_ok, offs_d, q


@triton.jit
def _dec_cmp_kernel(Q, KC, VC, WS, o_pm, o_pl, o_pacc, o_mt, o_ia, o_ib,
                    sqb, sqh, skb, sks, skh, svb, svs, svh,
                    n_c, Hk, G, n_split, n_tiles, tps, NBW, qk_scale,
                    CB: tl.constexpr, CS: tl.constexpr, BS: tl.constexpr, R: tl.constexpr,
                    HEAD_DIM: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr):
    sp = tl.program_id(0)
    b64, hk, bh64, g, g_ok, offs_d, q = _group_query(Q, sqb, sqh, Hk, G, GP, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    kbase = KC + b64 * skb + hk * skh
    vbase = VC + b64 * svb + hk * svh
    NB: tl.constexpr = BLOCK_N // R
    cr = offs_n % R
    w1 = tl.minimum(CB, BS - cr * CS).to(tl.float32)     # overlap with the compressed block's own selection block
    w2 = CB - w1                                           # spill into the next one
    jj = tl.arange(0, NB)
    ia_row = WS + o_ia + (bh64 * GP + g[:, None]) * NBW
    ib_row = WS + o_ib + (bh64 * GP + g[:, None]) * NBW
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HEAD_DIM], tl.float32)
    t_lo = sp * tps
    t_hi = tl.minimum(t_lo + tps, n_tiles)
    for t in range(t_lo, t_hi):
        c = t * BLOCK_N + offs_n
        ok = c < n_c
        k = tl.load(kbase + c[:, None].to(tl.int64) * sks + offs_d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(vbase + c[:, None].to(tl.int64) * svs + offs_d[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        mt = tl.max(s, 1)                                  # finite: a launched tile holds >= 1 compressed key
        pt = tl.math.exp2(s - mt[:, None])
        a = tl.sum(tl.reshape(pt * w1[None, :], (GP, NB, R)), 2)
        sb = tl.sum(tl.reshape(pt * w2[None, :], (GP, NB, R)), 2)
        j = t * NB + jj
        tl.store(ia_row + j[None, :], a, mask=g_ok[:, None])
        tl.store(ib_row + (j + 1)[None, :], sb, mask=g_ok[:, None])
        tl.store(WS + o_mt + (bh64 * n_tiles + t) * GP + g, mt, mask=g_ok)
        m_new = tl.maximum(m_i, mt)
        alpha = tl.math.exp2(m_i - m_new)
        p = pt * tl.math.exp2(mt - m_new)[:, None]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    prow = (bh64 * n_split + sp) * GP + g
    tl.store(WS + o_pm + prow, m_i, mask=g_ok)
    tl.store(WS + o_pl + prow, l_i, mask=g_ok)
    tl.store(WS + o_pacc + prow[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _rank_keys(score, j, NJ: tl.constexpr):
    """int64 sort keys of block scores: high word = the fp32 bits of the score (monotone for scores >= 0; -inf is a
    negative int and sorts below them, and its key is negative), low word = NJ - 1 - j (ties to the lower index).
    Keys of distinct blocks are distinct, so one integer compare orders a pair."""
    return (score.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (NJ - 1 - j).to(tl.int64)


@triton.jit
def _rank(key):
    """Rank of each key among `key` (0 = largest): a row sum of the pairwise comparison matrix."""
    return tl.sum((key[None, :] > key[:, None]).to(tl.int32), 1)


@triton.jit
def _dec_score_kernel(WS, CAND, o_pm, o_pl, o_mt, o_ia, o_ib,
                      Hk, G, n_split, n_tiles, NBW, n_b,
                      NB: tl.constexpr, CH: tl.constexpr, CW: tl.constexpr, NBLK: tl.constexpr,
                      NSPLITP: tl.constexpr, GP: tl.constexpr, HC: tl.constexpr):
    ch = tl.program_id(0)
    bh = tl.program_id(1)
    bh64 = bh.to(tl.int64)
    j = ch * CH + tl.arange(0, CH)
    cur = n_b - 1                                   # the query is the last token: its block is the last one
    n_w = n_tiles * NB                              # IMP_A written for j < n_w, IMP_B for 1 <= j <= n_w
    ok_a = (j < n_w) & (j <= cur)
    ok_b = (j >= 1) & (j <= n_w) & (j <= cur)
    t_a = j // NB
    t_b = tl.maximum(j - 1, 0) // NB
    sp = tl.arange(0, NSPLITP)
    sp_ok = sp < n_split
    score = tl.zeros([CH], tl.float32)
    for hc in tl.static_range(GP // HC):
        gg = hc * HC + tl.arange(0, HC)
        gok = gg < G
        pidx = (bh64 * n_split + sp[:, None]) * GP + gg[None, :]
        pmask = sp_ok[:, None] & gok[None, :]
        pm = tl.load(WS + o_pm + pidx, mask=pmask, other=float("-inf"))
        pl = tl.load(WS + o_pl + pidx, mask=pmask, other=0.0)
        mx = tl.max(pm, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        tot = tl.sum(pl * tl.math.exp2(pm - mx[None, :]), 0)
        lse = tl.where(tot > 0.0, mx + tl.math.log2(tl.where(tot > 0.0, tot, 1.0)), float("inf"))   # [HC]
        ma = gok[:, None] & ok_a[None, :]
        mb = gok[:, None] & ok_b[None, :]
        ia = tl.load(WS + o_ia + (bh64 * GP + gg[:, None]) * NBW + j[None, :], mask=ma, other=0.0)
        ib = tl.load(WS + o_ib + (bh64 * GP + gg[:, None]) * NBW + j[None, :], mask=mb, other=0.0)
        mta = tl.load(WS + o_mt + (bh64 * n_tiles + t_a[None, :]) * GP + gg[:, None], mask=ma, other=0.0)
        mtb = tl.load(WS + o_mt + (bh64 * n_tiles + t_b[None, :]) * GP + gg[:, None], mask=mb, other=0.0)
        fa = tl.where(ma, tl.math.exp2(mta - lse[:, None]), 0.0)
        fb = tl.where(mb, tl.math.exp2(mtb - lse[:, None]), 0.0)
        score += tl.sum(ia * fa + ib * fb, 0)
    score = tl.where(j == 0, FORCE_FIRST_C, score)
    score = tl.where(j == cur, float("inf"), score)
    score = tl.where(j <= cur, score, float("-inf"))
    # The chunk's best CW blocks are the only ones that can be in the global top num_selected (CW >= num_selected
    # or CW == CH): write them to slots by rank; the attention kernel ranks the n_chunks * CW candidates.
    key = _rank_keys(score, j, NBLK)
    rank = _rank(key)
    tl.store(CAND + bh64 * (tl.num_programs(0) * CW) + ch * CW + rank, key, mask=rank < CW)


@triton.jit
def _dec_attn_kernel(Q, K, V, IDX, WS, CAND, o_sm, o_sl, o_sacc,
                     sqb, sqh, skb, sks, skh, svb, svs, svh,
                     S, Hk, G, window, n_part, qk_scale,
                     NSEL: tl.constexpr, BS: tl.constexpr, BLK: tl.constexpr, HEAD_DIM: tl.constexpr,
                     GP: tl.constexpr, MP: tl.constexpr, NBLK: tl.constexpr, NSELP: tl.constexpr,
                     RET_IDX: tl.constexpr):
    p_id = tl.program_id(0)
    b64, hk, bh64, g, g_ok, offs_d, q = _group_query(Q, sqb, sqh, Hk, G, GP, HEAD_DIM)
    offs_n = tl.arange(0, BLK)
    qpos = S - 1
    is_slc = p_id < NSEL
    # Top-k, second stage: the rank of each of the MP candidates of this (b, kv head); program p takes rank p.
    # (Window programs compute it too: a few hundred cycles, cheaper than a branch per program kind.)
    key = tl.load(CAND + bh64 * MP + tl.arange(0, MP))
    cj = NBLK - 1 - (key & 0xFFFFFFFF).to(tl.int32)
    rank = _rank(key)
    sel = (rank < NSEL) & (key >= 0)                      # key < 0: score -inf (a block after the query's)
    jb = tl.max(tl.where(sel & (rank == p_id), cj, -1), 0)
    if RET_IDX:
        if p_id == 0:          # the selected blocks in ascending order, -1 padded (the reference's layout)
            pos = tl.sum((sel[None, :] & (cj[None, :] < cj[:, None])).to(tl.int32), 1)
            tl.store(IDX + bh64 * NSEL + pos, cj, mask=sel)
            cnt = tl.sum(sel.to(tl.int32), 0)
            sl = tl.arange(0, NSELP)
            tl.store(IDX + bh64 * NSEL + sl, tl.full([NSELP], -1, tl.int32), mask=(sl >= cnt) & (sl < NSEL))
    w_lo = tl.maximum(qpos - window + 1, 0) + (p_id - NSEL) * BLK
    start = tl.where(is_slc, tl.maximum(jb, 0) * BS, w_lo)
    hi = tl.where(is_slc, tl.where(jb >= 0, start + BS, 0), S)       # exclusive; padding entry (-1): nothing
    key = start + offs_n
    ok = (key < hi) & (key < S)
    k = tl.load(K + b64 * skb + hk * skh + key[:, None].to(tl.int64) * sks + offs_d[None, :], mask=ok[:, None],
                other=0.0)
    v = tl.load(V + b64 * svb + hk * svh + key[:, None].to(tl.int64) * svs + offs_d[None, :], mask=ok[:, None],
                other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m = tl.max(s, 1)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v)
    prow = (bh64 * n_part + p_id) * GP + g
    tl.store(WS + o_sm + prow, m, mask=g_ok)
    tl.store(WS + o_sl + prow, l_i, mask=g_ok)
    tl.store(WS + o_sacc + prow[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _merge(WS, o_m, o_l, o_acc, row0, lo, hi, g, offs_d, NP: tl.constexpr, GP: tl.constexpr,
           HEAD_DIM: tl.constexpr):
    """LSE merge of partials lo..hi-1 of one head (rows (row0 + i) * GP + g): the normalised output (0 if empty)."""
    i = tl.arange(0, NP)
    ok = (i >= lo) & (i < hi)
    prow = (row0 + i) * GP + g
    m = tl.load(WS + o_m + prow, mask=ok, other=float("-inf"))
    l_ = tl.load(WS + o_l + prow, mask=ok, other=0.0)
    mx = tl.max(m, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.where(ok, tl.math.exp2(m - mx), 0.0)
    tot = tl.sum(l_ * w, 0)
    acc = tl.load(WS + o_acc + prow[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0)
    return o / tl.where(tot > 0.0, tot, 1.0)


@triton.jit
def _dec_combine_kernel(WS, GATES, OUT, o_pm, o_pl, o_pacc, o_sm, o_sl, o_sacc,
                        sgb, sgh, sgc, sob, soh,
                        Hq, G, n_split, n_part,
                        NSEL: tl.constexpr, NSPLITP: tl.constexpr, NPARTP: tl.constexpr, HEAD_DIM: tl.constexpr,
                        GP: tl.constexpr, HAS_GATES: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // Hq
    h = pid % Hq
    bh64 = (pid // G).to(tl.int64)                  # = b * Hk + h // G
    g = h % G
    offs_d = tl.arange(0, HEAD_DIM)
    o_cmp = _merge(WS, o_pm, o_pl, o_pacc, bh64 * n_split, 0, n_split, g, offs_d, NSPLITP, GP, HEAD_DIM)
    o_slc = _merge(WS, o_sm, o_sl, o_sacc, bh64 * n_part, 0, NSEL, g, offs_d, NPARTP, GP, HEAD_DIM)
    o_swa = _merge(WS, o_sm, o_sl, o_sacc, bh64 * n_part, NSEL, n_part, g, offs_d, NPARTP, GP, HEAD_DIM)
    if HAS_GATES:
        gb = GATES + b.to(tl.int64) * sgb + h * sgh
        g0 = tl.load(gb).to(tl.float32)
        g1 = tl.load(gb + sgc).to(tl.float32)
        g2 = tl.load(gb + 2 * sgc).to(tl.float32)
        o = g0 * o_cmp + g1 * o_slc + g2 * o_swa
    else:
        o = (o_cmp + o_slc + o_swa) * (1.0 / 3.0)
    tl.store(OUT + b.to(tl.int64) * sob + h * soh + offs_d, o.to(OUT.dtype.element_ty))


# ---------------------------------------------------------------------------------------------------------- host
def _workspace(n, dtype, device):
    """Scratch for one decode step, from PyTorch's caching allocator: stream-ordered and CUDA-graph aware, so calls on
    several streams or in several captured graphs never share it (a process-wide buffer would). Sized up to a power
    of two (>= 1024) so repeated steps reuse the same cached block."""
    return torch.empty(triton.next_power_of_2(max(n, 1024)), dtype=dtype, device=device)


def applies(q, k, cache, needs_grad: bool, offs) -> bool:
    """True when `nsa.nsa_attention` should take the decode path (after `nsa.supports` said yes)."""
    return (q.shape[1] == 1 and not needs_grad and offs is None and (cache is not None or k.shape[1] > 1)
            and not torch.compiler.is_compiling())


def _plan(B, Hk, G, S, n_c, config):
    """Launch sizes (all host ints, from shapes only)."""
    bs, d = config.block_size, config.compress_stride
    R = bs // d
    NB = CMP_BLOCK_N // R
    n_tiles = triton.cdiv(n_c, CMP_BLOCK_N)
    tps = max(1, triton.cdiv(n_tiles * B * Hk, TARGET_PROGRAMS))
    n_split = max(1, triton.cdiv(n_tiles, tps))
    GP = max(16, triton.next_power_of_2(G))
    BLK = max(16, triton.next_power_of_2(bs))
    n_win = triton.cdiv(config.window, BLK)
    return R, NB, n_tiles, tps, n_split, GP, BLK, n_win


def nsa_decode(q, k, v, k_cmp, v_cmp, gates, scale, config, return_indices: bool = False):
    """One decode step: q (B, 1, Hq, D) at position S - 1 of k/v (B, S, Hk, D); k_cmp/v_cmp (B, n_c, Hk, D) the
    compressed blocks of k/v (any strides with a unit last one). Returns (out (B, 1, Hq, D) q.dtype,
    idx int32 (B, 1, Hk, num_selected) or None unless return_indices)."""
    B, T, Hq, D = q.shape
    S, Hk = k.shape[1], k.shape[2]
    G = Hq // Hk
    BH = B * Hk
    bs, nsel = config.block_size, config.num_selected
    n_c = k_cmp.shape[1]
    dev = q.device
    R, NB, n_tiles, tps, n_split, GP, BLK, n_win = _plan(B, Hk, G, S, n_c, config)
    n_b = -(-S // bs)
    NBW = n_tiles * NB + 1
    n_part = nsel + n_win
    if n_c == 0:
        k_cmp = v_cmp = q.new_zeros((B, 1, Hk, D))
    if k_cmp.stride(-1) != 1 or v_cmp.stride(-1) != 1:
        k_cmp, v_cmp = k_cmp.contiguous(), v_cmp.contiguous()
    # fp32 workspace: cmp partials (m, l, acc), tile maxima, per-head importance (A, B), slc/swa partials
    # top-k candidates: NBLK block scores in n_chunks chunks of CH, each chunk keeps its best CW
    NBLK = max(16, triton.next_power_of_2(n_b))
    CH = min(NBLK, SCORE_CHUNK)
    CW = min(CH, triton.next_power_of_2(nsel))
    n_chunks = NBLK // CH
    sizes = [BH * n_split * GP, BH * n_split * GP, BH * n_split * GP * D, BH * max(n_tiles, 1) * GP,
             BH * GP * NBW, BH * GP * NBW, BH * n_part * GP, BH * n_part * GP, BH * n_part * GP * D]
    offs, tot = [], 0
    for n in sizes:
        offs.append(tot)
        tot += (n + 31) // 32 * 32
    ws = _workspace(tot, torch.float32, dev)
    o_pm, o_pl, o_pacc, o_mt, o_ia, o_ib, o_sm, o_sl, o_sacc = offs
    # without return_indices the attention kernel stores no indices (RET_IDX=False): ws stands in for the argument
    idx = torch.empty((B, 1, Hk, nsel), dtype=torch.int32, device=dev) if return_indices else ws
    qk_scale = scale * LOG2E
    _dec_cmp_kernel[(n_split, BH)](
        q, k_cmp, v_cmp, ws, o_pm, o_pl, o_pacc, o_mt, o_ia, o_ib,
        q.stride(0), q.stride(2), k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
        v_cmp.stride(0), v_cmp.stride(1), v_cmp.stride(2),
        n_c, Hk, G, n_split, n_tiles, tps, NBW, qk_scale,
        CB=config.compress_block, CS=config.compress_stride, BS=bs, R=R, HEAD_DIM=D, GP=GP, BLOCK_N=CMP_BLOCK_N,
        num_warps=NUM_WARPS["cmp"], num_stages=NUM_STAGES["cmp"])
    cand = _workspace(BH * n_chunks * CW, torch.int64, dev)
    _dec_score_kernel[(n_chunks, BH)](
        ws, cand, o_pm, o_pl, o_mt, o_ia, o_ib, Hk, G, n_split, n_tiles, NBW, n_b,
        NB=NB, CH=CH, CW=CW, NBLK=NBLK, NSPLITP=max(2, triton.next_power_of_2(n_split)), GP=GP,
        HC=max(1, min(GP, 4096 // CH)), num_warps=NUM_WARPS["score"])
    _dec_attn_kernel[(n_part, BH)](
        q, k, v, idx, ws, cand, o_sm, o_sl, o_sacc,
        q.stride(0), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        S, Hk, G, config.window, n_part, qk_scale,
        NSEL=nsel, BS=bs, BLK=BLK, HEAD_DIM=D, GP=GP, MP=n_chunks * CW, NBLK=NBLK,
        NSELP=max(16, triton.next_power_of_2(nsel)), RET_IDX=return_indices, num_warps=NUM_WARPS["attn"])
    out = torch.empty((B, 1, Hq, D), dtype=q.dtype, device=dev)
    gt = gates if gates is not None else out
    _dec_combine_kernel[(B * Hq,)](
        ws, gt, out, o_pm, o_pl, o_pacc, o_sm, o_sl, o_sacc,
        gt.stride(0), gt.stride(2), gt.stride(3) if gates is not None else 0, out.stride(0), out.stride(2),
        Hq, G, n_split, n_part,
        NSEL=nsel, NSPLITP=max(2, triton.next_power_of_2(n_split)), NPARTP=triton.next_power_of_2(n_part),
        HEAD_DIM=D, GP=GP, HAS_GATES=gates is not None, num_warps=NUM_WARPS["combine"])
    return out, (idx if return_indices else None)
