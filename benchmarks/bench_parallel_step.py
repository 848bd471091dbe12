"""Context parallelism on 2+ GPUs: a Wan2.1-1.3B-shaped transformer step, sparsepatch skip lists at a fixed
density, 1 GPU vs Ulysses vs ring, with diffusers' own dense CP (SDPA cuDNN) as the peer.

    torchrun --nproc-per-node 2 benchmarks/bench_parallel_step.py [--layers 30] [--reps 3] [--density 0.5]

Per shape (default 480x832 -> 32760 tokens, the acceptance shape, and 512x768 -> 32256 tokens, where each ring
shard is a whole number of 128-row tiles so ring lists are exactly the single-GPU lists of the rank's q tiles):
1. every rank, alone on its GPU: dense (SDPA cuDNN) and patched (SkipConfig(threshold=-1e9, warmup_steps=1,
   tile 128)) with the lists forced after the warm-up call to one fixed random list at `--density` (diagonal
   listed; `benchmarks/common.random_list`). A keep-everything threshold makes the kernel write back the list it
   read, so the density stays fixed for every timed call;
2. the same weights under `enable_parallelism(ContextParallelConfig(ulysses_degree=N))`, then `ring_degree=N`:
   dense (diffusers' _native_cudnn CP) and patched, with each rank's lists set to its part of the same global list
   (Ulysses: its heads; ring "gather": its q tiles). Outputs (gathered by diffusers) are compared with the 1-GPU
   patched output: max |diff| and cos.
Time = median over reps of the slowest rank's CUDA-event time of one transformer forward (no CFG).
Writes <out>/<gpu>x<N>-parallel-step.json (and under $OUT) from rank 0, and prints a table.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TILE = (128, 128)


def timed(fn, reps, device):
    """(median ms of the slowest rank, last output)."""
    out = fn()                                   # warm-up (Triton compiles, cuDNN plans)
    times = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = torch.tensor([1e3 * (time.perf_counter() - t0)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times), out


def force_lists(handle, global_mask, part):
    """Overwrite every live list of the handle with `part(global_mask, local_shape)` (bool (B, H, Tq, Tk))."""
    from sparsepatch.kernels.skip.skiplist import SkipList
    n = 0
    for lst in handle.skip_lists().values():
        shape = tuple(lst.counts.shape) + (lst.indices.shape[-1],)
        local = SkipList.from_mask(part(global_mask, shape), lst.tile, lst.seq_q, lst.seq_k)
        lst.counts.copy_(local.counts)
        lst.indices.copy_(local.indices)
        n += 1
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--density", type=float, default=0.5)
    ap.add_argument("--shapes", default="480x832,512x768", help="comma-separated HxW (81 frames)")
    ap.add_argument("--modes", default="ulysses,ring")
    ap.add_argument("--cpu", action="store_true", help="smoke test: gloo on CPU (use tiny --layers/--shapes)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cpu:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    from diffusers import ContextParallelConfig
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import sparsepatch as sp
    from common import gpu_name, random_list, save_results, wan_1_3b_shaped
    from sparsepatch.recipes.parallel_video import _one_device_on_cpu

    gpu = "cpu" if args.cpu else torch.cuda.get_device_name()
    res = dict(gpu=gpu, world=world, layers=args.layers, density=args.density, shapes={})
    for shape in args.shapes.split(","):
        h, w = (int(x) for x in shape.split("x"))
        lat_h, lat_w = h // 8, w // 8
        S = 21 * (lat_h // 2) * (lat_w // 2)
        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(1, 16, 21, lat_h, lat_w, device=device, dtype=torch.bfloat16, generator=g)
        ctx = torch.randn(1, 512, 4096, device=device, dtype=torch.bfloat16, generator=g)
        ts = torch.tensor([500], device=device)
        mask = random_list(1, 12, S, args.density, tile=TILE, seed=0, device=device).to_mask()
        entry = {"tokens": S, "modes": {}}
        res["shapes"][shape] = entry

        def step(model):
            backend = contextlib.nullcontext() if args.cpu else sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
            with torch.no_grad(), backend:
                return model(x, ts, ctx, return_dict=False)[0]

        def patched_run(model, part):
            handle = sp.patch(model, sp.SkipConfig(threshold=-1e9, warmup_steps=1, tile=TILE))
            try:
                step(model)                               # warm-up call: dense, creates the list buffers
                forced = force_lists(handle, mask, part)
                ms, out = timed(lambda: step(model), args.reps, device)
                density = handle.stats()["per_step"][-1]
            finally:
                sp.unpatch(model)
            return ms, out, density, forced

        model = wan_1_3b_shaped(args.layers, device)
        dense_ms, _ = timed(lambda: step(model), args.reps, device)
        ms, single, density, forced = patched_run(model, lambda m, shape: m)
        entry["modes"]["1gpu_dense_cudnn"] = dense_ms
        entry["modes"]["1gpu_skip"] = ms
        entry["1gpu_density"] = density
        entry["lists_forced"] = forced
        model = None
        if device.type == "cuda":
            torch.cuda.empty_cache()

        for mode in args.modes.split(","):
            model = wan_1_3b_shaped(args.layers, device)
            model.set_attention_backend("native" if args.cpu else "_native_cudnn")
            cfg = ContextParallelConfig(ulysses_degree=world) if mode == "ulysses" else \
                ContextParallelConfig(ring_degree=world)
            with _one_device_on_cpu(device):
                model.enable_parallelism(config=cfg)
            try:
                cp_dense_ms, _ = timed(lambda: step(model), args.reps, device)
            except Exception as exc:   # noqa: BLE001  (the peer is optional; report why it did not run)
                cp_dense_ms = None
                entry[f"{mode}_dense_error"] = repr(exc)[:300]
            if mode == "ulysses":
                hs = 12 // world
                part = lambda m, shape: m[:, rank * hs:(rank + 1) * hs]            # noqa: E731
            else:
                # the rank's q tiles of the global list (rows wrap when shards are not whole tiles: same density)
                part = lambda m, shape: m[:, :, (rank * shape[2] + torch.arange(shape[2])) % m.shape[2]]  # noqa: E731
            ms, out, density, forced = patched_run(model, part)
            d = torch.tensor([density], device=device, dtype=torch.float64)
            dist.all_reduce(d)
            diff = (out.float() - single.float()).abs().max().item()
            cos = torch.nn.functional.cosine_similarity(out.float().flatten(), single.float().flatten(), 0).item()
            entry["modes"][f"{mode}_dense_cudnn"] = cp_dense_ms
            entry["modes"][f"{mode}_skip"] = ms
            entry[f"{mode}_density_mean"] = d.item() / world
            entry[f"{mode}_max_abs_diff_vs_1gpu"] = diff
            entry[f"{mode}_cos_vs_1gpu"] = cos
            entry[f"{mode}_output_absmax"] = single.float().abs().max().item()
            model = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if rank == 0:
            print(json.dumps(entry), flush=True)

    if rank == 0:
        save_results(res, f"{'cpu' if args.cpu else gpu_name()}x{world}-parallel-step.json", args.out)
        print(f"\n## Context parallelism, Wan2.1-1.3B-shaped transformer step ({args.layers} layers, bf16, "
              f"density {args.density}), {world} x {gpu}")
        print("| shape | tokens | mode | dense cuDNN ms | skip ms | skip vs 1-GPU skip | max abs diff vs 1-GPU "
              "| cos vs 1-GPU |")
        print("|---|---|---|---|---|---|---|---|")
        for shape, e in res["shapes"].items():
            m = e["modes"]
            one = m["1gpu_skip"]
            print(f"| {shape} | {e['tokens']} | 1 GPU | {m['1gpu_dense_cudnn']:.1f} | {one:.1f} | 1.00x | | |")
            for mode in args.modes.split(","):
                dn = m.get(f"{mode}_dense_cudnn")
                dn = f"{dn:.1f}" if dn is not None else "n/a"
                print(f"| {shape} | {e['tokens']} | {mode} x{world} | {dn} | {m[f'{mode}_skip']:.1f} | "
                      f"{m[f'{mode}_skip'] / one:.2f}x | {e[f'{mode}_max_abs_diff_vs_1gpu']:.3g} | "
                      f"{e[f'{mode}_cos_vs_1gpu']:.5f} |")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
