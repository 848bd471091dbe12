"""Where a CUDA-graph NSA decode step spends its time: per-kernel GPU durations (torch.profiler/CUPTI) against the
replay time of the whole step, HQ64/H4 D128 bf16 B=1, at a few context lengths.

    python benchmarks/profile_nsa_decode.py [--out DIR] [--s 65536] [--sweep]   # CUDA only; JSON
                                                                   # <gpu>-nsa-decode-profile.json
    python benchmarks/profile_nsa_decode.py --s 65536 8192 16384 32768 --ab new t160 [--ab-full 1]
        # A/B of module-setting variants (AB_VARIANTS) of the normal and the tile-continuing step, timed as
        # bench_nsa.py's graph rows (ours_graph_us, tile_graph_us), then timelines of both steps warm and L2-flushed;
        # JSON <gpu>-nsa-decode-ab.json
    python benchmarks/profile_nsa_decode.py --s 8192 16384 32768 65536 --given
        # the step with a given selection (selection="tile": the 63 of 64 steps that reuse the tile's selection;
        # nsa_decode(..., indices=)) against the normal step and SDPA decode, then its timelines at the largest S;
        # JSON <gpu>-nsa-decode-given.json

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
from sparsepatch.kernels.nsa import decode as nsa_decode
from sparsepatch.kernels.nsa import reference as ref

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
            {"NUM_WARPS": {"cmp": 8}}, {"NUM_STAGES": {"cmp": 3}}, {"TARGET_PROGRAMS": 256}, {}]

PROBE_SLOTS = {2: "gdc_wait done", 3: "chunk score+rank done", 5: "window progs: cmp+swa merges done",
               6: "wait 1 done (rank)", 7: "final rank, slots stored", 9: "wait 2 done (attn)",
               8: "selected partial stored", 10: "wait 3 done (merge)", 11: "output stored"}


def probe(S, var=None, reps=20, cold=False, given=False):
    """Timeline of one captured step (nsa_decode.PROBE builds: %globaltimer at each program's entry and exit,
    %clock64 at the phase ends, converted with the clock rate measured on the compressed programs): us after the
    first compressed program started, median and max over the programs that pass each point. given: the step with
    the normal step's selection given (indices=)."""
    q, k, v, kc, vc, scale, cfg = inputs(S)
    idx = nsa_decode.nsa_decode(q, k, v, kc, vc, None, scale, cfg, True)[1] if given else None
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
        g = common.graph_replay(lambda: nsa_decode.nsa_decode(q, k, v, kc, vc, None, scale, cfg, indices=idx))
    finally:
        nsa_decode.PROBE = None
        for n, val in saved.items():
            setattr(nsa_decode, n, val)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda") if cold else None
    for _ in range(reps):            # cold: L2 flushed before each replay (as do_bench); the last replay is kept
        if cold:
            flush.zero_()
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
    print(f"probe {var or {}} given={given} cold={cold} (clock {ghz:.3f} GHz; us: median, max, programs):", flush=True)
    for n_, v_ in line.items():
        print(f"   {n_:28s} {v_[0]:7.2f} {v_[1]:7.2f} {v_[2]:5d}")
    return dict(variant=repr(var or {}), given=given, cold=cold, ghz=ghz, plan=pl, timeline=line,
                raw_a=buf["a"].tolist(),
                raw_b=buf["b"].tolist())


S4 = {"KEY_POLL": False, "SLOT_POLL": False, "EARLY_LOADS": False}   # session-4 structure (counter barriers)
# new: the module defaults. The others switch something off the defaults: t160 (160 compressed programs: 32 splits
# at 64K), s4, noearly, nopoll, stages3 (the compressed kernel with 3 pipeline stages, session 5).
AB_VARIANTS = {"new": {}, "t160": {"TARGET_PROGRAMS": 160}, "s4": S4, "noearly": {"EARLY_LOADS": False},
               "nopoll": {"KEY_POLL": False, "SLOT_POLL": False}, "stages3": {"NUM_STAGES": {"cmp": 3}}}


def _set(var):
    saved = {n: getattr(nsa_decode, n) for n in var}
    for n, val in var.items():
        setattr(nsa_decode, n, val)
    return saved


def ab(ss, names, rounds=2, full=2, save=None):
    """Variants of the decode step (AB_VARIANTS) in one process, timed as bench_nsa.py --decode-only times its graph
    rows: one captured nsa_attention step (NSACache(store_kv=False) prefilled to S) replayed under triton do_bench
    (median, L2 flushed before each replay), per variant the normal step (`{name}_us`, ranks its blocks) and the tile
    step (`{name}_tile_us`: selection="tile", a step continuing a tile, i.e. nsa_decode(..., indices=) with the
    normal step's blocks, as bench_nsa's tile_graph_us); variants alternate `rounds` times. Also SDPA decode (graph)
    and, at the largest S, 'code warm' (a flush, then a replay of the same step on other inputs, then the timed
    replay: data cold, kernel code and launch state warm) and 'warm' (no flush) of the normal step. Variants after
    the first `full` run only at the largest S."""
    import torch.nn.functional as F
    from sparsepatch.kernels.nsa import forward as nsa
    rows = []
    for S in ss:
        q, k, v, kc, vc, scale, cfg = inputs(S)
        cache = ref.NSACache(store_kv=False)
        tcfg = NSAConfig(**{**vars(cfg), "selection": "tile"})
        tcache = ref.NSACache(store_kv=False)
        with torch.no_grad():
            cache.update(k, v, cfg)
            tcache.update(k, v, tcfg)
        row = {"S": S}
        graphs = {}
        sels = []      # each tile graph reads the selection tensor it was captured with: kept alive while it is
        with torch.no_grad():   # replayed (a freed one is reused by later allocations: garbage block indices)
            for name in (names if S == max(ss) else names[:full]):
                saved = _set(AB_VARIANTS[name])
                try:
                    o, idx = nsa_decode.nsa_decode(q, k, v, kc, vc, None, scale, cfg, True)
                    o_p, i_p = nsa._forward(q, k, v, kc, vc, None, scale, cfg)[:2]
                    row[f"{name}_same_idx_as_prefill"] = bool(torch.equal(idx, i_p))
                    row[f"{name}_max_diff_vs_prefill"] = (o.float() - o_p.float()).abs().max().item()
                    graphs[name] = common.graph_replay(lambda: nsa.nsa_attention(q, k, v, cfg, cache=cache))
                    # the tile step continues the tile whose first step selected i_p (the prefill kernels' blocks)
                    sels.append(i_p[:, 0].contiguous())
                    tcache.tile_selection = ((S - 1) // tcfg.block_size, sels[-1])
                    o_t = nsa.nsa_attention(q, k, v, tcfg, cache=tcache)
                    row[f"{name}_tile_max_diff_vs_prefill"] = (o_t.float() - o_p.float()).abs().max().item()
                    row[f"{name}_tile_finite"] = bool(torch.isfinite(o_t).all())
                    graphs[name + "_tile"] = common.graph_replay(lambda: nsa.nsa_attention(q, k, v, tcfg,
                                                                                           cache=tcache))
                finally:
                    _set(saved)
            qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            g_sdpa = common.graph_replay(lambda: F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True))
            for _ in range(rounds):
                for name, g in graphs.items():
                    row.setdefault(f"{name}_us", []).append(dobench_us(g))
                row.setdefault("sdpa_graph_us", []).append(dobench_us(g_sdpa))
            if S == max(ss):
                q2, k2, v2, *_ = inputs(S)
                cache2 = ref.NSACache(store_kv=False)
                cache2.update(k2, v2, cfg)
                flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
                for name in names[:2]:      # (normal step only)
                    saved = _set(AB_VARIANTS[name])
                    try:
                        other = common.graph_replay(lambda: nsa.nsa_attention(q2, k2, v2, cfg, cache=cache2))
                    finally:
                        _set(saved)
                    row[f"{name}_codewarm_us"] = events_us(graphs[name], flush, other)
                    row[f"{name}_warm_us"] = events_us(graphs[name], None, graphs[name])
                row["sdpa_codewarm_us"] = events_us(g_sdpa, flush, g_sdpa_other(S, F))
        for kk in list(row):
            if isinstance(row[kk], list):
                row[kk] = min(row[kk])          # best of the alternating rounds (each a do_bench median)
        for name in names:
            for mode in ("", "_tile"):
                if f"{name}{mode}_us" in row:
                    row[f"{name}{mode}_x_sdpa"] = row["sdpa_graph_us"] / row[f"{name}{mode}_us"]
        rows.append(row)
        if save is not None:
            save(rows)
        print("ab", {kk: (round(vv, 2) if isinstance(vv, float) else vv) for kk, vv in row.items()}, flush=True)
        del graphs, g_sdpa
        torch.cuda.empty_cache()
    return rows


# given-selection step variants (module flags): the default and GIVEN_EARLY off
GIVEN_VARIANTS = {"given": {}, "given_late": {"GIVEN_EARLY": False}}


def given_ab(ss, variants=("given", "given_late"), rounds=3, save=None):
    """The decode step with a given selection (nsa_decode(..., indices=): selection="tile" reuses the tile's first
    selection for its other block_size - 1 steps) against the normal step (which scores and ranks) and SDPA decode
    (enable_gqa, default backend), in one process, each one captured call timed as the rows above: triton do_bench
    median of a graph replay, L2 flushed; the variants alternate `rounds` times, best round kept. Variants of
    GIVEN_VARIANTS: given = the default structure (GIVEN_EARLY: selected blocks before griddepcontrol.wait, one merge
    of the three branches), given_late = GIVEN_EARLY off. The given steps get the normal step's own selection, so
    their outputs must equal it up to rounding (max_diff) and return the same indices."""
    import torch.nn.functional as F
    names = ("normal",) + tuple(variants)
    rows = []
    for S in ss:
        q, k, v, kc, vc, scale, cfg = inputs(S)
        row = {"S": S}
        with torch.no_grad():
            o, idx = nsa_decode.nsa_decode(q, k, v, kc, vc, None, scale, cfg, True)
            graphs = {"normal": common.graph_replay(lambda: nsa_decode.nsa_decode(q, k, v, kc, vc, None, scale,
                                                                                      cfg))}
            for name in variants:
                saved = _set(GIVEN_VARIANTS[name])
                try:            # the flag is read on the host: the captured graph keeps its kernels
                    og, ig = nsa_decode.nsa_decode(q, k, v, kc, vc, None, scale, cfg, True, indices=idx)
                    row[f"{name}_same_idx"] = bool(torch.equal(ig, idx))
                    row[f"{name}_max_diff_vs_normal"] = (og.float() - o.float()).abs().max().item()
                    row[f"{name}_finite"] = bool(torch.isfinite(og).all())
                    graphs[name] = common.graph_replay(lambda: nsa_decode.nsa_decode(q, k, v, kc, vc, None, scale,
                                                                                        cfg, indices=idx))
                finally:
                    _set(saved)
            qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            graphs["sdpa"] = common.graph_replay(lambda: F.scaled_dot_product_attention(qh, kh, vh,
                                                                                          enable_gqa=True))
            for _ in range(rounds):
                for name, g in graphs.items():
                    row.setdefault(f"{name}_us", []).append(dobench_us(g))
        for kk in list(row):
            if isinstance(row[kk], list):
                row[f"{kk}_rounds"] = row[kk]
                row[kk] = min(row[kk])
        for name in names:
            row[f"{name}_x_sdpa"] = row["sdpa_us"] / row[f"{name}_us"]
        rows.append(row)
        if save is not None:
            save(rows)
        print("given", {kk: (round(vv, 2) if isinstance(vv, float) else vv) for kk, vv in row.items()
                        if not kk.endswith("_rounds")}, flush=True)
        del graphs
        torch.cuda.empty_cache()
    return rows


def g_sdpa_other(S, F):
    q, k, v, *_ = inputs(S)
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return common.graph_replay(lambda: F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True))


def events_us(g, flush, pre, reps=60):
    """Median us of one replay of g between two events, each preceded by (flush.zero_() if flush is given) and a
    replay of `pre` (outside the events)."""
    ts = []
    for i in range(reps + 5):
        if flush is not None:
            flush.zero_()
        pre()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g()
        b.record()
        torch.cuda.synchronize()
        if i >= 5:
            ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


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
    ap.add_argument("--ab-full", type=int, default=2, help="--ab: variants timed at every S (the rest: largest S)")
    ap.add_argument("--given", nargs="*", metavar="VARIANT", help="only the given-selection step (variants of "
                    f"GIVEN_VARIANTS: {', '.join(GIVEN_VARIANTS)}; default given given_late) vs the normal step and "
                    "SDPA at --s, then its timelines at the largest S; JSON <gpu>-nsa-decode-given.json")
    ap.add_argument("--ab", nargs="*", metavar="VARIANT",
                    help=f"only the A/B at --s (variants of AB_VARIANTS: {', '.join(AB_VARIANTS)}; default "
                         "new t160), then timelines (warm and L2-flushed) at the largest S; JSON "
                         "<gpu>-nsa-decode-ab.json")
    args = ap.parse_args(argv)
    rows = []
    res = {"device": torch.cuda.get_device_name(), "rows": rows}
    if args.given is not None:
        variants = tuple(args.given or ("given", "given_late"))
        fname = f"{common.gpu_name()}-nsa-decode-given.json"

        def save_g(rows_):
            res["given"] = rows_
            common.save_results(res, fname, args.out)
        res["given"] = given_ab(args.s, variants, save=save_g)
        res["probe"] = []
        for cold in (True, False):
            res["probe"].append(probe(max(args.s), cold=cold, given=True))
            common.save_results(res, fname, args.out)
        names = ("normal",) + variants
        print(f"{'S':>6} " + " ".join(f"{n + ' us':>14}" for n in names) + f" {'sdpa us':>9} "
              + " ".join(f"{n + ' x':>12}" for n in names) + "  (graph replay, do_bench median, L2 flushed)")
        for r in res["given"]:
            print(f"{r['S']:>6} " + " ".join(f"{r[n + '_us']:14.2f}" for n in names) + f" {r['sdpa_us']:9.2f} "
                  + " ".join(f"{r[n + '_x_sdpa']:12.2f}" for n in names)
                  + " idx " + " ".join(str(r[n + "_same_idx"]) for n in names[1:])
                  + " diff " + " ".join(f"{r[n + '_max_diff_vs_normal']:.1e}" for n in names[1:]))
        return res
    if args.ab is not None:
        names = args.ab or ["new", "t160"]
        fname = f"{common.gpu_name()}-nsa-decode-ab.json"

        def save(rows_):
            res["ab"] = rows_
            common.save_results(res, fname, args.out)
        res["ab"] = ab(args.s, names, full=args.ab_full, save=save)
        res["probe"] = []
        for given in (False, True):      # timelines of the first variant, both steps
            for cold in (True, False):
                res["probe"].append(probe(max(args.s), AB_VARIANTS[names[0]], cold=cold, given=given))
                common.save_results(res, fname, args.out)
        print(f"{'S':>6} {'step':>6} " + " ".join(f"{n + ' us':>12}" for n in names) + f" {'sdpa us':>9} "
              + " ".join(f"{n + ' x':>9}" for n in names) + "  (graph replay, do_bench median, L2 flushed)")
        for r in res["ab"]:
            for mode, step in (("", "token"), ("_tile", "tile")):
                print(f"{r['S']:>6} {step:>6} " + " ".join(f"{r.get(n + mode + '_us', float('nan')):12.2f}"
                                                          for n in names)
                      + f" {r['sdpa_graph_us']:9.2f} " + " ".join(f"{r.get(n + mode + '_x_sdpa', float('nan')):9.2f}"
                                                                for n in names)
                      + (" idx " + " ".join(str(r.get(n + "_same_idx_as_prefill")) for n in names) if not mode else
                         " finite " + " ".join(str(r.get(n + "_tile_finite")) for n in names))
                      + " diff " + " ".join(f"{r.get(n + mode + '_max_diff_vs_prefill', float('nan')):.1e}"
                                            for n in names))
        big = res["ab"][-1]
        print("largest S, code warm / warm us:", {kk: round(vv, 2) for kk, vv in big.items()
                                                  if kk.endswith("warm_us")})
        return res
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
