"""Temporal skip-list attention forward: sparsepatch Triton vs SDPA (cuDNN, flash), FlexAttention, sageattention.

    python benchmarks/bench_skip.py [--quick] [--sweep] [--no-peers] [--out DIR]
    python -m sparsepatch bench skip      (calls main(argv))

One process, same inputs. Shapes (bf16, B1): H12 S32760 D128, H40 S32760 D128, H16 S4096 D128. Densities 1.0 /
0.5 / 0.13 / 0.05 from fixed random lists (seed 0) that always include the diagonal tile; the SAME list drives
FlexAttention (BlockMask.from_kv_blocks, full blocks, compiled flex_attention). Times are triton.testing.do_bench
medians (ms), each cell timed once per round in --rounds (3) interleaved rounds and the median round kept, with
the mean SM clock of each cell (NVML, when pynvml is installed); TFLOP/s are dense-equivalent (4 B H S^2 D / t) so
sparse rows show the effective speed.
Our skip rows include the in-kernel keep test and the next-list write (threshold -5).
Writes <out>/<gpu>-skip.json (default benchmarks/results) and $OUT/<gpu>-skip.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ClockSampler, gpu_name, host_ms, random_list, save_results  # noqa: E402

SHAPES = [(1, 12, 32760, 128), (1, 40, 32760, 128), (1, 16, 4096, 128)]
DENSITIES = [1.0, 0.5, 0.13, 0.05]
TILE = (128, 128)


def bench_ms(fn, rep=150):
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def flex_peer(lst, S):
    """Compiled flex_attention with the list as full blocks; returns fn(q, k, v) in (B, H, S, D) layout or None."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError:
        return None, "no flex_attention"
    flex = _compiled_flex(flex_attention)
    zeros_n = torch.zeros_like(lst.counts)
    zeros_i = torch.zeros_like(lst.indices)
    bm = BlockMask.from_kv_blocks(zeros_n, zeros_i, lst.counts, lst.indices, BLOCK_SIZE=TILE, seq_lengths=(S, S))
    return (lambda q, k, v: flex(q, k, v, block_mask=bm)), None


_FLEX = {}


def _compiled_flex(flex_attention):
    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def sweep_configs(q, k, v, skip, lists, log):
    """Time the dense kernel and the skip kernel (density 0.5 and 1.0) over small config sets.

    Returns (rows, best dense config, best skip config); a variant that fails to compile is reported, not fatal.
    """
    dense_variants = [
        dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=False),
        dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=True),
        dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=True, ws=True),
        dict(BLOCK_N=128, num_warps=8, num_stages=4, tma=True, ws=True),
    ]
    skip_variants = [
        dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=False),
        dict(BLOCK_N=128, num_warps=8, num_stages=2, tma=False),
        dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=True),
        dict(BLOCK_N=128, num_warps=8, num_stages=2, tma=True),
        dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=True, ws=True),
        dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=False, ws=True),
        dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=False, prefetch_j=True),
        dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=True, prefetch_j=True),
        dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=True, ws=True, prefetch_j=True),
        dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=True, prefetch_j=True, host_desc=True),
        # ablations (never picked): no keep test / list indices ignored / both
        dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=True, ablate_keep=True),
        dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=True, ablate_direct_j=True),
        dict(BLOCK_N=128, num_warps=8, num_stages=3, tma=True, ablate_keep=True, ablate_direct_j=True),
    ]
    saved = dict(skip.CONFIGS[(128, 128)]), dict(skip.SKIP_CONFIGS[(128, 128)])
    B, S, H, D = q.shape
    flops = 4 * B * H * S * S * D
    rows = []
    ref = skip.attention(q, k, v)
    ref_skip, ref_next = skip.skip_attention(q, k, v, lists[0.5], -5.0)
    for kind, variants in (("dense", dense_variants), ("skip", skip_variants)):
        for cfg in variants:
            row = dict(kind=kind, **cfg)
            try:
                t0 = time.time()
                if kind == "dense":
                    skip.CONFIGS[(128, 128)] = cfg
                    out = skip.attention(q, k, v)
                    torch.cuda.synchronize()
                    row["compile_s"] = round(time.time() - t0, 1)
                    row["max_err"] = (out.float() - ref.float()).abs().max().item()
                    row["ms"] = bench_ms(lambda: skip.attention(q, k, v))
                    row["tflops"] = flops / row["ms"] * 1e-9
                else:
                    skip.SKIP_CONFIGS[(128, 128)] = cfg
                    out, nxt = skip.skip_attention(q, k, v, lists[0.5], -5.0)
                    torch.cuda.synchronize()
                    row["compile_s"] = round(time.time() - t0, 1)
                    row["max_err"] = (out.float() - ref_skip.float()).abs().max().item()
                    row["same_next_list"] = bool(nxt.equal(ref_next))
                    row["ms"] = bench_ms(lambda: skip.skip_attention(q, k, v, lists[0.5], -5.0))
                    row["ms_rho1"] = bench_ms(lambda: skip.skip_attention(q, k, v, lists[1.0], -5.0))
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            log(f"sweep {row}")
            rows.append(row)
    skip.CONFIGS[(128, 128)], skip.SKIP_CONFIGS[(128, 128)] = saved
    ok = [r for r in rows if "ms" in r and r["max_err"] < 2e-2 and r.get("same_next_list", True)
          and not any(kk.startswith("ablate") for kk in r)]
    keys = ("BLOCK_N", "num_warps", "num_stages", "tma", "ws", "prefetch_j", "host_desc")
    pick = {}
    for kind in ("dense", "skip"):
        cand = [r for r in ok if r["kind"] == kind]
        pick[kind] = {kk: r[kk] for r in [min(cand, key=lambda r: r["ms"])] for kk in keys if kk in r} if cand else None
    return rows, pick["dense"], pick["skip"]


def seq_list(B, H, S, n, tile=(128, 128), device="cuda"):
    """SkipList whose every row lists k-tiles 0..n-1 (same tiles for all q-tiles: L2-friendly access)."""
    from sparsepatch.kernels.skip.skiplist import SkipList, num_tiles
    tq, tk = num_tiles(S, tile[0]), num_tiles(S, tile[1])
    counts = torch.full((B, H, tq), n, dtype=torch.int32, device=device)
    idx = torch.arange(tk, dtype=torch.int32, device=device).expand(B, H, tq, tk).contiguous()
    return SkipList(counts, idx, tile, S, S)


VARIANTS = {
    "default": {},                                        # SKIP_CONFIGS as shipped
    "dev_desc": dict(host_desc=False),                    # device-built TMA descriptors
    # 2026-11-23 round 2 (issue #3 leftovers): q load / out store through host TMA descriptors, list head loaded
    # with its count (the default since). The persistent grid, keep_word and flat2d variants timed in rounds 1-2
    # were deleted (measured neutral or slower; benchmarks/NOTES.md, skip forward v4 / v5).
    "prev_default": dict(q_desc=False, o_desc=False, head_chunk=False),   # the default before round 2
    "ablate_keep": dict(ablate_keep=True),                # no keep test at all (not exact: next lists differ)
    # round 3 (v6): popcount compaction (no scan / cross-thread sums); pf_next: L2 prefetch of the program one wave
    # ahead (q tile, list head, count). Both in the default since; a variant that also prefetched K/V of that
    # program's first listed tile measured no better and was deleted (NOTES v6).
    "r2_default": dict(popc=False, pf_next=False),       # the default of round 2
    "popc": dict(popc=True, pf_next=False),
    "pf1": dict(popc=True, pf_next=True),                # = default
    "pf1_optr": dict(popc=True, pf_next=True, o_desc=False),
    # session 8 (v8): a persistent flat-loop kernel ("flat", "flat_qe") and an in-loop L2 prefetch of K/V tiles ahead
    # ("pf4", "pf6", "pf4_all") were timed here and deleted (slower / within noise; benchmarks/NOTES.md, v8).
    "grid": dict(gluon=False),                            # the per-q-tile Triton kernel (the default until session 8)
    "gluon": dict(gluon=True),                            # persistent warp-specialised Gluon kernel (skip_gluon.py)
    "gluon_s2": dict(gluon=True, gluon_stages=2),
    # session 9 (v10): the default stages each warpgroup's out tile through its 64 rows of the last tile's K and runs
    # the last P V under the next-list write; "gluon_plain" stores from the wgmma layout after a synchronous last
    # P V (session 8's order). Timed and deleted: early count / list loads, an L2 prefetch of the next q, out staged
    # through q halves (+ refilled in step, + TMA store): NOTES v10.
    "gluon_plain": dict(gluon=True, gluon_kstage=False, gluon_pv_async=False),
    # session 10 (v12): qpf (next q rows into L2), kv0_early (first listed index before the q_empty wait), writer=1
    # (warpgroup 1 writes the next lists): no gain in cycles, deleted; the ablations that found the rho-1 loop cost
    # (no keep test; k-tile t instead of the list's) and the run-loop A/B were deleted after the change (NOTES v12)
    # session 11 (v13): q in registers with the q buffer released at the q-tile's start (qreg), and the next q-tile's
    # start under this one's epilogue (s0early): slower, deleted; the count / k-tile indices handed over in shared
    # memory (meta): neutral, deleted
    # K and V on separate ready barriers (kvsplit): no gain, deleted (NOTES v13c)
}

# probe layout (skip.py PROBE builds): clock64 c0 entry, c1 list head known, c2 loop end (incl. partial tile),
# c3 keep words reduced, c4 = c5 next list written (indices and count), c6 out stored; g0 / g1 globaltimer entry /
# exit; smid
PHASES = [("head", 0, 1), ("loop", 1, 2), ("words", 2, 3), ("compact", 3, 4), ("out", 5, 6), ("total", 0, 6)]


def probe(log, shape=(1, 12, 32760, 128), names=("default",), lists=("seq1", "seq13", "rand0.05")):
    """Per-phase clocks of the skip forward (PROBE builds): median us per phase, per-SM gaps between programs."""
    from sparsepatch.kernels.skip import triton as skip
    B, H, S, D = shape
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    all_lists = {"seq1": seq_list(B, H, S, 1), "seq13": seq_list(B, H, S, 13), "rand0.05": random_list(B, H, S, 0.05)}
    base_cfg = dict(skip.SKIP_CONFIGS[(128, 128)])
    tq = (S + 127) // 128
    buf = torch.zeros(B * H * tq * 16, dtype=torch.int64, device="cuda")
    rows = []
    for name in names:
        for ln in lists:
            lst = all_lists[ln]
            cfg = dict(base_cfg, **VARIANTS[name])
            skip.SKIP_CONFIGS[(128, 128)] = dict(cfg, probe=buf)
            try:
                for _ in range(3):  # warm: the last launch is recorded
                    skip.skip_attention(q, k, v, lst, -5.0)
                torch.cuda.synchronize()
                t_probe = bench_ms(lambda lst=lst: skip.skip_attention(q, k, v, lst, -5.0), rep=50)
                skip.skip_attention(q, k, v, lst, -5.0)
                torch.cuda.synchronize()
                skip.SKIP_CONFIGS[(128, 128)] = cfg
                t_plain = bench_ms(lambda lst=lst: skip.skip_attention(q, k, v, lst, -5.0), rep=50)
            except Exception as exc:  # noqa: BLE001
                log(f"probe {name} {ln}: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            finally:
                skip.SKIP_CONFIGS[(128, 128)] = base_cfg
            p = buf.view(-1, 16).double().cpu()
            c, g0, g1, sm = p[:, :7], p[:, 7], p[:, 8], p[:, 9].long()
            ghz = ((c[:, 6] - c[:, 0]) / (g1 - g0).clamp(min=1)).median().item()
            row = dict(variant=name, list=ln, ms_probe=t_probe, ms_plain=t_plain, ghz=ghz)
            for ph, a, b_ in PHASES:
                d = (c[:, b_] - c[:, a]) / ghz / 1e3
                row[ph + "_us"] = d.median().item()
                row[ph + "_p90_us"] = d.quantile(0.9).item()
            # gaps on each SM between one program's exit and the next one's entry (globaltimer, ns)
            gaps, per_sm = [], []
            for s_id in sm.unique().tolist():
                sel = (sm == s_id).nonzero().flatten()
                order = g0[sel].argsort()
                a0, a1 = g0[sel][order], g1[sel][order]
                per_sm.append(len(sel))
                if len(sel) > 1:
                    gaps.append(a0[1:] - a1[:-1])
            gaps = torch.cat(gaps) / 1e3
            span = (g1.max() - g0.min()).item() / 1e3
            busy = ((g1 - g0).sum() / 1e3).item() / (len(per_sm) * span)
            row.update(gap_us=gaps.median().item(), gap_p90_us=gaps.quantile(0.9).item(), span_us=span,
                       busy_frac=busy, sms=len(per_sm), progs_per_sm=(min(per_sm), max(per_sm)),
                       first_entry_spread_us=(g0.kthvalue(len(per_sm)).values - g0.min()).item() / 1e3)
            rows.append(row)
            log(f"probe {row}")
    print("\n| variant | list | ms (plain / probe) | " + " | ".join(p[0] for p in PHASES)
          + " | SM gap us | busy | span us |")
    print("|---|---|---|" + "---|" * len(PHASES) + "---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['list']} | {r['ms_plain']:.3f} / {r['ms_probe']:.3f} | "
              + " | ".join(f"{r[p[0] + '_us']:.2f}" for p in PHASES)
              + f" | {r['gap_us']:.2f} | {r['busy_frac']:.3f} | {r['span_us']:.0f} |")
    return rows


GLUON_PHASES = ("q_wait", "kv0_wait", "loop", "pv_last", "list", "out")   # consumer stamps c0..c6, one per edge


def probe_gluon(log, shape=(1, 12, 32760, 128), names=("gluon",), lists=("seq1", "rand0.05", "rand1.0")):
    """Per-q-tile phase times of the Gluon kernel (its PROBE build: %clock64 stamps per owned q-tile of each
    warpgroup and of the producer). Mean us per q-tile over all programs' middle q-tiles."""
    from sparsepatch.kernels.skip import triton as skip
    from sparsepatch.kernels.skip import gluon as skip_gluon
    B, H, S, D = shape
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    all_lists = {"seq1": lambda: seq_list(B, H, S, 1), "seq13": lambda: seq_list(B, H, S, 13)}
    all_lists.update({f"rand{r}": (lambda r=r: random_list(B, H, S, r)) for r in DENSITIES})
    all_lists["dense"] = lambda: None   # skip.attention: the dense mode (skipping compiled out), CONFIGS' options
    n_items = B * H * ((S + 127) // 128)
    progs = min(n_items, torch.cuda.get_device_properties(0).multi_processor_count)
    maxk = -(-n_items // progs)
    buf = torch.zeros((progs, maxk, 3, 8), dtype=torch.int64, device="cuda")
    n_k = torch.tensor([len(range(p, n_items, progs)) for p in range(progs)])
    rows = []
    for ln in lists:
        lst = all_lists[ln]()
        table = skip.CONFIGS if lst is None else skip.SKIP_CONFIGS
        base_cfg = dict(table[(128, 128)])
        if lst is None:
            def call():
                return skip.attention(q, k, v)
        else:
            def call(lst=lst):
                return skip.skip_attention(q, k, v, lst, -5.0)
        for name in names:
            cfg = dict(base_cfg, **VARIANTS[name])
            try:
                table[(128, 128)] = cfg
                t_plain = bench_ms(call, rep=50)
                table[(128, 128)] = dict(cfg, gluon_probe=buf)
                t_probe = bench_ms(call, rep=50)
                buf.zero_()
                skip_gluon._PLANS.clear()
                call()   # the recorded call (after do_bench's L2 flush pattern)
                torch.cuda.synchronize()
                if not skip._GLUON_OK[0]:   # a failed Gluon build falls back to Triton for the whole process
                    raise RuntimeError("the Gluon kernel (or its PROBE build) failed; see the warning above")
            except Exception as exc:  # noqa: BLE001
                log(f"probe_gluon {name} {ln}: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            finally:
                table[(128, 128)] = base_cfg
            p = buf.double().cpu()
            first, last = p[:, 0, 2], p[torch.arange(progs), n_k - 1, 2]   # producer stamps: clock64, globaltimer
            cyc_per_ns = ((last[:, 0] - first[:, 0]) / (last[:, 3] - first[:, 3]))[n_k > 1].median().item()
            kk = torch.arange(maxk)
            mid = (kk >= 1) & (kk < (n_k - 1)[:, None])   # each program's q-tiles but its first and last
            us = 1e-3 / cyc_per_ns
            row = dict(variant=name, list=ln, ms_plain=t_plain, ms_probe=t_probe, ghz=cyc_per_ns)
            for wg in (0, 1):
                c = p[:, :, wg, :7]
                for i, ph in enumerate(GLUON_PHASES):
                    row[f"wg{wg}_{ph}"] = ((c[:, :, i + 1] - c[:, :, i])[mid] * us).mean().item()
                nxt = torch.roll(c[:, :, 0], -1, dims=1)
                row[f"wg{wg}_gap"] = ((nxt - c[:, :, 6])[mid] * us).mean().item()
                row[f"wg{wg}_item"] = ((nxt - c[:, :, 0])[mid] * us).mean().item()
            pr = p[:, :, 2]
            row["prod_qempty_wait"] = ((pr[:, :, 1] - pr[:, :, 0])[mid] * us).mean().item()
            row["q_latency"] = ((p[:, :, 0, 1] - pr[:, :, 1])[mid] * us).mean().item()   # q issued -> wg0 has it
            row["wg1_lead"] = ((p[:, :, 0, 0] - p[:, :, 1, 0])[mid] * us).mean().item()
            row["cnt_mean"] = p[:, :, 0, 7][mid].mean().item()
            rows.append(row)
            log(f"probe_gluon {row}")
    cols = [f"wg{w}_{ph}" for w in (0, 1) for ph in GLUON_PHASES + ("gap", "item")] + [
        "prod_qempty_wait", "q_latency", "wg1_lead"]
    print("\n| list | variant | ms plain / probe | " + " | ".join(cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r['list']} | {r['variant']} | {r['ms_plain']:.3f} / {r['ms_probe']:.3f} | "
              + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")
    return rows


def _gpu_ms_host_hidden(fn, reps=60):
    """Median GPU ms of fn with a cold L2, host time hidden: each rep flushes L2 (do_bench's 256 MB zero) and
    queues a ~0.3 ms GPU sleep before the start event, so the host's launch work overlaps GPU work as it does in
    a model (do_bench exposes host time beyond its ~0.09 ms flush)."""
    import triton
    cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()
    fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        cache.zero_()
        torch.cuda._sleep(500_000)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[reps // 2]


def host_check(log, shapes=((1, 12, 32760, 128), (1, 16, 4096, 128))):
    """Per density and launch path (cached launch plans vs Triton's JIT launcher): host us per call, do_bench ms
    and GPU ms with host time hidden; then a cProfile of the host path at the lowest density. Says how much of a
    do_bench time is host launch work."""
    import cProfile
    import io
    import pstats
    from sparsepatch.kernels.skip import triton as skip
    rows = []
    direct = skip._DIRECT[0]
    for (B, H, S, D) in shapes:
        g = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        lists = {f"rand{rho}": random_list(B, H, S, rho) for rho in DENSITIES}
        lists["seq1"] = seq_list(B, H, S, 1)
        fns = {"dense": lambda: skip.attention(q, k, v)}
        for lname, lst in lists.items():
            fns[lname] = lambda lst=lst: skip.skip_attention(q, k, v, lst, -5.0)
        for mode in ("plan", "jit"):
            skip._DIRECT[0] = direct and mode == "plan"
            for lname, fn in fns.items():
                long = S > 10000 and lname in ("dense", "rand1.0")
                r = dict(shape=[B, H, S, D], list=lname, launch=mode, host_us=host_ms(fn, 100, busy=True) * 1e3,
                         do_bench=bench_ms(fn, rep=100), hidden=_gpu_ms_host_hidden(fn, reps=20 if long else 60))
                rows.append(r)
                log(f"host {r}")
        skip._DIRECT[0] = direct
        fn = fns["rand0.05"]
        torch.cuda._sleep(200_000_000)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(100):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(14)
        log(buf.getvalue())
        del q, k, v, lists, fns
        torch.cuda.empty_cache()
    print("\n| shape | list | launch | host us/call | do_bench ms | GPU ms, host hidden | do_bench / hidden |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['list']} | {r['launch']} | {r['host_us']:.1f} | {r['do_bench']:.4f} | "
              f"{r['hidden']:.4f} | {r['do_bench'] / r['hidden']:.3f} |")
    return rows


def host_breakdown(log, shape=(1, 16, 4096, 128)):
    """Host us per call of each layer of the skip call (GPU kept busy): skip_attention, _skip_fwd_impl, _launch
    (plan hit), the relaunch alone (C launcher + TMA map fills), and the pieces around them."""
    from sparsepatch.kernels.skip import triton as skip
    from sparsepatch.kernels._common import DescriptorArgs, current_stream
    B, H, S, D = shape
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    lst = random_list(B, H, S, 0.05)
    scale = 1.0 / math.sqrt(D)
    out = torch.empty_like(q)
    nc, ni = torch.empty_like(lst.counts), torch.empty_like(lst.indices)
    cfg = skip._config(D, 128, 128)
    kw = dict(cnt_in=lst.counts, idx_in=lst.indices, cnt_out=nc, idx_out=ni, frow=None, fcol=None, step=None,
              Tq=lst.counts.shape[-1], Tk=lst.indices.shape[-1], slot_cnt=0, slot_idx=0, warmup=0, scale=scale,
              threshold=-5.0, tm=128, tn=128, skip=True, stateful=False, causal=False, cfg=cfg)
    skip._PLANS.clear()
    skip._launch(q, k, v, out, None, **kw)
    relaunch, template, tslots, dslots = next(iter(skip._PLANS.values()))
    tensors = (q, k, v, out, None, lst.counts, lst.indices, nc, ni, None, None, None)
    args = list(template)
    for pos, i in tslots:
        args[pos] = out if tensors[i] is None else tensors[i]
    for pos, i, geo in dslots:
        args[pos] = DescriptorArgs(tensors[i], *geo)
    dev = q.get_device()
    parts = {
        "skip_attention": lambda: skip.skip_attention(q, k, v, lst, -5.0),
        "_skip_fwd_impl": lambda: skip._skip_fwd_impl(q, k, v, lst.counts, lst.indices, -5.0, scale, 128, 128, [],
                                                      False),
        "_launch (plan hit)": lambda: skip._launch(q, k, v, out, None, **kw),
        "relaunch only": lambda: relaunch(current_stream(dev), *args),
        "_config": lambda: skip._config(D, 128, 128),
        "4 x torch.empty": lambda: [torch.empty((B, S, H, D), dtype=q.dtype, device=q.device) for _ in range(4)],
        "_check_inputs": lambda: skip._check_inputs(q, k, v),
        "SkipList(...)": lambda: type(lst)(nc, ni, (128, 128), S, S),
    }
    return _host_parts(log, parts, "host path part (S4096 H16, rand0.05)")


def _host_parts(log, parts, title, calls=None, before=None, rounds=5):
    """Host us per call (`common.host_ms`, GPU kept busy) of each fn in parts {name: fn} (calls[name] calls,
    default 300; before() ahead of each timing), in `rounds` interleaved rounds (this host's timings of one call
    move by 2-3x between timings); the median round is kept. Prints a table headed `title`, returns the rows."""
    samples = {name: [] for name in parts}
    for _ in range(rounds):
        for name, fn in parts.items():
            if before is not None:
                before()
            samples[name].append(host_ms(fn, (calls or {}).get(name, 300), busy=True) * 1e3)
    rows = [dict(part=name, host_us=sorted(v)[len(v) // 2], rounds=v) for name, v in samples.items()]
    for r in rows:
        log(f"host part {r}")
    print(f"\n| {title} | us per call (median of {rounds} rounds) | min / max |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['part']} | {r['host_us']:.1f} | {min(r['rounds']):.1f} / {max(r['rounds']):.1f} |")
    return rows


def host_step(log, shape=(1, 16, 4096, 128)):
    """Host us per call of the patcher's stateful path (GPU kept busy): the sparsepatch::skip_step op, its body
    (skip.skip_step), the fused density / step launch, and the ~12 torch ops that launch replaced (as they were)."""
    from sparsepatch.kernels.skip import triton as skip
    from sparsepatch.kernels.skip import stateful
    B, H, S, D = shape
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    bufs = stateful.SkipListBuffers.create(B, H, S, S, (128, 128), "cuda")
    lst = random_list(B, H, S, 0.05)
    bufs.counts[:].copy_(lst.counts)
    bufs.indices[:].copy_(lst.indices)
    Tk = lst.indices.shape[-1]
    scale = 1.0 / math.sqrt(D)

    def old_bookkeeping(cnt=bufs.counts, step=bufs.step, density=bufs.density, warmup_steps=0):
        n = step.reshape(1)
        warm = n < warmup_steps
        read = torch.remainder(n - warmup_steps, 2).clamp(min=0)
        dens = cnt.index_select(0, read).to(torch.float32).mean(dim=(2, 3)).reshape(B) / Tk
        dens = torch.where(warm, torch.ones_like(dens), dens)
        cap = density.shape[0]
        at = n.clamp(max=cap - 1)
        old = density.index_select(0, at)
        density.index_copy_(0, at, torch.where((n < cap)[:, None], dens[None, :], old))
        step.add_(1)

    parts = {
        "stateful.skip_step (the patcher's call)": lambda: stateful.skip_step(q, k, v, bufs, -5.0, 0),
        "the sparsepatch::skip_step op": lambda: stateful._skip_step_op(q, k, v, bufs.counts, bufs.indices, bufs.step,
                                                                        bufs.density, -5.0, 0, 128, 128, scale, []),
        "skip.skip_step (op body)": lambda: skip.skip_step(q, k, v, bufs.counts, bufs.indices, bufs.step,
                                                           bufs.density, -5.0, 0, 128, 128, scale, []),
        "skip_attention (stateless)": lambda: skip.skip_attention(q, k, v, lst, -5.0),
        "fused density / step launch": lambda: skip._step_density(bufs.counts, bufs.step, bufs.density, 0, Tk),
        "old density / step torch ops": old_bookkeeping,
    }
    # (at most ~1000 launches per timing: beyond the GPU's launch queue the host would wait for the GPU)
    return _host_parts(log, parts, "stateful host path part (S4096 H16, rand0.05)",
                       calls={"old density / step torch ops": 60}, before=bufs.step.zero_)


def variants(log, shape=(1, 12, 32760, 128), names=None, rounds=2, only=None):
    """Time skip-config variants (exact: outputs and next lists must equal the base config's) on random lists at
    DENSITIES and on sequential lists of n tiles (fixed cost vs per-tile cost). Returns result rows."""
    from sparsepatch.kernels.skip import triton as skip
    B, H, S, D = shape
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    lists = {f"rand{rho}": random_list(B, H, S, rho) for rho in DENSITIES}
    for n in (1, 4, 13):
        lists[f"seq{n}"] = seq_list(B, H, S, n)
    if only:
        lists = {kk: vv for kk, vv in lists.items() if kk in only}
    base_cfg = dict(skip.SKIP_CONFIGS[(128, 128)])
    rows = []
    t_dense = [bench_ms(lambda: skip.attention(q, k, v))]
    ref = {}
    for rnd in range(rounds):  # interleaved rounds; each cell keeps its fastest round
        for name in names or VARIANTS:
            skip.SKIP_CONFIGS[(128, 128)] = dict(base_cfg, **VARIANTS[name])
            for lname, lst in lists.items():
                row = next((r for r in rows if r["variant"] == name and r["list"] == lname), None)
                if row is None:
                    row = dict(variant=name, list=lname, ms_rounds=[])
                    rows.append(row)
                try:
                    if rnd == 0:
                        out, nxt = skip.skip_attention(q, k, v, lst, -5.0)
                        torch.cuda.synchronize()
                        if lname not in ref:
                            ref[lname] = (out, nxt)
                        else:
                            row["same_out"] = bool(torch.equal(out, ref[lname][0]))
                            row["max_diff_out"] = (out.float() - ref[lname][0].float()).abs().max().item()
                            row["same_next"] = bool(nxt.equal(ref[lname][1]))
                    row["ms_rounds"].append(bench_ms(lambda lst=lst: skip.skip_attention(q, k, v, lst, -5.0),
                                                     rep=100))
                    row["ms"] = min(row["ms_rounds"])
                except Exception as exc:  # noqa: BLE001
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                log(f"variant {row}")
        t_dense.append(bench_ms(lambda: skip.attention(q, k, v)))
    skip.SKIP_CONFIGS[(128, 128)] = base_cfg
    log(f"dense ms (start, after each round): {t_dense}")
    dense = min(t_dense)
    names_l = list(lists)
    print("\n| variant | " + " | ".join(names_l) + " |")
    print("|---|" + "---|" * len(names_l))
    for name in names or VARIANTS:
        cells = []
        for ln in names_l:
            r = next((r for r in rows if r["variant"] == name and r["list"] == ln), {})
            ok = "" if r.get("same_out", True) and r.get("same_next", True) else " (DIFF)"
            cells.append(f"{r['ms']:.3f}{ok}" if "ms" in r else "err")
        print(f"| {name} | " + " | ".join(cells) + " |")
    tg = {f"rand{rho}": (1.1 * rho * dense + 0.05 if rho < 1 else 1.05 * dense) for rho in DENSITIES}
    print("| target | " + " | ".join(f"{tg[ln]:.3f}" if ln in tg else "-" for ln in names_l) + " |")
    print(f"dense {dense:.3f} ms ({4 * B * H * S * S * D / dense * 1e-9:.0f} TFLOP/s)")
    return dict(dense_ms=t_dense, rows=rows, base_cfg=base_cfg)


def step_check(log, shapes=((1, 12, 32760, 128), (1, 40, 32760, 128)), densities=(0.5, 0.13, 0.05)):
    """The patcher's stateful path (`skip.skip_step`) on the Triton vs the Gluon kernel, same process and inputs:
    a warm-up call (every tile, no list written) and calls reading a fixed random list (the call counter is reset
    before each call, so every call reads the same slot). Checks out (max abs diff) and the written list slot
    (exact) between the two kernels; ms by do_bench."""
    from sparsepatch.kernels.skip import triton as skip
    from sparsepatch.kernels.skip import stateful
    key = (128, 128)
    rows = []
    for (B, H, S, D) in shapes:
        g = torch.Generator(device="cuda").manual_seed(3)
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        for rho in ("warm",) + tuple(densities):
            res = {}
            for name, on in (("triton", False), ("gluon", True)):
                base = dict(skip.SKIP_CONFIGS[key])
                skip.SKIP_CONFIGS[key] = dict(base, gluon=on)
                try:
                    bufs = stateful.SkipListBuffers.create(B, H, S, S, key, "cuda")
                    if rho != "warm":
                        lst = random_list(B, H, S, rho)
                        bufs.counts[0].copy_(lst.counts)
                        bufs.indices[0].copy_(lst.indices)
                    warmup = 1 if rho == "warm" else 0

                    def call(bufs=bufs, warmup=warmup):
                        bufs.step.zero_()
                        return skip.skip_step(q, k, v, bufs.counts, bufs.indices, bufs.step, bufs.density, -5.0,
                                              warmup, 128, 128, 1 / math.sqrt(D), [])
                    out = call()
                    torch.cuda.synchronize()
                    written = (bufs.counts[1].clone(), bufs.indices[1].clone())
                    res[name] = (bench_ms(call), out, written, skip._GLUON_OK[0])
                finally:
                    skip.SKIP_CONFIGS[key] = base
            (tt, to, tw, _), (gt, go, gw, ok) = res["triton"], res["gluon"]
            row = dict(shape=f"B{B} H{H} S{S} D{D}", list=str(rho), triton_ms=tt, gluon_ms=gt, gluon_ran=ok,
                       out_max_abs=(to.float() - go.float()).abs().max().item(),
                       lists_equal=bool(torch.equal(tw[0], gw[0]) and torch.equal(tw[1], gw[1])))
            rows.append(row)
            log(f"step {row}")
    print("\n| shape | list | skip_step Triton ms | Gluon ms | Triton / Gluon | out max abs diff | next list equal |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['list']} | {r['triton_ms']:.3f} | {r['gluon_ms']:.3f} | "
              f"{r['triton_ms'] / r['gluon_ms']:.2f}x | {r['out_max_abs']:.2e} | {r['lists_equal']} |")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="first shape only")
    ap.add_argument("--sweep", action="store_true", help="time a small kernel-config set first and use the best")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--variants", nargs="*", default=None,
                    help="only time skip-config variants (names from VARIANTS; none = all) at H12 S32760")
    ap.add_argument("--shape", default="1,12,32760,128", help="--variants: B,H,S,D")
    ap.add_argument("--rounds", type=int, default=None,
                    help="interleaved rounds: --variants 2 (fastest kept), the table 3 (median kept)")
    ap.add_argument("--lists", nargs="*", default=None, help="--variants: only these lists (rand0.05, seq1, ...)")
    ap.add_argument("--probe", nargs="*", default=None,
                    help="per-phase clocks (PROBE builds) for these variants (none = default), then exit")
    ap.add_argument("--probe-gluon", nargs="*", default=None,
                    help="phase times per q-tile of the Gluon kernel (its PROBE build) for these variants at --shape "
                         "(none = gluon) on --lists (default seq1 rand0.05 rand1.0); exit")
    ap.add_argument("--host", action="store_true",
                    help="host us per call vs GPU time (do_bench and host-hidden), cProfile of the host path; exit")
    ap.add_argument("--step", action="store_true",
                    help="the patcher's stateful skip_step on the Triton vs the Gluon kernel (checks + ms); exit")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_skip: needs CUDA")
        return 1
    import triton
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from sparsepatch.kernels.skip import triton as skip

    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    if args.step:
        res = dict(step=step_check(log), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__)
        save_results(res, f"{gpu_name()}-skip-step-gluon.json", args.out)
        return 0

    if args.host:
        res = dict(host=host_check(log), parts=host_breakdown(log), step=host_step(log),
                   gpu=torch.cuda.get_device_name(),
                   torch=torch.__version__, triton=triton.__version__)
        for d in filter(None, [args.out, os.environ.get("OUT")]):
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"{gpu_name()}-skip-host.json"), "w") as f:
                json.dump(res, f, indent=1)
        return 0

    if args.probe_gluon is not None:
        shape = tuple(int(x) for x in args.shape.split(","))
        res = dict(probe=probe_gluon(log, shape=shape, names=args.probe_gluon or ("gluon",),
                                     lists=args.lists or ("seq1", "rand0.05", "rand1.0")),
                   shape=shape, gpu=torch.cuda.get_device_name())
        save_results(res, f"{gpu_name()}-skip-probe-gluon-{'x'.join(map(str, shape))}.json", args.out)
        return 0

    if args.probe is not None:
        res = dict(probe=probe(log, names=args.probe or ("default",)), gpu=torch.cuda.get_device_name())
        for d in filter(None, [args.out, os.environ.get("OUT")]):
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"{gpu_name()}-skip-probe.json"), "w") as f:
                json.dump(res, f, indent=1)
        if args.variants is None:
            return 0

    if args.variants is not None:
        shape = tuple(int(x) for x in args.shape.split(","))
        res = variants(log, shape=shape, names=args.variants or None, rounds=args.rounds or 2, only=args.lists)
        res.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
        for d in filter(None, [args.out, os.environ.get("OUT")]):
            os.makedirs(d, exist_ok=True)
            tag = "" if shape == (1, 12, 32760, 128) else "-" + "x".join(map(str, shape))
            with open(os.path.join(d, f"{gpu_name()}-skip-variants{tag}.json"), "w") as f:
                json.dump(res, f, indent=1)
        return 0

    try:
        from sageattention import sageattn
    except Exception as exc:  # noqa: BLE001
        sageattn = None
        log(f"sageattention unavailable: {type(exc).__name__}: {exc}")

    gpu = gpu_name()
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  tile=list(TILE), threshold=-5.0, rows=[], sweep=None)
    shapes = SHAPES[:1] if args.quick else SHAPES
    rounds = args.rounds or 3
    result["rounds"] = rounds
    table = []
    for si, (B, H, S, D) in enumerate(shapes):
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))    # (B, H, S, D) strided views, no copies
        flops = 4 * B * H * S * S * D
        lists = {rho: random_list(B, H, S, rho) for rho in DENSITIES}
        if si == 0 and args.sweep:
            rows, best, best_skip = sweep_configs(q, k, v, skip, lists, log)
            result["sweep"] = rows
            if best is not None:
                skip.CONFIGS[(128, 128)] = best
            if best_skip is not None:
                skip.SKIP_CONFIGS[(128, 128)] = best_skip
            log(f"using dense config {best}, skip config {best_skip}")
        result["config"] = dict(dense=dict(skip.CONFIGS[(128, 128)]), skip=dict(skip.SKIP_CONFIGS[(128, 128)]))

        cells = []   # (key in t, impl, density, fn): timed in interleaved rounds below

        def rec(name, density, fn, key):
            cells.append((key, name, density, fn))

        # correctness spot checks against cuDNN (dense) and dense-vs-full-list
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2)
        ours = skip.attention(q, k, v)
        full_out, _ = skip.skip_attention(q, k, v, lists[1.0], -5.0)
        err = dict(dense_vs_cudnn=(ours.float() - ref.float()).abs().max().item(),
                   full_list_vs_dense=(full_out.float() - ours.float()).abs().max().item())
        log(f"S{S} H{H}: max abs err {err}")
        result.setdefault("checks", []).append(dict(S=S, H=H, **err))
        del ref, full_out

        t, mhz = {}, {}   # median-round ms and that round's mean SM clock, per cell key
        if not args.no_peers:
            for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                                  ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
                def run(backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(qt, kt, vt)
                rec(name, 1.0, run, name)
            if sageattn is not None:
                rec("sageattn", 1.0, lambda: sageattn(q, k, v, tensor_layout="NHD", is_causal=False), "sageattn")
        rec("sparsepatch_dense", 1.0, lambda: skip.attention(q, k, v), "ours_dense")
        for rho in DENSITIES:
            lst = lists[rho]
            rec("sparsepatch_skip", rho, lambda lst=lst: skip.skip_attention(q, k, v, lst, -5.0), ("ours", rho))
            if not args.no_peers:
                try:
                    fn, why = flex_peer(lst, S)
                    if fn is not None:
                        t0 = time.time()
                        fo = fn(qt, kt, vt)
                        torch.cuda.synchronize()
                        if rho == 1.0:
                            log(f"flex compile {time.time() - t0:.1f}s, max err vs ours "
                                f"{(fo.transpose(1, 2).float() - ours.float()).abs().max().item():.3g}")
                        rec("flex", rho, lambda fn=fn: fn(qt, kt, vt), ("flex", rho))
                    else:
                        log(f"flex unavailable: {why}")
                except Exception as exc:  # noqa: BLE001
                    log(f"flex S{S} rho{rho}: {type(exc).__name__}: {str(exc)[:300]}")
        # every cell once per round, rounds back to back, the median round kept: the SM clock of this machine moves
        # by up to ~10% between do_bench calls (benchmarks/NOTES.md, v10), so a ratio of two single calls is noisy
        timed, clocks = {}, {}
        for _ in range(rounds):
            for key, name, density, fn in cells:
                if key in timed and timed[key] is None:
                    continue
                try:
                    with ClockSampler() as cs:
                        ms = bench_ms(fn, rep=300 if S < 10000 else 150)
                    timed.setdefault(key, []).append(ms)
                    clocks.setdefault(key, []).append((cs.mhz, cs.watts))
                except Exception as exc:  # noqa: BLE001
                    log(f"{name} S{S} H{H} rho{density}: {type(exc).__name__}: {str(exc)[:300]}")
                    timed[key] = None
        for key, name, density, fn in cells:
            if timed.get(key) is None:
                continue
            mid = sorted(range(len(timed[key])), key=lambda i: timed[key][i])[len(timed[key]) // 2]
            ms = timed[key][mid]
            t[key] = ms
            mhz[key] = clocks[key][mid][0]
            result["rows"].append(dict(B=B, H=H, S=S, D=D, impl=name, density=density, ms=ms,
                                       tflops=flops / ms * 1e-9, ms_rounds=timed[key],
                                       sm_mhz_rounds=[c[0] for c in clocks[key]],
                                       watts_rounds=[c[1] for c in clocks[key]]))
        dense_own = t.get("ours_dense")
        for rho in DENSITIES:
            ms = t.get(("ours", rho))
            if ms is None:
                continue
            table.append(dict(shape=f"B{B} H{H} S{S} D{D}", rho=rho, ours=ms, dense_own=dense_own,
                              mhz=mhz.get(("ours", rho)), dense_mhz=mhz.get("ours_dense"),
                              cudnn=t.get("sdpa_cudnn"), flash=t.get("sdpa_flash"), sage=t.get("sageattn"),
                              flex=t.get(("flex", rho)), flops=flops))
        del q, k, v, qt, kt, vt, lists, ours
        torch.cuda.empty_cache()

    result["table"] = table
    name = f"{gpu}-skip.json"
    os.makedirs(args.out, exist_ok=True)
    for d in filter(None, [args.out, os.environ.get("OUT")]):
        with open(os.path.join(d, name), "w") as f:
            json.dump(result, f, indent=1)

    def fmt(x, w=7, p=2):
        return f"{x:{w}.{p}f}" if x is not None else " " * (w - 1) + "-"

    print()
    print(f"## skip-list attention forward, {torch.cuda.get_device_name()}, bf16, tile {TILE}, torch "
          f"{torch.__version__}, triton {triton.__version__}")
    print("| shape | density | ours ms | ours TFLOP/s* | own dense ms | target ms | cuDNN ms | flash ms | sage ms | "
          "Flex ms | vs cuDNN | vs Flex | SM MHz ours / dense | ours at dense's clock** |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        tgt = 1.1 * r["rho"] * r["dense_own"] + 0.05 if r["dense_own"] and r["rho"] < 1 else (
            1.05 * r["dense_own"] if r["dense_own"] else None)
        vc = r["cudnn"] / r["ours"] if r["cudnn"] else None
        vf = r["flex"] / r["ours"] if r["flex"] else None
        at_dense_clock = r["ours"] * r["mhz"] / r["dense_mhz"] if r["mhz"] and r["dense_mhz"] else None
        print(f"| {r['shape']} | {r['rho']:.2f} | {fmt(r['ours'])} | {fmt(r['flops'] / r['ours'] * 1e-9, 6, 0)} | "
              f"{fmt(r['dense_own'])} | {fmt(tgt)} | {fmt(r['cudnn'])} | {fmt(r['flash'])} | {fmt(r['sage'])} | "
              f"{fmt(r['flex'])} | {fmt(vc, 5)}x | {fmt(vf, 5)}x | {fmt(r['mhz'], 4, 0)} / "
              f"{fmt(r['dense_mhz'], 4, 0)} | {fmt(at_dense_clock)} |")
    dense_rows = [r for r in result["rows"] if r["density"] == 1.0 and r["impl"] != "sparsepatch_skip"
                  and r["impl"] != "flex"]
    print("\ndense TFLOP/s: " + "; ".join(f"{r['impl']} S{r['S']} H{r['H']} {r['tflops']:.0f}" for r in dense_rows))
    print("* dense-equivalent. target: rho<1 -> 1.1*rho*own_dense+0.05 ms; rho=1 -> 1.05*own_dense")
    print("** ours ms x its mean SM clock / own dense's (NVML, sampled during each cell): the time at equal clocks, "
          "if the kernel is clock-bound")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
