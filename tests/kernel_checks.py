"""Shared by the tests: markers for interpreter / GPU runs, and the floating-point error model every tolerance uses.

conftest.py sets TRITON_INTERPRET=1 on machines without CUDA before any test module imports Triton.

Error model (why the bounds below have the shape they have). A sum of n terms rounded in a format with machine
epsilon eps = 2^-(mantissa bits) (torch.finfo(dtype).eps: fp32 1.2e-7, tf32 9.8e-4, fp16 9.8e-4, bf16 7.8e-3)
carries a rounding error of about eps * sqrt(n) * (magnitude of the terms): the roundings are nearly independent,
so they add like a random walk; their exact pattern depends on the summation order, which changes with the CPU's
vector width (ATEN_CPU_CAPABILITY), the BLAS kernel and the thread count. Independent error sources add in
quadrature, so a chain of reductions of lengths n1, n2, ... counts as one of length n1 + n2 + ...; `depth`
multiplies the bound for sequential stages whose errors can add coherently (layers, denoising steps).

    fp_bound(dtype, reduction, magnitude, depth, margin) = margin * eps(dtype) * sqrt(reduction) * depth * magnitude

`margin` (MARGIN = 8 by default) covers the largest of many roughly Gaussian errors (~4-5 sigma over 1e4-1e6
elements) times a factor 2 for the spread between kernels, CPUs and thread counts; relative Frobenius norms (`rel`)
are an rms, which has no tail: RMS_MARGIN = 4 there. Comparisons:
- against an fp64 oracle (the claim "equals dense"): `assert_close_to_oracle`; the oracle's own error is ~1e-16.
  sparsepatch's reference kernels compute fp32 inputs in fp64 and round once: compared with an fp64 loop they are
  oracle-exact up to that final rounding (reduction=1).
- two computations in the same format (parallel vs single process, patched vs unpatched model): `assert_agree`,
  twice the bound (each side carries its own error).
- relative Frobenius norms (`rel`): `assert_rel` / `rel_bound`, the same bound at magnitude 1 and RMS_MARGIN.
  A kernel fed the same rounded inputs as its reference and computing in fp32 differs from it by its fp32 sums and
  the rounding of its output: rel_bound(out dtype) + rel_bound(fp32, reduction).
Softmax attention gets its own estimate (`attention_bounds`): a logit s = scale * q.k rounded with relative error
eps * sqrt(D) moves the output by ~|s| * that * |v| (peaked attention has |s| >> 1), on top of eps * sqrt(Sk) * |v|
from the P.V sum.

Setting SPARSEPATCH_TOL_LOG=<file> appends one JSON line (test, what, err, bound) per checked bound, so the
headroom of every tolerance can be read off a run (`make test-matrix` prints the tightest ones).
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
cpu_only = pytest.mark.skipif(not INTERP, reason="interpreter tests (TRITON_INTERPRET=1, no CUDA)")
gpu = pytest.mark.gpu

MARGIN = 8.0
RMS_MARGIN = 4.0
TF32 = "tf32"          # fp32 operands rounded to a 10-bit mantissa (Triton's default fp32 dot on GPU)


def rel(got, want) -> float:
    """||got - want|| / ||want|| in fp64 (want is the reference)."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def eps(dtype) -> float:
    """Machine epsilon of `dtype` (a torch floating dtype, or TF32)."""
    if dtype == TF32:
        return 2.0 ** -10
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype or 'tf32', got {dtype!r}")
    return torch.finfo(dtype).eps


def fp_bound(dtype, reduction: float = 1, magnitude: float = 1.0, depth: float = 1, margin: float = MARGIN) -> float:
    """margin * eps(dtype) * sqrt(reduction) * depth * magnitude: the max-abs rounding error of a result of size
    `magnitude` computed in `dtype` through sums of total length `reduction` over `depth` sequential stages."""
    for name, value, low in (("reduction", reduction, 1), ("depth", depth, 1), ("margin", margin, 0)):
        if not value >= low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if not magnitude >= 0:
        raise ValueError(f"magnitude must be >= 0, got {magnitude}")
    return margin * eps(dtype) * math.sqrt(reduction) * depth * magnitude


def rel_bound(dtype, reduction: float = 1, depth: float = 1, margin: float = RMS_MARGIN) -> float:
    """Bound on `rel(got, want)` (a relative rms error) for a result computed in `dtype` through sums of total
    length `reduction`."""
    return fp_bound(dtype, reduction, 1.0, depth, margin)


def _logit_scale(q, k, scale) -> float:
    """L = |scale| * max_(i, j) sum_d |q_id k_jd| (Cauchy-Schwarz max|q_i| max|k_j| for large inputs): >= every
    |logit|, and the scale of a logit's rounding. q (B, Sq, Hq, D), k (B, Sk, Hk, D)."""
    B, Sq, Hq, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    if not (Sq and Sk):
        return 0.0
    qa, ka = q.detach().float().abs(), k.detach().float().abs()
    if B * Hq * Sq * Sk <= 1 << 24:
        L = torch.einsum("bqhgd,bkhd->bhgqk", qa.reshape(B, Sq, Hk, Hq // Hk, D), ka).max().item()
    else:
        L = (qa.norm(dim=-1).max() * ka.norm(dim=-1).max()).item()
    return abs(scale) * L


def attention_bounds(q, k, v, dtype=None, scale=None, margin: float = MARGIN) -> tuple[float, float]:
    """(out, lse) max-abs error bounds for softmax attention evaluated in `dtype` (default q.dtype) vs the exact
    value. q (B, Sq, Hq, D), k/v (B, Sk, Hk, D) with Hq % Hk == 0; scale defaults to D^-0.5.

    A logit s = scale * sum_d q_d k_d is rounded by ~eps * sqrt(D) * L (`_logit_scale`); that moves the output by
    up to that times max|v| and the log-sum-exp by as much. The P.V sum adds eps * sqrt(Sk) * max|v|; the final
    rounding of the lse adds eps * |lse| <= eps * (L + log Sk). Sources in quadrature."""
    D, Sk = q.shape[-1], k.shape[1]
    scale = D ** -0.5 if scale is None else float(scale)
    L = _logit_scale(q, k, scale)
    vmax = v.detach().double().abs().max().item() if v.numel() else 0.0
    logit2 = D * L * L
    out = fp_bound(dtype or q.dtype, Sk + logit2 + 1, vmax, 1, margin)
    lse = fp_bound(dtype or q.dtype, Sk + logit2 + (L + math.log(max(Sk, 1))) ** 2, 1.0, 1, margin)
    return out, lse


def attention_rel_bound(q, k, v, dtype=None, scale=None, margin: float = RMS_MARGIN) -> float:
    """Bound on `rel` (relative rms error) of attention outputs and gradients (dq, dk, dv) computed in `dtype`
    (default q.dtype) vs the exact values: the sums over keys (out, dq), queries (dk, dv) and features (dP = dO V^T),
    the logits' rounding sqrt(D) * L (`_logit_scale`) and the stored lse's (L + log Sk), in quadrature."""
    Sq, D, Sk = q.shape[1], q.shape[-1], k.shape[1]
    scale = D ** -0.5 if scale is None else float(scale)
    L = _logit_scale(q, k, scale)
    return rel_bound(dtype or q.dtype, Sq + Sk + D + D * L * L + (L + math.log(max(Sk, 1))) ** 2, 1, margin)


def denoiser_bound(dtype, tokens: int, steps: int, layers: int, guidance: float = 1.0, magnitude: float = 1.0,
                   margin: float = MARGIN) -> float:
    """Max-abs bound for the output of a `steps`-step sampler over a `layers`-block transformer in `dtype`.

    Each attention call of `tokens` keys rounds at ~eps * sqrt(tokens) of its output; the steps * layers calls are
    sequential stages (errors may add coherently: depth); classifier-free guidance v_u + w (v_c - v_u) amplifies
    the error of each branch by |w| + |w - 1|. The VAE decode after the sampler is a fixed, well-conditioned map
    from latents to frames in [0, 1] (magnitude 1)."""
    gain = abs(guidance) + abs(guidance - 1.0) if guidance != 1.0 else 1.0
    return fp_bound(dtype, tokens, magnitude * gain, steps * layers, margin)


def _log(what: str, err: float, bound: float) -> None:
    path = os.environ.get("SPARSEPATCH_TOL_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "what": what, "err": err, "bound": bound,
                                "cap": torch.backends.cpu.get_cpu_capability(),
                                "threads": torch.get_num_threads()}) + "\n")


def check_bound(err: float, bound: float, what: str = "") -> float:
    """assert err <= bound (NaN fails), logging the pair when SPARSEPATCH_TOL_LOG is set; returns err."""
    _log(what, err, bound)
    assert err <= bound, f"{what + ': ' if what else ''}error {err:.3e} > bound {bound:.3e} ({err / bound:.2f}x)"
    return err


def max_err(actual, want, mask=None) -> float:
    """max |actual - want| in fp64 over `mask` (bool, broadcastable; default everything); NaN if any is NaN."""
    d = (actual.detach().double() - want.detach().double()).abs()
    if mask is not None:
        d = d[mask.expand_as(d)] if mask.shape != d.shape else d[mask]
    if d.numel() == 0:
        return 0.0
    return float("nan") if torch.isnan(d).any() else d.max().item()


def assert_close_to_oracle(actual, oracle, dtype=None, reduction: float = 1, margin: float = MARGIN, *,
                           depth: float = 1, magnitude: float | None = None, bound: float | None = None, mask=None,
                           what: str = "") -> float:
    """max|actual - oracle| <= bound, the oracle exact (fp64, or an fp64 result rounded once).

    bound: given, or fp_bound(dtype (default actual.dtype), reduction, magnitude (default max|oracle|), depth,
    margin). mask: compare only where True. Returns the error."""
    if bound is None:
        if magnitude is None:
            magnitude = oracle.detach().double().abs().max().item() if oracle.numel() else 0.0
        bound = fp_bound(dtype or actual.dtype, reduction, magnitude, depth, margin)
    return check_bound(max_err(actual, oracle, mask), bound, what)


def assert_agree(a, b, dtype=None, reduction: float = 1, margin: float = MARGIN, *, depth: float = 1,
                 magnitude: float | None = None, bound: float | None = None, mask=None, what: str = "") -> float:
    """Two computations of the same value, each rounded in `dtype` (default a.dtype): max|a - b| <= 2 * bound, the
    per-side bound given or fp_bound(dtype, reduction, magnitude (default max(|a|, |b|)), depth, margin)."""
    if bound is None:
        if magnitude is None:
            magnitude = max(a.detach().double().abs().max().item(), b.detach().double().abs().max().item())
        bound = fp_bound(dtype or a.dtype, reduction, magnitude, depth, margin)
    return check_bound(max_err(a, b, mask), 2 * bound, what)


def assert_rel(got, want, dtype=None, reduction: float = 1, margin: float = RMS_MARGIN, *, depth: float = 1,
               bound: float | None = None, what: str = "") -> float:
    """rel(got, want) <= bound (default rel_bound(dtype (default got.dtype), reduction, depth, margin))."""
    if bound is None:
        bound = rel_bound(dtype or got.dtype, reduction, depth, margin)
    err = rel(got, want)
    return check_bound(err if err == err else float("nan"), bound, what)


def summarize(path: str, worst: int = 15) -> str:
    """The tightest bounds of a SPARSEPATCH_TOL_LOG file: per (test, what), the largest err / bound over the runs
    (CPU capabilities, thread counts) logged in it. Entries over their bound come from the negative checks of
    tests/test_tolerances.py (expected to exceed) or from failed tests (pytest reported them)."""
    worst_ratio, variants, over = {}, set(), 0
    with open(path) as f:
        for line in f:
            e = json.loads(line)
            variants.add((e["cap"], e["threads"]))
            ratio = e["err"] / e["bound"] if e["bound"] > 0 and e["err"] == e["err"] else float("inf")
            if ratio > 1:
                over += 1
                continue
            key = (e["test"], e["what"])
            worst_ratio[key] = max(worst_ratio.get(key, 0.0), ratio)
    rows = sorted(worst_ratio.items(), key=lambda kv: -kv[1])[:worst]
    out = [f"{len(worst_ratio)} bounds checked under {sorted(variants)}; {over} entries over their bound "
           f"(negative checks / failures); tightest (err / bound, max over variants):"]
    out += [f"  {r:6.3f}  {t} {w}".rstrip() for (t, w), r in rows]
    return "\n".join(out)


if __name__ == "__main__":
    import sys
    print(summarize(sys.argv[1]))
