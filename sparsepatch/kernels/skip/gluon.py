"""Persistent, warp-specialised skip-list attention forward in Gluon (Hopper, sm_90), and its dense mode.

Same function as `skip.skip_attention` (tile 128 x 128, head dim 64 / 128, fp16 / bf16), as the stateful
`skip.skip_step` (STATEFUL: the list slots and the call counter of the patcher's buffers) and, with skipping
compiled out (SKIP=False), as `skip.attention`, non-causal or causal (CAUSAL: each q-tile stops at its diagonal
tile, which is masked; q-tiles run longest first within each head and are handed out by an atomic counter, so
q-tiles of unequal length spread evenly over the programs); `skip.py` dispatches here by default on sm_90 at head
dim 64 / 128 (cfg keys `gluon`, `causal_gluon`). H100: ~10% faster per tile than the Triton kernel, dense 641-658
TFLOP/s vs cuDNN 564-590 (benchmarks/NOTES.md, skip forward v9).
Each program (one per SM) owns q-tiles p, p + P, ... (causal: q-tile p, then those it draws); a 1-warp producer
partition walks their lists and keeps a STAGES-deep K/V ring (and q) loaded across q-tile boundaries, so the next
q-tile's first tiles are in shared memory while the two consumer warpgroups (64 rows each) finish the current one
(last P V, next-list write, out store).
Where the speed comes from, measured: the per-tile overlap below (Triton 3.6's kernel waits for each Q K^T before
its softmax), and a cheap q-tile epilogue (KSTAGE / PV_ASYNC, on by default; NOTES v10): the last P V runs under the
next-list exchange, each warpgroup stages its out tile through its 64 rows of the last tile's K (free once both
warpgroups' last Q K^T are done, i.e. the q_empty phase the producer waits on; that ring slot is released after the
staging) and stores 16 bytes per thread, so q is refilled while the epilogue runs. Per q-tile fixed cost ~4.5k
cycles (was ~8k); PROBE builds stamp %clock64 per phase (`bench_skip.py --probe-gluon`).

Consumer loop (FA3's intra-warpgroup order): issue S_t = Q K_t^T, issue O += P_{t-1} V_{t-1}; wait(1); softmax
(S_t) with the keep test; wait(0); release slot t-1; O *= alpha_t. It runs in runs of 32 tiles; the keep bits of a
run (one 32-bit word per row) are reduced over the rows between runs, not inside the loop (NOTES v12: rho 1 within
1-3% of the dense mode). The words of the two warpgroups are OR-ed through shared memory (warpgroup 1 hands its
words to warpgroup 0, which writes the next list).
"""
from __future__ import annotations

import functools

import torch

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAS_GLUON = True
except Exception:  # pragma: no cover - depends on the installed Triton
    HAS_GLUON = False

from .._common import DescriptorArgs, direct_launcher, num_sms, relaunch_or_stop
from ..dispatch import memory_layout
from ..dense.reference import LOG2E

BM = 128  # q rows per q-tile (two warpgroups of 64)
BN = 128  # keys per k-tile (head dim 256, dense only: 64, as K / V stages of 128 x 256 do not fit shared memory)
# dynamic (causal only): q-tiles handed out by an atomic counter instead of static round-robin shares (`_producer`;
# H200 bf16: +2 to +14% at 16K / 32K, neutral at 1K, NOTES session 15)
GLUON_SKIP_CONFIG = dict(stages=3, consumer_regs=232, producer_regs=40, kstage=True, pv_async=True, dynamic=True,
                         exp_poly=0)
# head dim 64, dense mode: one exponential in 8 on the FMA pipe (H200 bf16, ours / best SDPA: causal +2 to +7% at
# 4K-32K; 1 in 2, 4 or 16 measured slower or between, and the skip mode, with its keep test per tile, 1-2% slower:
# NOTES session 16)
GLUON_D64_DENSE_CONFIG = dict(GLUON_SKIP_CONFIG, exp_poly=8)
# head dim 256: q 64 KB + 2 stages of 64-key K and V tiles (128 KB); out stored from registers (the staging through
# the last K tile needs 64 rows per warpgroup)
GLUON_D256_CONFIG = dict(GLUON_SKIP_CONFIG, stages=2, kstage=False)


def block_n(D: int) -> int:
    """Keys per k-tile of the kernel at head dim D."""
    return 64 if D > 128 else BN

# 2^x for x <= 0 on the FMA pipe (cfg `exp_poly`): x = j + f with j = round(x) (the 1.5 * 2^23 add), f in [-0.5, 0.5],
# 2^f by a degree-3 polynomial (relative error < 7.5e-5 in fp32 Horner, far below P's bf16 / fp16 rounding), 2^j
# added to the exponent bits; x is clamped at -125 (P = 2^-125 instead of a smaller or zero one: an absolute error of
# 2.4e-38; the result stays a normal number).
# At head dim 64 a 128 x 128 tile's exponentials take the SM's MUFU unit (16 per clock) as long as its two GEMMs take
# the tensor cores, so the softmax of one warpgroup cannot hide under the other's GEMMs; moving one exponential in
# `exp_poly` to ~9 FMA / ALU instructions evens the two pipes out.
_EXP2_POLY_C = ("0f3F7FFB49", "0f3F31798D", "0f3E786F0E", "0f3D61FBB0")   # c0..c3, fp32 bits


def exp2_poly_asm(n: int) -> str:
    """PTX for `inline_asm_elementwise(pack=n)`: outputs $0..$n-1 = 2^($n..$2n-1); the last of each n on the FMA
    pipe, the others on MUFU (ex2.approx.ftz, what gl.exp2 lowers to)."""
    lines = [f"ex2.approx.ftz.f32 ${i}, ${n + i};" for i in range(n - 1)]
    c0, c1, c2, c3 = _EXP2_POLY_C
    lines += ["{", ".reg .b32 t, j, f, p;",
              f"max.ftz.f32 f, ${2 * n - 1}, 0fC2FA0000;",
              "add.rn.f32 t, f, 0f4B400000;", "sub.rn.f32 j, t, 0f4B400000;", "sub.rn.f32 f, f, j;",
              f"fma.rn.f32 p, f, {c3}, {c2};", f"fma.rn.f32 p, p, f, {c1};", f"fma.rn.f32 p, p, f, {c0};",
              "shl.b32 t, t, 23;", f"add.s32 ${n - 1}, p, t;", "}"]
    return "\n".join(lines)


def exp2_poly_reference(x: torch.Tensor) -> torch.Tensor:
    """What the FMA-pipe exponential of `exp2_poly_asm` computes, in torch fp32 (tests: error against exp2)."""
    c0, c1, c2, c3 = (torch.tensor(int(c[2:], 16), dtype=torch.int32).view(torch.float32) for c in _EXP2_POLY_C)
    x = torch.clamp(x.float(), min=-125.0)
    j = torch.round(x)
    f = x - j
    p = c3
    for c in (c2, c1, c0):   # fp32 FMAs: the fp64 product of two fp32 values is exact, then the sum is rounded
        p = (p.double() * f.double() + c.double()).float()
    return (p.view(torch.int32) + (j.to(torch.int32) << 23)).view(torch.float32)


if HAS_GLUON:
    _LN2 = gl.constexpr(0.6931471805599453)
    _BM = gl.constexpr(BM)
    _EXP2_POLY8 = gl.constexpr(exp2_poly_asm(8))
    _PACK8_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 8 + ["r"] * 8))

    @gluon.jit
    def _bit_or(a, b):
        return a | b

    @gluon.jit
    def _popc(x):
        return gl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _stamp(PRB, base, i: gl.constexpr, dep):
        """PROBE builds only (benchmarks): %clock64, read once `dep` (a scalar) is known, to PRB[base + i]."""
        t = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [dep], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(PRB + base + i, t)

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, ready, empty, v_ready, v_empty, q_ready, q_empty,
                  item_smem, CTR, CNT, IDX, warm, PRB,
                  MAXK, Sq, Sk, Hq, n_rep, Tq, Tk, n_items, causal_off, D: gl.constexpr, STAGES: gl.constexpr,
                  SKIP: gl.constexpr, STATEFUL: gl.constexpr, CAUSAL: gl.constexpr,
                  LAYOUT: gl.constexpr, BN: gl.constexpr, SPLIT: gl.constexpr, DYNAMIC: gl.constexpr,
                  PROBE: gl.constexpr):
        """The loads. K and V of a k-tile share one ring slot and barrier pair (ready / empty); SPLIT: K and V have
        their own barrier pairs (ready / empty for K, v_ready / v_empty for V), so the consumers free a K tile as
        soon as its Q K^T is done and the next K loads while the previous P V still runs (2-stage rings: head dim
        256, where a third stage does not fit shared memory).
        DYNAMIC: after its first item (the program id), each program takes the next item from the counter *CTR
        (items in `_item` order: head-major, longest q-tiles first), so programs that drew long q-tiles draw fewer;
        the item goes to the consumers through item_smem with the q-tile's q_ready phase, and -1 after the last one.
        """
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        g = 0
        k = 0
        lin = pid
        while lin < n_items:
            pb = ((pid * MAXK + k) * 3 + 2).to(gl.int64) * 8   # PROBE: this q-tile's producer stamps
            if PROBE:
                _stamp(PRB, pb, 0, lin)
                gl.store(PRB + pb + 3, gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [lin],
                                                                dtype=gl.int64, is_pure=False, pack=1))
            bh, pm = _item(lin, Tq, CAUSAL)
            b = bh // Hq
            h = bh % Hq
            hk = h // n_rep
            if SKIP:
                cnt = gl.load(CNT + lin)
                if STATEFUL:
                    cnt = gl.where(warm, Tk, cnt)   # a warm-up call visits every tile
            elif CAUSAL:
                cnt = _causal_count(pm, Tk, causal_off, BN)
            else:
                cnt = Tk
            # q of this q-tile: its buffer is free once both consumers passed the last Q K^T of the previous one
            mbarrier.wait(q_empty, (k + 1) & 1, pred=k > 0)
            if PROBE:
                _stamp(PRB, pb, 1, cnt)
            if DYNAMIC:   # published by q_ready's arrive below (release), read after the consumers' wait on it
                item_smem.store(gl.full([1], lin, gl.int32, one))
                gl.thread_barrier()
            mbarrier.expect(q_ready, _BM * D * 2)
            # TMA coordinates in each tensor's 2-D descriptor (LAYOUT bits 1 / 2 / 4: q / k / v head-major)
            if LAYOUT & 1:
                tma.async_copy_global_to_shared(q_desc, [bh * Sq + pm * _BM, 0], q_ready, q_smem)
            else:
                tma.async_copy_global_to_shared(q_desc, [b * Sq + pm * _BM, h * D], q_ready, q_smem)
            bhk = b * (Hq // n_rep) + hk
            row = IDX + lin.to(gl.int64) * Tk
            for t in range(gl.maximum(cnt, 1)):   # an empty list: one placeholder tile (k-tile 0), discarded
                if SKIP:
                    j = gl.load(row + t, mask=t < cnt, other=0)
                    j = gl.minimum(gl.maximum(j, 0), Tk - 1)
                    if STATEFUL:
                        j = gl.where(warm, t, j)
                else:
                    j = t
                slot = g % STAGES
                mbarrier.wait(empty.index(slot), ((g // STAGES) + 1) & 1, pred=g >= STAGES)
                if SPLIT:
                    mbarrier.expect(ready.index(slot), BN * D * 2)
                else:
                    mbarrier.expect(ready.index(slot), 2 * BN * D * 2)
                if LAYOUT & 2:
                    tma.async_copy_global_to_shared(k_desc, [bhk * Sk + j * BN, 0], ready.index(slot),
                                                    k_smem.index(slot))
                else:
                    tma.async_copy_global_to_shared(k_desc, [b * Sk + j * BN, hk * D], ready.index(slot),
                                                    k_smem.index(slot))
                if SPLIT:
                    vbar = v_ready.index(slot)
                    mbarrier.wait(v_empty.index(slot), ((g // STAGES) + 1) & 1, pred=g >= STAGES)
                    mbarrier.expect(vbar, BN * D * 2)
                else:
                    vbar = ready.index(slot)
                if LAYOUT & 4:
                    tma.async_copy_global_to_shared(v_desc, [bhk * Sk + j * BN, 0], vbar, v_smem.index(slot))
                else:
                    tma.async_copy_global_to_shared(v_desc, [b * Sk + j * BN, hk * D], vbar, v_smem.index(slot))
                g += 1
            if PROBE:
                _stamp(PRB, pb, 2, g)
            k += 1
            if DYNAMIC:
                lin = P + gl.atomic_add(CTR, 1)
            else:
                lin += P
        if DYNAMIC:   # no items left: the consumers read -1 with the next q_ready phase
            mbarrier.wait(q_empty, (k + 1) & 1, pred=k > 0)
            item_smem.store(gl.full([1], -1, gl.int32, one))
            gl.thread_barrier()
            mbarrier.arrive(q_ready)

    @gluon.jit
    def _item(lin, Tq, CAUSAL: gl.constexpr):
        """Work item lin -> (batch * head, q-tile), head-major (the programs running at once share one head's K/V in
        L2); causal: each head's longest q-tiles (most key tiles) first, so the short ones fill the end of the
        dynamic schedule."""
        if CAUSAL:
            return lin // Tq, Tq - 1 - lin % Tq
        else:
            return lin // Tq, lin % Tq

    @gluon.jit
    def _causal_count(pm, Tk, causal_off, BN: gl.constexpr):
        """Key tiles a causal q-tile visits: up to the one holding key pm * BM + BM - 1 + causal_off (at least 1)."""
        return gl.maximum(gl.minimum(Tk, (pm * _BM + _BM + causal_off + BN - 1) // BN), 1)

    @gluon.jit
    def _exp2_mixed(x, POLY: gl.constexpr):
        """2^x (x <= 0, finite); POLY 8: one element in 8 on the FMA pipe (`exp2_poly_asm`), the rest on MUFU; 0: all
        on MUFU."""
        if POLY == 8:
            return gl.inline_asm_elementwise(_EXP2_POLY8, _PACK8_CONSTRAINTS, [x], dtype=gl.float32, is_pure=True,
                                             pack=8)
        else:
            return gl.exp2(x)

    @gluon.jit
    def _softmax(s, m_i, l_i, qk_scale, start_n, Sk, MASK: gl.constexpr, s_layout: gl.constexpr, rows, causal_off,
                 CAUSAL: gl.constexpr, BN: gl.constexpr, POLY: gl.constexpr = 0):
        """One online-softmax step on S (fp32 [64, BN]): -> (P fp32, new m, new l, alpha, scaled row max).
        MASK: keys >= Sk (and, CAUSAL, keys > row + causal_off) are masked out (their exponentials all on MUFU:
        -inf - m must give exactly 0). POLY: `_exp2_mixed` for the unmasked tiles."""
        if MASK:
            cols = start_n + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            if CAUSAL:
                keep = gl.expand_dims(cols < Sk, 0) & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + causal_off)
                s = gl.where(keep, s, float("-inf"))
            else:
                s = gl.where(gl.expand_dims(cols < Sk, 0), s, float("-inf"))
        rmax = gl.max(s, 1) * qk_scale
        m_new = gl.maximum(m_i, rmax)
        if MASK:
            p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        else:
            p = _exp2_mixed(s * qk_scale - gl.expand_dims(m_new, 1), POLY)
        alpha = gl.exp2(m_i - m_new)
        return p, m_new, l_i * alpha + gl.sum(p, 1), alpha, rmax

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, ready, empty, v_ready, v_empty, q_ready, q_empty, wx, wx_full, wx_empty,
                  item_smem, CNT, IDX, CNT_OUT, IDX_OUT, FROW, FCOL, warm, O, LSE, PRB, MAXK, stride_ob, stride_os,
                  stride_oh, Sq, Sk, Hq, Tq, Tk, n_items, qk_scale, threshold, causal_off, D: gl.constexpr,
                  STAGES: gl.constexpr,
                  NWORDS: gl.constexpr, WG: gl.constexpr, LAST_PARTIAL: gl.constexpr, WRITE_LSE: gl.constexpr,
                  SKIP: gl.constexpr, KSTAGE: gl.constexpr, PV_ASYNC: gl.constexpr, STATEFUL: gl.constexpr,
                  CAUSAL: gl.constexpr, FORCED: gl.constexpr, BN: gl.constexpr,
                  SPLIT: gl.constexpr, DYNAMIC: gl.constexpr, PROBE: gl.constexpr, POLY: gl.constexpr):
        """One warpgroup: rows [64 * WG, 64 * WG + 64) of every owned q-tile (DYNAMIC: of every q-tile the
        producer publishes in item_smem, until it publishes -1). WG 0 also writes the next lists
        (STATEFUL: not on a warm-up call, which visits every tile); FORCED: the must_do tiles (q-tile row flags FROW,
        k-tile column flags FCOL, int8) are kept whatever their keep test said."""
        NW: gl.constexpr = gl.num_warps()
        WSPAN: gl.constexpr = 32 if SKIP else (1 << 30)   # tiles per run of the tile loop
        RM: gl.constexpr = 16 * NW
        # key tiles a q-tile's mask can reach: its last BM / BN (CAUSAL: the diagonal spans them), else the last one
        NMASK: gl.constexpr = _BM // BN if CAUSAL else 1
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                           instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                           instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        w_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        widx_w = gl.arange(0, NWORDS, layout=w_layout)
        offs_c = gl.arange(0, 32, layout=w_layout)
        qh = q_smem.slice(RM * WG, RM)
        s_zero = gl.zeros([RM, BN], gl.float32, s_layout)
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        g = 0
        k = 0
        if DYNAMIC:
            mbarrier.wait(q_ready, 0)
            lin = gl.max(item_smem.load(w_layout), 0)
        else:
            lin = pid
        while (lin >= 0) & (lin < n_items):
            pb = ((pid * MAXK + k) * 3 + WG).to(gl.int64) * 8   # PROBE: this q-tile's stamps of this warpgroup
            if PROBE:
                _stamp(PRB, pb, 0, lin)
            bh, pm = _item(lin, Tq, CAUSAL)
            row = IDX + lin.to(gl.int64) * Tk
            part = False
            if SKIP:
                cnt = gl.load(CNT + lin)
                if LAST_PARTIAL:
                    part = (cnt > 0) & (gl.load(row + gl.maximum(cnt - 1, 0)) == Tk - 1)
                    if STATEFUL:
                        part = part | warm
                if STATEFUL:
                    cnt = gl.where(warm, Tk, cnt)
            elif CAUSAL:   # the last NMASK visited tiles hold the diagonal (and any keys >= Sk)
                cnt = _causal_count(pm, Tk, causal_off, BN)
                part = CAUSAL
            else:
                cnt = Tk
                part = LAST_PARTIAL
            n_it = gl.maximum(cnt, 1)
            # a masked tile's first key: the list's last entry is k-tile Tk - 1 (SKIP), else tile t is k-tile t
            last_start = (Tk - 1) * BN
            rows = pm * _BM + RM * WG + gl.arange(0, RM, layout=row_l)
            row_ok = rows < Sq
            m_i = gl.full([RM], float("-inf"), gl.float32, row_l)
            l_i = gl.zeros([RM], gl.float32, row_l)
            acc = gl.zeros([RM, D], gl.float32, o_layout)
            word = gl.zeros([RM], gl.int32, row_l)         # keep bits of the current 32-tile word, per row
            words = gl.zeros([NWORDS], gl.int32, w_layout)  # completed words, OR-ed over this warpgroup's rows
            mbarrier.wait(q_ready, k & 1)
            if PROBE:
                _stamp(PRB, pb, 1, cnt)
                gl.store(PRB + pb + 7, cnt.to(gl.int64))
            # tile 0: S synchronously, its softmax; its P V is issued with the next tile's S (or in the tail)
            slot = g % STAGES
            mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
            if PROBE:
                _stamp(PRB, pb, 2, g)
            s = warpgroup_mma(qh, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False)
            if SPLIT:
                mbarrier.arrive(empty.index(slot))   # (K only)
            if part & (n_it <= NMASK):
                p, m_new, l_i, alpha, rmax = _softmax(s, m_i, l_i, qk_scale, last_start if SKIP else 0, Sk, True,
                                                      s_layout, rows, causal_off, CAUSAL, BN)
            else:
                p, m_new, l_i, alpha, rmax = _softmax(s, m_i, l_i, qk_scale, 0, Sk, False, s_layout, rows,
                                                      causal_off, CAUSAL, BN, POLY)
            if SKIP:
                word = ((rmax - m_i > threshold) & row_ok).to(gl.int32)
            p16 = gl.convert_layout(p.to(k_smem.dtype), p_layout)
            m_i = m_new
            prev = slot
            prev_phase = (g // STAGES) & 1
            g += 1
            # tiles in runs of 32, one keep word each (dense: one run); a completed word is reduced over the rows (a
            # cross-warp reduction through shared memory) between runs, so the tile loop has no branch / barrier
            # for it (inside the loop, it made the rho-1 loop 2-8% slower than the dense one: NOTES v12)
            for w in range(0, (n_it + WSPAN - 1) // WSPAN):
                for t in range(gl.maximum(w * WSPAN, 1), gl.minimum(w * WSPAN + WSPAN, n_it)):
                    slot = g % STAGES
                    mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
                    s_tok = warpgroup_mma(qh, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                                          is_async=True)
                    if SPLIT:
                        mbarrier.wait(v_ready.index(prev), prev_phase)
                    o_tok = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
                    s = warpgroup_mma_wait(1, deps=[s_tok])
                    if SPLIT:
                        mbarrier.arrive(empty.index(slot))
                    if part & (t >= n_it - NMASK):
                        p, m_new, l_i, alpha, rmax = _softmax(s, m_i, l_i, qk_scale, last_start if SKIP else t * BN,
                                                              Sk, True, s_layout, rows, causal_off, CAUSAL, BN)
                    else:
                        p, m_new, l_i, alpha, rmax = _softmax(s, m_i, l_i, qk_scale, 0, Sk, False, s_layout, rows,
                                                              causal_off, CAUSAL, BN, POLY)
                    acc = warpgroup_mma_wait(0, deps=[o_tok])
                    if SPLIT:
                        mbarrier.arrive(v_empty.index(prev))
                    else:
                        mbarrier.arrive(empty.index(prev))
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
                    if SKIP:
                        word = word | (((rmax - m_i > threshold) & row_ok).to(gl.int32) << (t & 31))
                    p16 = gl.convert_layout(p.to(k_smem.dtype), p_layout)
                    m_i = m_new
                    prev = slot
                    prev_phase = (g // STAGES) & 1
                    g += 1
                if SKIP:
                    words = words | gl.where(widx_w == w, gl.reduce(word, 0, _bit_or), 0)
                    word = gl.zeros([RM], gl.int32, row_l)
            if PROBE:
                _stamp(PRB, pb, 3, g)
            mbarrier.arrive(q_empty)   # every Q K^T of this q-tile has completed
            if SPLIT:   # (KSTAGE off: the K ring slots are freed early)
                mbarrier.wait(v_ready.index(prev), prev_phase)
                v_free = v_empty.index(prev)
            else:
                v_free = empty.index(prev)
            if PV_ASYNC:   # the last P V runs under the next-list exchange / write
                o_tok = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
            else:
                acc = warpgroup_mma(p16, v_smem.index(prev), acc)
                if not KSTAGE:
                    mbarrier.arrive(v_free)
            if PROBE:
                _stamp(PRB, pb, 4, k)

            # next list: the two warpgroups' keep words OR-ed through shared memory, written by warpgroup 0
            if not SKIP:
                if PROBE:
                    _stamp(PRB, pb, 5, k)
            elif WG == 1:
                mbarrier.wait(wx_empty, (k + 1) & 1, pred=k > 0)
                wx.store(words)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(wx_full)
                if PROBE:
                    _stamp(PRB, pb, 5, k)
            else:
                mbarrier.wait(wx_full, k & 1)
                words = words | wx.load(w_layout)
                gl.thread_barrier()
                mbarrier.arrive(wx_empty)
                words = gl.where(cnt > 0, words, 0)
                if STATEFUL:
                    write = warm == 0
                else:
                    write = True
                out_cnt = cnt * 0
                if write:
                    dst = IDX_OUT + lin.to(gl.int64) * Tk
                    if FORCED:
                        forced_row = gl.load(FROW + pm) != 0
                    for wi in gl.static_range(NWORDS):
                        if wi * 32 < cnt:
                            c1 = gl.minimum(cnt - wi * 32, 32)
                            wd = gl.sum(gl.where(widx_w == wi, words, 0), 0)
                            jv = gl.load(row + wi * 32 + offs_c, mask=offs_c < c1, other=0)
                            if FORCED:   # (a forced row keeps all its tiles: the union listed every one)
                                fc = gl.load(FCOL + jv, mask=offs_c < c1, other=0) != 0
                                wd = wd | gl.reduce(gl.where(fc, 1 << offs_c, 0), 0, _bit_or)
                                wd = gl.where(forced_row, -1, wd)
                            wv = wd & gl.where(c1 >= 32, -1, (1 << c1) - 1)
                            keep = ((wv >> offs_c) & 1) != 0
                            gl.store(dst + out_cnt + _popc(wv & ((1 << offs_c) - 1)), jv, mask=keep)
                            out_cnt += _popc(wv)
                    gl.store(CNT_OUT + lin, out_cnt)
                if PROBE:
                    _stamp(PRB, pb, 5, out_cnt)

            if PV_ASYNC:
                acc = warpgroup_mma_wait(0, deps=[o_tok])
                if not KSTAGE:
                    mbarrier.arrive(v_free)
            # out = acc / l (zeros for a placeholder), LSE
            real = cnt > 0
            l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
            # one reciprocal per row, 0 for a placeholder / empty row (per-element selects and divisions cost ~300
            # instructions per thread here)
            inv_l = gl.where(real & (l_o != 0.0), 1.0 / gl.where(l_o == 0.0, 1.0, l_o), 0.0)
            out = (acc * gl.expand_dims(inv_l, 1)).to(O.dtype.element_ty)
            b = bh // Hq
            h = bh % Hq
            if KSTAGE:   # staged in shared memory: 8 columns per thread, 16-byte stores
                st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [NW, 1], [1, 0])
            else:
                st_layout: gl.constexpr = o_layout
            o_rows = pm * _BM + RM * WG + gl.arange(0, RM, layout=gl.SliceLayout(1, st_layout))
            cols = gl.arange(0, D, layout=gl.SliceLayout(0, st_layout))
            o_ptrs = (O + b.to(gl.int64) * stride_ob + h * stride_oh + gl.expand_dims(o_rows, 1).to(gl.int64)
                      * stride_os + gl.expand_dims(cols, 0))
            o_mask = gl.expand_dims(o_rows < Sq, 1)
            if KSTAGE:   # through this warpgroup's 64 rows of the last tile's K (q stays loaded for the next q-tile)
                mbarrier.wait(q_empty, k & 1)   # both warpgroups' last Q K^T (which read all of that K) are done
                ks = k_smem.index(prev).slice(RM * WG, RM)
                ks.store(out)
                gl.thread_barrier()
                out = ks.load(st_layout)
                fence_async_shared()   # these reads before the slot's next TMA load
                gl.thread_barrier()
                mbarrier.arrive(empty.index(prev))
                gl.store(o_ptrs, out, mask=o_mask)
            else:
                gl.store(o_ptrs, out, mask=o_mask)
            if WRITE_LSE:
                lse = gl.where(real & (l_i != 0.0), (m_i + gl.log2(gl.where(l_i == 0.0, 1.0, l_i))) * _LN2,
                               float("-inf"))
                gl.store(LSE + bh.to(gl.int64) * Sq + rows, lse, mask=row_ok)
            if PROBE:
                _stamp(PRB, pb, 6, k)
            k += 1
            if DYNAMIC:   # (the body's own wait on this phase then returns at once)
                mbarrier.wait(q_ready, k & 1)
                lin = gl.max(item_smem.load(w_layout), 0)
            else:
                lin += P

    @gluon.jit
    def _skip_gluon_kernel(q_desc, k_desc, v_desc, CNT, IDX, CNT_OUT, IDX_OUT, FROW, FCOL, STEP, O, LSE, PRB, CTR, MAXK,
                           n_warmup,
                           slot_cnt, slot_idx, stride_ob, stride_os, stride_oh, Sq, Sk, Hq, n_rep, Tq, Tk, n_items,
                           qk_scale, threshold, causal_off,
                           D: gl.constexpr, STAGES: gl.constexpr, NWORDS: gl.constexpr, LAST_PARTIAL: gl.constexpr,
                           WRITE_LSE: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                           num_warps: gl.constexpr, SKIP: gl.constexpr = True, KSTAGE: gl.constexpr = True,
                           PV_ASYNC: gl.constexpr = True, STATEFUL: gl.constexpr = False, CAUSAL: gl.constexpr = False,
                           FORCED: gl.constexpr = False, LAYOUT: gl.constexpr = 0,
                           BLOCK_N: gl.constexpr = 128, DYNAMIC: gl.constexpr = False, PROBE: gl.constexpr = False,
                           EXP_POLY: gl.constexpr = 0):
        """Launched with num_warps=4 and grid (programs,): default partition = warpgroup 0 (rows 0-63 of each
        q-tile), worker 0 (4 warps) = warpgroup 1 (rows 64-127), worker 1 (1 warp) = the loads.
        STATEFUL (the patcher's skip_step): CNT / IDX (read) and CNT_OUT / IDX_OUT (written) are two list slots each
        (slot strides slot_cnt / slot_idx; the same tensors, or with must_do the read ones are the union of the
        slots and the forced tiles); the call counter *STEP decides: calls < n_warmup visit every tile and write no
        list, later calls read slot (step - n_warmup) % 2 and write the other one.
        FORCED (must_do): the lists read already hold the forced tiles (`skip._union`); FROW (Tq,) / FCOL (Tk,) int8
        flag them so that the next lists keep them."""
        if STATEFUL:
            n = gl.load(STEP)
            warm = n < n_warmup
            rs = gl.where(warm, 0, (n - n_warmup) % 2)
            CNT_OUT = CNT_OUT + (1 - rs) * slot_cnt
            IDX_OUT = IDX_OUT + (1 - rs) * slot_idx
            CNT = CNT + rs * slot_cnt
            IDX = IDX + rs * slot_idx
        else:
            warm = False
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [_BM, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
        # SPLIT (BLOCK_N < 128, KSTAGE off): K and V rings with their own barriers (see _producer)
        SPLIT: gl.constexpr = BLOCK_N < _BM
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        wx = gl.allocate_shared_memory(gl.int32, [NWORDS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        item_smem = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)   # one arrive per consumer warpgroup
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=2)
        mbarrier.init(bars.index(0), count=1)        # q_ready (TMA bytes)
        mbarrier.init(bars.index(1), count=2)        # q_empty
        mbarrier.init(bars.index(2), count=1)        # wx_full (warpgroup 1's words)
        mbarrier.init(bars.index(3), count=1)        # wx_empty
        fence_async_shared()
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, ready, empty, v_ready, v_empty, bars.index(0), bars.index(1), wx,
                         bars.index(2), bars.index(3), item_smem, CNT, IDX, CNT_OUT, IDX_OUT, FROW, FCOL, warm, O, LSE,
                         PRB, MAXK, stride_ob, stride_os, stride_oh, Sq, Sk, Hq, Tq, Tk, n_items, qk_scale, threshold,
                         causal_off, D, STAGES, NWORDS, 0, LAST_PARTIAL, WRITE_LSE, SKIP, KSTAGE, PV_ASYNC, STATEFUL,
                         CAUSAL, FORCED, BLOCK_N, SPLIT, DYNAMIC, PROBE, EXP_POLY)),
            (_consumer, (q_smem, k_smem, v_smem, ready, empty, v_ready, v_empty, bars.index(0), bars.index(1), wx,
                         bars.index(2), bars.index(3), item_smem, CNT, IDX, CNT_OUT, IDX_OUT, FROW, FCOL, warm, O, LSE,
                         PRB, MAXK, stride_ob, stride_os, stride_oh, Sq, Sk, Hq, Tq, Tk, n_items, qk_scale, threshold,
                         causal_off, D, STAGES, NWORDS, 1, LAST_PARTIAL, WRITE_LSE, SKIP, KSTAGE, PV_ASYNC, STATEFUL,
                         CAUSAL, FORCED, BLOCK_N, SPLIT, DYNAMIC, PROBE, EXP_POLY)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, ready, empty, v_ready, v_empty, bars.index(0),
                         bars.index(1), item_smem, CTR,
                         CNT, IDX, warm, PRB, MAXK, Sq, Sk, Hq, n_rep, Tq, Tk, n_items, causal_off, D, STAGES, SKIP,
                         STATEFUL, CAUSAL, LAYOUT, BLOCK_N, SPLIT, DYNAMIC, PROBE)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _head_major(t) -> bool:
    return memory_layout(t) == "head"


def _layout_bits(q, k, v) -> int:
    """The kernel's LAYOUT: bit 1 / 2 / 4 set when q / k / v is head-major, else sequence-major."""
    return sum(bit for bit, t in ((1, q), (2, k), (4, v)) if _head_major(t))


def supported(q, k, v, tile, dense: bool = False) -> bool:
    """True when the Gluon kernel runs these inputs: Gluon, an sm_90 GPU, tile (128, 128), fp16 / bf16, head dim
    64 / 128 (and 256 for dense calls), 16-byte aligned (B, S, H, D) tensors, each sequence-major (its (B * S) rows
    have one stride: views of a fused QKV qualify) or head-major (the transposed view of a contiguous (B, H, S, D)
    tensor)."""
    if not (HAS_GLUON and q.is_cuda and tuple(tile) == (BM, BN)):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] not in ((64, 128, 256) if dense else (64, 128)):
        return False
    if _capability_major(q.device.index if q.device.index is not None else torch.cuda.current_device()) != 9:
        return False
    for t in (q, k, v):
        if memory_layout(t) == "other":
            return False
        if t.data_ptr() % 16 or (t.stride(1) * t.element_size()) % 16:
            return False
    return True


def causal_aligned(seq_q: int, seq_k: int) -> bool:
    """The causal calls the Gluon kernel runs: bottom-right aligned with Sk >= Sq and Sk - Sq a multiple of 128 (its
    q-tile and largest key tile), so the diagonal lies in each q-tile's last BM / BN key tiles."""
    return seq_k >= seq_q and (seq_k - seq_q) % BN == 0


def supports_causal(q, k) -> bool:
    """Causal dense calls the Gluon kernel runs (on top of `supported`): `causal_aligned` sequence lengths."""
    return causal_aligned(q.shape[1], k.shape[1])


def dense_fwd(q, k, v, scale, return_lse, cfg=None, causal: bool = False):
    """Gluon dense forward: the skip kernel with skipping compiled out (every k-tile, no lists). causal: query i
    sees keys <= Sk - Sq + i (bottom-right aligned, `supports_causal` inputs); q-tiles run longest first."""
    if causal and not supports_causal(q, k):
        raise ValueError(f"causal Gluon attention needs Sk >= Sq and (Sk - Sq) % {BN} == 0, got Sq={q.shape[1]}, "
                         f"Sk={k.shape[1]}")
    out, _, _, lse = _launch(q, k, v, None, None, -1.0, scale, return_lse, cfg, skip=False, causal=causal)
    return out, lse


def skip_fwd(q, k, v, counts, indices, threshold, scale, return_lse, cfg=None, forced=None):
    """Gluon skip forward: same outputs as `skip._skip_fwd_impl` at tile (128, 128). must_do: counts / indices
    already hold the forced tiles (`skip._union`) and forced = (frow (Tq,), fcol (Tk,)) int8 flags them, so that
    the next list keeps them."""
    return _launch(q, k, v, counts, indices, threshold, scale, return_lse, cfg, skip=True, forced=forced)


def skip_step(q, k, v, counts, indices, step, warmup, threshold, scale, cfg=None, read=None, forced=None):
    """Gluon body of `skip.skip_step` (tile (128, 128)) -> out. counts int32 (2, B, H, Tq) / indices int32
    (2, B, H, Tq, Tk) are the list slots (each slot contiguous: the caller checks), step int64 (1,) the call
    counter, read by the kernel: calls < warmup visit every tile and leave the lists alone, later calls read slot
    (step - warmup) % 2 and write the other. The counter is not incremented here.
    must_do: read = (counts, indices) of the slots with the forced tiles added (`skip._union`, same slot strides),
    which the kernel reads instead, and forced = (frow, fcol) as in `skip_fwd`."""
    return _launch(q, k, v, counts, indices, threshold, scale, False, cfg, skip=True, step=step,
                   warmup=int(warmup), read=read, forced=forced)[0]


# Launch plans, as skip._launch's (host time: benchmarks/NOTES.md, skip forward v7): the first call of a key goes
# through Gluon's JIT launcher and records the compiled kernel's direct launcher; later calls fill in the tensors
# and descriptor bases only. Key: every shape / stride / dtype / scalar argument and the config.
_PLANS: dict = {}
_DIRECT = [True]
_TENSORS = ("CNT", "IDX", "CNT_OUT", "IDX_OUT", "FROW", "FCOL", "STEP", "O", "LSE", "PRB", "CTR")
_DESCS = dict(q_desc=0, k_desc=1, v_desc=2)


def _launch(q, k, v, counts, indices, threshold, scale, return_lse, cfg, skip, step=None, warmup=0, causal=False,
            read=None, forced=None):
    B, Sq, Hq, D = q.shape
    base = GLUON_D256_CONFIG if D > 128 else GLUON_D64_DENSE_CONFIG if D == 64 and not skip else GLUON_SKIP_CONFIG
    cfg = dict(base, **cfg) if cfg else base
    poly = int(cfg.get("exp_poly", 0))
    if poly not in (0, 8):
        raise ValueError(f"cfg['exp_poly'] must be 0 (every exponential on MUFU) or 8 (one in 8 on the FMA pipe), "
                         f"got {poly!r}")
    bn = block_n(D)
    if skip and bn != BN:
        raise ValueError(f"the Gluon skip kernel takes head dim 64 / 128, got {D}")
    if bn != BN and cfg["kstage"]:   # (the out staging needs a 128-row K tile)
        raise ValueError(f"cfg: kstage must be False at head dim {D}")
    Sk, Hk = k.shape[1], k.shape[2]
    Tq, Tk = triton.cdiv(Sq, BM), triton.cdiv(Sk, bn)
    dev = q.device
    out = torch.empty((B, Sq, Hq, D), dtype=q.dtype, device=dev)
    lse = torch.empty((B, Hq, Sq) if return_lse else (1,), dtype=torch.float32, device=dev)
    stateful = step is not None
    if stateful:   # the kernel picks the read / write slots from *step
        next_counts, next_indices = counts, indices
        if read is not None:
            counts, indices = read
            if (counts.stride(0), indices.stride(0)) != (next_counts.stride(0), next_indices.stride(0)):
                raise ValueError("read: the union's slot strides must equal the list slots' strides")
    elif skip:
        next_counts = torch.empty((B, Hq, Tq), dtype=torch.int32, device=dev)
        next_indices = torch.empty((B, Hq, Tq, Tk), dtype=torch.int32, device=dev)
        counts, indices = counts.contiguous(), indices.contiguous()
    else:   # (never read)
        next_counts = next_indices = counts = indices = torch.empty((1,), dtype=torch.int32, device=dev)
    n_items = B * Hq * Tq
    grid = (min(n_items, num_sms(dev)),)
    maxk = triton.cdiv(n_items, grid[0])
    dynamic = bool(causal and cfg["dynamic"])
    # benchmarks only: cfg["probe"], int64 (programs, maxk, 3, 8): %clock64 stamps per owned q-tile of warpgroup 0,
    # warpgroup 1 and the producer (bench_skip.py `probe_gluon` reads them)
    probe = cfg.get("probe")
    if probe is not None and dynamic:
        raise ValueError("cfg['probe'] needs static shares (cfg['dynamic'] False): a dynamic program's q-tile count "
                         "is not known in advance")
    if probe is not None and (probe.dtype != torch.int64 or probe.numel() < grid[0] * maxk * 24):
        raise ValueError(f"cfg['probe'] must be an int64 tensor of >= {grid[0] * maxk * 24} elements")
    frow, fcol = forced if forced is not None else (lse, lse)   # (never read without must_do)
    # the work counter starts at 0 on every call (a fresh one per call: CUDA graphs and concurrent streams)
    ctr = torch.zeros((1,), dtype=torch.int32, device=dev) if dynamic else lse
    tensors = dict(CNT=counts, IDX=indices, CNT_OUT=next_counts, IDX_OUT=next_indices, FROW=frow, FCOL=fcol,
                   STEP=step if stateful else next_counts, O=out, LSE=lse, PRB=lse if probe is None else probe,
                   CTR=ctr)
    slot_cnt, slot_idx = (counts.stride(0), indices.stride(0)) if stateful else (0, 0)
    # (skip_step returns out only: no empty LSE to allocate for it)
    lse_ret = lse if return_lse or stateful else q.new_empty((0,), dtype=torch.float32)
    # (the lists' 16-byte alignment is in the key: Gluon specialises pointers on it, q / k / v pass `supported`)
    key = (dev.index, q.dtype, q.shape, k.shape, q.stride(), k.stride(), v.stride(), bool(return_lse), skip,
           counts.data_ptr() % 16 == 0, indices.data_ptr() % 16 == 0, float(threshold), float(scale),
           tuple(sorted(cfg.items())), stateful, warmup, slot_cnt, slot_idx, stateful and step.data_ptr() % 16 == 0,
           causal, forced is not None, *(t.data_ptr() % 16 == 0 for t in (next_counts, next_indices, frow, fcol)))
    plan = _PLANS.get(key) if _DIRECT[0] and probe is None else None
    if plan is not None:
        relaunch, template, tslots, dslots = plan
        args = list(template)
        for pos, name in tslots:
            args[pos] = tensors[name]
        qkv = (q, k, v)
        for pos, i, geometry in dslots:
            args[pos] = DescriptorArgs(qkv[i], *geometry)
        if relaunch_or_stop(relaunch, dev.index, args, _DIRECT, _PLANS, "skip_gluon"):
            return out, next_counts, next_indices, lse_ret
    dt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    lay = gl.NVMMASharedLayout.get_default_for([bn, D], dt)
    # 2-D views (B * S, H * D), or (B * H * S, D) for a head-major tensor: rows past a (batch, head)'s S belong to
    # the next one; only the partial last k-tile reaches them and its columns >= Sk are masked (q rows >= Sq are
    # never stored)
    layout = _layout_bits(q, k, v)

    def desc(t, S, H, rows, shared):
        if _head_major(t):
            return TensorDescriptor(t, [t.shape[0] * H * S, D], [D, 1], [rows, D], shared)
        return TensorDescriptor(t, [t.shape[0] * S, H * D], [t.stride(1), 1], [rows, D], shared)

    qd = desc(q, Sq, Hq, BM, gl.NVMMASharedLayout.get_default_for([BM, D], dt))
    kd = desc(k, Sk, Hk, bn, lay)
    vd = desc(v, Sk, Hk, bn, lay)
    params = dict(q_desc=qd, k_desc=kd, v_desc=vd, **tensors, MAXK=maxk, n_warmup=warmup, slot_cnt=slot_cnt,
                  slot_idx=slot_idx, stride_ob=out.stride(0),
                  stride_os=out.stride(1), stride_oh=out.stride(2), Sq=Sq, Sk=Sk, Hq=Hq, n_rep=Hq // Hk, Tq=Tq,
                  Tk=Tk, n_items=n_items,
                  qk_scale=scale * LOG2E, threshold=float(threshold), causal_off=Sk - Sq, D=D,
                  STAGES=int(cfg["stages"]),
                  NWORDS=max(1, triton.next_power_of_2(triton.cdiv(Tk, 32))), LAST_PARTIAL=bool(Sk % bn),
                  WRITE_LSE=bool(return_lse), CONSUMER_REGS=int(cfg["consumer_regs"]),
                  PRODUCER_REGS=int(cfg["producer_regs"]), num_warps=4, SKIP=skip, KSTAGE=bool(cfg["kstage"]),
                  PV_ASYNC=bool(cfg["pv_async"]), STATEFUL=stateful, CAUSAL=bool(causal),
                  FORCED=forced is not None, LAYOUT=layout, BLOCK_N=bn, DYNAMIC=dynamic,
                  PROBE=probe is not None, EXP_POLY=poly)
    kern = _skip_gluon_kernel[grid](**params)
    if _DIRECT[0] and probe is None and dev.index == torch.cuda.current_device():
        relaunch = direct_launcher(kern, grid)
        if relaunch is not None:
            names = _skip_gluon_kernel.arg_names
            tslots = [(pos, n) for pos, n in enumerate(names) if n in _TENSORS]
            dslots = [(names.index(n), i, (params[n].shape, params[n].strides, params[n].block_shape,
                                           params[n].padding)) for n, i in _DESCS.items()]
            per_call = {pos for pos, _ in tslots} | {pos for pos, _, _ in dslots}
            template = [None if pos in per_call else params[n] for pos, n in enumerate(names)]
            if len(_PLANS) > 64:
                _PLANS.clear()
            _PLANS[key] = (relaunch, template, tslots, dslots)
    return out, next_counts, next_indices, lse_ret
