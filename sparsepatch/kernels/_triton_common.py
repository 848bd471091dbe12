"""Small host-side helpers shared by the Triton kernel modules."""
from __future__ import annotations

import os

import torch
import triton


def interpret() -> bool:
    """True when Triton runs kernels through its interpreter (TRITON_INTERPRET=1: CPU tensors, CI)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _tma_scratch(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def set_tma_allocator() -> None:
    """Device-side TMA descriptors need a scratch allocator. Triton keeps it in a ContextVar, so a flag set once
    would miss other threads (autograd runs CUDA backward on its own thread): set it before every such launch."""
    triton.set_allocator(_tma_scratch)
