"""Context parallelism: the sparsepatch diffusers backend under `ModelMixin.enable_parallelism` (Ulysses and ring).

diffusers hands a context-parallel backend's work to `_templated_context_parallel_attention` with a
`forward_op(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, _save_ctx, _parallel_config)`.
Every process (rank) has its own PatchHandle, so skip state is per rank by construction; layer names and context
(branch) names are the same on every rank.

Ulysses (`ContextParallelConfig(ulysses_degree=N)`): after diffusers' all-to-all a rank holds the whole sequence for
heads [r H/N, (r+1) H/N) and forward_op is called once. The call goes through `PatchHandle.attend` as without
parallelism: the lists of (layer, context) on rank r are (B, H/N, Tq, Tk) and are exactly the single-process lists of
those heads (the keep rule is per head, on the same rows). Outputs equal the single-process patched run.

Ring (`ContextParallelConfig(ring_degree=N)`): a rank holds q shard r. Two strategies (`RING_STRATEGY`):
- "gather" (default): all-gather the k/v shards of the ring group and run the q shard against the whole k in ONE skip
  call through `PatchHandle.attend`: lists keyed (layer, context), (B, H, Sq/N q-tiles, all k-tiles). diffusers 0.42's
  ring already all-gathers every k/v shard up front (rotate_method "allgather" only), so this costs no extra
  communication and one extra k/v copy, and it keeps the keep rule exact: the rank's lists are the single-process
  lists of its q tiles whenever Sq/N is a multiple of the q tile, so outputs equal the single-process run.
  Falls back to "walk" when must_do or joint-text ranges are present (their q and k offsets differ per rank).
- "walk": diffusers' templated ring loop — forward_op is called N times, on the k/v of shard (r + i) % N, returns
  (out, lse) and diffusers merges the partials with their LSE (`merge_partial` is the same formula). One
  SkipListBuffers per (layer, context) holds the lists of the rank's q tiles over the concatenated k-tile grids of
  the N shards (k-tile j * Tks + t = tile t of shard j; the global grid when shards are whole tiles), i.e. state per
  (q shard, k shard). Each shard is one skip call whose running row max starts afresh, so every shard's first listed
  tile is kept: a different tiling of the same keep rule. Exact: keep-everything thresholds equal dense (up to the fp32
  LSE merge); warmup calls and the first skip call (full list) compute every tile; the list that first skip call
  writes CONTAINS the single-process one (per shard the running max before a tile covers a subset of the tiles the
  global one covers, so every gain is >=). Later lists may differ either way (a larger list raises later running
  maxes): outputs are not equal to the single-process run, and density is higher (tiny Wan, 2 shards, threshold -3:
  0.957 vs 0.832 at step 4), growing with N. It is what a true P2P ring (k/v memory S/N) would need; eager only.

Unified (ulysses_degree > 1 and ring_degree > 1): the Ulysses all-to-all, then the ring strategy on the ring group
(verified with 4 CPU processes, 2 x 2: "gather" equals the single-process run).

Density (`handle.stats()`): each rank reports its own share — Ulysses: the fraction of tiles computed over its heads;
ring: over its q tiles x all k tiles. Shares have equal size, so the global density is the mean over ranks (the
recipe `sparsepatch.recipes.parallel_video` all-reduces it).

Not supported (clear errors): gradients through the CP path, attention masks under ring, `ring_anything` (uneven
shards), joint text+video layouts under ulysses_anything.
"""
from __future__ import annotations

import functools

import torch

from .. import kernels
from ..config import SkipConfig
from ..kernels import SkipList, skip_step
from ..kernels.skip import num_tiles
from . import diffusers_compat as compat


RING_STRATEGY = "gather"   # or "walk": one skip call per k/v shard, merged by LSE (see the module docstring)


def merge_partial(out_a, lse_a, out_b, lse_b):
    """Merge two partial attentions over disjoint key sets. out (B, S, H, D), lse (B, S, H) fp32 natural log.

    Returns (out, lse) of attention over the union (the formula diffusers' ring loop uses).
    """
    la, lb = lse_a.unsqueeze(-1), lse_b.unsqueeze(-1)
    out = out_a - torch.sigmoid(lb - la) * (out_a - out_b)
    lse = lse_a - torch.nn.functional.logsigmoid(lse_a - lse_b)
    return out, lse


def _hit(ranges, start: int, length: int, tile_len: int) -> torch.Tensor:
    """Bool (num_tiles(length, tile_len),): tiles of positions [start, start + length) overlapping any range."""
    hit = torch.zeros(num_tiles(length, tile_len), dtype=torch.bool)
    for a, b in ranges:
        lo, hi = max(int(a) - start, 0), min(int(b) - start, length)
        if hi > lo:
            hit[lo // tile_len: num_tiles(hi, tile_len)] = True
    return hit


def text_ranges(text: str | None, text_len: int, chunk: int, chunks: int) -> list[tuple[int, int]]:
    """must_do ranges of joint text+video attention when each of `chunks` sequence chunks of length `chunk` is laid
    out like a rank's local sequence ([text_local, video_local] for "prefix", [video_local, text_local] for "suffix")
    — the layout diffusers' cp plans give (text and video split per rank, concatenated by the processor)."""
    if not text or not text_len:
        return []
    local = (0, text_len) if text == "prefix" else (chunk - text_len, chunk)
    return [(c * chunk + local[0], c * chunk + local[1]) for c in range(chunks)]


def _check_inference(q, k, v):
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError("sparsepatch backend: gradients under context parallelism are not supported; run "
                                  "the model under torch.no_grad()")


def _backward_op(ctx, grad_out, *args, **kwargs):
    raise NotImplementedError("sparsepatch backend: gradients under context parallelism are not supported")


def attention(binding, query, key, value, attn_mask, dropout_p, is_causal, scale, parallel_config):
    """The sparsepatch backend under a diffusers ParallelConfig. binding: the calling processor's _Binding or None
    (a processor we did not patch: dense). Tensors (B, S_local, H, D) in and out, like every diffusers backend."""
    templated_attention = compat.templated_cp_attention()
    cp = parallel_config.context_parallel_config
    _check_inference(query, key, value)
    if binding is not None and getattr(binding.handle.config, "precision", "native") != "native":
        raise NotImplementedError(f"sparsepatch backend: {type(binding.handle.config).__name__}(precision='fp8') "
                                  "under context parallelism is not supported; patch with precision='native'")
    if binding is None:
        forward_op = _dense_forward_op
    elif cp.ring_degree > 1:
        if getattr(cp, "ring_anything", False):
            raise NotImplementedError("sparsepatch backend: ring_anything (uneven ring shards) is not supported; use "
                                      "a sequence length divisible by ring_degree")
        if attn_mask is not None:
            raise NotImplementedError("sparsepatch backend: attention masks under ring attention are not supported")
        has_must_do = bool(binding.handle.config.must_do if isinstance(binding.handle.config, SkipConfig) else 0) \
            or bool(binding.text and binding.text_len)
        if RING_STRATEGY == "gather" and not has_must_do:
            return _ring_gather(binding, cp, query, key, value, dropout_p, is_causal, scale, parallel_config)
        if RING_STRATEGY == "gather":
            binding.handle.warn_once("ring-must-do", "sparsepatch: ring attention with must_do / joint text tokens "
                                     "uses the per-shard ('walk') lists")
        forward_op = _RingCall(binding, cp).forward_op
    else:
        forward_op = functools.partial(_ulysses_forward_op, binding)
    return templated_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, False, False,
        forward_op=forward_op, backward_op=_backward_op, _parallel_config=parallel_config)


def _gather_seq(x, group):
    """All-gather (B, S_local, H, D) along the sequence over `group`, in rank order -> (B, S, H, D)."""
    from torch.distributed import _functional_collectives as funcol
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return funcol.wait_tensor(gather(x.contiguous(), 1, group))


def _ring_gather(binding, cp, query, key, value, dropout_p, is_causal, scale, parallel_config):
    """Ring degree R: gather the ring group's k/v shards (what diffusers' allgather ring does too) and run this rank's
    q shard against the whole k in one skip call, through `PatchHandle.attend` (lists keyed (layer, context), shape
    (B, H, Sq/R tiles, Sk tiles)). With Ulysses too (unified CP), the Ulysses all-to-all runs first, as in diffusers."""
    ulysses_attention = compat.templated_ulysses_attention()
    handle, cfg = binding.handle, binding.handle.config

    def attend(q, k, v):
        group = compat.ring_group(cp)
        k, v = _gather_seq(k, group), _gather_seq(v, group)
        context = handle.contexts.get(binding.prefix, "default")
        if not isinstance(cfg, SkipConfig) or is_causal or dropout_p:
            return handle.attend(binding.site, context, q, k, v, is_causal=is_causal, scale=scale,
                                 dropout_p=dropout_p)
        # PatchHandle.attend runs Sq != Sk dense (cross-attention); here q is a shard of k's own sequence.
        site = binding.site
        names = site.batch_branches(context, q.shape[0]) if site.batch_branches else [context] * q.shape[0]
        buffers = handle._buffers_for(site, context, q, k, names)
        return skip_step(q, k, v, buffers, cfg.threshold, cfg.warmup_steps, scale=scale)

    if cp.ulysses_degree == 1:
        return attend(query, key, value)

    def forward_op(ctx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                   return_lse=False, _save_ctx=True, _parallel_config=None):
        return attend(q, k, v)
    return ulysses_attention.apply(query, key, value, None, dropout_p, is_causal, scale, False, False,
                                           forward_op, _backward_op, parallel_config)


def _dense_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    if dropout_p:
        raise ValueError(f"dropout_p={dropout_p}: sparsepatch attention has no dropout")
    res = kernels.attention(query, key, value, causal=is_causal, scale=scale, attn_mask=attn_mask,
                            return_lse=return_lse)
    if return_lse:
        out, lse = res
        return out, lse.transpose(1, 2)            # diffusers wants lse (B, S, H)
    return res


def _ulysses_forward_op(binding, ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    """The whole sequence, this rank's heads: the ordinary per-handle path (lists keyed (layer, context))."""
    if return_lse:
        raise NotImplementedError("sparsepatch backend: return_lse under Ulysses is not supported")
    cp = _parallel_config.context_parallel_config
    S = query.shape[1]
    must_do = None
    if binding.text and binding.text_len:
        if S % cp.ulysses_degree:
            raise NotImplementedError("sparsepatch backend: joint text+video attention needs a sequence length "
                                      f"divisible by ulysses_degree ({S} % {cp.ulysses_degree})")
        chunk = S // cp.ulysses_degree
        must_do = text_ranges(binding.text, binding.text_len, chunk, cp.ulysses_degree)
    context = binding.handle.contexts.get(binding.prefix, "default")
    return binding.handle.attend(binding.site, context, query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                 scale=scale, dropout_p=dropout_p, must_do=must_do)


class _RingCall:
    """One ring attention call on this rank: forward_op runs once per k/v shard; lists read at the first shard,
    written after the last."""

    def __init__(self, binding, cp):
        self.binding = binding
        self.handle = binding.handle
        self.N = cp.ring_degree
        self.rank = compat.ring_rank(cp)
        self.i = 0

    def forward_op(self, ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, return_lse=True, _save_ctx=True, _parallel_config=None):
        if _save_ctx:          # diffusers saves the ctx on the first shard only: a new ring call
            self.i = 0
        shard = (self.rank + self.i) % self.N
        self.i += 1
        if dropout_p:
            raise ValueError(f"dropout_p={dropout_p}: sparsepatch attention has no dropout; call the model in eval "
                             "mode or set the attention dropout to 0")
        cfg = self.handle.config
        sparse = isinstance(cfg, SkipConfig) and not is_causal and query.shape[1] == key.shape[1]
        if not sparse:
            out, lse = kernels.attention(query, key, value, causal=is_causal, scale=scale, return_lse=True)
            if self.i == self.N:
                context = self.handle.contexts.get(self.binding.prefix, "default")
                names = self._names(context, query.shape[0])
                for branch in dict.fromkeys(names):
                    self.handle._history[self.binding.site.layer][branch].append(1.0)
                self.handle._calls += 1
        else:
            if self.i == 1:
                self._begin(query, key)
            out, lse = self._shard(query, key, value, scale, shard)
            if self.i == self.N:
                self._end()
        return out, lse.transpose(1, 2)            # diffusers wants lse (B, S, H)

    def _names(self, context, B):
        site = self.binding.site
        return site.batch_branches(context, B) if site.batch_branches else [context] * B

    def _begin(self, q, k):
        cfg = self.handle.config
        B, Sq, H, _ = q.shape
        Sk = k.shape[1]
        tm, tn = cfg.tile
        self.tks = num_tiles(Sk, tn)
        self.seq = (Sq, Sk)
        context = self.handle.contexts.get(self.binding.prefix, "default")
        names = self._names(context, B)
        # The buffers cover the rank's q tiles x the N shards' k-tile grids side by side.
        virtual_k = k.new_empty((B, self.N * self.tks * tn, 1, 1))
        self.buffers = self.handle._buffers_for(self.binding.site, context, q, virtual_k, names)
        self.n = self.buffers.calls()
        self.dense = self.n < cfg.warmup_steps
        if self.dense:
            return
        self.read = (self.n - cfg.warmup_steps) % 2
        b = self.buffers
        self.listed = SkipList(b.counts[self.read], b.indices[self.read], b.tile, Sq,
                               self.N * self.tks * tn).to_mask()
        self.next = torch.zeros_like(self.listed)
        self.computed = torch.zeros(B, dtype=torch.float64, device=q.device)
        text = text_ranges(self.binding.text, self.binding.text_len, Sq, 1)   # local layout, same on q and k
        self.text = text
        self.global_ranges = [tuple(r) for r in (cfg.must_do or [])]

    def _forced(self, shard, Sq, Sk, device):
        """Bool (Tq, Tks) tiles forced by must_do (global positions) and joint-attention text (local positions)."""
        tm, tn = self.handle.config.tile
        rows = _hit(self.global_ranges, self.rank * Sq, Sq, tm) | _hit(self.text, 0, Sq, tm)
        cols = _hit(self.global_ranges, shard * Sk, Sk, tn) | _hit(self.text, 0, Sk, tn)
        forced = rows[:, None] | cols[None, :]
        return forced.to(device) if bool(forced.any()) else None

    def _shard(self, q, k, v, scale, shard):
        cfg = self.handle.config
        if (q.shape[1], k.shape[1]) != self.seq:
            raise NotImplementedError("sparsepatch backend: ring shards of unequal length are not supported")
        if self.dense:
            return kernels.attention(q, k, v, scale=scale, return_lse=True)
        cols = slice(shard * self.tks, (shard + 1) * self.tks)
        listed = self.listed[..., cols]
        forced = self._forced(shard, q.shape[1], k.shape[1], q.device)
        if forced is not None:
            listed = listed | forced
        lst = SkipList.from_mask(listed, cfg.tile, q.shape[1], k.shape[1])
        out, nxt, lse = kernels.skip_attention(q, k, v, lst, cfg.threshold, scale=scale, return_lse=True)
        self.next[..., cols] = nxt.to_mask()
        self.computed += listed.sum(dim=(1, 2, 3)).double()
        return out, lse

    def _end(self):
        b = self.buffers
        n = self.n
        if self.dense:
            dens = torch.ones(b.density.shape[1], dtype=torch.float32, device=b.density.device)
        else:
            total = self.listed.shape[1] * self.listed.shape[2] * self.listed.shape[3]
            dens = (self.computed / total).float()
            nxt = SkipList.from_mask(self.next, b.tile, self.seq[0], self.listed.shape[3] * b.tile[1])
            b.counts[1 - self.read].copy_(nxt.counts)
            b.indices[1 - self.read].copy_(nxt.indices)
        if n < b.density.shape[0]:
            b.density[n].copy_(dens)
        b.step.add_(1)
