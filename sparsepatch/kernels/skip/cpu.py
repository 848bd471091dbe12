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

BLOCK_BYTES = 4 << 20     # scores per block of q-tiles (cache-sized: the passes over them stay in cache)
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
    lse = torch.empty((B, Hq, Tq, tm), dtype=torch.float32, device=q.device) if return_lse else None
    keep = torch.zeros((B, Hq, Tq, Tk), dtype=torch.bool, device=q.device)
    gather = C < Tk * GATHER_BELOW
    everything = bool(listed.all())          # density 1 without padding columns: no masking pass at all
    all_tiles = torch.arange(Tk, device=q.device)
    cols = (C if gather else Tk) * tn
    # Every tile listed (a first call, density 1): the output is dense attention, so SDPA computes it and the
    # blocks below only run the keep test (one Q K^T GEMM and a max pass instead of a softmax and a second GEMM).
    sdpa_out = everything and not return_lse and not gather
    if sdpa_out:
        dense = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).to(compute), k.transpose(1, 2).to(compute), v.transpose(1, 2).to(compute),
            scale=scale, enable_gqa=group > 1)                               # (B, Hq, Sq, Dv)
    # Blocks of q-tiles whose scores fit in cache: every pass over the scores (max, exp, sum) stays there.
    per_tile = tm * cols * (8 if compute == torch.float64 else 4)
    tiles_per_block = max(1, BLOCK_BYTES // per_tile)
    for b in range(B):
        for h in range(Hq):
            kc, vc = kt[b, h // group], vt[b, h // group]                   # (Tk, tn, D)
            if not gather:
                kf = kc.reshape(Tk * tn, D).to(compute).t()
                vf = vc.reshape(Tk * tn, -1).to(compute)
            for t0 in range(0, Tq, tiles_per_block):
                t1 = min(Tq, t0 + tiles_per_block)
                n = t1 - t0
                qc = qt[b, h, t0:t1] * scale                                 # (n, tm, D), scaled once
                if gather:
                    idx = order[b, h, t0:t1]                                 # (n, C)
                    ok = slot_ok[b, h, t0:t1]
                    kg = kc[idx].reshape(n, C * tn, D).to(compute)
                    vg = vc[idx].reshape(n, C * tn, -1).to(compute)
                    s = torch.matmul(qc, kg.transpose(-1, -2))              # (n, tm, C * tn)
                else:
                    idx = all_tiles.expand(n, Tk)
                    ok = listed[b, h, t0:t1]
                    s = torch.matmul(qc.reshape(n * tm, D), kf).reshape(n, tm, Tk * tn)
                if not (everything and Sk == Tk * tn and not gather):
                    col_ok = (ok[..., None] & col_ok_tile[idx]).reshape(n, 1, cols)
                    s.masked_fill_(~col_ok, float("-inf"))
                # keep test (DESIGN.md section 5) on tile maxima in visiting order
                tile_max = s.reshape(n, tm, -1, tn).amax(-1)                 # (n, tm, slots)
                running = torch.cummax(tile_max, dim=-1).values
                before = torch.cat([torch.full_like(running[..., :1], float("-inf")), running[..., :-1]], dim=-1)
                gain = (tile_max - before).mul_(LOG2E)
                keep_slot = ((gain > threshold) & row_ok[t0:t1, :, None]).any(1) & ok   # (n, slots)
                keep_slot |= ok & (ok.cumsum(-1) == 1)                        # a row's first visited tile
                kk = torch.zeros((n, Tk), dtype=torch.bool, device=q.device)
                kk.scatter_(-1, idx.long(), keep_slot)   # a row's slots hold distinct tiles; padded slots write False
                keep[b, h, t0:t1] = kk
                if sdpa_out:
                    continue
                # softmax (one fused pass); rows with no finite score give 0 and lse -inf
                m = running[..., -1:]                                        # (n, tm, 1): the row max
                if return_lse:
                    lse[b, h, t0:t1] = torch.logsumexp(s, -1).to(torch.float32)
                p = torch.softmax(s, -1)
                empty = m == float("-inf")                                   # NaN rows stay NaN, as the oracle
                if bool(empty.any()):
                    p.masked_fill_(empty, 0.0)
                o = torch.matmul(p, vg) if gather else torch.matmul(p.reshape(n * tm, -1), vf).reshape(n, tm, -1)
                out[b, h, t0:t1] = o
    if forced is not None:
        keep |= forced.to(q.device)
    if sdpa_out:
        out = dense.transpose(1, 2).to(q.dtype)
    else:
        out = out.reshape(B, Hq, Tq * tm, -1)[:, :, :Sq].transpose(1, 2).to(q.dtype)
    nxt = SkipList.from_mask(keep, (tm, tn), Sq, Sk)
    if return_lse:
        return out, nxt, lse.reshape(B, Hq, Tq * tm)[..., :Sq]
    return out, nxt
