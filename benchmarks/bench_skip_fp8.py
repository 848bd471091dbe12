"""fp8 skip-list forward (`SkipConfig(precision="fp8")`, kernels/skip/fp8.py) at the Wan2.1-1.3B self-attention
shape B1 H12 S32760 D128 bf16, tile (128, 128), densities 1 / 0.5 / 0.13 on the same fixed random lists, with its
peers in the same process: cuDNN bf16 (torch SDPA, CUDNN_ATTENTION), our fp8 dense (`attention_fp8`, end to end
and its kernel alone on the same quantized k/v), our bf16 skip (`skip_attention`). Every timer runs once per
round, rounds interleaved; medians (triton do_bench median per cell). Plus the quality check of issue 25 on the
synthetic video-like workload (threshold -5, 10 steps of carried lists): fp8 output cos vs bf16 skip, fraction of
next-list tiles equal to the bf16 lists.

    python benchmarks/bench_skip_fp8.py [--rounds 5] [--switches NAME,...,all]
        [--variants] [--out FILE.json]      (JSON: FILE; default benchmarks/results/<gpu>-skip-fp8.json
                                             and $OUT/bench_skip_fp8.json)

--switches: boolean FP8_SKIP_CONFIG switches (names in SWITCH_NAMES; none at present, default none) timed on the
kernel alone (k/v quantized once, as the "kernel only" cell) beside the default, interleaved; before timing, each
one's output and next list are checked bitwise equal to the default's at every density (a switch changes the
schedule, never a value). Per switch: the median over rounds of its time / the default's time in the same round
(paired), and the median time. "all" = every switch at once.
Host time: the call's Python time per call (20 calls queued behind the GPU, no sync inside), launch plans on
(`_common.LaunchPlans`) and off, and the end-to-end cell with plans off.
--variants: the round-2 A/B cells (keep_row off, diagnostics seqidx / nokeep) and CUDA-graph replays (device time
without host launch cost) of the end-to-end calls.

Acceptance (H200): rho 1 >= 1.30x cuDNN and >= 0.97x fp8 dense; rho in {0.5, 0.13}: t <= 1.1 rho t_fp8dense +
0.05 ms; quality cos >= 0.999 and lists equal on >= 99% of tiles.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from common import ROOT, gpu_name, graph_replay, host_ms, random_list, save_results

DENSITIES = (1.0, 0.5, 0.13)


def bench_ms(fn, rep=100):
    import triton
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def cos(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def quality(log):
    """Issue 25 quality bar: video-like q/k/v (12 heads x 128, S = 8 x 16 x 32 = 4096), threshold -5, 10 steps."""
    from sparsepatch.kernels import skip_attention
    from sparsepatch.testing import video_like_qkv
    l8 = lb = None
    rows = []
    for step in range(10):
        q, k, v = video_like_qkv(heads=12, frames=8, height=16, width=32, dim=128, step=step,
                                 dtype=torch.bfloat16, device="cuda")
        ob, nb = skip_attention(q, k, v, lb, -5.0)
        o8, n8 = skip_attention(q, k, v, l8, -5.0, precision="fp8")
        # the same read list for both: the list agreement of one step, not accumulated drift
        _, n8b = skip_attention(q, k, v, lb, -5.0, precision="fp8")
        rows.append(dict(step=step, cos=cos(o8, ob), density_bf16=nb.density().item(),
                         density_fp8=n8.density().item(),
                         lists_equal=(n8.to_mask() == nb.to_mask()).float().mean().item(),
                         lists_equal_same_read=(n8b.to_mask() == nb.to_mask()).float().mean().item()))
        l8, lb = n8, nb
    worst = dict(cos=min(r["cos"] for r in rows), lists_equal=min(r["lists_equal"] for r in rows),
                 lists_equal_same_read=min(r["lists_equal_same_read"] for r in rows))
    log(f"quality (video-like, thr -5, 10 steps): worst cos {worst['cos']:.5f} (>= 0.999), lists equal "
        f"{worst['lists_equal']:.4f} carried / {worst['lists_equal_same_read']:.4f} same read (>= 0.99); density "
        f"bf16 {rows[-1]['density_bf16']:.3f} fp8 {rows[-1]['density_fp8']:.3f}")
    return dict(rows=rows, worst=worst, ok=worst["cos"] >= 0.999 and worst["lists_equal"] >= 0.99)


# Same-output boolean FP8_SKIP_CONFIG keys under A/B (a new one: add its name here). None at present: of session
# 15's, lsum_early and early_list became the kernel's schedule, full_rows and desc2d were deleted (NOTES).
SWITCH_NAMES: tuple[str, ...] = ()


def switch_cfgs(names):
    """--switches names -> {name: cfg} ("all": every switch of SWITCH_NAMES at once)."""
    out = {}
    for n in filter(None, names.split(",")):
        if n == "all" and SWITCH_NAMES:
            out[n] = {k: True for k in SWITCH_NAMES}
        elif n in SWITCH_NAMES:
            out[n] = {n: True}
        else:
            known = ", ".join(SWITCH_NAMES + ("all",)) if SWITCH_NAMES else "none at present"
            raise SystemExit(f"--switches: unknown {n!r} (known: {known})")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--switches", default="",
                    help="comma-separated FP8_SKIP_CONFIG switches (SWITCH_NAMES, or 'all') timed beside the default "
                         "(kernel only); default none")
    ap.add_argument("--variants", action="store_true",
                    help="A/B cells: round-1 keep bits (keep_row off), diagnostics seqidx / nokeep, "
                         "CUDA-graph replays (device time without host launch cost)")
    ap.add_argument("--old-variants", action="store_true", help="also time block_m 128 and device-side descriptors")
    ap.add_argument("--no-quality", action="store_true", help="skip the video-like quality check")
    ap.add_argument("--plan-ab", action="store_true",
                    help="also time the e2e call with only the skip kernel's / only the quantize launches' plans off")
    ap.add_argument("--S", type=int, default=32760)
    ap.add_argument("--out", default=None, help="JSON file (default benchmarks/results/<gpu>-skip-fp8.json)")
    args = ap.parse_args()
    switches = switch_cfgs(args.switches)
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sparsepatch.kernels.dense import fp8 as dense_fp8
    from sparsepatch.kernels.skip import fp8 as skip_fp8
    from sparsepatch.kernels.skip import triton as skip

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t0 = time.time()
    B, H, S, D = 1, 12, args.S, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    lists = {rho: random_list(B, H, S, rho) for rho in DENSITIES}
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               shape=[B, H, S, D], tile=[128, 128],
               threshold=-5.0, rounds=args.rounds, config=dict(skip_fp8.FP8_SKIP_CONFIG), switches=switches)

    # correctness at this shape: fp8 skip with the full list vs fp8 dense (same quantization: q per 64 rows) and
    # vs cuDNN; next lists of kernel vs emulation are covered by tests/test_skip_fp8.py (-m gpu)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2)
    with torch.no_grad():
        d8 = dense_fp8.attention_fp8(q, k, v)
        s8, n8 = skip_fp8.skip_attention_fp8(q, k, v, lists[1.0], -5.0)
    res["checks"] = dict(cos_fp8skip_vs_cudnn=cos(s8, ref), cos_fp8skip_vs_fp8dense=cos(s8, d8),
                         max_abs_fp8skip_vs_fp8dense=(s8.float() - d8.float()).abs().max().item(),
                         next_density_full=n8.density().item())
    log(f"checks: {res['checks']}")
    del ref, d8, s8

    quant = dense_fp8.quantize_fp8(q, k, v, "int8", quantize_q=False)[2:]
    k8, ks, vt8, vs = quant
    # each switch's output and next list against the default's, bitwise, at every density (kernel alone)
    same = {}
    with torch.no_grad():
        for rho in DENSITIES:
            o0, n0 = skip_fp8.skip_attention_fp8(q, k, v, lists[rho], -5.0, quantized=quant)
            for name, cfg in switches.items():
                o1, n1 = skip_fp8.skip_attention_fp8(q, k, v, lists[rho], -5.0, quantized=quant, cfg=cfg)
                same[f"{name}@{rho}"] = bool(torch.equal(o0, o1) and n0.equal(n1))
                del o1
            del o0
    res["switch_equal_default"] = same
    bad = [k_ for k_, ok_ in same.items() if not ok_]
    log(f"switches equal to the default (output + next list, bitwise): {'all' if not bad else 'NOT ' + str(bad)}")

    def no_plans(fn, which=("skip", "quant")):
        """fn with the direct-launch plans of `which` off (the skip kernel's, the quantize launches')."""
        plans = [p for name, p in (("skip", skip_fp8._PLANS), ("quant", dense_fp8._QUANT_PLANS)) if name in which]

        def run():
            for p in plans:
                p.enabled[0] = False
            try:
                return fn()
            finally:
                for p in plans:
                    p.enabled[0] = True
        return run

    cells = {"cudnn": lambda: _cudnn(qt, kt, vt), "fp8_dense": lambda: dense_fp8.attention_fp8(q, k, v),
             "fp8_dense_kernel": lambda: dense_fp8._fp8_launch(
                 q, None, k8, ks, vt8, vs, B=B, Sq=S, Hq=H, Sk=S, causal=False, scale=None, return_lse=False,
                 out_dtype=q.dtype, cfg=None, qfused=True),
             "quantize_kv": lambda: dense_fp8.quantize_fp8(q, k, v, "int8", quantize_q=False)}
    variants = {"": None}
    if args.variants:
        variants.update({"_keepword": {"keep_row": False}, "_seqidx": {"diag": "seqidx"},
                         "_nokeep": {"diag": "nokeep"}})
    if args.old_variants:
        variants.update({"_bm128": {"block_m": 128}, "_devdesc": {"host_desc": False}})
    for rho in DENSITIES:
        lst = lists[rho]
        cells[f"bf16_skip@{rho}"] = lambda lst=lst: skip.skip_attention(q, k, v, lst, -5.0)
        for suf, cfg in variants.items():
            cells[f"fp8_skip{suf}@{rho}"] = lambda lst=lst, cfg=cfg: skip_fp8.skip_attention_fp8(q, k, v, lst, -5.0,
                                                                                               cfg=cfg)
        cells[f"fp8_skip_noplan@{rho}"] = no_plans(lambda lst=lst: skip_fp8.skip_attention_fp8(q, k, v, lst, -5.0))
        if args.plan_ab:   # which plans cost the e2e time measured with plans on at low density (session 15)
            for which in ("skip", "quant"):
                cells[f"fp8_skip_no{which}plan@{rho}"] = no_plans(
                    lambda lst=lst: skip_fp8.skip_attention_fp8(q, k, v, lst, -5.0), (which,))
        cells[f"fp8_skip_kernel@{rho}"] = lambda lst=lst: skip_fp8.skip_attention_fp8(q, k, v, lst, -5.0,
                                                                                     quantized=quant)
        for name, cfg in switches.items():
            cells[f"fp8_skip_kernel[{name}]@{rho}"] = lambda lst=lst, cfg=cfg: skip_fp8.skip_attention_fp8(
                q, k, v, lst, -5.0, quantized=quant, cfg=cfg)
    with torch.no_grad():
        for name, fn in cells.items():   # compile / warm every cell once
            fn()
        torch.cuda.synchronize()
        if args.variants:   # device time only: the same calls replayed from a CUDA graph
            for name in ["quantize_kv", "fp8_dense"] + [f"fp8_skip@{r}" for r in DENSITIES]:
                try:
                    cells[f"graph:{name}"] = graph_replay(cells[name], warmup=1)
                except Exception as exc:  # noqa: BLE001  (diagnostic cells only)
                    log(f"graph capture of {name} failed: {type(exc).__name__}: {str(exc)[:200]}")
        host = {}
        for rho in (1.0, 0.13):
            host[f"plans@{rho}"] = host_ms(cells[f"fp8_skip@{rho}"])
            host[f"no_plans@{rho}"] = host_ms(cells[f"fp8_skip_noplan@{rho}"])
        res["host_ms_per_call"] = host
        log(f"host ms per call: {host}")
    times = {name: [] for name in cells}
    with torch.no_grad():
        log(f"warm-up done at {time.time() - t0:.0f} s")
        names = list(cells)
        for r in range(args.rounds):
            # each round in its own order: a cell timed right after the bf16 skip cell read 0.1-0.3 ms slower at
            # density 0.13 / 0.5 in every run where it held that place (plans on or off; session 15)
            for name in random.Random(r).sample(names, len(names)):
                times[name].append(bench_ms(cells[name], rep=50))
            log(f"round {r + 1} done at {time.time() - t0:.0f} s")
    med = {n: statistics.median(v) for n, v in times.items()}
    res["ms"] = med
    res["ms_rounds"] = times

    cud, fd = med["cudnn"], med["fp8_dense"]
    rows, ok = [], True
    print(f"B{B} H{H} S{S} D{D} bf16, tile 128x128, {res['gpu']}; medians of {args.rounds} rounds (ms)")
    print(f"cuDNN bf16 {cud:.3f} | fp8 dense {fd:.3f} ({cud / fd:.2f}x cuDNN), its kernel alone "
          f"{med['fp8_dense_kernel']:.3f} | quantize k+v {med['quantize_kv']:.3f}")
    graphed = {n[6:]: t for n, t in med.items() if n.startswith("graph:")}
    if graphed:
        print("CUDA-graph replay (device time, no host launch cost): "
              + " | ".join(f"{n} {t:.3f}" for n, t in graphed.items()))
    print("host ms per call (Python, GPU busy): " + " | ".join(f"{n} {t:.3f}" for n, t in host.items()))
    print("| rho | bf16 skip | fp8 skip | plans off | fp8 kernel only | kernel / (density x dense kernel) | x cuDNN "
          "| x fp8 dense "
          "| budget | ok |" + "".join(f" fp8{suf} |" for suf in variants if suf))
    for rho in DENSITIES:
        t = med[f"fp8_skip@{rho}"]
        if rho == 1.0:
            budget = None
            good = cud / t >= 1.30 and fd / t >= 0.97
        else:
            budget = 1.1 * rho * fd + 0.05
            good = t <= budget
        ok &= good
        kern = med[f"fp8_skip_kernel@{rho}"]
        dens = lists[rho].density().item()     # tiles listed / all tiles (round(rho Tk) per row)
        row = dict(rho=rho, density=dens, bf16_skip=med[f"bf16_skip@{rho}"], fp8_skip=t,
                   fp8_skip_noplan=med[f"fp8_skip_noplan@{rho}"], fp8_kernel=kern,
                   kernel_vs_dense_kernel=kern / (dens * med["fp8_dense_kernel"]),
                   x_cudnn=cud / t, x_fp8_dense=fd / t, budget=budget, ok=good,
                   variants={suf: med[f"fp8_skip{suf}@{rho}"] for suf in variants if suf})
        rows.append(row)
        print(f"| {rho} | {row['bf16_skip']:.3f} | {t:.3f} | {row['fp8_skip_noplan']:.3f} | {kern:.3f} | "
              f"{row['kernel_vs_dense_kernel']:.3f} | {cud / t:.2f} | {fd / t:.3f} | "
              f"{'>=1.30x cuDNN, >=0.97x fp8' if budget is None else f'{budget:.3f}'} | {good} |"
              + "".join(f" {v:.3f} |" for v in row["variants"].values()))
    res["rows"] = rows
    if switches:
        sw = {}
        print("switches, kernel alone: median ms [paired ratio to the default: median (min, max) over rounds]")
        print("| switch | " + " | ".join(f"rho {rho}" for rho in DENSITIES) + " | equal to default |")
        for name in switches:
            cols = []
            for rho in DENSITIES:
                base, alt = times[f"fp8_skip_kernel@{rho}"], times[f"fp8_skip_kernel[{name}]@{rho}"]
                ratios = [a_ / b_ for a_, b_ in zip(alt, base)]
                sw[f"{name}@{rho}"] = dict(ms=med[f"fp8_skip_kernel[{name}]@{rho}"], ratio=statistics.median(ratios),
                                           ratio_min=min(ratios), ratio_max=max(ratios))
                e = sw[f"{name}@{rho}"]
                cols.append(f"{e['ms']:.3f} [{e['ratio']:.3f} ({e['ratio_min']:.3f}, {e['ratio_max']:.3f})]")
            eq = all(same[f"{name}@{rho}"] for rho in DENSITIES)
            print(f"| {name} | " + " | ".join(cols) + f" | {eq} |")
        print("| default | " + " | ".join(f"{med[f'fp8_skip_kernel@{rho}']:.3f}" for rho in DENSITIES) + " | |")
        res["switch_results"] = sw
    if not args.no_quality:
        res["quality"] = quality(log)
        ok &= res["quality"]["ok"]
        w = res["quality"]["worst"]
        print(f"quality: worst cos {w['cos']:.5f}, lists equal {w['lists_equal']:.4f} (same read "
              f"{w['lists_equal_same_read']:.4f}) -> {res['quality']['ok']}")
    res["all_ok"] = bool(ok)
    res["wall_s"] = time.time() - t0
    print(f"all acceptance lines met: {ok}; wall {res['wall_s']:.0f} s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    else:
        save_results(res, f"{gpu_name()}-skip-fp8.json", os.path.join(ROOT, "benchmarks", "results"))
        save_results(res, "bench_skip_fp8.json", None)


def _cudnn(qt, kt, vt):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(qt, kt, vt)


if __name__ == "__main__":
    main()
