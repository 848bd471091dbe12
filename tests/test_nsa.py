"""Native Sparse Attention: reference semantics (CPU fp32/fp64), Triton vs reference (interpreter / GPU), adapter."""
from __future__ import annotations

import math
import os

import pytest
import torch

from kernel_checks import (assert_agree, assert_close_to_oracle, attention_bounds, check_bound, denoiser_bound,
                           max_err)
from sparsepatch.config import NSAConfig
from sparsepatch.kernels.nsa import reference as ref

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not (CUDA or INTERPRET), reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
gpu = pytest.mark.gpu

CFG = NSAConfig(block_size=16, num_selected=3, window=24, compress_block=16, compress_stride=8)


def nsa_tol(q, k, v, scale=None):
    """Max-abs bound for an fp32 NSA output vs the reference (fp64 math rounded once): a gated sum (gates <= 1) of
    three softmax attentions over subsets of these keys, each within attention_bounds (errors in quadrature)."""
    return 3 ** 0.5 * attention_bounds(q, k, v, torch.float32, scale)[0]


def rand(B, T, Hq, Hk, D, dtype=torch.float32, seed=0, S=None, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    q = torch.randn(B, T, Hq, D, generator=g)
    k = torch.randn(B, S, Hk, D, generator=g)
    v = torch.randn(B, S, Hk, D, generator=g)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)]


def naive(q, k, v, cfg, gates=None, scale=None, w=None):
    """Token-by-token NSA in fp64, written independently of the vectorised reference (causal, S == T).
    cfg.selection == "tile": token t attends to the blocks chosen at its tile's first position (t // bs) * bs."""
    q, k, v = q.double(), k.double(), v.double()
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    G = Hq // Hk
    scale = 1 / math.sqrt(D) if scale is None else scale
    l, d, bs = cfg.compress_block, cfg.compress_stride, cfg.block_size
    out = torch.zeros_like(q)

    def attend(qv, keys, vals):
        if keys.shape[0] == 0:
            return torch.zeros_like(qv), None
        p = torch.softmax(keys @ qv * scale, 0)
        return p @ vals, p

    for b in range(B):
        for hk in range(Hk):
            chosen = {}
            kc = [(k[b, c * d:c * d + l, hk] * (1 / l if w is None else w[0, hk, :, None].double())).sum(0)
                  for c in range((T - l) // d + 1)] if T >= l else []
            vc = [(v[b, c * d:c * d + l, hk] * (1 / l if w is None else w[1, hk, :, None].double())).sum(0)
                  for c in range((T - l) // d + 1)] if T >= l else []
            for t in range(T):
                ncv = (t + 1 - l) // d + 1 if t + 1 >= l else 0
                nb = t // bs + 1
                imp = [0.0] * nb
                o_c = {}
                for h in range(hk * G, hk * G + G):
                    o, p = attend(q[b, t, h], torch.stack(kc[:ncv]) if ncv else k.new_zeros(0, D),
                                  torch.stack(vc[:ncv]) if ncv else k.new_zeros(0, D))
                    o_c[h] = o
                    if p is not None:
                        for c in range(ncv):
                            for j in range(nb):
                                ov = min(c * d + l, (j + 1) * bs) - max(c * d, j * bs)
                                if ov > 0:
                                    imp[j] += float(p[c]) * ov
                cand = sorted(range(nb), key=lambda j: (j != t // bs, j != 0, -imp[j], j))[:cfg.num_selected]
                if cfg.selection == "tile":
                    cand = chosen.setdefault(t // bs, cand)   # the tile's first position chose
                keys = sorted(s for j in cand for s in range(j * bs, min((j + 1) * bs, t + 1)))
                wk = list(range(max(0, t - cfg.window + 1), t + 1))
                for h in range(hk * G, hk * G + G):
                    o_s, _ = attend(q[b, t, h], k[b, keys, hk], v[b, keys, hk])
                    o_w, _ = attend(q[b, t, h], k[b, wk, hk], v[b, wk, hk])
                    g = (1 / 3, 1 / 3, 1 / 3) if gates is None else gates[b, t, h].double()
                    out[b, t, h] = g[0] * o_c[h] + g[1] * o_s + g[2] * o_w
    return out


# ------------------------------------------------------------------------------------------------ reference
def test_reference_matches_naive_loop():
    q, k, v = rand(2, 53, 4, 2, 8, seed=1)
    gates = torch.rand(2, 53, 4, 3, generator=torch.Generator().manual_seed(2))
    w = torch.randn(2, 2, CFG.compress_block, generator=torch.Generator().manual_seed(3)) / 4
    got = ref.nsa_attention(q, k, v, CFG, gates=gates, compress_weights=w, scale=0.3)
    want = naive(q, k, v, CFG, gates, 0.3, w)
    assert_close_to_oracle(got, want, torch.float32)          # the reference: fp64 math rounded once


@pytest.mark.parametrize("selection", ["token", "tile"])
def test_causality_exact(selection):
    cfg = NSAConfig(**{**CFG.__dict__, "selection": selection})
    q, k, v = rand(1, 90, 4, 2, 16, seed=3)
    out = ref.nsa_attention(q, k, v, cfg)
    for t in (0, 15, 23, 40, 71):
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[:, t + 1:] = torch.randn_like(q2[:, t + 1:]) * 5
        k2[:, t + 1:] = torch.randn_like(k2[:, t + 1:]) * 5
        v2[:, t + 1:] = torch.randn_like(v2[:, t + 1:]) * 5
        out2 = ref.nsa_attention(q2, k2, v2, cfg)
        assert torch.equal(out[:, :t + 1], out2[:, :t + 1]), t


TILE = NSAConfig(**{**CFG.__dict__, "selection": "tile"})


def test_tile_selection_matches_naive_and_first_token():
    """selection="tile": every token of a tile uses the blocks the token-mode reference picks for the tile's first
    position, and the output equals the independent loop."""
    q, k, v = rand(1, 101, 4, 2, 8, seed=11)
    gates = torch.rand(1, 101, 4, 3, generator=torch.Generator().manual_seed(12))
    out, idx = ref.nsa_attention(q, k, v, TILE, gates=gates, scale=0.3, return_indices=True)
    _, tok_idx = ref.nsa_attention(q, k, v, CFG, gates=gates, scale=0.3, return_indices=True)
    first = torch.arange(101) // TILE.block_size * TILE.block_size
    assert torch.equal(idx, tok_idx[:, first])
    assert not torch.equal(idx, tok_idx)                        # the two modes do differ on these inputs
    want = naive(q, k, v, TILE, gates, 0.3)
    assert_close_to_oracle(out, want, torch.float32)
    # causal=False (DiT): the same rule over query indices, every block a candidate
    _, nc_idx = ref.nsa_attention(q, k, v, TILE, causal=False, return_indices=True)
    _, nc_tok = ref.nsa_attention(q, k, v, CFG, causal=False, return_indices=True)
    assert torch.equal(nc_idx, nc_tok[:, first]) and not torch.equal(nc_idx, nc_tok)


@pytest.mark.parametrize("store_kv", [True, False])
def test_tile_decode_and_chunks_with_cache(store_kv):
    """Prefill ending mid-tile, then decode steps across a tile boundary, equal the full forward; a call starting
    mid-tile needs the cache that saw the tile's first position."""
    q, k, v = rand(2, 70, 8, 2, 16, seed=15)
    full = ref.nsa_attention(q, k, v, TILE)
    cache = ref.NSACache(store_kv=store_kv)

    def call(a, b):
        kk, vv = (k[:, a:b], v[:, a:b]) if store_kv else (k[:, :b], v[:, :b])
        return ref.nsa_attention(q[:, a:b], kk, vv, TILE, cache=cache)

    # chunks and the full call: both fp64 math rounded once
    assert_agree(call(0, 60), full[:, :60], torch.float32)
    assert cache.tile_selection[0] == 3                         # tile [48, 64) is open
    for t in range(60, 67):
        assert_agree(call(t, t + 1)[:, 0], full[:, t], torch.float32)
    assert_agree(call(67, 70), full[:, 67:], torch.float32)
    with pytest.raises(ValueError, match="selection='tile'"):
        ref.nsa_attention(q[:, 60:], k, v, TILE)                  # queries start mid-tile, no cache
    with pytest.raises(ValueError, match="selection='tile'"):
        ref.nsa_attention(q[:, 60:61], k[:, :61], v[:, :61], TILE, cache=ref.NSACache(store_kv=False))


def test_no_leak_from_incomplete_compressed_blocks():
    cfg = NSAConfig(block_size=16, num_selected=1, window=1, compress_block=16, compress_stride=8)
    q, k, v = rand(1, 40, 2, 1, 8, seed=4)
    only_cmp = torch.zeros(1, 40, 2, 3)
    only_cmp[..., 0] = 1.0
    out = ref.nsa_attention(q, k, v, cfg, gates=only_cmp)
    # Query t = 20 sees compressed blocks ending at 15 only (block 1 = [8, 24) is incomplete at t = 20).
    t = 20
    k2, v2 = k.clone(), v.clone()
    k2[:, 16:t + 1] += 3.0
    v2[:, 16:t + 1] += 3.0
    out2 = ref.nsa_attention(q, k2, v2, cfg, gates=only_cmp)
    assert torch.equal(out[:, t], out2[:, t])
    assert not torch.equal(out[:, 23], out2[:, 23])            # block [8, 24) complete at t = 23
    assert torch.equal(out[:, :15], torch.zeros_like(out[:, :15]))  # no complete block before t = 15
    # and the exact value at t = 20: softmax over the single mean-pooled block [0, 16)
    kc, vc = k[0, :16, 0].double().mean(0), v[0, :16, 0].double().mean(0)
    assert_close_to_oracle(out[0, t, 0], vc, torch.float32)
    assert kc.shape == vc.shape


def test_decode_consistency_with_cache():
    q, k, v = rand(2, 70, 8, 2, 16, seed=5)
    w = torch.randn(2, 2, CFG.compress_block, generator=torch.Generator().manual_seed(6)) / 4
    full = ref.nsa_attention(q, k, v, CFG, compress_weights=w)
    cache = ref.NSACache()
    pre = ref.nsa_attention(q[:, :60], k[:, :60], v[:, :60], CFG, cache=cache, compress_weights=w)
    assert_agree(pre, full[:, :60], torch.float32)
    for t in range(60, 70):
        step = ref.nsa_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], CFG, cache=cache, compress_weights=w)
        assert_agree(step[:, 0], full[:, t], torch.float32)
    assert cache.k_cmp.shape[1] == ref.num_compressed(70, CFG)
    # external-kv mode (the transformers adapter): full k/v each call, compressed blocks added incrementally
    c2 = ref.NSACache(store_kv=False)
    ref.nsa_attention(q[:, :60], k[:, :60], v[:, :60], CFG, cache=c2, compress_weights=w)
    step = ref.nsa_attention(q[:, 60:61], k[:, :61], v[:, :61], CFG, cache=c2, compress_weights=w)
    assert_agree(step[:, 0], full[:, 60], torch.float32)


def test_varlen_equals_per_sequence():
    lens = [37, 1, 64, 20]
    q, k, v = rand(1, sum(lens), 4, 2, 8, seed=7)
    gates = torch.rand(1, sum(lens), 4, 3, generator=torch.Generator().manual_seed(8))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    out = ref.nsa_attention(q, k, v, CFG, gates=gates, cu_seqlens=cu)
    a = 0
    for n in lens:
        one = ref.nsa_attention(q[:, a:a + n], k[:, a:a + n], v[:, a:a + n], CFG, gates=gates[:, a:a + n])
        assert torch.equal(out[:, a:a + n], one)
        a += n


@pytest.mark.parametrize("G", [1, 2, 4, 8, 16])
def test_gqa_groups_match_naive(G):
    q, k, v = rand(1, 40, 2 * G, 2, 8, seed=G)
    got = ref.nsa_attention(q, k, v, CFG)
    want = naive(q, k, v, CFG)
    assert_close_to_oracle(got, want, torch.float32)


def test_selection_always_has_first_and_local_blocks():
    q, k, v = rand(1, 100, 4, 2, 8, seed=9)
    _, idx = ref.nsa_attention(q, k, v, CFG, return_indices=True)
    t = torch.arange(100)
    for hk in range(2):
        sel = idx[0, :, hk]
        assert bool((sel == 0).any(-1).all())
        assert bool((sel == (t // 16)[:, None]).any(-1).all())
        assert bool(((sel <= (t // 16)[:, None])).all())         # nothing from the future
        nvalid = (sel >= 0).sum(-1)
        assert torch.equal(nvalid, torch.clamp(t // 16 + 1, max=3))


def test_non_causal_sees_everything():
    q, k, v = rand(1, 48, 2, 1, 8, seed=10)
    out, idx = ref.nsa_attention(q, k, v, CFG, causal=False, return_indices=True)
    assert out.shape == q.shape and bool((idx >= 0).all())
    # the first query's output depends on the last keys (not causal)
    k2 = k.clone()
    k2[:, -5:] += 2
    assert not torch.equal(ref.nsa_attention(q, k2, v, CFG, causal=False)[:, 0], out[:, 0])


def test_gradients_finite_and_nonzero():
    q, k, v = rand(1, 48, 4, 2, 8, seed=11)
    for t in (q, k, v):
        t.requires_grad_(True)
    gl = torch.zeros(1, 48, 4, 3).requires_grad_(True)
    w = torch.full((2, 2, CFG.compress_block), 1 / CFG.compress_block).requires_grad_(True)
    out = ref.nsa_attention(q, k, v, CFG, gates=torch.sigmoid(gl), compress_weights=w)
    out.square().sum().backward()
    for name, t in (("q", q), ("k", k), ("v", v), ("gates", gl), ("compress_weights", w)):
        assert torch.isfinite(t.grad).all(), name
        assert t.grad.abs().sum() > 0, name


@pytest.mark.parametrize("bad, word", [
    (dict(config=None), "config"),
    (dict(gates=torch.rand(1, 8, 4, 2)), "gates"),
    (dict(gates="x"), "gates"),
    (dict(cu_seqlens=torch.tensor([0, 3, 5])), "cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0.0, 8.0])), "cu_seqlens"),
    (dict(causal="yes"), "causal"),
    (dict(cache=object()), "cache"),
    (dict(compress_weights=torch.rand(2, 2, 5)), "compress_weights"),
    (dict(k=torch.randn(1, 8, 3, 8), v=torch.randn(1, 8, 3, 8)), "heads"),
    (dict(q=torch.randn(1, 8, 4)), "q"),
    (dict(k=torch.randn(1, 4, 2, 8), v=torch.randn(1, 4, 2, 8)), "k length"),
])
def test_hostile_inputs_raise(bad, word):
    q, k, v = rand(1, 8, 4, 2, 8)
    kw = dict(q=q, k=k, v=v, config=CFG)
    kw.update(bad)
    with pytest.raises(ValueError, match=word):
        ref.nsa_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("config"), **kw)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="block_size"):
        NSAConfig(block_size=0)
    with pytest.raises(ValueError, match="gates"):
        NSAConfig(gates="sometimes")


def test_density():
    assert ref.nsa_density(CFG, 10) > 0.99
    cfg = NSAConfig()
    assert 0.05 < ref.nsa_density(cfg, 65536) < 0.25


# ------------------------------------------------------------------------------------------------ Triton
def _tri():
    from sparsepatch.kernels.nsa import forward as nsa
    return nsa


def _bf16_err(out, want):
    """max |out - want| beyond bf16 rounding: 2e-2 absolute plus two bf16 ulps (2^-6 relative) of the reference (an
    early token's output is a few v values of magnitude up to ~4, where one ulp is 0.0156)."""
    out, want = out.float(), want.float()
    return ((out - want).abs() - 2.0 ** -6 * want.abs()).max().item()


def _compare(out, idx, want, widx, atol):
    assert torch.equal(idx.long().cpu(), widx.cpu()), "selected blocks differ from the reference"
    check_bound(max_err(out.float(), want.float()), atol, "nsa out")


@needs_triton
@pytest.mark.parametrize("G, Hk, dtype", [(1, 2, torch.float32), (4, 1, torch.float32), (16, 1, torch.float32),
                                          (2, 1, torch.float16), (3, 1, torch.float32)])
def test_triton_matches_reference(G, Hk, dtype):
    dev = "cuda" if CUDA and not INTERPRET else "cpu"
    q, k, v = rand(1, 40, G * Hk, Hk, 32, dtype=dtype, seed=20 + G, device=dev)
    gates = torch.rand(1, 40, G * Hk, 3, generator=torch.Generator().manual_seed(G)).to(dev)
    out, idx = _tri().nsa_attention(q, k, v, CFG, gates=gates, return_indices=True)
    want, widx = ref.nsa_attention(q, k, v, CFG, gates=gates, return_indices=True)
    # fp16: inputs rounded alike on both sides; P and the output rounded to fp16 in the kernel (~4 ulps)
    _compare(out, idx, want, widx, nsa_tol(q, k, v) if dtype == torch.float32 else 4e-3)


@needs_triton
@pytest.mark.parametrize("G, Hk, T, rows", [(1, 2, 40, 16), (16, 1, 40, 16), (3, 1, 37, 32)])
def test_triton_selected_tile_union_equals_per_token(G, Hk, T, rows, monkeypatch):
    """`_slc_tile_kernel` (tokens of a tile visit the union of their blocks, each row masks the blocks its token
    did not select) computes the per-token kernel's function: same indices, outputs equal to rounding."""
    from sparsepatch.kernels.nsa import forward as nsa
    dev = "cuda" if CUDA and not INTERPRET else "cpu"
    q, k, v = rand(1, T, G * Hk, Hk, 32, seed=40 + G, device=dev)
    gates = torch.rand(1, T, G * Hk, 3, generator=torch.Generator().manual_seed(G)).to(dev)
    monkeypatch.setattr(nsa, "SLC_TILE_ROWS", 0)
    a, ia = nsa.nsa_attention(q, k, v, CFG, gates=gates, return_indices=True)
    monkeypatch.setattr(nsa, "SLC_TILE_ROWS", rows)
    b, ib = nsa.nsa_attention(q, k, v, CFG, gates=gates, return_indices=True)
    assert torch.equal(ia, ib)
    assert_agree(a, b, bound=nsa_tol(q, k, v), what="tile union vs per token")
    want, widx = ref.nsa_attention(q, k, v, CFG, gates=gates, return_indices=True)
    _compare(b, ib, want, widx, nsa_tol(q, k, v))
    monkeypatch.setattr(nsa, "SLC_TILE_ROWS", 24)
    with pytest.raises(ValueError, match="SLC_TILE_ROWS"):
        nsa.nsa_attention(q, k, v, CFG)
    monkeypatch.setattr(nsa, "SLC_TILE_ROWS", None)   # the measured rule (MHA / small G at short T, any G to 64 blocks)
    assert nsa.slc_tile_rows(1, 1024) == 128 and nsa.slc_tile_rows(4, 256) == 128
    assert nsa.slc_tile_rows(4, 512) == 0 and nsa.slc_tile_rows(16, 128) == 0 and nsa.slc_tile_rows(16, 65) == 0
    assert nsa.slc_tile_rows(16, 64) == 128 and nsa.slc_tile_rows(8, 64) == 128   # T <= 4K at block 64, any G
    assert nsa.slc_tile_rows(16, 1024, 64) == 64 and nsa.slc_tile_rows(1, 1024, 64) == 64   # selection="tile"


@needs_triton
@pytest.mark.parametrize("G, Hk", [(1, 2), (4, 1), (16, 1), (3, 1)])
def test_triton_tile_selection_matches_reference(G, Hk, monkeypatch):
    """selection="tile" on the Triton kernels: prefill (programs sharing one selection, and the union path), a
    prefill ending mid-tile, decode steps across a tile boundary (the tile's selection carried by the cache) and a
    chunk, against the reference."""
    nsa = _tri()
    dev = "cuda" if CUDA and not INTERPRET else "cpu"
    q, k, v = rand(1, 70, G * Hk, Hk, 32, seed=50 + G, device=dev)
    gates = torch.rand(1, 70, G * Hk, 3, generator=torch.Generator().manual_seed(G)).to(dev)
    out, idx = nsa.nsa_attention(q, k, v, TILE, gates=gates, return_indices=True)
    want, widx = ref.nsa_attention(q, k, v, TILE, gates=gates, return_indices=True)
    _compare(out, idx, want, widx, nsa_tol(q, k, v))
    monkeypatch.setattr(nsa, "SLC_SHARED", False)
    out_u, idx_u = nsa.nsa_attention(q, k, v, TILE, gates=gates, return_indices=True)
    assert torch.equal(idx_u, idx)
    assert_agree(out_u, out, bound=nsa_tol(q, k, v), what="unshared vs shared")
    cache = ref.NSACache()
    for a, b in ((0, 60), (60, 61), (61, 62), (62, 63), (63, 64), (64, 65), (65, 70)):
        o, i = nsa.nsa_attention(q[:, a:b], k[:, a:b], v[:, a:b], TILE, gates=gates[:, a:b], cache=cache,
                                 return_indices=True)
        _compare(o, i, want[:, a:b], widx[:, a:b], nsa_tol(q, k, v))
    with pytest.raises(ValueError, match="selection='tile'"):   # queries start mid-tile, no cache
        nsa.nsa_attention(q[:, 60:], k, v, TILE)


@needs_triton
def test_triton_decode_varlen_and_weights():
    nsa = _tri()
    dev = "cuda" if CUDA and not INTERPRET else "cpu"
    q, k, v = rand(1, 41, 4, 2, 16, seed=30, device=dev)
    w = (torch.randn(2, 2, CFG.compress_block, generator=torch.Generator().manual_seed(31)) / 4).to(dev)
    c1, c2 = ref.NSACache(), ref.NSACache()
    a = nsa.nsa_attention(q[:, :40], k[:, :40], v[:, :40], CFG, cache=c1, compress_weights=w)
    b = ref.nsa_attention(q[:, :40], k[:, :40], v[:, :40], CFG, cache=c2, compress_weights=w)
    check_bound(max_err(a, b), nsa_tol(q, k, v), "prefill with cache")
    a = nsa.nsa_attention(q[:, 40:], k[:, 40:], v[:, 40:], CFG, cache=c1, compress_weights=w)
    b = ref.nsa_attention(q[:, 40:], k[:, 40:], v[:, 40:], CFG, cache=c2, compress_weights=w)
    check_bound(max_err(a, b), nsa_tol(q, k, v), "decode step")
    cu = torch.tensor([0, 17, 41], dtype=torch.int32)
    a, ia = nsa.nsa_attention(q, k, v, CFG, cu_seqlens=cu, return_indices=True)
    b, ib = ref.nsa_attention(q, k, v, CFG, cu_seqlens=cu, return_indices=True)
    _compare(a, ia, b, ib, nsa_tol(q, k, v))


@needs_triton
def test_triton_grad_runs():
    """The Triton backward (tests/test_nsa_backward.py checks its values against the reference)."""
    dev = "cuda" if CUDA and not INTERPRET else "cpu"
    q, k, v = rand(1, 20, 2, 1, 16, seed=32, device=dev)
    q.requires_grad_(True)
    _tri().nsa_attention(q, k, v, CFG).sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0


def _topk_inputs(kind, n_b, n_rows, seed):
    """Selection scores (imp_a, imp_b) fp32 (1, 2, n_rows, n_b + 1) of one pattern (see the top-k test)."""
    g = torch.Generator().manual_seed(seed)
    shape = (1, 2, n_rows, n_b + 1)
    j = torch.arange(n_b + 1)
    if kind == "random":
        return torch.rand(shape, generator=g), torch.rand(shape, generator=g)
    if kind == "ties":        # few distinct values: many exactly equal scores, the order decided by block index
        return torch.randint(0, 4, shape, generator=g).float(), torch.zeros(shape)
    if kind == "const":       # every score equal
        return torch.ones(shape), torch.ones(shape)
    # "clustered": the large scores all sit in two of the parallel filter's 32 strided chunks (j mod 32 in {0, 1}),
    # so at 1024 blocks ~64 blocks beat the 16th largest chunk maximum: more than its CAP = 32 candidates
    a = torch.rand(shape, generator=g) + 10.0 * ((j % 32) < 2).float()
    return a, torch.zeros(shape)


def _topk_candidates(score, cur, nsel=16, nch=32):
    """The parallel top-k's candidate count for one row of scores (n_b,) (blocks <= cur visible), as the kernel's
    filter computes it: keys (score bits, ~index), chunk maxima of j mod nch, their nsel-th largest."""
    nblk = max(16, 1 << (score.numel() - 1).bit_length())
    sc = torch.full((nblk,), float("-inf"))
    sc[:cur + 1] = score[:cur + 1]
    sc[0], sc[cur] = ref.FORCE_FIRST, float("inf")
    key = (sc.view(torch.int32).long() << 32) | (nblk - 1 - torch.arange(nblk))
    lim = key.reshape(nblk // nch, nch).amax(0).sort(descending=True).values[nsel - 1]
    return int(((key >= lim) & (torch.arange(nblk) <= cur)).sum())


@needs_triton
# (each path and tie pattern once: CI time)
@pytest.mark.parametrize("kind,n_b", [("random", 20), ("random", 100), ("random", 1024), ("ties", 20), ("ties", 1024),
                                      ("const", 100), ("clustered", 1024)])
def test_triton_topk_parallel_and_serial_match_reference(kind, n_b, monkeypatch):
    """`_topk_kernel` alone on given scores, PARALLEL_TOPK on and off, against `select_blocks` (ties to the lower
    block index, the local and first blocks forced, -1 padding): rows that see 1..20 blocks (fewer than the 16
    selected) and rows spread up to the last block (and past it: capped). n_b 20: one pairwise rank of all blocks;
    100 and 1024: the chunk-maxima filter and the rank of its candidates, and (clustered, 1024) its serial
    fallback when the candidates exceed CAP = 32."""
    nsa = _tri()
    dev = "cuda" if CUDA and not INTERPRET else "cpu"
    monkeypatch.setattr(nsa, "TOPK_PARALLEL_MIN_BLOCKS", 0)
    nsel = 16
    cfg = ref.NSAParams(block_size=1, num_selected=nsel)
    stride = -(-(n_b + 3) // 12)
    for q_off, ts, n_rows in ((0, 1, 20), (5, stride, 13)):     # row i sees blocks 0 .. q_off + i * ts (capped)
        a, b = _topk_inputs(kind, n_b, n_rows, seed=n_b + n_rows)
        qpos = q_off + ts * torch.arange(n_rows)
        score = a[..., :n_b] + torch.where(torch.arange(n_b) >= 1, b[..., :n_b], torch.zeros(()))
        want = ref.select_blocks(score, qpos, cfg, causal=True)
        for par in (True, False):
            monkeypatch.setattr(nsa, "PARALLEL_TOPK", par)
            got = nsa._topk(a.clone().to(dev), b.clone().to(dev), n_b, q_off, 0, ts, 1, nsel)
            assert torch.equal(got.long().cpu(), want), (kind, n_b, q_off, par)
    if kind == "clustered" and n_b == 1024:   # the case this input exists for: the fallback path is taken
        cur = min(q_off + ts * (n_rows - 1), n_b - 1)
        assert _topk_candidates(score[0, 0, -1], cur) > 32
    if kind == "random" and n_b == 1024:      # and the filter path
        cur = min(q_off + ts * (n_rows - 1), n_b - 1)
        assert _topk_candidates(score[0, 0, -1], cur) <= 32


@needs_triton
@pytest.mark.parametrize("parallel", [True, False])
def test_triton_selection_ties_go_to_lower_blocks(parallel, monkeypatch):
    """Equal importances end to end: k is one vector at every position, so each query's compressed probabilities
    are uniform; with compress_block = stride = block_size every selection block gets exactly one compressed
    block's weight, so all visible blocks tie exactly (in the kernel and in the reference alike) and the blocks
    after the forced ones are the lowest-indexed ones. q and k hold multiples of 1/4 in [-1/2, 1/2], so every
    q.k is exact in any summation order (a BLAS, as the interpreter's dot, may round equal columns differently)."""
    nsa = _tri()
    monkeypatch.setattr(nsa, "PARALLEL_TOPK", parallel)
    monkeypatch.setattr(nsa, "TOPK_PARALLEL_MIN_BLOCKS", 0)
    dev = "cuda" if CUDA and not INTERPRET else "cpu"
    cfg = NSAConfig(block_size=16, num_selected=4, window=16, compress_block=16, compress_stride=16)
    q, k, v = rand(1, 160, 2, 1, 16, seed=60, device=dev)
    q, k = (torch.round(x * 2).clamp(-2, 2) / 4 for x in (q, k))
    k = k[:, :1].expand_as(k).contiguous()
    out, idx = nsa.nsa_attention(q, k, v, cfg, return_indices=True)
    want, widx = ref.nsa_attention(q, k, v, cfg, return_indices=True)
    _compare(out, idx, want, widx, nsa_tol(q, k, v))
    t = torch.arange(160)
    cur = t // 16
    # a token whose local block is >= 4 sees only complete compressed blocks before its local block ... all tied:
    # it selects 0, 1, 2 (lowest indices) and its local block
    late = cur >= 4
    exp = torch.stack([torch.zeros_like(cur), torch.ones_like(cur), torch.full_like(cur, 2), cur], -1)
    assert torch.equal(idx[0, late, 0].long().cpu(), exp[late])


@gpu
@pytest.mark.parametrize("selection", ["token", "tile"])
def test_gpu_parallel_topk_equals_serial_at_long_t(selection, monkeypatch):
    """bf16 at T = 32K (512 selection blocks: the parallel top-k's default range, too long for the dense
    reference): PARALLEL_TOPK on and off select the same blocks and give the same output bits."""
    from sparsepatch.kernels.nsa import forward as nsa
    cfg = NSAConfig(selection=selection)
    q, k, v = rand(1, 32768, 16, 1, 128, dtype=torch.bfloat16, seed=7, device="cuda")
    res = []
    for par in (True, False):
        monkeypatch.setattr(nsa, "PARALLEL_TOPK", par)
        res.append(nsa.nsa_attention(q, k, v, cfg, return_indices=True))
    assert nsa.TOPK_PARALLEL_MIN_BLOCKS <= 512
    assert torch.equal(res[0][1], res[1][1])
    assert torch.equal(res[0][0], res[1][0])
    assert int((res[0][1] >= 0).sum(-1).min()) >= 1 and int(res[0][1][0, -1, 0].min()) >= 0   # last row: 16 blocks


@gpu
@pytest.mark.parametrize("slc_rows", [0, 128])
@pytest.mark.parametrize("G, Hk", [(16, 2), (4, 4), (1, 8)])
@pytest.mark.parametrize("T", [1000, 4096])
def test_gpu_bf16_matches_reference(G, Hk, T, slc_rows, monkeypatch):
    from sparsepatch.kernels.nsa import forward as nsa
    monkeypatch.setattr(nsa, "SLC_TILE_ROWS", slc_rows)   # 0: per-token selected kernel, 128: token-tile union
    cfg = NSAConfig()
    q, k, v = rand(1, T, G * Hk, Hk, 128, dtype=torch.bfloat16, seed=T + G, device="cuda")
    gates = torch.rand(1, T, G * Hk, 3, generator=torch.Generator().manual_seed(T + G)).cuda()
    out, idx = nsa.nsa_attention(q, k, v, cfg, gates=gates, return_indices=True)
    want, widx = ref.nsa_attention(q, k, v, cfg, gates=gates, return_indices=True)
    same = (idx.long() == widx).all(-1)                            # (B, T, Hk): near-ties may flip in bf16
    assert same.float().mean().item() > 0.995
    rows = same.all(-1)[0]                                          # tokens whose every KV head agrees
    err = _bf16_err(out[0, rows], want[0, rows])
    assert err < 2e-2, err


@gpu
@pytest.mark.parametrize("G, Hk", [(16, 2), (4, 4), (1, 8)])
def test_gpu_bf16_tile_selection_matches_reference(G, Hk):
    """selection="tile", bf16, NSAConfig() sizes: prefill of 4000 tokens, then a cache prefill of 3000 (mid-tile)
    and decode steps 3000..3009 across the tile boundary at 3008, against the reference."""
    from sparsepatch.kernels.nsa import forward as nsa
    cfg = NSAConfig(selection="tile")
    q, k, v = rand(1, 4000, G * Hk, Hk, 128, dtype=torch.bfloat16, seed=G, device="cuda")
    gates = torch.rand(1, 4000, G * Hk, 3, generator=torch.Generator().manual_seed(G)).cuda()
    out, idx = nsa.nsa_attention(q, k, v, cfg, gates=gates, return_indices=True)
    want, widx = ref.nsa_attention(q, k, v, cfg, gates=gates, return_indices=True)
    same = (idx.long() == widx).all(-1)
    assert same.float().mean().item() > 0.99                       # a flipped near-tie flips a whole tile
    rows = same.all(-1)[0]
    assert _bf16_err(out[0, rows], want[0, rows]) < 2e-2
    cache = ref.NSACache()
    nsa.nsa_attention(q[:, :3000], k[:, :3000], v[:, :3000], cfg, gates=gates[:, :3000], cache=cache)
    for t in range(3000, 3010):
        o, i = nsa.nsa_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cfg, gates=gates[:, t:t + 1],
                                 cache=cache, return_indices=True)
        assert torch.equal(i[0, 0], idx[0, t]), t                   # the tile's blocks, carried by the cache
        if rows[t]:
            assert _bf16_err(o[0, 0], want[0, t]) < 2e-2, t


@gpu
def test_gpu_decode_matches_reference():
    from sparsepatch.kernels.nsa import forward as nsa
    cfg = NSAConfig()
    q, k, v = rand(2, 3001, 32, 8, 128, dtype=torch.bfloat16, seed=3, device="cuda")
    c1, c2 = ref.NSACache(), ref.NSACache()
    nsa.nsa_attention(q[:, :3000], k[:, :3000], v[:, :3000], cfg, cache=c1)
    ref.nsa_attention(q[:, :3000], k[:, :3000], v[:, :3000], cfg, cache=c2)
    a, ia = nsa.nsa_attention(q[:, 3000:], k[:, 3000:], v[:, 3000:], cfg, cache=c1, return_indices=True)
    b, ib = ref.nsa_attention(q[:, 3000:], k[:, 3000:], v[:, 3000:], cfg, cache=c2, return_indices=True)
    assert torch.equal(ia.long(), ib)
    assert (a.float() - b.float()).abs().max().item() < 2e-2


# ------------------------------------------------------------------------------------------------ transformers
LLM_CFG = NSAConfig(block_size=16, num_selected=2, window=32, compress_block=16, compress_stride=8)


def tiny_llama(seed=0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   attn_implementation="sdpa")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def _patch(model, config):
    from sparsepatch.patcher.state import PatchHandle
    from sparsepatch.patcher.transformers_nsa import patch_nsa
    h = PatchHandle(model, config)
    patch_nsa(model, config, h)
    return h


@pytest.mark.parametrize("selection", ["token", "tile"])
def test_llama_nsa_generate_matches_full_forward(selection):
    model = tiny_llama()
    # 3 selected of 4 blocks: one chosen by importance (2 = only the forced first and local blocks)
    h = _patch(model, NSAConfig(**{**LLM_CFG.__dict__, "selection": selection, "num_selected": 3}))
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        seq = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        full = model(seq[:, :-1]).logits
    assert seq.shape[1] == 52
    # greedy decode through the cache == argmax of a single prefill over the same tokens (decode consistency)
    assert torch.equal(full[0, 39:].argmax(-1), seq[0, 40:])
    st = h.stats()["density"]
    layer = next(iter(st))
    assert len(st[layer]["prefill"]) >= 2 and len(st[layer]["decode"]) == 11
    assert all(0 < d for d in st[layer]["decode"])
    h.remove()


def test_llama_window_only_gates_equal_dense():
    dense = tiny_llama()
    model = tiny_llama()
    cfg = NSAConfig(block_size=16, num_selected=2, window=64, compress_block=16, compress_stride=8, gates="learned")
    h = _patch(model, cfg)
    names = [n for n, _ in model.named_parameters() if "nsa_gate" in n]
    assert len(names) == 4 and all(p.requires_grad for n, p in model.named_parameters() if "nsa_gate" in n)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "nsa_gate"):
                m.nsa_gate.bias.copy_(torch.tensor([-200.0, -200.0, 200.0]))
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids).logits
        want = dense(ids).logits
    # patched vs unpatched model: two fp32 evaluations, 2 layers over 48 tokens
    assert_agree(got, want, bound=denoiser_bound(torch.float32, 48, 1, 2, magnitude=want.abs().max().item()))
    h.remove()


def test_llama_learned_gates_train_and_unpatch_bit_exact():
    twin = tiny_llama()
    model = tiny_llama()
    keys = set(model.state_dict())
    h = _patch(model, NSAConfig(block_size=16, num_selected=2, window=32, compress_block=16, compress_stride=8,
                                gates="learned"))
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    loss = model(ids, labels=ids).loss
    loss.backward()
    gate = next(m.nsa_gate for m in model.modules() if hasattr(m, "nsa_gate"))
    assert torch.isfinite(gate.weight.grad).all() and gate.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    h.remove()
    assert set(model.state_dict()) == keys
    assert not any(hasattr(m, "nsa_gate") for m in model.modules())
    assert model.config._attn_implementation == twin.config._attn_implementation
    with torch.no_grad():
        assert torch.equal(model(ids).logits, twin(ids).logits)


def test_llama_padding_mask_raises():
    model = tiny_llama()
    h = _patch(model, LLM_CFG)
    ids = torch.randint(0, 128, (2, 20))
    am = torch.ones(2, 20, dtype=torch.long)
    am[0, :5] = 0
    with pytest.raises(NotImplementedError, match="mask"):
        with torch.no_grad():
            model(ids, attention_mask=am)
    h.remove()
