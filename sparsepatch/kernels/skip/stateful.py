"""Skip lists carried across calls inside one op, so compiled callers see no Python state change per step.

A `SkipListBuffers` holds device tensors only: two list slots (double buffering), a call counter and a density
history. `skip_step` reads slot `(step - warmup) % 2`, computes, writes the next list into the other slot and
increments the counter, all on the device (no host sync on the Triton / Gluon path): inside the
`sparsepatch::skip_step` custom op when compiled or when autograd is on, the op's body directly in eager mode.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from ..dense.op import attention, attention_fp8
from ..dispatch import Call
from . import reference
from .op import DISPATCH, FP8_DISPATCH, check_inference, check_precision, nonfinite_tiles, skip_attention, \
    warn_native_once
from .skiplist import SkipList, num_tiles

MAX_CALLS = 1024  # density history length per buffer; calls beyond it still run, their density is not recorded


@dataclass
class SkipListBuffers:
    """Double-buffered skip lists for one (layer, branch).

    counts  int32 (2, B, H, Tq), indices int32 (2, B, H, Tq, Tk): list slots; slot 0 starts full.
    step    int64 (1,): calls made so far (warmup calls included).
    density fp32 (MAX_CALLS, B): fraction of tiles computed per call and batch element (1.0 for warmup calls).
    nonfinite int64 (2,): [0] calls whose output held a NaN / inf (those q-tiles kept every tile they read); [1] is
        bookkeeping (1 + the last call counted, so a device-side repair counts each call once).
    """

    counts: torch.Tensor
    indices: torch.Tensor
    step: torch.Tensor
    density: torch.Tensor
    tile: tuple
    seq_q: int
    seq_k: int
    nonfinite: torch.Tensor = None

    def __post_init__(self):
        if self.nonfinite is None:
            self.nonfinite = torch.zeros(2, dtype=torch.int64, device=self.step.device)

    @classmethod
    def create(cls, B, H, Sq, Sk, tile, device) -> "SkipListBuffers":
        full = SkipList.full(B, H, Sq, Sk, tile, device=device)
        counts = torch.stack([full.counts, full.counts.clone()])
        indices = torch.stack([full.indices, full.indices.clone()])
        step = torch.zeros(1, dtype=torch.int64, device=device)
        density = torch.zeros(MAX_CALLS, B, dtype=torch.float32, device=device)
        return cls(counts, indices, step, density, tuple(tile), Sq, Sk)

    def matches(self, B, H, Sq, Sk, device) -> bool:
        return (self.counts.shape[1:3] == (B, H) and (self.seq_q, self.seq_k) == (Sq, Sk)
                and self.counts.device == device)

    def calls(self) -> int:
        return int(self.step.item())

    def history(self) -> torch.Tensor:
        """fp32 (calls, B) density per recorded call."""
        return self.density[: min(self.calls(), MAX_CALLS)].cpu()

    def current(self, warmup_steps: int) -> SkipList:
        """The list the next call will read."""
        slot = max(self.calls() - warmup_steps, 0) % 2
        return SkipList(self.counts[slot], self.indices[slot], self.tile, self.seq_q, self.seq_k)


def _must_do_flat(must_do) -> list[int]:
    return [int(x) for rng in (must_do or []) for x in rng]


def _skip_step_portable(q, k, v, counts, indices, step, density, threshold, warmup_steps, tm, tn, scale,
                        must_do_flat, nonfinite, backend, precision="native") -> torch.Tensor:
    """skip_step on the op's other backends (CPU, reference; fp8: the emulation): the step counter is read on the
    host. precision "fp8": warm-up calls run `attention_fp8` (the fp8 kernel's warm-up reads every tile in fp8)."""
    n = int(step.item())
    B = q.shape[0]
    must_do = list(zip(must_do_flat[0::2], must_do_flat[1::2]))
    if n < warmup_steps:
        out = (attention_fp8 if precision == "fp8" else attention)(q, k, v, scale=scale)
        dens = torch.ones(B, dtype=torch.float32, device=q.device)
    else:
        read = (n - warmup_steps) % 2
        lst = SkipList(counts[read], indices[read], (tm, tn), q.shape[1], k.shape[1])
        out, nxt = skip_attention(q, k, v, lst, threshold, scale=scale, must_do=must_do, backend=backend,
                                  precision=precision)
        nonfinite[:1].add_(nonfinite_tiles(out, tm).any().to(nonfinite.dtype))
        forced = reference.must_do_tiles(must_do, q.shape[1], k.shape[1], (tm, tn))
        computed = lst.to_mask() if forced is None else lst.to_mask() | forced.to(q.device)
        dens = computed.float().mean(dim=(1, 2, 3))
        counts[1 - read].copy_(nxt.counts)
        indices[1 - read].copy_(nxt.indices)
    if n < density.shape[0]:
        density[n].copy_(dens)
    step.add_(1)
    return out


_REPAIR_KERNEL_OK = [True]


def _keep_read_where_nonfinite(out, counts, indices, step, warmup_steps, tm, nonfinite) -> None:
    """After a device-side call (step already incremented): q-tiles whose output is non-finite get the list they
    read in the slot the call wrote, and `nonfinite` counts the call. Device work only (no host sync): one Triton
    launch where the list slots are contiguous (the patcher's buffers), else the same with torch ops."""
    if (_REPAIR_KERNEL_OK[0] and out.stride(-1) == 1 and counts[0].is_contiguous() and indices[0].is_contiguous()
            and nonfinite.numel() == 2):
        from . import triton as skip_triton
        try:
            skip_triton.repair_nonfinite(out, counts, indices, step, int(warmup_steps), tm, nonfinite)
            return
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001  (a Triton that cannot build it: the same repair in torch ops)
            warnings.warn(f"sparsepatch: the non-finite repair kernel failed ({type(exc).__name__}: "
                          f"{str(exc)[:200]}); using torch ops")
            _REPAIR_KERNEL_OK[0] = False
    n = step - 1
    active = n >= warmup_steps
    rd = torch.remainder(n - warmup_steps, 2)
    wr = 1 - rd
    bad = nonfinite_tiles(out, tm) & active                                  # (B, H, Tq)
    read_c, wrote_c = counts.index_select(0, rd)[0], counts.index_select(0, wr)[0]
    read_i, wrote_i = indices.index_select(0, rd)[0], indices.index_select(0, wr)[0]
    counts.index_copy_(0, wr, torch.where(bad, read_c, wrote_c)[None])
    indices.index_copy_(0, wr, torch.where(bad[..., None], read_i, wrote_i)[None])
    nonfinite[:1].add_(bad.any().to(nonfinite.dtype))


def _skip_step_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor, indices: torch.Tensor,
                    step: torch.Tensor, density: torch.Tensor, nonfinite: torch.Tensor, threshold: float,
                    warmup_steps: int, tm: int, tn: int, scale: float, must_do_flat: list[int],
                    precision: str = "native") -> torch.Tensor:
    """Body of the sparsepatch::skip_step op: the skip op's dispatcher picks the backend (the Triton / Gluon / fp8
    kernels read the step counter on the device; the others read it on the host)."""
    device_step, run_precision = None, "native"
    if precision == "fp8":
        backend = FP8_DISPATCH.route(Call.of(FP8_DISPATCH.op, q, k, v, tile=(tm, tn), must_do=must_do_flat)).backend
        if backend == "fp8_triton":
            from . import fp8
            device_step = fp8.skip_step_fp8
        elif backend == "fp8_emulated":
            run_precision = "fp8"
        else:
            warn_native_once(q, (tm, tn))   # no fp8 route: the native op, on its own device-side path
    if device_step is None and run_precision == "native":
        backend = DISPATCH.route(Call.of("skip_attention", q, k, v, tile=(tm, tn), must_do=must_do_flat)).backend
        if backend == "flash_triton":
            from . import triton as skip_triton
            device_step = skip_triton.skip_step
    if device_step is not None:
        out = device_step(q, k, v, counts, indices, step, density, threshold, warmup_steps, tm, tn, scale,
                          must_do_flat).contiguous()
        _keep_read_where_nonfinite(out, counts, indices, step, warmup_steps, tm, nonfinite)
        return out
    return _skip_step_portable(q, k, v, counts, indices, step, density, threshold, warmup_steps, tm, tn, scale,
                               must_do_flat, nonfinite, backend, run_precision).contiguous()


_skip_step_op = torch.library.custom_op("sparsepatch::skip_step",
                                        mutates_args=("counts", "indices", "step", "density", "nonfinite"))(
    _skip_step_impl)


@_skip_step_op.register_fake
def _(q, k, v, counts, indices, step, density, nonfinite, threshold, warmup_steps, tm, tn, scale, must_do_flat,
      precision="native"):
    return q.new_empty(q.shape)  # contiguous (B, Sq, Hq, D)


def skip_step(q, k, v, buffers: SkipListBuffers, threshold: float, warmup_steps: int, *, scale=None,
              must_do=None, precision: str = "native") -> torch.Tensor:
    """One call of temporal skip attention with the lists carried in `buffers` (updated in place).

    q (B, Sq, Hq, D), k/v (B, Sk, Hk, D) -> out (B, Sq, Hq, D). Calls numbered < warmup_steps run dense and
    leave the lists alone; later calls read the current list and write the next one. precision "fp8": inference
    only (inputs that require grad raise), the fp8 skip op (op.py) with the same list slots.
    """
    if check_precision(precision) == "fp8":
        check_inference(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    tm, tn = buffers.tile
    # Eager calls without autograd run the op's body directly: the same function, without the dispatcher's
    # ~35-80 us of host time per call (NOTES skip forward v14b). Compiled callers go through the op, and so do inputs that
    # require grad (the op then raises at backward: it has no autograd formula; skip_step_differentiable has one).
    needs_op = torch.compiler.is_compiling() or (torch.is_grad_enabled() and
                                                  (q.requires_grad or k.requires_grad or v.requires_grad))
    return (_skip_step_op if needs_op else _skip_step_impl)(
        q, k, v, buffers.counts, buffers.indices, buffers.step, buffers.density, buffers.nonfinite, float(threshold),
        int(warmup_steps), tm, tn, scale, _must_do_flat(must_do), precision)


class _TrainingModeSkip(torch.autograd.Function):
    """SkipConfig(backward=True): one forward over the read list; a backward over read ∩ kept.

    forward(q, k, v, read counts/indices, ...) -> (out, next counts, next indices); the next list is what the
    forward kept, so the backward walks only tiles that were computed AND found non-negligible, with the forward's
    normalisation (see reference.skip_attention_grads). triton=True: Triton forward and backward kernels.
    """

    @staticmethod
    def forward(ctx, q, k, v, counts, indices, tile, threshold, scale, must_do, triton):
        Sq, Sk = q.shape[1], k.shape[1]
        read = SkipList(counts, indices, tile, Sq, Sk)
        if triton:
            from . import triton as skip_triton
            out, kept, lse = skip_triton.skip_attention(q, k, v, read, threshold, scale=scale, must_do=must_do,
                                                 return_lse=True)
        else:
            out, kept, lse = skip_attention(q, k, v, read, threshold, scale=scale, must_do=must_do,
                                            return_lse=True)
        forced = reference.must_do_tiles(must_do, Sq, Sk, tile)
        # Saved as copies: the read list is a view of the double buffer that later steps overwrite.
        computed = read.clone() if forced is None else SkipList.from_mask(read.to_mask() | forced.to(q.device),
                                                                          tile, Sq, Sk)
        ctx.save_for_backward(q, k, v, out, lse, computed.counts, computed.indices, kept.counts, kept.indices)
        ctx.tile, ctx.scale, ctx.triton = tile, scale, triton
        ctx.mark_non_differentiable(kept.counts, kept.indices)
        return out, kept.counts, kept.indices

    @staticmethod
    def backward(ctx, dout, _dcounts, _dindices):
        q, k, v, out, lse, cc, ci, kc, ki = ctx.saved_tensors
        Sq, Sk = q.shape[1], k.shape[1]
        computed = SkipList(cc, ci, ctx.tile, Sq, Sk)
        kept = SkipList(kc, ki, ctx.tile, Sq, Sk)
        if ctx.triton:
            from . import backward as skip_backward
            dq, dk, dv = skip_backward.attention_backward(q, k, v, out, lse, dout.contiguous(), skip_list=computed,
                                                          scale=ctx.scale, extra_skip=kept)
        else:
            dq, dk, dv = reference.skip_attention_grads(q, k, v, out, lse, dout, computed, kept, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None, None, None, None


def _triton_training_ok(q, tile) -> bool:
    """True when the Triton forward and backward kernels run q at `tile` (CUDA, or CPU under TRITON_INTERPRET=1)."""
    from .op import triton_tile_ok
    if not triton_tile_ok(tuple(tile)) or q.shape[-1] not in (64, 128):
        return False
    if q.is_cuda:
        return q.dtype in (torch.float16, torch.bfloat16)
    from .._common import interpret
    return interpret() and q.dtype in (torch.float16, torch.float32)


def skip_step_differentiable(q, k, v, buffers: SkipListBuffers, threshold: float, warmup_steps: int, *,
                             scale=None, must_do=None, backward_skip: bool = False,
                             use_triton: bool | None = None) -> torch.Tensor:
    """`skip_step` for training: the same lists and state updates, run eagerly so autograd sees the attention.

    backward_skip False: the gradient is exactly that of the sparse forward (only the computed tiles contribute).
    backward_skip True (SkipConfig(backward=True)): the forward value is unchanged, but the gradient is that of
    attention over the tiles the forward KEPT (its next list) — the tiles it found negligible are skipped in the
    backward too, keeping the forward's softmax normalisation (an approximate gradient; `validate_gradients`
    reports its cos-sim vs dense). One forward, one backward over read ∩ kept: Triton kernels when use_triton
    (None = on CUDA when they support q), else the reference (`reference.skip_attention_grads`), same function.
    """
    n = buffers.calls()
    B = q.shape[0]
    if n < warmup_steps:
        out = attention(q, k, v, scale=scale)
        dens = torch.ones(B, dtype=torch.float32, device=q.device)
    else:
        read = (n - warmup_steps) % 2
        lst = SkipList(buffers.counts[read], buffers.indices[read], buffers.tile, q.shape[1], k.shape[1])
        if use_triton is None:
            use_triton = q.is_cuda and _triton_training_ok(q, buffers.tile)
        if backward_skip:
            scale_f = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
            out, kc, ki = _TrainingModeSkip.apply(q, k, v, lst.counts, lst.indices, buffers.tile, threshold,
                                                  scale_f, must_do, bool(use_triton))
            nxt = SkipList(kc, ki, buffers.tile, q.shape[1], k.shape[1])
        else:
            out, nxt = skip_attention(q, k, v, lst, threshold, scale=scale, must_do=must_do)
        forced = reference.must_do_tiles(must_do, q.shape[1], k.shape[1], buffers.tile)
        computed = lst.to_mask() if forced is None else lst.to_mask() | forced.to(q.device)
        dens = computed.float().mean(dim=(1, 2, 3))
        buffers.counts[1 - read].copy_(nxt.counts)
        buffers.indices[1 - read].copy_(nxt.indices)
    if n < buffers.density.shape[0]:
        buffers.density[n].copy_(dens)
    buffers.step.add_(1)
    return out


__all__ = ["SkipListBuffers", "skip_step", "skip_step_differentiable", "MAX_CALLS", "num_tiles"]
