"""Host time of a patched LLM decode step: cProfile of `generate` on a Llama-shaped model (4 layers), patched with
DenseConfig vs unpatched, and the per-call host time of the adapter's pieces. GPU only.

  python benchmarks/profile_patched_decode.py [--batch 16] [--new 32]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sparsepatch as sp  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new", type=int, default=32)
    args = p.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=4, vocab_size=32000, attn_implementation="sdpa")
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 32000, (args.batch, 512), device="cuda")
    kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)

    def run():
        with torch.no_grad():
            model.generate(ids, **kw)
        torch.cuda.synchronize()

    for label in ("unpatched", "patched"):
        if label == "patched":
            sp.patch(model, sp.DenseConfig())
        run()
        t0 = time.perf_counter()
        run()
        wall = time.perf_counter() - t0
        prof = cProfile.Profile()
        prof.enable()
        run()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print(f"== {label}: {wall * 1e3:.1f} ms for {args.new} tokens at B{args.batch}")
        print(s.getvalue()[-3500:])
    sp.unpatch(model)


if __name__ == "__main__":
    main()
