"""NSA block selection per query (what sparsepatch computes) vs per query tile (what some kernels compute), on the
trained tiny byte-level Llama (CPU, the reference implementation; no GPU needed).

    PYTHONPATH=. python benchmarks/nsa_selection_granularity.py [--tile 64] [--seq-len 1024] [--out DIR]
    (JSON cpu-nsa-selection-granularity-<seq-len>[-tile<N> unless N = 64].json)

Per query: each token ranks the selection blocks by its own importance (compressed-branch probabilities summed
over the GQA group), plus block 0 and its local block, causally. Per tile: the tokens of a tile of `--tile`
consecutive queries share one ranking (the per-token forced blocks and the causal cut stay per token):
- "tile-sum": importance summed over the tile's tokens. Kernel-friendly, but a token's blocks then depend on the
  queries of LATER tokens of its tile: not causal (information flows backwards within a tile).
- "tile-first": the importance of the tile's first token only. Causal, but later tokens of the tile select with a
  stale query.
- "selection='tile'": what `NSAConfig(selection="tile")` computes (the library's own path, no patching of the
  reference): tile-first with tiles = the selection blocks (block_size tokens, aligned), so the forced blocks are
  the tile's too. With --tile equal to block_size it must equal "tile-first" (the script checks).
Reported per NSAConfig: held-out loss (nats/byte) over 8 windows of --seq-len bytes, the gap to per query, logit
cos-sim vs dense over the last 256 positions, and the mean fraction of a token's per-query selected blocks that the
tile variant also selects. Gates uniform (untrained), no sparse fine-tune, as in the LLM notebook.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

import sparsepatch as sp
from sparsepatch.kernels.nsa import reference as nsa_reference
from sparsepatch.recipes.train_tiny_llm import heldout_tokens, load_trained

CONFIGS = [
    dict(block_size=16, num_selected=4, window=64, compress_block=16, compress_stride=8),
    dict(block_size=32, num_selected=4, window=128, compress_block=32, compress_stride=16),
]
BATCH, NUM_BATCHES = 2, 4


def tile_shared(importance: torch.Tensor, tile: int, mode: str) -> torch.Tensor:
    """importance (B, Hk, T, n_b) -> the same shape with every token of a `tile`-token tile given the tile's score
    ("sum": summed over the tile's tokens; "first": the tile's first token's)."""
    B, Hk, T, n_b = importance.shape
    nt = -(-T // tile)
    pad = nt * tile - T
    x = torch.nn.functional.pad(importance, (0, 0, 0, pad)).view(B, Hk, nt, tile, n_b)
    shared = x.sum(3, keepdim=True) if mode == "sum" else x[:, :, :, :1]
    return shared.expand(-1, -1, -1, tile, -1).reshape(B, Hk, nt * tile, n_b)[:, :, :T]


class Selection:
    """Context manager: route `nsa_reference.select_blocks` through a tile-shared score; records the blocks."""

    def __init__(self, mode: str | None, tile: int):
        self.mode, self.tile, self.picked = mode, tile, []

    def __enter__(self):
        self.orig, self.orig_tiles = nsa_reference.select_blocks, nsa_reference.select_tiles
        self.in_tiles = False

        def select(importance, qpos, config, causal):
            if self.mode is not None:
                importance = tile_shared(importance, self.tile, self.mode)
            idx = self.orig(importance, qpos, config, causal)
            if not self.in_tiles:
                self.picked.append(idx)
            return idx

        def select_tiles(*args, **kw):   # selection="tile": record its per-token result, not its per-tile ranking
            self.in_tiles = True
            try:
                idx = self.orig_tiles(*args, **kw)
            finally:
                self.in_tiles = False
            self.picked.append(idx)
            return idx
        nsa_reference.select_blocks = select
        nsa_reference.select_tiles = select_tiles
        return self

    def __exit__(self, *exc):
        nsa_reference.select_blocks, nsa_reference.select_tiles = self.orig, self.orig_tiles


def overlap(a: list, b: list) -> float:
    """Mean over tokens / heads of |a & b| / |a| for two runs' selected-block lists (same calls, same shapes)."""
    num = den = 0
    for x, y in zip(a, b):
        xs, ys = x.unsqueeze(-1), y.unsqueeze(-2)
        hit = ((xs == ys) & (xs >= 0)).any(-1)
        num += hit.sum().item()
        den += (x >= 0).sum().item()
    return num / max(den, 1)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tile", type=int, default=64, help="query tokens per tile (per-tile variants)")
    ap.add_argument("--seq-len", type=int, default=1024, help="bytes per held-out window (8 windows)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    if args.tile < 1:
        raise ValueError(f"--tile must be >= 1, got {args.tile}")
    if args.seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {args.seq_len}")
    SEQ_LEN = args.seq_len
    torch.manual_seed(0)
    model, _ = load_trained()
    tokens = heldout_tokens()
    starts = torch.linspace(0, len(tokens) - SEQ_LEN, BATCH * NUM_BATCHES).long()
    batches = torch.stack([tokens[s:s + SEQ_LEN] for s in starts]).view(NUM_BATCHES, BATCH, SEQ_LEN)

    def evaluate():
        losses, logits = [], []
        with torch.no_grad():
            for ids in batches:
                out = model(input_ids=ids, labels=ids)
                losses.append(out.loss.item())
                logits.append(out.logits[:, -256:].double())
        return sum(losses) / len(losses), torch.cat(logits)

    dense_loss, dense_logits = evaluate()
    rows = []
    for kwargs in CONFIGS:
        cfg = sp.NSAConfig(**kwargs)
        name = f"bs{cfg.block_size} sel{cfg.num_selected} win{cfg.window}"
        runs = {}
        for mode in (None, "sum", "first", "builtin"):
            sp.patch(model, sp.NSAConfig(**kwargs, selection="tile") if mode == "builtin" else cfg)
            try:
                with Selection(None if mode == "builtin" else mode, args.tile) as sel:
                    loss, logits = evaluate()
            finally:
                sp.unpatch(model)
            runs[mode] = (loss, logits, sel.picked)
        if args.tile == cfg.block_size and not torch.equal(runs["first"][1], runs["builtin"][1]):
            raise AssertionError("selection='tile' differs from tile-first with tiles of block_size tokens")
        q_loss = runs[None][0]
        for mode, label in ((None, "per query"), ("sum", f"tile-sum ({args.tile})"),
                            ("first", f"tile-first ({args.tile})"), ("builtin", "selection='tile'")):
            loss, logits, picked = runs[mode]
            rows.append(dict(config=name, selection=label, loss=loss, gap_vs_per_query=loss - q_loss,
                             gap_vs_dense=loss - dense_loss,
                             logit_cos_vs_dense=torch.nn.functional.cosine_similarity(
                                 logits.flatten(), dense_logits.flatten(), dim=0).item(),
                             blocks_shared_with_per_query=overlap(runs[None][2], picked)))
    print(f"dense held-out loss {dense_loss:.4f} nats/byte")
    print("| config | selection | loss | - per query | - dense | logit cos vs dense | per-query blocks kept |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['config']} | {r['selection']} | {r['loss']:.4f} | {r['gap_vs_per_query']:+.4f} | "
              f"{r['gap_vs_dense']:+.4f} | {r['logit_cos_vs_dense']:.5f} | {r['blocks_shared_with_per_query']:.3f} |")
    res = dict(tile=args.tile, seq_len=SEQ_LEN, windows=BATCH * NUM_BATCHES, dense_loss=dense_loss, rows=rows)
    os.makedirs(args.out, exist_ok=True)
    tag = "" if args.tile == 64 else f"-tile{args.tile}"
    with open(os.path.join(args.out, f"cpu-nsa-selection-granularity-{SEQ_LEN}{tag}.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
