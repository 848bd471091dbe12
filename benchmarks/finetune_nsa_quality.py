"""Issue 5's fine-tune line on CPU: the tiny Llama fine-tuned 200 steps dense vs NSA (learned gates, 4 selected
blocks), per query token and per selection tile, same data and seed; mean loss of the last 20 steps, ratio to dense.

    PYTHONPATH=. python benchmarks/finetune_nsa_quality.py [--max-steps 200] [--out results/cpu-finetune-llm-nsa-s7.json]

CPU fp32 through the NSA reference: a quality check, not a speed claim.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from sparsepatch.recipes import finetune_llm

# 4 selected of the 8 blocks of a 128-token sequence: the local and first block are forced, so 2 are chosen by
# importance (with the recipe's default 2 the two selections are the same function)
RUNS = {"dense": ["--config", "dense"],
        "nsa_token": ["--config", "nsa", "--nsa-selection", "token", "--nsa-selected", "4"],
        "nsa_tile": ["--config", "nsa", "--nsa-selection", "tile", "--nsa-selected", "4"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "cpu-finetune-llm-nsa-s7.json"))
    args = ap.parse_args(argv)
    res = {"command": "PYTHONPATH=. python benchmarks/finetune_nsa_quality.py", "max_steps": args.max_steps,
           "seed": args.seed}
    for name, extra in RUNS.items():
        r = finetune_llm.main([*extra, "--max-steps", str(args.max_steps), "--seed", str(args.seed),
                               "--log-every", str(args.max_steps)])
        res[name] = {"mean_loss_last20": statistics.fmean(r["losses"][-20:]), "final_loss": r["final_loss"],
                     "median_step_ms": 1e3 * statistics.median(r["step_times"])}
    for name in ("nsa_token", "nsa_tile"):
        res[name]["ratio_to_dense"] = res[name]["mean_loss_last20"] / res["dense"]["mean_loss_last20"]
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{'run':10} {'loss(last20)':>12} {'x dense':>8}")
    for name in RUNS:
        print(f"{name:10} {res[name]['mean_loss_last20']:12.4f} {res[name].get('ratio_to_dense', 1.0):8.4f}")
    return res


if __name__ == "__main__":
    main()
