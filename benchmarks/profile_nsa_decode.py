"""Where a CUDA-graph NSA decode step spends its time: per-kernel GPU durations (torch.profiler/CUPTI) against the
replay time of the whole step, HQ64/H4 D128 bf16 B=1, at a few context lengths.

    python benchmarks/profile_nsa_decode.py [--out DIR]     # CUDA only; JSON <gpu>-nsa-decode-profile.json

The difference between the replay time and the sum of kernel durations is launch/dependency latency between the
graph's kernels (what merging launches can save); each kernel's own duration is what tuning it can save.
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


def sweep(S, variants):
    """Replay us of one captured step per launch-setting variant (dicts of module attributes to set), with the
    selected indices checked against the default settings'."""
    q, k, v, kc, vc, scale, cfg = inputs(S)
    _, idx0 = nsa_decode.nsa_decode(q, k, v, kc, vc, None, scale, cfg, True)
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
            _, idx = nsa_decode.nsa_decode(q, k, v, kc, vc, None, scale, cfg, True)
            g = common.graph_replay(lambda: nsa_decode.nsa_decode(q, k, v, kc, vc, None, scale, cfg))
            rows.append(dict(variant=repr(var), same_idx=bool(torch.equal(idx, idx0)), replay_us=replay_us(g)))
        finally:
            for n, val in saved.items():
                setattr(nsa_decode, n, val)
        print(f"  {rows[-1]['replay_us']:6.1f} us  same_idx={rows[-1]['same_idx']}  {var}", flush=True)
    return rows


VARIANTS = [{}, {"NUM_WARPS": {"score": 8}}, {"NUM_WARPS": {"attn": 8}}, {"NUM_WARPS": {"combine": 8}},
            {"SCORE_CHUNK": 64}, {"SCORE_CHUNK": 256}, {"NUM_WARPS": {"combine": 2}}]


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
    for S in args.s:
        r = profile_step(S)
        rows.append(r)
        print(f"S={S}: replay {r['replay_us']:.1f} us, kernels {r['kernel_sum_us']:.1f}, gaps {r['gap_us']:.1f}")
        for n, t in sorted(r["kernels_us"].items(), key=lambda x: -x[1]):
            print(f"   {t:7.2f} us  {n}")
    common.save_results(res, f"{common.gpu_name()}-nsa-decode-profile.json", args.out)


if __name__ == "__main__":
    main()
