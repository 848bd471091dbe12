"""fp8 dense attention forward (inference, Hopper, head dim 64 / 128): int8 (or e4m3) Q K^T and e4m3 P V with
per-block q/k scales and per-channel v scales, the inputs quantized inside the call; plus the CPU emulation of the
quantization (`quantize_fp8_reference`). Layout as every dense backend: q (B, Sq, Hq, D), k/v (B, Sk, Hk, D).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._common import LaunchPlans, interpret, key_range, set_tma_allocator
from .reference import LOG2E, check_qkv
from .splitd import LN2_C, unit_stride

# ----------------------------------------------------------------------------------------------------------------
# fp8 (e4m3) forward, head dim 64 / 128 (Hopper)
# ----------------------------------------------------------------------------------------------------------------
# The op quantizes its bf16/fp16 inputs itself:
#   q, k: per block of FP8_BLOCK rows of one head, scale = amax / 448 (stored fp32, (B, H, ceil(S / FP8_BLOCK))),
#         written head-major (B, H, S, D) so one TMA box is one block;
#   v:    per channel (one scale per (b, kv head, d) over the whole sequence: V's outliers are channel-wise),
#         written transposed (B, Hk, D, Sk_pad16): Hopper's fp8 wgmma wants the B operand K-major, and for P @ V
#         the contraction runs over keys, so V^T rows must be contiguous in keys. The transpose is done here, in
#         the quantize pass, and its time is part of `attention_fp8`.
# In the kernel S = (q8 . k8) * s_q * s_k (the scales and scale*log2(e) are one scalar per k-block), P in [0, 1]
# is cast as P * 256 to e4m3 (no subnormal flush of small probabilities; the 256 is an exponent offset inside the
# exp2, and l carries it too), and O = acc * s_v / l.

FP8_MAX = 448.0
FP8_BLOCK = 128  # rows per q/k scale; the kernel's BLOCK_N and default BLOCK_M
FP8_LOG2_P_SCALE = 8.0  # P is cast to e4m3 as P * 2^8 (max 256 < 448)
FP8_INV_MAX_C = tl.constexpr(float.fromhex("0x1.24924ap-9"))  # fp32(1 / 448), exactly representable
# Scales and rounding are defined so that `quantize_fp8_reference` (torch, any device) reproduces every kernel's q8 /
# k8 / v8 and scales bit for bit: scale = max(amax, 1e-30) * fp32(1 / fmax) (one rounded multiply, what torch's
# CUDA `amax / fmax` does), y = x * RN(1 / scale) (IEEE reciprocal: `div_rn`, not the approximate `/`), the
# multiply through `mul.rn.f32` so that the compiler cannot contract it with the +-0.5 of the int8 rounding into
# an FMA (an exact product + 0.5 rounds once, torch's twice). Why bit for bit matters: bf16 inputs put ~15
# elements per 64 x 128 block at exactly amax / 2 (y = 63.5, a rounding tie), so a 1-ulp difference in the
# reciprocal flips the int8 value of a few % of rows (the fp8 skip GPU test, round 2: 3.6% of rows).
_RN_ASM = tl.constexpr(not interpret())  # the interpreter has no inline asm; numpy rounds every multiply anyway
# Warp specialisation, fp16x2 exp2 (fp8 runs 1-3), a folded int8 conversion, two key blocks per iteration, a
# register cap (session 6) were measured neutral or slower, or lost accuracy, and deleted (benchmarks/NOTES.md).
# Launch settings (cfg of attention_fp8): 64-row programs of one warpgroup, two per SM (fp8 session 6: -4 to -12%
# kernel time at 4K-8K vs 128-row programs of two warpgroups, which meet at a CTA barrier every k-block).
FP8_CONFIG = dict(num_warps=4, num_stages=3, fuse_q=True, block_m=64)


def fp32_inv(fmax: float) -> float:
    """fp32(1 / fmax) as a Python float (exactly representable: the kernels' fp32 constant and torch's scalar)."""
    return torch.tensor(1.0 / fmax, dtype=torch.float32).item()


@triton.jit
def _mul_rn(x, y):
    """x * y (fp32, same shape) rounded once, never contracted into an FMA with a following add."""
    if _RN_ASM:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [x, y], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return x * y


@triton.jit
def _recip_rn(x):
    """1 / x rounded to nearest (IEEE, as torch's `1.0 / tensor`; Triton's `/` on fp32 is approximate)."""
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), x)


@triton.jit
def _quant_tile(x, QINV: tl.constexpr, INT8: tl.constexpr):
    """One scale for the fp32 tile x: -> (y, scale), scale = max(amax, 1e-30) * QINV (QINV = fp32(1 / fmax)), y =
    x * RN(1 / scale) (fp32; INT8: rounded half away from zero, int32). Bit for bit `quantize_fp8_reference`."""
    sc = tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), 1e-30) * QINV
    y = _mul_rn(x, tl.zeros_like(x) + _recip_rn(sc))
    if INT8:  # the int8 cast truncates: round half away from zero first
        y = tl.where(y >= 0, y + 0.5, y - 0.5).to(tl.int32)
    return y, sc


@triton.jit
def _fp8_quant_block(X, Y, SC, b, h, bh, blk, stride_b, stride_s, stride_h, S, n_blk,
                     D: tl.constexpr, BLK: tl.constexpr, QINV: tl.constexpr, INT8: tl.constexpr):
    """Rows [blk * BLK, +BLK) of head h of X (B, S, H, D) -> Y (B, H, S, D) e4m3 (or int8, rounded to nearest) and
    the block's scale amax * QINV at SC[bh * n_blk + blk] (`_quant_tile`)."""
    rows = blk * BLK + tl.arange(0, BLK)
    offs_d = tl.arange(0, D)
    ok = (rows < S)[:, None]
    ptrs = X + b * stride_b + h * stride_h + rows[:, None] * stride_s + offs_d[None, :]
    x = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    y, sc = _quant_tile(x, QINV, INT8)
    y = y.to(Y.dtype.element_ty)
    y_ptrs = Y + (bh.to(tl.int64) * S + rows[:, None]) * D + offs_d[None, :]
    tl.store(y_ptrs, y, mask=ok)
    tl.store(SC + bh.to(tl.int64) * n_blk + blk, sc)


@triton.jit
def _fp8_quant_kqv_kernel(K, V, Q, K8, KS, VAMAX, Q8, QS, stride_kb, stride_ks, stride_kh,
                          stride_vb, stride_vs, stride_vh, stride_qb, stride_qs, stride_qh,
                          Sk, Sq, Hk, Hq, nkb, nqb, n_k_tasks,
                          D: tl.constexpr, BLK: tl.constexpr, QINV: tl.constexpr, INT8: tl.constexpr):
    """One launch for everything `quantize_fp8` can do before V's scales are known. Program t < n_k_tasks: key
    block (t % nkb) of (batch, kv head) t // nkb -> k8 + its scale, and the per-channel amax of the same V rows,
    merged into VAMAX (B, Hk, D) (zeroed by the caller) by an atomic max on the fp32 bits as int32 (|v| >= 0, so
    the integer order of the bits is the float order). Later programs: the q blocks (when there are any).
    Program t takes block t // (B Hk) of head t % (B Hk) (heads fastest: the programs resident at one time spread
    their V amax atomics over every head's D words; measured as fast as blocks-fastest, fp8 skip round 2). The
    outputs do not depend on the order (integer atomic max)."""
    t = tl.program_id(0)
    if t < n_k_tasks:
        nbh = n_k_tasks // nkb
        blk = t // nbh
        bh = t % nbh
        b = (bh // Hk).to(tl.int64)
        h = bh % Hk
        rows = blk * BLK + tl.arange(0, BLK)
        offs_d = tl.arange(0, D)
        # V's loads are issued before K's block is processed: both 32 KB reads in flight at once
        v_ptrs = V + b * stride_vb + h * stride_vh + rows[:, None] * stride_vs + offs_d[None, :]
        xv = tl.load(v_ptrs, mask=(rows < Sk)[:, None], other=0.0)
        _fp8_quant_block(K, K8, KS, b, h, bh, blk, stride_kb, stride_ks, stride_kh, Sk, nkb, D, BLK, QINV, INT8)
        amax = tl.max(tl.abs(xv.to(tl.float32)), 0)
        tl.atomic_max(VAMAX + bh.to(tl.int64) * D + offs_d, amax.to(tl.int32, bitcast=True), sem="relaxed")
    else:
        t -= n_k_tasks
        blk = t % nqb
        bh = t // nqb
        _fp8_quant_block(Q, Q8, QS, (bh // Hq).to(tl.int64), bh % Hq, bh, blk, stride_qb, stride_qs, stride_qh, Sq,
                         nqb, D, BLK, QINV, INT8)


@triton.jit
def _fp8_quant_vt_kernel(X, Y, SC, VAMAX, stride_b, stride_s, stride_h, S, S_pad, H, nblk,
                         D: tl.constexpr, BS: tl.constexpr):
    """V (B, S, H, D) -> e4m3 V^T rows Y[(bh * D + d) * S_pad + s] (B, H, D, S_pad), columns >= S zero, with the per-
    channel scales SC (B, H, D), computed here from the channel amax bits VAMAX as max(amax, 1e-30) * fp32(1 /
    448) (the bits of torch's CUDA `amax / 448.0`, which multiplies by the fp32 reciprocal: an IEEE division
    differs in the last bit often enough to flip ~0.1% of the e4m3 roundings, fp8 session 6 run 1); the program
    of block 0 of each head stores them to SC. 1-D grid of (B H) x nblk programs of BS keys, blocks fastest
    within a head. The tile is indexed (d, s) from the start: the load is vectorised along d, the store along s
    (16 keys per thread), and the compiler's layout change between them goes through shared memory (offline
    sm_90: 40 registers, 32 KB shared at D128: up to 6 programs of 8 warps per SM)."""
    t = tl.program_id(0)
    bh = t // nblk
    blk = t % nblk
    b = (bh // H).to(tl.int64)
    h = bh % H
    offs_d = tl.arange(0, D)
    amax = tl.load(VAMAX + bh.to(tl.int64) * D + offs_d).to(tl.float32, bitcast=True)
    sc = tl.maximum(amax, 1e-30) * FP8_INV_MAX_C
    if blk == 0:
        tl.store(SC + bh.to(tl.int64) * D + offs_d, sc)
    inv = _recip_rn(sc)
    rows = blk * BS + tl.arange(0, BS)
    ptrs = X + b * stride_b + h * stride_h + rows[None, :] * stride_s + offs_d[:, None]
    x = tl.load(ptrs, mask=(rows < S)[None, :], other=0.0)
    y = _mul_rn(x.to(tl.float32), tl.zeros([D, BS], tl.float32) + inv[:, None]).to(Y.dtype.element_ty)
    # The store mask is s < S_pad, a multiple of 16: the compiler proves each thread's 16-key run all in or all out
    # and stores 16-byte vectors (columns S..S_pad-1 get the zeros of the masked load). With the mask s < S and
    # S % 16 != 0 (e.g. 32760) every run became 16 one-byte stores over 4 rows of V^T (offline sm_90 SASS: 64
    # STG.E.U8 per thread instead of 4 STG.E.128): 0.29 ms for the quantize pass at S32760 on H200, vs 0.154 ms
    # on H100 for the same bytes at S8192 (fp8 sessions 6 / skip round 2).
    tl.store(Y + (bh.to(tl.int64) * D + offs_d[:, None]) * S_pad + rows[None, :], y, mask=(rows < S_pad)[None, :])


@triton.jit
def _qk_scores(q, k, QK_ACC: tl.constexpr):
    """q . k^T as fp32. int8 operands: the int32 sums (|x| < 2^21 for D <= 128, so exact) are converted by adding
    the bits of 1.5 * 2^23, reinterpreting and subtracting, instead of I2F (a quarter-rate instruction, 64 per
    thread per k-block): end to end 6-8% faster at 16K/32K than the plain conversion (fp8 runs 3 and 4, NOTES)."""
    s = tl.dot(q, tl.trans(k), out_dtype=QK_ACC)
    if QK_ACC == tl.int32:
        s = (s + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    return s


@triton.jit
def _fp8_fwd_kernel(Q8, K8, VT8, QS, KS, VS, O, LSE, stride_ob, stride_os, stride_oh,
                    Sq, Sk, Sk_pad, Hq, Hk, n_rep, nqb, nkb, qk_scale, causal_off,
                    stride_qb, stride_qs, stride_qh,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                    WRITE_LSE: tl.constexpr, LOG2_PS: tl.constexpr, QK_ACC: tl.constexpr, QFUSED: tl.constexpr,
                    QINV: tl.constexpr, QBLK: tl.constexpr):
    """One (BLOCK_M rows, query head) tile. QFUSED: Q8 is the fp16/bf16 q (B, Sq, Hq, D) itself, quantized here
    (one scale per tile: the blocks of `quantize_fp8` when BLOCK_M = 128), saving the separate pass over q.
    Otherwise Q8 is q8 (B, Hq, Sq, D) with one scale per QBLK rows. BLOCK_M 64 (4 warps, one warpgroup): two
    independent programs per SM, so one's softmax can overlap the other's wgmma (a 128-row program's two
    warpgroups meet at a CTA barrier every k-block: its tensor cores idle during the softmax)."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    bhk = (b * Hk + h // n_rep).to(tl.int64)
    start_m = pid_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    k_desc = tl.make_tensor_descriptor(K8 + bhk * Sk * D, shape=[Sk, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    v_desc = tl.make_tensor_descriptor(VT8 + bhk * D * Sk_pad, shape=[D, Sk], strides=[Sk_pad, 1],
                                       block_shape=[D, BLOCK_N])
    if QFUSED:
        qf = tl.load(Q8 + b.to(tl.int64) * stride_qb + h * stride_qh + rows[:, None] * stride_qs + offs_d[None, :],
                     mask=(rows < Sq)[:, None], other=0.0).to(tl.float32)
        qy, sq = _quant_tile(qf, QINV, QK_ACC == tl.int32)
        q = qy.to(K8.dtype.element_ty)
        cq = sq * qk_scale
    else:
        q_desc = tl.make_tensor_descriptor(Q8 + bh.to(tl.int64) * Sq * D, shape=[Sq, D], strides=[D, 1],
                                           block_shape=[BLOCK_M, D])
        q = q_desc.load([start_m, 0])
        cq = tl.load(QS + bh.to(tl.int64) * nqb + start_m // QBLK) * qk_scale
    ks_base = KS + bhk * nkb
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    hi, hi_full = key_range(start_m, Sk, causal_off, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in tl.range(0, hi_full, BLOCK_N):
        k = k_desc.load([start_n, 0])
        vt = v_desc.load([0, start_n])
        c = cq * tl.load(ks_base + start_n // BLOCK_N)
        s = _qk_scores(q, k, QK_ACC)
        m_new = tl.maximum(m_i, tl.max(s, 1) * c)
        # P is produced already scaled by 2^LOG2_PS (exponent offset, no multiply); l carries the same factor.
        p = tl.math.exp2(s * c - (m_new - LOG2_PS)[:, None])
        l_i = l_i * tl.math.exp2(m_i - m_new) + tl.sum(p, 1)
        alpha = tl.math.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(vt.dtype), tl.trans(vt), acc)
        m_i = m_new
    for start_n in tl.range(hi_full, hi, BLOCK_N, num_stages=1):
        k = k_desc.load([start_n, 0])
        vt = v_desc.load([0, start_n])
        c = cq * tl.load(ks_base + start_n // BLOCK_N)
        cols = start_n + offs_n
        valid = (cols < Sk)[None, :]
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None] + causal_off)
        s = tl.where(valid, _qk_scores(q, k, QK_ACC) * c, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - (m_use - LOG2_PS)[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(vt.dtype), tl.trans(vt), acc)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    sv = tl.load(VS + bhk * D + offs_d)
    out = acc * (1.0 / l_safe)[:, None] * sv[None, :]
    row_ok = rows < Sq
    o_ptrs = O + b.to(tl.int64) * stride_ob + h * stride_oh + rows[:, None] * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe) - LOG2_PS) * LN2_C)
        tl.store(LSE + bh.to(tl.int64) * Sq + rows, lse, mask=row_ok)


def fp8_supported(q) -> bool:
    """True when `attention_fp8` runs q: CUDA compute capability >= 8.9 (e4m3 tensor cores; TMA needs 9.0),
    fp16/bf16, head dim 64 or 128."""
    return (q.dim() == 4 and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in (64, 128)
            and torch.cuda.get_device_capability(q.device)[0] >= 9 and hasattr(tl, "make_tensor_descriptor"))


QK_FORMATS = ("int8", "e4m3")
_QMAX = {"int8": 127.0, "e4m3": FP8_MAX}
_QINV = {f: fp32_inv(m) for f, m in _QMAX.items()}  # the kernels' QINV constexprs and the model's multipliers


_VT_BS = 128  # keys per V^T block: 128-byte rows of V^T per store

def quantize_fp8(q, k, v, qk_format: str = "int8", quantize_q: bool = True):
    """Quantize for `attention_fp8`: -> (q8 (B, Hq, Sq, D), q_scale (B, Hq, ceil(Sq/128)), k8, k_scale (same for
    k), vt8 (B, Hk, D, Sk rounded up to 16), v_scale (B, Hk, D)); fp32 scales (dequant = x8 * scale). q8/k8 are
    int8 (qk_format "int8", scale amax/127) or e4m3 ("e4m3", amax/448); vt8 is always e4m3. quantize_q=False:
    q8 and q_scale are None (the kernel quantizes q itself).

    Two launches: k blocks + V's per-channel amax (atomic max) + q blocks, then the V^T pass, which needs the amax
    over the whole sequence. Every output equals `quantize_fp8_reference`'s rounding bit for bit; vt8 columns >=
    Sk (padding up to a multiple of 16) are zero."""
    B, Sq, Sk, Hq, Hk, D = check_qkv(q, k, v)
    q, k, v = (unit_stride(t) for t in (q, k, v))
    if qk_format not in QK_FORMATS:
        raise ValueError(f"qk_format must be one of {QK_FORMATS}, got {qk_format!r}")
    dev, f8 = q.device, torch.float8_e4m3fn
    qk_dt = torch.int8 if qk_format == "int8" else f8
    int8 = qk_format == "int8"
    nqb, nkb = triton.cdiv(Sq, FP8_BLOCK), triton.cdiv(Sk, FP8_BLOCK)
    q8 = torch.empty((B, Hq, Sq, D), dtype=qk_dt, device=dev) if quantize_q else None
    qs = torch.empty((B, Hq, nqb), dtype=torch.float32, device=dev) if quantize_q else None
    k8 = torch.empty((B, Hk, Sk, D), dtype=qk_dt, device=dev)
    ks = torch.empty((B, Hk, nkb), dtype=torch.float32, device=dev)
    s_pad = -(-Sk // 16) * 16
    vt = torch.empty((B, Hk, D, s_pad), dtype=f8, device=dev)
    vamax = torch.zeros((B, Hk, D), dtype=torch.int32, device=dev)
    vs = torch.empty((B, Hk, D), dtype=torch.float32, device=dev)
    n_k = nkb * B * Hk
    n_q = nqb * B * Hq if quantize_q else 0
    qa = q if quantize_q else k  # unused pointers when q is not quantized here
    _QUANT_PLANS.launch(
        _fp8_quant_kqv_kernel, (n_k + n_q,),
        (k, v, qa, k8, ks, vamax, q8 if quantize_q else k8, qs if quantize_q else ks,
         k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
         qa.stride(0), qa.stride(1), qa.stride(2), Sk, Sq, Hk, Hq, nkb, nqb, n_k,
         D, FP8_BLOCK, _QINV[qk_format], int8), num_warps=8)
    _launch_vt(v, vt, vs, vamax)
    return q8, qs, k8, ks, vt, vs


def _launch_vt(v, vt, vs, vamax):
    """The V^T pass of `quantize_fp8` (v unit-stride on D; vamax: the first launch's channel amax bits)."""
    B, Sk, Hk, D = v.shape
    nblk = triton.cdiv(Sk, _VT_BS)
    _QUANT_PLANS.launch(_fp8_quant_vt_kernel, (nblk * B * Hk,),
                        (v, vt, vs, vamax, v.stride(0), v.stride(1), v.stride(2), Sk, vt.shape[-1], Hk, nblk,
                         D, _VT_BS), num_warps=8)


# Direct-launch plans of the two quantize launches (`_common.LaunchPlans`: the compiled kernel's launcher, ~tens of
# us less host time per call than Triton's Python launch path).
_QUANT_PLANS = LaunchPlans("fp8 quantize")


def _fp8_cfg(cfg):
    unknown = sorted(set(cfg or {}) - set(FP8_CONFIG))
    if unknown:
        raise ValueError(f"cfg: unknown keys {unknown} (known: {sorted(FP8_CONFIG)})")
    cfg = dict(FP8_CONFIG, **(cfg or {}))
    if cfg["block_m"] not in (64, 128):  # a program must not span two q8 scale blocks (FP8_BLOCK rows)
        raise ValueError(f"cfg['block_m'] must be 64 or 128, got {cfg['block_m']!r}")
    return cfg


def _fp8_launch(qa, qs, k8, ks, vt8, vs, *, B, Sq, Hq, Sk, causal, scale, return_lse, out_dtype, cfg, qfused):
    D, Hk = k8.shape[-1], k8.shape[1]
    cfg = _fp8_cfg(cfg)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = torch.empty((B, Sq, Hq, D), dtype=out_dtype, device=k8.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=k8.device) if return_lse else out.new_empty(
        (0,), dtype=torch.float32)
    int8 = k8.dtype == torch.int8
    qstr = (qa.stride(0), qa.stride(1), qa.stride(2)) if qfused else (0, 0, 0)
    set_tma_allocator()
    bm = cfg["block_m"]
    _fp8_fwd_kernel[(triton.cdiv(Sq, bm), B * Hq)](
        qa, k8, vt8, qs if qs is not None else ks, ks, vs, out, lse, out.stride(0), out.stride(1), out.stride(2),
        Sq, Sk, vt8.shape[-1], Hq, Hk, Hq // Hk, qs.shape[-1] if qs is not None else 0, ks.shape[-1],
        scale * LOG2E, Sk - Sq, *qstr,
        D=D, BLOCK_M=bm, BLOCK_N=FP8_BLOCK, CAUSAL=bool(causal), WRITE_LSE=bool(return_lse),
        LOG2_PS=FP8_LOG2_P_SCALE, QK_ACC=tl.int32 if int8 else tl.float32, QFUSED=bool(qfused),
        QINV=_QINV["int8" if int8 else "e4m3"], QBLK=FP8_BLOCK, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return (out, lse) if return_lse else out


def attention_fp8_quantized(q8, qs, k8, ks, vt8, vs, *, Sk, causal=False, scale=None, return_lse=False,
                            out_dtype=torch.bfloat16, cfg=None):
    """The fp8 attention kernel on `quantize_fp8` outputs -> out (B, Sq, Hq, D) out_dtype [, lse (B, Hq, Sq)]."""
    B, Hq, Sq, D = q8.shape
    return _fp8_launch(q8, qs, k8, ks, vt8, vs, B=B, Sq=Sq, Hq=Hq, Sk=Sk, causal=causal, scale=scale,
                       return_lse=return_lse, out_dtype=out_dtype, cfg=cfg, qfused=False)


def attention_fp8(q, k, v, *, causal: bool = False, scale=None, return_lse: bool = False, qk_format: str = "int8",
                  cfg=None):
    """Low-precision dense flash forward (inference only): q (B, Sq, Hq, D), k/v (B, Sk, Hk, D) fp16/bf16 CUDA,
    D in {64, 128} -> out (B, Sq, Hq, D) in q's dtype [, lse (B, Hq, Sq) fp32].

    Quantizes the inputs itself (part of the call's time): k and v in a pass before the kernel (`quantize_fp8`),
    q inside the kernel (cfg fuse_q, default; one scale per program tile of block_m rows, 64 by default:
    `quantize_fp8_reference(..., q_block=64)` models it). P @ V always in e4m3 (v per channel, transposed; P as
    P * 256); Q K^T in int8 (qk_format "int8", the default: per-block int8 has ~4x less rounding error than e4m3
    on Gaussian data at the same tensor-core rate) or e4m3 ("e4m3": all-fp8). Measured cos-sim vs bf16 attention
    on N(0, 1) inputs (benchmarks/NOTES.md): int8 ~0.9992, e4m3 ~0.9986."""
    B, Sq, Sk, Hq, Hk, D = check_qkv(q, k, v)
    if not fp8_supported(q):
        raise ValueError("attention_fp8 needs fp16/bf16 CUDA q/k/v with head dim 64 or 128 on a Hopper-class GPU, "
                         f"got {q.dtype} {tuple(q.shape)} on {q.device}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q/k/v dtypes must match, got {q.dtype}, {k.dtype}, {v.dtype}")
    q, k, v = (unit_stride(t) for t in (q, k, v))  # the quantize kernels and the fused q load index D with stride 1
    fuse = _fp8_cfg(cfg)["fuse_q"]
    q8, qs, k8, ks, vt8, vs = quantize_fp8(q, k, v, qk_format, quantize_q=not fuse)
    return _fp8_launch(q if fuse else q8, qs, k8, ks, vt8, vs, B=B, Sq=Sq, Hq=Hq, Sk=Sk, causal=causal,
                       scale=scale, return_lse=return_lse, out_dtype=q.dtype, cfg=cfg, qfused=fuse)


def quantize_fp8_reference(q, k, v, qk_format: str = "int8", q_block: int = FP8_BLOCK):
    """Plain-PyTorch model of `quantize_fp8` + dequantization (any device, fp32 out): the values the kernel
    multiplies, bit for bit (same scale / reciprocal / rounding steps as `_quant_tile`; every op here rounds once),
    for tests and error budgets. Returns dequantized (q, k, v) in (B, S, H, D) layout. q_block: rows per q scale
    (`quantize_fp8`: 128; `attention_fp8` quantizes q per program tile, FP8_CONFIG["block_m"])."""
    f8 = torch.float8_e4m3fn
    if qk_format not in QK_FORMATS:
        raise ValueError(f"qk_format must be one of {QK_FORMATS}, got {qk_format!r}")
    qinv = _QINV[qk_format]

    def rows(x, blk):
        B, S, H, D = x.shape
        nb = -(-S // blk)
        xp = torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, nb * blk - S))
        xb = xp.view(B, nb, blk, H, D)
        sc = xb.abs().amax(dim=(2, 4), keepdim=True).clamp_min(1e-30) * qinv
        y = xb * (1.0 / sc)
        y = torch.where(y >= 0, y + 0.5, y - 0.5).trunc() if qk_format == "int8" else y.to(f8).float()
        return (y * sc).view(B, nb * blk, H, D)[:, :S]

    sv = v.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-30) * _QINV["e4m3"]
    return rows(q, q_block), rows(k, FP8_BLOCK), (v.float() * (1.0 / sv)).to(f8).float() * sv


__all__ = ["attention_fp8", "attention_fp8_quantized", "quantize_fp8", "quantize_fp8_reference", "fp8_supported",
            "QK_FORMATS"]
