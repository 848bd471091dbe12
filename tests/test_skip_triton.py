"""Triton skip-list / dense forward vs the reference.

CPU: runs under TRITON_INTERPRET=1 at tiny shapes (fp16/fp32). GPU (`-m gpu`): bf16/fp16 at realistic shapes.

Inputs have structure so tiles really drop: every q-tile / k-tile belongs to one of a few clusters (q and k share
a cluster centre), so tiles of other clusters visited after a same-cluster tile fall far below the running max.
q and k are quantised to multiples of 1/4, so q.k is exact in any fp32 summation order, every keep-test gain lies
on a lattice of step scale*log2(e)/16, and the threshold sits half a step off that lattice: the exact next-list
comparison cannot flip on rounding.
"""
from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_checks import CUDA, INTERP, attention_bounds, check_bound, cpu_only, gpu, max_err  # noqa: E402

from sparsepatch.kernels.dense import reference  # noqa: E402
from sparsepatch.kernels.skip import reference as skip_reference
from sparsepatch.kernels.skip import stateful
from sparsepatch.kernels._common import C_LAUNCH_VERSIONS  # noqa: E402
from sparsepatch.kernels.dense.reference import LOG2E  # noqa: E402
from sparsepatch.kernels.skip.skiplist import SkipList  # noqa: E402

skip = pytest.importorskip("sparsepatch.kernels.skip.triton")

needs_cuda = pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA")


def lattice_threshold(D, scale=None, near=-5.0):
    """A threshold half a lattice step away from any reachable gain (see module docstring)."""
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    step = scale * LOG2E / 16
    return -(round(-near / step) + 0.5) * step


def structured_qkv(B, Sq, Sk, Hq, Hk, D, dtype, tile, *, seed, device="cpu", clusters=4, strength=1.0,
                   assign=None):
    """Random q/k/v with cluster structure per tile, q/k on the 1/4 lattice. Returns (q, k, v, assign)."""
    g = torch.Generator().manual_seed(seed)
    tm, tn = tile
    tq, tk = -(-Sq // tm), -(-Sk // tn)
    if assign is None:
        centres = torch.randint(0, 2, (clusters, D), generator=g).float() * 2 - 1
        cq = torch.randint(0, clusters, (B, tq, Hq), generator=g)
        ck = torch.randint(0, clusters, (B, tk, Hk), generator=g)
        assign = (centres, cq, ck)
    centres, cq, ck = assign
    qc = centres[cq].repeat_interleave(tm, 1)[:, :Sq]            # (B, Sq, Hq, D)
    kc = centres[ck].repeat_interleave(tn, 1)[:, :Sk]            # (B, Sk, Hk, D)
    q = qc * strength + 0.5 * torch.randn(B, Sq, Hq, D, generator=g)
    k = kc * strength + 0.5 * torch.randn(B, Sk, Hk, D, generator=g)
    q = (q * 4).round().clamp(-12, 12) / 4
    k = (k * 4).round().clamp(-12, 12) / 4
    v = torch.randn(B, Sk, Hk, D, generator=g)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), assign


def assert_close(out, ref, dtype, qkv=None):
    """qkv: the inputs, for fp32 (the attention error model of kernel_checks: the reference is fp64 math rounded
    once). fp16 / bf16: bounds in units of the format's rounding (P and the output are rounded to it)."""
    if dtype == torch.float32 and qkv is not None:
        assert torch.isfinite(out).all()
        check_bound(max_err(out, ref), attention_bounds(*qkv, torch.float32)[0], "out")
        return
    out, ref = out.float(), ref.float()
    assert torch.isfinite(out).all()
    rel = ((out - ref).norm() / ref.norm()).item()
    err = (out - ref).abs()
    if dtype == torch.bfloat16:
        assert err.max().item() <= 2e-2 * max(1.0, ref.abs().max().item()), err.max().item()
        assert rel <= 1e-2, rel
    else:  # fp16: 1e-3 absolute (~1 ulp at 1), plus the output's own fp16 rounding (half an ulp ~ 2^-11 relative)
        tol = 1e-3 + (2.0 ** -10) * ref.abs()
        assert (err <= tol).all(), (err - tol).max().item()
        assert rel <= 1e-3, rel


def assert_lse_close(lse, rlse, q, k, v):
    """fp32 LSEs on both sides (the kernel's scores are fp32 sums of fp16/fp32 products): attention_bounds' lse
    bound on the interpreter; on the GPU the earlier 2e-3 absolute + 1e-4 relative (not re-derived there)."""
    if not INTERP:
        torch.testing.assert_close(lse, rlse, atol=2e-3, rtol=1e-4)
        return
    fin = torch.isfinite(rlse)
    assert torch.equal(fin, torch.isfinite(lse)) and torch.equal(lse[~fin], rlse[~fin])   # fully skipped rows
    check_bound(max_err(lse[fin], rlse[fin]), attention_bounds(q, k, v, torch.float32)[1], "lse")


def check_skip(q, k, v, lst, thr, *, tile, must_do=None, dtype):
    out, nxt, lse = skip.skip_attention(q, k, v, lst, thr, must_do=must_do, return_lse=True, tile=tile)
    rout, rnxt, rlse = skip_reference.skip_attention(q, k, v, lst, thr, must_do=must_do, return_lse=True, tile=tile)
    assert_close(out, rout, dtype, (q, k, v))
    assert_lse_close(lse, rlse, q, k, v)
    assert nxt.equal(rnxt), (nxt.to_mask() ^ rnxt.to_mask()).sum().item()
    return nxt


# ------------------------------------------------------------------------------------------------- interpreter


@cpu_only
@pytest.mark.parametrize("dtype,tile,D", [(torch.float16, (64, 64), 64), (torch.float32, (128, 128), 64),
                                          (torch.float16, (64, 128), 128)])
def test_skip_two_calls_interp(dtype, tile, D):
    B, S, Hq, Hk = 1, 300, 4, 2
    thr = lattice_threshold(D)
    q, k, v, assign = structured_qkv(B, S, S, Hq, Hk, D, dtype, tile, seed=1)
    nxt = check_skip(q, k, v, None, thr, tile=tile, dtype=dtype)
    assert nxt.density().item() < 0.9
    # Second call: fresh inputs with the same structure, reading the pruned list.
    q, k, v, _ = structured_qkv(B, S, S, Hq, Hk, D, dtype, tile, seed=2, assign=assign)
    nxt2 = check_skip(q, k, v, nxt, thr, tile=tile, dtype=dtype)
    assert nxt2.density().item() < 1.0


@cpu_only
@pytest.mark.parametrize("extra", [{}, dict(head_chunk=True, host_desc=True),
                                   dict(head_chunk=True, host_desc=True, popc=True, pf_next=1)])
def test_skip_many_tiles_interp(monkeypatch, extra):
    """More than 32 k-tiles per row (several keep-bit words), Sq != Sk, partial last k-tile."""
    for key in list(skip.SKIP_CONFIGS):
        monkeypatch.setitem(skip.SKIP_CONFIGS, key, dict(skip.SKIP_CONFIGS[key], **extra))
    dtype, tile, D = torch.float16, (32, 16), 64
    thr = lattice_threshold(D)
    q, k, v, assign = structured_qkv(1, 64, 600, 2, 1, D, dtype, tile, seed=7, clusters=3)
    nxt = check_skip(q, k, v, None, thr, tile=tile, dtype=dtype)
    assert nxt.density().item() < 0.9
    q, k, v, _ = structured_qkv(1, 64, 600, 2, 1, D, dtype, tile, seed=8, assign=assign)
    check_skip(q, k, v, nxt, thr, tile=tile, dtype=dtype)


@cpu_only
@pytest.mark.parametrize("extra", [dict(host_desc=True),
                                   dict(host_desc=True, head_chunk=True, q_desc=True, o_desc=True),
                                   dict(host_desc=True, head_chunk=True, q_desc=True, o_desc=True, popc=True,
                                        pf_next=1)])
def test_skip_launch_variants_interp(monkeypatch, extra):
    """Host TMA descriptors over the (B, H, S, D) view (K/V; with q_desc / o_desc also q and out), list head
    loaded with its count: same outputs and next lists as the reference, GQA, strided inputs, must_do, 2 calls."""
    for key in list(skip.SKIP_CONFIGS):
        monkeypatch.setitem(skip.SKIP_CONFIGS, key, dict(skip.SKIP_CONFIGS[key], **extra))
    B, S, Hq, Hk, D, tile = 2, 330, 2, 1, 64, (64, 64)
    dtype = torch.float16
    thr = lattice_threshold(D)
    q, k, v, assign = structured_qkv(B, S, S, Hq, Hk, D, dtype, tile, seed=11)
    fused = torch.stack([q, k.expand(-1, -1, Hq, -1), v.expand(-1, -1, Hq, -1)], dim=2)
    q, k, v = fused[:, :, 0], fused[:, :, 1][:, :, :Hk], fused[:, :, 2][:, :, :Hk]
    nxt = check_skip(q, k, v, None, thr, tile=tile, must_do=[(0, 20)], dtype=dtype)
    assert nxt.density().item() < 0.9
    q, k, v, _ = structured_qkv(B, S, S, Hq, Hk, D, dtype, tile, seed=12, assign=assign)
    check_skip(q, k, v, nxt, thr, tile=tile, dtype=dtype)


@cpu_only
def test_skip_must_do_strided_interp():
    B, S, Hq, Hk, D, tile = 2, 200, 2, 1, 64, (64, 64)
    dtype = torch.float16
    thr = lattice_threshold(D)
    q, k, v, assign = structured_qkv(B, S, S, Hq, Hk, D, dtype, tile, seed=3)
    # Strided inputs as diffusers passes them: views into one fused (B, S, 3, H, D) buffer (Hk == Hq here).
    fused = torch.stack([q, k.expand(-1, -1, Hq, -1), v.expand(-1, -1, Hq, -1)], dim=2)
    q, k, v = fused[:, :, 0], fused[:, :, 1], fused[:, :, 2]
    must_do = [(0, 30), (190, 200)]
    mask = torch.rand(B, Hq, 4, 4, generator=torch.Generator().manual_seed(4)) < 0.5
    lst = SkipList.from_mask(mask, tile, S, S)
    nxt = check_skip(q, k, v, lst, thr, tile=tile, must_do=must_do, dtype=dtype)
    assert nxt.density().item() < 1.0


@cpu_only
def test_dense_interp():
    dtype = torch.float16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 130, 4, 64, generator=g).to(dtype)
    k = torch.randn(1, 150, 2, 64, generator=g).to(dtype)
    v = torch.randn(1, 150, 2, 64, generator=g).to(dtype)
    for causal in (False, True):
        out, lse = skip.attention(q, k, v, causal=causal, return_lse=True)
        rout, rlse = reference.attention(q, k, v, causal=causal, return_lse=True)
        assert_close(out, rout, dtype)
        assert_lse_close(lse, rlse, q, k, v)
    # decode: one query sees every key
    out = skip.attention(q[:, -1:], k, v, causal=True)
    assert_close(out, reference.attention(q[:, -1:], k, v, causal=True), dtype)


@cpu_only
@pytest.mark.parametrize("warmup,calls", [(1, 3), (0, 1), (5, 3)])
def test_repair_nonfinite_kernel_interp(warmup, calls):
    """The one-launch repair after a stateful call: q-tiles whose output holds a NaN / inf get the list they read in
    the slot the call wrote (other q-tiles and the read slot untouched); the call is counted once however many
    q-tiles are bad; a warm-up call changes nothing."""
    B, Sq, Hq, D, tm, Tk = 2, 200, 3, 40, 64, 7
    Tq = -(-Sq // tm)
    g = torch.Generator().manual_seed(3)
    counts = torch.randint(0, Tk + 1, (2, B, Hq, Tq), generator=g, dtype=torch.int32)
    indices = torch.randint(0, Tk, (2, B, Hq, Tq, Tk), generator=g, dtype=torch.int32)
    out = torch.randn(B, Sq, Hq, D, generator=g)
    out[0, 5, 1, 3] = float("nan")            # q-tile 0 of (b 0, h 1)
    out[1, Sq - 1, 2, D - 1] = float("-inf")  # the partial last q-tile of (b 1, h 2)
    step = torch.tensor([calls], dtype=torch.int64)
    nonfinite = torch.zeros(2, dtype=torch.int64)
    before_c, before_i = counts.clone(), indices.clone()
    skip.repair_nonfinite(out, counts, indices, step, warmup, tm, nonfinite)
    skip.repair_nonfinite(out, counts, indices, step, warmup, tm, nonfinite)   # same call again: counted once
    n = calls - 1
    if n < warmup:
        assert counts.equal(before_c) and indices.equal(before_i) and int(nonfinite[0]) == 0
        return
    rd, wr = (n - warmup) % 2, 1 - (n - warmup) % 2
    want_c, want_i = before_c.clone(), before_i.clone()
    for b, h, t in ((0, 1, 0), (1, 2, Tq - 1)):
        want_c[wr, b, h, t] = before_c[rd, b, h, t]
        want_i[wr, b, h, t] = before_i[rd, b, h, t]
    assert counts.equal(want_c) and indices.equal(want_i)
    assert int(nonfinite[0]) == 1 and int(nonfinite[1]) == calls
    step += 1                                  # the next call, also bad: counted again
    skip.repair_nonfinite(out, counts, indices, step, warmup, tm, nonfinite)
    assert int(nonfinite[0]) == 2


@cpu_only
def test_skip_step_op_body_on_the_triton_route_interp(monkeypatch):
    """The op body `_skip_step_impl` on the flash_triton route (what CUDA calls take): the Triton step, then the
    one-launch non-finite repair; against the reference backend's body over a warm-up call, a clean call and a call
    with a non-finite q-tile (whose written list must equal the list it read)."""
    from sparsepatch.kernels import dispatch
    from sparsepatch.kernels.skip import op as skip_op
    real_route = skip_op.DISPATCH.route
    monkeypatch.setattr(skip_op.DISPATCH, "route", lambda call, backend=None: dispatch.Route(
        call.op, "flash_triton", "forced by the test", ()) if backend is None else real_route(call, backend))
    B, S, Hq, Hk, D, tile, dtype = 1, 200, 2, 1, 64, (64, 64), torch.float16
    thr = lattice_threshold(D)
    bufs = stateful.SkipListBuffers.create(B, Hq, S, S, tile, "cpu")
    refb = stateful.SkipListBuffers.create(B, Hq, S, S, tile, "cpu")
    assign = None
    for call in range(3):
        q, k, v, assign = structured_qkv(B, S, S, Hq, Hk, D, dtype, tile, seed=20 + call, assign=assign)
        if call == 2:
            q = q.clone()
            q[0, 70, 1, :] = float("nan")                        # q-tile 1 of head 1
        args = (thr, 1, tile[0], tile[1], 1 / math.sqrt(D), [])
        out = stateful._skip_step_impl(q, k, v, bufs.counts, bufs.indices, bufs.step, bufs.density,
                                       bufs.nonfinite, *args)
        rout = stateful._skip_step_portable(q, k, v, refb.counts, refb.indices, refb.step, refb.density, *args,
                                            refb.nonfinite, "reference")
        fin = torch.isfinite(rout)
        assert torch.equal(fin, torch.isfinite(out))
        assert_close(torch.where(fin, out, 0), torch.where(fin, rout, 0), dtype)
        assert bufs.calls() == refb.calls() == call + 1
        assert bufs.current(1).equal(refb.current(1))
    assert int(bufs.nonfinite[0]) == int(refb.nonfinite[0]) == 1
    read, wrote = bufs.current(0), bufs.current(1)
    assert torch.equal(wrote.to_mask()[0, 1, 1], read.to_mask()[0, 1, 1])


@cpu_only
def test_repair_kernel_and_its_torch_fallback_agree(monkeypatch):
    """A Triton that cannot build the repair kernel falls back (one warning) to torch ops with the same result."""
    B, Sq, Hq, D, tm, Tk = 1, 130, 2, 32, 64, 5
    g = torch.Generator().manual_seed(4)
    counts = torch.randint(0, Tk + 1, (2, B, Hq, 3), generator=g, dtype=torch.int32)
    indices = torch.randint(0, Tk, (2, B, Hq, 3, Tk), generator=g, dtype=torch.int32)
    out = torch.randn(B, Sq, Hq, D, generator=g)
    out[0, 70, 0, 1] = float("inf")
    results = []
    for broken in (False, True):
        c, i, nf, step = counts.clone(), indices.clone(), torch.zeros(2, dtype=torch.int64), torch.tensor([2])
        monkeypatch.setattr(stateful, "_REPAIR_KERNEL_OK", [True])
        if broken:
            def fail(*a, **k):
                raise RuntimeError("no kernel here")
            monkeypatch.setattr(skip, "repair_nonfinite", fail)
            with pytest.warns(UserWarning, match="repair kernel failed"):
                stateful._keep_read_where_nonfinite(out, c, i, step, 1, tm, nf)
            assert stateful._REPAIR_KERNEL_OK[0] is False
        else:
            stateful._keep_read_where_nonfinite(out, c, i, step, 1, tm, nf)
        results.append((c, i, int(nf[0])))
    assert results[0][0].equal(results[1][0]) and results[0][1].equal(results[1][1])
    assert results[0][2] == results[1][2] == 1
    assert not results[0][0].equal(counts) or not results[0][1].equal(indices)   # the bad q-tile was repaired


@cpu_only
@pytest.mark.parametrize("B,must_do", [(1, [0, 20]), (2, [])])
def test_skip_step_interp(B, must_do):
    """skip_step against the reference over 3 calls: output, the carried lists, the call counter and the density
    history (kept by one fused launch per call)."""
    S, Hq, Hk, D, tile = 200, 2, 1, 64, (64, 64)
    dtype = torch.float16
    thr = lattice_threshold(D)
    bufs = stateful.SkipListBuffers.create(B, Hq, S, S, tile, "cpu")
    refb = stateful.SkipListBuffers.create(B, Hq, S, S, tile, "cpu")
    assign = None
    for call in range(3):
        q, k, v, assign = structured_qkv(B, S, S, Hq, Hk, D, dtype, tile, seed=10 + call, assign=assign)
        args = (thr, 1, tile[0], tile[1], 1 / math.sqrt(D), must_do)
        out = skip.skip_step(q, k, v, bufs.counts, bufs.indices, bufs.step, bufs.density, *args)
        rout = stateful._skip_step_portable(q, k, v, refb.counts, refb.indices, refb.step, refb.density, *args,
                                            refb.nonfinite, "reference")
        assert_close(out, rout, dtype)
        assert bufs.calls() == refb.calls() == call + 1
        assert bufs.current(1).equal(refb.current(1))
        torch.testing.assert_close(bufs.history(), refb.history())
    assert bufs.current(1).density().item() < 1.0


@cpu_only
def test_step_density_any_density_layout():
    """The fused density / step launch of skip_step: a warm-up call records 1, later calls the read slot's counts
    / (H * Tq * Tk) per batch element, into a density history of any strides; the counter advances each call."""
    B, H, Tq, Tk, cap = 2, 3, 5, 7, 4
    g = torch.Generator().manual_seed(3)
    cnt = torch.randint(0, Tk + 1, (2, B, H, Tq), generator=g, dtype=torch.int32)
    step = torch.zeros(1, dtype=torch.int64)
    density = torch.full((B, cap), -1.0).t()          # (cap, B) view with strides (1, cap)
    for call in range(cap + 1):                      # the last call is past the history: not recorded
        skip._step_density(cnt, step, density, 1, Tk)
        assert step.item() == call + 1
    want = torch.stack([torch.ones(B)] + [cnt[(n - 1) % 2].float().sum((1, 2)) / (H * Tq * Tk)
                                          for n in range(1, cap)])
    torch.testing.assert_close(density, want)


def test_bad_inputs():
    q = torch.randn(1, 16, 2, 96, dtype=torch.float16)
    assert not skip.supports(q)
    with pytest.raises(ValueError, match="head dim"):
        skip.attention(q, q, q)
    q = torch.randn(1, 16, 2, 64, dtype=torch.float16)
    assert not skip.supports(q, attn_mask=torch.ones(16, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="threshold"):
        skip.skip_attention(q, q, q, None, 0.5)
    with pytest.raises(ValueError, match="tile"):
        skip.skip_attention(q, q, q, None, -5.0, tile=(256, 128))


# ------------------------------------------------------------------------------------------------- GPU


GLUON_VARIANTS = {"gluon": {}, "gluon_plain": dict(gluon_kstage=False, gluon_pv_async=False)}


def _use_gluon(monkeypatch, on, *tables, variant="gluon"):
    """Route the 128x128-tile skip / dense calls of `tables` (default both) to the Gluon kernel (with the options
    of GLUON_VARIANTS[variant]) or the Triton one."""
    for table in tables or (skip.SKIP_CONFIGS, skip.CONFIGS):
        for key in list(table):
            monkeypatch.setitem(table, key, dict(table[key], gluon=on, **(GLUON_VARIANTS[variant] if on else {})))


def _assert_gluon_ran(q, k, v, tile):
    """The Gluon kernel served these inputs (not the Triton fallback after a failed launch)."""
    from sparsepatch.kernels.skip import gluon as skip_gluon
    assert skip_gluon.supported(q, k, v, tile) and skip._GLUON_OK[0]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("S,D,tile,H", [(4096, 128, (128, 128), (4, 2)), (4000, 64, (64, 64), (2, 2)),
                                        (32760, 128, (128, 128), (1, 1)), (8000, 128, (128, 128), (3, 1)),
                                        (4000, 64, (128, 128), (2, 1))])
@pytest.mark.parametrize("gluon", [False, "gluon", "gluon_plain"])
def test_skip_gpu(monkeypatch, dtype, S, D, tile, H, gluon):
    if gluon and tile != (128, 128):
        pytest.skip("the Gluon kernel serves tile (128, 128) only")
    _use_gluon(monkeypatch, bool(gluon), skip.SKIP_CONFIGS, variant=gluon or "gluon")
    Hq, Hk = H
    thr = lattice_threshold(D)
    q, k, v, assign = structured_qkv(1, S, S, Hq, Hk, D, dtype, tile, seed=20, device="cuda", clusters=8)
    nxt = check_skip(q, k, v, None, thr, tile=tile, dtype=dtype)
    assert nxt.density().item() < 0.9
    q, k, v, _ = structured_qkv(1, S, S, Hq, Hk, D, dtype, tile, seed=21, device="cuda", assign=assign)
    check_skip(q, k, v, nxt, thr, tile=tile, dtype=dtype)
    if gluon:
        _assert_gluon_ran(q, k, v, tile)
    check_skip(q, k, v, nxt, thr, tile=tile, must_do=[(0, 300)], dtype=dtype)
    # forced rows and columns in the middle and at the partial end (text tokens after the video ones)
    check_skip(q, k, v, nxt, thr, tile=tile, must_do=[(1000, 1100), (S - 70, S)], dtype=dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", list(GLUON_VARIANTS))
def test_skip_gluon_edge_lists_gpu(monkeypatch, dtype, variant):
    """Gluon kernel: batch 2 (its 2-D descriptors span batches), partial last q- and k-tiles, GQA, an empty list
    (out 0, LSE -inf) and a list holding only the partial last k-tile."""
    from sparsepatch.kernels.skip import gluon as skip_gluon
    _use_gluon(monkeypatch, True, skip.SKIP_CONFIGS, variant=variant)
    B, S, Hq, Hk, D, tile = 2, 4000, 4, 2, 128, (128, 128)
    thr = lattice_threshold(D)
    q, k, v, assign = structured_qkv(B, S, S, Hq, Hk, D, dtype, tile, seed=70, device="cuda", clusters=6)
    if not skip_gluon.supported(q, k, v, tile):
        pytest.skip("Gluon kernel not available here")
    nxt = check_skip(q, k, v, None, thr, tile=tile, dtype=dtype)
    counts, idx = nxt.counts.clone(), nxt.indices.clone()
    counts[0, 1, 3] = 0
    counts[1, 2, 5] = 1
    idx[1, 2, 5, 0] = idx.shape[-1] - 1
    q, k, v, _ = structured_qkv(B, S, S, Hq, Hk, D, dtype, tile, seed=71, device="cuda", assign=assign)
    out = check_skip(q, k, v, SkipList(counts, idx, tile, S, S), thr, tile=tile, dtype=dtype)
    assert out.counts[0, 1, 3].item() == 0
    _assert_gluon_ran(q, k, v, tile)


@gpu
@needs_cuda
def test_skip_gluon_plans_gpu(monkeypatch):
    """Gluon kernel: later calls relaunch through a cached plan (fresh tensors each call): bitwise equal to Gluon's
    own launcher, skip and dense."""
    from sparsepatch.kernels.skip import gluon as skip_gluon
    _use_gluon(monkeypatch, True)
    S, D, tile, dtype = 4096, 128, (128, 128), torch.bfloat16
    thr = lattice_threshold(D)
    q, k, v, assign = structured_qkv(1, S, S, 4, 2, D, dtype, tile, seed=80, device="cuda", clusters=8)
    if not skip_gluon.supported(q, k, v, tile):
        pytest.skip("Gluon kernel not available here")
    skip_gluon._PLANS.clear()
    nxt = check_skip(q, k, v, None, thr, tile=tile, dtype=dtype)
    skip.attention(q, k, v)
    n_plans = len(skip_gluon._PLANS)
    assert n_plans >= 2 and skip_gluon._DIRECT[0]
    for seed in (81, 82):
        q, k, v, _ = structured_qkv(1, S, S, 4, 2, D, dtype, tile, seed=seed, device="cuda", assign=assign)
        q, k, v = q.clone(), k.clone(), v.clone()
        via_plan = skip.skip_attention(q, k, v, nxt, thr, return_lse=True)
        dense_plan = skip.attention(q, k, v)
        assert len(skip_gluon._PLANS) == n_plans and skip_gluon._DIRECT[0]
        skip_gluon._DIRECT[0] = False
        try:
            via_jit = skip.skip_attention(q, k, v, nxt, thr, return_lse=True)
            dense_jit = skip.attention(q, k, v)
        finally:
            skip_gluon._DIRECT[0] = True
        assert torch.equal(via_plan[0], via_jit[0]) and via_plan[1].equal(via_jit[1])
        assert torch.equal(via_plan[2], via_jit[2]) and torch.equal(dense_plan, dense_jit)
        check_skip(q, k, v, nxt, thr, tile=tile, dtype=dtype)
        nxt = via_plan[1]


@gpu
@needs_cuda
@pytest.mark.parametrize("B,S,D", [(2, 4000, 64), (1, 4096, 128)])
def test_gluon_head_major_inputs_gpu(monkeypatch, B, S, D):
    """The Gluon kernel on head-major q / k (the (B, S, H, D) views of contiguous (B, H, S, D) tensors, as SDPA
    callers such as CogVideoX hand over) with a sequence-major v: dense, causal, skip with must_do, against the
    reference on the same values; batch 2 and a partial last tile (rows past a head's S belong to the next head)."""
    from sparsepatch.kernels.skip import gluon as skip_gluon
    from sparsepatch.kernels.dispatch import memory_layout
    _use_gluon(monkeypatch, True)
    for key in skip.CONFIGS:
        monkeypatch.setitem(skip.CONFIGS, key, dict(skip.CONFIGS[key], causal_gluon=True))
    dtype, tile, Hq, Hk = torch.bfloat16, (128, 128), 4, 2
    thr = lattice_threshold(D)
    q, k, v, _ = structured_qkv(B, S, S, Hq, Hk, D, dtype, tile, seed=90, device="cuda", clusters=6)
    qh, kh = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k))
    assert memory_layout(qh) == memory_layout(kh) == "head" and memory_layout(v) == "seq"
    if not skip_gluon.supported(qh, kh, v, tile):
        pytest.skip("Gluon kernel not available here")
    for causal in (False, True):
        out, lse = skip.attention(qh, kh, v, causal=causal, return_lse=True)
        rout, rlse = reference.attention(q, k, v, causal=causal, return_lse=True)
        assert_close(out, rout, dtype)
        torch.testing.assert_close(lse, rlse, atol=2e-3, rtol=1e-4)
    nxt = check_skip(qh, kh, v, None, thr, tile=tile, must_do=[(0, 226)], dtype=dtype)
    check_skip(qh, kh, v, nxt, thr, tile=tile, must_do=[(0, 226)], dtype=dtype)
    _assert_gluon_ran(qh, kh, v, tile)


@gpu
@needs_cuda
@pytest.mark.parametrize("D", [64, 128, 256])
def test_gluon_causal_static_shares_gpu(monkeypatch, D):
    """The causal Gluon kernel with static round-robin shares (cfg dynamic off) against the reference: batch 2,
    3 heads, a partial last q-tile."""
    from sparsepatch.kernels.skip import gluon as skip_gluon
    for key in skip.CONFIGS:
        monkeypatch.setitem(skip.CONFIGS, key, dict(skip.CONFIGS[key], gluon=True, causal_gluon=True,
                                                    gluon_dynamic=False))
    g = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = (torch.randn(2, 1000, 3, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    if not skip_gluon.supported(q, k, v, (128, 128), dense=True):
        pytest.skip("Gluon kernel not available here")
    out, lse = skip.attention(q, k, v, causal=True, return_lse=True)
    assert skip._GLUON_OK[0]
    rout, rlse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert_close(out, rout, torch.bfloat16)
    torch.testing.assert_close(lse, rlse, atol=2e-3, rtol=1e-4)


@gpu
@needs_cuda
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("B,Sq,Sk,H", [(2, 1000, 1000, (3, 3)), (1, 8000, 8256, (8, 2))])
def test_gluon_causal_dynamic_gpu(monkeypatch, D, B, Sq, Sk, H):
    """cfg dynamic (q-tiles handed out by an atomic counter) against the reference: fewer q-tiles than programs (48,
    every program draws once and stops) and many more (504, GQA, a diagonal offset by 256 keys, partial last
    q-tile); three calls in a row and a CUDA-graph replay (the counter starts at 0 on every call)."""
    from sparsepatch.kernels.skip import gluon as skip_gluon
    for key in skip.CONFIGS:
        monkeypatch.setitem(skip.CONFIGS, key, dict(skip.CONFIGS[key], gluon=True, causal_gluon=True,
                                                    gluon_dynamic=True))
    Hq, Hk = H
    g = torch.Generator(device="cuda").manual_seed(10)
    q = torch.randn(B, Sq, Hq, D, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(B, Sk, Hk, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    if not skip_gluon.supported(q, k, v, (128, 128), dense=True):
        pytest.skip("Gluon kernel not available here")
    rout, rlse = reference.attention(q, k, v, causal=True, return_lse=True)
    for _ in range(3):
        out, lse = skip.attention(q, k, v, causal=True, return_lse=True)
        assert skip._GLUON_OK[0]
        assert_close(out, rout, torch.bfloat16)
        torch.testing.assert_close(lse, rlse, atol=2e-3, rtol=1e-4)
    static = skip_gluon.dense_fwd(q, k, v, D ** -0.5, False, cfg=dict(dynamic=False), causal=True)[0]
    assert torch.equal(out, static)   # same q-tile arithmetic, only the program that runs it differs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = skip.attention(q, k, v, causal=True)
    for _ in range(2):
        gout.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(gout, out)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,Sq,Sk,H,causal,head_major", [(2, 4000, 4000, (4, 2), False, False),
                                                          (2, 4000, 4000, (4, 1), True, True),
                                                          (1, 1000, 1256, (2, 2), True, False),
                                                          (1, 4096, 4096, (2, 2), True, False),
                                                          (1, 300, 5000, (2, 1), False, True)])
def test_gluon_head_dim_256_dense_gpu(dtype, B, Sq, Sk, H, causal, head_major):
    """Head dim 256 on the Gluon kernel (64-key tiles, so a causal q-tile's diagonal spans its last two key tiles):
    against the reference, batch 2, GQA, partial tiles, an offset diagonal, head-major inputs; training raises."""
    from sparsepatch.kernels.skip import gluon as skip_gluon
    Hq, Hk = H
    g = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(B, Sq, Hq, 256, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, Sk, Hk, 256, device="cuda", generator=g).to(dtype)
    v = torch.randn(B, Sk, Hk, 256, device="cuda", generator=g).to(dtype)
    if head_major:
        q, k = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k))
    if not skip_gluon.supported(q, k, v, (128, 128), dense=True):
        pytest.skip("Gluon kernel not available here")
    out, lse = skip.attention(q, k, v, causal=causal, return_lse=True)
    assert skip._GLUON_OK[0]
    rout, rlse = reference.attention(q, k, v, causal=causal, return_lse=True)
    assert_close(out, rout, dtype)
    torch.testing.assert_close(lse, rlse, atol=2e-3, rtol=1e-4)
    with pytest.raises(ValueError, match="inference only"):
        skip.attention(q.detach().requires_grad_(), k, v, causal=causal)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Sq,Sk,D,causal", [(4096, 4096, 128, False), (4000, 4100, 64, True),
                                            (1, 5000, 128, True), (32760, 32760, 128, False),
                                            (4000, 4100, 64, False), (4096, 4096, 128, True),
                                            (4000, 4000, 128, True), (1000, 1256, 128, True),
                                            (4096, 4096, 64, True)])
@pytest.mark.parametrize("gluon", [False, True])
def test_dense_gpu(monkeypatch, dtype, Sq, Sk, D, causal, gluon):
    """Dense forward vs the reference; with gluon, causal shapes that `supports_causal` takes (Sk - Sq a multiple of
    the key tile: several q-tiles, a partial last tile, an offset diagonal) run the Gluon kernel."""
    from sparsepatch.kernels.skip import gluon as skip_gluon
    _use_gluon(monkeypatch, gluon, skip.CONFIGS)
    if gluon and causal:
        for key in skip.CONFIGS:
            monkeypatch.setitem(skip.CONFIGS, key, dict(skip.CONFIGS[key], causal_gluon=True))
    g = torch.Generator(device="cuda").manual_seed(6)
    H = 2 if Sq > 10000 else 4
    q = torch.randn(1, Sq, H, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(1, Sk, H // 2, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(1, Sk, H // 2, D, device="cuda", generator=g).to(dtype)
    out, lse = skip.attention(q, k, v, causal=causal, return_lse=True)
    if gluon and (not causal or skip_gluon.supports_causal(q, k)):
        _assert_gluon_ran(q, k, v, (128, 128))
    rout, rlse = reference.attention(q, k, v, causal=causal, return_lse=True)
    assert_close(out, rout, dtype)
    torch.testing.assert_close(lse, rlse, atol=2e-3, rtol=1e-4)


@gpu
@needs_cuda
def test_launch_plans_gpu(monkeypatch):
    """Later calls relaunch the compiled kernel through a cached plan (fresh tensors each call, so every pointer
    and descriptor is re-filled): bitwise equal to Triton's own launcher, and to the reference's lists."""
    _use_gluon(monkeypatch, False)   # the Triton kernels (the Gluon one has its own plan test)
    S, D, tile, dtype = 4096, 128, (128, 128), torch.bfloat16
    thr = lattice_threshold(D)
    skip._PLANS.clear()
    q, k, v, assign = structured_qkv(1, S, S, 4, 2, D, dtype, tile, seed=60, device="cuda", clusters=8)
    nxt = check_skip(q, k, v, None, thr, tile=tile, dtype=dtype)            # first calls: Triton's launcher
    dense0 = skip.attention(q, k, v, return_lse=True)
    n_plans = len(skip._PLANS)
    assert n_plans >= 1 and skip._DIRECT[0]
    if triton.__version__ in C_LAUNCH_VERSIONS:   # the compiled launcher is called directly, not Triton's runner
        assert all(getattr(plan[0], "direct", False) for plan in skip._PLANS.values())
    for seed in (61, 62):
        q, k, v, _ = structured_qkv(1, S, S, 4, 2, D, dtype, tile, seed=seed, device="cuda", assign=assign)
        q, k, v = q.clone(), k.clone(), v.clone()                            # new pointers
        via_plan = skip.skip_attention(q, k, v, nxt, thr, return_lse=True)
        dense_plan = skip.attention(q, k, v, return_lse=True)
        check_skip(q, k, v, nxt, thr, tile=tile, dtype=dtype)
        assert len(skip._PLANS) == n_plans and skip._DIRECT[0]              # reused, none added, no fallback
        skip._DIRECT[0] = False                                              # Triton's launcher, same inputs
        try:
            via_jit = skip.skip_attention(q, k, v, nxt, thr, return_lse=True)
            dense_jit = skip.attention(q, k, v, return_lse=True)
        finally:
            skip._DIRECT[0] = True
        assert torch.equal(via_plan[0], via_jit[0]) and via_plan[1].equal(via_jit[1])
        assert torch.equal(via_plan[2], via_jit[2])
        assert torch.equal(dense_plan[0], dense_jit[0]) and torch.equal(dense_plan[1], dense_jit[1])
        nxt = via_plan[1]
    assert not torch.equal(dense0[0], dense_plan[0])                          # the inputs really changed


def _step_inputs(S, D, dtype, seed, assign, tile):
    return structured_qkv(1, S, S, 4, 2, D, dtype, tile, seed=seed, device="cuda", assign=assign)


@gpu
@needs_cuda
@pytest.mark.parametrize("S,D,must_do", [(4096, 128, None), (4000, 128, None), (4000, 64, [(0, 226)]),
                                         (4096, 128, [(0, 130), (3900, 4096)])])
@pytest.mark.parametrize("gluon", [False, True])
def test_skip_step_gpu_graph_compile(monkeypatch, S, D, must_do, gluon):
    """skip_step (the patcher's stateful path) against the reference over 3 calls (a dense warm-up call, then lists
    carried between the slots), a CUDA graph replayed, and torch.compile without recompilation; on the Triton and
    the Gluon kernel, with and without a partial last tile, head dim 64 / 128, with and without must_do (text
    tokens first, as the CogVideoX adapter passes them, or at both ends)."""
    tile, dtype = (128, 128), torch.bfloat16
    flat = [x for rng in must_do or [] for x in rng]
    _use_gluon(monkeypatch, gluon, skip.SKIP_CONFIGS)
    thr = lattice_threshold(D)
    bufs = stateful.SkipListBuffers.create(1, 4, S, S, tile, torch.device("cuda"))
    refb = stateful.SkipListBuffers.create(1, 4, S, S, tile, torch.device("cuda"))
    assign = None
    for call in range(3):
        q, k, v, assign = _step_inputs(S, D, dtype, 30 + call, assign, tile)
        out = stateful.skip_step(q, k, v, bufs, thr, 1, must_do=must_do)
        rout = stateful._skip_step_portable(q, k, v, refb.counts, refb.indices, refb.step, refb.density, thr, 1,
                                            tile[0], tile[1], 1 / math.sqrt(D), flat, refb.nonfinite, "reference")
        assert_close(out, rout, dtype)
        assert bufs.current(1).equal(refb.current(1))
        torch.testing.assert_close(bufs.history(), refb.history())
    assert bufs.current(1).density().item() < (0.9 if must_do is None else 0.95)   # (forced tiles add up to 24%)
    if gluon:
        _assert_gluon_ran(q, k, v, tile)

    # CUDA graph: capture one step, replay twice; the device step counter drives slot choice.
    gb = stateful.SkipListBuffers.create(1, 4, S, S, tile, torch.device("cuda"))
    eager = stateful.SkipListBuffers.create(1, 4, S, S, tile, torch.device("cuda"))
    q, k, v, _ = _step_inputs(S, D, dtype, 40, assign, tile)
    stateful.skip_step(q, k, v, gb, thr, 1, must_do=must_do)   # warm-up call (compiles), also dense warmup step
    stateful.skip_step(q, k, v, eager, thr, 1, must_do=must_do)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = stateful.skip_step(q, k, v, gb, thr, 1, must_do=must_do)
    for _ in range(2):
        graph.replay()
        eout = stateful.skip_step(q, k, v, eager, thr, 1, must_do=must_do)
        torch.cuda.synchronize()
        assert torch.equal(gout, eout)
    assert gb.calls() == eager.calls() == 3   # capture itself does not run the step
    assert gb.current(1).equal(eager.current(1))

    # torch.compile: 5 calls, no recompilation.
    from torch import _dynamo
    _dynamo.reset()
    cb = stateful.SkipListBuffers.create(1, 4, S, S, tile, torch.device("cuda"))

    def f(q, k, v):
        return stateful.skip_step(q, k, v, cb, thr, 1, must_do=must_do) * 2

    cf = torch.compile(f, fullgraph=True)
    with _dynamo.config.patch(error_on_recompile=True):
        for call in range(5):
            q, k, v, _ = _step_inputs(S, D, dtype, 50 + call, assign, tile)
            cf(q, k, v)
    assert cb.calls() == 5


@gpu
@needs_cuda
def test_custom_ops_compile():
    q = torch.randn(1, 1000, 4, 128, device="cuda", dtype=torch.bfloat16)
    lst = SkipList.full(1, 4, 1000, 1000, (128, 128), device="cuda")

    def f(q):
        out, nxt = skip.skip_attention(q, q, q, lst, -5.0)
        return out + skip.attention(q, q, q), nxt.counts

    out, counts = torch.compile(f)(q)
    eout, ecounts = f(q)
    torch.testing.assert_close(out, eout)
    assert torch.equal(counts, ecounts)


# ------------------------------------------------------------------------------------------------- exp_poly


def _run_exp2_poly_ptx(asm: str, n: int, x: "np.ndarray") -> "np.ndarray":
    """Execute `exp2_poly_asm(n)` on fp32 inputs x (shape (m, n)) with numpy, one instruction at a time, fp32
    rounding per instruction (an FMA: the exact fp64 product plus the addend, rounded to fp32); ex2.approx is
    taken as an exactly rounded exp2 (the hardware's is within 2 ulp; the claim tested here is the FMA-pipe path)."""
    import numpy as np
    f32 = np.float32
    regs = {f"${n + i}": x[:, i].astype(f32) for i in range(n)}

    def val(tok):
        tok = tok.strip()
        if tok.startswith("0f"):
            return np.full(x.shape[0], np.uint32(int(tok[2:], 16)).view(f32))
        if tok.isdigit():
            return int(tok)
        return regs[tok]

    for line in asm.split("\n"):
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [t.strip() for t in rest.split(",")]
        a = [val(t) for t in src]
        if op == "ex2.approx.ftz.f32":
            r = np.exp2(a[0].astype(np.float64)).astype(f32)
        elif op == "max.ftz.f32":
            r = np.maximum(a[0], a[1])
        elif op == "add.rn.f32":
            r = (a[0] + a[1]).astype(f32)
        elif op == "sub.rn.f32":
            r = (a[0] - a[1]).astype(f32)
        elif op == "fma.rn.f32":
            r = (a[0].astype(np.float64) * a[1].astype(np.float64) + a[2].astype(np.float64)).astype(f32)
        elif op == "shl.b32":
            r = (a[0].view(np.uint32) << np.uint32(a[1])).view(f32)
        elif op == "add.s32":
            r = (a[0].view(np.int32) + a[1].view(np.int32)).view(f32)
        else:
            raise AssertionError(f"unexpected instruction {op}")
        regs[dst] = r
    return np.stack([regs[f"${i}"] for i in range(n)], 1)


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_exp2_poly_asm_matches_exp2(n):
    """The PTX of the Gluon kernel's mixed exponential (cfg exp_poly), executed instruction by instruction: outputs
    $0..$n-1 are 2^x of inputs $n..$2n-1 for x in [-126, 0], the FMA-pipe one within its polynomial's bound (7.5e-5
    relative: degree-3 minimax of 2^f on [-0.5, 0.5]; 1e-4 allows fp32 Horner rounding), and equal to the torch
    emulation `exp2_poly_reference` bit for bit; below -125 it returns ~2^-125 (a P of 2.4e-38, not 0)."""
    import numpy as np
    from sparsepatch.kernels.skip import gluon as skip_gluon
    rng = np.random.default_rng(n)
    x = np.concatenate([-rng.exponential(3.0, (4096, n)), -rng.uniform(0, 125, (4096, n)),
                        np.full((1, n), -0.0), np.full((1, n), -0.5), np.full((1, n), -125.0)]).astype(np.float32)
    y = _run_exp2_poly_ptx(skip_gluon.exp2_poly_asm(n), n, x)
    want = np.exp2(x.astype(np.float64))
    rel = np.abs(y.astype(np.float64) / want - 1.0)
    assert rel[:, :-1].max() < 2 ** -23    # MUFU lanes: exp2 itself here
    assert rel[:, -1].max() < 1e-4         # the polynomial lane
    assert rel[:, -1].max() > 1e-6         # (it is the polynomial, not an exact exp2)
    emu = skip_gluon.exp2_poly_reference(torch.from_numpy(x[:, -1])).numpy()
    assert np.array_equal(emu.view(np.int32), y[:, -1].view(np.int32))
    low = _run_exp2_poly_ptx(skip_gluon.exp2_poly_asm(n), n, np.full((1, n), -300.0, np.float32))[0, -1]
    assert abs(low / 2.0 ** -125 - 1.0) < 1e-4


def test_exp_poly_cfg_is_checked():
    from sparsepatch.kernels.skip import gluon as skip_gluon
    if not skip_gluon.HAS_GLUON:
        pytest.skip("no Gluon in this Triton")
    q = torch.zeros(1, 128, 1, 64)
    with pytest.raises(ValueError, match="exp_poly"):
        skip_gluon._launch(q, q, q, None, None, -5.0, 0.125, False, dict(exp_poly=4), False)


@gpu
@needs_cuda
@pytest.mark.parametrize("poly", [0, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_exp_poly_gpu(monkeypatch, poly, D, causal, dtype):
    """cfg exp_poly (8: one exponential in 8 on the FMA pipe; 0: none) against the reference, with the tolerances
    of the all-MUFU kernel (the polynomial's 7.5e-5 relative error is far below P's rounding to bf16 / fp16): GQA, a
    partial last tile, an offset causal diagonal; the skip kernel at D64 with the lists it writes."""
    from sparsepatch.kernels.skip import gluon as skip_gluon
    for table in (skip.CONFIGS, skip.SKIP_CONFIGS):
        for key in list(table):
            monkeypatch.setitem(table, key, dict(table[key], gluon=True, causal_gluon=True, gluon_exp_poly=poly))
    g = torch.Generator(device="cuda").manual_seed(11 + poly)
    Sq, Sk = (4000, 4128) if causal else (4000, 4000)
    q = torch.randn(2, Sq, 4, D, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(2, Sk, 2, D, device="cuda", generator=g).to(dtype) for _ in range(2))
    if not skip_gluon.supported(q, k, v, (128, 128), dense=True):
        pytest.skip("Gluon kernel not available here")
    out, lse = skip.attention(q, k, v, causal=causal, return_lse=True)
    _assert_gluon_ran(q, k, v, (128, 128))
    rout, rlse = reference.attention(q, k, v, causal=causal, return_lse=True)
    assert_close(out, rout, dtype)
    torch.testing.assert_close(lse, rlse, atol=2e-3, rtol=1e-4)
    mufu = skip_gluon.dense_fwd(q, k, v, D ** -0.5, False, cfg=dict(exp_poly=0), causal=causal)[0]
    # the option changes the arithmetic (and only it: exp_poly 0 is the all-MUFU kernel bit for bit)
    assert torch.equal(out, mufu) == (poly == 0)
    shipped = skip_gluon.dense_fwd(q, k, v, D ** -0.5, False, causal=causal)[0]
    assert torch.equal(shipped, out) == (poly == skip_gluon.GLUON_D64_DENSE_CONFIG["exp_poly"] if D == 64 else
                                         poly == skip_gluon.GLUON_SKIP_CONFIG["exp_poly"])
    if not causal and D == 64:
        tile, thr = (128, 128), lattice_threshold(D)
        qs, ks, vs, assign = structured_qkv(1, 4000, 4000, 2, 1, D, dtype, tile, seed=23, device="cuda", clusters=8)
        nxt = check_skip(qs, ks, vs, None, thr, tile=tile, dtype=dtype)
        qs, ks, vs, _ = structured_qkv(1, 4000, 4000, 2, 1, D, dtype, tile, seed=24, device="cuda", assign=assign)
        check_skip(qs, ks, vs, nxt, thr, tile=tile, dtype=dtype)
