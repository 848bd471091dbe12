"""Causal and head-dim-64 dense forward on the persistent warp-specialised Gluon kernel vs SDPA (issue 24).

Times, in one process on the same inputs, the dense `attention` backends at the dispatcher's prefill cells
(`kernels.tuning.default_cells`: B * S = 16K tokens, B = 1 at 32K; MHA and GQA 4) for causal D 64 / 128 and
non-causal D 64, with `flash_triton` in two launch settings:
  before: the shipped CONFIGS (causal and D 64 on the Triton kernel; non-causal D 128 on Gluon),
  gluon:  causal D 128 / D 64 and non-causal D 64 on the Gluon kernel (`causal_gluon`, `gluon` config keys),
          causal q-tiles head-major, longest first within each head (causal_order 1, the default),
  gluon_o0: the same with causal_order 0 (longest q-tiles of all heads first).
Prints ours / best SDPA per cell and writes the cost-table entries of each setting (kernels/cost_tables format)
to benchmarks/results/<gpu>-gluon-causal.json (and $OUT).

    python benchmarks/bench_gluon_causal.py [--dtypes bfloat16,float16] [--dims 64,128]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import gpu_name, save_results  # noqa: E402
from sparsepatch.kernels import tuning  # noqa: E402
from sparsepatch.kernels.skip import triton as skip_triton  # noqa: E402

SDPA = ["sdpa_cudnn", "sdpa_flash", "sdpa"]
SETTINGS = {
    "before": {},
    "gluon": {(128, 128): dict(gluon=True, causal_gluon=True), (64, 128): dict(gluon=True, causal_gluon=True)},
    "gluon_o0": {(128, 128): dict(gluon=True, causal_gluon=True, gluon_causal_order=0),
                 (64, 128): dict(gluon=True, causal_gluon=True, gluon_causal_order=0)},
}


def cells_for(dtypes, dims):
    out = []
    for cell in tuning.default_cells(dtypes=dtypes, head_dims=dims):
        B, Sq, Sk, Hq, Hk, D, causal, dtype = cell
        if Sq > 1 and (causal or D == 64):
            out.append(cell)
    return out


def run(dtypes, dims, log=print):
    cells = cells_for(dtypes, dims)
    peers = tuning.measure(cells, backends=SDPA, log=log)
    shipped = {key: dict(cfg) for key, cfg in skip_triton.CONFIGS.items()}
    ours = {}
    for name, overrides in SETTINGS.items():
        for key, cfg in shipped.items():
            skip_triton.CONFIGS[key] = dict(cfg, **overrides.get(key, {}))
        try:
            ours[name] = tuning.measure(cells, backends=["flash_triton"], log=log)
        finally:
            skip_triton.CONFIGS.update({key: dict(cfg) for key, cfg in shipped.items()})
    rows, entries = [], {name: [] for name in SETTINGS}
    for i, peer in enumerate(peers):
        best = min(peer["ms"].values()) if peer["ms"] else float("nan")
        row = {k: peer[k] for k in ("causal", "D", "group", "dtype", "B", "Sq", "Hq")}
        row["best_sdpa_ms"] = best
        for name in SETTINGS:
            t = ours[name][i]["ms"].get("flash_triton")
            row[f"{name}_ms"] = t
            row[f"{name}_ratio"] = best / t if t else None
            entries[name].append(dict(peer, ms=dict(peer["ms"], **ours[name][i]["ms"])))
        rows.append(row)
    return rows, entries


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--dims", default="64,128")
    args = ap.parse_args(argv)
    dtypes = tuple(getattr(torch, d) for d in args.dtypes.split(","))
    dims = tuple(int(d) for d in args.dims.split(","))
    rows, entries = run(dtypes, dims)
    print(f"\n{'causal':>6} {'D':>4} {'G':>2} {'dtype':>9} {'B':>3} {'S':>6} {'sdpa ms':>8} "
          + " ".join(f"{n + ' x':>9}" for n in SETTINGS))
    for r in rows:
        print(f"{str(r['causal']):>6} {r['D']:>4} {r['group']:>2} {r['dtype']:>9} {r['B']:>3} {r['Sq']:>6} "
              f"{r['best_sdpa_ms']:8.3f} " + " ".join(f"{(r[n + '_ratio'] or 0):9.3f}" for n in SETTINGS))
    print(f"Gluon kernel still enabled after the run (no launch failure): {skip_triton._GLUON_OK[0]}")
    save_results({"gpu": gpu_name(), "gluon_ok": skip_triton._GLUON_OK[0], "rows": rows, "entries": entries},
                 f"{gpu_name()}-gluon-causal.json", os.path.join(ROOT, "benchmarks", "results"))


if __name__ == "__main__":
    main()
