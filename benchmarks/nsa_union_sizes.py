"""How many selection blocks a tile of consecutive query tokens needs (the union of their per-token selections):
the quantity that decides whether the NSA token-tile selected kernel (`nsa._slc_tile_kernel`) can share K/V loads.

    PYTHONPATH=. python benchmarks/nsa_union_sizes.py [--out DIR]

CPU, reference selection (`nsa_reference`), two kinds of data:
- random N(0, 1) q/k/v (what `bench_nsa.py` times): NSAConfig(), T = 8192, the last 1024 queries (each sees >= 112
  of the 128 blocks), per GQA layout HQ64/H4, HQ32/H8, HQ16/H16;
- the trained tiny byte-level Llama (`sparsepatch/assets/tiny_llm`), 4 held-out windows of 1024 bytes, the second
  half of each window, the two NSA configs of `nsa_selection_granularity.py`.
Prints the mean union size per tile of 1 / 4 / 8 / 16 / 64 tokens (per KV head) and writes
<out>/cpu-nsa-union-sizes.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TILES = (1, 4, 8, 16, 64)


def mean_union(idx: torch.Tensor, first: int) -> dict:
    """idx (B, T, Hk, nsel) selected blocks (-1 padded) -> {tile: mean number of distinct blocks of the tile's
    tokens}, over tiles starting at token `first` or later, per (batch, KV head)."""
    B, T, Hk, _ = idx.shape
    res = {}
    for bt in TILES:
        sizes = []
        for b in range(B):
            for h in range(Hk):
                for t0 in range(first, T - bt + 1, bt):
                    s = idx[b, t0:t0 + bt, h].flatten()
                    sizes.append(torch.unique(s[s >= 0]).numel())
        res[bt] = round(sum(sizes) / len(sizes), 1)
    return res


def random_inputs(T=8192, last=1024, chunk=256):
    from sparsepatch.config import NSAConfig
    from sparsepatch.kernels.nsa import reference as ref
    cfg = NSAConfig()
    rows = []
    for HQ, H in ((64, 4), (32, 8), (16, 16)):
        torch.manual_seed(0)
        q, k, v = torch.randn(1, T, HQ, 128), torch.randn(1, T, H, 128), torch.randn(1, T, H, 128)
        idxs = []
        for a in range(T - last, T, chunk):   # the reference materialises (Hq, chunk, S) scores: go in chunks
            ks, vs = k[:, :a + chunk], v[:, :a + chunk]
            _, i = ref._core(q[:, a:a + chunk], ks, vs, *ref.compress_kv(ks, vs, cfg), cfg, None, True,
                             128 ** -0.5, True)
            idxs.append(i)
        rows.append(dict(data="random N(0,1)", heads=f"HQ{HQ} H{H}", T=T, config=vars(cfg),
                         mean_union=mean_union(torch.cat(idxs, 1), 0)))
        print(rows[-1], flush=True)
    return rows


def trained_llm(seq_len=1024, windows=4):
    import sparsepatch as sp
    import nsa_selection_granularity as gran
    from sparsepatch.recipes.train_tiny_llm import heldout_tokens, load_trained
    torch.manual_seed(0)
    model, _ = load_trained()
    tokens = heldout_tokens()
    ids = torch.stack([tokens[s:s + seq_len] for s in torch.linspace(0, len(tokens) - seq_len, windows).long()])
    rows = []
    for kw in gran.CONFIGS:
        sp.patch(model, sp.NSAConfig(**kw))
        try:
            with gran.Selection(None, 1) as sel, torch.no_grad():
                model(input_ids=ids)
        finally:
            sp.unpatch(model)
        res = [mean_union(i, seq_len // 2) for i in sel.picked]          # one (B, T, Hk, nsel) per layer
        mean = {bt: round(sum(r[bt] for r in res) / len(res), 1) for bt in TILES}
        rows.append(dict(data="trained tiny byte Llama", config=kw, mean_union=mean))
        print(rows[-1], flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    res = dict(tiles=TILES, rows=random_inputs() + trained_llm())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu-nsa-union-sizes.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
