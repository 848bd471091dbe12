"""`python -m sparsepatch demo | validate | bench <name>`."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


# Defaults per demo model. trained: the -0.15 row of the BENCHMARKS.md sweep ("Quality-vs-speed sweeps", tile 16,
# 10 steps, 2 dense warm-up steps: density <= 0.5 from step 3 on, final PSNR ~30-31 dB), one clip instead of two to
# stay under a minute on a 2-core CPU (--batch 2 reproduces the sweep row exactly). size / frames are nominal
# pixels: latents are size / 8 and (frames - 1) / 4 + 1 as with Wan's VAE (192 x 29 -> the trained latent shape
# 24 x 24 x 8).
# random: the random-weight tiny WanPipeline with sharpened attention (head dim 64, the Triton kernels' size).
DEMO_DEFAULTS = {
    "trained": dict(steps=10, size=192, frames=29, threshold=-0.15, warmup=2, tile=16, batch=1),
    "random": dict(steps=5, size=96, frames=9, threshold=-3.0, warmup=1, tile=16, batch=1),
}


def demo(args) -> int:
    """Dense vs SkipConfig on a tiny video model (no download), per-step table (density, attention cos, PSNR).

    Default: the committed trained tiny Wan denoiser (sparsepatch/assets/tiny_video) sampling latent clips of its
    procedural classes with a rectified-flow Euler sampler; --random: a random-weight tiny WanPipeline."""
    import torch

    import sparsepatch as sp
    from sparsepatch import testing
    start = time.perf_counter()
    mode = "random" if args.random else "trained"
    for key, value in DEMO_DEFAULTS[mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    # bf16 on a GPU (CPU runs the fp32 reference path). The Triton skip kernel serves head dims 64 / 128: the
    # random model is built with 64; the trained one has 32, so its skip attention runs the reference on a GPU too.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if mode == "random":
        pipe = testing.tiny_wan_pipeline(head_dim=64, attention_gain=args.attention_gain).to(device, dtype)
        pipe.set_progress_bar_config(disable=True)
        kwargs = testing.wan_call_kwargs(height=args.size, width=args.size, num_frames=args.frames,
                                         steps=args.steps)
        what = (f"tiny WanPipeline (random weights, attention sharpened x{args.attention_gain}), {args.frames} "
                f"frames {args.size}x{args.size}, CFG cond+uncond")
    else:
        if args.size % 16 or (args.frames - 1) % 4:
            raise SystemExit("demo: --size must be a multiple of 16 and --frames of the form 4k + 1")
        pipe, info = testing.tiny_trained_video_pipeline(args.model_path, dtype=dtype)
        pipe.to(device)
        kwargs = testing.trained_video_call_kwargs(pipe, info, batch=args.batch, frames=(args.frames - 1) // 4 + 1,
                                                   latent_size=args.size // 8, steps=args.steps)
        tr = pipe.transformer
        shape = kwargs["shape"]
        what = (f"trained tiny Wan denoiser ({sum(p.numel() for p in tr.parameters()) / 1e6:.2f} M params, "
                f"{tr.config.num_layers} layers x {tr.config.num_attention_heads} heads x "
                f"{tr.config.attention_head_dim}), Euler flow sampler, {shape[0]} clip(s) of latents "
                f"{tuple(shape[1:])} = {shape[2] * (shape[3] // 2) * (shape[4] // 2)} video tokens each")
        if device == "cuda" and tr.config.attention_head_dim not in (64, 128):
            print(f"(head dim {tr.config.attention_head_dim}: no Triton skip kernel for it, the PyTorch reference "
                  "runs on the GPU; use --random for the Triton path)")
    config = sp.SkipConfig(threshold=args.threshold, warmup_steps=args.warmup, tile=(args.tile, args.tile))
    print(f"sparsepatch demo: {what}, {args.steps} steps, {device} {dtype}")
    if device == "cpu":
        print("(on CPU attention runs the plain-PyTorch reference: expect quality numbers, not a speed-up)")
    report = sp.validate(pipe, config, **kwargs)
    print(report.summary())
    if args.json:
        report.to_json(args.json)
    if args.plot:
        report.plot(args.plot)
    print(f"demo finished in {time.perf_counter() - start:.1f} s")
    return 0


def bench(args) -> int:
    path = BENCHMARKS / f"bench_{args.name}.py"
    if not path.exists():
        known = sorted(p.stem[len("bench_"):] for p in BENCHMARKS.glob("bench_*.py"))
        print(f"unknown benchmark {args.name!r}; available: {known}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(BENCHMARKS))   # the scripts share benchmarks/common.py
    spec = importlib.util.spec_from_file_location(f"bench_{args.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(args.rest) or 0


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m sparsepatch")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("demo", "validate"):
        p = sub.add_parser(name, help="dense vs patched on the trained tiny video model (no download)")
        tr, rnd = DEMO_DEFAULTS["trained"], DEMO_DEFAULTS["random"]

        def default(key):
            return f"default {tr[key]}; --random: {rnd[key]}"
        p.add_argument("--random", action="store_true",
                       help="a random-weight tiny WanPipeline (sharpened attention) instead of the trained model")
        p.add_argument("--steps", type=int, help=default("steps"))
        p.add_argument("--size", type=int, help="video height = width in pixels, multiple of 16 (trained model: "
                       "latent size = size / 8); " + default("size"))
        p.add_argument("--frames", type=int, help="frames, 4k + 1 (trained model: k + 1 latent frames); "
                       + default("frames"))
        p.add_argument("--threshold", type=float, help="skip threshold, log2 units; " + default("threshold"))
        p.add_argument("--warmup", type=int, help="dense warm-up steps; " + default("warmup"))
        p.add_argument("--tile", type=int, help="skip tile edge (tiny models: 16; real models: 128); "
                       + default("tile"))
        p.add_argument("--batch", type=int, help="trained model: clips per call, prompted with classes 0, 1, ...; "
                       + default("batch"))
        p.add_argument("--model-path", help="trained model: a train_tiny_video output dir (default: the committed "
                       "sparsepatch/assets/tiny_video)")
        p.add_argument("--attention-gain", type=float, default=100.0, help="--random: q/k logit gain")
        p.add_argument("--cpu", action="store_true")
        p.add_argument("--json", help="write the report as JSON here")
        p.add_argument("--plot", help="save the density / cos-sim plot here (PNG)")
        p.set_defaults(fn=demo)
    p = sub.add_parser("bench", help="run benchmarks/bench_<name>.py (GPU)")
    p.add_argument("name")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=bench)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
