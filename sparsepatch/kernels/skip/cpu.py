"""Skip-list attention on the CPU: the reference's function (same output, same next list) at GEMM speed.

Each q-tile gathers the k/v tiles of its list (padded to the longest list of the call), so the work scales with
the density: one batched Q K^T, a masked softmax and one batched P V per chunk of (batch, head) pairs. The keep
test runs on the tile maxima of the same scores, vectorised over every row and visited tile. Math in fp32 (fp64
for fp64 inputs); the reference computes fp32 inputs in fp64, so a tile whose keep test sits within fp32
rounding of the threshold may differ (random inputs: none observed in the tests).
"""
from __future__ import annotations

import math

import torch

from ..dense.reference import LOG2E, check_qkv
from .reference import check_skip_list, check_threshold, must_do_tiles
from .skiplist import SkipList, check_tile, num_tiles

CHUNK_BYTES = 256 << 20   # scores per chunk of (batch, head) pairs
GATHER_BELOW = 0.75       # gather a q-tile's k/v tiles when the longest list is below this fraction of Tk


def supports_dtype(dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _padded(t, S, T, tile):
    """(B, S, H, D) -> (B, H, T, tile, D), zero rows past S."""
    pad = T * tile - S
    t = t.transpose(1, 2)
    if pad:
        t = torch.nn.functional.pad(t, (0, 0, 0, pad))
    return t.reshape(t.shape[0], t.shape[1], T, tile, t.shape[-1])


def skip_attention(q, k, v, skip_list: SkipList | None = None, threshold: float = -5.0, *, scale=None,
                   must_do=None, return_lse: bool = False, tile=(128, 128)):
    """Same contract as `reference.skip_attention` without attn_mask: (out (B, Sq, Hq, D), next_list[, lse])."""
    B, Sq, Sk, Hq, Hk, D = check_qkv(q, k, v)
    threshold = check_threshold(threshold)
    if skip_list is None:
        tm, tn = check_tile(tile)
        skip_list = SkipList.full(B, Hq, Sq, Sk, (tm, tn), device=q.device)
    else:
        check_skip_list(skip_list, B, Hq, Sq, Sk)
        tm, tn = skip_list.tile
    Tq, Tk = num_tiles(Sq, tm), num_tiles(Sk, tn)
    listed = skip_list.to_mask().to(q.device)
    forced = must_do_tiles(must_do, Sq, Sk, (tm, tn))
    if forced is not None:
        listed = listed | forced.to(q.device)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32

    # Per (b, h, q-tile): its k-tiles ascending in the first `counts` slots, padded with the last slot's tile.
    counts = listed.sum(-1)                                                  # (B, Hq, Tq)
    C = max(int(counts.max()), 1)
    order = torch.argsort((~listed).to(torch.int8), dim=-1, stable=True)[..., :C]   # listed tiles first, ascending
    slot_ok = torch.arange(C, device=q.device) < counts[..., None]           # (B, Hq, Tq, C)

    qt = _padded(q, Sq, Tq, tm).to(compute)                                  # (B, Hq, Tq, tm, D)
    kt = _padded(k, Sk, Tk, tn)                                              # (B, Hk, Tk, tn, D)
    vt = _padded(v, Sk, Tk, tn)
    group = Hq // Hk
    col_ok_tile = (torch.arange(Tk * tn, device=q.device) < Sk).reshape(Tk, tn)   # partial last k-tile
    row_ok = (torch.arange(Tq * tm, device=q.device) < Sq).reshape(Tq, tm)

    out = q.new_empty((B, Hq, Tq, tm, v.shape[-1]), dtype=compute)
    lse = torch.empty((B, Hq, Tq, tm), dtype=torch.float32, device=q.device)
    keep = torch.zeros((B, Hq, Tq, Tk), dtype=torch.bool, device=q.device)
    gather = C < Tk * GATHER_BELOW
    all_tiles = torch.arange(Tk, device=q.device)
    per_pair = Tq * tm * (C if gather else Tk) * tn * (8 if compute == torch.float64 else 4)
    pairs = [(b, h) for b in range(B) for h in range(Hq)]
    step = max(1, CHUNK_BYTES // max(per_pair, 1))
    for c0 in range(0, len(pairs), step):
        chunk = pairs[c0:c0 + step]
        bi = torch.tensor([p[0] for p in chunk], device=q.device)
        hi = torch.tensor([p[1] for p in chunk], device=q.device)
        n = len(chunk)
        qc = qt[bi, hi]                                                      # (n, Tq, tm, D)
        kc, vc = kt[bi, hi // group], vt[bi, hi // group]                    # (n, Tk, tn, D)
        if gather:
            idx = order[bi, hi]                                              # (n, Tq, C)
            ok = slot_ok[bi, hi]                                             # (n, Tq, C)
            sel = torch.arange(n, device=q.device)[:, None, None]
            kg = kc[sel, idx].reshape(n, Tq, C * tn, D).to(compute)          # (n, Tq, C * tn, D)
            vg = vc[sel, idx].reshape(n, Tq, C * tn, -1).to(compute)
            s = torch.matmul(qc, kg.transpose(-1, -2)) * scale              # (n, Tq, tm, C * tn)
        else:   # dense enough: one GEMM against every key, unlisted tiles masked (no gathered copies)
            idx = all_tiles.expand(n, Tq, Tk)
            ok = listed[bi, hi]
            s = torch.matmul(qc.reshape(n, 1, Tq * tm, D), kc.reshape(n, 1, Tk * tn, D).to(compute)
                             .transpose(-1, -2)).reshape(n, Tq, tm, Tk * tn) * scale
        cols = idx.shape[-1] * tn
        col_ok = (ok[..., None] & col_ok_tile[idx]).reshape(n, Tq, 1, cols)
        s = s.masked_fill(~col_ok, float("-inf"))
        # keep test (DESIGN.md section 5) on tile maxima in visiting order
        tile_max = s.reshape(n, Tq, tm, -1, tn).amax(-1)                    # (n, Tq, tm, slots)
        running = torch.cummax(tile_max, dim=-1).values
        before = torch.cat([torch.full_like(running[..., :1], float("-inf")), running[..., :-1]], dim=-1)
        gain = (tile_max - before) * LOG2E
        keep_slot = ((gain > threshold) & row_ok[None, :, :, None]).any(2) & ok   # (n, Tq, C)
        keep_slot |= ok & (ok.cumsum(-1) == 1)                                # a row's first visited tile
        kk = torch.zeros((n, Tq, Tk), dtype=torch.bool, device=q.device)
        kk.scatter_(-1, idx.long(), keep_slot)       # a row's slots hold distinct tiles; padded slots write False
        keep[bi, hi] = kk
        # softmax over the gathered columns; rows with no finite score give 0 (lse -inf)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(s - m)
        total = e.sum(-1, keepdim=True)
        if gather:
            o = torch.matmul(e, vg)
        else:
            o = torch.matmul(e.reshape(n, 1, Tq * tm, Tk * tn), vc.reshape(n, 1, Tk * tn, -1).to(compute))
            o = o.reshape(n, Tq, tm, -1)
        o = o / torch.where(total > 0, total, torch.ones_like(total))
        out[bi, hi] = o
        lse[bi, hi] = (m + torch.log(total)).squeeze(-1).to(torch.float32)
    if forced is not None:
        keep |= forced.to(q.device)
    out = out.reshape(B, Hq, Tq * tm, -1)[:, :, :Sq].transpose(1, 2).to(q.dtype)
    nxt = SkipList.from_mask(keep, (tm, tn), Sq, Sk)
    if return_lse:
        return out, nxt, lse.reshape(B, Hq, Tq * tm)[..., :Sq]
    return out, nxt
