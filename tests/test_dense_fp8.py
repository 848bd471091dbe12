"""Low-precision dense forward `sparsepatch.kernels.dense.attention_fp8` (int8 or e4m3 Q K^T, e4m3 P V).

CPU: the quantization model (`quantize_fp8_reference`): error budget of the dequantized inputs and the cos-sim of
attention on them (the function the kernel computes, up to P's rounding). GPU (`-m gpu`): the Triton quantize
kernels against that model, and the kernel's cos-sim vs bf16 attention >= 0.999 (int8 Q K^T; e4m3 >= 0.997).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_checks import gpu, rel  # noqa: E402

from sparsepatch.kernels import reference  # noqa: E402

dense = pytest.importorskip("sparsepatch.kernels.dense")


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
        want = reference.attention(q, k, v, causal=True)
        got = reference.attention(qd, kd, vd, causal=True)
        assert cos(got, want) >= (0.999 if fmt == "int8" else 0.998)
    with pytest.raises(ValueError, match="qk_format"):
        dense.quantize_fp8_reference(q, k, v, "int4")


def test_attention_fp8_rejects_bad_input():
    q = torch.randn(1, 8, 2, 128)
    assert not dense.fp8_supported(q)
    with pytest.raises(ValueError, match="attention_fp8"):
        dense.attention_fp8(q, q, q)


CASES = [  # (B, Sq, Sk, Hq, Hk, D, causal)
    (1, 2048, 2048, 4, 4, 128, False),
    (2, 1000, 1000, 4, 2, 128, True),     # partial tiles, GQA
    (1, 512, 1536, 2, 1, 64, True),       # Sq < Sk, bottom-right causal
]


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
        assert rel((vt8.float()[..., :Sk] * vs[..., None]).permute(0, 3, 1, 2), vd) <= 1e-3
        out, lse = dense.attention_fp8(q, k, v, causal=causal, return_lse=True, qk_format=fmt)
        assert out.dtype == q.dtype and out.shape == q.shape and torch.isfinite(out).all()
        assert cos(out, want) >= floor, (fmt, cos(out, want))
        assert (lse - wlse).abs().max().item() <= lse_tol
