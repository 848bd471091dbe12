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


def head_major_desc(t: torch.Tensor, block: int):
    """Host TMA descriptor over the (B, H, S, D) view of a (B, S, H, D) tensor with blocks (1, 1, block, D); None
    when unavailable (no TensorDescriptor in this Triton, base or strides not 16-byte aligned). Works under the
    interpreter too."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    esz = t.element_size()
    if t.data_ptr() % 16 or any((t.stride(i) * esz) % 16 for i in range(3)):
        return None
    B, S, H, D = t.shape
    return TensorDescriptor(t, [B, H, S, D], [t.stride(0), t.stride(2), t.stride(1), 1], [1, 1, block, D])
