"""Native Sparse Attention (NSA), plain PyTorch: the semantic oracle for kernels/nsa.py and the CPU path.

Layout: q (B, T, Hq, D), k/v (B, S, Hk, D), Hq % Hk == 0 (GQA group G = Hq // Hk), out (B, T, Hq, D) in q's dtype.
Causal: bottom-right aligned, query i sits at position t = S - T + i (S == T for prefill, T == 1 for decode).
Math is fp64 for fp32/fp64 inputs, fp32 otherwise. Every branch uses the same `scale` (default 1/sqrt(D)).

Three branches, combined as out = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa:

1. Compressed. Compressed block c covers tokens [c*d, c*d + l) (l = compress_block, d = compress_stride); only
   COMPLETE blocks exist (c*d + l <= S). phi = mean over the block, or with `compress_weights` w of shape
   (2, Hk, l) a learnable per-head weighted sum: k_cmp[c, h] = sum_j w[0, h, j] * k[c*d + j, h] (w[1] for v);
   the mean is w = 1/l. Causal: query t sees block c iff c*d + l - 1 <= t (the block ends at or before t: no
   future and no incomplete block). A query that sees no block gets o_cmp = 0.
2. Selected. Selection block j covers tokens [j*b, (j+1)*b) (b = block_size). Importance of block j for query t
   and KV head h: sum over the G query heads of h and over compressed blocks c of p_cmp[t, head, c] * w(c, j),
   where w(c, j) = |[c*d, c*d+l) ∩ [j*b, (j+1)*b)| (tokens of overlap). When l and b are multiples of d this is
   the paper's Eq. 9 (weights (1, 2, ..., 2, 1) * d) with each compressed block counted for the selection blocks
   it actually overlaps. Selection is per KV head (shared by the group's heads): the top `num_selected` visible
   blocks (causal: j <= t // b) by importance, ties to the lower index; the local block (t // b) always wins first,
   block 0 second. Inside selected blocks the causal mask applies (keys <= t).
   config.selection = "token" (default): ranked per query token t. "tile": ranked once per selection tile, the b
   positions of one selection block ([u*b, (u+1)*b)), from the importance of its first position u*b; every token
   of the tile uses that set (it is causal: u*b <= t; the local block and the visible blocks are the same for the
   whole tile). A tile whose first position precedes this call's queries (decode, chunked prefill) takes the set
   from the cache (`NSACache` keeps the last tile's); without one that is an error.
3. Sliding window: causal keys (t - window, t]; non-causal keys [t - window // 2, t - window // 2 + window).

causal=False (DiT self-attention, S == T): every complete compressed block and every selection block is visible,
the local block is the query's own block, selected blocks are unmasked, and the window is centred.

gates: (B, T, Hq, 3) values (sigmoid outputs) for (cmp, slc, swa), or None for uniform 1/3.
cu_seqlens: int (N+1,) offsets of packed sequences (B must be 1, S == T); each sequence is independent.
cache: an `NSACache`; k/v are then only the NEW tokens, appended to the cache, and compressed blocks completed by
them are added incrementally (prefill with an empty cache, then decode one token at a time).
Differentiable in q, k, v, gates and compress_weights (the selection itself is a discrete choice: no gradient).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..dense.reference import check_qkv

__all__ = ["nsa_attention", "NSACache", "compress_kv", "select_blocks", "select_tiles", "num_compressed", "nsa_density",
           "check_config", "check_gates", "check_cu_seqlens", "check_compress_weights", "tile_prior", "FORCE_LOCAL",
           "FORCE_FIRST"]

FORCE_LOCAL = float("inf")   # selection score of the local block (always picked first)
FORCE_FIRST = 3.0e38         # selection score of block 0 (picked second)


# ---------------------------------------------------------------------------------------------------- validation
@dataclass(frozen=True)
class NSAParams:
    """The parameters the NSA kernels read (`sparsepatch.NSAConfig` carries them plus the patcher's options).

    block_size: keys per selection block (and query positions per selection tile); num_selected: blocks each query
    attends to; window: sliding-window length in tokens; compress_block / compress_stride: tokens pooled per
    compressed key and the stride between them; selection: "token" (per query) or "tile" (per selection tile).
    """

    block_size: int = 64
    num_selected: int = 16
    window: int = 512
    compress_block: int = 32
    compress_stride: int = 16
    selection: str = "token"

    def __post_init__(self):
        for name in ("block_size", "num_selected", "window", "compress_block", "compress_stride"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if self.selection not in ("token", "tile"):
            raise ValueError(f"selection must be 'token' or 'tile', got {self.selection!r}")


def check_config(config) -> NSAParams:
    """config as NSAParams: an NSAParams, or any object with its fields (sparsepatch.NSAConfig)."""
    if isinstance(config, NSAParams):
        return config
    try:
        return NSAParams(**{f.name: getattr(config, f.name) for f in dataclasses.fields(NSAParams)})
    except AttributeError:
        raise ValueError(f"config must be a sparsepatch NSAConfig or kernels.NSAParams, got "
                         f"{type(config).__name__}") from None


def check_gates(gates, q):
    if gates is None:
        return None
    if not isinstance(gates, torch.Tensor):
        raise ValueError(f"gates must be a tensor (B, T, Hq, 3) or None, got {type(gates).__name__}")
    want = (*q.shape[:3], 3)
    if tuple(gates.shape) != want:
        raise ValueError(f"gates must have shape (B, T, Hq, 3) = {want}, got {tuple(gates.shape)}")
    if not gates.is_floating_point():
        raise ValueError(f"gates must be floating point (sigmoid values in [0, 1]), got {gates.dtype}")
    if gates.device != q.device:
        raise ValueError(f"gates must be on q's device {q.device}, got {gates.device}")
    return gates


def check_compress_weights(w, config, Hk, q):
    if w is None:
        return None
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"compress_weights must be a tensor (2, Hk, compress_block) or None, got {type(w).__name__}")
    want = (2, Hk, config.compress_block)
    if tuple(w.shape) != want:
        raise ValueError(f"compress_weights must have shape (2, Hk, compress_block) = {want}, got {tuple(w.shape)}")
    if not w.is_floating_point() or w.device != q.device:
        raise ValueError(f"compress_weights must be a floating tensor on {q.device}, got {w.dtype} on {w.device}")
    return w


def check_cu_seqlens(cu_seqlens, q, k):
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        raise ValueError("cu_seqlens must be a 1-D integer tensor of N+1 sequence offsets, got "
                         f"{cu_seqlens if not isinstance(cu_seqlens, torch.Tensor) else (cu_seqlens.dtype, tuple(cu_seqlens.shape))}")
    if q.shape[0] != 1:
        raise ValueError(f"q batch must be 1 with cu_seqlens (sequences packed along T), got {q.shape[0]}")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k length {k.shape[1]} must equal q length {q.shape[1]} with cu_seqlens")
    offs = [int(x) for x in cu_seqlens.tolist()]
    if offs[0] != 0 or offs[-1] != q.shape[1] or any(b < a for a, b in zip(offs, offs[1:])):
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at T={q.shape[1]}, got {offs}")
    return offs


def _check_common(q, k, v, config, gates, cu_seqlens, causal, cache, compress_weights):
    check_config(config)
    B, T, S, Hq, Hk, D = check_qkv(q, k, v)
    if not q.is_floating_point():
        raise ValueError(f"q must be floating point, got {q.dtype}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if cache is not None and not isinstance(cache, NSACache):
        raise ValueError(f"cache must be a sparsepatch NSACache or None, got {type(cache).__name__}")
    if cache is not None and cu_seqlens is not None:
        raise ValueError("cache and cu_seqlens cannot be combined (decode one batch of sequences at a time)")
    if cache is not None and not causal:
        raise ValueError("causal must be True with a cache (decoding is causal)")
    if cache is None:
        if causal and S < T:
            raise ValueError(f"k length {S} must be >= q length {T} (queries are the last T positions)")
        if not causal and S != T:
            raise ValueError(f"causal=False needs k length == q length (self-attention), got {S} and {T}")
    check_gates(gates, q)
    check_compress_weights(compress_weights, config, Hk, q)
    offs = check_cu_seqlens(cu_seqlens, q, k)
    return offs


# ---------------------------------------------------------------------------------------------------- pieces
def num_compressed(S: int, config) -> int:
    """Complete compressed blocks in a sequence of S tokens."""
    l, d = config.compress_block, config.compress_stride
    return 0 if S < l else (S - l) // d + 1


def compress_kv(k, v, config, compress_weights=None, start: int = 0):
    """Compressed keys/values (B, n_c - start, Hk, D) for complete blocks start..n_c-1 (dtype of k)."""
    l, d = config.compress_block, config.compress_stride
    B, S, Hk, D = k.shape
    n = num_compressed(S, config)
    if n <= start:
        e = k.new_zeros((B, 0, Hk, D))
        return e, e.clone()
    a = start * d
    kb = k[:, a:(n - 1) * d + l].unfold(1, l, d)          # (B, n - start, Hk, D, l) view
    vb = v[:, a:(n - 1) * d + l].unfold(1, l, d)
    if compress_weights is None:
        return kb.mean(-1), vb.mean(-1)
    w = compress_weights.to(k.dtype)
    return torch.einsum("bnhdl,hl->bnhd", kb, w[0]), torch.einsum("bnhdl,hl->bnhd", vb, w[1])


def overlap_weights(n_c: int, n_b: int, config, device) -> torch.Tensor:
    """(n_c, n_b) tokens of overlap between compressed block c and selection block j (Eq. 9 generalised)."""
    l, d, b = config.compress_block, config.compress_stride, config.block_size
    c0 = torch.arange(n_c, device=device)[:, None] * d
    j0 = torch.arange(n_b, device=device)[None, :] * b
    return (torch.minimum(c0 + l, j0 + b) - torch.maximum(c0, j0)).clamp(min=0)


def select_tiles(importance: torch.Tensor, qpos: torch.Tensor, config, causal: bool, prior=None) -> torch.Tensor:
    """selection="tile": importance (B, Hk, T, n_b) of T consecutive query positions qpos -> int64 (B, T, Hk,
    num_selected): each query takes the selection of its tile's first position (see `select_blocks`); a tile that
    starts before qpos[0] takes `prior` (B, Hk, num_selected), the selection made when that tile started."""
    bs = config.block_size
    u = torch.div(qpos, bs, rounding_mode="floor")                         # each query's tile
    tiles = torch.arange(int(u[0]), int(u[-1]) + 1, device=qpos.device)     # the tiles this call touches
    first = tiles * bs - qpos[0]                                           # their first query's index (< 0: earlier)
    sel = select_blocks(importance[:, :, first.clamp(min=0)], tiles * bs, config, causal)   # one ranking per tile
    if int(first[0]) < 0:
        if prior is None:
            raise ValueError(f"selection='tile': position {int(qpos[0])} is inside the selection tile starting at "
                             f"{int(tiles[0]) * bs}, whose query is not in this call; start queries at a multiple of "
                             f"block_size={bs} or pass the NSACache that saw that position")
        sel[:, 0] = prior.to(sel.dtype).reshape(sel.shape[0], *sel.shape[2:])
    return sel[:, u - u[0]]


def select_blocks(importance: torch.Tensor, qpos: torch.Tensor, config, causal: bool) -> torch.Tensor:
    """importance (B, Hk, T, n_b) -> int64 (B, T, Hk, num_selected) selected block indices, ascending, -1 padded.

    Candidates: causal j <= qpos // block_size (all blocks otherwise). Order: the local block, block 0, then
    importance descending with ties to the lower index.
    """
    B, Hk, T, n_b = importance.shape
    bs, n_sel = config.block_size, config.num_selected
    cur = (qpos // bs).clamp(max=n_b - 1)
    j = torch.arange(n_b, device=importance.device)
    score = importance.to(torch.float64)
    score = torch.where(j == 0, torch.full_like(score, FORCE_FIRST), score)
    score = torch.where(j[None, :] == cur[:, None], torch.full_like(score, FORCE_LOCAL), score)
    if causal:
        score = score.masked_fill(j[None, :] > cur[:, None], float("-inf"))
    order = torch.sort(score, dim=-1, descending=True, stable=True)
    k_ = min(n_sel, n_b)
    idx = order.indices[..., :k_]
    idx = torch.where(order.values[..., :k_] > float("-inf"), idx, -1)
    if k_ < n_sel:
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], n_sel - k_), -1)], -1)
    idx = torch.where(idx < 0, n_b + 1, idx).sort(-1).values          # ascending, padding last
    idx = torch.where(idx > n_b, -1, idx)
    return idx.permute(0, 2, 1, 3).contiguous()                        # (B, T, Hk, n_sel)


def _softmax(s):
    """Softmax over the last axis with fully-masked rows giving 0 (not NaN)."""
    if s.shape[-1] == 0:
        return s
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    z = e.sum(-1, keepdim=True)
    return e / torch.where(z > 0, z, torch.ones_like(z))


def _expand(x, G):
    """(B, S, Hk, D) -> (B, Hq, S, D) in heads-first layout."""
    x = x.transpose(1, 2)
    return x.repeat_interleave(G, dim=1) if G > 1 else x


def _core(q, k, v, k_cmp, v_cmp, config, gates, causal, scale, return_indices=False, prior=None):
    """One batch of equal-length sequences; q positions are the last T of S (causal)."""
    B, T, Hq, D = q.shape
    S, Hk = k.shape[1], k.shape[2]
    G = Hq // Hk
    l, d, bs = config.compress_block, config.compress_stride, config.block_size
    compute = torch.float64 if q.dtype in (torch.float32, torch.float64) else torch.float32
    dev = q.device
    qpos = torch.arange(T, device=dev) + (S - T)
    kpos = torch.arange(S, device=dev)
    qh = q.transpose(1, 2).to(compute)                                     # (B, Hq, T, D)

    # 1. compressed branch
    n_c = k_cmp.shape[1]
    kc, vc = _expand(k_cmp.to(compute), G), _expand(v_cmp.to(compute), G)
    s_c = torch.matmul(qh, kc.transpose(-1, -2)) * scale                  # (B, Hq, T, n_c)
    if causal:
        vis = (torch.arange(n_c, device=dev) * d + l - 1)[None, :] <= qpos[:, None]
        s_c = s_c.masked_fill(~vis, float("-inf"))
    p_c = _softmax(s_c)
    o_cmp = torch.matmul(p_c, vc)

    # 2. selection from the compressed probabilities
    n_b = -(-S // bs)
    with torch.no_grad():
        w = overlap_weights(n_c, n_b, config, dev).to(compute)
        imp = torch.matmul(p_c.detach(), w)                                # (B, Hq, T, n_b)
        imp = imp.reshape(B, Hk, G, T, n_b).sum(2)
        spos = qpos if causal else torch.arange(T, device=dev)
        if config.selection == "tile":
            idx = select_tiles(imp, spos, config, causal, prior)
        else:
            idx = select_blocks(imp, spos, config, causal)
        chosen = torch.zeros(B, T, Hk, n_b + 1, dtype=torch.bool, device=dev)
        chosen.scatter_(-1, torch.where(idx < 0, n_b, idx), True)
        chosen = chosen[..., :n_b].permute(0, 2, 1, 3)                     # (B, Hk, T, n_b)
        tok = chosen.repeat_interleave(bs, -1)[..., :S]                    # (B, Hk, T, S)
        if causal:
            tok = tok & (kpos[None, :] <= qpos[:, None])
        tok = tok.repeat_interleave(G, 1) if G > 1 else tok
    kh, vh = _expand(k.to(compute), G), _expand(v.to(compute), G)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale                    # (B, Hq, T, S)
    o_slc = torch.matmul(_softmax(s.masked_fill(~tok, float("-inf"))), vh)

    # 3. sliding window
    W = config.window
    if causal:
        win = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - W)
    else:
        lo = qpos[:, None] - W // 2
        win = (kpos[None, :] >= lo) & (kpos[None, :] < lo + W)
    o_swa = torch.matmul(_softmax(s.masked_fill(~win, float("-inf"))), vh)

    if gates is None:
        out = (o_cmp + o_slc + o_swa) / 3.0
    else:
        g = gates.to(compute).permute(0, 2, 1, 3)                          # (B, Hq, T, 3)
        out = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_swa
    out = out.transpose(1, 2).to(q.dtype)
    return (out, idx) if return_indices else out


# ---------------------------------------------------------------------------------------------------- cache
class NSACache:
    """Decode state of one attention layer: raw k/v (when `store_kv`) and the compressed k/v built so far.

    store_kv=True (default): `nsa_attention(q, k_new, v_new, cfg, cache=c)` appends k_new/v_new and attends over
    everything cached. store_kv=False (the transformers adapter, whose model cache already holds k/v): pass the
    FULL k/v each call; only compressed blocks completed since the last call are computed (a call whose k is
    shorter than the cached length, or with q length == k length, starts over).
    """

    def __init__(self, store_kv: bool = True):
        self.store_kv = bool(store_kv)
        self.reset()

    def reset(self):
        self.k = self.v = None
        self.k_cmp = self.v_cmp = None
        self.length = 0
        self._bufs = {}
        self.tile_selection = None   # selection="tile": (tile number, (B, Hk, num_selected) blocks) of the last tile

    def keep_tile_selection(self, config, S: int, idx):
        """After a call over S keys: remember the last tile's selection (idx (B, T, Hk, num_selected), last row)."""
        if config.selection == "tile":
            self.tile_selection = ((S - 1) // config.block_size, idx[:, -1].detach().contiguous())

    def _append(self, name, cur, new):
        """cur + new along dim 1. Without autograd, into a buffer of doubling capacity whose prefix view `cur` is (no
        per-step allocation, no O(length) copy); with autograd, torch.cat (the buffer would be written in place)."""
        if cur is None or torch.is_grad_enabled():
            self._bufs.pop(name, None)
            return new if cur is None else torch.cat([cur, new], 1)
        n, m = cur.shape[1], new.shape[1]
        buf = self._bufs.get(name)
        # a new buffer when cur is not the prefix of ours (first append, or the caller replaced it), when ours is full,
        # or when it was made under inference mode and this call is not (in-place writes to it would fail)
        if buf is None or buf.data_ptr() != cur.data_ptr() or buf.shape[1] < n + m \
                or buf.is_inference() != torch.is_inference_mode_enabled():
            buf = cur.new_empty((cur.shape[0], max(2 * (n + m), 64), *cur.shape[2:]))
            buf[:, :n].copy_(cur)
            self._bufs[name] = buf
        buf[:, n:n + m].copy_(new)
        return buf[:, :n + m]

    def update(self, k, v, config, compress_weights=None, restart: bool = False):
        """Returns (k_full, v_full, k_cmp, v_cmp) after adding this call's tokens."""
        if self.store_kv:
            if self.k is not None and (self.k.shape[0] != k.shape[0] or self.k.shape[2:] != k.shape[2:]
                                       or self.k.dtype != k.dtype):
                raise ValueError(f"k {tuple(k.shape)} {k.dtype} does not extend the cached k "
                                 f"{tuple(self.k.shape)} {self.k.dtype}")
            k_full = self._append("k", self.k, k)
            v_full = self._append("v", self.v, v)
            self.k, self.v = k_full, v_full
        else:
            k_full, v_full = k, v
            if restart or k.shape[1] < self.length or (self.k_cmp is not None and (
                    self.k_cmp.shape[0] != k.shape[0] or self.k_cmp.shape[2:] != k.shape[2:]
                    or self.k_cmp.dtype != k.dtype)):
                self.k_cmp = self.v_cmp = None
                self.tile_selection = None
        have = 0 if self.k_cmp is None else self.k_cmp.shape[1]
        if self.k_cmp is None or num_compressed(k_full.shape[1], config) > have:   # else nothing new to pool
            new_k, new_v = compress_kv(k_full, v_full, config, compress_weights, start=have)
            if self.k_cmp is None:
                self.k_cmp, self.v_cmp = new_k, new_v
                self._bufs.pop("k_cmp", None)
                self._bufs.pop("v_cmp", None)
            elif new_k.shape[1]:
                self.k_cmp = self._append("k_cmp", self.k_cmp, new_k)
                self.v_cmp = self._append("v_cmp", self.v_cmp, new_v)
        self.length = k_full.shape[1]
        return k_full, v_full, self.k_cmp, self.v_cmp


def tile_prior(config, first_pos: int, cache=None):
    """selection="tile": the selection (B, Hk, num_selected) of the tile containing query position `first_pos`
    when that tile started before it, from `cache` (None when `first_pos` starts a tile, or for selection="token").
    A ValueError when no cache saw the tile's first position."""
    bs = config.block_size
    if config.selection != "tile" or first_pos % bs == 0:
        return None
    kept = None if cache is None else cache.tile_selection
    if kept is None or kept[0] != first_pos // bs:
        raise ValueError(f"selection='tile': the first query (position {first_pos}) continues the selection tile "
                         f"starting at {first_pos // bs * bs}, whose selection "
                         f"{'this cache did not see' if cache is not None else 'needs a cache'}: start the queries "
                         f"at a multiple of block_size={bs}, or prefill from position 0 with the same NSACache")
    return kept[1]


# ---------------------------------------------------------------------------------------------------- entry
def nsa_attention(q, k, v, config, gates=None, cu_seqlens=None, causal: bool = True, cache=None,
                  compress_weights=None, *, scale=None, return_indices: bool = False):
    """Native Sparse Attention (see the module docstring for the exact semantics).

    q (B, T, Hq, D); k/v (B, S, Hk, D) (with a cache: only the new tokens); config: NSAConfig;
    gates (B, T, Hq, 3) or None; cu_seqlens int (N+1,) or None; compress_weights (2, Hk, compress_block) or None.
    Returns out (B, T, Hq, D) [, indices int64 (B, T, Hk, num_selected) ascending, -1 padded].
    """
    offs = _check_common(q, k, v, config, gates, cu_seqlens, causal, cache, compress_weights)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if cache is not None:
        k, v, k_cmp, v_cmp = cache.update(k, v, config, compress_weights, restart=(k.shape[1] == q.shape[1]
                                                                                   and not cache.store_kv))
        if k.shape[1] < q.shape[1]:
            raise ValueError(f"cache holds {k.shape[1]} tokens, fewer than the {q.shape[1]} queries")
        prior = tile_prior(config, k.shape[1] - q.shape[1], cache)
        out, idx = _core(q, k, v, k_cmp, v_cmp, config, gates, causal, scale, True, prior)
        cache.keep_tile_selection(config, k.shape[1], idx)
        return (out, idx) if return_indices else out
    if offs is None:
        tile_prior(config, k.shape[1] - q.shape[1])
        k_cmp, v_cmp = compress_kv(k, v, config, compress_weights)
        return _core(q, k, v, k_cmp, v_cmp, config, gates, causal, scale, return_indices)
    outs, idxs = [], []
    for a, b in zip(offs, offs[1:]):
        ks, vs = k[:, a:b], v[:, a:b]
        k_cmp, v_cmp = compress_kv(ks, vs, config, compress_weights)
        r = _core(q[:, a:b], ks, vs, k_cmp, v_cmp, config, None if gates is None else gates[:, a:b], causal,
                  scale, True)
        outs.append(r[0])
        idxs.append(r[1])
    out = torch.cat(outs, 1)
    return (out, torch.cat(idxs, 1)) if return_indices else out


def nsa_density(config, T: int, S: int | None = None, causal: bool = True) -> float:
    """Fraction of keys NSA scores vs dense attention for T queries at the end of S keys.

    Per query: visible compressed blocks + tokens in min(num_selected, visible) selection blocks + window tokens
    (a token in both a selected block and the window is counted twice), divided by the dense key count
    (causal: t + 1). Can exceed 1 for short sequences.
    """
    S = T if S is None else S
    t = torch.arange(S - T, S, dtype=torch.float64)
    l, d, bs = config.compress_block, config.compress_stride, config.block_size
    if causal:
        n_c = torch.where(t + 1 >= l, torch.div(t + 1 - l, d, rounding_mode="floor") + 1, torch.zeros_like(t))
        slc = torch.minimum(torch.full_like(t, config.num_selected * bs), t + 1)
        win = torch.minimum(torch.full_like(t, config.window), t + 1)
        return float(((n_c + slc + win) / (t + 1)).mean())
    n_c = num_compressed(S, config)
    return min(1.0, (n_c + min(config.num_selected * bs, S) + min(config.window, S)) / S)
