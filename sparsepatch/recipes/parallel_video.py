"""Run a Wan pipeline with sparsepatch under diffusers context parallelism (Ulysses or ring) on N processes.

    # CPU, 2 processes (gloo), the tiny pipeline, checked against a single-process patched run:
    torchrun --nproc-per-node 2 -m sparsepatch.recipes.parallel_video --ulysses 2 --check
    torchrun --nproc-per-node 2 -m sparsepatch.recipes.parallel_video --ring 2 --ring-strategy gather,walk --check
    # unified Ulysses x ring (diffusers' 2-D mesh), 4 processes (verified on CPU: equals the single-process run):
    torchrun --nproc-per-node 4 -m sparsepatch.recipes.parallel_video --ulysses 2 --ring 2 --check
    # 2 GPUs (nccl), a Wan-shaped transformer (12 heads x 128, random weights), 480x832x81 -> 32760 tokens, bf16:
    torchrun --nproc-per-node 2 -m sparsepatch.recipes.parallel_video --model wan-shaped --ulysses 2 \\
        --height 480 --width 832 --frames 81 --steps 10 --threshold=-5 --tile 128 128 --dtype bf16 --check

Each rank prints per-step wall time and density (its own share and the mean over ranks: Ulysses ranks own H/N heads,
ring ranks own a q shard; see sparsepatch/patcher/parallel.py). --check also runs the same pipeline patched in one
process (on every rank) and reports the max abs difference of the frames and whether the rank's skip lists equal /
contain that run's lists for its heads (Ulysses) or q tiles (ring) after each step. --json PATH writes rank 0's
report (all thresholds) for tests.

On CPU, diffusers' `_resolve_parallel_config` computes `rank % torch.accelerator.device_count()`, which is 0 without
an accelerator; the script reports one device while enable_parallelism runs (it only names the device "cpu:0").
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist

import sparsepatch as sp
from sparsepatch.testing import tiny_wan_pipeline, wan_call_kwargs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODELS = {  # tiny_wan_pipeline arguments
    "tiny": dict(num_layers=2, heads=2, head_dim=32, attention_gain=100.0),
    "wan-shaped": dict(num_layers=2, heads=12, head_dim=128, attention_gain=100.0),
}


@contextlib.contextmanager
def _one_device_on_cpu(device):
    if device.type != "cpu":
        yield
        return
    orig = torch.accelerator.device_count
    torch.accelerator.device_count = lambda *a, **k: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = orig


def build(args, device, dtype, seed=0):
    pipe = tiny_wan_pipeline(seed=seed, **MODELS[args.model])
    pipe.to(device=device) if dtype == torch.float32 else pipe.to(device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_kwargs(args):
    return wan_call_kwargs(height=args.height, width=args.width, num_frames=args.frames, steps=args.steps,
                           seed=args.seed)


def run(pipe, args, snapshot):
    """Frames, per-step wall times and, when `snapshot` is a handle, its skip-list masks after each step."""
    times, lists, t0 = [], [], [time.perf_counter()]

    def on_step_end(p, i, t, kw):
        if pipe.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        times.append(now - t0[0])
        t0[0] = now
        if snapshot is not None:
            lists.append({key: lst.to_mask().cpu() for key, lst in snapshot.skip_lists().items()})
        return kw

    with torch.no_grad():
        frames = pipe(**call_kwargs(args), callback_on_step_end=on_step_end).frames
    return frames.float().cpu(), times, lists


def _rank_view(ref_mask, mode, rank, world, mine):
    """The part of a single-process list (B, H, Tq, Tk) that this rank's list covers, or None if grids differ."""
    if mode == "unified":
        return None
    if mode == "ulysses":
        h = ref_mask.shape[1] // world
        part = ref_mask[:, rank * h:(rank + 1) * h]
    else:
        tq = mine.shape[2]
        part = ref_mask[:, :, rank * tq:(rank + 1) * tq]
    return part if part.shape == mine.shape else None


def compare_lists(mine_steps, ref_steps, mode, rank, world):
    """Per step: "equal", "contains" (rank list is a strict superset), "differs" or "n/a" (different tile grids)."""
    out = []
    for mine, ref in zip(mine_steps, ref_steps):
        verdicts = []
        for key, m in mine.items():
            part = _rank_view(ref[key], mode, rank, world, m) if key in ref else None
            if part is None:
                verdicts.append("n/a")
            elif torch.equal(part, m):
                verdicts.append("equal")
            elif bool((m | part).eq(m).all()):
                verdicts.append("contains")
            else:
                verdicts.append("differs")
        order = ["equal", "contains", "differs", "n/a"]
        out.append(max(verdicts, key=order.index) if verdicts else "n/a")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ulysses", type=int, default=1)
    ap.add_argument("--ring", type=int, default=1)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--height", type=int, default=128)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--frames", type=int, default=9)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threshold", type=lambda s: [float(x) for x in s.split(",")], default=[-3.0],
                    help="comma-separated skip thresholds, e.g. --threshold=-1e9,-3 (one run each)")
    ap.add_argument("--tile", type=int, nargs=2, default=[16, 16])
    ap.add_argument("--ring-strategy", default="gather",
                    help="comma-separated ring strategies (gather, walk; see sparsepatch/patcher/parallel.py)")
    ap.add_argument("--warmup-steps", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--check", action="store_true", help="compare with a single-process patched run")
    ap.add_argument("--json", help="write rank 0's report here")
    args = ap.parse_args(argv)
    if args.ulysses * args.ring == 1:
        ap.error("give --ulysses N and/or --ring N with N > 1")
    mode = "unified" if args.ulysses > 1 and args.ring > 1 else "ulysses" if args.ulysses > 1 else "ring"

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dtype = DTYPES[args.dtype]
    from diffusers import ContextParallelConfig

    pipe = build(args, device, dtype)
    with _one_device_on_cpu(device):
        pipe.transformer.enable_parallelism(
            config=ContextParallelConfig(ulysses_degree=args.ulysses, ring_degree=args.ring))
    ref_pipe = build(args, device, dtype) if args.check else None
    dense = run(ref_pipe, args, None)[0] if args.check else None

    from sparsepatch.patcher import parallel
    strategies = args.ring_strategy.split(",") if args.ring > 1 else ["-"]
    report = {"mode": mode, "world": world, "runs": []}
    for strategy, threshold in ((s, t) for s in strategies for t in args.threshold):
        if args.ring > 1:
            parallel.RING_STRATEGY = strategy
        config = sp.SkipConfig(threshold=threshold, tile=tuple(args.tile), warmup_steps=args.warmup_steps)
        handle = sp.patch(pipe, config)
        try:
            frames, times, lists = run(pipe, args, handle)
            stats = handle.stats()
        finally:
            sp.unpatch(pipe)
        per_step = torch.tensor(stats["per_step"], dtype=torch.float64)
        mean_step = per_step.clone()
        dist.all_reduce(mean_step)
        mean_step /= world
        entry = {"threshold": threshold, "strategy": strategy, "rank": rank, "step_s": times, "density_rank": stats["per_step"],
                 "density_mean": mean_step.tolist(), "density": stats["density"], "calls": stats["calls"]}
        if args.check:
            ref_handle = sp.patch(ref_pipe, config)
            try:
                ref_frames, _, ref_lists = run(ref_pipe, args, ref_handle)
                ref_stats = ref_handle.stats()
            finally:
                sp.unpatch(ref_pipe)
            entry.update(err_vs_single=(frames - ref_frames).abs().max().item(),
                         err_vs_dense=(frames - dense).abs().max().item(),
                         single_err_vs_dense=(ref_frames - dense).abs().max().item(),
                         single_density=ref_stats["per_step"],
                         lists_vs_single=compare_lists(lists, ref_lists, mode, rank, world))
        gathered = [None] * world
        dist.all_gather_object(gathered, entry)
        report["runs"].append(gathered)
        if rank == 0:
            for e in gathered:
                name = mode if args.ring == 1 else f"{mode}/{strategy}"
                line = (f"[{name} x{world} rank {e['rank']}] threshold {threshold:g}: step s "
                        + " ".join(f"{t:.3f}" for t in e["step_s"]) + " | density rank "
                        + " ".join(f"{d:.3f}" for d in e["density_rank"]) + " | mean "
                        + " ".join(f"{d:.3f}" for d in e["density_mean"]))
                if args.check:
                    line += (f" | max|diff| vs single-process {e['err_vs_single']:.2e} (vs dense {e['err_vs_dense']:.2e},"
                             f" single vs dense {e['single_err_vs_dense']:.2e}) lists {e['lists_vs_single']}")
                print(line, flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
