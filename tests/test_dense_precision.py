"""DenseConfig(precision="fp8"): the config value, the `sp.kernels.attention_fp8` dispatcher (CPU emulation of the
kernel's quantization, inference-only guard, native fallback with a warning) and both adapters routing through it.
GPU (`-m gpu`): a patched bf16 Llama at head dim 128 really runs the fp8 Triton kernel."""
from __future__ import annotations

import logging

import pytest
import torch

import sparsepatch as sp
from kernel_checks import assert_agree
from sparsepatch import kernels
from sparsepatch.kernels.dense import reference

pytest.importorskip("triton")
fp8 = pytest.importorskip("sparsepatch.kernels.dense.fp8")
transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from sparsepatch.testing import tiny_wan_pipeline, wan_call_kwargs  # noqa: E402


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def test_precision_is_validated_naming_the_argument():
    assert sp.DenseConfig().precision == "native"
    assert sp.DenseConfig(precision="fp8").precision == "fp8"
    with pytest.raises(ValueError, match="precision"):
        sp.DenseConfig(precision="int4")


def test_cpu_fp8_emulates_the_kernel_quantization():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 200, 4, 64, generator=g) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]    # GQA
    for causal in (False, True):
        got, lse = kernels.attention_fp8(q, k, v, causal=causal, return_lse=True)
        qd, kd, vd = fp8.quantize_fp8_reference(q, k, v, q_block=fp8.FP8_CONFIG["block_m"])  # as the kernel
        want, want_lse = reference.attention(qd, kd, vd, causal=causal, return_lse=True)
        native = reference.attention(q, k, v, causal=causal)
        # the same function of the same quantized inputs, fp64 math rounded once to fp32 on both sides
        assert_agree(got, want, torch.float32, what="out")
        assert_agree(lse, want_lse, torch.float32, what="lse")
        assert (got - native).abs().max().item() >= 1e-4        # quantization really happened
        assert cos(got, native) >= 0.999
    half = kernels.attention_fp8(q.half(), k.half(), v.half())
    assert half.dtype == torch.float16


def test_fp8_is_inference_only():
    q = torch.randn(1, 16, 2, 64, requires_grad=True)
    with pytest.raises(ValueError, match="precision='fp8'.*inference-only"):
        kernels.attention_fp8(q, q, q)
    with torch.no_grad():
        assert kernels.attention_fp8(q, q, q).shape == q.shape


def _frames(pipe, **kw):
    with torch.no_grad():
        return pipe(**kw).frames


def test_diffusers_wan_fp8_close_to_dense_and_unpatch_bit_exact():
    pipe = tiny_wan_pipeline(head_dim=32)
    pipe.set_progress_bar_config(disable=True)
    kw = lambda: wan_call_kwargs(height=64, width=64, num_frames=5, steps=2)   # noqa: E731
    dense_frames = _frames(pipe, **kw())
    sp.patch(pipe, sp.DenseConfig())
    native = _frames(pipe, **kw())
    sp.unpatch(pipe)
    report = sp.validate(pipe, sp.DenseConfig(precision="fp8"), measure_speed=False, **kw())
    per_call = [c for branches in report.attention_cos.values() for calls in branches.values() for c in calls]
    assert len(per_call) == 2 * 2 * 2 * 2 and min(per_call) >= 0.999     # (attn1+attn2) x layers x CFG x steps
    assert report.output_cos >= 0.999
    sp.patch(pipe, sp.DenseConfig(precision="fp8"))
    fp8 = _frames(pipe, **kw())
    sp.unpatch(pipe)
    assert (fp8 - native).abs().max().item() >= 1e-5                      # the fp8 path, not the native one
    assert torch.equal(_frames(pipe, **kw()), dense_frames)


def tiny_llama(head_dim=16, hidden=64, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def test_transformers_llama_fp8_logits_close_and_unpatch_bit_exact():
    model = tiny_llama()
    ids = torch.randint(2, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        sp.patch(model, sp.DenseConfig(precision="fp8"))
        got = model(ids).logits
        sp.unpatch(model)
        again = model(ids).logits
    assert cos(got, want) >= 0.999 and (got - want).abs().max().item() >= 1e-5
    assert torch.equal(again, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_llama_fp8_runs_the_fp8_kernel_and_falls_back_with_a_warning(caplog):
    ids = torch.randint(2, 96, (1, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    for head_dim, expect_fp8 in ((128, True), (256, False)):
        model = tiny_llama(head_dim=head_dim, hidden=512).to("cuda", torch.bfloat16)
        calls = []
        orig = fp8.attention_fp8
        fp8.attention_fp8 = lambda *a, **kw: (calls.append(1), orig(*a, **kw))[1]
        try:
            with torch.no_grad(), caplog.at_level(logging.WARNING):
                want = model(ids).logits
                sp.patch(model, sp.DenseConfig(precision="fp8"))
                got = model(ids).logits
                sp.unpatch(model)
        finally:
            fp8.attention_fp8 = orig
        assert len(calls) == (2 if expect_fp8 else 0)
        assert cos(got, want) >= 0.99, head_dim
        assert expect_fp8 or "no fp8 kernel for head dim 256" in caplog.text
