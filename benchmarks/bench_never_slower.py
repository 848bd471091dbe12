"""Never slower than unpatched: `sp.kernels.attention` vs every SDPA backend over the grid users run, and whole
models patched vs unpatched, in one process.

  python -m sparsepatch bench never_slower [--quick] [--table-out PATH] [--skip-models] [--out DIR]

1. Kernel grid (kernels/tuning.py cells: causal x head dim 64/128/256 x S 1K..32K (B*S = 16K) x MHA/GQA4, bf16 and
   fp16, plus decode Sq = 1): every backend timed (do_bench medians); the measurements become the cost table
   (`--table-out` writes it: the shipped sparsepatch/kernels/cost_tables/sm90.json comes from this run); then
   `sp.kernels.attention` (the dispatcher with that table) is timed again per cell. Ratio = best SDPA backend /
   dispatched (> 1 = faster than the best SDPA kernel; the acceptance line is >= 0.98).
2. Whole models, patched with DenseConfig vs unpatched (transformers' / diffusers' SDPA): Llama-shaped (4 layers,
   32 x 128 heads, GQA 4), Qwen3-shaped, D256-shaped LLMs (prefill 1K / 8K / 32K; greedy decode tokens/s at B 1
   and 16 after a warm-up of the same batch), and a Wan2.1-1.3B-shaped transformer step (4 layers, 32760 tokens)
   with DenseConfig and with the default recipe (skip lists; random weights keep every tile); a CogVideoX-5B-shaped
   step (4 layers, 48 x 64 heads, 17550 + 226 tokens) the same way; both steps also with the default recipe at
   forced list densities 0.5 / 0.25; and a Llama-shaped LLM (2 layers, 64 x 128 heads, 4 KV heads) patched with
   NSAConfig (per-token and tile selection) at prefill 8K / 32K (`llama_nsa`), and a Llama-shaped training step
   (forward + loss + backward, 4K / 16K: `llama_train`). `--models` picks rows. Each
   unpatched / patched pair (prefill, step and decode) is timed in the order unpatched, patched, patched,
   unpatched (`_abba`).
Results: benchmarks/results/<gpu>-never-slower.json; a table printed last.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import gpu_name, save_results  # noqa: E402

import sparsepatch as sp  # noqa: E402
from sparsepatch.kernels import dispatch, tuning as tune  # noqa: E402
from sparsepatch.kernels.dense import op as dense_op  # noqa: E402

SDPA = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa")


def _bench(fn, rep=40):
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def kernel_grid(cells, log):
    entries = tune.measure(cells, log=log)
    table = {"device": torch.cuda.get_device_name(), "arch": list(torch.cuda.get_device_capability()),
             "torch": torch.__version__, "measured": time.strftime("%Y-%m-%d"), "entries": entries}
    dispatch.set_cost_table(dispatch.CostTable(table, source="this run"))
    rows = []
    for cell, e in zip(cells, entries):
        q, k, v = tune.cell_inputs(cell)
        causal = cell[6]
        route = sp.kernels.explain(q, k, v, causal=causal)
        sdpa = {n: e["ms"][n] for n in SDPA if n in e["ms"]}
        best = min(sdpa, key=sdpa.get) if sdpa else None
        ours = {n: e["ms"][n] for n in ("flash_triton", "splitd_triton") if n in e["ms"]}
        # the dispatched call and the best SDPA kernel timed back to back (2 interleaved rounds, min of each), so
        # clock drift over the grid cannot enter the ratio; the table's times pick the backend
        t, tb = float("inf"), float("inf")
        run_best = dense_op.DISPATCH.backends[best].run if best else None
        for _ in range(2):
            t = min(t, _bench(lambda: sp.kernels.attention(q, k, v, causal=causal)))
            if best:
                tb = min(tb, _bench(lambda: run_best(q, k, v, causal=causal, scale=None, attn_mask=None,
                                                     return_lse=False)))
        if best:
            sdpa[best] = tb
        rows.append(dict(cell=[cell[0], cell[1], cell[2], cell[3], cell[4], cell[5], cell[6], str(cell[7])],
                         backend=route.backend, dispatched_ms=t, best_sdpa=best,
                         best_sdpa_ms=sdpa.get(best), ratio=(sdpa[best] / t) if best else None,
                         own_kernel_ratio=(sdpa[best] / min(ours.values())) if best and ours else None,
                         ms=e["ms"]))
        del q, k, v
    return table, rows


def _llm(kind, layers=4):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    common = dict(num_hidden_layers=layers, vocab_size=32000, max_position_embeddings=65536,
                  attn_implementation="sdpa")
    if kind == "llama":
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                          **common)
        cls = LlamaForCausalLM
    elif kind == "qwen3":
        cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, **common)
        cls = Qwen3ForCausalLM
    elif kind == "llama_nsa":   # issue 27's NSA row: 64 x 128 query heads, 4 KV heads (a 70B-like attention)
        cfg = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=4,
                          **dict(common, num_hidden_layers=min(layers, 2)))
        cls = LlamaForCausalLM
    else:   # D256-shaped (Gemma-like heads on a Llama body)
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=16, num_key_value_heads=4,
                          head_dim=256, **common)
        cls = LlamaForCausalLM
    with torch.device("cuda"):
        model = cls(cfg)
    return model.to(torch.bfloat16).eval()


def _prefill(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False, logits_to_keep=1)


def _time_decode(model, B, prompt=512, new=32):
    ids = torch.randint(0, 32000, (B, prompt), device="cuda")
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **kw)       # warm-up of the same batch
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            model.generate(ids, **kw)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
    return B * new / best


def llm_rows(log, quick, kinds=("llama", "qwen3", "d256"), seqs=None, decode=True):
    rows = []
    for kind in kinds:
        model = _llm(kind)
        seqs = seqs or ((1024, 8192) if quick else (1024, 8192, 32768))
        for S in seqs:
            ids = torch.randint(0, 32000, (1, S), device="cuda")
            base, ours, stats, _ = _abba(lambda: _prefill(model, ids), model, sp.DenseConfig())
            backends = stats.get("backends", {})
            sp.unpatch(model)
            rows.append(dict(model=kind, what=f"prefill {S}", unpatched_ms=base, patched_ms=ours,
                             ratio=base / ours, backends=backends))
            log(f"  {kind} prefill {S}: {base:.2f} vs {ours:.2f} ms ({base / ours:.3f}x)")
        for B in (1, 16) if decode else ():
            # unpatched, patched, patched, unpatched (as `_abba`); tokens/s of each pair averaged
            b1 = _time_decode(model, B)
            sp.patch(model, sp.DenseConfig())
            o1, o2 = _time_decode(model, B), _time_decode(model, B)
            sp.unpatch(model)
            base, ours = (b1 + _time_decode(model, B)) / 2, (o1 + o2) / 2
            rows.append(dict(model=kind, what=f"decode B{B} tok/s", unpatched=base, patched=ours, ratio=ours / base))
            log(f"  {kind} decode B{B}: {base:.1f} vs {ours:.1f} tok/s ({ours / base:.3f}x)")
        del model
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def wan_rows(log):
    try:
        from common import wan_1_3b_shaped
        model = wan_1_3b_shaped(layers=4)
    except ImportError as exc:
        log(f"  Wan step skipped: {exc}")
        return []
    return _step_rows("wan1.3b-shaped 4 layers", model, _denoising_step(model, (1, 16, 21, 60, 104), 512), log)


def _denoising_step(model, latent_shape, text_tokens):
    """step() -> one no-grad forward of the DiT `model` on seeded random bf16 latents of `latent_shape`, text
    embeddings (1, text_tokens, 4096) and timestep 500."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(*latent_shape, device="cuda", dtype=torch.bfloat16, generator=g)
    text = torch.randn(1, text_tokens, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    t = torch.tensor([500], device="cuda")

    def step():
        with torch.no_grad():
            return model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
    return step


FORCED_DENSITIES = (0.5, 0.25)


def _forced_density_rows(label, handle, step, base, log):
    """The default recipe's step below density 1. Random weights keep every tile, so the lists never thin out by
    themselves: before each timed step every self-attention layer's read slot gets a fixed random list of density
    rho (`common.random_list`, diagonal tiles always listed; must_do tiles the adapter passes are still computed) and
    its call counter is set past the warm-up, so each layer reads that list and writes its next one as in
    steady-state sampling. The list copies are timed alone and subtracted."""
    from common import random_list
    warm = handle.config.warmup_steps
    step()                                   # past every layer's warm-up calls
    for _ in range(warm):
        step()
    bufs = [e[0] for e in handle._buffers.values() if e[0].seq_q == e[0].seq_k]
    rows = []
    for rho in FORCED_DENSITIES:
        forced = [random_list(b.counts.shape[1], b.counts.shape[2], b.seq_q, rho, tile=b.tile, device="cuda")
                  for b in bufs]

        def load():
            for b, lst in zip(bufs, forced):
                b.step.fill_(warm)
                b.counts[0].copy_(lst.counts)
                b.indices[0].copy_(lst.indices)

        def forced_step():
            load()
            return step()
        ms = _bench(forced_step) - _bench(load)
        rows.append(dict(model=label, what=f"step default recipe, forced density {rho}", unpatched_ms=base,
                         patched_ms=ms, ratio=base / ms, layers_forced=len(bufs)))
        log(f"  {label} step default recipe, forced density {rho}: {base:.2f} vs {ms:.2f} ms ({base / ms:.3f}x, "
            f"{len(bufs)} layers)")
    return rows


def _abba(fn, model, cfg, rep=40):
    """(unpatched ms, patched ms) of fn() in the order unpatched, patched, patched, unpatched (each the mean of its
    two), so that a clock drift linear in time (a 75-ms DiT step heats the card: the same kernels read 2-3% slower a
    minute later, session 16) enters both alike -> (base, ours, the patched run's stats, a handle of the model
    patched again for the caller). rep: do_bench's time budget per measurement, ms."""
    b1 = _bench(fn, rep)
    h = sp.patch(model, cfg)
    o1, o2 = _bench(fn, rep), _bench(fn, rep)
    stats = h.stats()
    sp.unpatch(model)
    b2 = _bench(fn, rep)
    h = sp.patch(model, cfg)
    return (b1 + b2) / 2, (o1 + o2) / 2, stats, h


def _step_rows(label, model, step, log):
    """One denoising step timed unpatched, with DenseConfig and with the default recipe (skip lists), then the
    default recipe at forced densities (`_forced_density_rows`)."""
    rows = []
    for name, cfg in (("DenseConfig", sp.DenseConfig()), ("default recipe", None)):
        base, ours, stats, h = _abba(step, model, cfg)
        forced = _forced_density_rows(label, h, step, base, log) if cfg is None else []
        sp.unpatch(model)
        rows.append(dict(model=label, what=f"step {name}", unpatched_ms=base, patched_ms=ours, ratio=base / ours,
                         backends=stats.get("backends", {})))
        log(f"  {label} step {name}: {base:.2f} vs {ours:.2f} ms ({base / ours:.3f}x)")
        rows += forced
    return rows


def cogvideox_5b_shaped(layers=4):
    """(model, step): a CogVideoX-5B-shaped transformer (48 x 64 heads, seeded random weights, bf16, CUDA) and one
    no-grad denoising step of 13 latent frames x 60 x 90 (17550 video tokens) + 226 text tokens."""
    from diffusers import CogVideoXTransformer3DModel
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = CogVideoXTransformer3DModel(num_attention_heads=48, attention_head_dim=64, in_channels=16,
                                            out_channels=16, time_embed_dim=512, text_embed_dim=4096,
                                            num_layers=layers, sample_width=90, sample_height=60, sample_frames=49,
                                            patch_size=2, use_rotary_positional_embeddings=True)
    model = model.to(torch.bfloat16).eval()
    return model, _denoising_step(model, (1, 13, 16, 60, 90), 226)


def cogvideox_rows(log, layers=4):
    """CogVideoX-5B-shaped transformer step (48 x 64 heads, 13 latent frames x 30 x 45 = 17550 video tokens + 226
    text tokens in joint attention; `layers` blocks, random weights, bf16): unpatched vs DenseConfig and vs the
    default recipe (skip lists; random weights keep every tile, so this is the density-1 warm-up cost)."""
    try:
        model, step = cogvideox_5b_shaped(layers)
    except ImportError as exc:
        log(f"  CogVideoX step skipped: {exc}")
        return []
    rows = _step_rows(f"cogvideox-5b-shaped {layers} layers", model, step, log)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


MODEL_ROWS = ("llama", "qwen3", "d256", "wan", "cogvideox", "llama_nsa", "llama_train")


def train_rows(log, seqs=None):
    """A Llama-shaped training step (4 layers, 32 x 128 heads, GQA 4, bf16 weights): forward, next-token loss and
    backward of one sequence, patched with DenseConfig vs unpatched. Training calls are routed by the table's
    "attention+backward" cells (flash_cudnn_bwd where it measured > 2% faster than SDPA, else SDPA)."""
    model = _llm("llama")
    model.train()
    rows = []
    for S in seqs or (4096, 16384):
        ids = torch.randint(0, 32000, (1, S), device="cuda")

        def step():
            model(ids, labels=ids, use_cache=False).loss.backward()
        base, ours, stats, _ = _abba(step, model, sp.DenseConfig(), rep=500)   # >= 8 steps per measurement
        sp.unpatch(model)
        model.zero_grad(set_to_none=True)
        rows.append(dict(model="llama_train", what=f"train step {S}", unpatched_ms=base, patched_ms=ours,
                         ratio=base / ours, backends=stats.get("backends", {})))
        log(f"  llama train step {S}: {base:.2f} vs {ours:.2f} ms ({base / ours:.3f}x) {stats.get('backends', {})}")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def nsa_rows(log, seqs=None):
    """Llama-shaped prefill (2 layers, 64 x 128 query heads, 4 KV heads) patched with NSAConfig (per-token and tile
    selection, uniform gates) vs unpatched SDPA: issue 27's whole-model line (>= 1.5x at 32K)."""
    model = _llm("llama_nsa")
    rows = []
    for S in seqs or (8192, 32768):
        ids = torch.randint(0, 32000, (1, S), device="cuda")
        for sel in ("token", "tile"):
            base, ours, _, _ = _abba(lambda: _prefill(model, ids), model, sp.NSAConfig(selection=sel))
            sp.unpatch(model)
            rows.append(dict(model="llama_nsa", what=f"prefill {S} {sel}", unpatched_ms=base, patched_ms=ours,
                             ratio=base / ours))
            log(f"  llama_nsa prefill {S} NSA {sel}: {base:.2f} vs {ours:.2f} ms ({base / ours:.3f}x)")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m sparsepatch bench never_slower", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="bf16 only, S 4K/16K, LLM prefill 1K/8K")
    p.add_argument("--skip-models", action="store_true", help="kernel grid only")
    p.add_argument("--models-only", action="store_true", help="whole models only, with the shipped cost table")
    p.add_argument("--table-out", default=None, help="write the measured cost table (JSON) here")
    p.add_argument("--models", default=",".join(MODEL_ROWS), help=f"whole-model rows to run, of {MODEL_ROWS}")
    p.add_argument("--llm-seqs", default=None, help="LLM prefill lengths, comma-separated (default: 1K, 8K, 32K)")
    p.add_argument("--no-decode", action="store_true", help="skip the LLM decode rows")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"), help="results directory")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench never_slower: needs a CUDA GPU", file=sys.stderr)
        return 2
    log = lambda s: print(s, flush=True)  # noqa: E731
    cells = tune.default_cells(dtypes=(torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float16))
    if args.quick:
        cells = [c for c in cells if c[1] in (1, 4096, 16384)]
    t0 = time.time()
    table, grid = kernel_grid(cells, log) if not args.models_only else ({}, [])
    log(f"kernel grid: {len(grid)} cells in {time.time() - t0:.0f} s")
    if args.table_out and grid:
        with open(args.table_out, "w") as f:
            json.dump(table, f, indent=0)
    models = []
    if not args.skip_models:
        chosen = [m for m in args.models.split(",") if m]
        bad = [m for m in chosen if m not in MODEL_ROWS]
        if bad:
            p.error(f"--models must name rows of {MODEL_ROWS}, got {bad}")
        seqs = tuple(int(x) for x in args.llm_seqs.split(",")) if args.llm_seqs else None
        models = llm_rows(log, args.quick, kinds=[m for m in chosen if m in ("llama", "qwen3", "d256")],
                          seqs=seqs, decode=not args.no_decode)
        models += wan_rows(log) if "wan" in chosen else []
        models += cogvideox_rows(log) if "cogvideox" in chosen else []
        models += nsa_rows(log, seqs) if "llama_nsa" in chosen else []
        models += train_rows(log, seqs) if "llama_train" in chosen else []
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, grid=grid, models=models)
    save_results(res, f"{gpu_name()}-never-slower{'-models' if args.models_only else ''}.json", args.out)
    log("\n| causal | D | Hq/Hk | dtype | B x Sq x Sk | backend | ms | best SDPA | ratio | own kernel / best SDPA |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for r in grid:
        B, Sq, Sk, Hq, Hk, D, causal, dt = r["cell"]
        own = f"{r['own_kernel_ratio']:.2f}" if r["own_kernel_ratio"] else "-"
        log(f"| {causal} | {D} | {Hq}/{Hk} | {dt} | {B}x{Sq}x{Sk} | {r['backend']} | {r['dispatched_ms']:.4f} | "
            f"{r['best_sdpa']} {r['best_sdpa_ms']:.4f} | {r['ratio']:.3f} | {own} |")
    if grid:
        worst = min(grid, key=lambda r: r["ratio"])
        log(f"worst cell ratio {worst['ratio']:.3f} at {worst['cell']} ({worst['backend']})")
    for m in models:
        log(f"| {m['model']} | {m['what']} | {m['ratio']:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
