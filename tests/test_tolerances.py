"""The error-model helpers of tests/kernel_checks.py: each bound holds for a correct fp32 computation and fails for
the bugs the tests rely on it to catch (a missing softmax scale, a dropped key tile, a dropped summand)."""
import math

import pytest
import torch

from kernel_checks import (MARGIN, assert_agree, assert_close_to_oracle, assert_rel, attention_bounds,
                           attention_rel_bound, check_bound, denoiser_bound, eps, fp_bound, max_err, rel)
from sparsepatch.testing import video_like_qkv


def fp32_attention(q, k, v, scale=None, drop=None):
    """Softmax attention computed in fp32 with plain torch ops (a second implementation, not the reference).
    drop: a slice of keys left out (the "dropped tile" bug). Returns (out (B, Sq, H, D), lse (B, H, Sq))."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if drop is not None:
        keep = torch.ones(k.shape[1], dtype=torch.bool)
        keep[drop] = False
        k, v = k[:, keep], v[:, keep]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), v), lse


def oracle_attention(q, k, v):
    return fp32_attention(q.double(), k.double(), v.double())


def fails(fn):
    with pytest.raises(AssertionError):
        fn()
    return True


def test_eps_and_bound_arguments():
    assert eps(torch.float32) == 2.0 ** -23 and eps(torch.float16) == 2.0 ** -10 and eps("tf32") == 2.0 ** -10
    assert fp_bound(torch.float32, 16, 2.0, 3) == MARGIN * 2.0 ** -23 * 4 * 3 * 2.0
    for kwargs, name in ((dict(reduction=0), "reduction"), (dict(depth=0.5), "depth"),
                         (dict(magnitude=-1.0), "magnitude"), (dict(margin=-1.0), "margin")):
        with pytest.raises(ValueError, match=name):
            fp_bound(torch.float32, **kwargs)
    with pytest.raises(ValueError, match="dtype"):
        eps(torch.int32)
    assert fails(lambda: check_bound(float("nan"), 1.0))                 # NaN never passes


def test_oracle_bound_holds_for_fp32_sums_and_catches_a_dropped_summand():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 4096, generator=g), torch.randn(4096, 8, generator=g)
    oracle = x.double() @ w.double()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):                                           # another summation order
            torch.set_num_threads(threads)
            assert_close_to_oracle(x @ w, oracle, torch.float32, reduction=4096,
                                   magnitude=(x.abs() @ w.abs()).max().item())
    finally:
        torch.set_num_threads(before)
    dropped = x[:, 1:] @ w[1:]                                           # one of 4096 terms missing
    assert fails(lambda: assert_close_to_oracle(dropped, oracle, torch.float32, reduction=4096,
                                                magnitude=(x.abs() @ w.abs()).max().item()))
    # two fp32 orders agree within twice the bound; the dropped summand does not
    chunked = sum(x[:, i:i + 512] @ w[i:i + 512] for i in range(0, 4096, 512))
    mag = (x.abs() @ w.abs()).max().item()
    assert_agree(x @ w, chunked, torch.float32, 4096, magnitude=mag)
    assert fails(lambda: assert_agree(dropped, chunked, torch.float32, 4096, magnitude=mag))


@pytest.mark.parametrize("sharp", [False, True], ids=["random", "video-like"])
def test_attention_bounds_hold_and_catch_missing_scale_and_dropped_tile(sharp):
    if sharp:    # peaked attention, |logits| ~ 50: the logit rounding term dominates
        q, k, v = video_like_qkv(frames=2, height=8, width=8, dim=32)
    else:
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(1, 128, 2, 32, generator=g) for _ in range(3))
    out_bound, lse_bound = attention_bounds(q, k, v, torch.float32)
    want, want_lse = oracle_attention(q, k, v)
    out, lse = fp32_attention(q, k, v)
    sdpa = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    for got in (out, sdpa):
        assert_close_to_oracle(got, want, bound=out_bound)
    assert_close_to_oracle(lse, want_lse, bound=lse_bound)
    unscaled, unscaled_lse = fp32_attention(q, k, v, scale=1.0)
    dropped, dropped_lse = fp32_attention(q, k, v, drop=slice(16, 32))    # one 16-key tile
    assert fails(lambda: assert_close_to_oracle(unscaled, want, bound=out_bound))
    assert fails(lambda: assert_close_to_oracle(unscaled_lse, want_lse, bound=lse_bound))
    assert fails(lambda: assert_close_to_oracle(dropped, want, bound=out_bound))
    assert fails(lambda: assert_close_to_oracle(dropped_lse, want_lse, bound=lse_bound))


def test_attention_rel_bound_holds_for_fp32_gradients_and_catches_bugs():
    q, k, v = (t.requires_grad_() for t in video_like_qkv(frames=2, height=8, width=8, dim=32))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(oracle_attention(qd, kd, vd)[0], (qd, kd, vd), do.double())
    bound = attention_rel_bound(q, k, v, torch.float32)
    got = torch.autograd.grad(fp32_attention(q, k, v)[0], (q, k, v), do)
    for a, b in zip(got, want):
        assert_rel(a, b, bound=bound)
    for bug in (dict(scale=1.0), dict(drop=slice(16, 32))):
        bad = torch.autograd.grad(fp32_attention(q, k, v, **bug)[0], (q, k, v), do)
        assert fails(lambda: [assert_rel(a, b, bound=bound) for a, b in zip(bad, want)])
    assert rel(got[0], want[0]) > 0                                     # not trivially exact


def test_denoiser_bound_holds_for_another_fp32_pipeline_run_and_catches_attention_bugs():
    """Tiny Wan, 2 CFG steps: the math SDPA backend (another fp32 summation order) stays within the two-run bound;
    the same pipeline with one 16-key tile of every self-attention dropped, or without the softmax scale, does
    not (the bugs `test_diffusers_adapter` / `test_parallel` must catch)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sparsepatch.testing import tiny_wan_pipeline, wan_call_kwargs
    pipe = tiny_wan_pipeline(head_dim=32, attention_gain=100.0)
    pipe.set_progress_bar_config(disable=True)

    def frames():
        with torch.no_grad():
            return pipe(**wan_call_kwargs(height=96, width=96, num_frames=9, steps=2)).frames

    dense = frames()
    bound = 2 * denoiser_bound(torch.float32, 3 * 6 * 6, steps=2, layers=2, guidance=5.0,
                               magnitude=dense.abs().max().item())
    with sdpa_kernel(SDPBackend.MATH):
        check_bound(max_err(frames(), dense), bound, "math SDPA")
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def buggy(query, key, value, *args, scale=None, drop=False, **kw):
        if drop and key.shape[-2] > 32:                                  # self-attention: 108 keys
            keep = torch.ones(key.shape[-2], dtype=torch.bool)
            keep[16:32] = False
            key, value = key[..., keep, :], value[..., keep, :]
        return sdpa(query, key, value, *args, scale=1.0 if not drop else scale, **kw)

    for drop in (True, False):
        torch.nn.functional.scaled_dot_product_attention = lambda *a, **kw: buggy(*a, drop=drop, **kw)
        try:
            bad = frames()
        finally:
            torch.nn.functional.scaled_dot_product_attention = sdpa
        assert max_err(bad, dense) > bound, drop


def test_threads_option_is_applied(pytestconfig):
    n = pytestconfig.getoption("--threads")
    assert torch.get_num_threads() == (n if n is not None else min(2, torch.get_num_threads()))
    assert math.isfinite(fp_bound(torch.float32))
