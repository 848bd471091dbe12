"""Train the tiny reference video denoiser committed under `sparsepatch/assets/tiny_video` (CPU, fixed seeds).

    PYTHONPATH=. python -m sparsepatch.recipes.train_tiny_video            # the committed run (see training_info.json)
    # a 10k-step GPU run (H100: 231 s; loss 0.35 vs 0.84, but NOT adopted, see BENCHMARKS.md "Video" sweep notes):
    PYTHONPATH=. python -m sparsepatch.recipes.train_tiny_video --max-steps 10000 --batch-size 16 --lr 1e-3 \
        --lr-schedule cosine --lr-warmup 200 --num-workers 8 --output-dir /tmp/tiny_video_10k
    PYTHONPATH=. python -m sparsepatch.recipes.train_tiny_video --max-steps 5 --output-dir /tmp/tv   # smoke

A thin wrapper over `finetune_video` (dense config, rectified flow on `data.ProceduralClips`): it builds a
WanTransformer3DModel of `TINY_VIDEO_CONFIG` with a fixed seed, saves it as the initial weights and runs
`finetune_video.main(["--model-path", init, ...])`. The point of the model is attention STRUCTURE (local in
space and time after training), so it spends its budget on latent tokens (frames x H/2 x W/2) rather than depth:
2 layers, 4 heads x head_dim 32, latents (4, FRAMES, LATENT_SIZE, LATENT_SIZE).

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
                         rope_max_seq_len=64, num_attention_heads=4, attention_head_dim=32, num_layers=2,
                         ffn_dim=256, text_dim=64, freq_dim=64)
FRAMES = 8          # latent frames
LATENT_SIZE = 24    # latent H = W -> 12 x 12 tokens per frame, 8 * 144 = 1152 tokens
TEXT_LEN = 8
SEED = 0



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparsepatch.recipes.train_tiny_video", description=__doc__.split("\n")[0])
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--frames", type=int, default=FRAMES)
    p.add_argument("--latent-size", type=int, default=LATENT_SIZE)
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant")
    p.add_argument("--lr-warmup", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=0, help="data-loader processes drawing the clips")
    p.add_argument("--output-dir", default=str(ASSET_DIR))
    p.add_argument("--log-every", type=int, default=25)
    return p


def build_initial(path: str):
    """Random initial weights of TINY_VIDEO_CONFIG from SEED, saved to `path` (save_pretrained)."""
    import torch
    from diffusers import WanTransformer3DModel
    torch.manual_seed(SEED)
    model = WanTransformer3DModel(**TINY_VIDEO_CONFIG)
    model.save_pretrained(path)
    return model


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    from . import finetune_video
    return finetune_video.train_from_initial(
        "sparsepatch.recipes.train_tiny_video", argv, build_initial, finetune_video.main,
        ["--config", "dense", "--max-steps", str(args.max_steps), "--batch-size", str(args.batch_size),
         "--lr", str(args.lr), "--seed", str(SEED), "--frames", str(args.frames),
         "--latent-size", str(args.latent_size), "--text-len", str(TEXT_LEN), "--output-dir", args.output_dir,
         "--log-every", str(args.log_every), "--lr-schedule", args.lr_schedule, "--lr-warmup", str(args.lr_warmup),
         "--num-workers", str(args.num_workers)],
        args.output_dir, tail=50, frames=args.frames, latent_size=args.latent_size, text_len=TEXT_LEN,
        batch_size=args.batch_size, lr=args.lr, lr_schedule=args.lr_schedule)


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
