"""NSA selection="tile" forward (inference) on Hopper: the selected, window and compressed branches of 8 tokens x 16
query heads per work item in one persistent, warp-specialised Gluon kernel.

Same function as `forward._tile_branches_kernel` (the Triton fused launch) for head dim 128, selection blocks of
64 keys, GQA group 16, fp16 / bf16, no saved branch outputs: a 1-warp producer streams every K / V tile of an item
(the tile's selected blocks, then the window's unselected blocks, then the compressed keys) through a ring of
shared-memory stages by TMA, and keeps streaming the next item's tiles while the two consumer warpgroups (64 rows =
4 tokens x 16 heads each) finish the current one. Per item the consumers run four phases over that stream:
  A. the selected blocks before the window: selected-branch state only, no mask;
  B. the selected blocks inside the window: one Q K^T, both the selected and the window state (each its mask);
  C. the window's unselected blocks: window state;
  D. the compressed keys: compressed state (the rows' visible prefix);
then out = g_slc * o_slc + g_swa * o_swa + g_cmp * o_cmp (gates, or 1/3 each). Within phases A, C and D each
warpgroup overlaps the softmax of tile t with the P V of tile t - 1 (FA3's intra-warpgroup order, as the dense
Gluon kernel `skip.gluon`). Scores are in log2 units (qk_scale = scale * log2(e)).
"""
from __future__ import annotations

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

from .._common import num_sms
from ..dense.reference import LOG2E

TOKENS = 8      # tokens per work item (x 16 heads = 128 rows, two consumer warpgroups of 64)
GROUP = 16      # query heads per KV head this kernel runs
BLOCK = 64      # keys per K / V tile: one selection block, or 64 compressed keys
HEAD_DIM = 128
GLUON_NSA_CONFIG = dict(stages=4, consumer_regs=232, producer_regs=40)

if HAS_GLUON:
    _KIND_SEL = gl.constexpr(0)    # phase A: selected blocks before the window (no mask)
    _KIND_WIN = gl.constexpr(1)    # phase C: the window's unselected blocks
    _KIND_CMP = gl.constexpr(2)    # phase D: compressed keys

    @gluon.jit
    def _schedule(IDX, b, hk, t0, T, q_off, window, n_c, s_ib, s_it, s_ih, CB: gl.constexpr, CS: gl.constexpr,
                  NSEL: gl.constexpr, NSELP: gl.constexpr, WB: gl.constexpr):
        """An item's tile stream, computed alike by the producer and the consumers: the tile's selection (row of
        its first token t0: ascending block ids, -1 padding last), n1 = its blocks before the window's first
        block wlo, n_u = all of them; the window's blocks wlo .. whi not selected: cand / wonly / rank (the i-th is
        the cand with wonly and rank == i), n_wo of them; n_ct compressed tiles (the keys the item's last row sees).
        minpos / maxpos: the item's first / last query position."""
        NW: gl.constexpr = gl.num_warps()
        l2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NW, 1], [1, 0])
        sel_l: gl.constexpr = gl.SliceLayout(0, l2)
        cand_l: gl.constexpr = gl.SliceLayout(1, l2)
        offs_s = gl.arange(0, NSELP, layout=sel_l)
        lbase = IDX + b.to(gl.int64) * s_ib + t0.to(gl.int64) * s_it + hk * s_ih
        selv = gl.load(lbase + offs_s, mask=offs_s < NSEL, other=-1)
        minpos = t0 + q_off
        maxpos = gl.minimum(t0 + 8, T) - 1 + q_off
        wlo = gl.maximum(minpos - window + 1, 0) // 64
        whi = maxpos // 64
        n_u = gl.sum((selv >= 0).to(gl.int32), 0)
        n1 = gl.sum(((selv >= 0) & (selv < wlo)).to(gl.int32), 0)
        # window-only blocks and their ranks: the same test in both orientations of a [WB, NSELP] / [WB, WB] grid
        cand = wlo + gl.arange(0, WB, layout=cand_l)
        cand_c = wlo + gl.arange(0, WB, layout=sel_l)
        selv_r = gl.convert_layout(selv, cand_l)
        hit = gl.max((gl.expand_dims(cand, 1) == gl.expand_dims(selv, 0)).to(gl.int32), 1)
        hit_c = gl.max((gl.expand_dims(selv_r, 1) == gl.expand_dims(cand_c, 0)).to(gl.int32), 0)
        wonly = ((cand <= whi) & (hit == 0)).to(gl.int32)
        wonly_c = ((cand_c <= whi) & (hit_c == 0)).to(gl.int32)
        rank = gl.sum(((gl.expand_dims(cand_c, 0) < gl.expand_dims(cand, 1)) & (gl.expand_dims(wonly_c, 0) != 0))
                      .to(gl.int32), 1)
        n_wo = gl.sum(wonly, 0)
        hi_c = gl.minimum(gl.where(maxpos + 1 >= CB, (maxpos + 1 - CB) // CS + 1, 0), n_c)
        n_ct = (hi_c + 63) // 64
        return lbase, n1, n_u, cand, wonly, rank, n_wo, n_ct, minpos, maxpos, whi

    @gluon.jit
    def _load_tile(desc_k, desc_v, row, col, k_smem, v_smem, ready, empty, g, STAGES: gl.constexpr):
        slot = g % STAGES
        mbarrier.wait(empty.index(slot), ((g // STAGES) + 1) & 1, pred=g >= STAGES)
        mbarrier.expect(ready.index(slot), 2 * 64 * 128 * 2)
        tma.async_copy_global_to_shared(desc_k, [row, col], ready.index(slot), k_smem.index(slot))
        tma.async_copy_global_to_shared(desc_v, [row, col], ready.index(slot), v_smem.index(slot))
        return g + 1

    @gluon.jit
    def _q_after(c, pre, k, b, hk, t0, T, Hk, q_desc, q_smem, q_ready, q_empty):
        """Once the item's first `pre` tiles are issued (c == pre): q of the item (8 boxes of the 16 heads of one
        token: rows (b * T + t) * Hq + hk * 16 of the (B * T * Hq, D) view), after both consumers finished the
        previous item."""
        if c == pre:
            mbarrier.wait(q_empty, (k + 1) & 1, pred=k > 0)
            mbarrier.expect(q_ready, 128 * 128 * 2)
            for i in gl.static_range(8):
                tma.async_copy_global_to_shared(q_desc, [(b * T + t0 + i) * (Hk * 16) + hk * 16, 0], q_ready,
                                                q_smem.slice(16 * i, 16))

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, kc_desc, vc_desc, q_smem, k_smem, v_smem, ready, empty, q_ready, q_empty,
                  IDX, s_ib, s_it, s_ih, T, S, n_c, q_off, Hk, window, n_groups, n_items,
                  CB: gl.constexpr, CS: gl.constexpr, NSEL: gl.constexpr, NSELP: gl.constexpr, WB: gl.constexpr,
                  STAGES: gl.constexpr):
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        g = 0
        k = 0
        lin = pid
        while lin < n_items:
            bhk = lin // n_groups
            t0 = (lin % n_groups) * 8
            b = bhk // Hk
            hk = bhk % Hk
            # the same stream as `_schedule`, enumerated with scalars (one warp: no [WB, NSELP] grids in registers)
            lbase = IDX + b.to(gl.int64) * s_ib + t0.to(gl.int64) * s_it + hk * s_ih
            minpos = t0 + q_off
            maxpos = gl.minimum(t0 + 8, T) - 1 + q_off
            wlo = gl.maximum(minpos - window + 1, 0) // 64
            whi = maxpos // 64
            n_u = 0
            n_in = 0   # selected blocks inside the window
            for i in range(NSEL):
                jb = gl.load(lbase + i)
                n_u += (jb >= 0).to(gl.int32)
                n_in += (jb >= wlo).to(gl.int32)
            hi_c = gl.minimum(gl.where(maxpos + 1 >= CB, (maxpos + 1 - CB) // CS + 1, 0), n_c)
            n_ct = (hi_c + 63) // 64
            # the first ring-full of this item's tiles waits only for slots the previous item frees; q once both
            # consumers finished the previous item (`_q_after`)
            pre = gl.minimum(n_u + (whi - wlo + 1 - n_in) + n_ct, STAGES)
            c = 0
            for i in range(n_u):
                jb = gl.load(lbase + i)
                g = _load_tile(k_desc, v_desc, b * S + jb * 64, hk * 128, k_smem, v_smem, ready, empty, g, STAGES)
                c += 1
                _q_after(c, pre, k, b, hk, t0, T, Hk, q_desc, q_smem, q_ready, q_empty)
            for jw in range(wlo, whi + 1):
                hit = 0
                for i in range(n_u - n_in, n_u):
                    hit += (gl.load(lbase + i) == jw).to(gl.int32)
                if hit == 0:
                    g = _load_tile(k_desc, v_desc, b * S + jw * 64, hk * 128, k_smem, v_smem, ready, empty, g,
                                   STAGES)
                    c += 1
                    _q_after(c, pre, k, b, hk, t0, T, Hk, q_desc, q_smem, q_ready, q_empty)
            for i in range(n_ct):
                g = _load_tile(kc_desc, vc_desc, b * n_c + i * 64, hk * 128, k_smem, v_smem, ready, empty, g,
                               STAGES)
                c += 1
                _q_after(c, pre, k, b, hk, t0, T, Hk, q_desc, q_smem, q_ready, q_empty)
            k += 1
            lin += P

    @gluon.jit
    def _online(s, m_i, l_i, qk_scale, keep, MASK: gl.constexpr):
        """One online-softmax step on S (fp32 [64, 64], raw scores): -> (P, new m, new l, alpha); m / l in log2
        units. MASK: keys where keep is False are dropped; a row that has seen no key yet keeps m = -inf, l = 0
        (its P and alpha are 0, never NaN)."""
        if MASK:
            s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
        alpha = gl.exp2(m_i - m_use)
        return p, m_new, l_i * alpha + gl.sum(p, 1), alpha

    @gluon.jit
    def _keep(KIND: gl.constexpr, start, cols, qpos, nvis, window):
        """The keys a row may attend to in a tile whose first key (or compressed key) is `start`."""
        key = gl.expand_dims(start + cols, 0)
        if KIND == _KIND_CMP:
            return key < gl.expand_dims(nvis, 1)
        else:
            qp = gl.expand_dims(qpos, 1)
            return (key <= qp) & (key > qp - window)

    @gluon.jit
    def _tile_start(KIND: gl.constexpr, i, cand, wonly, rank):
        if KIND == _KIND_WIN:
            return gl.sum(gl.where((wonly != 0) & (rank == i), cand, 0), 0) * 64
        else:
            return i * 64

    @gluon.jit
    def _phase(qh, k_smem, v_smem, ready, empty, g, acc, m_i, l_i, n, qk_scale, qpos, nvis, window,
               mask_lo, mask_hi, cand, wonly, rank, KIND: gl.constexpr, STAGES: gl.constexpr,
               s_layout: gl.constexpr, p_layout: gl.constexpr, o_layout: gl.constexpr):
        """n tiles of the stream into one online-softmax state (acc, m_i, l_i). A tile whose first key lies in
        [mask_lo, mask_hi) runs unmasked (every row sees all its keys); the others with `_keep`. Tile t's Q K^T is
        issued with tile t - 1's P V, and its softmax runs while that P V executes; the last P V completes before
        the return."""
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([64, 64], gl.float32, s_layout)
        if n > 0:
            slot = g % STAGES
            mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
            s = warpgroup_mma(qh, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False)
            start = _tile_start(KIND, 0, cand, wonly, rank)
            if (start >= mask_lo) & (start < mask_hi):
                p, m_new, l_i, alpha = _online(s, m_i, l_i, qk_scale, None, False)
            else:
                p, m_new, l_i, alpha = _online(s, m_i, l_i, qk_scale, _keep(KIND, start, cols, qpos, nvis, window),
                                               True)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p16 = gl.convert_layout(p.to(k_smem.dtype), p_layout)
            m_i = m_new
            prev = slot
            g += 1
            for t in range(1, n):
                slot = g % STAGES
                mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
                s_tok = warpgroup_mma(qh, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                o_tok = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=[s_tok])
                start = _tile_start(KIND, t, cand, wonly, rank)
                if (start >= mask_lo) & (start < mask_hi):
                    p, m_new, l_i, alpha = _online(s, m_i, l_i, qk_scale, None, False)
                else:
                    p, m_new, l_i, alpha = _online(s, m_i, l_i, qk_scale,
                                                   _keep(KIND, start, cols, qpos, nvis, window), True)
                acc = warpgroup_mma_wait(0, deps=[o_tok])
                mbarrier.arrive(empty.index(prev))
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
                p16 = gl.convert_layout(p.to(k_smem.dtype), p_layout)
                m_i = m_new
                prev = slot
                g += 1
            acc = warpgroup_mma(p16, v_smem.index(prev), acc)
            mbarrier.arrive(empty.index(prev))
        return acc, m_i, l_i, g

    @gluon.jit
    def _phase_both(qh, k_smem, v_smem, ready, empty, g, acc_s, m_s, l_s, acc_w, m_w, l_w, lbase, n1, n_u,
                    qk_scale, qpos, window, minpos, maxpos, STAGES: gl.constexpr, s_layout: gl.constexpr,
                    p_layout: gl.constexpr, o_layout: gl.constexpr):
        """Phase B: the selected blocks inside the window (list entries n1 .. n_u - 1): one Q K^T per block, then
        the selected state (causal mask on the block holding the item's tokens) and the window state (its window
        mask where a row's window edge or the causal diagonal crosses the block)."""
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([64, 64], gl.float32, s_layout)
        for i in range(n1, n_u):
            slot = g % STAGES
            mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
            s = warpgroup_mma(qh, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False)
            start = gl.load(lbase + i) * 64
            key = gl.expand_dims(start + cols, 0)
            qp = gl.expand_dims(qpos, 1)
            causal = key <= qp
            if start + 63 > minpos:
                p, m_new, l_s, alpha = _online(s, m_s, l_s, qk_scale, causal, True)
            else:
                p, m_new, l_s, alpha = _online(s, m_s, l_s, qk_scale, None, False)
            acc_s = acc_s * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p16s = gl.convert_layout(p.to(k_smem.dtype), p_layout)
            tok_s = warpgroup_mma(p16s, v_smem.index(slot), acc_s, is_async=True)
            m_s = m_new
            if (start + 63 > minpos) | (start <= maxpos - window):
                p, m_new, l_w, alpha = _online(s, m_w, l_w, qk_scale, causal & (key > qp - window), True)
            else:
                p, m_new, l_w, alpha = _online(s, m_w, l_w, qk_scale, None, False)
            acc_w = acc_w * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p16w = gl.convert_layout(p.to(k_smem.dtype), p_layout)
            tok_w = warpgroup_mma(p16w, v_smem.index(slot), acc_w, is_async=True)
            m_w = m_new
            acc_s, p16s = warpgroup_mma_wait(1, deps=[tok_s, p16s])   # (P stays live while its P V runs)
            acc_w, p16w = warpgroup_mma_wait(0, deps=[tok_w, p16w])
            mbarrier.arrive(empty.index(slot))
            g += 1
        return acc_s, m_s, l_s, acc_w, m_w, l_w, g

    @gluon.jit
    def _normalized(acc, l_i, o_layout: gl.constexpr):
        """acc / l per row (0 for a row that saw no key)."""
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        return acc * gl.expand_dims(gl.where(l_o != 0.0, 1.0 / gl.where(l_o == 0.0, 1.0, l_o), 0.0), 1)

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, ready, empty, q_ready, q_empty, IDX, GATES, OUT,
                  s_ib, s_it, s_ih, sgb, sgs, sgh, sgc, sob, sos, soh, T, n_c, q_off, Hk, window, n_groups,
                  n_items, qk_scale, WG: gl.constexpr, CB: gl.constexpr, CS: gl.constexpr, NSEL: gl.constexpr,
                  NSELP: gl.constexpr, WB: gl.constexpr, STAGES: gl.constexpr, HAS_GATES: gl.constexpr):
        """Rows 64 * WG .. 64 * WG + 63 of every item (tokens t0 + 4 * WG .. + 3, x the 16 heads)."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 64, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 128, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        orow_l: gl.constexpr = gl.SliceLayout(1, o_layout)
        qh = q_smem.slice(64 * WG, 64)
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        r = gl.arange(0, 64, layout=row_l)
        ro = gl.arange(0, 64, layout=orow_l)
        dcols = gl.arange(0, 128, layout=gl.SliceLayout(0, o_layout))
        g = 0
        k = 0
        lin = pid
        while lin < n_items:
            bhk = lin // n_groups
            t0 = (lin % n_groups) * 8
            b = bhk // Hk
            hk = bhk % Hk
            lbase, n1, n_u, cand, wonly, rank, n_wo, n_ct, minpos, maxpos, whi = _schedule(
                IDX, b, hk, t0, T, q_off, window, n_c, s_ib, s_it, s_ih, CB, CS, NSEL, NSELP, WB)
            qpos = t0 + 4 * WG + r // 16 + q_off
            nvis = gl.minimum(gl.where(qpos + 1 >= CB, (qpos + 1 - CB) // CS + 1, 0), n_c)
            nvis_lo = gl.minimum(gl.where(minpos + 1 >= CB, (minpos + 1 - CB) // CS + 1, 0), n_c)
            m_s = gl.full([64], float("-inf"), gl.float32, row_l)
            l_s = gl.zeros([64], gl.float32, row_l)
            acc_s = gl.zeros([64, 128], gl.float32, o_layout)
            m_w = gl.full([64], float("-inf"), gl.float32, row_l)
            l_w = gl.zeros([64], gl.float32, row_l)
            acc_w = gl.zeros([64, 128], gl.float32, o_layout)
            mbarrier.wait(q_ready, k & 1)
            # A: every key of a selected block before the window is visible to every row
            acc_s, m_s, l_s, g = _phase(qh, k_smem, v_smem, ready, empty, g, acc_s, m_s, l_s, n1, qk_scale, qpos,
                                        nvis, window, -(1 << 30), 1 << 30, cand, wonly, rank, _KIND_SEL, STAGES,
                                        s_layout, p_layout, o_layout)
            acc_s, m_s, l_s, acc_w, m_w, l_w, g = _phase_both(
                qh, k_smem, v_smem, ready, empty, g, acc_s, m_s, l_s, acc_w, m_w, l_w, lbase, n1, n_u, qk_scale,
                qpos, window, minpos, maxpos, STAGES, s_layout, p_layout, o_layout)
            # C: unmasked where the block starts after every row's window edge and ends before the first row
            acc_w, m_w, l_w, g = _phase(qh, k_smem, v_smem, ready, empty, g, acc_w, m_w, l_w, n_wo, qk_scale, qpos,
                                        nvis, window, maxpos - window + 1, minpos - 62, cand, wonly, rank,
                                        _KIND_WIN, STAGES, s_layout, p_layout, o_layout)
            tok = t0 + 4 * WG + ro // 16
            head = hk * 16 + ro % 16
            row_ok = tok < T
            if HAS_GATES:
                gb = GATES + b.to(gl.int64) * sgb + tok.to(gl.int64) * sgs + head * sgh
                g0 = gl.load(gb, mask=row_ok, other=0.0).to(gl.float32)
                g1 = gl.load(gb + sgc, mask=row_ok, other=0.0).to(gl.float32)
                g2 = gl.load(gb + 2 * sgc, mask=row_ok, other=0.0).to(gl.float32)
            else:
                g0 = gl.full([64], 1.0 / 3.0, gl.float32, orow_l)
                g1 = g0
                g2 = g0
            res = (_normalized(acc_s, l_s, o_layout) * gl.expand_dims(g1, 1)
                   + _normalized(acc_w, l_w, o_layout) * gl.expand_dims(g2, 1))
            # D: compressed tiles wholly inside the first row's visible prefix run unmasked
            m_c = gl.full([64], float("-inf"), gl.float32, row_l)
            l_c = gl.zeros([64], gl.float32, row_l)
            acc_c = gl.zeros([64, 128], gl.float32, o_layout)
            acc_c, m_c, l_c, g = _phase(qh, k_smem, v_smem, ready, empty, g, acc_c, m_c, l_c, n_ct, qk_scale, qpos,
                                        nvis, window, 0, nvis_lo - 63, cand, wonly, rank, _KIND_CMP, STAGES,
                                        s_layout, p_layout, o_layout)
            mbarrier.arrive(q_empty)   # every Q K^T of this item is done: q may be refilled
            out = res + _normalized(acc_c, l_c, o_layout) * gl.expand_dims(g0, 1)
            ptrs = (OUT + b.to(gl.int64) * sob + gl.expand_dims(tok.to(gl.int64) * sos + head * soh, 1)
                    + gl.expand_dims(dcols, 0))
            gl.store(ptrs, out.to(OUT.dtype.element_ty), mask=gl.expand_dims(row_ok, 1))
            k += 1
            lin += P

    @gluon.jit
    def _nsa_tile_kernel(q_desc, k_desc, v_desc, kc_desc, vc_desc, IDX, GATES, OUT,
                         s_ib, s_it, s_ih, sgb, sgs, sgh, sgc, sob, sos, soh, T, S, n_c, q_off, Hk, window,
                         n_groups, n_items, qk_scale,
                         CB: gl.constexpr, CS: gl.constexpr, NSEL: gl.constexpr, NSELP: gl.constexpr,
                         WB: gl.constexpr, STAGES: gl.constexpr, HAS_GATES: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """Launched with num_warps=4, grid (programs,): default partition = warpgroup 0, worker 0 (4 warps) =
        warpgroup 1, worker 1 (1 warp) = the loads. Items lin = (b * Hk + hk) * n_groups + token group."""
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [128, 128], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 64, 128], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 64, 128], v_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)   # one arrive per consumer warpgroup
        mbarrier.init(bars.index(0), count=1)        # q_ready (TMA bytes)
        mbarrier.init(bars.index(1), count=2)        # q_empty
        fence_async_shared()
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, ready, empty, bars.index(0), bars.index(1), IDX, GATES, OUT,
                         s_ib, s_it, s_ih, sgb, sgs, sgh, sgc, sob, sos, soh, T, n_c, q_off, Hk, window, n_groups,
                         n_items, qk_scale, 0, CB, CS, NSEL, NSELP, WB, STAGES, HAS_GATES)),
            (_consumer, (q_smem, k_smem, v_smem, ready, empty, bars.index(0), bars.index(1), IDX, GATES, OUT,
                         s_ib, s_it, s_ih, sgb, sgs, sgh, sgc, sob, sos, soh, T, n_c, q_off, Hk, window, n_groups,
                         n_items, qk_scale, 1, CB, CS, NSEL, NSELP, WB, STAGES, HAS_GATES)),
            (_producer, (q_desc, k_desc, v_desc, kc_desc, vc_desc, q_smem, k_smem, v_smem, ready, empty,
                         bars.index(0), bars.index(1), IDX, s_ib, s_it, s_ih, T, S, n_c, q_off, Hk, window,
                         n_groups, n_items, CB, CS, NSEL, NSELP, WB, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def supported(q, k, config, gates, save: bool, q_off: int) -> bool:
    """True when `tile_forward` runs this call: Gluon on an sm_90 GPU, selection="tile", selection blocks of 64,
    head dim 128, GQA group 16, fp16 / bf16, no saved branch outputs (inference), the first query starting a
    selection tile."""
    if not (HAS_GLUON and q.is_cuda and not save and config.selection == "tile" and config.block_size == BLOCK):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] != HEAD_DIM or k.shape[-1] != HEAD_DIM:
        return False
    if q.shape[2] != GROUP * k.shape[2] or q_off % BLOCK:
        return False
    if gates is not None and gates.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    return torch.cuda.get_device_capability(q.device)[0] == 9


def _rows_2d(t):
    """t (B, S, H, D) as its (B * S, H * D) row view for a TMA descriptor (a contiguous copy when its rows do not
    have one stride)."""
    B, S, H, D = t.shape
    if t.stride(3) != 1 or t.stride(2) != D or t.stride(0) != S * t.stride(1) or t.data_ptr() % 16:
        t = t.contiguous()
    return t, [B * S, H * D], [t.stride(1), 1]


def tile_forward(q, k, v, idx, k_cmp, v_cmp, n_c, gates, scale, config, q_off, cfg=None):
    """Inference forward of NSA selection="tile" (`supported` inputs) -> out (B, T, Hq, D) in q's dtype.
    q (B, T, Hq, D), k / v (B, S, Hk, D), idx (B, T, Hk, num_selected) int32 (each token's row = its tile's
    selection, ascending, -1 padded), k_cmp / v_cmp (B, >= max(n_c, 1), Hk, D) whose first n_c rows are the
    compressed keys / values, gates (B, T, Hq, 3) or None (1/3 each)."""
    cfg = dict(GLUON_NSA_CONFIG, **(cfg or {}))
    B, T, Hq, D = q.shape
    S, Hk = k.shape[1], k.shape[2]
    dt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    if q.stride(3) != 1 or q.stride(2) != D or q.stride(1) != Hq * D or q.stride(0) != T * Hq * D:
        q = q.contiguous()
    q_desc = TensorDescriptor(q, [B * T * Hq, D], [D, 1], [16, D],
                              gl.NVMMASharedLayout.get_default_for([16, D], dt))
    lay = gl.NVMMASharedLayout.get_default_for([BLOCK, D], dt)
    descs = []
    for t in (k, v, k_cmp, v_cmp):
        t, shape, strides = _rows_2d(t)
        descs.append(TensorDescriptor(t, shape, strides, [BLOCK, D], lay))
    out = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    gt = gates if gates is not None else out
    n_groups = triton.cdiv(T, TOKENS)
    n_items = B * Hk * n_groups
    nsel = config.num_selected
    grid = (min(n_items, num_sms(q.device)),)
    _nsa_tile_kernel[grid](
        q_desc, *descs, idx, gt, out, idx.stride(0), idx.stride(1), idx.stride(2),
        gt.stride(0), gt.stride(1), gt.stride(2), gt.stride(3) if gates is not None else 0,
        out.stride(0), out.stride(1), out.stride(2), T, S, n_c, q_off, Hk, config.window, n_groups, n_items,
        scale * LOG2E, CB=config.compress_block, CS=config.compress_stride, NSEL=nsel,
        NSELP=triton.next_power_of_2(nsel), WB=triton.next_power_of_2(config.window // BLOCK + 2),
        STAGES=int(cfg["stages"]), HAS_GATES=gates is not None, CONSUMER_REGS=int(cfg["consumer_regs"]),
        PRODUCER_REGS=int(cfg["producer_regs"]), num_warps=4)
    return out
