"""Quality vs speed of skip lists on the trained d64 video denoiser, at the GPU kernels' tiles (issue 26).

    # GPU (bf16; the trained shape: 16 latent frames x 32 x 32 = 4096 tokens, batch 2, 10 steps; ~2 min on an H200)
    python benchmarks/sweep_tiny_video_d64.py --out $OUT
    # CPU (fp32, 8 frames x 32 x 32 = 2048 tokens, 1 clip, 6 steps: fewer frames and steps than the GPU run;
    # quality only unless --time: the CPU skip path's times say nothing about the GPU kernels)
    python benchmarks/sweep_tiny_video_d64.py --cpu
    # smoke test (any machine): 2 frames x 16 x 16 = 128 tokens, 2 steps
    python benchmarks/sweep_tiny_video_d64.py --cpu --frames 2 --latent-size 16 --steps 2 --tiles 64 \\
        --thresholds -1 --warmups 1 --reps 1 --profile-step 1 --time

The model: sparsepatch/assets/tiny_video_d64 (WanTransformer3DModel, 4 layers x 4 heads x head dim 64) in the Euler
flow sampler with its recorded shift / guidance (CFG: two transformer calls per step). For each tile x warm-up x
threshold: sp.validate (dense run, then the patched run with every attention call compared with dense attention
on the same q/k/v) -> density per step, attention cos per step and per layer, latent PSNR / SSIM per step and
final; then the time per denoising step patched vs dense (median of --reps sampling runs after a warm run, CUDA
synchronized per step). Dense is timed with torch SDPA restricted to cuDNN and unrestricted (torch's choice); the
patched runs' cross-attention runs on cuDNN too. A "floor" row runs sparsepatch's dense attention instead
(DenseConfig): the PSNR that kernel rounding alone costs (bf16 on a GPU).
The attention statistics (mass vs temporal / spatial distance, oracle tile density at 90 / 99 / 99.9% of the
mass) are taken from every layer's self-attention at step --profile-step (cond branch, first clip) and from
sparsepatch.testing.video_like_qkv at the same token grid.

Writes <out>/<device>-tiny-video-d64-sweep.json (and $OUT/... when OUT is set) after every row; prints a table.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # benchmarks/common.py

GPU_DEFAULTS = dict(frames=16, latent_size=32, batch=2, steps=10, tiles=[64, 128],
                    thresholds=[-3.0, -2.0, -1.5, -1.0, -0.75, -0.5, -0.35, -0.25], warmups=[1, 2], reps=5)
CPU_DEFAULTS = dict(frames=8, latent_size=32, batch=1, steps=6, tiles=[64, 128],
                    thresholds=[-1.0, -0.5, -0.25, -0.1], warmups=[2], reps=1)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (fp32; smaller defaults) even with CUDA")
    p.add_argument("--model-path", default=None, help="default: sparsepatch/assets/tiny_video_d64")
    p.add_argument("--frames", type=int, help="latent frames (GPU default 16, CPU 8)")
    p.add_argument("--latent-size", type=int, help="latent H = W (default 32: 16 x 16 tokens per frame)")
    p.add_argument("--batch", type=int, help="clips per call (GPU default 2, CPU 1)")
    p.add_argument("--steps", type=int, help="denoising steps (GPU default 10, CPU 6)")
    p.add_argument("--tiles", type=int, nargs="+", help="square skip tiles (default 64 128)")
    p.add_argument("--thresholds", type=float, nargs="+", help="skip thresholds, log2 units < 0")
    p.add_argument("--warmups", type=int, nargs="+", help="dense warm-up steps (GPU default 1 2, CPU 2)")
    p.add_argument("--reps", type=int, help="timed sampling runs per config (GPU default 5, CPU 1)")
    p.add_argument("--no-time", action="store_true", help="quality only (no timed runs; the CPU default)")
    p.add_argument("--time", action="store_true", help="on the CPU too: time the steps (not a speed figure there)")
    p.add_argument("--profile-step", type=int, default=None,
                   help="step whose attention the statistics use (default: steps // 2); -1: no statistics")
    p.add_argument("--profile-queries", type=int, default=256, help="queries per (clip, head) for the distance profile")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--name", default=None, help="result file name (default <device>-tiny-video-d64-sweep.json)")
    return p


def attention_statistics(pipe, kwargs, step, tiles, queries, log=print) -> dict:
    """Distance profiles and oracle tile densities of the model at `step` and of video_like_qkv on the same grid."""
    from sparsepatch import testing, video_sweep as vs
    grid = vs.token_grid(kwargs)
    t0 = time.perf_counter()
    kw = dict(kwargs, shape=(1,) + tuple(kwargs["shape"][1:]), text=kwargs["text"][:1])
    captured = vs.capture_self_attention(pipe, kw, step)
    model = {}
    for layer, (q, k) in captured.items():
        model[layer] = dict(profile=vs.attention_distance_profile(q, k, grid, max_queries=queries),
                            coverage={str(t): vs.tile_mass_coverage(q, k, (t, t)) for t in tiles})
    heads, dim = next(iter(captured.values()))[0].shape[2:]
    q, k, _ = testing.video_like_qkv(B=1, heads=heads, frames=grid[0], height=grid[1], width=grid[2], dim=dim)
    synthetic = dict(profile=vs.attention_distance_profile(q, k, grid, max_queries=queries),
                     coverage={str(t): vs.tile_mass_coverage(q, k, (t, t)) for t in tiles})
    log(f"attention statistics at step {step} ({time.perf_counter() - t0:.1f} s): oracle density holding 99% of the "
        "mass per query tile")
    for name, entry in list(model.items()) + [("video_like_qkv", synthetic)]:
        cov = "  ".join(f"tile {t}: {c['density'][1]:.3f}" for t, c in entry["coverage"].items())
        tm = entry["profile"]["temporal"]["mass"]
        log(f"  {name:<40} {cov}  mass at dt=0: {tm[0]:.3f}, dt<=1: {sum(tm[:2]):.3f}")
    return {"step": step, "grid": list(grid), "model": model, "video_like_qkv": synthetic}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from sparsepatch import testing, video_sweep as vs
    from sparsepatch.recipes.train_tiny_video import KERNEL_VIDEO_DIR
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    defaults = GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if any(t >= 0 for t in args.thresholds):
        raise SystemExit("--thresholds: every threshold must be < 0 (log2 units)")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    path = args.model_path or str(KERNEL_VIDEO_DIR)
    pipe, info = testing.tiny_trained_video_pipeline(path, dtype=dtype)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    kwargs = testing.trained_video_call_kwargs(pipe, info, batch=args.batch, frames=args.frames,
                                               latent_size=args.latent_size, steps=args.steps, seed=args.seed)
    grid = vs.token_grid(kwargs)
    gpu = device == "cuda"
    if gpu:
        from common import gpu_name
        short = gpu_name()
    else:
        short = "cpu"
    name = args.name or f"{short}-tiny-video-d64-sweep.json"
    reduced = (args.frames, args.latent_size, args.steps) != (info["frames"], info["latent_size"], 10)
    meta = dict(model=os.path.relpath(path, ROOT) if path.startswith(ROOT) else path, device=device,
                device_name=torch.cuda.get_device_name() if gpu else "cpu", dtype=str(pipe.transformer.dtype),
                torch=torch.__version__, threads=torch.get_num_threads(), shape=list(kwargs["shape"]),
                tokens_per_clip=grid[0] * grid[1] * grid[2], grid=list(grid), steps=args.steps,
                shift=kwargs["shift"], guidance_scale=kwargs["guidance_scale"], seed=args.seed,
                reduced_from_trained_shape=reduced, argv=list(argv if argv is not None else sys.argv[1:]))
    if gpu:
        meta["cudnn_version"] = torch.backends.cudnn.version()
    print(f"sweep_tiny_video_d64: {meta['device_name']} {dtype}, latents {tuple(kwargs['shape'])} = "
          f"{meta['tokens_per_clip']} tokens per clip, {args.steps} steps, CFG {kwargs['guidance_scale']}"
          + (" (fewer frames / steps than the trained 16 frames x 10 steps)" if reduced else ""), flush=True)
    if not gpu:
        print("(CPU: skip attention runs the PyTorch path; the times are not a speed measurement)", flush=True)
    start = time.perf_counter()
    result = {"meta": meta}

    def save(partial):
        from common import save_results
        save_results({**result, **partial, "wall_s": time.perf_counter() - start}, name, args.out)

    log = lambda s: print(s, flush=True)   # noqa: E731
    sweep = vs.sweep(pipe, kwargs, [(t, t) for t in args.tiles], args.thresholds, args.warmups, reps=args.reps,
                     dense_sdpa=("cudnn", None) if gpu else (None,), time_it=not args.no_time and (gpu or args.time),
                     on_row=save, log=log)
    result.update(sweep)
    step = args.steps // 2 if args.profile_step is None else args.profile_step
    if step >= 0:
        result["attention_statistics"] = attention_statistics(pipe, kwargs, step, args.tiles, args.profile_queries,
                                                              log=log)
    save({})
    print("\ndense per step: " + "; ".join(f"{k}: {vs._ms(v)}" for k, v in result["dense"].items()))
    fl = result["floor"]
    print(f"floor (sparsepatch dense attention, same steps): PSNR {fl['psnr_db']:.2f} dB, SSIM {fl['ssim']:.5f}")
    print("columns: density = mean over the steps after warm-up (from the first step that skips: warm-up w -> step "
          "w + 1, step w writes the first lists); cos/step = min over those steps of the mean attention "
          "cos; cos min = worst single call; PSNR / SSIM = final latents vs dense; ms/step = patched, mean; "
          "speedup = dense total / patched total" + (" (SDPA cuDNN)" if gpu else " (CPU: not a speed figure)"))
    print(vs.TABLE_HEADER)
    for row in result["rows"]:
        print(vs.format_row(row))
    ok = [r for r in result["rows"] if r["meets"] and r["tile"] == [64, 64]]
    print("acceptance at tile 64 (density <= 0.5 after warm-up, PSNR >= 32 dB, cos/step >= 0.995): "
          + ("MET by " + ", ".join(f"thr {r['threshold']:g} wu {r['warmup_steps']}" for r in ok) if ok else "NOT MET"))
    print(f"wrote {os.path.join(args.out, name)}" + (f" and $OUT/{name}" if os.environ.get("OUT") else "")
          + f" ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
