"""Plain-PyTorch reference kernels: the semantic oracle for the Triton kernels and the CPU path.

Layout everywhere: q (B, Sq, Hq, D), k/v (B, Sk, Hk, D) with Hq % Hk == 0 (GQA); outputs (B, Sq, Hq, D) in the
input dtype; LSE (B, Hq, Sq) fp32, natural log. Math is done in fp32 (fp64 inputs stay fp64).
"""
from __future__ import annotations

import math

import torch

from .skiplist import DEFAULT_TILE, SkipList, check_tile, num_tiles

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


def _scores(q, k, scale, attn_mask, causal):
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


def _softmax_out(s, v, out_dtype, Hq):
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
    s = _scores(q, k, scale, attn_mask, causal)
    out, lse = _softmax_out(s, v, q.dtype, q.shape[2])
    return (out, lse) if return_lse else out


def check_threshold(threshold) -> float:
    threshold = float(threshold)
    if not threshold < 0 or math.isnan(threshold):
        raise ValueError(
            f"threshold must be < 0 (log2 units relative to the running row max: -1 ~ 50%, -5 ~ 3%), got {threshold}"
        )
    return threshold


def must_do_tiles(must_do, Sq: int, Sk: int, tile) -> torch.Tensor | None:
    """Bool (Tq, Tk) of tiles forced by `must_do` token ranges, or None.

    must_do: sequence of half-open token ranges (start, end). A tile is forced when its q-rows or its k-columns
    overlap a range: the range's tokens attend to everything and everything attends to them (joint text+video).
    """
    if must_do is None or len(must_do) == 0:
        return None
    tm, tn = tile
    tq, tk = num_tiles(Sq, tm), num_tiles(Sk, tn)
    rows = torch.zeros(tq, dtype=torch.bool)
    cols = torch.zeros(tk, dtype=torch.bool)
    for rng in must_do:
        try:
            start, end = (int(x) for x in rng)
        except (TypeError, ValueError):
            raise ValueError(f"must_do must be a sequence of (start, end) token ranges, got {must_do!r}") from None
        if start < 0 or end < start:
            raise ValueError(f"must_do range {rng!r} must satisfy 0 <= start <= end")
        if end > start:
            rows[start // tm: num_tiles(min(end, Sq), tm)] |= start < Sq
            cols[start // tn: num_tiles(min(end, Sk), tn)] |= start < Sk
    return rows[:, None] | cols[None, :]


def check_skip_list(skip_list: SkipList, B: int, Hq: int, Sq: int, Sk: int) -> None:
    if not isinstance(skip_list, SkipList):
        raise ValueError(f"skip_list must be a sparsepatch.kernels.SkipList, got {type(skip_list).__name__}")
    tm, tn = skip_list.tile
    want = (B, Hq, num_tiles(Sq, tm), num_tiles(Sk, tn))
    if skip_list.shape != want or skip_list.seq_q != Sq or skip_list.seq_k != Sk:
        raise ValueError(
            f"skip_list has shape {skip_list.shape} for seq ({skip_list.seq_q}, {skip_list.seq_k}) but q/k need "
            f"{want} for seq ({Sq}, {Sk}) with tile {skip_list.tile}"
        )


def skip_attention(q, k, v, skip_list: SkipList | None = None, threshold: float = -5.0, *, scale=None,
                   must_do=None, return_lse: bool = False, tile=DEFAULT_TILE, attn_mask=None):
    """Temporal skip-list attention (DESIGN.md section 5), the oracle for kernels/skip.py.

    Only the tiles in `skip_list` (plus must_do tiles) contribute to the softmax. Tiles are visited in ascending
    k-tile order; a visited tile is kept for the next call iff some row r of its q-tile has
    (tile_max[r] - running_max_before[r]) * scale * log2(e) > threshold; a row's first visited tile is always
    kept; must_do tiles are always computed and kept. skip_list None = every tile (first call), on `tile`.

    Returns (out (B, Sq, Hq, D), next_list) or (out, next_list, lse (B, Hq, Sq) fp32). Differentiable in q, k, v.
    """
    B, Sq, Sk, Hq, Hk, D = check_qkv(q, k, v)
    threshold = check_threshold(threshold)
    if skip_list is None:
        tm, tn = check_tile(tile)
        listed = torch.ones(B, Hq, num_tiles(Sq, tm), num_tiles(Sk, tn), dtype=torch.bool, device=q.device)
    else:
        check_skip_list(skip_list, B, Hq, Sq, Sk)
        tm, tn = skip_list.tile
        listed = skip_list.to_mask().to(q.device)
    tq, tk = listed.shape[2:]
    forced = must_do_tiles(must_do, Sq, Sk, (tm, tn))
    if forced is not None:
        listed = listed | forced.to(q.device)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)

    s = _scores(q, k, scale, attn_mask, False)
    elem = listed.repeat_interleave(tm, 2)[:, :, :Sq].repeat_interleave(tn, 3)[..., :Sk]
    out, lse = _softmax_out(s.masked_fill(~elem, float("-inf")), v, q.dtype, Hq)

    with torch.no_grad():
        pad = tk * tn - Sk
        sp = torch.nn.functional.pad(s.detach(), (0, pad), value=float("-inf")) if pad else s.detach()
        tile_max = sp.reshape(B, Hq, Sq, tk, tn).amax(-1)                       # (B, H, Sq, Tk)
        row_listed = listed.repeat_interleave(tm, 2)[:, :, :Sq]                 # (B, H, Sq, Tk)
        visited_max = tile_max.masked_fill(~row_listed, float("-inf"))
        running = torch.cummax(visited_max, dim=-1).values
        before = torch.cat([torch.full_like(running[..., :1], float("-inf")), running[..., :-1]], dim=-1)
        gain = (tile_max - before) * LOG2E                                       # scale already in s
        keep_row = (gain > threshold) & row_listed                               # nan (-inf - -inf) -> False
        padq = tq * tm - Sq
        if padq:
            keep_row = torch.nn.functional.pad(keep_row, (0, 0, 0, padq), value=False)
        keep = keep_row.reshape(B, Hq, tq, tm, tk).any(3)
        first = listed & (listed.cumsum(-1) == 1)
        keep = keep | first
        if forced is not None:
            keep = keep | forced.to(q.device)
        next_list = SkipList.from_mask(keep, (tm, tn), Sq, Sk)
    return (out, next_list, lse) if return_lse else (out, next_list)


def skip_attention_grads(q, k, v, out, lse, dout, computed, kept=None, *, scale=None):
    """Gradients (dq, dk, dv) of skip attention from the forward's out / lse, walking only `kept` tiles.

    computed: SkipList (or bool (B, Hq, Tq, Tk)) of the tiles the forward computed (must_do included); kept: the
    tiles the backward walks (training mode, SkipConfig(backward=True): the forward's next list), None = all
    computed tiles (then this is the exact gradient of the sparse forward). Probabilities keep the FORWARD's
    normalisation (its lse): dropping a negligible tile drops its terms from the exact gradient, it does not
    renormalise. Same function as skip_backward.attention_backward(extra_skip=...). Returns input-dtype tensors.
    """
    B, Sq, Sk, Hq, Hk, D = check_qkv(q, k, v)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    masks = [m.to_mask() if isinstance(m, SkipList) else m for m in (computed, kept) if m is not None]
    tile = computed.tile if isinstance(computed, SkipList) else None
    if tile is None:
        raise ValueError("computed must be a SkipList (its tile size defines the mask)")
    tm, tn = tile
    walk = masks[0] if len(masks) == 1 else masks[0] & masks[1]
    elem = walk.to(q.device).repeat_interleave(tm, 2)[:, :, :Sq].repeat_interleave(tn, 3)[..., :Sk]
    s = _scores(q, k, scale, None, False)                                     # (B, H, Sq, Sk) scaled
    p = torch.exp(s - lse.to(s.dtype)[..., None]).masked_fill(~elem, 0.0)
    group = Hq // Hk
    vh = v.transpose(1, 2).to(s.dtype).repeat_interleave(group, 1)
    kh = k.transpose(1, 2).to(s.dtype).repeat_interleave(group, 1)
    qh = q.transpose(1, 2).to(s.dtype)
    do = dout.transpose(1, 2).to(s.dtype)
    delta = (do * out.transpose(1, 2).to(s.dtype)).sum(-1, keepdim=True)
    ds = p * (do @ vh.transpose(-1, -2) - delta) * scale
    dq = (ds @ kh).transpose(1, 2)
    dk = (ds.transpose(-1, -2) @ qh).reshape(B, Hk, group, Sk, D).sum(2).transpose(1, 2)
    dv = (p.transpose(-1, -2) @ do).reshape(B, Hk, group, Sk, D).sum(2).transpose(1, 2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
