"""Split-D dense flash kernels (sparsepatch.kernels.dense.splitd) vs the reference, head dims 32..1024.

CPU: TRITON_INTERPRET=1 at tiny shapes (partial tiles, GQA, causal with Sq != Sk, rows that see no key).
Metric: relative Frobenius error per output / gradient. fp32 vs the fp64 oracle: kernel_checks.attention_rel_bound
(1e-4..3e-4 here); fp16 vs the exact function of the fp16 inputs: P (dS) and the result rounded to fp16,
rel_bound(fp16, 2 or 3) ~6e-3; LSEs (fp32 scores either way): attention_bounds. GPU (`-m gpu`): bf16 at D 256-1024, S 1-4096, fwd and grads <= 2e-2; plus a tiny
Llama (head_dim 512) whose attention calls run on this kernel.
"""
from __future__ import annotations


import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_checks import (INTERP, attention_bounds, attention_rel_bound, check_bound, cpu_only, gpu,  # noqa: E402
                           max_err, rel, rel_bound)

from sparsepatch.kernels.dense import reference  # noqa: E402

dense = pytest.importorskip("sparsepatch.kernels.dense.splitd")



def inputs(B, Sq, Sk, Hq, Hk, D, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return mk(B, Sq, Hq, D), mk(B, Sk, Hk, D), mk(B, Sk, Hk, D), mk(B, Sq, Hq, D)


def ref_grads(q, k, v, do, causal, lse_weight=None):
    qq, kk, vv = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    o, lse = reference.attention(qq, kk, vv, causal=causal, return_lse=True)
    loss = (o * do.float()).sum()
    if lse_weight is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * lse_weight).sum()
    return o.detach(), lse.detach(), torch.autograd.grad(loss, (qq, kk, vv))


FWD_CASES = [  # (B, Sq, Sk, Hq, Hk, D, dtype, causal)
    (2, 37, 37, 4, 2, 32, torch.float32, False),
    (1, 20, 45, 2, 1, 96, torch.float16, True),
    (1, 33, 33, 2, 2, 320, torch.float32, True),
    (1, 40, 21, 1, 1, 320, torch.float32, True),     # Sq > Sk causal: the first rows see no key
    (1, 17, 24, 2, 1, 512, torch.float16, False),
]


@cpu_only
@pytest.mark.parametrize("case", FWD_CASES, ids=lambda c: f"D{c[5]}-{str(c[6])[6:]}-c{int(c[7])}-S{c[1]}x{c[2]}")
def test_forward_interpreter(case):
    B, Sq, Sk, Hq, Hk, D, dt, causal = case
    q, k, v, _ = inputs(B, Sq, Sk, Hq, Hk, D, dt, seed=D)
    out, lse = dense.attention(q, k, v, causal=causal, return_lse=True)
    want, wlse = reference.attention(q.float(), k.float(), v.float(), causal=causal, return_lse=True)
    tol = attention_rel_bound(q, k, v) if dt == torch.float32 else rel_bound(dt, 2)
    assert out.shape == q.shape and out.dtype == dt and lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32
    check_bound(rel(out, want), tol, "out")
    fin = torch.isfinite(wlse)
    assert torch.equal(torch.isfinite(lse), fin)
    check_bound(max_err(lse[fin], wlse[fin]), attention_bounds(q, k, v, torch.float32)[1], "lse")
    if not fin.all():
        assert out.float()[~fin.transpose(1, 2).unsqueeze(-1).expand_as(out)].abs().max() == 0


GRAD_CASES = [  # (B, Sq, Sk, Hq, Hk, D, dtype, causal)
    (1, 24, 40, 4, 2, 96, torch.float32, True),
    (1, 20, 20, 1, 1, 320, torch.float16, False),
    (1, 18, 18, 1, 1, 512, torch.float32, True),
]


@cpu_only
@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: f"D{c[5]}-{str(c[6])[6:]}-c{int(c[7])}")
def test_grads_interpreter(case):
    B, Sq, Sk, Hq, Hk, D, dt, causal = case
    q, k, v, do = inputs(B, Sq, Sk, Hq, Hk, D, dt, seed=D + 1)
    w = torch.randn(B, Hq, Sq, generator=torch.Generator().manual_seed(3)) if dt == torch.float32 else None
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = dense.attention(qq, kk, vv, causal=causal, return_lse=True)
    loss = (out.float() * do.float()).sum() + ((lse * w).sum() if w is not None else 0.0)
    got = torch.autograd.grad(loss, (qq, kk, vv))
    _, _, want = ref_grads(q, k, v, do, causal, lse_weight=w)
    tol = attention_rel_bound(q, k, v) if dt == torch.float32 else rel_bound(dt, 3)
    for name, a, b in zip("qkv", got, want):
        assert a.shape == b.shape and a.dtype == dt
        check_bound(rel(a, b), tol, name)


@cpu_only
def test_backward_without_lse_recomputes():
    q, k, v, do = inputs(1, 16, 16, 1, 1, 64, torch.float32, seed=5)
    qq = q.clone().requires_grad_(True)
    out = dense.attention(qq, k, v, causal=True)
    (dq,) = torch.autograd.grad(out, (qq,), do)
    _, _, want = ref_grads(q, k, v, do, True)
    check_bound(rel(dq, want[0]), attention_rel_bound(q, k, v), "dq")


def test_supports_and_errors():
    q = torch.randn(1, 4, 2, 320)
    if INTERP:
        assert dense.supports(q) and dense.supports(q.half())
        assert not dense.supports(q.double())
    else:
        assert not dense.supports(q)   # CPU tensor, no interpreter
    assert not dense.supports(torch.randn(1, 4, 2, 100))
    assert not dense.supports(torch.randn(1, 4, 2, 2048))
    assert not dense.supports(q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="head dim"):
        dense.attention(torch.randn(1, 4, 1, 48), torch.randn(1, 4, 1, 48), torch.randn(1, 4, 1, 48))
    with pytest.raises(ValueError, match="multiple"):
        dense.attention(torch.randn(1, 4, 3, 64), torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 64))


# ----------------------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------------------

GPU_CASES = [  # (B, Sq, Sk, Hq, Hk, D, causal)
    (1, 1024, 1024, 2, 1, 256, True),
    (1, 1536, 1536, 2, 2, 384, False),
    (1, 2048, 2048, 2, 2, 320, False),
    (1, 1024, 1536, 4, 2, 320, True),
    (1, 4096, 4096, 1, 1, 512, True),
    (2, 1024, 1024, 2, 1, 512, False),
    (1, 2048, 2048, 2, 2, 768, True),
    (1, 1024, 1024, 2, 2, 1024, False),
    (1, 2000, 2000, 2, 2, 1024, True),  # partial tiles
    (1, 1, 300, 4, 2, 1024, True),      # decode-like row, GQA (materialised forward, TMA boxes past the end)
    (2, 77, 77, 2, 2, 768, False),      # B > 1: head-major GEMM buffers copied back
]


@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"D{c[5]}-S{c[1]}x{c[2]}-H{c[3]}/{c[4]}-c{int(c[6])}")
def test_gpu_bf16(case):
    B, Sq, Sk, Hq, Hk, D, causal = case
    q, k, v, do = inputs(B, Sq, Sk, Hq, Hk, D, torch.bfloat16, seed=D, device="cuda")
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = dense.attention(qq, kk, vv, causal=causal, return_lse=True)
    got = torch.autograd.grad(out, (qq, kk, vv), do)
    want, wlse, wg = ref_grads(q, k, v, do, causal)
    assert rel(out, want) <= 2e-2
    assert (lse - wlse).abs().max().item() <= 2e-2
    for name, a, b in zip("qkv", got, wg):
        assert rel(a, b) <= 2e-2, (name, rel(a, b))


# ----------------------------------------------------------------------------------------------------------------
# transformers: tiny Llama with head_dim 512
# ----------------------------------------------------------------------------------------------------------------

def _tiny_llama(dtype=torch.float32, device="cpu"):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=512,
                                   max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _generate(model, ids):
    with torch.no_grad():
        logits = model(ids).logits
        toks = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    return logits, toks


def test_llama_head_dim_512_dense_config_cpu():
    import sparsepatch as sp
    model = _tiny_llama()
    ids = torch.randint(2, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    want_logits, want = _generate(model, ids)
    h = sp.patch(model, sp.DenseConfig())
    try:
        logits, got = _generate(model, ids)
    finally:
        h.remove()
    assert torch.equal(got, want)
    # two fp32 evaluations of the model (2 layers, 12 + 6 tokens): relative rms bound each
    check_bound(rel(logits, want_logits), 2 * rel_bound(torch.float32, 18, depth=2), "logits")


@gpu
def test_llama_head_dim_512_gpu_kernel(monkeypatch):
    """Every attention call of a bf16 tiny Llama (head_dim 512) routed to dense.attention (prefill + decode)."""
    import sparsepatch as sp
    import sparsepatch.kernels as K
    model = _tiny_llama(torch.bfloat16, "cuda")
    ids = torch.randint(2, 64, (1, 40), generator=torch.Generator().manual_seed(0)).cuda()
    want_logits, want = _generate(model, ids)
    calls = []
    orig = K.attention

    def routed(q, k, v, *, causal=False, scale=None, attn_mask=None, return_lse=False):
        if attn_mask is not None:   # no padding here: the mask is plain (bottom-right) causal
            Sq, Sk = q.shape[1], k.shape[1]
            causal_mask = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(Sk - Sq)
            m = attn_mask if attn_mask.dtype == torch.bool else attn_mask == 0
            if not torch.equal(m.expand(q.shape[0], -1, Sq, Sk)[0, 0], causal_mask):
                return orig(q, k, v, causal=causal, scale=scale, attn_mask=attn_mask, return_lse=return_lse)
            causal = True
        calls.append(q.shape[1])
        return dense.attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse)

    monkeypatch.setattr(K, "attention", routed)
    h = sp.patch(model, sp.DenseConfig())
    try:
        logits, got = _generate(model, ids)
    finally:
        h.remove()
    assert calls and max(calls) == 40 and min(calls) == 1
    assert rel(logits, want_logits) <= 2e-2
    assert (got == want).float().mean().item() >= 0.9


@cpu_only
@pytest.mark.parametrize("mode", ["res", "flat", "flat2"])
def test_forward_modes_interpreter(mode):
    """Each Q handling of the forward (resident chunks, run-time chunk loop, flat ring) on one causal GQA case with two
    output groups and a partial last group (D 320 = 2 x 128 + 64 columns: MASK_D)."""
    q, k, v, _ = inputs(1, 20, 27, 2, 1, 320, torch.float32, seed=11)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_D=64, DC=64, NC=4, num_warps=4, num_stages=2, q=mode, qk_stages=2)
    out, lse = dense._fwd_impl(q, k, v, True, 320 ** -0.5, True, cfg=cfg)
    want, wlse = reference.attention(q, k, v, causal=True, return_lse=True)
    check_bound(rel(out, want), attention_rel_bound(q, k, v), "out")
    fin = torch.isfinite(wlse)
    check_bound(max_err(lse[fin], wlse[fin]), attention_bounds(q, k, v)[1], "lse")


@cpu_only
@pytest.mark.parametrize("scratch", [0, 1], ids=["keys-cut", "pairs-cut"])
def test_backward_scratch_chunks_interpreter(scratch):
    """The backward's P / dS scratch split into chunks: keys cut inside one (b, kv head) pair (dQ accumulated in
    fp32 over key chunks) or several pairs per chunk with a partial last chunk; causal GQA, Sq != Sk."""
    B, Sq, Sk, Hq, Hk, D = 2, 20, 37, 4, 2, 64
    q, k, v, do = inputs(B, Sq, Sk, Hq, Hk, D, torch.float32, seed=21)
    o, lse = dense._fwd_impl(q, k, v, True, D ** -0.5, True)
    pair = 2 * (Hq // Hk) * Sq * 40 * 4  # one pair's scratch bytes (keys padded to 40)
    cfg = dict(dense.bwd_config(D), scratch_mb=1)
    budget = (pair // 3) if scratch == 0 else 3 * pair  # 16-key chunks / 3 of the 4 pairs per chunk
    old = dense._bwd_chunks
    try:
        dense._bwd_chunks = lambda n, R, S, es, _b, bn: old(n, R, S, es, budget, bn)
        got = dense._bwd_impl(q, k, v, o, lse, do, None, True, D ** -0.5, cfg=cfg)
    finally:
        dense._bwd_chunks = old
    _, _, want = ref_grads(q, k, v, do, True)
    for name, a, b in zip("qkv", got, want):
        check_bound(rel(a, b), attention_rel_bound(q, k, v), name)


@cpu_only
@pytest.mark.parametrize("scratch", [None, 0, "mha"], ids=["whole", "keys-cut", "mha-direct"])
def test_forward_materialised_interpreter(scratch):
    """cfg q "mat" (row LSE kernel, normalised P written per scratch chunk, O = P V as a GEMM): causal GQA with
    Sq > Sk (rows that see no key: out 0, lse -inf), whole-pair chunks and keys cut into 16-key chunks; and MHA
    B=1 (the GEMM writes the output through a strided view)."""
    B, Sq, Sk, Hq, Hk, D = (1, 40, 21, 4, 2, 96) if scratch != "mha" else (1, 40, 21, 2, 2, 96)
    if scratch == "mha":
        scratch = None
    q, k, v, _ = inputs(B, Sq, Sk, Hq, Hk, D, torch.float32, seed=31)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_D=32, num_warps=4, num_stages=2, q="mat", scratch_mb=1)
    old = dense._bwd_chunks
    try:
        if scratch is not None:
            dense._bwd_chunks = lambda n, R, S, es, _b, bn: old(n, R, S, es, 2 * R * 16 * es, bn)
        out, lse = dense._fwd_impl(q, k, v, True, D ** -0.5, True, cfg=cfg)
    finally:
        dense._bwd_chunks = old
    want, wlse = reference.attention(q, k, v, causal=True, return_lse=True)
    check_bound(rel(out, want), attention_rel_bound(q, k, v), "out")
    fin = torch.isfinite(wlse)
    assert torch.equal(torch.isfinite(lse), fin) and not fin.all()
    check_bound(max_err(lse[fin], wlse[fin]), attention_bounds(q, k, v)[1], "lse")
