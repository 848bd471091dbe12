"""Helpers shared by the benchmark scripts: device short name and the fixed random skip lists they time."""
from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def gpu_name() -> str:
    """Short lowercase device name for result file names (h100, h200, ...)."""
    name = torch.cuda.get_device_name().lower()
    for short in ("h200", "h100", "a100", "b200", "l40", "a10"):
        if short in name:
            return short
    return name.replace(" ", "-")


def random_list(B, H, S, density, tile=(128, 128), seed=0, device="cuda"):
    """Fixed random SkipList with round(density * Tk) tiles per row (at least 1), diagonal always included."""
    from sparsepatch.kernels.skiplist import SkipList, num_tiles
    tm, tn = tile
    tq, tk = num_tiles(S, tm), num_tiles(S, tn)
    g = torch.Generator(device=device).manual_seed(seed)
    score = torch.rand(B, H, tq, tk, generator=g, device=device)
    diag = (torch.arange(tq, device=device) * tm // tn).clamp(max=tk - 1)
    score[:, :, torch.arange(tq, device=device), diag] = 2.0
    n = max(1, round(density * tk))
    top = score.topk(n, dim=-1).indices
    mask = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, top, True)
    return SkipList.from_mask(mask, tile, S, S)
