"""Replace cells of a shipped cost table with re-measured ones from a benchmark's results JSON.

    python benchmarks/update_cost_table.py RESULTS.json SETTING "why" [--table PATH (default: the shipped sm90.json)]

RESULTS.json holds {"entries": {setting: [cost-table entries]}} (bench_gluon_causal.py writes it): each entry of
SETTING replaces the ms of the table entry for the same cell (op, causal, D, group, dtype, B, Sq, Sk, Hq), backend by
backend (backends the run did not time keep their old ms); cells the table lacks are added. "why" is appended to the
table's "updates" list. Prints the cells whose fastest backend changed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CELL = ("op", "causal", "D", "group", "dtype", "B", "Sq", "Sk", "Hq")


def merge(table: dict, entries: list) -> list:
    """Merge `entries` into `table` in place -> [(cell, old fastest, new fastest)] where the fastest changed."""
    def cell_of(e):   # (layout: "seq" unless the entry says "head")
        return tuple(e[k] for k in CELL) + (e.get("layout", "seq"),)

    index = {cell_of(e): e for e in table["entries"]}
    changed = []
    for new in entries:
        cell = cell_of(new)
        old = index.get(cell)
        if old is None:
            old = {k: new[k] for k in CELL} | ({"layout": "head"} if cell[-1] == "head" else {}) | {"ms": {}}
            table["entries"].append(old)
            index[cell] = old
        before = min(old["ms"], key=old["ms"].get) if old["ms"] else None
        old["ms"].update({b: float(t) for b, t in new["ms"].items()})
        after = min(old["ms"], key=old["ms"].get)
        if before != after:
            changed.append((cell, before, after))
    return changed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("setting")
    ap.add_argument("why")
    ap.add_argument("--table", default=os.path.join(ROOT, "sparsepatch", "kernels", "cost_tables", "sm90.json"))
    args = ap.parse_args(argv)
    with open(args.results) as f:
        res = json.load(f)
    entries = res.get("entries", {}).get(args.setting)
    if not entries:
        ap.error(f"{args.results} has no entries for setting {args.setting!r} "
                 f"(has {sorted(res.get('entries', {}))})")
    with open(args.table) as f:
        table = json.load(f)
    changed = merge(table, entries)
    table.setdefault("updates", []).append(args.why)
    with open(args.table, "w") as f:
        json.dump(table, f, indent=0)
    print(f"{len(entries)} cells merged into {args.table}; fastest backend changed in {len(changed)}:")
    for cell, before, after in changed:
        print(f"  {cell}: {before} -> {after}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
