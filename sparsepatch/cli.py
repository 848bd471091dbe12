"""`python -m sparsepatch demo | validate | bench <name>`."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def demo(args) -> int:
    """Tiny Wan pipeline built from configs (no download): dense vs SkipConfig, per-step table."""
    import torch

    import sparsepatch as sp
    from sparsepatch.testing import tiny_wan_pipeline, wan_call_kwargs
    start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    # head_dim 64 + bf16 on a GPU: the shapes the Triton kernels serve (CPU runs the fp32 reference path).
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pipe = tiny_wan_pipeline(head_dim=64, attention_gain=args.attention_gain).to(device, dtype)
    pipe.set_progress_bar_config(disable=True)
    kwargs = wan_call_kwargs(height=args.size, width=args.size, num_frames=args.frames, steps=args.steps)
    config = sp.SkipConfig(threshold=args.threshold, warmup_steps=args.warmup, tile=(args.tile, args.tile))
    print(f"sparsepatch demo: tiny WanPipeline (random weights, attention sharpened x{args.attention_gain}), "
          f"{args.frames} frames {args.size}x{args.size}, {args.steps} steps, CFG cond+uncond, {device} {dtype}")
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
        p = sub.add_parser(name, help="dense vs patched on a tiny Wan pipeline built from configs (no download)")
        p.add_argument("--steps", type=int, default=5)
        p.add_argument("--size", type=int, default=96, help="video height = width in pixels (multiple of 16)")
        p.add_argument("--frames", type=int, default=9, help="frames (4k + 1)")
        p.add_argument("--threshold", type=float, default=-3.0)
        p.add_argument("--warmup", type=int, default=1)
        p.add_argument("--tile", type=int, default=16, help="skip tile edge (tiny model: 16; real models: 128)")
        p.add_argument("--attention-gain", type=float, default=100.0)
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
