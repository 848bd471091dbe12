"""Data for the fine-tuning recipes, made locally: no download, deterministic from a seed.

- `ProceduralClips`: latent-space "videos" of moving / rotating shapes, textures and pans, generated on the fly.
  They are drawn directly in a small latent space (C, F, H, W), e.g. (4, 5, 16, 16), the space a Wan denoiser
  works in, so no VAE is needed: the recipes exercise the denoiser's attention (the part sparsepatch changes),
  and a VAE would only add a fixed encoder in front of it. Each clip belongs to one of `NUM_CLASSES` motion
  classes; the class stands in for the prompt: `class_text_embeddings` maps class id -> a fixed random text
  embedding (text_len, text_dim), like a frozen text encoder would for a fixed caption.
- `TextCorpus`: a byte-level language-modelling corpus from local files (by default the Python sources of a
  stdlib package, e.g. `json`), tokenised as raw UTF-8 bytes (vocab 256 + BOS/EOS/PAD) with no tokenizer to fetch.
"""
from __future__ import annotations

import importlib
import math
import os
from pathlib import Path

import torch
from torch.utils.data import Dataset

# --- procedural latent clips ----------------------------------------------------------------------------------
CLASS_NAMES = ("moving_disk", "rotating_bar", "panning_texture", "moving_square", "expanding_ring",
               "rotating_checker", "drifting_blobs", "panning_stripes")
NUM_CLASSES = len(CLASS_NAMES)


def class_text_embeddings(num_classes: int = NUM_CLASSES, text_len: int = 8, text_dim: int = 16,
                          seed: int = 0) -> torch.Tensor:
    """Fixed random text embeddings, fp32 (num_classes, text_len, text_dim), unit variance; same seed, same table."""
    g = torch.Generator().manual_seed(10_007 + seed)
    return torch.randn(num_classes, text_len, text_dim, generator=g)


def _grid(frames: int, size: int):
    """Frame index t (F, 1, 1) and pixel coordinates y, x (1, H, W) in [-1, 1]."""
    c = torch.linspace(-1.0, 1.0, size)
    y, x = torch.meshgrid(c, c, indexing="ij")
    t = torch.arange(frames, dtype=torch.float32)[:, None, None]
    return t, y[None], x[None]


def class_colour(class_id: int, channels: int = 4) -> torch.Tensor:
    """The fixed colour direction of a class, fp32 (channels,): a seeded Gaussian draw (same id, same colour)."""
    return torch.randn(channels, generator=torch.Generator().manual_seed(20_011 + class_id % NUM_CLASSES))


def render_clip(class_id: int, frames: int = 5, size: int = 16, channels: int = 4,
                generator: torch.Generator | None = None, colour_jitter: float | None = None) -> torch.Tensor:
    """One latent clip, fp32 (channels, frames, size, size), roughly zero mean and unit scale.

    A scalar field per frame (the shape / texture of `class_id`, with random position, speed, angle, frequency)
    times a colour vector over the latent channels (norm sqrt(channels)), plus a little noise texture.
    colour_jitter None: the colour is a random direction per clip (the prompt says nothing about it); a float j:
    the class's fixed colour (`class_colour`) plus j times a random vector, so the prompt fixes the colour up to
    j, as a caption naming a colour would (a tiny denoiser can then generate from noise: it does not have to break
    the colour's sign and direction symmetry on its own). Both draw the same numbers from `generator`.
    """
    g = generator if generator is not None else torch.Generator().manual_seed(0)

    def u(lo, hi):  # one uniform draw from the clip's generator
        return lo + (hi - lo) * float(torch.rand((), generator=g))

    t, y, x = _grid(frames, size)
    speed = u(0.08, 0.25)
    heading = u(0.0, 2 * math.pi)
    vx, vy = speed * math.cos(heading), speed * math.sin(heading)
    cx, cy = u(-0.5, 0.5) + vx * t, u(-0.5, 0.5) + vy * t                # centre trajectory (F, 1, 1)
    omega = u(-0.6, 0.6)                                                  # rad per frame
    angle = u(0.0, math.pi) + omega * t
    freq = u(2.0, 5.0)
    soft = 0.08                                                           # edge softness, in grid units
    name = CLASS_NAMES[class_id % NUM_CLASSES]
    if name == "moving_disk":
        r = u(0.2, 0.45)
        field = torch.sigmoid((r - ((x - cx) ** 2 + (y - cy) ** 2).sqrt()) / soft)
    elif name == "rotating_bar":
        along = (x - cx) * torch.cos(angle) + (y - cy) * torch.sin(angle)
        across = -(x - cx) * torch.sin(angle) + (y - cy) * torch.cos(angle)
        field = torch.sigmoid((0.7 - along.abs()) / soft) * torch.sigmoid((0.15 - across.abs()) / soft)
    elif name == "panning_texture":       # camera pan over a 2D sinusoid texture
        field = torch.sin(freq * (x + vx * t * 3)) * torch.cos(freq * 0.7 * (y + vy * t * 3))
    elif name == "moving_square":
        half = u(0.2, 0.4)
        field = (torch.sigmoid((half - (x - cx).abs()) / soft) * torch.sigmoid((half - (y - cy).abs()) / soft))
    elif name == "expanding_ring":
        r = u(0.1, 0.3) + u(0.05, 0.15) * t
        field = torch.exp(-((((x - cx) ** 2 + (y - cy) ** 2).sqrt() - r) / 0.1) ** 2)
    elif name == "rotating_checker":
        xr = x * torch.cos(angle) + y * torch.sin(angle)
        yr = -x * torch.sin(angle) + y * torch.cos(angle)
        field = torch.tanh(3 * torch.sin(freq * xr) * torch.sin(freq * yr))
    elif name == "drifting_blobs":
        field = torch.zeros(frames, size, size)
        for _ in range(3):
            bx, by, s = u(-0.8, 0.8), u(-0.8, 0.8), u(0.15, 0.35)
            dx, dy = u(-0.2, 0.2), u(-0.2, 0.2)
            field = field + torch.exp(-((x - bx - dx * t) ** 2 + (y - by - dy * t) ** 2) / (2 * s * s))
    else:                                 # panning_stripes: stripes sliding along their normal
        phase = u(0.0, 2 * math.pi)
        field = torch.sin(freq * (x * math.cos(heading) + y * math.sin(heading)) - 1.5 * speed * freq * t + phase)
    field = field - field.mean()
    field = field / field.std().clamp_min(1e-3)
    color = torch.randn(channels, generator=g)
    if colour_jitter is not None:
        base = class_colour(class_id, channels)
        color = base / base.norm().clamp_min(1e-3) + colour_jitter * color / math.sqrt(channels)
    color = color / color.norm().clamp_min(1e-3) * math.sqrt(channels)
    noise = 0.1 * torch.randn(channels, frames, size, size, generator=g)
    return color[:, None, None, None] * field[None] + noise


class ProceduralClips(Dataset):
    """Map-style dataset of `length` virtual clips; item i is the same clip for the same (seed, i), any process.

    Returns {"latents": fp32 (C, F, H, W), "class_id": int64 (), "text": fp32 (text_len, text_dim)}.
    colour_jitter: see `render_clip` (None: random colour per clip).
    Map-style (not iterable) so `accelerator.prepare` shards it across processes with its sampler.
    """

    def __init__(self, length: int = 100_000, frames: int = 5, size: int = 16, channels: int = 4,
                 text_len: int = 8, text_dim: int = 16, seed: int = 0, colour_jitter: float | None = None):
        self.length, self.frames, self.size, self.channels, self.seed = length, frames, size, channels, seed
        self.colour_jitter = colour_jitter
        self.text = class_text_embeddings(NUM_CLASSES, text_len, text_dim, seed)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        class_id = int(torch.randint(NUM_CLASSES, (), generator=g))
        latents = render_clip(class_id, self.frames, self.size, self.channels, generator=g,
                              colour_jitter=self.colour_jitter)
        return {"latents": latents, "class_id": torch.tensor(class_id), "text": self.text[class_id]}


# --- local text corpus ----------------------------------------------------------------------------------------
BYTE_VOCAB = 256
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
VOCAB_SIZE = 259   # 256 byte values + BOS, EOS, PAD


def encode_bytes(text: str) -> list[int]:
    """UTF-8 bytes as token ids 0..255 (a lossless byte-level tokenisation, no vocabulary file)."""
    return list(text.encode("utf-8"))


def decode_bytes(ids) -> str:
    """Inverse of `encode_bytes`; special ids (>= 256) are dropped, invalid UTF-8 replaced."""
    return bytes(int(i) for i in ids if 0 <= int(i) < BYTE_VOCAB).decode("utf-8", errors="replace")


def corpus_files(source: str = "json", suffix: str = ".py") -> list[Path]:
    """Files of the corpus, sorted: `source` is a directory path or an importable package name (its directory)."""
    path = Path(source)
    if not path.is_dir():
        try:
            module = importlib.import_module(source)
        except ImportError as exc:
            raise ValueError(f"corpus: {source!r} is neither a directory nor an importable package") from exc
        if not getattr(module, "__path__", None):
            raise ValueError(f"corpus: {source!r} is a module, not a package directory; pass a package or a path")
        path = Path(list(module.__path__)[0])
    files = sorted(p for p in path.rglob(f"*{suffix}") if p.is_file())
    if not files:
        raise ValueError(f"corpus: no *{suffix} files under {path}")
    return files


class TextCorpus(Dataset):
    """Byte-level causal-LM windows over a local corpus.

    All files are joined into one token stream (each file: BOS, its bytes, EOS). Item i is the window of
    `seq_len` tokens starting at i * stride; `input_ids` int64 (seq_len,), labels = input_ids (the model shifts).
    """

    def __init__(self, source: str = "json", seq_len: int = 128, stride: int | None = None,
                 suffix: str = ".py", max_bytes: int | None = 4_000_000):
        self.files = corpus_files(source, suffix)
        ids: list[int] = []
        for f in self.files:
            ids += [BOS_ID] + encode_bytes(f.read_text(encoding="utf-8", errors="replace")) + [EOS_ID]
            if max_bytes is not None and len(ids) >= max_bytes:
                break
        self.tokens = torch.tensor(ids, dtype=torch.int64)
        self.seq_len = seq_len
        self.stride = stride or seq_len
        if len(self.tokens) < seq_len:
            raise ValueError(f"corpus: {len(self.tokens)} tokens is shorter than seq_len={seq_len}")

    def __len__(self) -> int:
        return (len(self.tokens) - self.seq_len) // self.stride + 1

    def __getitem__(self, i: int) -> dict:
        start = int(i) * self.stride
        window = self.tokens[start:start + self.seq_len]
        return {"input_ids": window, "labels": window.clone()}


def default_corpus() -> str:
    """The default corpus: the `json` stdlib package (small, always installed, plain Python source)."""
    return os.environ.get("SPARSEPATCH_CORPUS", "json")


__all__ = ["CLASS_NAMES", "NUM_CLASSES", "class_colour", "class_text_embeddings", "render_clip", "ProceduralClips", "TextCorpus",
           "encode_bytes", "decode_bytes", "corpus_files", "VOCAB_SIZE", "BOS_ID", "EOS_ID", "PAD_ID",
           "default_corpus"]
