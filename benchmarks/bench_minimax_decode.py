"""Whole-model decode throughput of a small MiniMax (hybrid lightning + softmax layers), patched vs unpatched.

Measures what users see: `model.generate` tokens/s (greedy, fixed length) at B=1 and B=64, bf16, the model's own
cache, eager. The attention kernel is a small part of a decode step; this is the number that includes the rest
(projections, MoE, cache bookkeeping). Also checks that greedy tokens match.

    python -m sparsepatch bench minimax_decode [--layers 4] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def build(layers: int, device, dtype):
    from transformers import MiniMaxConfig, MiniMaxForCausalLM
    torch.manual_seed(0)
    types = ["linear_attention" if i % 4 != 1 else "full_attention" for i in range(layers)]
    cfg = MiniMaxConfig(vocab_size=4096, hidden_size=1024, intermediate_size=1024, num_hidden_layers=layers,
                        num_attention_heads=8, num_key_value_heads=8, head_dim=128, num_local_experts=2,
                        num_experts_per_tok=1, block_size=256, max_position_embeddings=4096, pad_token_id=0,
                        bos_token_id=1, eos_token_id=100000, layer_types=types)
    return MiniMaxForCausalLM(cfg).eval().to(device=device, dtype=dtype)


def tokens_per_s(model, ids, new_tokens, device):
    def run():
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  do_sample=False, min_new_tokens=new_tokens)
    run()                                                   # warm-up (kernel compilation, allocator)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = run()
    if device == "cuda":
        torch.cuda.synchronize()
    return ids.shape[0] * new_tokens / (time.perf_counter() - t0), out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args(argv)

    import sparsepatch as sp
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build(args.layers, device, dtype)
    rows = []
    for B in args.batches:
        ids = torch.randint(2, 4096, (B, args.prompt), generator=torch.Generator().manual_seed(B)).to(device)
        base, base_out = tokens_per_s(model, ids, args.new_tokens, device)
        handle = sp.patch(model)                            # LightningConfig from the recipe table
        try:
            fast, fast_out = tokens_per_s(model, ids, args.new_tokens, device)
        finally:
            handle.remove()
        match = (fast_out == base_out).float().mean().item()
        rows.append(dict(batch=B, unpatched_tok_s=base, patched_tok_s=fast, speedup=fast / base,
                         token_match=match))
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", dtype=str(dtype),
                  layers=args.layers, prompt=args.prompt, new_tokens=args.new_tokens, rows=rows)
    if device == "cuda":
        from common import gpu_name
        text = json.dumps(result, indent=1)
        (ROOT / "benchmarks" / "results" / f"{gpu_name()}-minimax-decode.json").write_text(text)
        if args.out:
            Path(args.out, f"{gpu_name()}-minimax-decode.json").write_text(text)
    print(f"MiniMax {args.layers} layers (hidden 1024, 8 heads x 128), {dtype}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, {result['device']}")
    print(f"{'B':>4} {'unpatched tok/s':>16} {'patched tok/s':>14} {'speedup':>8} {'same tokens':>12}")
    for r in rows:
        print(f"{r['batch']:>4} {r['unpatched_tok_s']:>16.1f} {r['patched_tok_s']:>14.1f} {r['speedup']:>7.2f}x "
              f"{r['token_match']:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
