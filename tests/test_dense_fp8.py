"""Low-precision dense forward `sparsepatch.kernels.dense.fp8.attention_fp8` (int8 or e4m3 Q K^T, e4m3 P V).

CPU: the quantization model (`quantize_fp8_reference`): error budget of the dequantized inputs and the cos-sim of
attention on them (the function the kernel computes, up to P's rounding). GPU (`-m gpu`): the Triton quantize
kernels against that model, and the kernel's cos-sim vs bf16 attention >= 0.999 (int8 Q K^T; e4m3 >= 0.997).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_checks import cpu_only, gpu, rel  # noqa: E402

from sparsepatch.kernels.dense import reference  # noqa: E402

dense = pytest.importorskip("sparsepatch.kernels.dense.fp8")


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def test_quantize_model_error_budget():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 300, 2, 64, generator=g) for _ in range(3))
    v[..., 3] *= 50.0  # an outlier channel: per-channel V scales keep the other channels' precision
    for fmt, qk_tol in (("int8", 0.02), ("e4m3", 0.05)):
        qd, kd, vd = dense.quantize_fp8_reference(q, k, v, fmt)
        assert qd.shape == q.shape and vd.shape == v.shape
        assert rel(qd, q) <= qk_tol and rel(kd, k) <= qk_tol
        assert rel(vd[..., :3], v[..., :3]) <= 0.05
        q64 = dense.quantize_fp8_reference(q, k, v, fmt, q_block=64)[0]  # attention_fp8's in-kernel q blocks
        assert q64.shape == q.shape and rel(q64, q) <= qk_tol and not torch.equal(q64, qd)
        want = reference.attention(q, k, v, causal=True)
        got = reference.attention(qd, kd, vd, causal=True)
        assert cos(got, want) >= (0.999 if fmt == "int8" else 0.998)
    with pytest.raises(ValueError, match="qk_format"):
        dense.quantize_fp8_reference(q, k, v, "int4")


@cpu_only
def test_quant_kqv_kernel_interpreter():
    """The fused k / V-amax / q launch of `quantize_fp8` (interpreter, fp16 in, int8 out): k8, q8 and their block
    scales dequantize exactly to the model, and V's channel amax (atomic max on the fp32 bits) is exact."""
    import triton
    g = torch.Generator().manual_seed(1)
    B, Sq, Sk, Hq, Hk, D = 2, 200, 300, 4, 2, 64
    q = torch.randn(B, Sq, Hq, D, generator=g).half()
    k, v = (torch.randn(B, Sk, Hk, D, generator=g).half() for _ in range(2))
    v[..., 3] *= 40.0
    nqb, nkb = triton.cdiv(Sq, 128), triton.cdiv(Sk, 128)
    q8, k8 = torch.empty(B, Hq, Sq, D, dtype=torch.int8), torch.empty(B, Hk, Sk, D, dtype=torch.int8)
    qs, ks = torch.empty(B, Hq, nqb), torch.empty(B, Hk, nkb)
    vam = torch.zeros(B, Hk, D, dtype=torch.int32)
    n_k = nkb * B * Hk
    dense._fp8_quant_kqv_kernel[(n_k + nqb * B * Hq,)](
        k, v, q, k8, ks, vam, q8, qs, *k.stride()[:3], *v.stride()[:3], *q.stride()[:3], Sk, Sq, Hk, Hq, nkb, nqb,
        n_k, D=D, BLK=128, QINV=dense._QINV["int8"], INT8=True)
    qd, kd, vd = dense.quantize_fp8_reference(q, k, v, "int8")
    assert torch.equal(vam.view(torch.float32), v.float().abs().amax(1))
    assert torch.equal((k8.float() * ks.repeat_interleave(128, -1)[..., :Sk, None]).transpose(1, 2), kd)
    assert torch.equal((q8.float() * qs.repeat_interleave(128, -1)[..., :Sq, None]).transpose(1, 2), qd)


@cpu_only
def test_quant_vt_kernel_interpreter():
    """The V^T pass from the channel amax bits (interpreter; fp16 out, as the interpreter's e4m3 cast is not the
    GPU's): V^T indexing, the padding columns Sk..S_pad-1 written as zeros, and the per-channel scales it
    stores."""
    import triton
    g = torch.Generator().manual_seed(2)
    B, Sk, Hk, D = 2, 300, 3, 64                  # Sk % 16 != 0: 4 padding columns, a partial last block
    v = torch.randn(B, Sk, Hk, D, generator=g).half()
    v[..., 5] *= 30.0
    s_pad = -(-Sk // 16) * 16
    vam = v.float().abs().amax(1).contiguous().view(torch.int32)
    # torch's CUDA division by a scalar (what the scales must equal bit for bit) multiplies by the fp32 reciprocal
    want_s = v.float().abs().amax(1).clamp_min(1e-30) * torch.tensor(1.0 / dense.FP8_MAX, dtype=torch.float32)
    vt = torch.full((B, Hk, D, s_pad), float("nan"), dtype=torch.float16)
    vs = torch.full((B, Hk, D), float("nan"))
    nblk = triton.cdiv(Sk, 128)
    dense._fp8_quant_vt_kernel[(nblk * B * Hk,)](v, vt, vs, vam, *v.stride()[:3], Sk, s_pad, Hk, nblk, D=D, BS=128)
    assert torch.equal(vs, want_s)
    assert torch.equal(vt[..., :Sk], (v.float() * (1.0 / want_s[:, None])).permute(0, 2, 3, 1).half())
    assert torch.equal(vt[..., Sk:], torch.zeros(B, Hk, D, s_pad - Sk, dtype=torch.float16))


@cpu_only
@pytest.mark.parametrize("quantize_q", [True, False])
def test_quantize_fp8_interpreter(quantize_q):
    """`quantize_fp8`'s host path (both launches, positional arguments as its launch plans pass them) under the
    interpreter, fp16 in: int8 q8 / k8 and every scale equal the model; vt8 has the padded shape and zero padding
    columns (its e4m3 values are the GPU test's: the interpreter's e4m3 cast is not the GPU's)."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 200, 4, 64, generator=g).half()
    k, v = (torch.randn(2, 300, 2, 64, generator=g).half() for _ in range(2))
    q8, qs, k8, ks, vt8, vs = dense.quantize_fp8(q, k, v, "int8", quantize_q=quantize_q)
    qd, kd, _ = dense.quantize_fp8_reference(q, k, v, "int8")
    assert torch.equal((k8.float() * ks.repeat_interleave(128, -1)[..., :300, None]).transpose(1, 2), kd)
    if quantize_q:
        assert torch.equal((q8.float() * qs.repeat_interleave(128, -1)[..., :200, None]).transpose(1, 2), qd)
    else:
        assert q8 is None and qs is None
    assert torch.equal(vs, v.float().abs().amax(1).clamp_min(1e-30) * dense._QINV["e4m3"])
    assert vt8.shape == (2, 2, 64, 304) and vt8.dtype == torch.float8_e4m3fn
    assert int(vt8[..., 300:].view(torch.uint8).count_nonzero()) == 0


def test_attention_fp8_rejects_bad_input():
    with pytest.raises(ValueError, match="block_m"):
        dense._fp8_cfg(dict(block_m=256))
    with pytest.raises(ValueError, match="unknown keys"):
        dense._fp8_cfg(dict(blockm=64))
    q = torch.randn(1, 8, 2, 128)
    assert not dense.fp8_supported(q)
    with pytest.raises(ValueError, match="attention_fp8"):
        dense.attention_fp8(q, q, q)


QUANT_SHAPES = [  # (B, Sq, Sk, Hq, Hk, D)
    (1, 1000, 1000, 4, 4, 128),     # partial last block, Sk % 16 != 0 (V^T padding)
    (2, 520, 1016, 8, 2, 64),       # B > 1, GQA, D64, Sq != Sk, Sk % 128 != 0 but Sk % 16 == 0 (no padding)
    (1, 130, 4099, 2, 1, 128),      # Sk % 16 == 3, 33 key blocks (two V^T programs per head order differ more)
]


@gpu
@pytest.mark.parametrize("fmt", ["int8", "e4m3"])
@pytest.mark.parametrize("shape", QUANT_SHAPES, ids=lambda c: "B{}-S{}x{}-H{}/{}-D{}".format(*c))
def test_gpu_quantize_bitwise_model(fmt, shape):
    """`quantize_fp8` (k, q blocks, V channel scales, V^T) equals `quantize_fp8_reference` bit for bit on bf16
    inputs with rounding ties: bf16 blocks hold many elements at exactly amax / 2 (int8: y = 63.5), and two more
    per block are planted, so an approximate division or an FMA-contracted rounding anywhere flips some. V^T's
    padding columns are zero."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9):
        pytest.skip("needs sm_90")
    B, Sq, Sk, Hq, Hk, D = shape
    g = torch.Generator().manual_seed(7 + Sk)
    q = torch.randn(B, Sq, Hq, D, generator=g).bfloat16()
    k, v = (torch.randn(B, Sk, Hk, D, generator=g).bfloat16() for _ in range(2))
    for x in (q, k):
        x[:, 0::128, :, 0] = 6.0     # the block amax (|randn| > 6: ~2e-9 per element)
        x[:, 1::128, :, 1] = 3.0     # amax / 2: the int8 tie y = 63.5
        x[:, 2::128, :, 1] = -3.0
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    qd, kd, vd = dense.quantize_fp8_reference(q, k, v, fmt)
    s_pad = -(-Sk // 16) * 16
    q8, qs, k8, ks, vt8, vs = dense.quantize_fp8(q, k, v, fmt)
    assert vt8.shape == (B, Hk, D, s_pad)
    got_q = (q8.float() * qs.repeat_interleave(128, -1)[..., :Sq, None]).transpose(1, 2)
    got_k = (k8.float() * ks.repeat_interleave(128, -1)[..., :Sk, None]).transpose(1, 2)
    got_v = (vt8.float()[..., :Sk] * vs[..., None]).permute(0, 3, 1, 2)
    for name, got, want in (("q", got_q, qd), ("k", got_k, kd), ("v", got_v, vd)):
        assert torch.equal(got, want), (name, int((got != want).sum()))
    assert torch.equal(vt8[..., Sk:].float(), torch.zeros(B, Hk, D, s_pad - Sk, device=v.device))
    assert torch.equal(vs, v.float().abs().amax(1).clamp_min(1e-30) / dense.FP8_MAX)


CASES = [  # (B, Sq, Sk, Hq, Hk, D, causal)
    (1, 2048, 2048, 4, 4, 128, False),
    (2, 1000, 1000, 4, 2, 128, True),     # partial tiles, GQA
    (1, 512, 1536, 2, 1, 64, True),       # Sq < Sk, bottom-right causal
]


# launch configs: the default (64-row programs, one warpgroup, fused q), the same with q8 from the quantize pass,
# and the 128-row programs of two warpgroups (the default before fp8 session 6)
CFGS = [dict(), dict(fuse_q=False), dict(block_m=128, num_warps=8)]


@gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"D{c[5]}-S{c[1]}x{c[2]}-H{c[3]}/{c[4]}-c{int(c[6])}")
def test_gpu_fp8_vs_bf16(case):
    B, Sq, Sk, Hq, Hk, D, causal = case
    g = torch.Generator().manual_seed(D + Sq)
    q = torch.randn(B, Sq, Hq, D, generator=g).cuda().bfloat16()
    k, v = (torch.randn(B, Sk, Hk, D, generator=g).cuda().bfloat16() for _ in range(2))
    want, wlse = reference.attention(q.float(), k.float(), v.float(), causal=causal, return_lse=True)
    for fmt, floor, lse_tol in (("int8", 0.999, 0.05), ("e4m3", 0.997, 0.15)):
        # the quantize kernels reproduce the model (up to rounding ties)
        q8, qs, k8, ks, vt8, vs = dense.quantize_fp8(q, k, v, fmt)
        qd, kd, vd = dense.quantize_fp8_reference(q, k, v, fmt)
        assert rel((q8.float() * qs.repeat_interleave(128, -1)[..., :Sq, None]).transpose(1, 2), qd) <= 1e-3
        assert rel((k8.float() * ks.repeat_interleave(128, -1)[..., :Sk, None]).transpose(1, 2), kd) <= 1e-3
        assert rel((vt8.float()[..., :Sk] * vs[..., None]).permute(0, 3, 1, 2), vd) <= 1e-3
        # V's scales (atomic amax in the first launch, scale in the V^T pass) are torch's bits
        assert torch.equal(vs, v.float().abs().amax(1).clamp_min(1e-30) / dense.FP8_MAX)
        cfgs = CFGS if fmt == "int8" else CFGS[:1]
        for cfg in cfgs:
            out, lse = dense.attention_fp8(q, k, v, causal=causal, return_lse=True, qk_format=fmt, cfg=cfg)
            assert out.dtype == q.dtype and out.shape == q.shape and torch.isfinite(out).all()
            assert cos(out, want) >= floor, (fmt, cfg, cos(out, want))
            assert (lse - wlse).abs().max().item() <= lse_tol, (fmt, cfg)
        # the kernel on the quantize outputs (q8 path) vs attention on the dequantized inputs
        want_q = reference.attention(qd, kd, vd, causal=causal)
        for cfg in cfgs:
            got = dense.attention_fp8_quantized(q8, qs, k8, ks, vt8, vs, Sk=Sk, causal=causal, cfg=cfg)
            assert cos(got, want_q) >= 0.999, (fmt, cfg, cos(got, want_q))
