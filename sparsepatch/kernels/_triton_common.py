"""Small helpers shared by the Triton kernel modules (host side, and one jit function)."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def interpret() -> bool:
    """True when Triton runs kernels through its interpreter (TRITON_INTERPRET=1: CPU tensors, CI)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device) -> int:
    """Streaming multiprocessors of a CUDA device (queried once per device)."""
    d = torch.device(device)
    return _sm_count(d.index if d.index is not None else torch.cuda.current_device())


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


@triton.jit
def key_range(start_m, Sk, causal_off, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys a q-tile starting at row start_m visits: (hi, hi_full) = end of the visited keys (exclusive) and end of
    the key blocks needing no mask (a multiple of BLOCK_N). Causal: query i sees keys <= i + causal_off."""
    if CAUSAL:
        hi = tl.maximum(tl.minimum(Sk, start_m + BLOCK_M + causal_off), 0)
        hi_full = tl.minimum(tl.maximum(start_m + causal_off + 1, 0), hi) // BLOCK_N * BLOCK_N
    else:
        hi = Sk
        hi_full = Sk // BLOCK_N * BLOCK_N
    return hi, hi_full
