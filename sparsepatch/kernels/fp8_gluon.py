"""fp8 / int8 dense attention forward in Gluon (Hopper): the kernel of `dense.attention_fp8` with explicit wgmma
wait placement, so the softmax of one key block runs while the tensor cores do P @ V of the previous one.

Same numerics as `dense.attention_fp8` (qk_format "int8"): S = (q8 . k8) * s_q * s_k with int8 q/k per 128-row
block (scale amax/127, round half away from zero), P cast to e4m3 as P * 2^8, V e4m3 per channel stored transposed
(B, Hk, D, Sk_pad16) by `dense.quantize_fp8`. Why Gluon: Triton 3.6 waits for every wgmma whose result is not a
loop-carried accumulator right after issuing it, so in the plain-Triton kernel each warpgroup runs
Q K^T -> wait -> softmax -> P V -> wait with no overlap (benchmarks/NOTES.md, fp8 section, session 4 SASS).

Per program: one (128-row q tile, query head); 8 warps = two warpgroups of 64 rows (the wgmma M split), both
reading the same K / V^T tiles from a STAGES-deep shared-memory ring filled by TMA. Loop step j (FA3's
intra-warpgroup order):
    issue S_j = Q K_j^T (async)       issue O += P_{j-1} V_{j-1} (async)
    wait(1) -> S_j ready               softmax(S_j) -> P_j, alpha_j   (overlaps P_{j-1} V_{j-1})
    wait(0) -> O ready                 O *= alpha_j;  CTA barrier; TMA refill of block j-1's slot
int32 -> fp32 without I2F: the Q K^T accumulator starts at the bits of 1.5 * 2^23 (use_acc with a constant), so
the int32 result reinterpreted as fp32 is exactly 1.5 * 2^23 + q.k (|q.k| < 2^21); the offset folds into the
per-row bias of the one FFMA that scales and shifts the logits.

cfg ws=True: the same step in a warp-specialised kernel (each 64-row warpgroup its own partition, a 1-warp TMA
producer, per-slot `empty` mbarriers instead of CTA barriers). cfg block_m=64: the lockstep kernel with one
warpgroup per CTA (2 CTAs per SM).

Status (H100, session 6, benchmarks/NOTES.md "fp8 Gluon forward"): GPU tests pass (lockstep / ws, run 1); cos vs
cuDNN 0.9992. SLOWER than `dense.attention_fp8` end to end at 8K / 16K / 32K (8K kernel: lockstep 2.61 ms, ws
2.29, block_m 64 2.41 vs Triton 2.14): opt-in only, used by default nowhere.

Public entry points: `attention_fp8_gluon_quantized` (on `dense.quantize_fp8` outputs, q either pre-quantized
int8 or the fp16/bf16 q itself, quantized in the kernel per 128-row tile), `attention_fp8_gluon` (end to end),
`gluon_fp8_supported`.
"""
from __future__ import annotations

import math

import torch

try:  # Gluon ships with Triton >= 3.5; without it the module still imports (supported() says False)
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    HAS_GLUON = True
except Exception:  # pragma: no cover - depends on the installed Triton
    HAS_GLUON = False

BLOCK = 128  # q rows per program = keys per block = the quantize blocks of dense.quantize_fp8
LOG2_P_SCALE = 8.0  # P is cast to e4m3 as P * 2^8 (as dense.FP8_LOG2_P_SCALE)
MAGIC = 12582912.0  # 1.5 * 2^23: fp32 whose low mantissa bits hold a small int32 exactly
MAGIC_BITS = 0x4B400000
# ws: the warp-specialised kernel (2 consumer warpgroups + 1 producer warp, registers per worker partition by
# setmaxnreg: consumer_regs for the second consumer warpgroup, producer_regs for the load warp)
# block_m: q rows per program (lockstep kernel): 128 = two warpgroups in one CTA (1 CTA per SM at ~245 registers),
# 64 = one warpgroup per CTA (2 CTAs per SM, which interleave: one's softmax under the other's MMAs); num_warps
# is block_m // 16. ws needs block_m 128.
GLUON_FP8_CONFIG = dict(stages=3, block_m=128, ws=False, consumer_regs=240, producer_regs=24)
LN2 = math.log(2.0)
LOG2E = 1.0 / LN2

if HAS_GLUON:
    _MAGIC = gl.constexpr(MAGIC)
    _MAGIC_BITS = gl.constexpr(MAGIC_BITS)
    _LN2 = gl.constexpr(LN2)

    @gluon.jit
    def _softmax_step(s_i32, m_i, l_i, c, start_n, Sk, s_layout: gl.constexpr, BN: gl.constexpr,
                      LOG2_PS: gl.constexpr, MASK: gl.constexpr):
        """Online softmax of one key block. s_i32: int32 [BM, BN] = bits of 1.5 * 2^23 + q.k; c = s_q * s_k *
        scale * log2(e) (scalar). -> (P * 2^LOG2_PS fp32 [BM, BN], m_new, l_new, alpha) with m in log2 units."""
        x = s_i32.to(gl.float32, bitcast=True)  # = MAGIC + q.k exactly
        if MASK:
            cols = start_n + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            x = gl.where(gl.expand_dims(cols < Sk, 0), x, float("-inf"))
        m_new = gl.maximum(m_i, (gl.max(x, 1) - _MAGIC) * c)
        # one FFMA per element: x * c - (MAGIC * c + m_new - LOG2_PS); the P * 2^LOG2_PS offset rides in the bias
        bias = _MAGIC * c + m_new - LOG2_PS
        p = gl.exp2(x * c - gl.expand_dims(bias, 1))
        alpha = gl.exp2(m_i - m_new)
        l_new = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_new, alpha

    @gluon.jit
    def _fp8_gluon_fwd_kernel(Q, QS, K8, KS, VT8, VS, O, LSE,
                              stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh,
                              Sq, Sk, Sk_pad, Hq, Hk, n_rep, nqb, nkb, qk_scale,
                              D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                              QFUSED: gl.constexpr, WRITE_LSE: gl.constexpr, LOG2_PS: gl.constexpr,
                              num_warps: gl.constexpr, QBLK: gl.constexpr = 128):
        """One (BM q rows, query head) tile, BM = 16 * num_warps (64 or 128). Q: fp16/bf16 q (B, Sq, Hq, D) when
        QFUSED (quantized here, one int8 block = this tile) else int8 q8 with scales QS (B, Hq, nqb) per QBLK rows;
        strides in elements, (b, s, h) order.
        K8 int8 (B, Hk, Sk, D), KS (B, Hk, nkb); VT8 e4m3 (B, Hk, D, Sk_pad), VS (B, Hk, D);
        O (B, Sq, Hq, D) by its strides; LSE fp32 (B, Hq, Sq) natural log."""
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
        b = bh // Hq
        h = bh % Hq
        bhk = (b * Hk + h // n_rep).to(gl.int64)
        start_m = pid_m * BM

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BN, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, D, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        TD: gl.constexpr = D // 8  # threads along D for 16-byte bf16 row loads
        ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TD, TD], [num_warps, 1], [1, 0])
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], gl.int8)
        k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.int8)
        v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([D, BN], gl.float8e4nv)

        # device-side descriptors over this head's K / V^T: out-of-range keys of the last block read as zeros
        # (a flat 2-D view would read the next head's rows, or V^T's unwritten padding columns)
        k_desc = tma.make_tensor_descriptor(K8 + bhk * Sk * D, shape=[Sk, D], strides=[D, 1],
                                            block_shape=[BN, D], layout=k_sl)
        v_desc = tma.make_tensor_descriptor(VT8 + bhk * D * Sk_pad, shape=[D, Sk], strides=[Sk_pad, 1],
                                            block_shape=[D, BN], layout=v_sl)
        q_smem = gl.allocate_shared_memory(gl.int8, [BM, D], q_sl)
        k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BN, D], k_sl)
        v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, D, BN], v_sl)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        fence_async_shared()

        n_blk = gl.cdiv(Sk, BN)
        TILE_BYTES: gl.constexpr = BN * D + D * BN
        for i in gl.static_range(STAGES):  # prologue: the first STAGES key blocks in flight
            mbarrier.expect(ready.index(i), TILE_BYTES, pred=i < n_blk)
            tma.async_copy_global_to_shared(k_desc, [i * BN, 0], ready.index(i), k_smem.index(i), pred=i < n_blk)
            tma.async_copy_global_to_shared(v_desc, [0, i * BN], ready.index(i), v_smem.index(i), pred=i < n_blk)

        # q tile -> int8 in shared memory (the A operand of every Q K^T), while the first loads land
        rows = start_m + gl.arange(0, BM, layout=gl.SliceLayout(1, ld_layout))
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, ld_layout))
        q_ptrs = (Q + b.to(gl.int64) * stride_qb + h * stride_qh + gl.expand_dims(rows, 1) * stride_qs
                  + gl.expand_dims(offs_d, 0))
        q_ok = gl.expand_dims(rows < Sq, 1)
        if QFUSED:
            qf = gl.load(q_ptrs, mask=q_ok, other=0.0).to(gl.float32)
            sq = gl.maximum(gl.max(gl.max(gl.abs(qf), 1), 0), 1e-30) / 127.0
            qy = qf * (1.0 / sq)
            qy = gl.where(qy >= 0, qy + 0.5, qy - 0.5).to(gl.int32)  # round half away from zero, as quantize
            q_smem.store(qy.to(gl.int8))
        else:
            q_smem.store(gl.load(q_ptrs, mask=q_ok, other=0))
            sq = gl.load(QS + bh.to(gl.int64) * nqb + start_m // QBLK)  # q8's scales are per 128 rows
        fence_async_shared()
        gl.thread_barrier()
        cq = sq * qk_scale
        ks_base = KS + bhk * nkb

        s_init = gl.full([BM, BN], _MAGIC_BITS, gl.int32, s_layout)
        m_i = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_layout))
        o = gl.zeros([BM, D], gl.float32, o_layout)

        # block 0: Q K_0^T synchronously, its softmax; P_0 V_0 is issued in step 1 (or the tail)
        mbarrier.wait(ready.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_init)
        c = cq * gl.load(ks_base)
        if Sk < BN:
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, c, 0, Sk, s_layout, BN, LOG2_PS, True)
        else:
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, c, 0, Sk, s_layout, BN, LOG2_PS, False)

        n_full = Sk // BN
        for j in range(1, n_blk):
            slot = j % STAGES
            prev = (j - 1) % STAGES
            c = cq * gl.load(ks_base + j)
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_init, is_async=True)
            # P_{j-1} is carried as fp32 and cast here, under Q K_j^T: a loop-carried e4m3 operand is kept as one
            # byte per register and re-packed every step (~190 PRMT/LOP3 per thread, offline SASS)
            p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
            o_tok = warpgroup_mma(p8, v_smem.index(prev).permute((1, 0)), o, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s_tok])
            if j < n_full:
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, c, j * BN, Sk, s_layout, BN, LOG2_PS, False)
            else:
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, c, j * BN, Sk, s_layout, BN, LOG2_PS, True)
            # (p8 cannot be a dep: 3.6's wait lowering takes 32/16-bit values only; ptxas keeps the registers of
            # an in-flight wgmma's A operand live until its wait_group)
            o = warpgroup_mma_wait(0, deps=[o_tok])
            o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            # block j-1's slot is free once both warpgroups passed their wait(0): refill it with block j-1+STAGES
            gl.thread_barrier()
            nxt = j - 1 + STAGES
            mbarrier.expect(ready.index(prev), TILE_BYTES, pred=nxt < n_blk)
            tma.async_copy_global_to_shared(k_desc, [nxt * BN, 0], ready.index(prev), k_smem.index(prev),
                                            pred=nxt < n_blk)
            tma.async_copy_global_to_shared(v_desc, [0, nxt * BN], ready.index(prev), v_smem.index(prev),
                                            pred=nxt < n_blk)
        p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
        o = warpgroup_mma(p8, v_smem.index((n_blk - 1) % STAGES).permute((1, 0)), o)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

        # epilogue: O = acc * s_v / l (l carries P's 2^LOG2_PS, so does acc)
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        sv = gl.load(VS + bhk * D + gl.arange(0, D, layout=gl.SliceLayout(0, o_layout)))
        out = o * gl.expand_dims(1.0 / l_o, 1) * gl.expand_dims(sv, 0)
        out = gl.convert_layout(out.to(O.dtype.element_ty), ld_layout)
        o_ptrs = (O + b.to(gl.int64) * stride_ob + h * stride_oh + gl.expand_dims(rows, 1) * stride_os
                  + gl.expand_dims(offs_d, 0))
        gl.store(o_ptrs, out, mask=q_ok)
        if WRITE_LSE:
            lse_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
            lse = (gl.convert_layout(m_i, lse_layout) + gl.log2(gl.convert_layout(l_i, lse_layout)) - LOG2_PS) * _LN2
            r = start_m + gl.arange(0, BM, layout=lse_layout)
            gl.store(LSE + bh.to(gl.int64) * Sq + r, lse, mask=r < Sq)


    # ------------------------------------------------------------------------------------------------------------
    # Warp-specialised variant (cfg ws=True): the two 64-row warpgroups are separate partitions and a 1-warp
    # producer partition runs the TMA ring. Slots are released by an mbarrier per slot (one arrive per consumer
    # warpgroup) instead of a CTA barrier, so the warpgroups are not forced into lockstep (one warpgroup's softmax
    # can run under the other's MMAs) and the Triton-inserted CTA barriers around the TMA issue leave the loop.
    # ------------------------------------------------------------------------------------------------------------
    @gluon.jit
    def _ws_producer(k_desc, v_desc, k_smem, v_smem, ready, empty, n_blk,
                     BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
        TILE_BYTES: gl.constexpr = BN * D + D * BN
        for j in range(n_blk):
            slot = j % STAGES
            # block j reuses the slot of block j - STAGES: wait for its release (both consumers arrived)
            mbarrier.wait(empty.index(slot), ((j // STAGES) + 1) & 1, pred=j >= STAGES)
            mbarrier.expect(ready.index(slot), TILE_BYTES)
            tma.async_copy_global_to_shared(k_desc, [j * BN, 0], ready.index(slot), k_smem.index(slot))
            tma.async_copy_global_to_shared(v_desc, [0, j * BN], ready.index(slot), v_smem.index(slot))

    @gluon.jit
    def _ws_consumer(q_sm, k_smem, v_smem, ready, empty, ks_base, VS, O, LSE, cq, row0, b, h, bh, bhk, Sq, Sk,
                     n_blk, stride_ob, stride_os, stride_oh,
                     D: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, WRITE_LSE: gl.constexpr,
                     LOG2_PS: gl.constexpr):
        """One warpgroup: 64 q rows from row0, all key blocks; writes its rows of O (and LSE)."""
        NW: gl.constexpr = gl.num_warps()
        RM: gl.constexpr = 16 * NW
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                           instr_shape=[16, BN, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                           instr_shape=[16, D, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        s_init = gl.full([RM, BN], _MAGIC_BITS, gl.int32, s_layout)
        m_i = gl.full([RM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([RM], gl.float32, gl.SliceLayout(1, s_layout))
        o = gl.zeros([RM, D], gl.float32, o_layout)

        mbarrier.wait(ready.index(0), 0)
        s = warpgroup_mma(q_sm, k_smem.index(0).permute((1, 0)), s_init)
        c = cq * gl.load(ks_base)
        if Sk < BN:
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, c, 0, Sk, s_layout, BN, LOG2_PS, True)
        else:
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, c, 0, Sk, s_layout, BN, LOG2_PS, False)
        n_full = Sk // BN
        for j in range(1, n_blk):
            slot = j % STAGES
            prev = (j - 1) % STAGES
            c = cq * gl.load(ks_base + j)
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            s_tok = warpgroup_mma(q_sm, k_smem.index(slot).permute((1, 0)), s_init, is_async=True)
            p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
            o_tok = warpgroup_mma(p8, v_smem.index(prev).permute((1, 0)), o, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s_tok])
            if j < n_full:
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, c, j * BN, Sk, s_layout, BN, LOG2_PS, False)
            else:
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, c, j * BN, Sk, s_layout, BN, LOG2_PS, True)
            o = warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(empty.index(prev))  # K_{j-1} and V_{j-1} no longer read by this warpgroup
            o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
        o = warpgroup_mma(p8, v_smem.index((n_blk - 1) % STAGES).permute((1, 0)), o)

        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        sv = gl.load(VS + bhk * D + gl.arange(0, D, layout=gl.SliceLayout(0, o_layout)))
        out = (o * gl.expand_dims(1.0 / l_o, 1) * gl.expand_dims(sv, 0)).to(O.dtype.element_ty)
        rows = row0 + gl.arange(0, RM, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = (O + b.to(gl.int64) * stride_ob + h * stride_oh + gl.expand_dims(rows, 1) * stride_os
                  + gl.expand_dims(cols, 0))
        gl.store(o_ptrs, out, mask=gl.expand_dims(rows < Sq, 1))
        if WRITE_LSE:
            lse = (m_i + gl.log2(l_i) - LOG2_PS) * _LN2
            r = row0 + gl.arange(0, RM, layout=gl.SliceLayout(1, s_layout))
            gl.store(LSE + bh.to(gl.int64) * Sq + r, lse, mask=r < Sq)

    @gluon.jit
    def _fp8_gluon_ws_kernel(Q, QS, K8, KS, VT8, VS, O, LSE,
                             stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh,
                             Sq, Sk, Sk_pad, Hq, Hk, n_rep, nqb, nkb, qk_scale,
                             D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                             QFUSED: gl.constexpr, WRITE_LSE: gl.constexpr, LOG2_PS: gl.constexpr,
                             CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                             num_warps: gl.constexpr):
        """As `_fp8_gluon_fwd_kernel` (same arguments), launched with num_warps=4: the default partition is the
        warpgroup of rows [0, 64) of the tile, worker 0 (4 warps) rows [64, 128), worker 1 (1 warp) the loads."""
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
        b = bh // Hq
        h = bh % Hq
        bhk = (b * Hk + h // n_rep).to(gl.int64)
        start_m = pid_m * BM
        HALF: gl.constexpr = BM // 2
        TD: gl.constexpr = D // 8
        ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TD, TD], [num_warps, 1], [1, 0])
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], gl.int8)
        k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.int8)
        v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([D, BN], gl.float8e4nv)
        k_desc = tma.make_tensor_descriptor(K8 + bhk * Sk * D, shape=[Sk, D], strides=[D, 1],
                                            block_shape=[BN, D], layout=k_sl)
        v_desc = tma.make_tensor_descriptor(VT8 + bhk * D * Sk_pad, shape=[D, Sk], strides=[Sk_pad, 1],
                                            block_shape=[D, BN], layout=v_sl)
        q_smem = gl.allocate_shared_memory(gl.int8, [BM, D], q_sl)
        k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BN, D], k_sl)
        v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, D, BN], v_sl)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrive per consumer warpgroup
        fence_async_shared()

        rows = start_m + gl.arange(0, BM, layout=gl.SliceLayout(1, ld_layout))
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, ld_layout))
        q_ptrs = (Q + b.to(gl.int64) * stride_qb + h * stride_qh + gl.expand_dims(rows, 1) * stride_qs
                  + gl.expand_dims(offs_d, 0))
        q_ok = gl.expand_dims(rows < Sq, 1)
        if QFUSED:
            qf = gl.load(q_ptrs, mask=q_ok, other=0.0).to(gl.float32)
            sq = gl.maximum(gl.max(gl.max(gl.abs(qf), 1), 0), 1e-30) / 127.0
            qy = qf * (1.0 / sq)
            qy = gl.where(qy >= 0, qy + 0.5, qy - 0.5).to(gl.int32)
            q_smem.store(qy.to(gl.int8))
        else:
            q_smem.store(gl.load(q_ptrs, mask=q_ok, other=0))
            sq = gl.load(QS + bh.to(gl.int64) * nqb + pid_m)
        fence_async_shared()
        gl.thread_barrier()
        cq = sq * qk_scale
        ks_base = KS + bhk * nkb
        n_blk = gl.cdiv(Sk, BN)
        q0 = q_smem.slice(0, HALF)
        q1 = q_smem.slice(HALF, HALF)
        gl.warp_specialize([
            (_ws_consumer, (q0, k_smem, v_smem, ready, empty, ks_base, VS, O, LSE, cq, start_m, b, h, bh, bhk,
                            Sq, Sk, n_blk, stride_ob, stride_os, stride_oh, D, BN, STAGES, WRITE_LSE, LOG2_PS)),
            (_ws_consumer, (q1, k_smem, v_smem, ready, empty, ks_base, VS, O, LSE, cq, start_m + HALF, b, h, bh,
                            bhk, Sq, Sk, n_blk, stride_ob, stride_os, stride_oh, D, BN, STAGES, WRITE_LSE,
                            LOG2_PS)),
            (_ws_producer, (k_desc, v_desc, k_smem, v_smem, ready, empty, n_blk, BN, D, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def gluon_fp8_supported(q) -> bool:
    """True when the Gluon fp8 kernel runs q: Gluon present, CUDA compute capability 9.x (wgmma; not 10.x),
    4-D fp16/bf16 (or int8 pre-quantized) q with head dim 64 or 128."""
    return (HAS_GLUON and isinstance(q, torch.Tensor) and q.dim() == 4 and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16, torch.int8) and q.shape[-1] in (64, 128)
            and torch.cuda.get_device_capability(q.device)[0] == 9)


def _check(q, qs, k8, ks, vt8, vs, Sk):
    if q.dim() != 4 or k8.dim() != 4 or vt8.dim() != 4:
        raise ValueError(f"q, k8, vt8 must be 4-D, got {tuple(q.shape)}, {tuple(k8.shape)}, {tuple(vt8.shape)}")
    D = q.shape[-1]
    if D not in (64, 128):
        raise ValueError(f"q: head dim must be 64 or 128, got {D}")
    if k8.dtype != torch.int8:
        raise ValueError(f"k8 must be int8 (dense.quantize_fp8(..., 'int8')), got {k8.dtype}")
    if vt8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"vt8 must be float8_e4m3fn, got {vt8.dtype}")
    B, Hk, Sk8, Dk = k8.shape
    if Dk != D or Sk8 != Sk:
        raise ValueError(f"k8 {tuple(k8.shape)} must be (B, Hk, Sk={Sk}, D={D})")
    if tuple(vt8.shape[:3]) != (B, Hk, D) or vt8.shape[3] < Sk or vt8.shape[3] % 16:
        raise ValueError(f"vt8 {tuple(vt8.shape)} must be (B, Hk, D, Sk rounded up to 16)")
    nkb = -(-Sk // BLOCK)
    if tuple(ks.shape) != (B, Hk, nkb) or ks.dtype != torch.float32:
        raise ValueError(f"ks must be fp32 {(B, Hk, nkb)}, got {ks.dtype} {tuple(ks.shape)}")
    if tuple(vs.shape) != (B, Hk, D) or vs.dtype != torch.float32:
        raise ValueError(f"vs must be fp32 {(B, Hk, D)}, got {vs.dtype} {tuple(vs.shape)}")
    if q.dtype == torch.int8:
        Bq, Hq, Sq, _ = q.shape
        if qs is None or tuple(qs.shape) != (B, Hq, -(-Sq // BLOCK)) or qs.dtype != torch.float32:
            raise ValueError("qs must be the fp32 (B, Hq, ceil(Sq/128)) scales of an int8 q (B, Hq, Sq, D)")
    elif q.dtype in (torch.float16, torch.bfloat16):
        Bq, Sq, Hq, _ = q.shape
        if qs is not None:
            raise ValueError("qs must be None when q is fp16/bf16 (q is quantized inside the kernel)")
        if q.stride(-1) != 1:
            raise ValueError("q: the head dim must be contiguous (stride 1)")
    else:
        raise ValueError(f"q must be int8 (quantized) or fp16/bf16, got {q.dtype}")
    if Bq != B or Hq % Hk:
        raise ValueError(f"q batch {Bq} / heads {Hq} must match k8's batch {B} and be a multiple of its heads {Hk}")
    for name, t in (("k8", k8), ("vt8", vt8), ("ks", ks), ("vs", vs)) + ((("q", q), ("qs", qs)) if q.dtype ==
                                                                          torch.int8 else ()):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (as dense.quantize_fp8 returns it)")
    if not q.is_cuda:
        raise ValueError(f"q must be a CUDA tensor on a Hopper GPU, got {q.device}")
    return B, Sq, Hq, Hk, D


def attention_fp8_gluon_quantized(q, qs, k8, ks, vt8, vs, *, Sk, causal=False, scale=None, return_lse=False,
                                  out_dtype=torch.bfloat16, cfg=None):
    """Gluon fp8 attention on `dense.quantize_fp8(q, k, v, "int8", ...)` outputs -> out (B, Sq, Hq, D) out_dtype
    [, lse (B, Hq, Sq) fp32, natural log].

    q: either the int8 q8 (B, Hq, Sq, D) with qs (B, Hq, ceil(Sq/128)) fp32 (quantize_q=True), or the fp16/bf16 q
    (B, Sq, Hq, D) itself with qs=None (quantize_q=False; q is quantized in the kernel per 128-row tile, the same
    blocks and rounding as quantize_fp8: no q8 round trip, the faster form). k8 int8 (B, Hk, Sk, D), ks fp32
    (B, Hk, ceil(Sk/128)), vt8 e4m3 (B, Hk, D, Sk_pad16), vs fp32 (B, Hk, D). Non-causal only (causal=True raises
    ValueError); head dim 64 / 128; GQA by Hq % Hk == 0. cfg: keys of GLUON_FP8_CONFIG."""
    if causal:
        raise ValueError("causal=True is not implemented by the Gluon fp8 kernel (non-causal only); "
                         "use dense.attention_fp8 for causal")
    if not HAS_GLUON:
        raise ValueError("attention_fp8_gluon needs Triton with Gluon (triton.experimental.gluon)")
    unknown = sorted(set(cfg or {}) - set(GLUON_FP8_CONFIG))
    if unknown:
        raise ValueError(f"cfg: unknown keys {unknown} (known: {sorted(GLUON_FP8_CONFIG)})")
    cfg = dict(GLUON_FP8_CONFIG, **(cfg or {}))
    bm = int(cfg["block_m"])
    if bm not in (64, 128) or (cfg["ws"] and bm != 128):
        raise ValueError(f"cfg: block_m must be 64 or 128 (128 with ws=True), got {bm}")
    B, Sq, Hq, Hk, D = _check(q, qs, k8, ks, vt8, vs, int(Sk))
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dev = k8.device
    out = torch.empty((B, Sq, Hq, D), dtype=out_dtype, device=dev)
    lse = (torch.empty((B, Hq, Sq), dtype=torch.float32, device=dev) if return_lse
           else torch.empty((1,), dtype=torch.float32, device=dev))
    qfused = q.dtype != torch.int8
    qstr = (q.stride(0), q.stride(1), q.stride(2)) if qfused else (q.stride(0), q.stride(2), q.stride(1))
    from ._triton_common import set_tma_allocator
    set_tma_allocator()
    grid = (triton.cdiv(Sq, BLOCK if cfg["ws"] else bm), B * Hq)
    args = (q, qs if qs is not None else ks, k8, ks, vt8, vs, out, lse, *qstr,
            out.stride(0), out.stride(1), out.stride(2),
            Sq, int(Sk), vt8.shape[-1], Hq, Hk, Hq // Hk, qs.shape[-1] if qs is not None else 1, ks.shape[-1],
            scale * LOG2E)
    meta = dict(D=D, BM=BLOCK, BN=BLOCK, STAGES=int(cfg["stages"]), QFUSED=qfused, WRITE_LSE=bool(return_lse),
                LOG2_PS=LOG2_P_SCALE)
    if cfg["ws"]:
        _fp8_gluon_ws_kernel[grid](*args, **meta, CONSUMER_REGS=int(cfg["consumer_regs"]),
                                   PRODUCER_REGS=int(cfg["producer_regs"]), num_warps=4)
    else:
        meta["BM"] = bm
        _fp8_gluon_fwd_kernel[grid](*args, **meta, num_warps=bm // 16)
    return (out, lse) if return_lse else out


def attention_fp8_gluon(q, k, v, *, causal: bool = False, scale=None, return_lse: bool = False, cfg=None):
    """End to end: q (B, Sq, Hq, D), k/v (B, Sk, Hk, D) fp16/bf16 CUDA -> out (B, Sq, Hq, D) in q's dtype
    [, lse]. k/v quantized by `dense.quantize_fp8(..., "int8", quantize_q=False)` (timed as part of the call),
    q inside the kernel."""
    from . import dense
    if not gluon_fp8_supported(q) or q.dtype == torch.int8:
        raise ValueError("attention_fp8_gluon needs fp16/bf16 CUDA q with head dim 64/128 on an sm_90 GPU and "
                         f"Triton with Gluon, got {q.dtype} {tuple(q.shape)} on {q.device}")
    _, _, k8, ks, vt8, vs = dense.quantize_fp8(q, k, v, "int8", quantize_q=False)
    return attention_fp8_gluon_quantized(q, None, k8, ks, vt8, vs, Sk=k.shape[1], causal=causal, scale=scale,
                                         return_lse=return_lse, out_dtype=q.dtype, cfg=cfg)


__all__ = ["attention_fp8_gluon", "attention_fp8_gluon_quantized", "gluon_fp8_supported", "GLUON_FP8_CONFIG"]
