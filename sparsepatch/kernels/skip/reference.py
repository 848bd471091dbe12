"""Temporal skip-list attention reference (DESIGN.md section 5): the oracle for every skip backend.

Layout: q (B, Sq, Hq, D), k/v (B, Sk, Hk, D) with Hq % Hk == 0; outputs (B, Sq, Hq, D) in the input dtype; LSE
(B, Hq, Sq) fp32, natural log. Math in fp32 (fp32/fp64 inputs in fp64), as `dense.reference`.
"""
from __future__ import annotations

import math

import torch

from ..dense.reference import LOG2E, check_qkv, scores, softmax_out
from .skiplist import DEFAULT_TILE, SkipList, check_tile, num_tiles


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
    """Temporal skip-list attention (DESIGN.md section 5), the oracle for every skip backend (triton.py, gluon.py, cpu.py).

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

    s = scores(q, k, scale, attn_mask, False)
    elem = listed.repeat_interleave(tm, 2)[:, :, :Sq].repeat_interleave(tn, 3)[..., :Sk]
    out, lse = softmax_out(s.masked_fill(~elem, float("-inf")), v, q.dtype, Hq)

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
    s = scores(q, k, scale, None, False)                                     # (B, H, Sq, Sk) scaled
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
