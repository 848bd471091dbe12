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


def state_dtype_tokens(model, new_tokens, device, prompt=128, seed=7):
    """Greedy tokens of `model` patched with an fp32 state vs a bf16 state (B=1, fixed length): first position
    where they differ (None: never) and the fraction of equal positions; both token lists included."""
    import sparsepatch as sp
    ids = torch.randint(2, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(device)
    outs = {}
    for name in ("float32", "bfloat16"):
        handle = sp.patch(model, sp.LightningConfig(state_dtype=name))
        try:
            with torch.no_grad():
                outs[name] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                            min_new_tokens=new_tokens, do_sample=False)[0, prompt:].tolist()
        finally:
            handle.remove()
    a, b = outs["float32"], outs["bfloat16"]
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return dict(new_tokens=new_tokens, first_difference=diff[0] if diff else None,
                equal_fraction=1 - len(diff) / len(a), tokens_fp32=a, tokens_bf16=b)


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


def _graph_us(fn, reps_ms=200):
    """us per replay of one CUDA graph of fn() (warmed up on a side stream first), or an error string."""
    import triton
    try:
        from common import graph_replay
        replay = graph_replay(fn, warmup=2)
        replay()
        torch.cuda.synchronize()
        return triton.testing.do_bench(replay, warmup=25, rep=reps_ms, return_mode="median") * 1e3
    except Exception as exc:  # noqa: BLE001
        torch.cuda.synchronize()
        return f"{type(exc).__name__}: {str(exc)[:160]}"


def analysis(B=64, layers=2, heads=64, hidden=1024, prompt=32, vocab=4096):
    """Where the decode step's time goes at real MiniMax head shapes (64 heads x 128) with few layers, all
    lightning: the attention module alone and one whole decode step (embed, layers, norm, lm_head), unpatched vs
    patched (fp32 state) vs patched (bf16 state), eager (do_bench) and as one CUDA graph replay. The MoE uses
    transformers' grouped_mm experts (capturable: no host sync); the decode step is driven directly (no
    generate) so the hybrid cache needs no static variant: every linear layer's state is updated in place
    (patched) or replaced by a new tensor (unpatched; under a graph the replay recomputes from the captured
    state, which times the same work)."""
    import triton
    from transformers import MiniMaxConfig, MiniMaxForCausalLM
    from transformers.models.minimax.modeling_minimax import MiniMaxCache
    import sparsepatch as sp
    torch.manual_seed(0)
    cfg = MiniMaxConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=1024, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=8, head_dim=128, num_local_experts=2,
                        num_experts_per_tok=1, block_size=256, max_position_embeddings=4096, pad_token_id=0,
                        bos_token_id=1, eos_token_id=100000, layer_types=["linear_attention"] * layers,
                        experts_implementation="grouped_mm")
    model = MiniMaxForCausalLM(cfg).eval().to(device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(2, vocab, (B, prompt), generator=torch.Generator().manual_seed(0)).cuda()
    nxt = torch.randint(2, vocab, (B, 1), generator=torch.Generator().manual_seed(1)).cuda()
    hs = torch.randn(B, 1, hidden, device="cuda", dtype=torch.bfloat16)
    bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median") * 1e3  # noqa: E731
    res = {"B": B, "layers": layers, "heads": heads, "head_dim": 128, "hidden": hidden, "prompt": prompt,
           "state_MB_per_layer_fp32": B * heads * 128 * 128 * 4 / 1e6, "variants": {}}

    def step(cache):
        h = model.model.embed_tokens(nxt)
        for layer in model.model.layers:
            h = layer(h, past_key_values=cache, use_cache=True)
        return model.lm_head(model.model.norm(h))

    for name, conf in (("unpatched", None), ("patched_fp32", sp.LightningConfig()),
                       ("patched_bf16", sp.LightningConfig(state_dtype="bfloat16"))):
        handle = sp.patch(model, conf) if conf is not None else None
        try:
            cache = MiniMaxCache()
            with torch.no_grad():
                model(input_ids=ids, past_key_values=cache, use_cache=True)
                attn = model.model.layers[0].self_attn
                r = {"state_dtype": str(cache.linear_cache[0].dtype)}
                fa = lambda: attn(hs, None, None, past_key_values=cache)  # noqa: E731
                fs = lambda: step(cache)  # noqa: E731
                r["attn_eager_us"] = bench(fa)
                r["step_eager_us"] = bench(fs)
                r["attn_graph_us"] = _graph_us(fa)
                r["step_graph_us"] = _graph_us(fs)
            torch.cuda.synchronize()
        finally:
            if handle is not None:
                handle.remove()
        res["variants"][name] = r
        print("analysis", name, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    base = res["variants"]["unpatched"]
    for name, r in res["variants"].items():
        for key in ("attn_eager_us", "step_eager_us", "attn_graph_us", "step_graph_us"):
            if isinstance(r.get(key), float) and isinstance(base.get(key), float):
                r["speedup_" + key[:-3]] = base[key] / r[key]
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--analysis", action="store_true",
                   help="attention module vs whole step, eager and CUDA graph, at 64 heads x 128 (see analysis())")
    p.add_argument("--state-tokens", type=int, default=0,
                   help="also: greedy tokens over this many new tokens, fp32 vs bf16 state (patched), B=1")
    args = p.parse_args(argv)
    if args.analysis:
        from common import gpu_name
        res = analysis()
        text = json.dumps(res, indent=1)
        if args.out:
            Path(args.out, f"{gpu_name()}-minimax-analysis.json").write_text(text)
        print(f"{'variant':>14} {'attn eager':>11} {'attn graph':>11} {'step eager':>11} {'step graph':>11}  (us)")
        for name, r in res["variants"].items():
            cells = [r.get(k) for k in ("attn_eager_us", "attn_graph_us", "step_eager_us", "step_graph_us")]
            print(f"{name:>14} " + " ".join(f"{c:>11.1f}" if isinstance(c, float) else f"{'err':>11}" for c in cells))
        return 0

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
    drift = None
    if args.state_tokens:
        drift = state_dtype_tokens(model, args.state_tokens, device, args.prompt)
        print("greedy tokens fp32 vs bf16 state:", {k: v for k, v in drift.items() if not k.startswith("tokens")})
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", dtype=str(dtype),
                  layers=args.layers, prompt=args.prompt, new_tokens=args.new_tokens, rows=rows,
                  state_dtype_tokens=drift)
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
