"""`python -m sparsepatch demo | validate | bench [name]`.

demo      dense vs skip lists on the committed trained tiny video model (no download), per-step table and verdict
validate  dense vs a config on YOUR saved model directory (diffusers pipeline or transformers model); report JSON + plot
bench     list the GPU benchmarks, or run one (`bench <name> --help` shows its options)
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path

PROG = "python -m sparsepatch"
# The benchmark scripts live in the source checkout (benchmarks/ beside the package), not in the wheel.
SOURCE_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = SOURCE_ROOT / "benchmarks"

# name -> (one line, what it needs). "cuda": a CUDA GPU; "sm_90": a Hopper GPU (H100 / H200); "torchrun": launched by
# torchrun on 2+ GPUs; None: runs anywhere (slowly on CPU). tests/test_cli.py checks this table against
# benchmarks/bench_*.py, so a new script needs a line here.
BENCHES = {
    "backward": ("attention backward: Triton dense + skip lists vs SDPA (cuDNN, flash) and FlexAttention", "cuda"),
    "dense": ("split-D dense flash attention (head dims 128..1024) vs the SDPA backends", "cuda"),
    "fp8_quantize": ("the fp8 k/v quantize pass: ms, GB/s and bit checks against the reference", "cuda"),
    "gluon_causal": ("causal, head-dim-64 / 256 dense and head-dim-64 skip on the Gluon kernel vs SDPA (cuDNN, flash)",
                     "sm_90"),
    "lightning": ("lightning attention decode / prefill vs fla and torch, bandwidth vs a copy", "cuda"),
    "minimax_decode": ("whole-model MiniMax generate tokens/s, patched vs unpatched (CPU too)", None),
    "never_slower": ("dispatched attention vs every SDPA backend over the grid; whole models patched vs not",
                     "cuda"),
    "nsa": ("Native Sparse Attention prefill / decode vs SDPA (cuDNN) and fla parallel_nsa", "cuda"),
    "parallel_step": ("context parallelism (Ulysses, ring, both) on N GPUs, Wan-shaped step, vs diffusers' CP",
                      "torchrun"),
    "skip": ("temporal skip-list attention forward vs SDPA, FlexAttention (same list), sageattention", "cuda"),
    "skip_cpu": ("skip-list attention on the CPU backend vs F.scaled_dot_product_attention, densities 1 / .5 / .25",
                 None),
    "skip_fp8": ("fp8 skip lists vs cuDNN bf16, our fp8 dense and bf16 skip lists (same lists), quality check",
                 "sm_90"),
    "skip_gluon_dense": ("dense forward: Triton grid kernel vs the Gluon kernel vs cuDNN", "sm_90"),
    "train_attention": ("training calls (fwd+bwd): our forward + cuDNN's backward vs SDPA, gradient checks, table cells",
                        "sm_90"),
    "training_mode": ("training mode (backward skips too): gradient cos-sim and backward time vs dense", "cuda"),
    "video_d64": ("skip-list sweep on the trained d64 video model: density, attention cos, PSNR, ms/step vs cuDNN",
                  None),
    "wan_step": ("one Wan2.1-1.3B-shaped denoising step: cuDNN SDPA vs skip lists at fixed densities", "cuda"),
}
EXIT_CANNOT_RUN_HERE = 3


# Defaults per demo model. trained: the head-dim-64 denoiser (sparsepatch/assets/tiny_video_d64, issue 26) at
# the Triton / Gluon skip kernels' tile (64, 64), one clip. size / frames are nominal pixels: latents are size / 8 and
# (frames - 1) / 4 + 1 as with Wan's VAE, so 256 x 61 is the trained latent shape 32 x 32 x 16 (4096 tokens). On a
# CPU (DEMO_CPU) the trained demo samples 6 latent frames (1536 tokens) for 6 steps so that its four runs stay
# within a minute on 2 cores; it says so in its output. Threshold: see BENCHMARKS.md "Video" (the d64 sweep).
# random: the random-weight tiny WanPipeline with sharpened attention (head dim 64, the Triton kernels' size).
DEMO_DEFAULTS = {
    "trained": dict(steps=10, size=256, frames=61, threshold=-0.5, warmup=2, tile=64, batch=1),
    "random": dict(steps=5, size=96, frames=9, threshold=-3.0, warmup=1, tile=16, batch=1),
}
DEMO_CPU = {"trained": dict(steps=6, frames=21)}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to every option's help, except where the default is None (the help text says what
    happens then) or a flag's False."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


# --- shared helpers -------------------------------------------------------------------------------------------------

def _device(cpu: bool) -> str:
    import torch
    return "cuda" if torch.cuda.is_available() and not cpu else "cpu"


def compile_notice(device: str) -> str | None:
    """The line printed before the first GPU kernel compile (None off-GPU): Triton compiles each kernel
    specialisation once and caches it on disk, so only a machine's first run pays it."""
    if not device.startswith("cuda"):
        return None
    import torch
    major, minor = torch.cuda.get_device_capability()
    cache = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return (f"compiling sparsepatch kernels for sm_{major}{minor}, once per machine (cached in {cache}); "
            "the first steps are slower")


def progress_printer(stream=None):
    """A `sp.validate(progress=...)` callback printing one line per denoising step (per call for bare models)."""
    from .validate import IDENTICAL_DB
    stream = stream or sys.stdout

    def show(run, runs, phase, step, steps, elapsed_s, psnr_db):
        where = "" if step is None else f"  step {step:>3}/{steps}" if steps else f"  step {step:>3}"
        psnr = "" if psnr_db is None else ("  latents identical to dense" if psnr_db >= IDENTICAL_DB
                                           else f"  latents PSNR {psnr_db:6.2f} dB vs dense")
        print(f"  [run {run}/{runs}: {phase}]{where}  {elapsed_s:6.1f} s{psnr}", file=stream, flush=True)
    return show


# --- demo -----------------------------------------------------------------------------------------------------------

def demo(args) -> int:
    """Dense vs SkipConfig on a tiny video model (no download): per-step table (density, attention cos, PSNR,
    SSIM, ms) and a verdict line.

    Default: the committed trained tiny Wan denoiser (sparsepatch/assets/tiny_video_d64) sampling latent clips of its
    procedural classes with a rectified-flow Euler sampler; --random: a random-weight tiny WanPipeline."""
    import torch

    import sparsepatch as sp
    from sparsepatch import testing
    start = time.perf_counter()
    mode = "random" if args.random else "trained"
    device = _device(args.cpu)
    reduced = {}
    for key, value in DEMO_DEFAULTS[mode].items():
        if getattr(args, key) is None:
            cpu_value = DEMO_CPU.get(mode, {}).get(key) if device == "cpu" else None
            if cpu_value is not None:
                reduced[key] = (cpu_value, value)
            setattr(args, key, value if cpu_value is None else cpu_value)
    # bf16 on a GPU (CPU runs fp32). The Triton / Gluon skip kernels serve head dims 64 / 128: both the random model
    # and the trained d64 model have 64 (the older tiny_video model, --model-path, has 32: the reference serves it).
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
        from .recipes.train_tiny_video import KERNEL_VIDEO_DIR
        pipe, info = testing.tiny_trained_video_pipeline(args.model_path or KERNEL_VIDEO_DIR, dtype=dtype)
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
    if reduced:
        print("(CPU: fewer " + " and ".join(f"{'latent frames' if k == 'frames' else k} ("
                                          + (f"{(v - 1) // 4 + 1} instead of {(full - 1) // 4 + 1}" if k == "frames"
                                             else f"{v} instead of {full}") + ")"
                                          for k, (v, full) in reduced.items())
              + " than on a GPU, to stay within a minute on 2 cores; "
              + " ".join(f"--{k} {full}" for k, (_, full) in reduced.items()) + " for the full run)")
    print(f"config: {config}\nruns: dense, patched (each attention call checked against dense attention), then "
          "patched and dense again for timing", flush=True)
    if device == "cpu":
        print("(CPU: a quality check; attention runs a PyTorch path here, speed is measured on a GPU)")
    notice = compile_notice(device)
    if notice:
        print(notice, flush=True)
    report = sp.validate(pipe, config, progress=progress_printer(), **kwargs)
    print(report.summary())
    if args.json:
        report.to_json(args.json)
    if args.plot:
        report.plot(args.plot)
    print(f"demo finished in {time.perf_counter() - start:.1f} s")
    return 0


# --- validate -------------------------------------------------------------------------------------------------------

CONFIG_TYPES = ("auto", "skip", "dense", "nsa", "lightning")
DEFAULT_PROMPT = "a cat runs on the beach"


def build_config(spec: str, threshold=None, warmup=None, tile=None):
    """A patch config from `--config`: a type name (auto = the recipe for the model class), a JSON file, or a JSON
    object {"type": "skip" | "dense" | "nsa" | "lightning", <that config's fields>}. threshold / warmup / tile
    override the skip config's fields. Returns None for "auto"."""
    import sparsepatch as sp
    classes = {"skip": sp.SkipConfig, "dense": sp.DenseConfig, "nsa": sp.NSAConfig, "lightning": sp.LightningConfig}
    if spec in CONFIG_TYPES:
        kind, fields = spec, {}
    else:
        text = Path(spec).read_text() if not spec.lstrip().startswith("{") and Path(spec).is_file() else spec
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--config: {spec!r} is neither one of {CONFIG_TYPES}, a JSON file nor a JSON object "
                             f"({exc})") from None
        if not isinstance(fields, dict) or fields.get("type") not in classes:
            raise ValueError(f"--config JSON must be an object with \"type\" one of {sorted(classes)}, got {text!r}")
        fields = dict(fields)
        kind = fields.pop("type")
    skip_overrides = {k: v for k, v in (("threshold", threshold), ("warmup_steps", warmup),
                                        ("tile", None if tile is None else (tile, tile))) if v is not None}
    if skip_overrides and kind != "skip":
        raise ValueError(f"--threshold / --warmup / --tile apply to --config skip, not {kind!r}")
    if kind == "auto":
        return None
    if "tile" in fields:
        fields["tile"] = tuple(fields["tile"])
    try:
        return classes[kind](**{**fields, **skip_overrides})
    except TypeError as exc:
        raise ValueError(f"--config {kind}: {exc}") from None


def load_model_dir(path, device: str, args):
    """(pipe_or_model, call kwargs, description) for a saved model directory:
    - a diffusers pipeline (model_index.json, from `pipe.save_pretrained`): called with --prompt, --steps, and
      --height / --width / --frames / --guidance / --negative-prompt where given and the pipeline takes them,
      output_type "pt" (decoded pixels, so SSIM is in pixel space), then --call's arguments;
    - a sparsepatch tiny video denoiser (train_tiny_video output: config.json + training_info.json) in the Euler
      flow sampler, latents of --batch clips (--frames / --height: latent frames / size, default as trained);
    - a transformers model (config.json with model_type): a forward over --batch x --seq-len token ids, random
      (seeded) or --prompt through the directory's tokenizer when it has one; SSIM does not apply (logits).
    """
    import inspect

    import torch
    path = Path(path)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(args.seed)
    extra = json.loads(args.call) if args.call else {}
    if not isinstance(extra, dict):
        raise ValueError(f"--call must be a JSON object of call arguments, got {args.call!r}")
    if (path / "model_index.json").is_file():
        import warnings

        from diffusers import DiffusionPipeline
        from diffusers.utils import logging as diffusers_logging
        diffusers_logging.disable_progress_bar()
        with warnings.catch_warnings():   # newer diffusers prefer dtype=, older ones only take torch_dtype=
            warnings.simplefilter("ignore", FutureWarning)
            pipe = DiffusionPipeline.from_pretrained(str(path), torch_dtype=dtype).to(device)
        pipe.set_progress_bar_config(disable=True)
        params = inspect.signature(pipe.__call__).parameters
        wanted = dict(prompt=args.prompt or DEFAULT_PROMPT, negative_prompt=args.negative_prompt, num_inference_steps=args.steps,
                      height=args.height, width=args.width, num_frames=args.frames, guidance_scale=args.guidance,
                      generator=generator, output_type="pt")
        kwargs = {k: v for k, v in wanted.items() if v is not None and k in params}
        return pipe, {**kwargs, **extra}, f"{type(pipe).__name__} from {path}"
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model_dir: {path} has neither model_index.json (a diffusers pipeline) nor config.json "
                         "(a transformers model or a sparsepatch tiny video denoiser)")
    config = json.loads(config_file.read_text())
    if "_class_name" in config:
        if config["_class_name"] != "WanTransformer3DModel" or not (path / "training_info.json").is_file():
            raise ValueError(f"model_dir: {path} holds a bare diffusers model ({config['_class_name']}); save the "
                             "whole pipeline (pipe.save_pretrained(dir)) to validate it")
        from sparsepatch import testing
        pipe, info = testing.tiny_trained_video_pipeline(str(path), dtype=dtype)
        pipe.to(device)
        kwargs = testing.trained_video_call_kwargs(pipe, info, batch=args.batch, frames=args.frames,
                                                   latent_size=args.height, steps=args.steps, seed=args.seed)
        return pipe, {**kwargs, **extra}, f"sparsepatch tiny video denoiser from {path} (Euler flow sampler)"
    if "model_type" not in config:
        raise ValueError(f"model_dir: {config_file} has neither model_type (transformers) nor _class_name (diffusers)")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    ids = None
    if args.prompt and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(path))
        ids = tok([args.prompt] * args.batch, return_tensors="pt")["input_ids"]
    if ids is None:
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len), generator=generator)
    return model, {"input_ids": ids.to(device), **extra}, f"{type(model).__name__} from {path}, {tuple(ids.shape)} tokens"


def validate_cmd(args) -> int:
    """Dense vs a config on a saved model directory: summary on stdout, report JSON + plot under --out."""
    import sparsepatch as sp
    try:
        config = build_config(args.config, args.threshold, args.warmup, args.tile)
        device = _device(args.cpu)
        target, kwargs, what = load_model_dir(args.model_dir, device, args)
    except ValueError as exc:
        print(f"{PROG} validate: error: {exc}", file=sys.stderr)
        return 2
    print(f"sparsepatch validate: {what}, {device}; config {config if config is not None else 'auto (recipe)'}",
          flush=True)
    notice = compile_notice(device)
    if notice:
        print(notice, flush=True)
    report = sp.validate(target, config, seed=args.seed, measure_speed=not args.no_speed,
                         progress=progress_printer(), **kwargs)
    print(report.summary())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.to_json(out / "report.json")
    fig = report.plot(out / "report.png")
    import matplotlib.pyplot as plt
    plt.close(fig)
    print(f"wrote {out / 'report.json'} and {out / 'report.png'}")
    return 0


# --- bench ----------------------------------------------------------------------------------------------------------

def _cannot_run_here(need) -> str | None:
    """Why a benchmark needing `need` cannot run on this machine, or None."""
    if need is None:
        return None
    if need == "torchrun":
        if "WORLD_SIZE" in os.environ:
            return None
        return ("launched by torchrun on 2+ GPUs: torchrun --nproc-per-node N benchmarks/bench_parallel_step.py "
                "(--cpu --shape tiny: a gloo smoke test)")
    import torch
    if not torch.cuda.is_available():
        return "needs a CUDA GPU, and torch.cuda.is_available() is False here (H100 numbers: BENCHMARKS.md)"
    if need == "sm_90" and torch.cuda.get_device_capability() != (9, 0):
        return (f"needs a Hopper GPU (sm_90), this is {torch.cuda.get_device_name()} "
                f"(sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    return None


def bench_list(stream=None) -> None:
    stream = stream or sys.stdout
    print(f"usage: {PROG} bench <name> [options]   ({PROG} bench <name> --help: that benchmark's options)\n"
          "benchmarks (source checkout: benchmarks/bench_<name>.py, results quoted in BENCHMARKS.md):", file=stream)
    width = max(map(len, BENCHES))
    for name, (line, need) in BENCHES.items():
        needs = {None: "", "cuda": "  [CUDA]", "sm_90": "  [Hopper GPU]", "torchrun": "  [torchrun, 2+ GPUs]"}[need]
        print(f"  {name:<{width}}  {line}{needs}", file=stream)


@contextlib.contextmanager
def _prog_name(prog: str):
    """argparse names a parser built without prog after sys.argv[0] (and, from Python 3.14, after `python -m
    <__main__'s package>`): point both at `prog` while a benchmark's main() builds its parser."""
    main = sys.modules.get("__main__")
    saved_argv0, saved_spec = sys.argv[0], getattr(main, "__spec__", None)
    sys.argv[0] = prog
    if main is not None and saved_spec is not None:
        main.__spec__ = None
    try:
        yield
    finally:
        sys.argv[0] = saved_argv0
        if main is not None and saved_spec is not None:
            main.__spec__ = saved_spec


def bench(args) -> int:
    argv = list(args.args)
    if not argv or argv[0] in ("-h", "--help"):
        bench_list()
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHES:
        print(f"{PROG} bench: unknown benchmark {name!r}", file=sys.stderr)
        bench_list(sys.stderr)
        return 2
    path = BENCHMARKS / f"bench_{name}.py"
    if not path.is_file():
        print(f"{PROG} bench: the benchmark scripts ship with the source checkout, not the installed package "
              f"(looked for {path}); run `{PROG} bench {name}` from a clone of the repository", file=sys.stderr)
        return 2
    wants_help = any(a in ("-h", "--help") for a in rest)
    why = None if wants_help else _cannot_run_here(BENCHES[name][1])
    if why:
        print(f"{PROG} bench {name}: cannot run here: {why}", file=sys.stderr)
        return EXIT_CANNOT_RUN_HERE
    sys.path.insert(0, str(BENCHMARKS))   # the scripts share benchmarks/common.py
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with _prog_name(f"{PROG} bench {name}"):
        try:
            return module.main(rest) or 0
        except SystemExit as exc:       # argparse's --help / usage errors inside the benchmark
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


# --- parser ---------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, formatter_class=HelpFormatter,
                                     description=f"sparsepatch from the command line ({PROG} <command> --help: "
                                                 "that command's options)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,validate,bench}")

    tr, rnd = DEMO_DEFAULTS["trained"], DEMO_DEFAULTS["random"]

    def default(key):
        cpu = DEMO_CPU["trained"].get(key)
        return f"default {tr[key]}" + (f" ({cpu} on a CPU)" if cpu is not None else "") + f"; --random: {rnd[key]}"
    p = sub.add_parser("demo", formatter_class=HelpFormatter,
                       help="dense vs skip lists on the committed trained tiny video model (no download)",
                       description="Sample the committed trained tiny Wan denoiser dense and with SkipConfig,\n"
                                   "and print per step the density, the attention cos-sim against dense attention\n"
                                   "and the PSNR / SSIM of the latents against the dense run, then the timings and\n"
                                   "a verdict. No download; runs on a CPU (a quality check there) or a GPU.")
    p.add_argument("--random", action="store_true",
                   help="a random-weight tiny WanPipeline (sharpened attention) instead of the trained model")
    p.add_argument("--steps", type=int, help="denoising steps; " + default("steps"))
    p.add_argument("--size", type=int, help="video height = width in pixels, multiple of 16 (trained model: "
                   "latent size = size / 8); " + default("size"))
    p.add_argument("--frames", type=int, help="frames, 4k + 1 (trained model: k + 1 latent frames); "
                   + default("frames"))
    p.add_argument("--threshold", type=float, help="skip threshold, log2 units; " + default("threshold"))
    p.add_argument("--warmup", type=int, help="dense warm-up steps; " + default("warmup"))
    p.add_argument("--tile", type=int, help="skip tile edge in tokens (the GPU kernels: 64 or 128); "
                   + default("tile"))
    p.add_argument("--batch", type=int, help="trained model: clips per call, prompted with classes 0, 1, ...; "
                   + default("batch"))
    p.add_argument("--model-path", help="trained model: a train_tiny_video output dir (default: the committed "
                   "sparsepatch/assets/tiny_video_d64; sparsepatch/assets/tiny_video is the older head-dim-32 model)")
    p.add_argument("--attention-gain", type=float, default=100.0,
                   help="--random: factor on the q/k logits (random weights attend almost uniformly)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is available")
    p.add_argument("--json", help="also write the report as JSON to this file")
    p.add_argument("--plot", help="also save the density / cos-sim plot to this PNG file")
    p.set_defaults(fn=demo)

    p = sub.add_parser("validate", formatter_class=HelpFormatter,
                       help="dense vs a config on your saved model directory; report JSON + plot",
                       description="Run your model dense and patched with a config (same seed), compare every\n"
                                   "attention call with dense attention and the outputs (PSNR, SSIM for images and\n"
                                   "video, cos-sim), time both, and write report.json + report.png to --out.\n\n"
                                   + load_model_dir.__doc__.split("\n", 1)[1].replace("    ", ""),
                       epilog=f"examples:\n  {PROG} validate ./my_wan_pipeline --config skip --threshold -5 "
                              "--steps 20 --frames 33\n"
                              f"  {PROG} validate ./my_llm --config '{{\"type\": \"nsa\", \"block_size\": 64}}' "
                              "--seq-len 8192")
    p.add_argument("model_dir", metavar="MODEL_DIR",
                   help="a saved diffusers pipeline (model_index.json) or transformers model (config.json)")
    p.add_argument("--config", default="auto",
                   help=f"one of {', '.join(CONFIG_TYPES)} (auto: the recipe for the model class), a JSON file or "
                        "a JSON object such as '{\"type\": \"skip\", \"threshold\": -5, \"tile\": [128, 128]}'")
    p.add_argument("--threshold", type=float, help="skip: threshold in log2 units (< 0); default: the config's (-5)")
    p.add_argument("--warmup", type=int, help="skip: dense warm-up steps; default: the config's (1)")
    p.add_argument("--tile", type=int, help="skip: square tile edge in tokens; default: the config's (128)")
    p.add_argument("--prompt", help=f"pipelines: the prompt (default {DEFAULT_PROMPT!r}); LLMs: tokenized with the "
                   "directory's tokenizer (if it has one) instead of --seq-len random ids")
    p.add_argument("--negative-prompt", help="pipelines: negative prompt (where the pipeline takes one)")
    p.add_argument("--steps", type=int, default=10, help="pipelines: num_inference_steps")
    p.add_argument("--height", type=int, help="pipelines: height in pixels (tiny video denoiser: latent size); "
                   "default: the pipeline's")
    p.add_argument("--width", type=int, help="pipelines: width in pixels; default: the pipeline's")
    p.add_argument("--frames", type=int, help="video pipelines: num_frames (tiny video denoiser: latent frames); "
                   "default: the pipeline's")
    p.add_argument("--guidance", type=float, help="pipelines: guidance_scale; default: the pipeline's")
    p.add_argument("--batch", type=int, default=1, help="LLMs: sequences; tiny video denoiser: clips")
    p.add_argument("--seq-len", type=int, default=256, help="LLMs: tokens per sequence (random ids, seeded)")
    p.add_argument("--call", help="extra call arguments as a JSON object, e.g. '{\"max_sequence_length\": 64}'")
    p.add_argument("--seed", type=int, default=0, help="seed of the generator / token ids, the same for both runs")
    p.add_argument("--no-speed", action="store_true",
                   help="skip the two timed runs (quality only: half the time)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is available")
    p.add_argument("--out", default="sparsepatch_validate", help="directory for report.json and report.png")
    p.set_defaults(fn=validate_cmd)

    p = sub.add_parser("bench", add_help=False, formatter_class=HelpFormatter,
                       help="list the GPU benchmarks, or run one: bench <name> [its options]; "
                            "bench <name> --help for them")
    p.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(fn=bench)
    return parser


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    parser = build_parser()
    # `bench` passes everything after it to the benchmark (parse_known_args: `bench --help` lists them)
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "bench":
        args.args = unknown + list(args.args)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
