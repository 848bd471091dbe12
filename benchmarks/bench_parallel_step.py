"""Context parallelism on N GPUs: one transformer step of a Wan-shaped model, diffusers' dense CP (SDPA cuDNN) vs
sparsepatch skip lists at a fixed density, under Ulysses, ring and Ulysses x ring (unified), against 1 GPU.

    torchrun --nproc-per-node 4 benchmarks/bench_parallel_step.py [--shape wan14b,wan1.3b]
        [--modes ulysses,ring,unified] [--ulysses-degree 2 --ring-degree 2] [--layers N] [--reps 3]
        [--density 0.5] [--quick] [--budget-s 300] [--size HxWxF]
    # CPU smoke (gloo, fp32, tile 16):
    torchrun --nproc-per-node 4 benchmarks/bench_parallel_step.py --cpu --shape tiny

Shapes (`--shape`, comma-separated; `--size HxWxF` overrides the video size of every shape):
- wan1.3b: Wan2.1-1.3B (12 heads x 128, ffn 8960), 480x832 x 81 frames -> 21 x 30 x 52 = 32760 tokens, 30 layers;
- wan14b:  Wan2.1-14B-shaped (40 heads x 128, ffn 13824), 720x1280 x 81 frames -> 21 x 45 x 80 = 75600 tokens, 4
  of the 40 layers by default (attention and ffn are per layer, so the per-layer ratios carry over; the table says
  how many layers ran);
- hunyuan: HunyuanVideo-sized attention in Wan blocks (24 heads x 128, ffn 12288), 720x1280 x 129 frames -> 33 x 45
  x 80 = 118800 tokens, 2 layers. Not HunyuanVideo's architecture: no joint text stream, no single-stream blocks;
- tiny (CPU smoke and tests): 4 heads x 32, ffn 64, text 16 x 32, 128x128 x 13 frames -> 4 x 8 x 8 = 256 tokens.

Modes (`--modes`): ulysses = ContextParallelConfig(ulysses_degree=N), ring = ring_degree=N, unified =
(ulysses_degree=U, ring_degree=R), U x R = N (`--ulysses-degree/--ring-degree`; default the squarest split with
U >= R). A mode whose Ulysses degree does not divide the head count is skipped and says so (diffusers' plain Ulysses
needs it).

Per shape:
1. 1 GPU (rank 0 alone on its GPU; the other ranks wait): dense (SDPA cuDNN), then patched with
   SkipConfig(threshold=-1e9, warmup_steps=1, tile): call 1 is the dense warm-up, call 2 runs the skip kernel on the
   full list ("keep-all"), then every list is forced to one fixed random list at `--density` (diagonal listed;
   `benchmarks/common.random_list`, the same on every rank) and the step is timed. The keep-everything threshold makes
   the kernel write back the list it read, so the density stays fixed for every timed call.
2. Each mode, on all ranks, the same weights: diffusers' dense CP (`_native_cudnn`) timed, then the patched model as
   in 1, each rank's lists set to its part of the same global list: heads [u H/U, (u+1) H/U) of the Ulysses rank u,
   q tiles of the ring rank r. When the ring shard S/R is not a whole number of q tiles, the rank's q tile t gets the
   global row of the tile holding its first row: the density is the same, the lists are not the 1-GPU lists and the
   density-d output is not expected to equal 1 GPU ("lists_exact": false); keep-all is exact either way.
Reported per mode: time (median over reps of the slowest rank's wall time of one forward, no CFG), ratios to 1 GPU,
the density each rank ran (`handle.stats()`) and their mean, outputs vs 1 GPU (max |diff| and cos for dense CP vs
1-GPU dense, keep-all vs 1-GPU keep-all, density-d vs 1-GPU density-d), peak memory (max over ranks).
Writes <out>/<gpu>x<N>-parallel-step.json (and under $OUT) from rank 0 after every mode, and prints a table.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# frames/height/width: the video in pixels (Wan VAE: 4x temporal, 8x spatial; patch (1, 2, 2)).
SHAPES = {
    "wan1.3b": dict(heads=12, head_dim=128, ffn=8960, text_dim=4096, text_len=512, height=480, width=832, frames=81,
                    layers=30, quick_layers=10, tile=128),
    "wan14b": dict(heads=40, head_dim=128, ffn=13824, text_dim=4096, text_len=512, height=720, width=1280, frames=81,
                   layers=4, quick_layers=2, tile=128),
    "hunyuan": dict(heads=24, head_dim=128, ffn=12288, text_dim=4096, text_len=256, height=720, width=1280,
                    frames=129, layers=2, quick_layers=1, tile=128),
    "tiny": dict(heads=4, head_dim=32, ffn=64, text_dim=32, text_len=16, height=128, width=128, frames=13, layers=2,
                 quick_layers=1, tile=16),
}


def latent_grid(height: int, width: int, frames: int) -> tuple[int, int, int]:
    """(latent frames, latent height, latent width) of a video in pixels; tokens = F * (h // 2) * (w // 2)."""
    if (frames - 1) % 4 or height % 16 or width % 16:
        raise ValueError(f"--size {height}x{width}x{frames}: need height and width multiples of 16 and frames = 4k+1")
    return (frames - 1) // 4 + 1, height // 8, width // 8


def tokens_of(spec: dict) -> int:
    f, h, w = latent_grid(spec["height"], spec["width"], spec["frames"])
    return f * (h // 2) * (w // 2)


def default_split(world: int) -> tuple[int, int]:
    """(ulysses, ring) with U * R = world, both > 1, as square as possible with U >= R; None if world is prime."""
    for r in range(int(math.isqrt(world)), 1, -1):
        if world % r == 0:
            return world // r, r
    return None


def resolve_modes(modes: str, world: int, ulysses_degree: int | None, ring_degree: int | None):
    """[(name, U, R)] for the comma-separated `modes` (None: ulysses, ring, and unified when degrees are given or the
    world size splits); raises ValueError on an unknown mode or degrees that do not multiply to the world size."""
    if modes is None:
        split = ulysses_degree or ring_degree or default_split(world)
        modes = "ulysses,ring,unified" if split else "ulysses,ring"
    out = []
    for mode in filter(None, modes.split(",")):
        if mode == "ulysses":
            out.append((f"ulysses x{world}", world, 1))
        elif mode == "ring":
            out.append((f"ring x{world}", 1, world))
        elif mode == "unified":
            if ulysses_degree is None and ring_degree is None:
                split = default_split(world)
                if split is None:
                    raise ValueError(f"--modes unified: world size {world} has no split U x R with U, R > 1; give "
                                     "--ulysses-degree and --ring-degree or drop 'unified'")
                u, r = split
            else:
                u = ulysses_degree if ulysses_degree is not None else world // ring_degree
                r = ring_degree if ring_degree is not None else world // ulysses_degree
            if u < 2 or r < 2 or u * r != world:
                raise ValueError(f"--ulysses-degree {u} x --ring-degree {r}: unified needs both >= 2 and their product "
                                 f"equal to the world size {world}")
            out.append((f"ulysses {u} x ring {r}", u, r))
        else:
            raise ValueError(f"--modes: unknown mode {mode!r}; accepted: ulysses, ring, unified")
    if not out:
        raise ValueError("--modes: give at least one of ulysses, ring, unified")
    return out


def rank_part(mask: torch.Tensor, shape, u_rank: int, U: int, r_rank: int, R: int, seq: int, tile_q: int):
    """This rank's part of a global list mask (B, H, Tq, Tk) bool for a local list of `shape` (B, H/U, Tq_local,
    Tk): heads of Ulysses rank u_rank; q tiles of ring rank r_rank (shard of seq // R rows; a local q tile takes the
    global row of the tile holding its first row, exact when the shard is whole tiles)."""
    B, H, Tq, Tk = mask.shape
    if H % U:
        raise ValueError(f"{H} heads do not split over ulysses degree {U}")
    hs = H // U
    part = mask[:, u_rank * hs:(u_rank + 1) * hs]
    if R > 1:
        start = r_rank * (seq // R)
        rows = ((start + torch.arange(shape[2], device=mask.device) * tile_q) // tile_q).clamp(max=Tq - 1)
        part = part[:, :, rows]
    if tuple(part.shape) != tuple(shape):
        raise ValueError(f"local list shape {tuple(shape)} does not match the rank's part {tuple(part.shape)} of the "
                         f"global list {tuple(mask.shape)} (ulysses {U}, ring {R})")
    return part


def force_lists(handle, global_mask, part):
    """Overwrite every live list of the handle with `part(global_mask, local_shape)` (bool (B, H, Tq, Tk)); returns
    how many lists were forced."""
    from sparsepatch.kernels.skip.skiplist import SkipList
    n = 0
    for lst in handle.skip_lists().values():
        shape = tuple(lst.counts.shape) + (lst.indices.shape[-1],)
        local = SkipList.from_mask(part(global_mask, shape), lst.tile, lst.seq_q, lst.seq_k)
        lst.counts.copy_(local.counts)
        lst.indices.copy_(local.indices)
        n += 1
    return n


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_local(fn, reps, device):
    """(median ms, last output) on this process alone (no collectives): the 1-GPU baseline."""
    out = fn()                                   # warm-up (Triton compiles, cuDNN plans)
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times), out


def timed(fn, reps, device):
    """(median over reps of the slowest rank's ms, last output); every rank must call it."""
    out = fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        t = torch.tensor([1e3 * (time.perf_counter() - t0)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times), out


def compare(out, ref) -> dict | None:
    """max |out - ref| and cos(out, ref) in fp32 over the whole output; None if either is missing."""
    if out is None or ref is None:
        return None
    a, b = out.float().flatten(), ref.float().flatten()
    return {"max_abs": (a - b).abs().max().item(), "cos": torch.nn.functional.cosine_similarity(a, b, 0).item()}


def backends_of(stats) -> list[str]:
    return sorted({name for per_layer in stats.get("backends", {}).values() for name in per_layer})


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="wan14b,wan1.3b", help=f"comma-separated, from {', '.join(SHAPES)}")
    ap.add_argument("--size", help="HxWxF video size in pixels for every shape (overrides the shape's own)")
    ap.add_argument("--modes", help="comma-separated: ulysses, ring, unified (default: all three, unified only "
                    "when the world size splits into U x R with U, R >= 2)")
    ap.add_argument("--ulysses-degree", type=int, help="unified mode's Ulysses degree (default: squarest split)")
    ap.add_argument("--ring-degree", type=int, help="unified mode's ring degree (default: world / ulysses degree)")
    ap.add_argument("--layers", type=int, help="transformer blocks for every shape (default: the shape's own)")
    ap.add_argument("--reps", type=int, help="timed calls per measurement (default 3; --quick: 2)")
    ap.add_argument("--density", type=float, default=0.5)
    ap.add_argument("--quick", action="store_true", help="fewer layers per shape (wan1.3b 10, wan14b 2, hunyuan 1) "
                    "and 2 reps")
    ap.add_argument("--budget-s", type=float, help="start no new shape or mode after this many seconds (the table "
                    "and JSON cover what ran)")
    ap.add_argument("--timeout-s", type=int, default=600, help="process-group timeout in seconds")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU, fp32 (use --shape tiny)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    for name in args.shape.split(","):
        if name not in SHAPES:
            ap.error(f"--shape: unknown shape {name!r}; accepted: {', '.join(SHAPES)}")
    if not 0 < args.density <= 1:
        ap.error(f"--density must be in (0, 1], got {args.density}")
    for name in ("layers", "reps", "ulysses_degree", "ring_degree"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.size:
        try:
            h, w, f = (int(x) for x in args.size.lower().split("x"))
            latent_grid(h, w, f)
        except ValueError as exc:
            ap.error(f"--size {args.size!r}: expected HxWxF with H, W multiples of 16 and F = 4k+1 ({exc})")
        args.size = (h, w, f)
    if args.reps is None:
        args.reps = 2 if args.quick else 3
    return args


def main(argv=None):
    args = parse_args(argv)
    dist.init_process_group("gloo" if args.cpu else "nccl", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cpu:
        device, dtype = torch.device("cpu"), torch.float32
    else:
        device, dtype = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))), torch.bfloat16
        torch.cuda.set_device(device)
    try:
        modes = resolve_modes(args.modes, world, args.ulysses_degree, args.ring_degree)
    except ValueError as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        dist.destroy_process_group()
        return 2

    import diffusers
    from diffusers import ContextParallelConfig
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import sparsepatch as sp
    from common import gpu_name, random_list, save_results, wan_shaped
    from sparsepatch.recipes.parallel_video import _one_device_on_cpu

    t_start = time.perf_counter()
    gpu = "cpu" if args.cpu else torch.cuda.get_device_name()
    fname = f"{'cpu' if args.cpu else gpu_name()}x{world}-parallel-step.json"
    res = dict(gpu=gpu, world=world, density=args.density, reps=args.reps, quick=args.quick, dtype=str(dtype),
               torch=torch.__version__, diffusers=diffusers.__version__, shapes={})

    def out_of_time() -> bool:
        """Rank 0 decides (so every rank agrees) whether the --budget-s is spent."""
        flag = torch.tensor([0], device=device)
        if rank == 0 and args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
            flag.fill_(1)
        dist.broadcast(flag, 0)
        return bool(flag.item())

    def peak_reset():
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

    def peak_gb() -> float | None:
        return torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None

    for shape_name in args.shape.split(","):
        spec = dict(SHAPES[shape_name])
        if args.size:
            spec["height"], spec["width"], spec["frames"] = args.size
        layers = args.layers or (spec["quick_layers"] if args.quick else spec["layers"])
        tile = (spec["tile"], spec["tile"])
        S = tokens_of(spec)
        f, lh, lw = latent_grid(spec["height"], spec["width"], spec["frames"])
        entry = dict(tokens=S, layers=layers, heads=spec["heads"], head_dim=spec["head_dim"], ffn=spec["ffn"],
                     size=f"{spec['height']}x{spec['width']}x{spec['frames']}", tile=list(tile), one_gpu={}, modes={})
        res["shapes"][shape_name] = entry
        if out_of_time():
            entry["skipped"] = "budget spent"
            continue
        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(1, 16, f, lh, lw, device=device, dtype=dtype, generator=g)
        ctx = torch.randn(1, spec["text_len"], spec["text_dim"], device=device, dtype=dtype, generator=g)
        ts = torch.tensor([500], device=device)
        mask = random_list(1, spec["heads"], S, args.density, tile=tile, seed=0, device=device).to_mask()

        def build():
            return wan_shaped(layers, heads=spec["heads"], ffn=spec["ffn"], head_dim=spec["head_dim"],
                              text_dim=spec["text_dim"], device=device, dtype=dtype)

        def step(model):
            backend = contextlib.nullcontext() if args.cpu else sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
            with torch.no_grad(), backend:
                return model(x, ts, ctx, return_dict=False)[0]

        def patched(model, part, timer):
            """keep-all output and density, then forced lists: (ms, output, density, keep-all output, keep-all
            density, lists forced, backends)."""
            handle = sp.patch(model, sp.SkipConfig(threshold=-1e9, warmup_steps=1, tile=tile))
            try:
                step(model)                               # dense warm-up: creates the list buffers
                keep_out = step(model)                    # skip kernel on the full lists (compiles it)
                keep_density = handle.stats()["per_step"][-1]
                forced = force_lists(handle, mask, part)
                if forced == 0:
                    raise RuntimeError("no skip list to force: the patch did not reach the self-attention layers")
                ms, out = timer(lambda: step(model), args.reps, device)
                stats = handle.stats()
            finally:
                sp.unpatch(model)
            return ms, out, stats["per_step"][-1], keep_out, keep_density, forced, backends_of(stats)

        # --- 1 GPU: rank 0 alone ------------------------------------------------------------------------------
        single = {}
        if rank == 0:
            one = entry["one_gpu"]
            t0 = time.perf_counter()
            try:
                peak_reset()
                model = build()
                one["build_s"] = time.perf_counter() - t0
                one["dense_ms"], single["dense"] = timed_local(lambda: step(model), args.reps, device)
                (one["skip_ms"], single["skip"], one["density"], single["keep_all"], one["keep_all_density"],
                 one["lists_forced"], one["backends"]) = patched(model, lambda m, shape: m, timed_local)
                one["output_absmax"] = single["skip"].float().abs().max().item()
                one["peak_gb"] = peak_gb()
            except Exception as exc:   # noqa: BLE001  (report it; the CP modes still run)
                one["error"] = repr(exc)[:400]
            model = None
            one["wall_s"] = time.perf_counter() - t0
            print(f"[{shape_name}] 1 GPU: " + json.dumps(one), flush=True)
            save_results(res, fname, args.out)
        peak_reset()
        dist.barrier()

        # --- each CP mode, all ranks -------------------------------------------------------------------------
        for name, U, R in modes:
            e = {"ulysses_degree": U, "ring_degree": R}
            entry["modes"][name] = e
            if out_of_time():
                e["skipped"] = "budget spent"
                continue
            if spec["heads"] % U:
                e["skipped"] = f"{spec['heads']} heads do not split over ulysses degree {U}"
                continue
            if S % world:
                e["skipped"] = f"{S} tokens do not split over {world} ranks"
                continue
            t0 = time.perf_counter()
            peak_reset()
            model = build()
            model.set_attention_backend("native" if args.cpu else "_native_cudnn")
            cfg = ContextParallelConfig(ulysses_degree=U, ring_degree=R)
            with _one_device_on_cpu(device):
                model.enable_parallelism(config=cfg)
            cp = getattr(getattr(model, "_parallel_config", None), "context_parallel_config", None) or cfg
            u_rank, r_rank = cp._ulysses_local_rank or 0, cp._ring_local_rank or 0
            e["lists_exact"] = R == 1 or (S // R) % tile[0] == 0
            try:
                e["dense_cp_ms"], dense_out = timed(lambda: step(model), args.reps, device)
            except Exception as exc:   # noqa: BLE001  (the peer is optional; report why it did not run)
                e["dense_cp_ms"], dense_out = None, None
                e["dense_cp_error"] = repr(exc)[:400]
            part = lambda m, shape: rank_part(m, shape, u_rank, U, r_rank, R, S, tile[0])   # noqa: E731
            try:
                ms, out, density, keep_out, keep_density, forced, backends = patched(model, part, timed)
            except Exception as exc:   # noqa: BLE001  (a failure of every rank alike: report it, go on)
                e["error"] = repr(exc)[:400]
                if rank == 0:
                    print(f"[{shape_name}] {name}: error {e['error']}", flush=True)
                    save_results(res, fname, args.out)
                model = None
                dist.barrier()
                continue
            model = None
            e["skip_ms"] = ms
            e["lists_forced"] = forced
            e["backends"] = backends
            per_rank = [None] * world
            dist.all_gather_object(per_rank, dict(rank=rank, u=u_rank, r=r_rank, density=density,
                                                  keep_all_density=keep_density, peak_gb=peak_gb()))
            e["ranks"] = per_rank
            e["density_mean"] = sum(p["density"] for p in per_rank) / world
            e["keep_all_density_mean"] = sum(p["keep_all_density"] for p in per_rank) / world
            e["peak_gb"] = max(p["peak_gb"] for p in per_rank) if device.type == "cuda" else None
            if rank == 0:
                one = entry["one_gpu"]
                if one.get("skip_ms"):
                    e["skip_vs_1gpu_skip"] = ms / one["skip_ms"]
                if one.get("dense_ms") and e["dense_cp_ms"]:
                    e["dense_cp_vs_1gpu_dense"] = e["dense_cp_ms"] / one["dense_ms"]
                e["diff"] = {"dense_cp_vs_1gpu_dense": compare(dense_out, single.get("dense")),
                             "keep_all_vs_1gpu": compare(keep_out, single.get("keep_all")),
                             "skip_vs_1gpu": compare(out, single.get("skip"))}
                e["wall_s"] = time.perf_counter() - t0
                print(f"[{shape_name}] {name}: " + json.dumps(e), flush=True)
                save_results(res, fname, args.out)
            out = keep_out = dense_out = None
            dist.barrier()

    res["wall_s"] = time.perf_counter() - t_start
    if rank == 0:
        save_results(res, fname, args.out)
        print_table(res)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _f(x, fmt=".1f"):
    return "n/a" if x is None else format(x, fmt)


def _x(ratio):
    return "n/a" if ratio is None else f"{ratio:.3f}x"


def print_table(res):
    print(f"\n## Context parallelism, one transformer step ({res['dtype']}, lists forced to density {res['density']}), "
          f"{res['world']} x {res['gpu']}, median of {res['reps']}")
    print("| shape | tokens | layers | mode | dense ms | skip ms | skip vs 1-GPU skip | dense vs 1-GPU dense | "
          "density (mean of ranks) | keep-all max abs diff / cos vs 1 GPU | skip max abs diff / cos vs 1 GPU | "
          "dense CP max abs diff vs 1 GPU | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for shape, e in res["shapes"].items():
        head = f"| {shape} | {e['tokens']} | {e['layers']}"
        one = e["one_gpu"]
        if e.get("skipped") or one.get("error"):
            print(f"{head} | 1 GPU | {e.get('skipped') or one.get('error')} |")
        else:
            print(f"{head} | 1 GPU | {_f(one.get('dense_ms'))} | {_f(one.get('skip_ms'))} | 1.00x | 1.00x | "
                  f"{_f(one.get('density'), '.3f')} | | | | {_f(one.get('peak_gb'))} |")
        for name, m in e["modes"].items():
            if m.get("skipped") or m.get("error"):
                print(f"{head} | {name} | {'skipped: ' + m['skipped'] if m.get('skipped') else m['error']} |")
                continue
            d = m.get("diff") or {}

            def pair(c):
                return "n/a" if not c else f"{c['max_abs']:.3g} / {c['cos']:.5f}"
            exact = "" if m.get("lists_exact") else " (lists not 1-GPU's)"
            dense = d.get("dense_cp_vs_1gpu_dense")
            print(f"{head} | {name} | {_f(m.get('dense_cp_ms'))} | {_f(m.get('skip_ms'))} | "
                  f"{_x(m.get('skip_vs_1gpu_skip'))} | {_x(m.get('dense_cp_vs_1gpu_dense'))} | "
                  f"{_f(m.get('density_mean'), '.3f')} | {pair(d.get('keep_all_vs_1gpu'))} | "
                  f"{pair(d.get('skip_vs_1gpu'))}{exact} | {'n/a' if not dense else format(dense['max_abs'], '.3g')}"
                  f" | {_f(m.get('peak_gb'))} |")
    print(f"total wall {res.get('wall_s', 0):.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
