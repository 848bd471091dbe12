"""Attention kernels: tensors in, tensors out. Nothing here knows what a model is.

`attention` / `skip_attention` run the bundled Triton kernels on CUDA tensors when they support the inputs and
the plain-PyTorch reference otherwise (CPU, fp32/fp64, unsupported head dims — the latter with a warning).
Call `sparsepatch.kernels.skip.skip_attention` directly to force the Triton kernel (TRITON_INTERPRET=1 on CPU).
"""
from __future__ import annotations

import importlib
import logging

import torch

from . import lightning_reference, nsa_reference, reference
from .nsa_reference import NSACache
from .skiplist import DEFAULT_TILE, SkipList

logger = logging.getLogger(__name__)

__all__ = ["SkipList", "DEFAULT_TILE", "NSACache", "attention", "attention_fp8", "skip_attention", "nsa_attention", "lightning_decode",
           "lightning_prefill", "reference"]


def _triton_module(name: str):
    """The Triton implementation module `name`, or None when it (or Triton) is not available."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError as exc:  # no triton on this platform, or the kernel has not landed
        logger.debug("sparsepatch.kernels.%s unavailable: %s", name, exc)
        return None


def _use_triton(module, q, **kw) -> bool:
    return module is not None and q.is_cuda and module.supports(q, **kw)


_WARNED: set = set()


def _warn_reference_once(q, attn_mask) -> None:
    key = (q.shape[-1], q.dtype, attn_mask is not None)
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning("sparsepatch: no Triton kernel for head dim %d, %s%s; using the PyTorch reference (slow)",
                       q.shape[-1], q.dtype, " with an attention mask" if attn_mask is not None else "")


def attention(q, k, v, *, causal: bool = False, scale=None, attn_mask=None, return_lse: bool = False):
    """Dense attention. q (B, Sq, Hq, D), k/v (B, Sk, Hk, D) -> (B, Sq, Hq, D) [, lse (B, Hq, Sq) fp32]."""
    # Head dims 64/128: the skip kernel with skipping compiled out; other head dims up to 1024: split-D kernels.
    for name in ("skip", "dense"):
        mod = _triton_module(name)
        if _use_triton(mod, q, attn_mask=attn_mask, causal=causal):
            return mod.attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse)
    if q.is_cuda:
        _warn_reference_once(q, attn_mask)
    return reference.attention(q, k, v, causal=causal, scale=scale, attn_mask=attn_mask, return_lse=return_lse)


def attention_fp8(q, k, v, *, causal: bool = False, scale=None, attn_mask=None, return_lse: bool = False):
    """Low-precision dense attention forward (inference): q (B, Sq, Hq, D), k/v (B, Sk, Hk, D) -> (B, Sq, Hq, D)
    in q's dtype [, lse (B, Hq, Sq) fp32].

    Hopper CUDA, fp16/bf16, D 64/128, no mask: the fp8 Triton kernel (`dense.attention_fp8`, int8 Q K^T + e4m3
    P V). CPU: the reference on q/k/v rounded exactly as the kernel quantizes them (`quantize_fp8_reference`; the
    kernel's e4m3 rounding of P is not modelled). Other CUDA inputs: `attention` (native precision), warned once.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("precision='fp8' attention is inference-only: q/k/v require grad (run under "
                         "torch.no_grad(), or patch with DenseConfig(precision='native') for training)")
    dense = _triton_module("dense")
    if attn_mask is None and dense is not None and dense.fp8_supported(q):
        return dense.attention_fp8(q, k, v, causal=causal, scale=scale, return_lse=return_lse)
    if q.is_cuda or dense is None:
        key = ("fp8", q.shape[-1], q.dtype, q.device.type, attn_mask is not None)
        if key not in _WARNED:
            _WARNED.add(key)
            logger.warning("sparsepatch: no fp8 kernel for head dim %d, %s on %s%s; running native precision",
                           q.shape[-1], q.dtype, q.device.type, " with an attention mask" if attn_mask is not None
                           else "")
        return attention(q, k, v, causal=causal, scale=scale, attn_mask=attn_mask, return_lse=return_lse)
    qd, kd, vd = dense.quantize_fp8_reference(q, k, v, q_block=dense.FP8_CONFIG["block_m"])  # q per program tile
    res = reference.attention(qd, kd, vd, causal=causal, scale=scale, attn_mask=attn_mask, return_lse=return_lse)
    if return_lse:
        return res[0].to(q.dtype), res[1]
    return res.to(q.dtype)


def skip_attention(q, k, v, skip_list=None, threshold: float = -5.0, *, scale=None, must_do=None,
                   return_lse: bool = False, tile=DEFAULT_TILE, attn_mask=None):
    """Temporal skip-list attention; see `reference.skip_attention` for the exact semantics."""
    skip = _triton_module("skip")
    if _use_triton(skip, q, attn_mask=attn_mask, causal=False, tile=tile if skip_list is None else skip_list.tile):
        return skip.skip_attention(q, k, v, skip_list, threshold, scale=scale, must_do=must_do,
                                   return_lse=return_lse, tile=tile)
    return reference.skip_attention(q, k, v, skip_list, threshold, scale=scale, must_do=must_do,
                                    return_lse=return_lse, tile=tile, attn_mask=attn_mask)


def nsa_attention(q, k, v, config, gates=None, cu_seqlens=None, causal: bool = True, cache=None,
                  compress_weights=None, *, scale=None, return_indices: bool = False):
    """Native Sparse Attention (compressed + selected + sliding window, gated); see `nsa_reference`.

    q (B, T, Hq, D), k/v (B, T, Hk, D) -> (B, T, Hq, D). Triton forward and backward (`nsa_backward`) on CUDA
    where `nsa.supports` says so, the reference elsewhere (CPU, fp32, non-causal, unsupported configs).
    """
    tri = _triton_module("nsa")
    impl = tri if _use_triton(tri, q, config=config, causal=causal) else nsa_reference
    return impl.nsa_attention(q, k, v, config, gates=gates, cu_seqlens=cu_seqlens, causal=causal, cache=cache,
                              compress_weights=compress_weights, scale=scale, return_indices=return_indices)


def lightning_decode(q, k, v, state, decay, *, scale=None, out=None, state_layout: str = "bhkv"):
    """One lightning-attention decode step; updates `state` (fp32, or bf16/fp16 storage) in place. See
    `lightning_reference`."""
    tri = _triton_module("lightning")
    impl = tri if _use_triton(tri, q) else lightning_reference
    return impl.lightning_decode(q, k, v, state, decay, scale=scale, out=out, state_layout=state_layout)


def lightning_prefill(q, k, v, decay, *, scale=None, initial_state=None, cu_seqlens=None,
                      state_layout: str = "bhkv", state_dtype=None):
    """Chunked lightning-attention prefill -> (o (B, T, H, V), final state; fp32 unless `state_dtype` or a
    bf16/fp16 initial_state says otherwise). See `lightning_reference`."""
    tri = _triton_module("lightning")
    impl = tri if _use_triton(tri, q) else lightning_reference
    return impl.lightning_prefill(q, k, v, decay, scale=scale, initial_state=initial_state,
                                  cu_seqlens=cu_seqlens, state_layout=state_layout, state_dtype=state_dtype)
