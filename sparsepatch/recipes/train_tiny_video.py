"""Train the tiny reference video denoiser committed under `sparsepatch/assets/tiny_video` (fixed seeds).

    # the committed run (H100, 211 s wall, bf16 autocast; training_info.json records it):
    ACCELERATE_MIXED_PRECISION=bf16 PYTHONPATH=. python -m sparsepatch.recipes.train_tiny_video --num-workers 5
    PYTHONPATH=. python -m sparsepatch.recipes.train_tiny_video --max-steps 5 --batch-size 2 --output-dir /tmp/tv  # smoke

The defaults are the committed run: 4000 steps x 32 clips, AdamW lr 1e-3, 200 warm-up steps then cosine decay,
10% condition dropout, class colours with jitter 0.3; seed SEED for the weights, the data and the noise.

A thin wrapper over `finetune_video` (dense config, rectified flow on `data.ProceduralClips`): it builds a
WanTransformer3DModel of `TINY_VIDEO_CONFIG` with a fixed seed, saves it as the initial weights and runs
`finetune_video.main(["--model-path", init, ...])`. The point of the model is attention STRUCTURE (local in
space and time after training), so it spends its budget on latent tokens (frames x H/2 x W/2) rather than width:
4 layers, 4 heads x head_dim 32, ffn 512 (1.21 M params), latents (4, FRAMES, LATENT_SIZE, LATENT_SIZE).

What makes it generate from pure noise (issue 8; BENCHMARKS.md "Video" sweep notes have the numbers):
- the prompt fixes the clip's colour (`--colour-jitter 0.3`, `data.render_clip`). With a random colour per clip
  the class-conditional mean is exactly zero (colour c and -c are equally likely) and a model this small never
  breaks that symmetry: the same run with random colours samples clips of amplitude 0.06-0.57 (data: 1.0) over
  shift {1, 3} x guidance {1, 2, 3, 5}, failing 4-5 of the 6 statistics;
- classifier-free guidance: `--cond-dropout 0.1` trains the unconditional velocity (all-zero text), the sampler
  uses guidance scale 2 and timestep shift 3 (`--sample-guidance`, `--sample-shift`, recorded in
  training_info.json "sampler", read by `testing.trained_video_call_kwargs`). Without guidance the samples stay
  too faint (amplitude ~0.65 of the data's at 6 steps); scale 3 gives amplitude 1.0 but amplifies the skip
  lists' attention error in v = v(null) + w (v(text) - v(null)) (-2 dB PSNR vs dense at the same density);
- 4 layers / ffn 512 instead of 2 / 256: mean loss of the last 50 steps 0.28; 2 / 256 on the same data and batch
  was at 0.35 after 3000 steps (both runs in BENCHMARKS.md). It costs the CPU demo: 4 layers x 2 guidance branches
  are 4x the attention calls of the old 2-layer model without guidance.

`load_trained()` returns the committed model (eval mode, fp32, unpatched) for the notebooks and tests.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny_video"

# heads x head_dim, layers, ffn; text_dim matches data.class_text_embeddings(text_dim=64)
TINY_VIDEO_CONFIG = dict(patch_size=(1, 2, 2), in_channels=4, out_channels=4, cross_attn_norm=True,
                         rope_max_seq_len=64, num_attention_heads=4, attention_head_dim=32, num_layers=4,
                         ffn_dim=512, text_dim=64, freq_dim=64)
FRAMES = 8          # latent frames
LATENT_SIZE = 24    # latent H = W -> 12 x 12 tokens per frame, 8 * 144 = 1152 tokens
TEXT_LEN = 8
SEED = 0

# The model at the GPU kernels' tile sizes (issue 26): head dim 64, so the Triton/Gluon skip kernels serve it, and
# 16 latent frames x 16 x 16 tokens = 4096 tokens per clip, so a 64- or 128-token tile is a few rows of one frame.
KERNEL_VIDEO_DIR = ASSET_DIR.parent / "tiny_video_d64"
PRESETS = {
    "tiny": dict(config=TINY_VIDEO_CONFIG, frames=FRAMES, latent_size=LATENT_SIZE, output_dir=ASSET_DIR),
    "d64": dict(config=dict(TINY_VIDEO_CONFIG, attention_head_dim=64, ffn_dim=1024),
                frames=16, latent_size=32, output_dir=KERNEL_VIDEO_DIR, save_dtype="float16"),
}



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparsepatch.recipes.train_tiny_video", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="tiny: the committed head-dim-32 model (1152 tokens); d64: head dim 64, 4096 tokens "
                        "(sparsepatch/assets/tiny_video_d64)")
    p.add_argument("--max-steps", type=int, default=4000)
    p.add_argument("--max-minutes", type=float, default=0.0, help="wall-clock budget of the loop; 0: none")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--frames", type=int, default=None, help="latent frames (default: the preset's)")
    p.add_argument("--latent-size", type=int, default=None, help="latent H = W (default: the preset's)")
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine")
    p.add_argument("--lr-warmup", type=int, default=200)
    p.add_argument("--num-workers", type=int, default=0, help="data-loader processes drawing the clips")
    p.add_argument("--output-dir", default=None, help="default: the preset's asset directory")
    p.add_argument("--init-from", default=None,
                   help="start from these saved weights (save_pretrained directory) instead of seeded random ones")
    p.add_argument("--log-every", type=int, default=25)
    # training objective (finetune_video's options; defaults = the plain rectified-flow objective)
    p.add_argument("--t-dist", choices=("uniform", "logit-normal"), default="uniform")
    p.add_argument("--t-shift", type=float, default=1.0)
    p.add_argument("--cond-dropout", type=float, default=0.1)
    p.add_argument("--colour-jitter", type=float, default=0.3, help="negative: random colour per clip")
    # architecture overrides of TINY_VIDEO_CONFIG
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--ffn-dim", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    # the sampler settings recorded with the weights (training does not use them; testing.trained_video_call_kwargs
    # reads them from training_info.json): Euler timestep shift and classifier-free guidance scale
    p.add_argument("--sample-shift", type=float, default=3.0)
    p.add_argument("--sample-guidance", type=float, default=2.0)
    return p


def model_config(layers=None, heads=None, ffn_dim=None, head_dim=None, base: dict | None = None) -> dict:
    """`base` (default TINY_VIDEO_CONFIG) with the given overrides (None: keep)."""
    cfg = dict(base or TINY_VIDEO_CONFIG)
    for key, value in (("num_layers", layers), ("num_attention_heads", heads), ("ffn_dim", ffn_dim),
                       ("attention_head_dim", head_dim)):
        if value is not None:
            cfg[key] = value
    return cfg


def build_initial(path: str, config: dict | None = None, init_from: str | None = None):
    """Initial weights saved to `path` (save_pretrained): those saved in `init_from` (to resume a run), else random
    weights of `config` (default TINY_VIDEO_CONFIG) from SEED."""
    import torch
    from diffusers import WanTransformer3DModel
    if init_from:
        model = WanTransformer3DModel.from_pretrained(init_from, torch_dtype=torch.float32)
    else:
        torch.manual_seed(SEED)
        model = WanTransformer3DModel(**(config or TINY_VIDEO_CONFIG))
    model.save_pretrained(path)
    return model


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    from . import finetune_video
    preset = PRESETS[args.preset]
    frames = args.frames or preset["frames"]
    latent_size = args.latent_size or preset["latent_size"]
    output_dir = args.output_dir or str(preset["output_dir"])
    config = model_config(args.layers, args.heads, args.ffn_dim, args.head_dim, base=preset["config"])
    objective = ["--t-dist", args.t_dist, "--t-shift", str(args.t_shift), "--cond-dropout", str(args.cond_dropout)]
    colour_jitter = None if args.colour_jitter is None or args.colour_jitter < 0 else args.colour_jitter
    if colour_jitter is not None:
        objective += ["--colour-jitter", str(colour_jitter)]
    result = finetune_video.train_from_initial(
        "sparsepatch.recipes.train_tiny_video", argv, lambda path: build_initial(path, config, args.init_from),
        finetune_video.main,
        ["--config", "dense", "--max-steps", str(args.max_steps), "--max-minutes", str(args.max_minutes),
         "--batch-size", str(args.batch_size),
         "--lr", str(args.lr), "--seed", str(SEED), "--frames", str(frames),
         "--latent-size", str(latent_size), "--text-len", str(TEXT_LEN), "--output-dir", output_dir,
         "--log-every", str(args.log_every), "--lr-schedule", args.lr_schedule, "--lr-warmup", str(args.lr_warmup),
         "--num-workers", str(args.num_workers), *objective],
        output_dir, tail=50, frames=frames, latent_size=latent_size, text_len=TEXT_LEN, preset=args.preset,
        init_from=args.init_from,
        batch_size=args.batch_size, lr=args.lr, lr_schedule=args.lr_schedule, t_dist=args.t_dist,
        t_shift=args.t_shift, cond_dropout=args.cond_dropout, colour_jitter=colour_jitter,
        sampler={"shift": args.sample_shift, "guidance_scale": args.sample_guidance},
        mixed_precision=os.environ.get("ACCELERATE_MIXED_PRECISION", "no"))
    if preset.get("save_dtype") and output_dir:
        # fp16 halves the committed file; load_trained casts back to fp32 (or the dtype asked for).
        import torch
        result["model"].to(getattr(torch, preset["save_dtype"])).save_pretrained(output_dir)
        info_file = Path(output_dir) / "training_info.json"
        record = dict(json.loads(info_file.read_text()), weights_dtype=preset["save_dtype"])
        info_file.write_text(json.dumps(record, indent=1))
        result["info"] = record
    return result


def load_trained(path: str | os.PathLike | None = None, dtype=None):
    """The committed tiny video denoiser (eval mode, unpatched), plus its training info.

    Returns (model, info) where info has "frames", "latent_size", "text_len" (the shapes it was trained on).
    """
    import torch
    from diffusers import WanTransformer3DModel
    path = Path(path) if path is not None else ASSET_DIR
    model = WanTransformer3DModel.from_pretrained(str(path), torch_dtype=dtype or torch.float32).eval()
    info_file = path / "training_info.json"
    info = json.loads(info_file.read_text()) if info_file.exists() else {
        "frames": FRAMES, "latent_size": LATENT_SIZE, "text_len": TEXT_LEN}
    return model, info


if __name__ == "__main__":
    main()
