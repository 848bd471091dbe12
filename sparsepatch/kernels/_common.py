"""Small helpers shared by the Triton kernel modules (host side, and a few jit functions)."""
from __future__ import annotations

import functools
import os
import warnings

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


@triton.jit
def list_slots(CNT_IN, IDX_IN, CNT_OUT, IDX_OUT, row, Tk, STEP, n_warmup, slot_stride_cnt, slot_stride_idx,
               STATEFUL: tl.constexpr):
    """Pointers to q-tile `row`'s read and write lists -> (cnt_in, idx_in, cnt_out, idx_out, warm, write_ok).

    STATEFUL (the patcher's double-buffered slots): the call counter *STEP picks them on the device: calls
    < n_warmup are warm-up calls (warm: read every tile; write_ok 0: leave the lists alone), later calls read slot
    (n - n_warmup) % 2 and write the other. Otherwise IN / OUT are the lists as given, warm False, write_ok 1."""
    cnt_in = CNT_IN + row
    idx_in = IDX_IN + row * Tk
    cnt_out = CNT_OUT + row
    idx_out = IDX_OUT + row * Tk
    if STATEFUL:
        n = tl.load(STEP)
        warm = n < n_warmup
        rs = tl.where(warm, 0, (n - n_warmup) % 2)
        cnt_in += rs * slot_stride_cnt
        idx_in += rs * slot_stride_idx
        cnt_out += (1 - rs) * slot_stride_cnt
        idx_out += (1 - rs) * slot_stride_idx
        write_ok = (n >= n_warmup).to(tl.int32)
        return cnt_in, idx_in, cnt_out, idx_out, warm, write_ok
    else:
        return cnt_in, idx_in, cnt_out, idx_out, False, 1


@triton.jit
def bit_or(a, b):
    """Combine function of tl.reduce: bitwise OR."""
    return a | b


@triton.jit
def popc32(x):
    """Set bits of each int32 in x (SWAR; integer ops only, so it also runs under the interpreter)."""
    u = x.to(tl.uint32, bitcast=True)
    u = u - ((u >> 1) & 0x55555555)
    u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
    u = (u + (u >> 4)) & 0x0F0F0F0F
    return ((u * 0x01010101) >> 24).to(tl.int32)


def empty_out_lse(q: torch.Tensor, return_lse: bool):
    """Uninitialised outputs of an attention forward op (its fake implementation): out like q (B, Sq, Hq, D) and the
    fp32 LSE (B, Hq, Sq), or an empty (0,) LSE when it is not returned."""
    B, Sq, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, Sq) if return_lse else (0,), dtype=torch.float32)


@triton.jit
def store_delta_lse2(DELTA, LSE2, LSE, DLSE, base, ok, delta, HAS_DLSE: tl.constexpr):
    """Epilogue of the backward prep kernels at row offsets `base` (rows where `ok`): delta = rowsum(dO * O) minus
    dLSE when the LSE output has a gradient, and the LSE in log2 units, +inf for rows that saw no key (so that
    exp2(s - lse2) is 0 there)."""
    if HAS_DLSE:
        delta -= tl.load(DLSE + base, mask=ok, other=0.0)
    lse = tl.load(LSE + base, mask=ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(DELTA + base, delta, mask=ok)
    tl.store(LSE2 + base, lse2, mask=ok)


# Triton versions whose compiled-kernel launcher (CompiledKernel.run.launch: the C launch function behind the
# tensor-descriptor wrapper) is called directly with the argument layout of CudaLauncher.__call__ (checked against
# its source: 3.6.0). Other versions relaunch through CompiledKernel[grid] (the public runner), which adds the
# launch-metadata and scratch-allocation steps but still skips JITFunction.run.
C_LAUNCH_VERSIONS = ("3.6.0",)


def direct_launcher(kern, grid, tail=()):
    """relaunch(stream, *params) for the compiled kernel `kern` (what `jit_fn[grid](...)` returned) on `grid`, or
    None (interpreter). params + tail: every kernel parameter in declaration order, constexprs included (Triton's
    launcher takes them all); `tail` holds the trailing ones that are the same at every launch. Host
    TensorDescriptors (or any object with base / shape / strides / padding) where the kernel has descriptors.

    This skips JITFunction.run (argument binding, specialisation, cache lookup: tens of microseconds per launch),
    so it is only valid for arguments that specialise as at the first launch: callers key their plans on every
    int / float argument and use them for 16-byte-aligned pointers only. Profiler launch hooks go through the
    public runner."""
    if not hasattr(kern, "__getitem__"):
        return None
    grid = (tuple(grid) + (1, 1))[:3]   # the launcher and the runner index three grid dimensions
    runner = kern[grid]
    run = getattr(kern, "run", None)
    if (triton.__version__ in C_LAUNCH_VERSIONS and hasattr(run, "launch")
            and getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0):
        from triton import knobs
        launch, fn, meta = run.launch, kern.function, kern.packed_metadata
        coop, pdl = run.launch_cooperative_grid, run.launch_pdl
        hooks = knobs.runtime
        g0, g1, g2 = grid

        def relaunch(stream, *args):
            if _no_hook(hooks.launch_enter_hook) and _no_hook(hooks.launch_exit_hook):
                launch(g0, g1, g2, stream, fn, coop, pdl, None, None, meta, None, None, None, *args, *tail)
            else:
                runner(*args, *tail, stream=stream)
        relaunch.direct = True
        return relaunch
    return lambda stream, *args: runner(*args, *tail, stream=stream)


def relaunch_or_stop(relaunch, device_index: int, args, enabled: list, plans: dict, who: str) -> bool:
    """Run a recorded direct launch (`direct_launcher`) on the device's current stream; True if it ran. On failure
    (a Triton whose launcher differs) warn, turn direct launches off for this caller (enabled[0] = False, its plans
    cleared) and return False: the caller then launches through Triton's runner."""
    try:
        relaunch(current_stream(device_index), *args)
        return True
    except Exception as exc:  # noqa: BLE001  (any launcher mismatch: stop trying, the runner path is correct)
        warnings.warn(f"sparsepatch {who}: direct relaunch failed ({exc}); using Triton's launcher")
        enabled[0] = False
        plans.clear()
        return False


def _no_hook(hook) -> bool:
    # Triton 3.6 keeps launch hooks in HookChain objects (never None; empty `calls` = no hook), older ones use None
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


@functools.lru_cache(maxsize=None)
def _stream_getter():
    return triton.runtime.driver.active.get_current_stream


def current_stream(device_index: int):
    """The raw current CUDA stream of a device, as Triton's launcher takes it."""
    return _stream_getter()(device_index)


class DescriptorArgs:
    """What Triton's launcher reads from a host TensorDescriptor (base, shape, strides, padding), for a descriptor
    geometry recorded in a launch plan and re-pointed at each call's tensor, without TensorDescriptor's
    per-construction validation (the plan key fixes shapes, strides and dtype)."""
    __slots__ = ("base", "shape", "strides", "block_shape", "padding")

    def __init__(self, base, shape, strides, block_shape, padding):
        self.base, self.shape, self.strides, self.block_shape, self.padding = base, shape, strides, block_shape, \
            padding

    def descriptor(self):
        """The Triton TensorDescriptor of this geometry (what Triton's own launch path takes)."""
        from triton.tools.tensor_descriptor import TensorDescriptor
        return TensorDescriptor(self.base, list(self.shape), list(self.strides), list(self.block_shape),
                                self.padding)


def _plan_key(a):
    """What of one kernel argument a launch plan depends on: a tensor's dtype and 16-byte alignment (Triton
    specialises pointers on it), a host descriptor's geometry, dtype and base alignment, any other value itself."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, DescriptorArgs):
        return (a.base.dtype, a.base.data_ptr() % 16 == 0, tuple(a.shape), tuple(a.strides), tuple(a.block_shape),
                a.padding)
    return a


def _plan_device(args):
    """Device index of the first CUDA tensor among args (plans are per device), else None (nothing to plan)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.index if a.is_cuda else None
    return None


class LaunchPlans:
    """Direct-launch plans of one kernel caller. `launch(fn, grid, args, ...)` runs fn[grid](*args) where args
    holds every kernel parameter in declaration order, constexprs included: tensors (re-filled per call), host TMA
    descriptors as `DescriptorArgs` (re-pointed per call; their geometry is part of the plan), and plain values.
    The first launch of a plan key (every plain value, every tensor's dtype and alignment, every descriptor's
    geometry, grid, warps, stages, device) goes through Triton's runner and records `direct_launcher` (the compiled
    kernel's launcher: tens of microseconds less host time per call than JITFunction.run's binding and cache
    lookup); later launches with the same key reuse it. A failing direct relaunch warns and turns this caller's
    plans off (`relaunch_or_stop`); Triton's runner then launches every call. Kernels that need Triton's global
    scratch (descriptors built on the device) are launched by the runner and not planned."""

    def __init__(self, who: str, limit: int = 64):
        self.who = who
        self.limit = limit
        self.plans: dict = {}
        self.enabled = [not interpret()]

    def launch(self, fn, grid, args, num_warps: int, num_stages: int | None = None) -> None:
        grid = tuple(grid)
        dev = _plan_device(args) if self.enabled[0] else None
        key = None
        if dev is not None:
            key = (fn, dev, grid, num_warps, num_stages, tuple(_plan_key(a) for a in args))
            relaunch = self.plans.get(key)
            if relaunch is not None and dev == torch.cuda.current_device():
                if relaunch_or_stop(relaunch, dev, args, self.enabled, self.plans, self.who):
                    return
                key = None
        opts = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps, num_stages=num_stages)
        kern = fn[grid](*[a.descriptor() if isinstance(a, DescriptorArgs) else a for a in args], **opts)
        if key is not None and dev == torch.cuda.current_device():
            relaunch = direct_launcher(kern, grid)
            if relaunch is not None and getattr(getattr(kern, "run", None), "global_scratch_size", 0) == 0:
                if len(self.plans) >= self.limit:
                    self.plans.clear()
                self.plans[key] = relaunch
