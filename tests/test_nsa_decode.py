"""NSA decode path (kernels/nsa_decode.py): split-K decode vs the reference, through NSACache, CUDA graphs (GPU)."""
from __future__ import annotations

import math
import os

import pytest
import torch

from kernel_checks import assert_agree, attention_bounds, check_bound, max_err
from sparsepatch.config import NSAConfig
from sparsepatch.kernels.nsa import reference as ref

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not (CUDA or INTERPRET), reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
gpu = pytest.mark.gpu
DEV = "cuda" if CUDA and not INTERPRET else "cpu"


def rand(B, T, Hq, Hk, D, S, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g)
    k = torch.randn(B, S, Hk, D, generator=g)
    v = torch.randn(B, S, Hk, D, generator=g)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)]


def _mods():
    from sparsepatch.kernels.nsa import forward as nsa
    from sparsepatch.kernels.nsa import decode as nsa_decode
    return nsa, nsa_decode


@pytest.fixture
def count_decode(monkeypatch):
    """Counts calls of the decode path (and checks the dispatcher really takes it)."""
    _, dec = _mods()
    calls = []
    orig = dec.nsa_decode

    def wrapped(*a, **kw):
        calls.append(a[0].shape)
        return orig(*a, **kw)
    monkeypatch.setattr(dec, "nsa_decode", wrapped)
    return calls


def _tol(dtype, q, k, v):
    """fp32: a gated sum (gates <= 1) of three softmax attentions over subsets of k/v, each within attention_bounds
    of the reference (fp64 math rounded once; errors in quadrature). fp16: inputs rounded alike on both sides, the
    kernel rounds P and the output to fp16 (~4 ulps)."""
    return 3 ** 0.5 * attention_bounds(q, k, v, torch.float32)[0] if dtype == torch.float32 else 4e-3


# (S, block_size, compress_block, compress_stride, window, num_selected, D, Hq, Hk, B, gates, dtype)
CASES = [
    (150, 16, 16, 8, 32, 3, 16, 4, 2, 2, False, torch.float32),
    (301, 16, 8, 4, 32, 4, 32, 4, 1, 1, True, torch.float32),     # G 4, compress 8 / 4 (R = 4)
    (100, 16, 16, 8, 32, 3, 16, 2, 2, 1, True, torch.float16),    # MHA
    (257, 16, 16, 4, 32, 5, 32, 8, 4, 2, False, torch.float16),   # block just started (local block = 1 token)
    (10, 16, 16, 8, 32, 3, 16, 2, 1, 1, False, torch.float32),    # no complete compressed block yet
    (200, 16, 16, 8, 32, 40, 16, 2, 1, 1, True, torch.float32),   # num_selected > visible blocks (-1 padding)
]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[f"S{c[0]}-l{c[2]}d{c[3]}-G{c[7] // c[8]}-B{c[9]}-{str(c[11])[6:]}"
                                             for c in CASES])
def test_decode_matches_reference(case, count_decode):
    nsa, _ = _mods()
    S, bs, l, d, W, nsel, D, Hq, Hk, B, has_gates, dtype = case
    cfg = NSAConfig(block_size=bs, num_selected=nsel, window=W, compress_block=l, compress_stride=d)
    q, k, v = rand(B, 1, Hq, Hk, D, S, dtype=dtype, seed=S, device=DEV)
    gates = torch.rand(B, 1, Hq, 3, generator=torch.Generator().manual_seed(1)).to(DEV) if has_gates else None
    out, idx = nsa.nsa_attention(q, k, v, cfg, gates=gates, return_indices=True)
    want, widx = ref.nsa_attention(q, k, v, cfg, gates=gates, return_indices=True)
    assert len(count_decode) == 1
    assert out.dtype == q.dtype and out.shape == want.shape and idx.dtype == torch.int32
    assert torch.equal(idx.long(), widx)
    check_bound(max_err(out.float(), want.float()), _tol(dtype, q, k, v), "decode")


@needs_triton
@pytest.mark.parametrize("block_n, target", [(16, 1000), (16, 8)])
def test_decode_splits(monkeypatch, block_n, target):
    """Several compressed tiles per program and several splits (importance spilling across tiles / splits)."""
    nsa, dec = _mods()
    monkeypatch.setattr(dec, "CMP_BLOCK_N", block_n)
    monkeypatch.setattr(dec, "TARGET_PROGRAMS", target)
    cfg = NSAConfig(block_size=16, num_selected=4, window=32, compress_block=16, compress_stride=4)
    q, k, v = rand(2, 1, 8, 2, 16, 290, seed=7, device=DEV)
    gates = torch.rand(2, 1, 8, 3, generator=torch.Generator().manual_seed(2)).to(DEV)
    n_c = ref.num_compressed(290, cfg)
    plan = dec._plan(2, 2, 4, 290, n_c, cfg)
    assert plan[2] == math.ceil(n_c / block_n) and plan[4] > 1 and (target > 100 or plan[3] > 1)
    out, idx = nsa.nsa_attention(q, k, v, cfg, gates=gates, return_indices=True)
    want, widx = ref.nsa_attention(q, k, v, cfg, gates=gates, return_indices=True)
    assert torch.equal(idx.long(), widx)
    check_bound(max_err(out, want), _tol(q.dtype, q, k, v), "splits")
    # the given step (its merge over the same splits) with the reference's selection: the reference's output
    kc, vc = ref.compress_kv(k, v, cfg)
    got, _ = dec.nsa_decode(q, k, v, kc, vc, gates, 0.25, cfg, indices=idx)
    check_bound(max_err(got, want), _tol(q.dtype, q, k, v), "given, splits")


@needs_triton
@pytest.mark.parametrize("nsel, ties", [(4, False), (20, False), (4, True)])
def test_decode_topk_chunks(monkeypatch, nsel, ties):
    """Top-k over several score chunks: each chunk keeps its best min(chunk, next_pow2(nsel)) candidates and the
    attention kernel ranks their union; the indices must still equal the reference's exactly (ties to the lower
    index). S = 620 at block 16 -> 39 blocks, NBLK 64 -> 4 chunks of 16; nsel 20 keeps whole chunks."""
    nsa, dec = _mods()
    monkeypatch.setattr(dec, "SCORE_CHUNK", 16)
    cfg = NSAConfig(block_size=16, num_selected=nsel, window=32, compress_block=16, compress_stride=8)
    q, k, v = rand(2, 1, 4, 2, 16, 620, seed=21, device=DEV)
    if ties:                  # q = 0: every score is exactly equal, interior blocks tie and the lower index wins
        q = q * 0
    out, idx = nsa.nsa_attention(q, k, v, cfg, return_indices=True)
    want, widx = ref.nsa_attention(q, k, v, cfg, return_indices=True)
    assert torch.equal(idx.long(), widx)
    check_bound(max_err(out, want), _tol(q.dtype, q, k, v), "top-k chunks")


@needs_triton
@pytest.mark.parametrize("store_kv", [True, False])
def test_decode_cache_steps(store_kv, count_decode):
    """Prefill T through an NSACache, then n decode steps == the reference prefill of T + n at those positions."""
    nsa, _ = _mods()
    cfg = NSAConfig(block_size=16, num_selected=3, window=32, compress_block=16, compress_stride=8)
    T, n = 117, 12                                    # crosses compressed-block (every 8) and selection-block ends
    q, k, v = rand(2, T + n, 8, 2, 16, T + n, seed=11, device=DEV)
    gates = torch.rand(2, T + n, 8, 3, generator=torch.Generator().manual_seed(3)).to(DEV)
    w = (torch.randn(2, 2, 16, generator=torch.Generator().manual_seed(4)) / 4).to(DEV) if store_kv else None
    full, fidx = ref.nsa_attention(q, k, v, cfg, gates=gates, compress_weights=w, return_indices=True)
    cache = ref.NSACache(store_kv=store_kv)
    # prefill through the reference (same cache state as the Triton prefill; the interpreter is slow at T = 117)
    ref.nsa_attention(q[:, :T], k[:, :T], v[:, :T], cfg, gates=gates[:, :T], cache=cache, compress_weights=w)
    for t in range(T, T + n):
        kk, vv = (k[:, t:t + 1], v[:, t:t + 1]) if store_kv else (k[:, :t + 1], v[:, :t + 1])
        out, idx = nsa.nsa_attention(q[:, t:t + 1], kk, vv, cfg, gates=gates[:, t:t + 1], cache=cache,
                                     compress_weights=w, return_indices=True)
        assert torch.equal(idx.long(), fidx[:, t:t + 1]), t
        check_bound(max_err(out, full[:, t:t + 1]), _tol(q.dtype, q, k, v), f"step {t}")
    assert len(count_decode) == n
    assert cache.length == T + n and cache.k_cmp.shape[1] == ref.num_compressed(T + n, cfg)
    kc, vc = ref.compress_kv(k, v, cfg, w)
    # block sums of 16 terms, incremental vs at once, in fp32: scaled by the sums of |terms|
    wa = w.abs() if w is not None else None
    kc_abs, vc_abs = ref.compress_kv(k.abs(), v.abs(), cfg, wa)
    assert_agree(cache.k_cmp, kc, torch.float32, 16, magnitude=kc_abs.abs().max().item())
    assert_agree(cache.v_cmp, vc, torch.float32, 16, magnitude=vc_abs.abs().max().item())
    if store_kv:
        assert torch.equal(cache.k, k) and torch.equal(cache.v, v)


def test_cache_buffers_keep_behaviour():
    """NSACache appends into doubling buffers without autograd: same values, old views untouched, no realloc."""
    cfg = NSAConfig(block_size=16, num_selected=3, window=32, compress_block=16, compress_stride=8)
    _, k, v = rand(1, 1, 2, 2, 8, 80, seed=12)
    c = ref.NSACache()
    with torch.no_grad():
        c.update(k[:, :40], v[:, :40], cfg)
        c.update(k[:, 40:41], v[:, 40:41], cfg)
        old_k, old_kc = c.k, c.k_cmp
        ptr = c.k.data_ptr()
        for t in range(41, 80):
            c.update(k[:, t:t + 1], v[:, t:t + 1], cfg)
        assert c.k.data_ptr() == ptr                      # capacity 2 * 41 >= 80: no reallocation
    assert torch.equal(c.k, k) and torch.equal(c.v, v) and torch.equal(old_k, k[:, :41])
    kc, vc = ref.compress_kv(k, v, cfg)
    assert torch.equal(c.k_cmp, kc) and torch.equal(c.v_cmp, vc)
    assert torch.equal(old_kc, kc[:, :old_kc.shape[1]])
    # with autograd enabled: torch.cat as before (graph kept)
    kg = k[:, :1].clone().requires_grad_(True)
    k2, *_ = c.update(kg, v[:, :1], cfg)
    assert k2.requires_grad and k2.shape[1] == 81 and torch.equal(k2[:, :80], k)
    # store_kv=False: a shorter k restarts, the compressed cache is rebuilt
    c2 = ref.NSACache(store_kv=False)
    with torch.no_grad():
        c2.update(k[:, :70], v[:, :70], cfg)
        for t in range(71, 81):
            c2.update(k[:, :t], v[:, :t], cfg)
        c2.update(k[:, :30], v[:, :30], cfg)
    assert torch.equal(c2.k_cmp, ref.compress_kv(k[:, :30], v[:, :30], cfg)[0])


@needs_triton
def test_decode_not_taken_with_grad(count_decode):
    nsa, _ = _mods()
    cfg = NSAConfig(block_size=16, num_selected=3, window=32, compress_block=16, compress_stride=8)
    q, k, v = rand(1, 1, 2, 1, 16, 40, seed=13, device=DEV)
    q.requires_grad_(True)
    nsa.nsa_attention(q, k, v, cfg).sum().backward()
    assert not count_decode and q.grad is not None


# ------------------------------------------------------------------------------- given selection (selection="tile")
def _given_reference(q, k, v, kc, vc, gates, cfg, idx, scale):
    """Decode step at position S - 1 with the selected blocks `idx` (B, Hk, nsel; -1 = none) given: fp64 PyTorch
    (compressed and window branches as in nsa_reference, the selected branch over exactly the given blocks)."""
    B, _, Hq, D = q.shape
    S, Hk = k.shape[1], k.shape[2]
    G = Hq // Hk
    qd = q[:, 0].double()                                            # (B, Hq, D)

    def attend(keys, vals, mask):                                    # keys (B, N, Hk, D), mask (B, Hk, N)
        s = torch.einsum("bhd,bnhd->bhn", qd, keys.double().repeat_interleave(G, 2)) * scale
        p = ref._softmax(s.masked_fill(~mask.repeat_interleave(G, 1), float("-inf")))
        return torch.einsum("bhn,bnhd->bhd", p, vals.double().repeat_interleave(G, 2))
    pos = torch.arange(S, device=q.device)
    o_cmp = attend(kc, vc, torch.ones(B, Hk, kc.shape[1], dtype=torch.bool, device=q.device))   # all complete
    o_swa = attend(k, v, (pos > S - 1 - cfg.window).expand(B, Hk, S))                            # blocks visible
    sel = ((pos // cfg.block_size)[None, None, :, None] == idx.long()[:, :, None, :]).any(-1)      # (B, Hk, S)
    o_slc = attend(k, v, sel)
    g = gates[:, 0].double() if gates is not None else torch.full((B, Hq, 3), 1 / 3, dtype=torch.float64,
                                                                   device=q.device)
    out = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_swa
    return out[:, None].to(q.dtype)


def _given_case(case, seed_gates=1):
    S, bs, l, d, W, nsel, D, Hq, Hk, B, has_gates, dtype = case
    cfg = NSAConfig(block_size=bs, num_selected=nsel, window=W, compress_block=l, compress_stride=d)
    q, k, v = rand(B, 1, Hq, Hk, D, S, dtype=dtype, seed=S, device=DEV)
    gates = (torch.rand(B, 1, Hq, 3, generator=torch.Generator().manual_seed(seed_gates)).to(DEV).to(dtype)
             if has_gates else None)
    kc, vc = ref.compress_kv(k, v, cfg)
    return cfg, q, k, v, kc, vc, gates, 1.0 / math.sqrt(D)


GIVEN_CASES = [CASES[1], CASES[2], CASES[5]]          # G 4 fp32 gates, MHA fp16, num_selected > visible blocks


@needs_triton
@pytest.mark.parametrize("early", [True, False], ids=["early", "late"])
@pytest.mark.parametrize("case", GIVEN_CASES, ids=["G4-f32", "MHA-f16", "nsel40"])
def test_decode_given_indices_equal_normal_step(monkeypatch, case, early):
    """indices = the normal step's own selection -> the same output (the selected partials are merged in another
    order: fp32 rounding) and the same indices back; both given-step structures (GIVEN_EARLY)."""
    _, dec = _mods()
    monkeypatch.setattr(dec, "GIVEN_EARLY", early)
    cfg, q, k, v, kc, vc, gates, scale = _given_case(case)
    out, idx = dec.nsa_decode(q, k, v, kc, vc, gates, scale, cfg, True)
    for form in (idx, idx[:, 0]):                     # (B, 1, Hk, nsel) and (B, Hk, nsel)
        got, gidx = dec.nsa_decode(q, k, v, kc, vc, gates, scale, cfg, True, indices=form)
        assert gidx.shape == idx.shape and gidx.dtype == torch.int32 and torch.equal(gidx, idx)
        # the selected partials merged in another order: two fp32 evaluations; fp16: ~2 ulps of the output
        tol = 2 * _tol(q.dtype, q, k, v) if q.dtype == torch.float32 else 2e-3
        check_bound(max_err(got.float(), out.float()), tol, "given vs own indices")
    assert dec.nsa_decode(q, k, v, kc, vc, gates, scale, cfg, indices=idx)[1] is None


@needs_triton
@pytest.mark.parametrize("early", [True, False], ids=["early", "late"])
@pytest.mark.parametrize("case", GIVEN_CASES, ids=["G4-f32", "MHA-f16", "nsel40"])
def test_decode_given_random_indices(monkeypatch, case, early):
    """Arbitrary selections (random ascending blocks, -1 padded, one (b, kv head) with none) -> the PyTorch
    reference over exactly those blocks."""
    _, dec = _mods()
    monkeypatch.setattr(dec, "GIVEN_EARLY", early)
    cfg, q, k, v, kc, vc, gates, scale = _given_case(case)
    B, S, Hk, nsel = q.shape[0], k.shape[1], k.shape[2], cfg.num_selected
    n_b = -(-S // cfg.block_size)
    # the helper itself against nsa_reference, with the reference's own selection
    want, widx = ref.nsa_attention(q, k, v, cfg, gates=gates, return_indices=True)
    mine = _given_reference(q, k, v, kc, vc, gates, cfg, widx[:, 0], scale)
    check_bound(max_err(mine.float(), want.float()), _tol(q.dtype, q, k, v), "given reference")
    g = torch.Generator().manual_seed(S)
    idx = torch.full((B, Hk, nsel), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(Hk):
            n = int(torch.randint(1, min(nsel, n_b) + 1, (1,), generator=g))
            idx[b, h, :n] = torch.randperm(n_b, generator=g)[:n].sort().values.int()
    idx[-1, -1] = -1                                   # a (b, kv head) with no selected block: o_slc = 0
    idx = idx.to(DEV)
    got, gidx = dec.nsa_decode(q, k, v, kc, vc, gates, scale, cfg, True, indices=idx)
    assert torch.equal(gidx[:, 0], idx)
    want = _given_reference(q, k, v, kc, vc, gates, cfg, idx, scale)
    check_bound(max_err(got.float(), want.float()), _tol(q.dtype, q, k, v), "given random")


@needs_triton
@pytest.mark.parametrize("early", [True, False], ids=["early", "late"])
def test_decode_given_huge_indices(monkeypatch, early):
    """A given entry past the last block contributes nothing, up to 2^31 - 1 (entries >= 2^31 / block_size wrapped
    the key offset negative before the clamp: loads outside K/V, NaN here, an illegal address on a GPU): the output
    equals the one with those entries -1."""
    _, dec = _mods()
    monkeypatch.setattr(dec, "GIVEN_EARLY", early)
    cfg, q, k, v, kc, vc, gates, scale = _given_case(CASES[0])      # B 2, Hk 2, 3 selected of 10 blocks
    n_b = -(-k.shape[1] // cfg.block_size)
    big = torch.tensor([[[1, 4, n_b], [0, n_b + 1, 1 << 25]], [[3, 1 << 30, 2 ** 31 - 1], [2 ** 31 - 1] * 3]],
                       dtype=torch.int32)
    clean = torch.where(big >= n_b, -1, big)
    want = dec.nsa_decode(q, k, v, kc, vc, gates, scale, cfg, indices=clean.to(DEV))[0]
    got, gidx = dec.nsa_decode(q, k, v, kc, vc, gates, scale, cfg, True, indices=big.to(DEV))
    assert torch.equal(gidx[:, 0].cpu(), big)
    assert torch.isfinite(want).all() and torch.equal(got, want)


@pytest.mark.parametrize("bad, msg", [
    (lambda i: i.long(), "int32"),
    (lambda i: i[..., :-1], "shape"),
    (lambda i: i[:, :, None], "shape"),
    (lambda i: i.to("meta"), "device"),
    (lambda i: i.tolist(), "torch.Tensor"),
], ids=["int64", "short", "axis", "device", "list"])
def test_decode_given_indices_checked(bad, msg):
    _, dec = _mods()
    cfg = NSAConfig(block_size=16, num_selected=3, window=32, compress_block=16, compress_stride=8)
    q, k, v = rand(1, 1, 4, 2, 16, 80)
    kc, vc = ref.compress_kv(k, v, cfg)
    idx = torch.zeros(1, 2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="indices") as e:
        dec.nsa_decode(q, k, v, kc, vc, None, 0.25, cfg, indices=bad(idx))
    assert msg in str(e.value)


# ------------------------------------------------------------------------------------------------------------ GPU
def _gpu_case(B, S, seed, gates=True):
    q, k, v = rand(B, 1, 64, 4, 128, S, dtype=torch.bfloat16, seed=seed, device="cuda")
    g = torch.rand(B, 1, 64, 3, device="cuda") if gates else None
    return q, k, v, g


@gpu
@pytest.mark.parametrize("B", [1, 2])
def test_gpu_decode_bf16_8k(B, count_decode):
    nsa, _ = _mods()
    cfg = NSAConfig()
    agree = total = 0
    for seed in range(3):
        S = 8192 - seed * 37
        q, k, v, g = _gpu_case(B, S, seed)
        out, idx = nsa.nsa_attention(q, k, v, cfg, gates=g, return_indices=True)
        want, widx = ref.nsa_attention(q, k, v, cfg, gates=g, return_indices=True)
        same = (idx.long() == widx).all(-1)                     # (B, 1, Hk): near-ties may flip in bf16
        agree += int(same.sum())
        total += same.numel()
        rows = same[:, 0].repeat_interleave(16, 1)              # (B, Hq): heads whose KV head agrees
        if rows.any():
            err = (out[:, 0][rows].float() - want[:, 0][rows].float()).abs().max().item()
            assert err < 2e-2, err
    assert agree >= total - 1, (agree, total)
    assert len(count_decode) == 3


@gpu
def test_gpu_decode_cache_steps_and_graph():
    """NSACache(store_kv=False) decode steps at 8K equal the reference; one captured step replays exactly."""
    nsa, _ = _mods()
    cfg = NSAConfig()
    S0, n = 8180, 20
    q, k, v, _ = _gpu_case(1, S0 + n, 5, gates=False)
    qs = torch.randn(1, n, 64, 128, device="cuda", dtype=torch.bfloat16)
    cache = ref.NSACache(store_kv=False)
    with torch.no_grad():
        cache.update(k[:, :S0], v[:, :S0], cfg)
        for i in range(n):
            t = S0 + i
            out, idx = nsa.nsa_attention(qs[:, i:i + 1], k[:, :t + 1], v[:, :t + 1], cfg, cache=cache,
                                         return_indices=True)
            assert torch.isfinite(out).all(), f"step {i}: NaN output (an in-kernel wait gave up)"
            want, widx = ref.nsa_attention(qs[:, i:i + 1], k[:, :t + 1], v[:, :t + 1], cfg, return_indices=True)
            if torch.equal(idx.long(), widx):
                assert (out.float() - want.float()).abs().max().item() < 2e-2
        assert cache.k_cmp.shape[1] == ref.num_compressed(S0 + n, cfg)
        kk, vv = k.clone(), v.clone()
        eager = nsa.nsa_attention(q, kk, vv, cfg, cache=cache)
        assert torch.isfinite(eager).all()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                nsa.nsa_attention(q, kk, vv, cfg, cache=cache)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = nsa.nsa_attention(q, kk, vv, cfg, cache=cache)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager)
        q.copy_(torch.randn_like(q))
        graph.replay()
        again = nsa.nsa_attention(q, kk, vv, cfg, cache=cache)
        torch.cuda.synchronize()
        assert torch.equal(static_out, again)


@gpu
@pytest.mark.parametrize("stall, old", [(1, False), (2, False), (3, False), (4, False), (1, True), (2, True)],
                         ids=["rank", "slot", "merge", "window", "rank-counters", "attn-counters"])
def test_gpu_decode_barrier_timeout_poisons(monkeypatch, stall, old):
    """An in-kernel wait that gives up (made unsatisfiable here through the test hook, with a short SPIN_LIMIT) makes
    the step's output NaN instead of silently wrong; the next step is unaffected (flags are reset per step). Default:
    the merge waits on one counter (ONE_CNT); `old`: the session-4 counter-barrier structure (KEY_POLL / SLOT_POLL /
    EARLY_LOADS off), whose merge waits on several."""
    _, dec = _mods()
    if old:
        for n in ("KEY_POLL", "SLOT_POLL", "EARLY_LOADS"):
            monkeypatch.setattr(dec, n, False)
    cfg = NSAConfig()
    q, k, v, g = _gpu_case(1, 8192, 9)
    kc, vc = ref.compress_kv(k, v, cfg)
    scale = 1.0 / math.sqrt(128)
    want, widx = dec.nsa_decode(q, k, v, kc, vc, g, scale, cfg, True)
    assert torch.isfinite(want).all()
    spin = dec.SPIN_LIMIT
    monkeypatch.setattr(dec, "SPIN_LIMIT", 1 << 10)
    monkeypatch.setattr(dec, "_STALL", stall)
    bad, _ = dec.nsa_decode(q, k, v, kc, vc, g, scale, cfg, True)
    torch.cuda.synchronize()
    assert torch.isnan(bad).all(), torch.isnan(bad).float().mean().item()
    monkeypatch.setattr(dec, "_STALL", 0)
    monkeypatch.setattr(dec, "SPIN_LIMIT", spin)
    again, idx = dec.nsa_decode(q, k, v, kc, vc, g, scale, cfg, True)
    assert torch.equal(again, want) and torch.equal(idx, widx)


@gpu
@pytest.mark.parametrize("early", [True, False], ids=["early", "late"])
def test_gpu_decode_given_bf16_8k(monkeypatch, early):
    """8K bf16 HQ64/H4, B=2: the given-selection step equals the normal step when given its selection, and the
    PyTorch reference over random given blocks."""
    _, dec = _mods()
    monkeypatch.setattr(dec, "GIVEN_EARLY", early)
    cfg = NSAConfig()
    q, k, v, g = _gpu_case(2, 8192 - 5, 31)
    kc, vc = ref.compress_kv(k, v, cfg)
    scale = 1.0 / math.sqrt(128)
    out, idx = dec.nsa_decode(q, k, v, kc, vc, g, scale, cfg, True)
    got, gidx = dec.nsa_decode(q, k, v, kc, vc, g, scale, cfg, True, indices=idx)
    assert torch.isfinite(got).all() and torch.equal(gidx, idx)
    assert (got.float() - out.float()).abs().max().item() < 1e-2
    n_b = -(-k.shape[1] // cfg.block_size)
    gen = torch.Generator(device="cuda").manual_seed(3)
    rnd = torch.rand(2, 4, n_b, generator=gen, device="cuda").topk(cfg.num_selected, -1).indices.sort(-1).values
    rnd = rnd.int()
    rnd[0, 1, 10:] = -1
    got = dec.nsa_decode(q, k, v, kc, vc, g, scale, cfg, indices=rnd)[0]
    want = _given_reference(q, k, v, kc, vc, g, cfg, rnd, scale)
    assert torch.isfinite(got).all()
    assert (got.float() - want.float()).abs().max().item() < 2e-2


@gpu
def test_gpu_decode_given_graph():
    """A captured given-selection step (the tile-reuse steps of a decode loop): replays equal the eager step, and
    new indices copied into the captured buffer take effect at the next replay."""
    _, dec = _mods()
    cfg = NSAConfig()
    q, k, v, g = _gpu_case(1, 8192 + 17, 41)
    kc, vc = ref.compress_kv(k, v, cfg)
    scale = 1.0 / math.sqrt(128)
    _, idx = dec.nsa_decode(q, k, v, kc, vc, g, scale, cfg, True)
    buf = idx.clone()

    def step():
        return dec.nsa_decode(q, k, v, kc, vc, g, scale, cfg, indices=buf)[0]
    eager = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(static_out).all() and torch.equal(static_out, eager)
    buf.copy_(torch.flip(torch.arange(cfg.num_selected, device="cuda", dtype=torch.int32) * 7, [0]).sort().values
              .expand_as(buf))
    graph.replay()
    again = step()
    torch.cuda.synchronize()
    assert torch.equal(static_out, again) and not torch.equal(static_out, eager)
    want = _given_reference(q, k, v, kc, vc, g, cfg, buf[:, 0], scale)
    assert (again.float() - want.float()).abs().max().item() < 2e-2


@gpu
@pytest.mark.parametrize("stall", [3, 4], ids=["merge", "window"])
def test_gpu_decode_given_timeout_poisons(monkeypatch, stall):
    """The given-selection step keeps the timeout poison: a merge or window wait that gives up -> NaN output."""
    _, dec = _mods()
    cfg = NSAConfig()
    q, k, v, g = _gpu_case(1, 8192, 9)
    kc, vc = ref.compress_kv(k, v, cfg)
    scale = 1.0 / math.sqrt(128)
    want, idx = dec.nsa_decode(q, k, v, kc, vc, g, scale, cfg, True)
    spin = dec.SPIN_LIMIT
    monkeypatch.setattr(dec, "SPIN_LIMIT", 1 << 10)
    monkeypatch.setattr(dec, "_STALL", stall)
    bad = dec.nsa_decode(q, k, v, kc, vc, g, scale, cfg, indices=idx)[0]
    torch.cuda.synchronize()
    assert torch.isnan(bad).all(), torch.isnan(bad).float().mean().item()
    monkeypatch.setattr(dec, "_STALL", 0)
    monkeypatch.setattr(dec, "SPIN_LIMIT", spin)
    again = dec.nsa_decode(q, k, v, kc, vc, g, scale, cfg, indices=idx)[0]
    assert torch.isfinite(again).all() and (again.float() - want.float()).abs().max().item() < 1e-2


def _within_ulp(a, b):
    """|a - b| <= one bf16 ulp of the larger (2^-7 |x|: two fp32 sums of the same terms, rounded to bf16 on either
    side of a rounding boundary) plus 1e-5 for outputs that cancel towards 0 (fp32 error of terms of size ~1)."""
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= 2.0 ** -7 * torch.maximum(a.abs(), b.abs()) + 1e-5).all())


@gpu
@pytest.mark.parametrize("S", [8192 + 17, 65536 - 3])
def test_gpu_decode_target_programs_and_given_agree(monkeypatch, S):
    """HQ64/H4 bf16 B=1 at 8K and 64K (64K: 64 compressed splits at TARGET_PROGRAMS 320, 32 at 160): 160 target
    programs give the same indices and outputs within one bf16 ulp; heads whose indices equal the reference's are
    within 2e-2 of it (the other decode tests' bound). Given step (GIVEN_EARLY on and off) with the normal step's
    indices: the indices back and the normal step's output within one bf16 ulp."""
    _, dec = _mods()
    cfg = NSAConfig()
    q, k, v, g = _gpu_case(1, S, 77)
    kc, vc = ref.compress_kv(k, v, cfg)
    scale = 1.0 / math.sqrt(128)
    out, idx = dec.nsa_decode(q, k, v, kc, vc, g, scale, cfg, True)
    assert torch.isfinite(out).all()
    monkeypatch.setattr(dec, "TARGET_PROGRAMS", 160)
    o16, i16 = dec.nsa_decode(q, k, v, kc, vc, g, scale, cfg, True)
    monkeypatch.setattr(dec, "TARGET_PROGRAMS", 320)
    assert torch.equal(i16, idx) and _within_ulp(o16, out)
    want, widx = ref.nsa_attention(q, k, v, cfg, gates=g, return_indices=True)
    same = (idx.long() == widx).all(-1)[0, 0]                   # (Hk,): near-ties may flip in bf16
    assert int(same.sum()) >= 3, same
    rows = same.repeat_interleave(16)
    assert (out[0, 0][rows].float() - want[0, 0][rows].float()).abs().max().item() < 2e-2
    for early in (True, False):
        monkeypatch.setattr(dec, "GIVEN_EARLY", early)
        got, gidx = dec.nsa_decode(q, k, v, kc, vc, g, scale, cfg, True, indices=idx)
        assert torch.isfinite(got).all() and torch.equal(gidx, idx), early
        assert _within_ulp(got, out), (early, (got.float() - out.float()).abs().max().item())
