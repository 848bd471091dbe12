"""Skip-list attention on the CPU (kernels/skip/cpu.py) vs F.scaled_dot_product_attention on the same inputs.

  python -m sparsepatch bench skip_cpu [--seq 4096] [--heads 4] [--dim 64] [--rounds 3]

Random lists at densities 1 / 0.5 / 0.25 (128 x 128 tiles, diagonal listed), fp32, B 1. Time = min over rounds of
interleaved calls (the machine may be shared); ratio = skip / SDPA (the acceptance line: <= 1.5 at density 1).
Writes benchmarks/results/cpu-skip-cpu.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import random_list, save_results  # noqa: E402

import sparsepatch as sp  # noqa: E402


def _time(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m sparsepatch bench skip_cpu", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.seq, args.heads, args.dim, generator=g) for _ in range(3))
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    lists = {d: random_list(1, args.heads, args.seq, d, device="cpu") for d in (1.0, 0.5, 0.25)}
    best = {"sdpa": float("inf"), **{d: float("inf") for d in lists}}
    for _ in range(args.rounds):
        best["sdpa"] = min(best["sdpa"], _time(lambda: F.scaled_dot_product_attention(qh, kh, vh)))
        for d, lst in lists.items():
            best[d] = min(best[d], _time(lambda: sp.kernels.skip_attention(q, k, v, lst, -5.0, backend="cpu")))
    rows = [dict(density=d, skip_ms=best[d] * 1e3, sdpa_ms=best["sdpa"] * 1e3, ratio=best[d] / best["sdpa"])
            for d in lists]
    save_results(dict(seq=args.seq, heads=args.heads, dim=args.dim, threads=torch.get_num_threads(), rows=rows),
                 "cpu-skip-cpu.json", args.out)
    print(f"S {args.seq} H {args.heads} D {args.dim}, {torch.get_num_threads()} threads; SDPA {best['sdpa'] * 1e3:.1f} ms")
    print("| density | skip ms | skip / SDPA |\n|---|---|---|")
    for r in rows:
        print(f"| {r['density']} | {r['skip_ms']:.1f} | {r['ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
