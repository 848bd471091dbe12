"""Where a CUDA-graph NSA decode step spends its time: per-kernel GPU durations (torch.profiler/CUPTI) against the
replay time of the whole step, HQ64/H4 D128 bf16 B=1, at a few context lengths.

    python benchmarks/profile_nsa_decode.py [--out DIR] [--s 65536] [--sweep]   # CUDA only; JSON
                                                                   # <gpu>-nsa-decode-profile.json

The difference between the replay time and the sum of kernel durations is launch/dependency latency between the
graph's kernels (with PDL the selection kernel's duration includes its wait for the compressed kernel, so the gap
can be negative). --sweep (at the largest S) also times VARIANTS of the module's launch settings by do_bench (the
benchmark's method, L2 flushed) and warm replay, prints a per-phase timeline of one step (`probe`: the kernels built
with nsa_decode.PROBE record %globaltimer / %clock64 per program) and SDPA decode / an empty graph timed the same way.
"""
from __future__ import annotations

import argparse
import collections
import math
import os

import torch
from torch.profiler import ProfilerActivity, profile

from sparsepatch.config import NSAConfig
from sparsepatch.kernels import nsa_decode
from sparsepatch.kernels import nsa_reference as ref

import common  # noqa: E402  (benchmarks/common.py)


def replay_us(replay, n=200):
    """Mean us per replay (L2 warm: back-to-back replays, no flush)."""
    for _ in range(20):
        replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / n


def inputs(S, HQ=64, H=4, D=128):
    cfg = NSAConfig()
    k = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(1, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    cache = ref.NSACache(store_kv=False)
    with torch.no_grad():
        cache.update(k, v, cfg)
    return q, k, v, cache.k_cmp, cache.v_cmp, 1.0 / math.sqrt(D), cfg


def dobench_us(fn):
    """The acceptance method (bench_nsa.py): triton do_bench median of fn (here a graph replay), L2 flushed."""
    import triton
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3


def baselines(S):
    """SDPA decode (enable_gqa, default backend) captured in a graph, timed like ours (do_bench and warm replay),
    and the floor of the method: one captured 1-element add."""
    import torch.nn.functional as F
    q, k, v, *_ = inputs(S)
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    g = common.graph_replay(lambda: F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True))
    x = torch.zeros(1, device="cuda")
    g0 = common.graph_replay(lambda: x.add_(1))
    return dict(sdpa_graph_dobench_us=dobench_us(g), sdpa_graph_replay_us=replay_us(g),
                empty_graph_dobench_us=dobench_us(g0), empty_graph_replay_us=replay_us(g0))


def sweep(S, variants):
    """Per launch-setting variant (dicts of module attributes to set): one captured step timed by do_bench (as the
    benchmark) and by warm back-to-back replay, with the output and the selected indices checked against the first
    variant's (indices equal; output equal up to bf16 rounding of a different merge order)."""
    q, k, v, kc, vc, scale, cfg = inputs(S)
    o0 = idx0 = None
    rows = []
    for var in variants:
        saved = {n: (dict(getattr(nsa_decode, n)) if isinstance(getattr(nsa_decode, n), dict) else getattr(nsa_decode, n))
                 for n in var}
        try:
            for n, val in var.items():
                if isinstance(val, dict):
                    getattr(nsa_decode, n).update(val)
                else:
                    setattr(nsa_decode, n, val)
            o, idx = nsa_decode.nsa_decode(q, k, v, kc, vc, None, scale, cfg, True)
            if idx0 is None:
                o0, idx0 = o, idx
            g = common.graph_replay(lambda: nsa_decode.nsa_decode(q, k, v, kc, vc, None, scale, cfg))
            rows.append(dict(variant=repr(var), same_idx=bool(torch.equal(idx, idx0)),
                             max_diff=(o.float() - o0.float()).abs().max().item(),
                             dobench_us=dobench_us(g), replay_us=replay_us(g)))
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(variant=repr(var), error=f"{type(exc).__name__}: {exc}"[:300]))
        finally:
            for n, val in saved.items():
                setattr(nsa_decode, n, val)
        r = rows[-1]
        print(f"  {r.get('dobench_us', float('nan')):6.1f} us do_bench {r.get('replay_us', float('nan')):6.1f} replay "
              f"same_idx={r.get('same_idx')} diff={r.get('max_diff', float('nan')):.1e} {var} {r.get('error', '')}",
              flush=True)
    return rows


VARIANTS = [{}, {"FUSE": False}, {"PDL": False}, {"SCORE_CHUNK": 32}, {"SCORE_CHUNK": 128},
            {"NUM_WARPS": {"cmp": 8}}, {"TARGET_PROGRAMS": 256}, {}]

PROBE_SLOTS = {2: "gdc_wait done", 3: "chunk score+rank done", 5: "window progs: cmp+swa merges done",
               6: "wait 1 done (rank)", 7: "final rank, slots stored", 9: "wait 2 done (attn)",
               8: "selected partial stored", 10: "wait 3 done (merge)", 11: "output stored"}


def probe(S, var=None, reps=20):
    """Timeline of one captured step (nsa_decode.PROBE builds: %globaltimer at each program's entry and exit,
    %clock64 at the phase ends, converted with the clock rate measured on the compressed programs): us after the
    first compressed program started, median and max over the programs that pass each point."""
    q, k, v, kc, vc, scale, cfg = inputs(S)
    buf = {}
    saved = {n: (dict(getattr(nsa_decode, n)) if isinstance(getattr(nsa_decode, n), dict) else getattr(nsa_decode, n))
             for n in (var or {})}
    try:
        for n, val in (var or {}).items():
            if isinstance(val, dict):
                getattr(nsa_decode, n).update(val)
            else:
                setattr(nsa_decode, n, val)
        nsa_decode.PROBE = buf
        g = common.graph_replay(lambda: nsa_decode.nsa_decode(q, k, v, kc, vc, None, scale, cfg))
    finally:
        nsa_decode.PROBE = None
        for n, val in saved.items():
            setattr(nsa_decode, n, val)
    for _ in range(reps):
        g()
    torch.cuda.synchronize()
    pl = buf["plan"]
    a = buf["a"].view(pl["BH"], -1, 4).double().cpu()
    b = buf["b"].view(pl["BH"], -1, 16).double().cpu()
    t0 = a[:, :, 0].min()
    ghz = ((a[:, :, 2] - a[:, :, 1]) / (a[:, :, 3] - a[:, :, 0]).clamp(min=1)).median().item()
    line = {}

    def put(name, x):
        x = x[x > -1e8]
        if x.numel():
            line[name] = (round(x.median().item(), 2), round(x.max().item(), 2), int(x.numel()))
    put("A entry", (a[:, :, 0] - t0).flatten() / 1e3)
    put("A exit", (a[:, :, 3] - t0).flatten() / 1e3)
    entry = (b[:, :, 0] - t0) / 1e3
    put("B entry", entry.flatten())
    for sl, name in PROBE_SLOTS.items():
        m = b[:, :, sl] != 0
        put(f"B {name}", torch.where(m, entry + (b[:, :, sl] - b[:, :, 1]) / ghz / 1e3, torch.tensor(-1e9)).flatten())
    put("B exit", ((b[:, :, 12] - t0) / 1e3).flatten())
    print(f"probe {var or {}} (clock {ghz:.3f} GHz; us: median, max, programs):", flush=True)
    for n_, v_ in line.items():
        print(f"   {n_:28s} {v_[0]:7.2f} {v_[1]:7.2f} {v_[2]:5d}")
    return dict(variant=repr(var or {}), ghz=ghz, plan=pl, timeline=line, raw_a=buf["a"].tolist(),
                raw_b=buf["b"].tolist())


def profile_step(S, reps=50):
    q, k, v, kc, vc, scale, cfg = inputs(S)

    def step():
        return nsa_decode.nsa_decode(q, k, v, kc, vc, None, scale, cfg)
    g = common.graph_replay(step)
    total = replay_us(g)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name.split("(")[0][:60]] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    kernels = {n: t / reps for n, t in per.items()}
    return dict(S=S, replay_us=total, kernels_us=kernels, kernel_sum_us=sum(kernels.values()),
                gap_us=total - sum(kernels.values()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--s", type=int, nargs="+", default=[8192, 65536])
    ap.add_argument("--sweep", action="store_true", help="also replay launch-setting variants at the largest S")
    args = ap.parse_args(argv)
    rows = []
    res = {"device": torch.cuda.get_device_name(), "rows": rows}
    if args.sweep:
        print(f"sweep at S={max(args.s)}:")
        res["sweep"] = sweep(max(args.s), VARIANTS)
        res["probe"] = [probe(max(args.s)), probe(max(args.s), {"PDL": False})]
        res["baselines"] = baselines(max(args.s))
        print("baselines", {k_: round(v_, 2) for k_, v_ in res["baselines"].items()}, flush=True)
    for S in args.s:
        r = profile_step(S)
        rows.append(r)
        print(f"S={S}: replay {r['replay_us']:.1f} us, kernels {r['kernel_sum_us']:.1f}, gaps {r['gap_us']:.1f}")
        for n, t in sorted(r["kernels_us"].items(), key=lambda x: -x[1]):
            print(f"   {t:7.2f} us  {n}")
    common.save_results(res, f"{common.gpu_name()}-nsa-decode-profile.json", args.out)


if __name__ == "__main__":
    main()
