"""`flash_cudnn_bwd` (dense attention, training calls): our flash forward with torch's cuDNN backward kernel.

CPU: which calls it declines and why (it must never take an inference call, a mask, an LSE output, causal with
Sq != Sk, or a head dim its forward does not run), that a training call reaches it only through a measured
"attention+backward" entry, and the glue to cuDNN's backward op (a stand-in checks what it is handed). GPU
(sm_90): gradients vs an fp32 oracle within the error model's bound and vs SDPA cuDNN's own, for bf16 / fp16,
D 64 / 128, MHA / GQA, causal or not, sequence- and head-major inputs.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from kernel_checks import attention_bounds, attention_rel_bound, check_bound, cpu_only, gpu, rel  # noqa: E402

from sparsepatch.kernels import dispatch  # noqa: E402
from sparsepatch.kernels.dense import flash_cudnn  # noqa: E402
from sparsepatch.kernels.dense import op as dense_op  # noqa: E402
from sparsepatch.kernels.dense import reference  # noqa: E402

TRAIN = dispatch.Call("attention", "cuda", (9, 0), torch.bfloat16, 2, 4096, 4096, 32, 8, 128, 128, True,
                      needs_grad=True, layouts=("head", "head", "head"))


@pytest.mark.parametrize("change,word", [
    (dict(needs_grad=False), "training calls only"),
    (dict(return_lse=True), "LSE"),
    (dict(device="cpu", arch=None), "sm_90"),
    (dict(arch=(8, 0)), "sm_90"),
    (dict(dtype=torch.float32), "float16/bfloat16"),
    (dict(mask="bool"), "attn_mask"),
    (dict(head_dim=256, head_dim_v=256), "head dim"),
    (dict(head_dim_v=64), "head dim"),
    (dict(seq_q=1024), "Sq != Sk"),
    (dict(layouts=("other", "seq", "seq")), "sequence- or head-major"),
])
def test_declines_calls_it_cannot_run_and_says_why(change, word):
    why = flash_cudnn.supports(dataclasses.replace(TRAIN, **change))
    assert why is not None and word in why, why


def test_training_call_takes_it_only_through_a_forward_plus_backward_entry(monkeypatch):
    """Routing among the real backend list, with every backend's support pinned (no CUDA here): a forward-only table
    leaves a training call on SDPA; a measured "attention+backward" cell gives it to flash_cudnn_bwd only where it
    beats SDPA's fwd+bwd by more than the baseline margin."""
    runs = {"flash_cudnn_bwd", "flash_triton", "sdpa_cudnn", "sdpa"}
    for b in dense_op.BACKENDS:
        monkeypatch.setitem(dense_op.DISPATCH.backends, b.name, dataclasses.replace(
            b, supports=lambda c, n=b.name: None if n in runs else "pinned off", measured_for=None))
    cell = dict(causal=True, D=128, group=4, dtype="bfloat16", B=2, Sq=4096, Sk=4096, Hq=32, layout="head")
    fwd = dict(cell, op="attention", ms={"flash_triton": 1.0, "flash_cudnn_bwd": 1.0, "sdpa_cudnn": 1.2})
    old = dispatch._TABLE[0]
    try:
        for entries, want in (([fwd], "sdpa"),
                              ([fwd, dict(cell, op="attention+backward",
                                          ms={"flash_cudnn_bwd": 4.0, "flash_triton": 5.0, "sdpa_cudnn": 4.2})],
                               "flash_cudnn_bwd"),
                              ([fwd, dict(cell, op="attention+backward",
                                          ms={"flash_cudnn_bwd": 4.0, "sdpa_cudnn": 4.05})], "sdpa_cudnn")):
            dispatch.set_cost_table(dispatch.CostTable({"entries": entries}))
            assert dense_op.DISPATCH._decide(TRAIN).backend == want, entries
        inference = dataclasses.replace(TRAIN, needs_grad=False)
        assert dense_op.DISPATCH._decide(inference).backend in ("flash_triton", "flash_cudnn_bwd")
    finally:
        dispatch.set_cost_table(old)


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon forward needs sm_90")
@pytest.mark.parametrize("D,causal,Hq,Hk,layout,dtype", [
    (D, causal, Hq, Hk, layout, torch.bfloat16) for D in (64, 128) for causal in (False, True)
    for Hq, Hk, layout in ((8, 8, "seq"), (8, 2, "head"))] + [(128, True, 8, 2, "head", torch.float16)])
def test_gradients_match_the_oracle_and_cudnn(D, causal, Hq, Hk, layout, dtype):
    S = 1536
    g = torch.Generator(device="cuda").manual_seed(D + Hk)
    shapes = [(1, S, H, D) for H in (Hq, Hk, Hk)]
    if layout == "head":
        q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
                   for H in (Hq, Hk, Hk))
    else:
        q, k, v = (torch.randn(*s, device="cuda", dtype=dtype, generator=g) for s in shapes)
    do = torch.randn(1, S, Hq, D, device="cuda", dtype=dtype, generator=g)
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    call = dispatch.Call.of("attention", qq, kk, vv, causal=causal)
    assert flash_cudnn.supports(call) is None
    out = flash_cudnn.attention(qq, kk, vv, causal=causal)
    got = (out, *torch.autograd.grad(out, (qq, kk, vv), do))
    with torch.no_grad():    # the forward is flash_triton's own, bit for bit
        assert torch.equal(out, dense_op.DISPATCH.backends["flash_triton"].run(
            q, k, v, causal=causal, scale=None, attn_mask=None, return_lse=False))
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = reference.attention(qf, kf, vf, causal=causal)
    want = (ref, *torch.autograd.grad(ref, (qf, kf, vf), do.float()))
    bound = attention_rel_bound(q, k, v)
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == w.shape and a.dtype == dtype
        check_bound(rel(a, w), bound, f"flash_cudnn_bwd {name}")
    qc, kc, vc = (t.detach().requires_grad_(True) for t in (q, k, v))
    oc = dense_op.DISPATCH.backends["sdpa_cudnn"].run(qc, kc, vc, causal=causal, scale=None, attn_mask=None,
                                                      return_lse=False)
    theirs = (oc, *torch.autograd.grad(oc, (qc, kc, vc), do))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, theirs):
        check_bound(rel(a, b), 2 * bound, f"flash_cudnn_bwd vs sdpa_cudnn {name}")


@cpu_only
@pytest.mark.parametrize("causal,Hk,layout", [(False, 4, "seq"), (True, 2, "head")])
def test_backward_hands_cudnn_the_tensors_its_own_forward_would_save(causal, Hk, layout, monkeypatch):
    """The glue, on CPU: our forward (the Triton kernel under the interpreter) and a stand-in for torch's cuDNN
    backward op that checks what it is given against the oracle (q / k / v / O / dO as (B, H, S, D) views, the
    natural-log LSE of the scaled scores as (B, Hq, Sq, 1) stats, no bias or ragged offsets, the causal flag and the
    scale) and returns the oracle's gradients in the layout `at::empty_like(query)` gives: the gradients that come
    back through autograd equal the oracle's, in q / k / v's shapes."""
    B, S, Hq, D = 1, 96, 4, 64
    g = torch.Generator().manual_seed(Hk)
    if layout == "head":
        q, k, v = (torch.randn(B, H, S, D, generator=g).transpose(1, 2) for H in (Hq, Hk, Hk))
    else:
        q, k, v = (torch.randn(B, S, H, D, generator=g) for H in (Hq, Hk, Hk))
    do = torch.randn(B, S, Hq, D, generator=g)
    scale = 0.3
    seen = {}

    def fake_cudnn_backward(dout, qh, kh, vh, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, p, is_causal,
                            *, scale=None):
        assert (bias, cum_q, cum_k, p, max_q, max_k, is_causal) == (None, None, None, 0.0, S, S, causal)
        assert qh.shape == (B, Hq, S, D) and kh.shape == vh.shape == (B, Hk, S, D) and out.shape == dout.shape
        assert lse.shape == (B, Hq, S, 1) and lse.dtype == torch.float32 and dout.stride() == out.stride()
        with torch.enable_grad():   # (autograd runs a backward with gradients off)
            qq, kk, vv = (t.transpose(1, 2).detach().double().requires_grad_(True) for t in (qh, kh, vh))
            want, want_lse = reference.attention(qq, kk, vv, causal=is_causal, scale=scale, return_lse=True)
            grads = torch.autograd.grad(want, (qq, kk, vv), dout.transpose(1, 2).double())
        b_out, b_lse = attention_bounds(q, k, v, torch.float32, scale)
        check_bound((out.transpose(1, 2).double() - want).abs().max().item(), b_out, "O handed to the backward")
        check_bound((lse[..., 0].double() - want_lse).abs().max().item(), b_lse, "natural-log LSE")
        seen["called"] = True
        return tuple(torch.empty_like(t).copy_(gr.transpose(1, 2)) for t, gr in zip((qh, kh, vh), grads))

    monkeypatch.setattr(flash_cudnn, "_cudnn_backward_op", lambda: fake_cudnn_backward)
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = flash_cudnn._FlashCudnn.apply(qq, kk, vv, causal, scale)
    got = torch.autograd.grad(out, (qq, kk, vv), do)
    assert seen.get("called")
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = reference.attention(qd, kd, vd, causal=causal, scale=scale)
    want = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    bound = attention_rel_bound(q, k, v, torch.float32, scale)   # the fp32 forward's O / LSE feed the oracle's grads
    for name, a, w, t in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert a.shape == t.shape
        check_bound(rel(a, w), bound, f"{name} through the stand-in")


@gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon forward needs sm_90")
@pytest.mark.parametrize("routed", [False, True])
def test_gpu_compiled_training_step_equals_eager(routed):
    """torch.compile(fullgraph=True) of a step whose attention runs flash_cudnn_bwd, forced (backend=) or routed by a
    measured "attention+backward" cell: no graph break, and the compiled step's output and gradients are the eager
    step's (the same two kernels run; cuDNN's backward is deterministic at these shapes, so within 1e-6 relative)."""
    B, S, Hq, Hk, D = 1, 2048, 8, 2, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
               for H in (Hq, Hk, Hk))
    do = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    force = None if routed else "flash_cudnn_bwd"
    old_table = dispatch._TABLE[0]
    if routed:
        cell = dict(causal=True, D=D, group=Hq // Hk, dtype="bfloat16", B=B, Sq=S, Sk=S, Hq=Hq, layout="head")
        dispatch.set_cost_table(dispatch.CostTable({"entries": [
            dict(cell, op="attention", ms={"flash_triton": 1.0, "sdpa_cudnn": 1.2}),
            dict(cell, op="attention+backward", ms={"flash_cudnn_bwd": 4.0, "flash_triton": 5.0, "sdpa_cudnn": 4.4})]}))

    def step(q, k, v):
        return dense_op.attention(q, k, v, causal=True, backend=force)

    results = []
    try:
        if routed:
            call = dispatch.Call.of("attention", q.detach().requires_grad_(True), k, v, causal=True)
            assert dense_op.DISPATCH._decide(call).backend == "flash_cudnn_bwd"
        for fn in (step, torch.compile(step, fullgraph=True)):
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = fn(qq, kk, vv)
            results.append((out, *torch.autograd.grad(out, (qq, kk, vv), do)))
    finally:
        dispatch.set_cost_table(old_table)
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel(a, b) <= 1e-6, (name, rel(a, b))
    # and it is that backend: the eager gradients equal a direct flash_cudnn_bwd call's
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = flash_cudnn.attention(qq, kk, vv, causal=True)
    direct = (out, *torch.autograd.grad(out, (qq, kk, vv), do))
    for name, a, b in zip(("out", "dq", "dk", "dv"), results[0], direct):
        assert rel(a, b) <= 1e-6, (name, rel(a, b))
