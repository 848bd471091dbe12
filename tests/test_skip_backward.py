"""Triton backward (skip_backward.py) vs autograd through the reference.

CPU: TRITON_INTERPRET=1 at tiny shapes (S=150 -> partial tiles, GQA Hq=4 Hk=2, D=64). Error metric everywhere:
relative Frobenius error ||got - want|| / ||want|| per gradient. fp32 inputs vs the fp64-exact reference:
kernel_checks.attention_rel_bound (~3e-5 here). fp16 inputs vs the fp32-input reference: three fp16 roundings
(P or dS, the gradient), rel_bound(fp16, 3) ~7e-3. GPU (`-m gpu`): bf16 at S=4096 and S=32760 vs an fp32
reference computed in q-chunks of whole tiles (same function, bounded memory): <= 2e-2 (not re-derived here).
"""
from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_checks import attention_rel_bound, check_bound, cpu_only, gpu, rel, rel_bound  # noqa: E402

from sparsepatch.kernels.dense import reference  # noqa: E402
from sparsepatch.kernels.skip import reference as skip_reference
from sparsepatch.kernels.skip.skiplist import SkipList, num_tiles  # noqa: E402

bwd = pytest.importorskip("sparsepatch.kernels.skip.backward")



def random_mask(B, H, Tq, Tk, density, seed, device="cpu", diag=True):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(B, H, Tq, Tk, generator=g) < density
    if diag:
        i = torch.arange(Tq)
        m[:, :, i, (i * Tk // Tq).clamp(max=Tk - 1)] = True
    return m.to(device)


def make_inputs(B, Sq, Sk, Hq, Hk, D, dtype, seed, device="cpu", strided=False):
    g = torch.Generator().manual_seed(seed)
    if strided:   # q/k/v as views of one packed tensor (B, S, 3, H, D), the way fused projections give them
        assert Sq == Sk and Hq == Hk
        qkv = torch.randn(B, Sq, 3, Hq, D, generator=g).to(device=device, dtype=dtype)
        q, k, v = qkv.unbind(2)
    else:
        q = torch.randn(B, Sq, Hq, D, generator=g).to(device=device, dtype=dtype)
        k = torch.randn(B, Sk, Hk, D, generator=g).to(device=device, dtype=dtype)
        v = torch.randn(B, Sk, Hk, D, generator=g).to(device=device, dtype=dtype)
    do = torch.randn(B, Sq, Hq, D, generator=g).to(device=device, dtype=dtype)
    return q, k, v, do


def ref_grads(q, k, v, do, skip_list=None, causal=False, scale=None, dtype=torch.float32, lse_weight=None):
    """(out, lse, dq, dk, dv) by autograd through the reference, inputs cast to `dtype`."""
    qq, kk, vv = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    if skip_list is None:
        o, lse = reference.attention(qq, kk, vv, causal=causal, scale=scale, return_lse=True)
    else:
        o, _, lse = skip_reference.skip_attention(qq, kk, vv, skip_list, -1.0, scale=scale, return_lse=True)
    loss = (o.to(torch.float64) * do.to(torch.float64)).sum()
    if lse_weight is not None:
        loss = loss + (lse.to(torch.float64) * lse_weight).sum()
    dq, dk, dv = torch.autograd.grad(loss, (qq, kk, vv))
    return o.detach(), lse.detach(), dq, dk, dv


def check(got, want, tol):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all(), name
        check_bound(rel(g, w), tol, name)


# ----------------------------------------------------------------------------------------------------------------
# transpose_list
# ----------------------------------------------------------------------------------------------------------------

@cpu_only
@pytest.mark.parametrize("shape,density", [((2, 3, 5, 7), 0.4), ((1, 2, 9, 4), 0.7), ((1, 1, 3, 3), 0.0)])
def test_transpose_list_matches_torch(shape, density):
    B, H, Tq, Tk = shape
    mask = random_mask(B, H, Tq, Tk, density, seed=1, diag=False)
    mask[0, 0, 0] = False                         # an empty row
    lst = SkipList.from_mask(mask, (16, 16))
    c_ref, i_ref = bwd.transpose_list_torch(lst)
    c, i = bwd.transpose_list(lst)
    assert c.dtype == torch.int32 and i.dtype == torch.int32 and i.shape == (B, H, Tk, Tq)
    assert torch.equal(c, c_ref)
    slot = torch.arange(Tq)
    valid = slot < c.unsqueeze(-1)
    assert torch.equal(torch.where(valid, i, -1), torch.where(valid, i_ref, -1))
    # the transposed list's mask is the transpose of the list's mask
    back = SkipList(c, i, (16, 16), Tk * 16, Tq * 16).to_mask()
    assert torch.equal(back, mask.transpose(-1, -2))


# ----------------------------------------------------------------------------------------------------------------
# Interpreter: skip and dense gradients
# ----------------------------------------------------------------------------------------------------------------

@cpu_only
@pytest.mark.parametrize("Sq,Sk,tile", [(150, 150, (64, 64)), (150, 200, (32, 64)), (96, 150, (64, 32))])
def test_skip_backward_fp32(Sq, Sk, tile):
    B, Hq, Hk, D = 1, 4, 2, 64
    q, k, v, do = make_inputs(B, Sq, Sk, Hq, Hk, D, torch.float32, seed=2)
    tm, tn = tile
    mask = random_mask(B, Hq, num_tiles(Sq, tm), num_tiles(Sk, tn), 0.4, seed=3)
    mask[0, 1, 0] = False                          # a q-tile that attends to nothing
    lst = SkipList.from_mask(mask, tile, Sq, Sk)
    out, lse, *want = ref_grads(q, k, v, do, lst, dtype=torch.float32)
    got = bwd.attention_backward(q, k, v, out, lse, do, skip_list=lst)
    check(got, want, attention_rel_bound(q, k, v))


@cpu_only
@pytest.mark.parametrize("Sq,Sk,causal", [(150, 150, False), (150, 150, True), (100, 150, True), (150, 100, True)])
def test_dense_backward_fp32(Sq, Sk, causal):
    B, Hq, Hk, D = 1, 4, 2, 64
    q, k, v, do = make_inputs(B, Sq, Sk, Hq, Hk, D, torch.float32, seed=4)
    out, lse, *want = ref_grads(q, k, v, do, None, causal=causal, dtype=torch.float32)
    got = bwd.attention_backward(q, k, v, out, lse, do, causal=causal)
    check(got, want, attention_rel_bound(q, k, v))


@cpu_only
@pytest.mark.parametrize("variant,skip_mode,causal", [
    (dict(flat=True), True, False), (dict(flat=True, tma=True), True, False), (dict(tma=True), False, True)])
def test_flat_and_tma_variants(variant, skip_mode, causal):
    """cfg flat=True (one loop over (tile, sub-block) pairs, index prefetched), tma=True (q/dO and k/v through
    host TMA descriptors); tile (64, 64) with M1=N2=32 so each listed tile has two sub-blocks; partial tiles, GQA."""
    Sq, Sk = 150, 200
    q, k, v, do = make_inputs(1, Sq, Sk, 4, 2, 64, torch.float32, seed=18)
    lst = SkipList.from_mask(random_mask(1, 4, 3, 4, 0.5, seed=19), (64, 64), Sq, Sk) if skip_mode else None
    out, lse, *want = ref_grads(q, k, v, do, lst, causal=causal)
    cfg = dict(bwd.CONFIGS[64], M1=32, N2=32, **variant)
    got = bwd._backward_impl(q, k, v, out, lse, do, None, lst.counts if lst else None, lst.indices if lst else None,
                             64, 64, 1 / 8, causal, cfg)
    check(got, want, attention_rel_bound(q, k, v))


@cpu_only
def test_strided_qkv_and_scale():
    q, k, v, do = make_inputs(1, 150, 150, 2, 2, 64, torch.float32, seed=5, strided=True)
    assert not q.is_contiguous()
    mask = random_mask(1, 2, 3, 3, 0.5, seed=6)
    lst = SkipList.from_mask(mask, (64, 64), 150, 150)
    out, lse, *want = ref_grads(q, k, v, do, lst, scale=0.3)
    got = bwd.attention_backward(q, k, v, out, lse, do, skip_list=lst, scale=0.3)
    check(got, want, attention_rel_bound(q, k, v, scale=0.3))


@cpu_only
def test_skip_backward_fp16_and_d128():
    B, S, Hq, Hk, D = 1, 150, 4, 2, 128
    q, k, v, do = make_inputs(B, S, S, Hq, Hk, D, torch.float16, seed=7)
    lst = SkipList.from_mask(random_mask(B, Hq, 3, 3, 0.5, seed=8), (64, 64), S, S)
    out, lse, *_ = ref_grads(q, k, v, do, lst, dtype=torch.float16)
    _, _, *want = ref_grads(q, k, v, do, lst, dtype=torch.float32)
    got = bwd.attention_backward(q, k, v, out, lse, do, skip_list=lst)
    assert all(g.dtype == torch.float16 for g in got)
    check(got, want, rel_bound(torch.float16, 3))


@cpu_only
def test_extra_skip_is_the_gradient_of_the_smaller_list():
    B, S, Hq, Hk, D = 1, 150, 4, 2, 64
    q, k, v, do = make_inputs(B, S, S, Hq, Hk, D, torch.float32, seed=9)
    full = random_mask(B, Hq, 3, 3, 0.7, seed=10)
    keep = full & random_mask(B, Hq, 3, 3, 0.6, seed=11)
    lst = SkipList.from_mask(full, (64, 64), S, S)
    out, lse, *_ = ref_grads(q, k, v, do, lst)
    got = bwd.attention_backward(q, k, v, out, lse, do, skip_list=lst,
                                 extra_skip=SkipList.from_mask(keep | ~full, (64, 64), S, S))
    # Expected: probabilities of the full forward (its lse) restricted to `keep` tiles.
    qq, kk, vv = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", qq, kk.repeat_interleave(2, 2)) / math.sqrt(D)
    elem = keep.repeat_interleave(64, 2)[:, :, :S].repeat_interleave(64, 3)[..., :S]
    p = torch.exp(s - lse.double()[..., None]).masked_fill(~elem, 0.0)
    # d/dx of the masked part with lse held fixed plus the lse term: the backward formula of the kept tiles.
    dP = torch.einsum("bqhd,bkhd->bhqk", do.double(), vv.detach().repeat_interleave(2, 2))
    delta = (do.double() * out.double()).sum(-1).transpose(1, 2)
    ds = p.detach() * (dP - delta[..., None]) / math.sqrt(D)
    want_dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk.detach().repeat_interleave(2, 2))
    want_dk = torch.einsum("bhqk,bqhd->bkhd", ds, qq.detach()).reshape(B, S, Hk, 2, D).sum(3)
    want_dv = torch.einsum("bhqk,bqhd->bkhd", p.detach(), do.double()).reshape(B, S, Hk, 2, D).sum(3)
    check(got, (want_dq, want_dk, want_dv), attention_rel_bound(q, k, v))


# ----------------------------------------------------------------------------------------------------------------
# Autograd through the forward custom ops (skip.py)
# ----------------------------------------------------------------------------------------------------------------

skip_mod = None
try:
    from sparsepatch.kernels.skip import triton as skip_mod  # noqa: E402
except ImportError:  # pragma: no cover
    pass
needs_fwd = pytest.mark.skipif(skip_mod is None, reason="skip.py forward not available")


def skip_fwd_op(q, k, v, lst, threshold=-5.0, must_do=None, return_lse=True):
    """The forward custom op itself (the public entry may bypass it in eager mode)."""
    flat = [int(x) for rng in (must_do or []) for x in rng]
    tm, tn = lst.tile
    out, _, _, lse = torch.ops.sparsepatch.skip_fwd(q, k, v, lst.counts, lst.indices, threshold,
                                                    1.0 / math.sqrt(q.shape[-1]), tm, tn, flat, return_lse)
    return out, lse


@cpu_only
@needs_fwd
@pytest.mark.parametrize("return_lse,must_do", [(True, None), (False, [(0, 20)])])
def test_autograd_through_skip_fwd(return_lse, must_do):
    B, S, Hq, Hk, D = 1, 150, 4, 2, 64
    q, k, v, do = make_inputs(B, S, S, Hq, Hk, D, torch.float32, seed=12)
    lst = SkipList.from_mask(random_mask(B, Hq, 3, 3, 0.4, seed=13), (64, 64), S, S)
    lse_w = torch.randn(B, Hq, S, generator=torch.Generator().manual_seed(14)).double() if return_lse else None
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    out, lse = skip_fwd_op(qq, kk, vv, lst, must_do=must_do, return_lse=return_lse)
    loss = (out.double() * do.double()).sum()
    if return_lse:
        loss = loss + (lse.double() * lse_w).sum()
    got = torch.autograd.grad(loss, (qq, kk, vv))
    q2, k2, v2 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o2, _, lse2 = skip_reference.skip_attention(q2, k2, v2, lst, -5.0, must_do=must_do, return_lse=True)
    loss2 = (o2 * do.double()).sum() + ((lse2.double() * lse_w).sum() if return_lse else 0)
    want = torch.autograd.grad(loss2, (q2, k2, v2))
    check(got, want, attention_rel_bound(q, k, v))


@cpu_only
@needs_fwd
@pytest.mark.parametrize("causal,return_lse", [(False, True), (True, False)])
def test_autograd_through_dense_fwd(causal, return_lse):
    q, k, v, do = make_inputs(1, 150, 150, 4, 2, 64, torch.float32, seed=15)
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    out, _ = torch.ops.sparsepatch.dense_fwd(qq, kk, vv, causal, 0.125, return_lse)
    got = torch.autograd.grad(out, (qq, kk, vv), do)
    _, _, *want = ref_grads(q, k, v, do, None, causal=causal)
    check(got, want, attention_rel_bound(q, k, v))


# ----------------------------------------------------------------------------------------------------------------
# GPU: bf16 at realistic shapes
# ----------------------------------------------------------------------------------------------------------------

def chunked_ref_grads(q, k, v, do, lst, causal=False, chunk_tiles=32):
    """fp32 reference gradients computed over q-chunks of whole tiles (each row's softmax is independent)."""
    B, Sq, Hq, D = q.shape
    tm = lst.tile[0] if lst is not None else 128
    step = chunk_tiles * tm
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    torch.set_grad_enabled(True)
    kk, vv = (t.detach().float().requires_grad_(True) for t in (k, v))
    assert not causal or Sq == k.shape[1]
    for a in range(0, Sq, step):
        b = min(a + step, Sq)
        qq = q[:, a:b].detach().float().requires_grad_(True)
        if lst is None:
            mask = None
            if causal:
                mask = torch.arange(k.shape[1], device=q.device)[None, :] <= torch.arange(a, b, device=q.device)[:, None]
            o, l = reference.attention(qq, kk, vv, attn_mask=mask, return_lse=True)
        else:
            sub = SkipList(lst.counts[:, :, a // tm: num_tiles(b, tm)], lst.indices[:, :, a // tm: num_tiles(b, tm)],
                           lst.tile, b - a, lst.seq_k)
            o, _, l = skip_reference.skip_attention(qq, kk, vv, sub, -1.0, return_lse=True)
        gq, gk, gv = torch.autograd.grad(o, (qq, kk, vv), do[:, a:b].float())
        dq[:, a:b] = gq
        dk += gk
        dv += gv
        out[:, a:b] = o.detach().to(q.dtype)
        lse[:, :, a:b] = l.detach()
        del o, l, gq, gk, gv
    return out, lse, dq, dk, dv


@gpu
@pytest.mark.parametrize("S,Hq,Hk,density,causal", [
    (4096, 4, 2, 0.3, False), (4096, 4, 2, None, False), (4096, 4, 4, None, True), (32760, 2, 1, 0.15, False),
    (32760, 2, 2, None, False)])
def test_gpu_bf16(S, Hq, Hk, density, causal):
    D = 128
    q, k, v, do = make_inputs(1, S, S, Hq, Hk, D, torch.bfloat16, seed=20, device="cuda")
    lst = None
    if density is not None:
        T = num_tiles(S, 128)
        lst = SkipList.from_mask(random_mask(1, Hq, T, T, density, seed=21, device="cuda"), (128, 128), S, S)
    out, lse, *want = chunked_ref_grads(q, k, v, do, lst, causal=causal)
    got = bwd.attention_backward(q, k, v, out, lse, do, skip_list=lst, causal=causal)
    torch.cuda.synchronize()
    check(got, want, 2e-2)
    variants = ()
    if S == 4096 and not causal:   # the launch variants the benchmark times, same tolerance
        variants = (dict(flat=True, s1=3, s2=3), dict(flat=False, tma=False, s1=2), dict(N2=128, s2=2),
                    dict(N1=128, w1=8, s1=3))
    elif density is not None or causal:   # partial tiles / causal masks: the round-2 8-warp 128-key dK/dV programs
        variants = (dict(N1=128, w1=8, s1=3),)
    for var in variants:
        cfg = dict(bwd.CONFIGS[D], **var)
        got = bwd._backward_impl(q, k, v, out, lse, do, None, lst.counts if lst else None,
                                 lst.indices if lst else None, 128, 128, D ** -0.5, causal, cfg)
        check(got, want, 2e-2)


@gpu
@needs_fwd
def test_gpu_autograd_skip_fwd():
    S, Hq, Hk, D = 4096, 4, 2, 128
    q, k, v, do = make_inputs(1, S, S, Hq, Hk, D, torch.bfloat16, seed=22, device="cuda")
    lst = SkipList.from_mask(random_mask(1, Hq, 32, 32, 0.3, seed=23, device="cuda"), (128, 128), S, S)
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    out, _ = skip_fwd_op(qq, kk, vv, lst, return_lse=False)
    got = torch.autograd.grad(out, (qq, kk, vv), do)
    _, _, *want = chunked_ref_grads(q, k, v, do, lst)
    check(got, want, 2e-2)


@cpu_only
@needs_fwd
def test_public_entries_are_differentiable():
    """sparsepatch.kernels.skip.triton.skip_attention / attention: gradient == autograd through the reference."""
    from sparsepatch.kernels.skip import triton as skip
    B, S, Hq, Hk, D = 1, 150, 4, 2, 64
    q, k, v, do = make_inputs(B, S, S, Hq, Hk, D, torch.float32, seed=21)
    lst = SkipList.from_mask(random_mask(B, Hq, 3, 3, 0.5, seed=22), (64, 64), S, S)
    for fn, ref in ((lambda a, b, c: skip.skip_attention(a, b, c, lst, -5.0)[0],
                     lambda a, b, c: skip_reference.skip_attention(a, b, c, lst, -5.0)[0]),
                    (lambda a, b, c: skip.attention(a, b, c, causal=True),
                     lambda a, b, c: reference.attention(a, b, c, causal=True))):
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        got = torch.autograd.grad((fn(qq, kk, vv).double() * do.double()).sum(), (qq, kk, vv))
        q2, k2, v2 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        want = torch.autograd.grad((ref(q2, k2, v2) * do.double()).sum(), (q2, k2, v2))
        check(got, want, attention_rel_bound(q, k, v))


@cpu_only
@needs_fwd
def test_training_mode_triton_path_equals_reference_straight_through():
    """SkipConfig(backward=True): one Triton forward + backward over read ∩ kept == the reference's
    straight-through construction (same value, same approximate gradient)."""
    from sparsepatch.kernels.skip.stateful import SkipListBuffers, skip_step_differentiable
    from sparsepatch.testing import video_like_qkv
    steps = [video_like_qkv(frames=2, height=8, width=16, dim=64, step=i, seed=3) for i in range(3)]
    got, want = [], []
    for use_triton, sink in ((True, got), (False, want)):
        buf = SkipListBuffers.create(1, 2, 256, 256, (64, 64), "cpu")
        for q, k, v in steps:
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            out = skip_step_differentiable(qq, kk, vv, buf, -3.0, 0, must_do=[(0, 10)], backward_skip=True,
                                           use_triton=use_triton)
            out.square().sum().backward()
            sink.append((out.detach(), qq.grad, kk.grad, vv.grad, buf.current(0).to_mask()))
    assert got[-1][4].float().mean() < 0.9                          # lists really pruned
    for (q, k, v), a, b in zip(steps, got, want):
        assert torch.equal(a[4], b[4])                              # same lists
        check_bound(rel(a[0], b[0]), attention_rel_bound(q, k, v), "out")
        for ga, gb in zip(a[1:4], b[1:4]):
            check_bound(rel(ga, gb), attention_rel_bound(q, k, v), "grad")


def test_reference_fallback_for_training_mode_matches_the_kernel_function():
    """attention_backward(extra_skip=...) on inputs the kernel does not take (fp64) = the same function."""
    B, S, Hq, Hk, D = 1, 150, 4, 2, 64
    q, k, v, do = make_inputs(B, S, S, Hq, Hk, D, torch.float32, seed=31)
    full = random_mask(B, Hq, 3, 3, 0.7, seed=32)
    keep = full & random_mask(B, Hq, 3, 3, 0.6, seed=33)
    lst = SkipList.from_mask(full, (64, 64), S, S)
    kept = SkipList.from_mask(keep, (64, 64), S, S)
    out, _, lse = skip_reference.skip_attention(q.double(), k.double(), v.double(), lst, -5.0, return_lse=True)
    got = bwd.attention_backward(q.double(), k.double(), v.double(), out, lse, do.double(), skip_list=lst,
                                 extra_skip=kept)
    want = skip_reference.skip_attention_grads(q.double(), k.double(), v.double(), out, lse, do.double(), lst, kept)
    check(got, want, rel_bound(torch.float64, S))
    exact = skip_reference.skip_attention_grads(q.double(), k.double(), v.double(), out, lse, do.double(), lst)
    qq, kk, vv = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o2, _ = skip_reference.skip_attention(qq, kk, vv, lst, -5.0)
    # kept=None: the exact gradient; fp64 math, but the lse it is given is stored in fp32 (eps32 * |lse|)
    lse_max = lse[torch.isfinite(lse)].abs().max().item()
    check(exact, torch.autograd.grad(o2, (qq, kk, vv), do.double()), rel_bound(torch.float32, 1 + lse_max ** 2))
