"""Native Sparse Attention decode (one query token per sequence) in Triton: flash-decoding split-K, two launches.

Same function as `nsa_reference` (and `nsa._forward`) for T == 1, causal, no gradient. Rows of every tile = the G
query heads of one KV head (padded to GP >= 16 for tl.dot). Work per (b, kv head):

1. `_dec_cmp_kernel`  grid (n_split, B * Hk). A split = `tps` tiles of CMP_BLOCK_N compressed keys: the online-softmax
   partial (m, l, acc) of the compressed branch (log2 units) and, per tile, its row max mt and per head the tile's
   share of the block importance sum_c exp2(s - mt) * w(c, j) (overlap weights; a compressed block overlaps its own
   selection block (IMP_A[j]) and spills into the next (IMP_B[j + 1])). exp2(s - lse) = exp2(s - mt) * exp2(mt - lse)
   is finished in (2a), so there is no second pass. Program 0 also resets (2)'s counters, slots and candidate keys.
2. `_dec_sel_kernel`  grid (n_prog + n_win, B * Hk), launched with programmatic dependent launch (PDL) so that it
   starts while (1) runs. Window programs (the last n_win) attend to one chunk of the sliding window before
   griddepcontrol.wait (they need only q, k, v). Then, phases separated by per-(b, kv head) counters:
   a. score: program c < n_chunks: LSE of the compressed branch per head (merge of the split partials), block
      importance of its chunk of SCORE_CHUNK blocks (sum over the group's heads of IMP_A * exp2(mt - lse) + IMP_B * ..;
      local block +inf, block 0 3e38, future blocks -inf), its best CW = min(chunk, next_pow2(num_selected)) blocks
      as candidates (int64 keys: score bits, reversed block index; rank = number of larger keys: higher score, ties
      to the lower index, as the reference; no sequential arg-max rounds).
   b. final rank: each chunk program ranks its own CW candidates among all n_chunks * CW (exact for the top
      num_selected: every key above a selected one is a candidate too) and writes slot[rank] = block. The window
      programs meanwhile merge the compressed and window branches per head (off the critical path).
   c. selected: program p < num_selected attends to the block in slot p (keys <= the query position; nothing for an
      empty slot); with return_indices, program 0 writes the selected blocks ascending, -1 padded.
   d. merge: program h < G: LSE merge of the selected partials + the compressed/window part, gates, output.
   In one launch the phases wait on each other by spinning, which needs every program resident at once: taken when
   the grid fits on the SMs (n_prog = max(n_chunks, num_selected, G); 96 programs at B=1, HQ64/H4), else the same
   kernel runs once per phase (4 launches; always so under TRITON_INTERPRET=1, which runs programs one after
   another). Waits: (b) spins on a per-(b, kv head) counter of the chunk programs (KEY_POLL, off by default: polls
   the candidate keys themselves, reset to a sentinel by (1)), (c) polls its own slot (SLOT_POLL: reset to -2 by
   (1)), the window merges and (d) spin on per-(b, kv head) counters ((d): one counter that every arrival it needs
   goes to: selected partials, final ranks, window merges) (acquire loads; arrivals are a bar.sync then a release
   add). Every wait is bounded (SPIN_LIMIT polls); one that gives up sets a per-(b, kv head) flag that reaches the
   merge through the later arrivals, and the merge then writes NaN for that (b, kv head): a broken co-residency
   assumption shows as NaN output, never as a hang or a wrong number.

Given selection (`indices=`, selection="tile": a step whose tile started earlier reuses the tile's selection, 63 of
64 steps at block 64): the compressed kernel is built without the importance work (IMP off: no tile maxima, IMP_A/B,
slots or candidate keys), the selection kernel without the score and rank phases (GIVEN), and by default (GIVEN_EARLY)
program p < num_selected attends to the given block p before griddepcontrol.wait, as the window programs do, so the
selected branch overlaps the compressed kernel; after the wait the merge programs wait for the window and selected
partials (two counters, the same bounded waits and NaN poison) and merge all three branches themselves: one launch
when co-resident, else two (partials, then the merge). GIVEN_EARLY off: the normal structure minus score and rank (the
selected programs read their block after the wait; the window programs pre-merge as before).

Host work: no sync, no .item(); a step allocates its fp32 scratch and its output from PyTorch's caching allocator
(no process-wide buffer, so concurrent streams and several captured graphs are safe). The step is CUDA-graph
capturable for a fixed context length. Supported inputs: those of `nsa.supports` (same config constraints).
Phase timings and the variants measured: benchmarks/NOTES.md, "NSA decode: two launches" (PROBE builds record
per-program clocks for benchmarks/profile_nsa_decode.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .._common import num_sms
from .reference import FORCE_FIRST

__all__ = ["nsa_decode", "applies"]

LOG2E = 1.4426950408889634
FORCE_FIRST_C = tl.constexpr(FORCE_FIRST)

# Launch settings (H100, bf16, D=128, HQ64/H4).
CMP_BLOCK_N = 64          # compressed keys per tile (a multiple of block_size / compress_stride, which is <= 64)
TARGET_PROGRAMS = 320     # compressed-branch programs aimed at (tiles per split = cdiv(tiles * B * Hk, this)); 320:
                          # one tile per split up to 64K at B=1, HQ64/H4 (H200: 64K per-token step 0.65 us faster
                          # than with 160, NOTES NSA decode session 16)
NUM_WARPS = dict(cmp=4, sel=4)
SCORE_CHUNK = 64          # selection blocks scored per program (the first top-k stage ranks within a chunk)
NUM_STAGES = dict(cmp=2)  # 2: a split's second tile is loaded only after the first tile's wait (sm_90 SASS); 3 issues
                          # both before it (one cold HBM round trip instead of two; not yet timed: NOTES session 5)
FUSE = True               # score + attention + merge in one launch with in-kernel barriers (when co-resident)
PDL = True                # programmatic dependent launch of the selection kernel (Hopper; no-op semantics else)
KEY_POLL = False          # True: final rank polls the candidate keys themselves (sentinel-initialised) instead of a
                          # counter. Off: with it on, 2 of 4 runs of the cache + graph GPU test timed out in that
                          # wait (NaN output; 0 of 4 with it off, session 5, cause not found: NOTES NSA decode s5)
SLOT_POLL = True          # each selected-block program polls its own slot instead of waiting for every chunk program
EARLY_LOADS = True        # tile maxima stored per selection block (the score phase's four [G, chunk] loads share one
                          # layout, so they leave together instead of in three dependent rounds through shared
                          # memory) and the merge loads the compressed + window part before its last wait
PROBE = None              # a dict: the next calls record per-program phase clocks into it (benchmarks only)
SPIN_LIMIT = 1 << 22      # polls before a barrier wait gives up (a safety net against a hung device, never hit);
                          # a wait that gives up makes the step's output NaN for that (b, kv head) (see _dec_sel_kernel)
GIVEN_EARLY = True        # given indices: selected blocks before griddepcontrol.wait, one merge of all three branches
                          # (False: the normal step's structure without score and rank; NOTES session 7)
_STALL = 0                # tests only: 1..4 makes one in-kernel wait unsatisfiable (rank, selected, merge, window)
KEY_UNSET = -(1 << 63)    # candidate key not written yet (the key of score -0.0, which no block has)
SLOT_UNSET = -2           # selected-block slot not written yet (-1 = written, no block)
KEY_UNSET_C = tl.constexpr(KEY_UNSET)
SLOT_UNSET_C = tl.constexpr(SLOT_UNSET)


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
def _attend_keys(q, K, V, b64, hk, start, hi, S, skb, sks, skh, svb, svs, svh, qk_scale, offs_d,
                 BLK: tl.constexpr):
    """Partial (m, l, acc) of the (GP, HEAD_DIM) query rows over keys [start, min(hi, S)), at most BLK of them
    (log2 units; m = -inf and l = 0 where no key is valid)."""
    key = start + tl.arange(0, BLK)
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
    return m, tl.sum(p, 1), tl.dot(p.to(v.dtype), v)


@triton.jit
def _store_partial(WS, o_m, o_l, o_acc, prow, m, l_i, acc, g_ok, offs_d, HEAD_DIM: tl.constexpr):
    tl.store(WS + o_m + prow, m, mask=g_ok)
    tl.store(WS + o_l + prow, l_i, mask=g_ok)
    tl.store(WS + o_acc + prow[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _dec_cmp_kernel(Q, KC, VC, WS, CNT, CAND, TS, o_pm, o_pl, o_pacc, o_mt, o_ia, o_ib,
                    sqb, sqh, skb, sks, skh, svb, svs, svh,
                    n_c, Hk, G, n_split, n_tiles, tps, NBW, qk_scale,
                    CB: tl.constexpr, CS: tl.constexpr, BS: tl.constexpr, R: tl.constexpr,
                    HEAD_DIM: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr, CNTW: tl.constexpr,
                    NSELP: tl.constexpr, MP: tl.constexpr, KEY_POLL: tl.constexpr, SLOT_POLL: tl.constexpr,
                    MTB: tl.constexpr, USE_PDL: tl.constexpr, PROBE: tl.constexpr, IMP: tl.constexpr):
    # IMP False (the step was given its selected blocks): no block importance, tile maxima, slots or candidate keys,
    # only the compressed branch's partials and the counter reset
    sp = tl.program_id(0)
    ts = TS + (tl.program_id(1).to(tl.int64) * tl.num_programs(0) + sp) * 4
    if PROBE:
        _gstamp(ts, 0)
        _stamp(ts, 1, sp)
    if USE_PDL:        # the selection kernel may start now: it only loads q before its griddepcontrol.wait
        gdc_launch_dependents()
    b64, hk, bh64, g, g_ok, offs_d, q = _group_query(Q, sqb, sqh, Hk, G, GP, HEAD_DIM)
    if sp == 0:        # the selection kernel's barrier counters, selected-block slots and candidate keys (it reads
        c8 = tl.arange(0, 8)   # them only after its griddepcontrol.wait, i.e. after this kernel): 8 counters (+5: the
        tl.store(CNT + bh64 * CNTW + c8, tl.zeros([8], tl.int32))       # timeout flag), NSELP slots
        if IMP:
            sl = tl.arange(0, NSELP)
            if SLOT_POLL:  # ranks < MP are written by the final rank (SLOT_UNSET until then), the others stay empty
                tl.store(CNT + bh64 * CNTW + 8 + sl, tl.where(sl < MP, SLOT_UNSET_C, -1))
            else:
                tl.store(CNT + bh64 * CNTW + 8 + sl, tl.full([NSELP], -1, tl.int32))
            if KEY_POLL:
                tl.store(CAND + bh64 * MP + tl.arange(0, MP), tl.full([MP], KEY_UNSET_C, tl.int64))
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
        if IMP:
            a = tl.sum(tl.reshape(pt * w1[None, :], (GP, NB, R)), 2)
            sb = tl.sum(tl.reshape(pt * w2[None, :], (GP, NB, R)), 2)
            j = t * NB + jj
            tl.store(ia_row + j[None, :], a, mask=g_ok[:, None])
            tl.store(ib_row + (j + 1)[None, :], sb, mask=g_ok[:, None])
            if MTB:            # per selection block (same [G, blocks] layout as IMP_A / IMP_B)
                tl.store(WS + o_mt + (bh64 * GP + g[:, None]) * NBW + j[None, :], mt[:, None] + tl.zeros([GP, NB],
                         tl.float32), mask=g_ok[:, None])
            else:
                tl.store(WS + o_mt + (bh64 * n_tiles + t) * GP + g, mt, mask=g_ok)
        m_new = tl.maximum(m_i, mt)
        alpha = tl.math.exp2(m_i - m_new)
        p = pt * tl.math.exp2(mt - m_new)[:, None]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    _store_partial(WS, o_pm, o_pl, o_pacc, (bh64 * n_split + sp) * GP + g, m_i, l_i, acc, g_ok, offs_d,
                   HEAD_DIM)
    if PROBE:
        _stamp(ts, 2, tl.sum(l_i, 0).to(tl.int32, bitcast=True))
        _gstamp(ts, 3)


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
def _stamp(TS, slot, dep):
    """PROBE builds only: the SM clock (%clock64) once `dep` (an int32 scalar the phase produced) is known."""
    t = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(TS + slot, t)


@triton.jit
def _gstamp(TS, slot):
    """PROBE builds only: %globaltimer (ns, device-wide) at this point."""
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(TS + slot, t)


@triton.jit
def _arrive(ptr):
    """Grid barrier, arrival: every thread's earlier global stores are ordered before the release add (bar.sync,
    then one thread's atomic at gpu scope)."""
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait_count(ptr, target, flag, SPIN: tl.constexpr):
    """Grid barrier, wait: poll until *ptr >= target (acquire). Bounded (SPIN polls, ~1 s at the default) so that a
    broken co-residency assumption cannot hang the device; a wait that gives up sets *flag (the (b, kv head)'s
    timeout flag, which makes its output NaN). Returns the last count read."""
    c = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    n = 0
    while (c < target) & (n < SPIN):
        c = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        n += 1
    if c < target:
        tl.atomic_xchg(flag, 1, sem="relaxed", scope="gpu")
    return c


@triton.jit
def _wait_slot(ptr, flag, STALL: tl.constexpr, SPIN: tl.constexpr):
    """Selected-block slot of this program: poll until it is written (!= SLOT_UNSET; the value is all it needs, so
    relaxed). Gives up like _wait_count (sets *flag) and then returns SLOT_UNSET (the caller poisons its partial).
    STALL (tests): never written."""
    v = tl.atomic_add(ptr, 0, sem="relaxed", scope="gpu")
    n = 0
    if STALL:
        while n < SPIN:
            v = tl.atomic_add(ptr, 0, sem="relaxed", scope="gpu")
            n += 1
        v = v * 0 + SLOT_UNSET_C
    else:
        while (v == SLOT_UNSET_C) & (n < SPIN):
            v = tl.atomic_add(ptr, 0, sem="relaxed", scope="gpu")
            n += 1
    if v == SLOT_UNSET_C:
        tl.atomic_xchg(flag, 1, sem="relaxed", scope="gpu")
    return v


@triton.jit
def _merge(WS, o_m, o_l, o_acc, row0, lo, hi, g, offs_d, NP: tl.constexpr, GP: tl.constexpr,
           HEAD_DIM: tl.constexpr):
    """LSE merge of partials lo..hi-1 of one head (rows (row0 + i) * GP + g): the normalised output (0 if empty).
    Loads bypass L1 (.cg): the partials may come from other programs of the same launch."""
    i = tl.arange(0, NP)
    ok = (i >= lo) & (i < hi)
    prow = (row0 + i) * GP + g
    m = tl.load(WS + o_m + prow, mask=ok, other=float("-inf"), cache_modifier=".cg")
    l_ = tl.load(WS + o_l + prow, mask=ok, other=0.0, cache_modifier=".cg")
    acc = tl.load(WS + o_acc + prow[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0,
                  cache_modifier=".cg")
    mx = tl.max(m, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.where(ok, tl.math.exp2(m - mx), 0.0)
    tot = tl.sum(l_ * w, 0)
    o = tl.sum(acc * w[:, None], 0)
    return o / tl.where(tot > 0.0, tot, 1.0)


@triton.jit
def _merge_two(WS, o_m, o_l, o_acc, row0, n1, n, g, offs_d, NP: tl.constexpr, GP: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    """Two LSE merges from one load of partials 0..n-1 of head g: (output of 0..n1-1, output of n1..n-1), each
    normalised (0 if empty), as two `_merge` calls but in one round of loads."""
    i = tl.arange(0, NP)
    ok = i < n
    first = i < n1
    prow = (row0 + i) * GP + g
    m = tl.load(WS + o_m + prow, mask=ok, other=float("-inf"), cache_modifier=".cg")
    l_ = tl.load(WS + o_l + prow, mask=ok, other=0.0, cache_modifier=".cg")
    acc = tl.load(WS + o_acc + prow[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0,
                  cache_modifier=".cg")
    m1 = tl.max(tl.where(first, m, float("-inf")), 0)
    m2 = tl.max(tl.where(first, float("-inf"), m), 0)
    m1 = tl.where(m1 == float("-inf"), 0.0, m1)
    m2 = tl.where(m2 == float("-inf"), 0.0, m2)
    w = tl.where(ok, tl.math.exp2(m - tl.where(first, m1, m2)), 0.0)
    w1 = tl.where(first, w, 0.0)
    w2 = w - w1
    t1 = tl.sum(l_ * w1, 0)
    t2 = tl.sum(l_ * w2, 0)
    o1 = tl.sum(acc * w1[:, None], 0)
    o2 = tl.sum(acc * w2[:, None], 0)
    return o1 / tl.where(t1 > 0.0, t1, 1.0), o2 / tl.where(t2 > 0.0, t2, 1.0)


@triton.jit
def _dec_sel_kernel(Q, K, V, IDX, WS, CAND, CNT, GATES, OUT, TS,
                    o_pm, o_pl, o_pacc, o_mt, o_ia, o_ib, o_sm, o_sl, o_sacc, o_pre,
                    sqb, sqh, skb, sks, skh, svb, svs, svh, sgb, sgh, sgc, sob, soh,
                    S, Hk, G, n_split, n_tiles, NBW, n_b, n_chunks, n_part, n_prog, n_win, window, qk_scale,
                    NB: tl.constexpr, CH: tl.constexpr, CW: tl.constexpr, NBLK: tl.constexpr,
                    NSPLITP: tl.constexpr, NSEL: tl.constexpr, BS: tl.constexpr,
                    BLK: tl.constexpr, HEAD_DIM: tl.constexpr, GP: tl.constexpr, MP: tl.constexpr,
                    NSELP: tl.constexpr, NPARTP: tl.constexpr, CNTW: tl.constexpr, RET_IDX: tl.constexpr,
                    HAS_GATES: tl.constexpr, DO_SCORE: tl.constexpr, DO_RANK: tl.constexpr, DO_ATTN: tl.constexpr,
                    DO_MERGE: tl.constexpr, SYNC: tl.constexpr, USE_PDL: tl.constexpr, PROBE: tl.constexpr,
                    KEY_POLL: tl.constexpr, SLOT_POLL: tl.constexpr, MTB: tl.constexpr, SPIN: tl.constexpr,
                    STALL_R: tl.constexpr, STALL_A: tl.constexpr, STALL_M: tl.constexpr, STALL_W: tl.constexpr,
                    GIVEN: tl.constexpr, EARLY: tl.constexpr, ONE_CNT: tl.constexpr):
    # GIVEN: the selected blocks come from IDX (B, Hk, NSEL) instead of the score + rank phases (compiled out).
    # EARLY (with GIVEN): program p < NSEL attends to its block before griddepcontrol.wait (it needs only q, k, v and
    # IDX, like the window chunks), and the merge programs merge all three branches themselves (host: DO_RANK and
    # DO_ATTN off); else the selected programs read IDX where they polled their slot.
    # ONE_CNT (SLOT_POLL, not GIVEN): every arrival the merge needs (selected partials, the chunk programs' final
    # ranks, the window programs' compressed + window merges) goes to one counter: one acquire wait, not three.
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b64, hk, bh64, g, g_ok, offs_d, q = _group_query(Q, sqb, sqh, Hk, G, GP, HEAD_DIM)
    b = bh // Hk
    # counters (zeroed by _dec_cmp_kernel): +0 candidates written, +1 slots written (SLOT_POLL: chunk programs done),
    # +2 selected partials written, +3 window partials written, +4 compressed + window merges written, +5 timeout flag
    # (a wait gave up: the output of this (b, kv head) is NaN), +6 (ONE_CNT) everything the merge waits for; then
    # NSELP slots (slot r = block of rank r)
    cnt = CNT + bh64 * CNTW
    flag = cnt + 5
    slot = cnt + 8
    ts = TS + (bh64 * tl.num_programs(0) + pid) * 16
    w = pid - n_prog                   # window programs: pid >= n_prog
    if PROBE:
        _gstamp(ts, 0)
        _stamp(ts, 1, pid)
    if DO_SCORE:
        if (w >= 0) & (w < n_win):
            # ---- one chunk of the sliding window: needs only q, k, v, so it runs before griddepcontrol.wait,
            # while the compressed kernel still runs
            w_lo = tl.maximum(S - window, 0) + w * BLK
            m, l_w, acc_w = _attend_keys(q, K, V, b64, hk, w_lo, S, S, skb, sks, skh, svb, svs, svh, qk_scale,
                                         offs_d, BLK)
            _store_partial(WS, o_sm, o_sl, o_sacc, (bh64 * n_part + NSEL + w) * GP + g, m, l_w, acc_w, g_ok,
                           offs_d, HEAD_DIM)
        if EARLY:
            if pid < NSEL:     # ---- given selected block, before the wait: overlaps the compressed kernel
                # an entry past the last block reads nothing: clamped to n_b before * BS (which would wrap int32
                # for entries >= 2^31 / BS and send the loads below K)
                jb = tl.minimum(tl.load(IDX + bh64 * NSEL + pid), n_b)
                start = tl.maximum(jb, 0) * BS
                hi = tl.where(jb >= 0, start + BS, 0)      # exclusive; -1 (or any negative): nothing
                m, l_s, acc_s = _attend_keys(q, K, V, b64, hk, start, hi, S, skb, sks, skh, svb, svs, svh, qk_scale,
                                             offs_d, BLK)
                _store_partial(WS, o_sm, o_sl, o_sacc, (bh64 * n_part + pid) * GP + g, m, l_s, acc_s, g_ok, offs_d,
                               HEAD_DIM)
                if PROBE:
                    _stamp(ts, 8, tl.sum(l_s, 0).to(tl.int32, bitcast=True))
    if USE_PDL:        # everything below reads what _dec_cmp_kernel wrote (or the counters it zeroed)
        gdc_wait()
    if PROBE:
        _stamp(ts, 2, pid)
    if DO_SCORE:
        if SYNC:
            if (w >= 0) & (w < n_win):
                _arrive(cnt + 3)
            if EARLY:
                if pid < NSEL:
                    _arrive(cnt + 2)
        if not GIVEN:      # (given indices: nothing is scored or ranked)
            if pid < n_chunks:
                # ---- top-k, first stage: block scores of chunk pid, its best CW blocks as candidates
                j = pid * CH + tl.arange(0, CH)
                cur = n_b - 1                                   # the query is the last token: its block is the last one
                n_w = n_tiles * NB                              # IMP_A written for j < n_w, IMP_B for 1 <= j <= n_w
                ok_a = (j < n_w) & (j <= cur)
                ok_b = (j >= 1) & (j <= n_w) & (j <= cur)
                sp = tl.arange(0, NSPLITP)
                gg = tl.arange(0, GP)
                gok = gg < G
                pidx = (bh64 * n_split + sp[:, None]) * GP + gg[None, :]
                pmask = (sp < n_split)[:, None] & gok[None, :]
                pm = tl.load(WS + o_pm + pidx, mask=pmask, other=float("-inf"))
                pl = tl.load(WS + o_pl + pidx, mask=pmask, other=0.0)
                ma = gok[:, None] & ok_a[None, :]
                mb = gok[:, None] & ok_b[None, :]
                ia = tl.load(WS + o_ia + (bh64 * GP + gg[:, None]) * NBW + j[None, :], mask=ma, other=0.0)
                ib = tl.load(WS + o_ib + (bh64 * GP + gg[:, None]) * NBW + j[None, :], mask=mb, other=0.0)
                if MTB:
                    mrow = WS + o_mt + (bh64 * GP + gg[:, None]) * NBW + j[None, :]
                    mta = tl.load(mrow, mask=ma, other=0.0)
                    mtb = tl.load(mrow - 1, mask=mb, other=0.0)
                else:
                    mrow = WS + o_mt + bh64 * n_tiles * GP + gg[:, None]
                    mta = tl.load(mrow + (j // NB)[None, :] * GP, mask=ma, other=0.0)
                    mtb = tl.load(mrow + (tl.maximum(j - 1, 0) // NB)[None, :] * GP, mask=mb, other=0.0)
                mx = tl.max(pm, 0)
                mx = tl.where(mx == float("-inf"), 0.0, mx)
                tot = tl.sum(pl * tl.math.exp2(pm - mx[None, :]), 0)
                lse = tl.where(tot > 0.0, mx + tl.math.log2(tl.where(tot > 0.0, tot, 1.0)), float("inf"))   # (GP,)
                fa = tl.where(ma, tl.math.exp2(mta - lse[:, None]), 0.0)
                fb = tl.where(mb, tl.math.exp2(mtb - lse[:, None]), 0.0)
                score = tl.sum(ia * fa + ib * fb, 0)
                score = tl.where(j == 0, FORCE_FIRST_C, score)
                score = tl.where(j == cur, float("inf"), score)
                score = tl.where(j <= cur, score, float("-inf"))
                # The chunk's best CW blocks are the only ones that can be in the global top NSEL (CW >= NSEL or
                # CW == CH): written to candidate slots by rank
                key = _rank_keys(score, j, NBLK)
                rank = _rank(key)
                tl.store(CAND + bh64 * MP + pid * CW + rank, key, mask=rank < CW)
                if PROBE:
                    _stamp(ts, 3, tl.max(rank, 0))
                if SYNC:
                    if KEY_POLL:      # the keys are their own flags (KEY_UNSET until stored); the bar.sync makes this
                        tl.debug_barrier()   # program's own keys visible to all its threads before it reads them back
                    else:
                        _arrive(cnt)
    if DO_RANK:
        if not GIVEN:
            if pid < n_chunks:
                # ---- top-k, second stage: global rank of this chunk's CW candidates among all MP (exact for the top
                # NSEL: every key above a top-NSEL key is a candidate too); selected ones (rank < NSEL, score > -inf)
                # go to slot[rank]
                cbase = CAND + bh64 * MP
                if SYNC and KEY_POLL:
                    # wait by polling the keys: no arrival (bar.sync + release fence + atomic) on the writers' side
                    allk = tl.load(cbase + tl.arange(0, MP), volatile=True)
                    mine = tl.load(cbase + pid * CW + tl.arange(0, CW), volatile=True)
                    left = tl.sum((allk == KEY_UNSET_C).to(tl.int32), 0) + tl.sum((mine == KEY_UNSET_C).to(tl.int32), 0)
                    left += STALL_R
                    n = 0
                    while (left > 0) & (n < SPIN):
                        allk = tl.load(cbase + tl.arange(0, MP), volatile=True)
                        mine = tl.load(cbase + pid * CW + tl.arange(0, CW), volatile=True)
                        left = (tl.sum((allk == KEY_UNSET_C).to(tl.int32), 0)
                                + tl.sum((mine == KEY_UNSET_C).to(tl.int32), 0) + STALL_R)
                        n += 1
                    if left > 0:
                        tl.atomic_xchg(flag, 1, sem="relaxed", scope="gpu")
                    c1 = n
                else:
                    c1 = 0
                    if SYNC:
                        c1 = _wait_count(cnt, n_chunks + STALL_R, flag, SPIN)
                    allk = tl.load(cbase + tl.arange(0, MP), cache_modifier=".cg")
                    mine = tl.load(cbase + pid * CW + tl.arange(0, CW), cache_modifier=".cg")
                if PROBE:
                    _stamp(ts, 6, c1)
                r = tl.sum((allk[None, :] > mine[:, None]).to(tl.int32), 1)
                cj = NBLK - 1 - (mine & 0xFFFFFFFF).to(tl.int32)
                if SLOT_POLL:     # every rank < min(NSEL, MP) is written (-1: score -inf), so a reader can poll its
                    val = tl.where(mine >= 0, cj, -1)  # slot; -3 (a key wait timed out) poisons the reader
                    if SYNC and KEY_POLL:
                        val = tl.where(left > 0, -3, val)
                    tl.atomic_xchg(slot + r, val, mask=r < NSEL, sem="relaxed", scope="gpu")
                else:
                    tl.store(slot + r, cj, mask=(r < NSEL) & (mine >= 0))
                if PROBE:
                    _stamp(ts, 7, tl.max(r, 0))
                if SYNC:
                    if SLOT_POLL:
                        if pid >= NSEL:       # the others arrive after their selected block (off their critical path)
                            _arrive(cnt + 6)
                    else:
                        _arrive(cnt + 1)
        if w >= 0:
            # ---- window programs, off the critical path: compressed and window branches merged and gated per
            # head, pre = g0 * o_cmp + g2 * o_swa, for heads w, w + n_wp, ...
            if SYNC:
                _wait_count(cnt + 3, n_win + STALL_W, flag, SPIN)
            for hp in range(w, G, tl.num_programs(0) - n_prog):
                o_cmp = _merge(WS, o_pm, o_pl, o_pacc, bh64 * n_split, 0, n_split, hp, offs_d, NSPLITP, GP,
                               HEAD_DIM)
                o_swa = _merge(WS, o_sm, o_sl, o_sacc, bh64 * n_part, NSEL, n_part, hp, offs_d, NPARTP, GP,
                               HEAD_DIM)
                if HAS_GATES:
                    gbp = GATES + b.to(tl.int64) * sgb + (hk * G + hp) * sgh
                    pre = tl.load(gbp).to(tl.float32) * o_cmp + tl.load(gbp + 2 * sgc).to(tl.float32) * o_swa
                else:
                    pre = (o_cmp + o_swa) * (1.0 / 3.0)
                tl.store(WS + o_pre + (bh64 * GP + hp) * HEAD_DIM + offs_d, pre)
            if PROBE:
                _stamp(ts, 5, w)
            if SYNC:
                if ONE_CNT:
                    _arrive(cnt + 6)
                else:
                    _arrive(cnt + 4)
    if DO_ATTN:
        if pid < NSEL:
            if GIVEN:
                jb = tl.minimum(tl.load(IDX + bh64 * NSEL + pid), n_b)     # (clamped as above)
            elif SYNC and SLOT_POLL:
                jb = _wait_slot(slot + pid, flag, STALL_A, SPIN)
                if PROBE:
                    _stamp(ts, 9, jb)
            else:
                if SYNC:
                    c2 = _wait_count(cnt + 1, n_chunks + STALL_A, flag, SPIN)
                    if PROBE:
                        _stamp(ts, 9, c2)
                jb = tl.load(slot + pid, cache_modifier=".cg")
            if RET_IDX:
                if pid == 0:          # the selected blocks in ascending order, -1 padded (the reference's layout)
                    sl = tl.arange(0, NSELP)
                    sj = tl.load(slot + sl, mask=sl < NSEL, other=-1, cache_modifier=".cg")
                    if SYNC and SLOT_POLL:    # every slot, not only this program's: poll until all are written
                        left = tl.sum((sj == SLOT_UNSET_C).to(tl.int32), 0)
                        n = 0
                        while (left > 0) & (n < SPIN):
                            sj = tl.load(slot + sl, mask=sl < NSEL, other=-1, volatile=True)
                            left = tl.sum((sj == SLOT_UNSET_C).to(tl.int32), 0)
                            n += 1
                        if left > 0:
                            tl.atomic_xchg(flag, 1, sem="relaxed", scope="gpu")
                    ok = sj >= 0
                    pos = tl.sum((ok[None, :] & (sj[None, :] < sj[:, None])).to(tl.int32), 1)
                    tl.store(IDX + bh64 * NSEL + pos, sj, mask=ok)
                    n_sel = tl.sum(ok.to(tl.int32), 0)
                    tl.store(IDX + bh64 * NSEL + sl, tl.full([NSELP], -1, tl.int32), mask=(sl >= n_sel) & (sl < NSEL))
            start = tl.maximum(jb, 0) * BS
            hi = tl.where(jb >= 0, start + BS, 0)                 # exclusive; empty slot (-1): nothing
            m, l_s, acc_s = _attend_keys(q, K, V, b64, hk, start, hi, S, skb, sks, skh, svb, svs, svh, qk_scale,
                                         offs_d, BLK)
            if not GIVEN:
                m = tl.where(jb < -1, float("nan"), m)  # slot wait gave up (-2) or a poisoned slot (-3): NaN part
            _store_partial(WS, o_sm, o_sl, o_sacc, (bh64 * n_part + pid) * GP + g, m, l_s, acc_s, g_ok, offs_d,
                           HEAD_DIM)
            if PROBE:
                _stamp(ts, 8, tl.sum(l_s, 0).to(tl.int32, bitcast=True))
            if SYNC:
                if ONE_CNT:          # (after its chunk's final rank, if it has one)
                    _arrive(cnt + 6)
                else:
                    _arrive(cnt + 2)
    if DO_MERGE:
        if pid < G:
            h = hk * G + pid
            bad = pid < 0
            prow = WS + o_pre + (bh64 * GP + pid) * HEAD_DIM + offs_d
            if HAS_GATES:     # an input: loaded before the waits (cold after a cache flush)
                g_slc = tl.load(GATES + b.to(tl.int64) * sgb + h * sgh + sgc).to(tl.float32)
            else:
                g_slc = 1.0 / 3.0
            if EARLY:
                # ---- all three branches merged here: the window and selected partials were computed before
                # griddepcontrol.wait, the compressed ones by the compressed kernel
                if HAS_GATES:
                    gbp = GATES + b.to(tl.int64) * sgb + h * sgh
                    g_cmp = tl.load(gbp).to(tl.float32)
                    g_swa = tl.load(gbp + 2 * sgc).to(tl.float32)
                # the compressed partials are complete since griddepcontrol.wait: merged while the others arrive
                o_cmp = _merge(WS, o_pm, o_pl, o_pacc, bh64 * n_split, 0, n_split, pid, offs_d, NSPLITP, GP,
                               HEAD_DIM)
                if SYNC:
                    c3 = _wait_count(cnt + 3, n_win + STALL_W, flag, SPIN)
                    c2 = _wait_count(cnt + 2, NSEL + STALL_M, flag, SPIN)
                    bad = (c2 < NSEL + STALL_M) | (c3 < n_win + STALL_W) | (tl.load(flag, volatile=True) != 0)
                    if PROBE:
                        _stamp(ts, 10, c2 + c3)
                # selected (0..NSEL-1) and window (NSEL..) partials: one round of loads
                o_slc, o_swa = _merge_two(WS, o_sm, o_sl, o_sacc, bh64 * n_part, NSEL, n_part, pid, offs_d, NPARTP,
                                          GP, HEAD_DIM)
                if HAS_GATES:
                    pre = g_cmp * o_cmp + g_swa * o_swa
                else:
                    pre = (o_cmp + o_swa) * (1.0 / 3.0)
            elif SYNC and ONE_CNT:
                # selected partials, final ranks and window merges: one counter
                n_arr = NSEL + tl.maximum(n_chunks - NSEL, 0) + tl.num_programs(0) - n_prog + STALL_M
                c6 = _wait_count(cnt + 6, n_arr, flag, SPIN)
                pre = tl.load(prow, cache_modifier=".cg")
                bad = (c6 < n_arr) | (tl.load(flag, volatile=True) != 0)
                if PROBE:
                    _stamp(ts, 10, c6)
            elif SYNC:
                if MTB:   # the window programs' merges are long done: their part is loaded before the last wait
                    c4 = _wait_count(cnt + 4, tl.num_programs(0) - n_prog, flag, SPIN)
                    pre = tl.load(prow, cache_modifier=".cg")
                    c3 = _wait_count(cnt + 2, NSEL + STALL_M, flag, SPIN)
                else:
                    c3 = _wait_count(cnt + 2, NSEL + STALL_M, flag, SPIN)
                    c4 = _wait_count(cnt + 4, tl.num_programs(0) - n_prog, flag, SPIN)
                    pre = tl.load(prow, cache_modifier=".cg")
                bad = (c3 < NSEL + STALL_M) | (c4 < tl.num_programs(0) - n_prog)
                # any wait of this (b, kv head) that gave up set the flag before its program's next arrival, which
                # the waits above acquired: NaN output instead of a silently wrong one
                bad = bad | (tl.load(flag, volatile=True) != 0)
                if PROBE:
                    _stamp(ts, 10, c3 + c4)
            else:
                pre = tl.load(prow, cache_modifier=".cg")
            if not EARLY:
                o_slc = _merge(WS, o_sm, o_sl, o_sacc, bh64 * n_part, 0, NSEL, pid, offs_d, NPARTP, GP, HEAD_DIM)
            o = pre + g_slc * o_slc
            o = tl.where(bad, float("nan"), o)
            tl.store(OUT + b.to(tl.int64) * sob + h * soh + offs_d, o.to(OUT.dtype.element_ty))
            if PROBE:
                _stamp(ts, 11, tl.sum(o, 0).to(tl.int32, bitcast=True))
    if PROBE:
        _gstamp(ts, 12)


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


def _check_indices(indices, B, Hk, nsel, device):
    """`indices` (B, Hk, nsel) or (B, 1, Hk, nsel) int32 on q's device -> contiguous (B, Hk, nsel)."""
    if not isinstance(indices, torch.Tensor):
        raise ValueError(f"indices must be a torch.Tensor or None, got {type(indices).__name__}")
    if indices.dtype != torch.int32:
        raise ValueError(f"indices must be int32 (selected block indices, -1 padded), got {indices.dtype}")
    if indices.device != device:
        raise ValueError(f"indices must be on q's device {device}, got {indices.device}")
    shape = tuple(indices.shape)
    if shape not in ((B, Hk, nsel), (B, 1, Hk, nsel)):
        raise ValueError(f"indices must have shape (B, Hk, num_selected) = {(B, Hk, nsel)} or (B, 1, Hk, "
                         f"num_selected), got {shape}")
    return indices.reshape(B, Hk, nsel).contiguous()


def nsa_decode(q, k, v, k_cmp, v_cmp, gates, scale, config, return_indices: bool = False, indices=None):
    """One decode step: q (B, 1, Hq, D) at position S - 1 of k/v (B, S, Hk, D); k_cmp/v_cmp (B, n_c, Hk, D) the
    compressed blocks of k/v (any strides with a unit last one). Returns (out (B, 1, Hq, D) q.dtype,
    idx int32 (B, 1, Hk, num_selected) or None unless return_indices).

    indices: None (the step ranks the blocks itself) or the selected blocks to use, int32 (B, Hk, num_selected) or
    (B, 1, Hk, num_selected) on q's device, ascending, -1 padded (the layout of the returned idx; selection="tile"
    reuses the tile's first selection). The step then scores and ranks nothing; inside each given block the causal
    mask still applies (keys <= S - 1), and a negative entry or one past the last block (any int32) contributes nothing
    (values are not checked on the host: that would need a sync). With return_indices the given indices come back as
    (B, 1, Hk, num_selected) (a view of them when they are contiguous)."""
    B, T, Hq, D = q.shape
    S, Hk = k.shape[1], k.shape[2]
    G = Hq // Hk
    BH = B * Hk
    bs, nsel = config.block_size, config.num_selected
    given = indices is not None
    if given:
        indices = _check_indices(indices, B, Hk, nsel, q.device)
    early = given and GIVEN_EARLY
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
    # top-k candidates: NBLK block scores in n_chunks chunks of CH, each chunk keeps its best CW
    NBLK = max(16, triton.next_power_of_2(n_b))
    CH = min(NBLK, SCORE_CHUNK)
    CW = min(CH, triton.next_power_of_2(nsel))
    n_chunks = NBLK // CH
    NSELP = max(16, triton.next_power_of_2(nsel))
    CNTW = 8 + NSELP
    # fp32 workspace: cmp partials (m, l, acc), tile maxima, per-head importance (A, B), slc/swa partials,
    # pre-merged cmp + swa output per head; int32: 8 barrier counters + NSELP selected-block slots per (b, kv head)
    n_imp = 0 if given else 1            # given indices: no tile maxima / importance
    sizes = [BH * n_split * GP, BH * n_split * GP, BH * n_split * GP * D, n_imp * BH * max(n_tiles * GP, GP * NBW),
             n_imp * BH * GP * NBW, n_imp * BH * GP * NBW, BH * n_part * GP, BH * n_part * GP, BH * n_part * GP * D,
             BH * GP * D, BH * CNTW]
    offs, tot = [], 0
    for n in sizes:
        offs.append(tot)
        tot += (n + 31) // 32 * 32
    ws = _workspace(tot, torch.float32, dev)
    o_pm, o_pl, o_pacc, o_mt, o_ia, o_ib, o_sm, o_sl, o_sacc, o_pre, o_cnt = offs
    cnt = ws[o_cnt:o_cnt + BH * CNTW].view(torch.int32)
    # without return_indices the attention phase stores no indices (RET_IDX=False): ws stands in for the argument
    if given:      # the selection kernel reads them (RET_IDX off)
        idx = indices
    else:
        idx = torch.empty((B, 1, Hk, nsel), dtype=torch.int32, device=dev) if return_indices else ws
    qk_scale = scale * LOG2E
    # Selection kernel: n_prog programs per (b, kv head) for chunk scores / final rank / selected blocks / merge,
    # then n_win window programs. One launch with in-kernel barriers when all its programs can be resident at once
    # (they spin on each other); else (and in the interpreter, which runs programs one after another) one launch per
    # phase, same code.
    n_prog = max(nsel, G) if given else max(n_chunks, nsel, G)
    n_prog_b = n_prog + n_win
    on_gpu = dev.type == "cuda"
    sync = FUSE and on_gpu and n_prog_b * BH <= num_sms(dev)
    pdl = PDL and on_gpu
    probe = isinstance(PROBE, dict) and on_gpu
    if probe:
        PROBE["a"] = tsa = torch.zeros(BH * n_split * 4, dtype=torch.int64, device=dev)
        PROBE["b"] = tsb = torch.zeros(BH * n_prog_b * 16, dtype=torch.int64, device=dev)
        PROBE["plan"] = dict(BH=BH, n_split=n_split, n_win=n_win, n_prog=n_prog, n_chunks=n_chunks, sync=sync)
    else:
        tsa = tsb = ws
    MP = n_chunks * CW
    cand = ws if given else _workspace(BH * MP, torch.int64, dev)
    _dec_cmp_kernel[(n_split, BH)](
        q, k_cmp, v_cmp, ws, cnt, cand, tsa, o_pm, o_pl, o_pacc, o_mt, o_ia, o_ib,
        q.stride(0), q.stride(2), k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
        v_cmp.stride(0), v_cmp.stride(1), v_cmp.stride(2),
        n_c, Hk, G, n_split, n_tiles, tps, NBW, qk_scale,
        CB=config.compress_block, CS=config.compress_stride, BS=bs, R=R, HEAD_DIM=D, GP=GP, BLOCK_N=CMP_BLOCK_N,
        CNTW=CNTW, NSELP=NSELP, MP=MP, KEY_POLL=KEY_POLL, SLOT_POLL=SLOT_POLL, MTB=EARLY_LOADS, USE_PDL=pdl,
        PROBE=probe, IMP=not given, num_warps=NUM_WARPS["cmp"], num_stages=NUM_STAGES["cmp"])
    out = torch.empty((B, 1, Hq, D), dtype=q.dtype, device=dev)
    gt = gates if gates is not None else out
    args = (q, k, v, idx, ws, cand, cnt, gt, out, tsb, o_pm, o_pl, o_pacc, o_mt, o_ia, o_ib, o_sm, o_sl, o_sacc,
            o_pre, q.stride(0), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
            v.stride(2), gt.stride(0), gt.stride(2), gt.stride(3) if gates is not None else 0, out.stride(0),
            out.stride(2), S, Hk, G, n_split, n_tiles, NBW, n_b, n_chunks, n_part, n_prog, n_win, config.window,
            qk_scale)
    meta = dict(NB=NB, CH=CH, CW=CW, NBLK=NBLK, NSPLITP=max(2, triton.next_power_of_2(n_split)), NSEL=nsel, BS=bs,
                BLK=BLK, HEAD_DIM=D, GP=GP, MP=MP, NSELP=NSELP, NPARTP=triton.next_power_of_2(n_part),
                CNTW=CNTW, RET_IDX=return_indices and not given, HAS_GATES=gates is not None, USE_PDL=pdl, PROBE=probe,
                KEY_POLL=KEY_POLL, SLOT_POLL=SLOT_POLL, MTB=EARLY_LOADS, SPIN=SPIN_LIMIT, STALL_R=int(_STALL == 1),
                STALL_A=int(_STALL == 2), STALL_M=int(_STALL == 3), STALL_W=int(_STALL == 4), GIVEN=given, EARLY=early,
                ONE_CNT=SLOT_POLL and not given,
                num_warps=NUM_WARPS["sel"], **(dict(launch_pdl=True) if pdl else {}))
    if early:      # window + selected partials, then the merge
        phases = [(1, 0, 0, 1)] if sync else [(1, 0, 0, 0), (0, 0, 0, 1)]
    else:
        phases = [(1, 1, 1, 1)] if sync else [(1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1)]
    for ph in phases:
        _dec_sel_kernel[(n_prog_b, BH)](*args, DO_SCORE=bool(ph[0]), DO_RANK=bool(ph[1]), DO_ATTN=bool(ph[2]),
                                        DO_MERGE=bool(ph[3]), SYNC=sync, **meta)
    if given:
        return out, (indices.view(B, 1, Hk, nsel) if return_indices else None)
    return out, (idx if return_indices else None)
