"""Reference kernels vs independent, loop-based computations of the same definitions."""
import math

import pytest
import torch

from kernel_checks import assert_agree, assert_close_to_oracle, attention_bounds, fp_bound
from sparsepatch.kernels import SkipList
from sparsepatch.kernels.dense import reference
from sparsepatch.kernels.skip import reference as skip_reference
from sparsepatch.kernels.dense.reference import LOG2E


def naive_skip(q, k, v, listed, threshold, tile, scale, forced=None):
    """Row-by-row, tile-by-tile implementation of DESIGN.md section 5 (fp64)."""
    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    tm, tn = tile
    Tq, Tk = listed.shape[2:]
    group = H // k.shape[2]
    if forced is not None:
        listed = listed | forced
    keep = torch.zeros_like(listed)
    out = torch.zeros(B, Sq, H, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            s = (q[b, :, h].double() @ k[b, :, h // group].double().T) * scale
            for i in range(Tq):
                cols = [j for j in range(Tk) if listed[b, h, i, j]]
                if cols:
                    keep[b, h, i, cols[0]] = True
                for r in range(i * tm, min((i + 1) * tm, Sq)):
                    running = -math.inf
                    for j in cols:
                        m = s[r, j * tn: min((j + 1) * tn, Sk)].max().item()
                        if (m - running) * LOG2E > threshold:
                            keep[b, h, i, j] = True
                        running = max(running, m)
                    mask = torch.zeros(Sk, dtype=torch.bool)
                    for j in cols:
                        mask[j * tn: (j + 1) * tn] = True
                    p = torch.softmax(s[r].masked_fill(~mask, -math.inf), -1)
                    out[b, r, h] = p @ v[b, :, h // group].double()
    if forced is not None:
        keep |= forced
    return out, keep


def structured_qkv(B=1, S=300, H=2, Hk=1, D=16, seed=0, sharp=4.0):
    """Inputs whose attention is peaked (banded), so the keep rule drops tiles."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(S).float()
    freqs = torch.linspace(0.02, 0.3, D // 2)
    emb = torch.cat([torch.sin(pos[:, None] * freqs), torch.cos(pos[:, None] * freqs)], -1)
    q = emb[None, :, None] * sharp + 0.3 * torch.randn(B, S, H, D, generator=g)
    k = emb[None, :, None] * sharp + 0.3 * torch.randn(B, S, Hk, D, generator=g)
    v = torch.randn(B, S, Hk, D, generator=g)
    return q, k.expand(B, S, Hk, D).contiguous(), v


def test_dense_attention_matches_sdpa_gqa_causal():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 37, h, 16, generator=g) for h in (4, 2, 2))
    for causal in (False, True):
        out, lse = reference.attention(q, k, v, causal=causal, return_lse=True)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=True)
        # the reference is fp64 math rounded once; SDPA and the logsumexp below run in fp32
        out_bound, lse_bound = attention_bounds(q, k, v, torch.float32)
        assert_close_to_oracle(ref.transpose(1, 2), out, bound=out_bound, what="sdpa")
        s = (q.transpose(1, 2) @ k.repeat_interleave(2, 2).permute(0, 2, 3, 1)) / 4.0
        if causal:
            s = s.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), -math.inf)
        assert_close_to_oracle(torch.logsumexp(s, -1), lse, bound=lse_bound, what="logsumexp")


def test_skip_first_call_is_dense_and_rule_matches_naive():
    q, k, v = structured_qkv()
    tile = (64, 64)
    out, nxt, lse = skip_reference.skip_attention(q, k, v, None, -2.0, tile=tile, return_lse=True)
    dense = reference.attention(q, k, v)
    assert_agree(out, dense, torch.float32)         # the first call computes every tile (both fp64, rounded once)
    listed = torch.ones(nxt.shape, dtype=torch.bool)
    _, keep = naive_skip(q, k, v, listed, -2.0, tile, 1 / 4.0)
    assert torch.equal(nxt.to_mask(), keep)
    assert 0.2 < nxt.density().item() < 0.95       # structured inputs really drop tiles


def test_second_call_computes_only_listed_tiles():
    q, k, v = structured_qkv(seed=2)
    tile = (64, 64)
    _, lst = skip_reference.skip_attention(q, k, v, None, -2.0, tile=tile)
    q2, k2, v2 = structured_qkv(seed=3)
    out, nxt = skip_reference.skip_attention(q2, k2, v2, lst, -2.0)
    naive_out, keep = naive_skip(q2, k2, v2, lst.to_mask(), -2.0, tile, 1 / 4.0)
    assert_close_to_oracle(out, naive_out, torch.float32)       # fp64 math rounded once to fp32
    assert torch.equal(nxt.to_mask(), keep)
    assert (nxt.to_mask() & ~lst.to_mask()).sum() == 0      # skipped tiles stay skipped
    assert (out - reference.attention(q2, k2, v2)).abs().max() > 1e-4   # and it is not dense


def test_must_do_tiles_are_computed_and_kept():
    q, k, v = structured_qkv(seed=4)
    tile = (64, 64)
    sparse = SkipList.from_mask(torch.eye(5, dtype=torch.bool).expand(1, 2, 5, 5).contiguous(), tile, 300, 300)
    must_do = [(250, 300)]                          # e.g. text tokens appended after the video
    out, nxt = skip_reference.skip_attention(q, k, v, sparse, -2.0, must_do=must_do)
    forced = skip_reference.must_do_tiles(must_do, 300, 300, tile)
    assert forced[:, 3:].all() and forced[3:, :].all() and not forced[:3, :3].any()
    naive_out, keep = naive_skip(q, k, v, sparse.to_mask(), -2.0, tile, 1 / 4.0, forced=forced)
    assert_close_to_oracle(out, naive_out, torch.float32)
    assert torch.equal(nxt.to_mask(), keep)
    assert nxt.to_mask()[..., forced].all()


def test_keep_everything_threshold_equals_dense_any_length():
    q, k, v = structured_qkv(S=300, seed=5)
    out, nxt = skip_reference.skip_attention(q, k, v, None, -1e9, tile=(128, 128))
    assert nxt.density().item() == 1.0
    assert_agree(out, reference.attention(q, k, v), torch.float32)


def test_skip_attention_is_differentiable():
    q, k, v = (t.clone().requires_grad_() for t in structured_qkv(S=100, seed=6))
    lst = SkipList.from_mask(torch.tensor([[True, False], [True, True]]).expand(1, 2, 2, 2).contiguous(),
                             (64, 64), 100, 100)
    out, _ = skip_reference.skip_attention(q, k, v, lst, -2.0)
    out.square().sum().backward()
    # k rows 64.. are never attended by q-tile 0; their gradient comes from q-tile 1 only
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    naive = []
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd.expand(-1, -1, 2, -1)) / 4.0
    mask = lst.to_mask().repeat_interleave(64, 2)[:, :, :100].repeat_interleave(64, 3)[..., :100]
    p = torch.softmax(s.masked_fill(~mask, -math.inf), -1)
    naive = torch.einsum("bhqk,bkhd->bqhd", p, vd.expand(-1, -1, 2, -1))
    naive.square().sum().backward()
    for a, b in ((q, qd), (k, kd), (v, vd)):
        assert_close_to_oracle(a.grad, b.grad, torch.float32)      # autograd through fp64 math, rounded once


@pytest.mark.parametrize("kwargs, name", [
    (dict(threshold=0.0), "threshold"), (dict(threshold=1.0), "threshold"), (dict(tile=(100, 128)), "tile"),
    (dict(must_do=[(5, 2)]), "must_do"),
])
def test_hostile_inputs_name_the_argument(kwargs, name):
    q, k, v = structured_qkv(S=64)
    args = dict(threshold=-5.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        skip_reference.skip_attention(q, k, v, None, args.pop("threshold"), **args)


def test_mismatched_head_dims_and_skip_list_shapes():
    q = torch.randn(1, 64, 2, 16)
    with pytest.raises(ValueError, match="head dim"):
        reference.attention(q, torch.randn(1, 64, 2, 8), torch.randn(1, 64, 2, 8))
    with pytest.raises(ValueError, match="skip_list"):
        skip_reference.skip_attention(q, q, q, SkipList.full(1, 2, 128, 64, (64, 64)))


def test_skiplist_roundtrip_and_density():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 3, 4, 5, generator=g) > 0.5
    lst = SkipList.from_mask(mask, (16, 32))
    assert torch.equal(lst.to_mask(), mask)
    assert lst.counts.dtype == torch.int32 and lst.indices.dtype == torch.int32
    for b, h, i in [(0, 0, 0), (1, 2, 3)]:
        n = lst.counts[b, h, i]
        assert lst.indices[b, h, i, :n].tolist() == mask[b, h, i].nonzero().squeeze(1).tolist()
    assert abs(lst.density().item() - mask.double().mean().item()) <= fp_bound(torch.float32)
    full = SkipList.full(1, 2, 300, 130, (128, 64))
    assert full.shape == (1, 2, 3, 3) and full.density().item() == 1.0
    with pytest.raises(ValueError, match="tile"):
        SkipList.full(1, 1, 64, 64, (24, 64))
