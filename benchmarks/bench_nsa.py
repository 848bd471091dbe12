"""Native Sparse Attention forward / decode: sparsepatch Triton vs SDPA (cuDNN causal) vs fla parallel_nsa.

    python benchmarks/bench_nsa.py [--quick] [--out DIR] [--max-t N] [--bwd] [--bwd-only] [--slc-ab 0,64,128]

Prefill forward, bf16, D=128, B=1, NSAConfig() (block 64, 16 selected, window 512, compressed block 32 stride 16,
uniform gates) for HQ64/H4 (G=16), HQ32/H8 (G=4), HQ16/H16 (MHA), T = 8K..64K (128K for G=16 with --max-t).
Peers in the same process on the same inputs: SDPA causal with the cuDNN backend (k/v expanded to HQ heads outside
the timing) and fla's parallel_nsa (G=16 only: fla needs G >= 16; block 64, 16 blocks, its own mean pooling with
compressed block = stride = 64, gates given) — a cheaper compression than ours (T/64 vs T/16 compressed keys). fla's
window branch needs flash-attn, so fla runs without it (window_size=0): speedup_vs_fla compares it with our whole
forward, speedup_vs_fla_same_branches with our forward minus our window kernel (`--fla-only`: just these rows).
Decode (`bench_decode`; --decode-only runs only it): one query token, HQ64/H4, context 8K..64K,
NSACache(store_kv=False) prefilled, the split-K decode path eager and CUDA-graph captured vs SDPA decode
(enable_gqa: default, flash, cuDNN backends; default captured). Times: triton.testing.do_bench medians (ms). Also a
per-kernel breakdown at the largest T (CUDA events around each launch). Writes <out>/<gpu>-nsa.json and prints ratio
tables.
--bwd adds a training section "fwd_bwd": forward + backward (torch.autograd.grad of q, k, v for a random dout,
uniform gates) of ours vs SDPA cuDNN causal (k/v expanded outside the timing, gradients of the expanded tensors)
at the same head configurations, T = 8K..32K (8K, 16K with --quick; HQ64/H4 always up to --max-t, 64K); medians of
about 6 or more timed calls (`_bench_n`; plain do_bench times one call at 64K, where a call takes > 50 ms);
--bwd-only skips the forward and decode sections. --bwd-tune first times every stage of nsa_backward (CUDA events,
nsa_backward.PROFILE) at HQ64/H4 16K and 64K, sweeps BWD_SETS at --tune-t and uses the per-stage best for fwd_bwd
(--best-out writes it as JSON for SPARSEPATCH_NSA_BWD); --summary JSON prints the backward tables of a results file.
--slc-ab R,R,...: only an A/B of the selected-branch kernel (nsa.SLC_TILE_ROWS per value; 0 = per token) at every
head layout, with index equality and output differences against the first value (section slc_ab).
--phases (issue 27): HQ64/H4 per-phase forward times and ratios vs cuDNN at 4K..64K for token and tile
selection, with --variants (PHASE_VARIANTS: nsa.SLC_TILE_ROWS = the rule / union / per token; top-k serial /
parallel at every T / parallel on 2 warps) in one process, and fwd+bwd at 16K; JSON <out>/<gpu>-nsa-phases.json.
With --selection tile only tile selection (e.g. --variants base,two_launch: the selected and window branches in
two launches instead of the fused one).
--selection both (default) also times NSAConfig(selection="tile") on the same inputs: prefill rows tile_ms (and
tile_* ratios), decode rows tile_graph_us (a step continuing a tile: the cached blocks, no ranking) and
tile_avg_graph_us (block_size - 1 such steps + one ranking step); --selection tile makes every section tile.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sparsepatch.config import NSAConfig  # noqa: E402
from sparsepatch.kernels.nsa import reference as ref  # noqa: E402
from common import graph_replay, host_ms  # noqa: E402

HEADS = [(64, 4), (32, 8), (16, 16)]
TS = [8192, 16384, 32768, 65536]
DECODE_S = [8192, 16384, 32768, 65536]
D = 128


def _bench(fn, rep=100, warmup=10):
    import triton
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")   # ms


def _bench_n(fn, n=6, rep=50):
    """do_bench median over about n timed calls or more: do_bench alone times a single call once fn takes longer
    than rep ms (fwd+bwd at 64K: ours ~140 ms, cuDNN ~440 ms), and single calls move by ~5-15% with the clock."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return _bench(fn, rep=max(rep, n * (time.perf_counter() - t0) * 1e3))


def load_fla():
    try:
        from fla.ops.nsa import parallel_nsa
        return parallel_nsa, None
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"


def _err(exc):
    import traceback
    return (f"{type(exc).__name__}: {exc} | " + " <- ".join(
        f"{f.filename.split('/')[-1]}:{f.lineno}" for f in traceback.extract_tb(exc.__traceback__)[-4:]))[:400]


def cudnn_causal(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    G = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(G, 2).transpose(1, 2)
    vh = v.repeat_interleave(G, 2).transpose(1, 2)

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    return run


def fwd_bwd(fn, leaves, dout):
    """A closure running fn(*leaves) and its backward (gradients of every leaf for the upstream dout)."""
    def run():
        out = fn(*leaves)
        return torch.autograd.grad(out, leaves, dout)
    return run


def cudnn_causal_fwd_bwd(q, k, v, dout):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    G = q.shape[2] // k.shape[2]
    qh = q.detach().transpose(1, 2).requires_grad_(True)
    kh = k.detach().repeat_interleave(G, 2).transpose(1, 2).requires_grad_(True)
    vh = v.detach().repeat_interleave(G, 2).transpose(1, 2).requires_grad_(True)
    doh = dout.transpose(1, 2)

    def attn(a, b, c):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(a, b, c, is_causal=True)
    return fwd_bwd(attn, (qh, kh, vh), doh)


def bench_fwd_bwd(nsa, cfg, heads, ts, both_modes=False, write=None, ts_g16=None):
    """Rows of forward + backward times (ms): ours (with both_modes also the other selected-branch dk/dv mode of
    nsa_backward.BWD) vs SDPA cuDNN causal, bf16, D=128, B=1. ts_g16: the lengths for HQ64/H4 (default ts)."""
    from sparsepatch.kernels.nsa import backward as nsa_backward
    rows = []
    for HQ, H in heads:
        for T in (ts_g16 or ts) if (HQ, H) == (64, 4) else ts:
            q = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dout = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16)
            row = dict(HQ=HQ, H=H, G=HQ // H, T=T)
            try:
                run = fwd_bwd(lambda a, b, c: nsa.nsa_attention(a, b, c, cfg), (q, k, v), dout)
                row["ours_ms"] = _bench_n(run)                  # selected dk/dv mode "list" (the default)
                bwd_cfg = nsa_backward.BWD
                mode = bwd_cfg["slc_dkdv"]
                try:
                    if both_modes:
                        bwd_cfg["slc_dkdv"] = "atomic" if mode == "list" else "list"
                        row[f"ours_{bwd_cfg['slc_dkdv']}_ms"] = _bench_n(run)
                finally:
                    bwd_cfg["slc_dkdv"] = mode
                with torch.no_grad():
                    row["ours_fwd_ms"] = _bench_n(lambda: nsa.nsa_attention(q, k, v, cfg))
            except Exception as exc:  # noqa: BLE001
                row["ours_error"] = _err(exc)
            try:
                row["cudnn_ms"] = _bench_n(cudnn_causal_fwd_bwd(q, k, v, dout))
            except Exception as exc:  # noqa: BLE001
                row["cudnn_error"] = _err(exc)
            if "ours_ms" in row and "cudnn_ms" in row:
                row["speedup_vs_cudnn"] = row["cudnn_ms"] / row["ours_ms"]
            rows.append(row)
            print("fwd+bwd", {kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in row.items()},
                  flush=True)
            if write is not None:
                write(rows)
            del q, k, v, dout
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------- backward breakdown / tuning
# Candidate launch settings for nsa_backward.BWD (each set changes every kernel; the stages are independent, so
# the best value of each stage can be combined). Set 0 = the defaults.
BWD_SETS = [
    {},
    dict(cmp_rows=64, cmp_block_n=64, warps_cmp=4, stages_cmp=2, slc_rows=64, warps_slc_dkdv=8,
         stages_slc_dkdv=3, warps_slc=4, stages_slc=1, dq_rows=128, dq_block_n=64, warps_dq=8, stages_dq=3,
         swa_rows=64, swa_block_n=64, warps_swa=4, stages_swa=3),
    dict(cmp_rows=64, cmp_block_n=64, warps_cmp=4, stages_cmp=3, slc_rows=32, warps_slc_dkdv=4,
         stages_slc_dkdv=3, slc_chunk_rows=16384, warps_slc=2, stages_slc=2, dq_rows=128, dq_block_n=128,
         warps_dq=8, stages_dq=2, swa_rows=32, swa_block_n=64, warps_swa=4, stages_swa=2),
    dict(cmp_rows=32, cmp_block_n=64, warps_cmp=4, stages_cmp=4, slc_rows=64, warps_slc_dkdv=4,
         stages_slc_dkdv=3, slc_chunk_rows=16384, warps_slc=8, stages_slc=1, dq_rows=64, dq_block_n=64,
         warps_dq=4, stages_dq=2, swa_rows=32, swa_block_n=128, warps_swa=8, stages_swa=3),
    dict(cmp_rows=64, cmp_block_n=128, warps_cmp=8, stages_cmp=3, slc_rows=128, warps_slc_dkdv=8,
         stages_slc_dkdv=2, warps_slc=4, stages_slc=3, dq_rows=128, dq_block_n=64, warps_dq=4, stages_dq=2,
         swa_rows=16, swa_block_n=64, warps_swa=4, stages_swa=3),
    dict(cmp_rows=32, cmp_block_n=64, warps_cmp=4, stages_cmp=3, cmp_programs=2112, slc_rows=64,
         warps_slc_dkdv=4, stages_slc_dkdv=2, slc_chunk_rows=32768, warps_slc=2, stages_slc=3, dq_rows=256,
         dq_block_n=32, warps_dq=8, stages_dq=2, swa_rows=64, swa_block_n=64, warps_swa=8, stages_swa=3),
]
# Round 1 (2026-11-24, 16K; benchmarks/results/h100-nsa-fwd-bwd-sweep1.json) picked today's defaults; the sets
# above are round 2 around them.
# which BWD keys belong to which stage (for combining the best of each)
STAGE_KEYS = {"slc_dq": ("warps_slc", "stages_slc"),
              "slc_list": ("slc_rows", "warps_slc_dkdv", "stages_slc_dkdv", "slc_chunk_rows"),
              "dq": ("dq_rows", "dq_block_n", "warps_dq", "stages_dq"),
              "swa_dkdv": ("swa_rows", "swa_block_n", "warps_swa", "stages_swa"),
              "cmp_dkdv": ("cmp_rows", "cmp_block_n", "warps_cmp", "stages_cmp", "cmp_programs")}


def best_per_stage(sweep, base, sets, rel_key):
    """BWD settings that take, for each backward stage (STAGE_KEYS), that stage's keys from the sweep row (one per
    settings set, index row["set"] into `sets`) with the lowest stage time among the rows whose gradients matched
    (max of row[rel_key] < 1e-2); stages with no such row keep `base`."""
    best = dict(base)
    for stage, keys in STAGE_KEYS.items():
        ok = [r for r in sweep if stage in r and "error" not in r and max(r[rel_key]) < 1e-2]
        if ok:
            w = min(ok, key=lambda r: r[stage])
            best.update({kk: {**base, **sets[w["set"]]}[kk] for kk in keys})
    return best


def _bwd_inputs(nsa, cfg, HQ, H, T, seed=0):
    """Saved forward state for one nsa_backward call (uniform gates), bf16, D=128, B=1."""
    import math
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kc, vc = ref.compress_kv(k, v, cfg)
    scale = 1.0 / math.sqrt(D)
    _, idx, lse, bo = nsa._forward(q, k, v, kc, vc, None, scale, cfg, save=True)
    return dict(q=q, k=k, v=v, kc=kc, vc=vc, idx=idx, lse=lse, bo=bo, dout=dout, scale=scale)


def _bwd_call(inp, cfg):
    from sparsepatch.kernels.nsa import backward as nb
    return nb.nsa_backward(inp["q"], inp["k"], inp["v"], inp["kc"], inp["vc"], None, inp["idx"], inp["lse"],
                           inp["bo"], inp["dout"], inp["scale"], cfg)


def bwd_stages(inp, cfg, reps=3):
    """ms per backward stage (min over reps after one warm-up / compile call), CUDA events in nsa_backward."""
    from sparsepatch.kernels.nsa import backward as nb
    times = {}
    try:
        for i in range(reps + 1):
            nb.PROFILE = []
            _bwd_call(inp, cfg)
            torch.cuda.synchronize()
            if i:
                for name, s, e in nb.PROFILE:
                    times.setdefault(name, []).append(s.elapsed_time(e))
    finally:
        nb.PROFILE = None
    out = {n: round(min(v), 3) for n, v in times.items()}
    out["slc_list"] = round(out.get("slc_sort", 0) + out.get("slc_dkdv", 0), 3)
    out["bwd_total"] = round(sum(v for n, v in out.items() if n in times), 3)
    return out


def glue_times(nsa, cfg, inp):
    """ms of the pieces around nsa_backward: forward with save, compress_kv forward+backward, end-to-end."""
    q, k, v, dout = inp["q"], inp["k"], inp["v"], inp["dout"]
    res = {}
    res["fwd_save"] = _bench(lambda: nsa._forward(q, k, v, inp["kc"], inp["vc"], None, inp["scale"], cfg,
                                                  save=True), rep=30)
    with torch.no_grad():
        res["fwd_nograd"] = _bench(lambda: nsa.nsa_attention(q, k, v, cfg), rep=30)
    kl, vl = k.detach().requires_grad_(True), v.detach().requires_grad_(True)
    gk, gv = torch.randn_like(inp["kc"]), torch.randn_like(inp["vc"])

    def ckv():
        a, b = ref.compress_kv(kl, vl, cfg)
        return torch.autograd.grad((a, b), (kl, vl), (gk, gv))
    res["compress_kv_fwd_bwd"] = _bench(ckv, rep=30)
    ql = q.detach().requires_grad_(True)
    res["end_to_end"] = _bench(fwd_bwd(lambda a, b, c: nsa.nsa_attention(a, b, c, cfg), (ql, kl, vl), dout), rep=30)
    return {n: round(x, 3) for n, x in res.items()}


def bwd_tune(nsa, cfg, res, write, tune_t=16384, best_out=None):
    """Per-stage breakdown of the backward at HQ64/H4 (16K and 64K) for the defaults, a sweep of BWD_SETS at 16K,
    the per-stage best combined (checked against the defaults at T=2048), and its breakdown."""
    from sparsepatch.kernels.nsa import backward as nb
    base = dict(nb.BWD)
    tune = res.setdefault("bwd_tune", {})
    inp = _bwd_inputs(nsa, cfg, 64, 4, 2048, seed=1)
    ref_grads = [x.float() for x in _bwd_call(inp, cfg)[:5]]
    inp16 = _bwd_inputs(nsa, cfg, 64, 4, 16384)
    tune["before_16K"] = dict(stages=bwd_stages(inp16, cfg), glue=glue_times(nsa, cfg, inp16))
    print("before 16K", tune["before_16K"], flush=True)
    write()
    if tune_t != 16384:
        del inp16
        torch.cuda.empty_cache()
        inp16 = _bwd_inputs(nsa, cfg, 64, 4, tune_t)
    sweep = []
    for i, over in enumerate(BWD_SETS):
        nb.BWD.update(base)
        nb.BWD.update(over)
        row = dict(set=i)
        try:
            got = _bwd_call(inp, cfg)[:5]
            row["rel_vs_default"] = [round(((a.float() - b).abs().max() / b.abs().max()).item(), 4)
                                     for a, b in zip(got, ref_grads)]
            row.update(bwd_stages(inp16, cfg, reps=3 if tune_t <= 16384 else 2))
        except Exception as exc:  # noqa: BLE001
            row["error"] = _err(exc)
        sweep.append(row)
        print("sweep", row, flush=True)
    nb.BWD.update(base)
    tune["sweep_16K" if tune_t == 16384 else f"sweep_{tune_t // 1024}K"] = sweep
    best = best_per_stage(sweep, base, BWD_SETS, "rel_vs_default")
    tune["best"] = best
    print("best", best, flush=True)
    if best_out:
        with open(best_out, "w") as f:
            json.dump({kk: vv for kk, vv in best.items() if base.get(kk) != vv}, f)
    write()
    del inp16
    torch.cuda.empty_cache()
    inp64 = _bwd_inputs(nsa, cfg, 64, 4, 65536)
    if tune_t == 65536:
        tune["before_64K"] = dict(stages={kk: vv for kk, vv in sweep[0].items() if kk not in ("set", "rel_vs_default")})
    else:
        tune["before_64K"] = dict(stages=bwd_stages(inp64, cfg, reps=2))
    print("before 64K", tune["before_64K"], flush=True)
    nb.BWD.update(best)
    tune["after_64K"] = dict(stages=bwd_stages(inp64, cfg, reps=2), glue=glue_times(nsa, cfg, inp64))
    print("after 64K", tune["after_64K"], flush=True)
    write()
    del inp64
    torch.cuda.empty_cache()
    inp16 = _bwd_inputs(nsa, cfg, 64, 4, 16384)
    tune["after_16K"] = dict(stages=bwd_stages(inp16, cfg), glue=glue_times(nsa, cfg, inp16))
    print("after 16K", tune["after_16K"], flush=True)
    write()
    return best


def _event_timed(fn, name, sink):
    """fn wrapped so that each call is bracketed by CUDA events, appended to sink()[name] (sink: the dict current at
    call time)."""
    def run(*a, **kw):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        r = fn(*a, **kw)
        e.record()
        sink().setdefault(name, []).append((s, e))
        return r
    return run


def breakdown(nsa, q, k, v, cfg):
    """ms per kernel for one forward (CUDA events around each launch)."""
    times = {}
    origs = {n: getattr(nsa, n).run for n in PHASE_KERNELS}
    for n in PHASE_KERNELS:
        getattr(nsa, n).run = _event_timed(origs[n], n, lambda: times)
    try:
        with torch.no_grad():
            for _ in range(3):
                nsa.nsa_attention(q, k, v, cfg)
        torch.cuda.synchronize()
    finally:
        for n in PHASE_KERNELS:
            getattr(nsa, n).run = origs[n]
    return {n: round(min(s.elapsed_time(e) for s, e in v_), 3) for n, v_ in times.items()}


def slc_ab(nsa, cfg, settings, ts, write=None):
    """Forward with each selected-branch kernel setting (nsa.SLC_TILE_ROWS: 0 = per token, R = token tiles of R
    rows visiting the union of their blocks; "Ru": R with nsa.SLC_SHARED off, i.e. the union path even where
    selection="tile" programs share one selection) at every head layout, same inputs, interleaved; cuDNN causal
    alongside.
    Each row: ms per setting (best of 2 rounds), the selected kernel's ms (CUDA events), and per setting whether
    the indices equal setting settings[0]'s and the max |out difference| to it."""
    rows, saved = [], (nsa.SLC_TILE_ROWS, nsa.SLC_SHARED)
    try:
        for HQ, H in HEADS:
            for T in ts:
                q = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
                v = torch.randn_like(k)
                row = dict(HQ=HQ, H=H, G=HQ // H, T=T, ms={}, slc_kernel_ms={}, same_idx={}, max_diff={})
                with torch.no_grad():
                    row["cudnn_ms"] = _bench(cudnn_causal(q, k, v), rep=100)
                    base = None
                    for rnd in range(2):
                        for r in settings:
                            # "R": SLC_TILE_ROWS = R; "Ru": and the union path also for selection="tile"
                            nsa.SLC_TILE_ROWS, nsa.SLC_SHARED = int(str(r).rstrip("u")), not str(r).endswith("u")
                            ms = _bench(lambda: nsa.nsa_attention(q, k, v, cfg), rep=100)
                            row["ms"][r] = min(ms, row["ms"].get(r, ms))
                            if rnd:
                                continue
                            out, idx = nsa.nsa_attention(q, k, v, cfg, return_indices=True)
                            bd = breakdown(nsa, q, k, v, cfg)
                            row["slc_kernel_ms"][r] = bd.get("_slc_tile_kernel" if nsa.SLC_TILE_ROWS else "_slc_kernel")
                            if base is None:
                                base = (out, idx)
                            row["same_idx"][r] = bool(torch.equal(idx, base[1]))
                            row["max_diff"][r] = (out.float() - base[0].float()).abs().max().item()
                row["speedup_vs_cudnn"] = {r: row["cudnn_ms"] / ms for r, ms in row["ms"].items()}
                rows.append(row)
                print("slc_ab", row, flush=True)
                if write:
                    write(rows)
                del q, k, v
                torch.cuda.empty_cache()
    finally:
        nsa.SLC_TILE_ROWS, nsa.SLC_SHARED = saved
    return rows


# ------------------------------------------------------------------------------- issue 27: per-phase A/B (--phases)
# Variant name -> forward-module overrides; "sel" = the selections it changes (others would repeat base).
PHASE_VARIANTS = {
    "base": dict(sel=("token", "tile"), attrs=dict(SLC_TILE_ROWS=None)),
    "u128": dict(sel=("token",), attrs=dict(SLC_TILE_ROWS=128)),     # the token-tile union kernel at every T
    "per_token": dict(sel=("token",), attrs=dict(SLC_TILE_ROWS=0)),  # the per-token selected kernel at every T
    "serial_topk": dict(sel=("token",), attrs=dict(PARALLEL_TOPK=False)),          # 16 serial arg-max rounds
    "par_topk_all": dict(sel=("token",), attrs=dict(TOPK_PARALLEL_MIN_BLOCKS=0)),  # parallel top-k at every T
    # parallel top-k at every T on 2 warps (NUM_WARPS "kernel=n": that entry of nsa.NUM_WARPS changed)
    "topk_w2": dict(sel=("token",), attrs=dict(TOPK_PARALLEL_MIN_BLOCKS=0, NUM_WARPS="topk=2")),
    # compressed / window kernels: rows per program, keys per k-tile, warps, stages
    "cmp128": dict(sel=("token", "tile"), attrs=dict(CMP_TILE_ROWS=128, NUM_WARPS="cmp=8")),
    "cmp128n128": dict(sel=("token", "tile"), attrs=dict(CMP_TILE_ROWS=128, CMP_BLOCK_N=128, NUM_WARPS="cmp=8")),
    "cmp_n128": dict(sel=("token", "tile"), attrs=dict(CMP_BLOCK_N=128)),
    "cmp_s3": dict(sel=("token", "tile"), attrs=dict(NUM_STAGES="cmp=3")),
    "cmp128_s3": dict(sel=("token", "tile"), attrs=dict(CMP_TILE_ROWS=128, NUM_WARPS="cmp=8", NUM_STAGES="cmp=3")),
    "swa128": dict(sel=("token", "tile"), attrs=dict(SWA_TILE_ROWS=128, NUM_WARPS="swa=8")),
    "swa128n128": dict(sel=("token", "tile"), attrs=dict(SWA_TILE_ROWS=128, SWA_BLOCK_N=128, NUM_WARPS="swa=8")),
    "swa_n128": dict(sel=("token", "tile"), attrs=dict(SWA_BLOCK_N=128)),
    "swa128_s3": dict(sel=("token", "tile"), attrs=dict(SWA_TILE_ROWS=128, NUM_WARPS="swa=8", NUM_STAGES="swa=3")),
    "slc_w2": dict(sel=("token",), attrs=dict(SLC_TILE_ROWS=0, NUM_WARPS="slc=2")),
    "slc_s4": dict(sel=("token",), attrs=dict(SLC_TILE_ROWS=0, NUM_STAGES="slc=4")),
    "tile128": dict(sel=("tile",), attrs=dict(SLC_TILE_ROWS=128)),
    # session 15 defaults turned off: pointer loads instead of TMA descriptors; tile mode's compressed launch masked
    "ptr": dict(sel=("token", "tile"), attrs=dict(NSA_TMA=False)),
    "no_split": dict(sel=("tile",), attrs=dict(CMP_MASK_SPLIT=False)),
    # two_launch: the selected and window branches in two launches and o_cmp from the full-length `_cmp_kernel`
    # launch, instead of the fused `_tile_branches_kernel` (the default: all three branches, 3 K/V stages);
    # fused_s2: the fused launch at 2 stages. With the fused launch "_cmp_kernel" is only the importance launch at
    # the tiles' first tokens and the compressed branch's time is inside "_tile_branches_kernel"
    "two_launch": dict(sel=("tile",), attrs=dict(FUSED_BRANCHES=False)),
    "fused_s2": dict(sel=("tile",), attrs=dict(NUM_STAGES="fused=2")),
}
PHASE_KERNELS = ["_cmp_kernel", "_topk_kernel", "_slc_kernel", "_slc_tile_kernel", "_swa_kernel",
                 "_tile_branches_kernel"]


def phase_breakdown(nsa, q, k, v, cfg, calls=3):
    """ms per phase of one forward: each kernel's launches summed within a call (tile mode launches `_cmp_kernel`
    twice), compress_kv (PyTorch pooling), total (events around the whole call) and glue = total - the rest (index
    glue, allocations, launch gaps); min over `calls` calls after one warm-up."""
    names = PHASE_KERNELS + ["compress_kv"]
    per_call = []
    cur = {}
    origs = {n: getattr(nsa, n).run for n in PHASE_KERNELS}
    orig_ckv = nsa.compress_kv
    for n in PHASE_KERNELS:
        getattr(nsa, n).run = _event_timed(origs[n], n, lambda: cur)
    nsa.compress_kv = _event_timed(orig_ckv, "compress_kv", lambda: cur)
    try:
        with torch.no_grad():
            nsa.nsa_attention(q, k, v, cfg)
            for _ in range(calls):
                cur = {}
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                nsa.nsa_attention(q, k, v, cfg)
                e.record()
                cur["total"] = [(s, e)]
                per_call.append(cur)
        torch.cuda.synchronize()
    finally:
        for n in PHASE_KERNELS:
            getattr(nsa, n).run = origs[n]
        nsa.compress_kv = orig_ckv
    out = {}
    for n in names + ["total"]:
        vals = [sum(a.elapsed_time(b) for a, b in c[n]) for c in per_call if n in c]
        if vals:
            out[n] = round(min(vals), 4)
    out["glue"] = round(out["total"] - sum(vv for n, vv in out.items() if n != "total"), 4)
    return out


def union_sizes(idx, n_b, groups=(8, 16)):
    """Mean number of distinct selected blocks over groups of g consecutive tokens (per KV head), for each g."""
    B, T, Hk, nsel = idx.shape
    res = {}
    for g in groups:
        n = T // g * g
        x = idx[:, :n].reshape(B, n // g, g, Hk, nsel).permute(0, 1, 3, 2, 4).reshape(B, n // g, Hk, g * nsel).long()
        hit = torch.zeros(B, n // g, Hk, n_b + 1, dtype=torch.bool, device=idx.device)
        hit.scatter_(-1, torch.where(x >= 0, x, n_b), True)
        res[g] = round(hit[..., :n_b].sum(-1).float().mean().item(), 2)
    return res


def phases(nsa, ts, variants, write=None, rep=60, fwd_bwd_t=16384, sels=("token", "tile")):
    """Issue 27: HQ64/H4 D128 bf16 B=1, NSAConfig() token and tile: per variant (PHASE_VARIANTS) forward ms, its
    ratio to cuDNN causal (same process, same inputs), per-phase ms, indices equal to base and max |out - base|;
    union sizes of 8 / 16 consecutive tokens (token mode). Then fwd+bwd at fwd_bwd_t for base and the variants."""
    HQ, H = 64, 4
    rows = []
    saved = {kk: getattr(nsa, kk) for kk in ("SLC_TILE_ROWS", "PARALLEL_TOPK", "TOPK_PARALLEL_MIN_BLOCKS",
                                            "NUM_WARPS", "NUM_STAGES", "CMP_TILE_ROWS", "SWA_TILE_ROWS",
                                            "CMP_BLOCK_N", "SWA_BLOCK_N", "CMP_MASK_SPLIT", "NSA_TMA",
                                            "FUSED_BRANCHES", "FUSED_ROWS")}

    def attrs(spec):
        """A variant's overrides; NUM_WARPS / NUM_STAGES "kernel=n[,kernel=n]" -> a copy of the saved dict with
        those entries changed."""
        out = dict(spec["attrs"])
        for name in ("NUM_WARPS", "NUM_STAGES"):
            if isinstance(out.get(name), str):
                out[name] = {**saved[name], **{kk: int(n) for kk, n in (e.split("=") for e in out[name].split(","))}}
        return out
    try:
        for T in ts:
            g = torch.Generator(device="cuda").manual_seed(T)
            q = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
            k = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
            v = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
            row = dict(T=T, ms={}, x_cudnn={}, phases={}, same_idx={}, max_diff={})
            with torch.no_grad():
                row["cudnn_ms"] = _bench(cudnn_causal(q, k, v), rep=rep)
                for sel in sels:
                    cfg = NSAConfig(selection=sel)
                    base = None
                    for name in variants:
                        spec = PHASE_VARIANTS[name]
                        if sel not in spec["sel"]:
                            continue
                        key = f"{sel}:{name}"
                        nsa.__dict__.update(saved)
                        nsa.__dict__.update(attrs(spec))
                        try:
                            out, idx = nsa.nsa_attention(q, k, v, cfg, return_indices=True)
                            if base is None:
                                base = (out, idx)
                                if sel == "token":
                                    row["union_8_16"] = union_sizes(idx, -(-T // cfg.block_size))
                            row["same_idx"][key] = bool(torch.equal(idx, base[1]))
                            row["max_diff"][key] = (out.float() - base[0].float()).abs().max().item()
                            del out, idx
                            row["ms"][key] = _bench(lambda: nsa.nsa_attention(q, k, v, cfg), rep=rep)
                            row["x_cudnn"][key] = row["cudnn_ms"] / row["ms"][key]
                            row["phases"][key] = phase_breakdown(nsa, q, k, v, cfg)
                        except Exception as exc:  # noqa: BLE001
                            row.setdefault("errors", {})[key] = _err(exc)
                        print(f"T={T} {key:16} ms={row['ms'].get(key, float('nan')):8.3f} "
                              f"x_cudnn={row['x_cudnn'].get(key, float('nan')):6.2f} "
                              f"same_idx={row['same_idx'].get(key)} "
                              f"max_diff={row['max_diff'].get(key, float('nan')):.2e} "
                              f"{row['phases'].get(key, row.get('errors', {}).get(key))}", flush=True)
                    del base
            print(f"T={T} cudnn_ms={row['cudnn_ms']:.3f} union(8,16 tokens)={row.get('union_8_16')}", flush=True)
            rows.append(row)
            if write:
                write(rows, None)
            del q, k, v
            torch.cuda.empty_cache()
        fb = []
        if fwd_bwd_t:
            T = fwd_bwd_t
            g = torch.Generator(device="cuda").manual_seed(1)
            q = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
            k = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
            v = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
            dout = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
            cud = _bench_n(cudnn_causal_fwd_bwd(q, k, v, dout))
            for sel in sels:
                cfg = NSAConfig(selection=sel)
                for name in variants:
                    spec = PHASE_VARIANTS[name]
                    if sel not in spec["sel"]:
                        continue
                    nsa.__dict__.update(saved)
                    nsa.__dict__.update(attrs(spec))
                    r = dict(T=T, key=f"{sel}:{name}", cudnn_ms=cud)
                    try:
                        r["ms"] = _bench_n(fwd_bwd(lambda a, b, c: nsa.nsa_attention(a, b, c, cfg), (q, k, v), dout))
                        r["x_cudnn"] = cud / r["ms"]
                    except Exception as exc:  # noqa: BLE001
                        r["error"] = _err(exc)
                    fb.append(r)
                    print("fwd+bwd", r, flush=True)
            del q, k, v, dout
            torch.cuda.empty_cache()
    finally:
        nsa.__dict__.update(saved)
    keys = [f"{sel}:{n}" for sel in sels for n in variants if sel in PHASE_VARIANTS[n]["sel"]]
    print(f"\n{'forward x cuDNN':16} " + " ".join(f"{r['T'] // 1024:>6}K" for r in rows))
    print(f"{'cudnn ms':16} " + " ".join(f"{r['cudnn_ms']:7.3f}" for r in rows))
    for kk in keys:
        print(f"{kk:16} " + " ".join(f"{r['x_cudnn'].get(kk, float('nan')):7.2f}" for r in rows))
    for kk in keys:
        print(f"{kk + ' ms':16} " + " ".join(f"{r['ms'].get(kk, float('nan')):7.3f}" for r in rows))
    print("phases (ms): " + ", ".join(n for n in PHASE_KERNELS + ["compress_kv", "glue", "total"]))
    for r in rows:
        for kk in keys:
            ph = r["phases"].get(kk, {})
            print(f"{r['T'] // 1024:>3}K {kk:16} " + " ".join(
                f"{n.strip('_').replace('_kernel', '')}={ph[n]:.3f}" for n in PHASE_KERNELS + ["compress_kv", "glue",
                                                                                              "total"] if n in ph))
    for r in fb:
        print(f"fwd+bwd {r['T'] // 1024}K {r['key']:16} {r.get('ms', float('nan')):8.2f} ms  cuDNN "
              f"{r['cudnn_ms']:8.2f}  x {r.get('x_cudnn', float('nan')):.2f}")
    return rows, fb


def host_bound(nsa, ts, rep=200):
    """Issue 27: is a short NSA forward bound by the host? HQ64/H4 D128 bf16 B=1, per T: cuDNN causal and
    NSAConfig token / tile, each timed eagerly (do_bench: back-to-back calls), its host ms per call (enqueue
    only, `common.host_ms`) and the CUDA-graph replay of the same call (GPU time without the host). Eager ~ host >
    graph: the call waits on the host."""
    import triton
    HQ, H = 64, 4
    rows = []
    for T in ts:
        g = torch.Generator(device="cuda").manual_seed(T)
        q, k, v = (torch.randn(1, T, h, D, device="cuda", dtype=torch.bfloat16, generator=g) for h in (HQ, H, H))
        row = dict(T=T)
        with torch.no_grad():
            fns = {"cudnn": cudnn_causal(q, k, v)}
            for sel in ("token", "tile"):
                cfg = NSAConfig(selection=sel)
                fns[sel] = (lambda c: lambda: nsa.nsa_attention(q, k, v, c))(cfg)
            for name, fn in fns.items():
                d = dict(eager=triton.testing.do_bench(fn, rep=rep, return_mode="median"), host=host_ms(fn, 40))
                try:
                    d["graph"] = triton.testing.do_bench(graph_replay(fn), rep=rep, return_mode="median")
                except Exception as exc:  # noqa: BLE001
                    d["graph_error"] = _err(exc)
                row[name] = d
        for sel in ("token", "tile"):
            for mode in ("eager", "graph"):
                if mode in row[sel] and mode in row["cudnn"]:
                    row[f"{sel}_x_cudnn_{mode}"] = row["cudnn"][mode] / row[sel][mode]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{'T':>6} {'call':6} {'eager':>8} {'host':>8} {'graph':>8}  (ms)")
    for r in rows:
        for name in ("cudnn", "token", "tile"):
            d = r[name]
            print(f"{r['T']:6d} {name:6} {d['eager']:8.3f} {d['host']:8.3f} {d.get('graph', float('nan')):8.3f}")
        print(f"{'':6} x cuDNN eager / graph: token {r.get('token_x_cudnn_eager', float('nan')):.2f} / "
              f"{r.get('token_x_cudnn_graph', float('nan')):.2f}, tile {r.get('tile_x_cudnn_eager', float('nan')):.2f}"
              f" / {r.get('tile_x_cudnn_graph', float('nan')):.2f}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T = 8K, 16K only")
    ap.add_argument("--max-t", type=int, default=65536, help="largest T for G=16 (131072 adds 128K)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--sweep", action="store_true", help="try tile rows / warps at 32K first and keep the best")
    ap.add_argument("--bwd", action="store_true", help="add the forward+backward section (fwd_bwd) vs cuDNN")
    ap.add_argument("--bwd-only", action="store_true", help="only the forward+backward section")
    ap.add_argument("--bwd-tune", action="store_true",
                    help="before fwd_bwd: per-stage backward breakdown at HQ64/H4 16K/64K, sweep of BWD_SETS at 16K, "
                         "the per-stage best is then used for fwd_bwd (section bwd_tune)")
    ap.add_argument("--both-modes", action="store_true", help="fwd_bwd: also time the other selected dk/dv mode")
    ap.add_argument("--tune-t", type=int, default=16384, help="--bwd-tune: sequence length of the sweep")
    ap.add_argument("--best-out", help="--bwd-tune: write the chosen BWD overrides (JSON) here")
    ap.add_argument("--tag", default="nsa", help="JSON name <gpu>-<tag>.json")
    ap.add_argument("--summary", metavar="JSON", help="only print the backward tables of a results JSON")
    ap.add_argument("--decode-only", action="store_true",
                    help="only the decode section (JSON <gpu>-nsa-decode.json unless --tag is given)")
    ap.add_argument("--slc-ab", metavar="R[,R...]",
                    help="only the selected-kernel A/B: forward with nsa.SLC_TILE_ROWS = each R (0 = per token; Ru: "
                         "and nsa.SLC_SHARED off) at "
                         "every head layout, T = 8K..64K (--quick: 8K, 16K); section slc_ab")
    ap.add_argument("--selection", choices=("token", "tile", "both"), default="both",
                    help="prefill rows: NSAConfig(selection=...) timed as ours_ms; both (default): ours_ms = token, "
                         "and tile also timed (tile_ms, same inputs, same process) with its breakdown at the largest "
                         "T; the other sections use token, or tile with --selection tile")
    ap.add_argument("--fla-only", action="store_true",
                    help="only the G=16 prefill rows (ours, cuDNN, fla without its window branch); no decode")
    ap.add_argument("--phases", action="store_true",
                    help="issue 27: HQ64/H4 forward per phase and x cuDNN for token and tile selection at --phase-t, "
                         "each --variants entry in the same process, then fwd+bwd at --phase-bwd-t "
                         "(JSON <gpu>-nsa-phases.json)")
    ap.add_argument("--variants", default="base,u128,per_token",
                    help="--phases: comma list, base first; names in PHASE_VARIANTS")
    ap.add_argument("--phase-t", default="4096,8192,16384,32768,65536")
    ap.add_argument("--phase-bwd-t", type=int, default=16384, help="--phases: fwd+bwd length (0: none)")
    ap.add_argument("--host-bound", metavar="T[,T...]",
                    help="only: eager vs host vs CUDA-graph ms of cuDNN and NSA token / tile at these lengths "
                         "(JSON <gpu>-nsa-host.json unless --tag)")
    args = ap.parse_args(argv)
    if args.summary:
        with open(args.summary) as f:
            return summary(json.load(f))
    from sparsepatch.kernels.nsa import forward as nsa
    cfg = NSAConfig(selection="tile" if args.selection == "tile" else "token")
    tile_cfg = NSAConfig(selection="tile") if args.selection == "both" else None
    dev = torch.cuda.get_device_name()
    gpu = "h100" if "H100" in dev else ("h200" if "H200" in dev else dev.split()[-1].lower())
    parallel_nsa, fla_err = load_fla()
    res = {"device": dev, "torch": torch.__version__, "config": vars(cfg), "fla_error": fla_err,
           "prefill": [], "decode": [], "breakdown": {}, "sweep": [], "fwd_bwd": []}
    ts = TS[:2] if args.quick else TS
    torch.manual_seed(0)
    if args.decode_only:
        tag = "nsa-decode" if args.tag == "nsa" else args.tag
        res["decode"] = bench_decode(nsa, cfg, DECODE_S[:2] if args.quick else DECODE_S,
                                     write=lambda rows: _write(res, args.out, gpu, tag, quiet=True))
        return _write(res, args.out, gpu, tag)

    def write(*_):
        _write(res, args.out, gpu, args.tag, quiet=True)
    if args.host_bound:
        res["host_bound"] = host_bound(nsa, [int(x) for x in args.host_bound.split(",")])
        return _write(res, args.out, gpu, args.tag if args.tag != "nsa" else "nsa-host")
    if args.phases:
        variants = args.variants.split(",")
        bad = [n for n in variants if n not in PHASE_VARIANTS]
        if bad or variants[0] != "base":
            raise SystemExit(f"--variants: first 'base', then any of {sorted(PHASE_VARIANTS)}; got {args.variants}")
        pts = [int(x) for x in args.phase_t.split(",")]

        def wr(rows, fb):
            res["phases"] = rows
            if fb is not None:
                res["phases_fwd_bwd"] = fb
            write()
        rows, fb = phases(nsa, pts, variants, write=wr, fwd_bwd_t=args.phase_bwd_t,
                          sels=("tile",) if args.selection == "tile" else ("token", "tile"))
        wr(rows, fb)
        return _write(res, args.out, gpu, args.tag if args.tag != "nsa" else "nsa-phases")
    if args.slc_ab:
        res["slc_ab"] = slc_ab(nsa, cfg, args.slc_ab.split(","), ts,
                               write=lambda rows: (res.__setitem__("slc_ab", rows), write()))
        return _write(res, args.out, gpu, args.tag)
    if args.bwd_tune:
        res["bwd_best"] = bwd_tune(nsa, cfg, res, write, args.tune_t, args.best_out)
    if args.bwd or args.bwd_only:
        # HQ64/H4 up to max-t (the issue-5 target is at 64K); the other head layouts at the --quick lengths
        ts_g16 = [t for t in TS if t <= args.max_t]
        res["fwd_bwd"] = bench_fwd_bwd(nsa, cfg, HEADS, [t for t in ts if t <= 32768], both_modes=args.both_modes,
                                       write=lambda rows: (res.__setitem__("fwd_bwd", rows), write()),
                                       ts_g16=ts_g16)
    if args.bwd_only:
        return _write(res, args.out, gpu, args.tag)

    if args.sweep:
        best = None
        for w, st in ((4, 3), (2, 3), (4, 2)):
            if True:
                nsa.NUM_WARPS["slc"], nsa.NUM_STAGES["slc"] = w, st
                rows = st
                for HQ, H in ((64, 4), (16, 16)):
                    q = torch.randn(1, 32768, HQ, D, device="cuda", dtype=torch.bfloat16)
                    k = torch.randn(1, 32768, H, D, device="cuda", dtype=torch.bfloat16)
                    v = torch.randn_like(k)
                    with torch.no_grad():
                        ms = _bench(lambda: nsa.nsa_attention(q, k, v, cfg), rep=60)
                    res["sweep"].append(dict(stages=rows, warps=w, HQ=HQ, H=H, ms=round(ms, 3)))
                    print("sweep", res["sweep"][-1], flush=True)
        tot = {}
        for r in res["sweep"]:
            tot[(r["stages"], r["warps"])] = tot.get((r["stages"], r["warps"]), 0) + r["ms"]
        best = min(tot, key=tot.get)
        nsa.NUM_STAGES["slc"], nsa.NUM_WARPS["slc"] = best[0], best[1]
        res["chosen"] = dict(slc_stages=best[0], slc_warps=best[1])
        print("chosen", res["chosen"], flush=True)

    for HQ, H in (HEADS[:1] if args.fla_only else HEADS):
        tl_ = ts + ([131072] if (HQ, H) == (64, 4) and args.max_t >= 131072 and not args.quick else [])
        for T in tl_:
            q = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            row = dict(HQ=HQ, H=H, G=HQ // H, T=T)
            with torch.no_grad():
                row["ours_ms"] = _bench(lambda: nsa.nsa_attention(q, k, v, cfg), rep=100)
                if tile_cfg is not None:
                    row["tile_ms"] = _bench(lambda: nsa.nsa_attention(q, k, v, tile_cfg), rep=100)
                try:
                    row["cudnn_ms"] = _bench(cudnn_causal(q, k, v), rep=100)
                except Exception as exc:  # noqa: BLE001
                    row["cudnn_error"] = f"{type(exc).__name__}: {exc}"[:200]
                if parallel_nsa is not None and HQ // H >= 16:
                    # fla's window branch calls flash-attn (not installed on the device image), so fla runs with
                    # window_size=0 (compressed + selected only) and is compared twice: against our whole forward
                    # (which also computes the 512-token window) and against it minus our window kernel's time.
                    g = torch.full((1, T, HQ), 1 / 3, device="cuda", dtype=torch.bfloat16)
                    try:
                        row["fla_no_window_ms"] = _bench(lambda: parallel_nsa(q, k, v, g, g, g, block_counts=16,
                                                                              block_size=64, window_size=0), rep=100)
                        row["ours_window_kernel_ms"] = breakdown(nsa, q, k, v, cfg)["_swa_kernel"]
                    except Exception as exc:  # noqa: BLE001
                        row["fla_error"] = _err(exc)
            for key, name in (("ours_ms", ""), ("tile_ms", "tile_")):
                if key not in row:
                    continue
                row[f"{name}ms_per_qhead" if name else "ours_ms_per_qhead"] = row[key] / HQ
                if "cudnn_ms" in row:
                    row[f"{name}speedup_vs_cudnn"] = row["cudnn_ms"] / row[key]
                if "fla_no_window_ms" in row:
                    row[f"{name}speedup_vs_fla"] = row["fla_no_window_ms"] / row[key]
                    row[f"{name}speedup_vs_fla_same_branches"] = row["fla_no_window_ms"] / (
                        row[key] - row["ours_window_kernel_ms"])
            res["prefill"].append(row)
            print({kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in row.items()}, flush=True)
            if T == max(ts):
                res["breakdown"][f"HQ{HQ}_H{H}_T{T}"] = breakdown(nsa, q, k, v, cfg)
                print("breakdown", res["breakdown"][f"HQ{HQ}_H{H}_T{T}"], flush=True)
                if tile_cfg is not None:
                    res["breakdown"][f"tile_HQ{HQ}_H{H}_T{T}"] = breakdown(nsa, q, k, v, tile_cfg)
                    print("breakdown tile", res["breakdown"][f"tile_HQ{HQ}_H{H}_T{T}"], flush=True)
            del q, k, v
            torch.cuda.empty_cache()

    if not args.fla_only:
        res["decode"] = bench_decode(nsa, cfg, DECODE_S[:2] if args.quick else DECODE_S)

    return _write(res, args.out, gpu, args.tag)


def _graph_replay(fn):
    from common import graph_replay
    return graph_replay(fn)


def _sdpa_decode(qh, kh, vh, backend=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        if backend is None:
            return F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)
    return run


DECODE_TARGETS = [40, 80, 160, 320, 640]   # nsa_decode.TARGET_PROGRAMS tried at the largest S (graph replay)


def bench_decode(nsa, cfg, ss, write=None, sweep=True, tile=True):
    """Decode rows (us): one query token, HQ64/H4, D=128, bf16, B=1, NSACache(store_kv=False) prefilled to S.
    ours = nsa.nsa_attention(q1, k, v, cache) eager (checks + cache.update + the 2 decode launches); kernels = the
    decode kernels alone (nsa_decode.nsa_decode, eager); graph = one captured nsa_attention step replayed;
    update = cache.update alone; old = the prefill kernels at T = 1 (nsa._forward, before this path). SDPA decode
    with enable_gqa: default backend, flash, cuDNN (eager), and the default one captured in a graph.
    tile: also NSAConfig(selection="tile") steps. A step at a tile's first position is the step above (it ranks the
    blocks); tile_graph = a later step of the tile (the cache holds the tile's blocks: here the ones the step above
    picked), captured and replayed; tile_avg_graph = (block_size - 1) later steps + one ranking step, per step."""
    import math
    from sparsepatch.kernels.nsa import decode as nsa_decode
    HQ, H = 64, 4
    scale = 1.0 / math.sqrt(D)
    rows = []
    for S in ss:
        k = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q1 = torch.randn(1, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        cache = ref.NSACache(store_kv=False)
        row = dict(HQ=HQ, H=H, S=S)
        with torch.no_grad():
            cache.update(k, v, cfg)
            kc, vc = cache.k_cmp, cache.v_cmp

            def step():
                return nsa.nsa_attention(q1, k, v, cfg, cache=cache)
            try:
                o_new, i_new = nsa_decode.nsa_decode(q1, k, v, kc, vc, None, scale, cfg, True)
                o_old, i_old = nsa._forward(q1, k, v, kc, vc, None, scale, cfg)[:2]
                row["same_idx_as_prefill_kernels"] = bool(torch.equal(i_new, i_old))
                row["max_diff_vs_prefill_kernels"] = (o_new.float() - o_old.float()).abs().max().item()
                row["ours_us"] = _bench(step) * 1e3
                row["kernels_us"] = _bench(lambda: nsa_decode.nsa_decode(q1, k, v, kc, vc, None, scale, cfg)) * 1e3
                row["update_us"] = _bench(lambda: cache.update(k, v, cfg)) * 1e3
                row["old_us"] = _bench(lambda: nsa._forward(q1, k, v, kc, vc, None, scale, cfg)) * 1e3
            except Exception as exc:  # noqa: BLE001
                row["ours_error"] = _err(exc)
            try:
                replay = _graph_replay(step)
                row["ours_graph_us"] = _bench(replay) * 1e3
            except Exception as exc:  # noqa: BLE001
                row["graph_error"] = _err(exc)
            qh, kh, vh = q1.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            for name, backend in (("sdpa", None), ("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION")):
                try:
                    row[f"{name}_us"] = _bench(_sdpa_decode(qh, kh, vh, backend)) * 1e3
                except Exception as exc:  # noqa: BLE001
                    row[f"{name}_error"] = _err(exc)[:200]
            try:
                row["sdpa_graph_us"] = _bench(_graph_replay(_sdpa_decode(qh, kh, vh))) * 1e3
            except Exception as exc:  # noqa: BLE001
                row["sdpa_graph_error"] = _err(exc)[:200]
            sd = [row[n] for n in ("sdpa_us", "sdpa_flash_us", "sdpa_cudnn_us") if n in row]
            if sd:
                row["sdpa_best_us"] = min(sd)
                if "ours_us" in row:
                    row["speedup"] = row["sdpa_best_us"] / row["ours_us"]
                if "ours_graph_us" in row:
                    row["speedup_graph"] = row.get("sdpa_graph_us", row["sdpa_best_us"]) / row["ours_graph_us"]
            if tile and "ours_graph_us" in row:
                tcfg = NSAConfig(**{**vars(cfg), "selection": "tile"})
                tcache = ref.NSACache(store_kv=False)
                tcache.update(k, v, tcfg)
                tcache.tile_selection = ((S - 1) // tcfg.block_size, i_new[:, 0].contiguous())

                def tstep():
                    return nsa.nsa_attention(q1, k, v, tcfg, cache=tcache)
                try:
                    o_t = tstep()
                    row["tile_max_diff_vs_same_blocks"] = (o_t.float() - o_new.float()).abs().max().item()
                    row["tile_graph_us"] = _bench(_graph_replay(tstep)) * 1e3
                    bs = tcfg.block_size
                    row["tile_avg_graph_us"] = ((bs - 1) * row["tile_graph_us"] + row["ours_graph_us"]) / bs
                    ref_us = row.get("sdpa_graph_us", row.get("sdpa_best_us"))
                    if ref_us:
                        row["tile_speedup_graph"] = ref_us / row["tile_graph_us"]
                        row["tile_avg_speedup_graph"] = ref_us / row["tile_avg_graph_us"]
                except Exception as exc:  # noqa: BLE001
                    row["tile_error"] = _err(exc)
            if sweep and S == max(ss) and "ours_graph_us" in row:
                base = nsa_decode.TARGET_PROGRAMS
                row["target_sweep_graph_us"] = {}
                try:
                    for tp in DECODE_TARGETS:
                        nsa_decode.TARGET_PROGRAMS = tp
                        row["target_sweep_graph_us"][tp] = round(_bench(_graph_replay(step)) * 1e3, 2)
                except Exception as exc:  # noqa: BLE001
                    row["target_sweep_error"] = _err(exc)
                finally:
                    nsa_decode.TARGET_PROGRAMS = base
        rows.append(row)
        print("decode", {kk: (round(vv, 2) if isinstance(vv, float) else vv) for kk, vv in row.items()}, flush=True)
        if write is not None:
            write(rows)
        del k, v, cache
        torch.cuda.empty_cache()
    print(f"{'S':>6} {'ours':>7} {'kernels':>7} {'graph':>7} {'update':>7} {'old':>7} {'sdpa':>7} {'flash':>7} "
          f"{'cudnn':>7} {'sdpa_g':>7} {'x eager':>7} {'x graph':>7} {'tile_g':>7} {'tile_av':>7} {'x tile':>7} "
          f"{'x t_avg':>7}  (us)")
    for r in rows:
        print(f"{r['S']:>6} " + " ".join(f"{r.get(n, float('nan')):7.1f}" for n in (
            "ours_us", "kernels_us", "ours_graph_us", "update_us", "old_us", "sdpa_us", "sdpa_flash_us",
            "sdpa_cudnn_us", "sdpa_graph_us")) + f" {r.get('speedup', float('nan')):7.2f} "
              f"{r.get('speedup_graph', float('nan')):7.2f} " + " ".join(f"{r.get(n, float('nan')):7.2f}" for n in (
                  "tile_graph_us", "tile_avg_graph_us", "tile_speedup_graph", "tile_avg_speedup_graph")))
    return rows


def summary(res):
    """Short tables of the backward sections (bwd_tune stages, fwd_bwd rows)."""
    tune = res.get("bwd_tune", {})
    keys = ["prep", "alloc", "slc_dq", "slc_sort", "slc_dkdv", "dq", "swa_dkdv", "cmp_dkdv", "bwd_total"]
    print("stage ms     " + " ".join(f"{k[:9]:>9}" for k in keys))
    for name in ("before_16K", "after_16K", "before_64K", "after_64K"):
        if name in tune:
            st = tune[name]["stages"]
            print(f"{name:12} " + " ".join(f"{st.get(k, float('nan')):9.2f}" for k in keys), tune[name].get("glue", ""))
    for r in [r for kk, vv in tune.items() if kk.startswith("sweep") for r in vv]:
        print("sweep", r.get("set"), r.get("error", "") or " ".join(f"{k}={r.get(k)}" for k in
              ("slc_dq", "slc_list", "dq", "swa_dkdv", "cmp_dkdv", "bwd_total", "rel_vs_default")))
    if "best" in tune:
        print("best", tune["best"])
    print(f"{'heads':10} {'T':>6} {'fwd':>7} {'fwd+bwd':>8} {'cuDNN':>8} {'speedup':>7}")
    for r in res.get("fwd_bwd", []):
        print(f"HQ{r['HQ']}H{r['H']:<5} {r['T']:>6} {r.get('ours_fwd_ms', float('nan')):7.2f} "
              f"{r.get('ours_ms', float('nan')):8.2f} {r.get('cudnn_ms', float('nan')):8.2f} "
              f"{r.get('speedup_vs_cudnn', float('nan')):7.2f}", r.get("ours_error", ""), r.get("cudnn_error", ""))
    return res


def _write(res, out, gpu, tag="nsa", quiet=False):
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{gpu}-{tag}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    if not quiet:
        print("wrote", path)
    return res


if __name__ == "__main__":
    t0 = time.time()
    main(sys.argv[1:])
    print(f"total {time.time() - t0:.1f} s")
