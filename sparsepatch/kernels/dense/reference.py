"""Dense attention reference: the semantic oracle for every dense backend, and the shared input checks.

Layout everywhere: q (B, Sq, Hq, D), k/v (B, Sk, Hk, D) with Hq % Hk == 0 (GQA); outputs (B, Sq, Hq, D) in the
input dtype; LSE (B, Hq, Sq) fp32, natural log. Math is done in fp32 (fp64 inputs stay fp64).
"""
from __future__ import annotations

import math

import torch


LOG2E = 1.4426950408889634


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """Validate the (B, S, H, D) layout; returns (B, Sq, Sk, Hq, Hk, D)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, S, H, D), got shape {tuple(t.shape)}")
    B, Sq, Hq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"k and v must have batch {B} like q, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[3] != D:
        raise ValueError(f"k head dim {k.shape[3]} must equal q head dim {D}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in (B, S, H)")
    Sk, Hk = k.shape[1], k.shape[2]
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({Hk})")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return B, Sq, Sk, Hq, Hk, D


def scores(q, k, scale, attn_mask, causal):
    """fp32 scores (B, Hq, Sq, Sk), with attn_mask / causality applied as -inf."""
    B, Sq, Sk, Hq, Hk, D = check_qkv(q, k, k)
    # fp32 inputs are computed in fp64 so the oracle is more exact than any fp32 kernel compared against it.
    compute = torch.float64 if q.dtype in (torch.float32, torch.float64) else torch.float32
    qh = q.transpose(1, 2).to(compute)
    kh = k.transpose(1, 2).to(compute)
    if Hq != Hk:
        kh = kh.repeat_interleave(Hq // Hk, dim=1)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.to(compute)
    if causal:
        # Bottom-right aligned: query i sits at key position Sk - Sq + i (decode: Sq=1 sees every key).
        qpos = torch.arange(Sq, device=q.device)[:, None] + (Sk - Sq)
        kpos = torch.arange(Sk, device=q.device)[None, :]
        s = s.masked_fill(kpos > qpos, float("-inf"))
    return s


def softmax_out(s, v, out_dtype, Hq):
    """Softmax over the last axis with fully-masked rows giving 0; returns (out (B,Sq,Hq,D), lse (B,Hq,Sq))."""
    # exp(s - rowmax) / rowsum rather than exp(s - lse): the rounding of lse would scale every p of a row alike
    # (~1e-6 relative in fp32); one exp pass instead of logsumexp's plus ours.
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)                 # fully masked row: every p = exp(-inf) = 0
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(total > 0, total, 1.0)
    lse = (m + torch.log(total)).squeeze(-1)                   # log 0 = -inf for a fully masked row
    vh = v.transpose(1, 2).to(s.dtype)
    if vh.shape[1] != Hq:
        vh = vh.repeat_interleave(Hq // vh.shape[1], dim=1)
    out = torch.matmul(p, vh).transpose(1, 2).to(out_dtype)
    return out, lse.to(torch.float32)


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, attn_mask=None,
              return_lse: bool = False):
    """Dense softmax attention.

    q (B, Sq, Hq, D), k/v (B, Sk, Hk, D). attn_mask: bool (True = attend) or additive float, broadcastable to
    (B, Hq, Sq, Sk). causal: bottom-right aligned. Returns out (B, Sq, Hq, D) [, lse (B, Hq, Sq) fp32].
    """
    check_qkv(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    s = scores(q, k, scale, attn_mask, causal)
    out, lse = softmax_out(s, v, q.dtype, q.shape[2])
    return (out, lse) if return_lse else out
