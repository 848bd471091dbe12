"""Dense attention: input checks, the backend list and the public entries `attention` / `attention_fp8`.

Backends of `attention` (all compute `reference.attention`; the dispatcher picks the cheapest that runs a call):
  flash_triton    the skip-list kernel with skipping compiled out (head dim 64 / 128; Gluon warp-specialised build
                  for non-causal calls on sm_90, Triton elsewhere): ../skip/triton.py, ../skip/gluon.py
  flash_cudnn_bwd training calls: the flash forward with torch's cuDNN backward kernel (sm_90): flash_cudnn.py
  splitd_triton   split-D flash kernels, head dims 32..1024 (multiples of 32): splitd.py
  sdpa_cudnn, sdpa_flash, sdpa_efficient   torch SDPA forced onto one of its CUDA kernels: sdpa.py
  sdpa            torch SDPA with torch's own choice (what an unpatched model runs; the CPU path)
  reference       the fp32/fp64 oracle (fp64 inputs, LSE on CPU, anything nothing else runs)
"""
from __future__ import annotations

import logging
import math

import torch

from ..dispatch import _ON_CLEAR, Backend, Call, Dispatcher, memory_layout
from ..dispatch import length_class as dispatch_length_class
from . import flash_cudnn, reference, sdpa

logger = logging.getLogger("sparsepatch.kernels")

_HALF = (torch.float16, torch.bfloat16)


def check_attention_inputs(q, k, v, attn_mask=None, scale=None) -> None:
    """Clear errors for inputs no backend should guess about. Raises ValueError naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must have a floating dtype (float16, bfloat16, float32, float64), got {t.dtype}")
    reference.check_qkv(q, k, v)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(float(scale))):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise ValueError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
            raise ValueError(f"attn_mask must be bool (True = attend) or an additive float mask, got {attn_mask.dtype}")
        B, Sq, Hq = q.shape[:3]
        want = (B, Hq, Sq, k.shape[1])
        ok = attn_mask.dim() <= 4 and all(m in (1, w) for m, w in zip(attn_mask.shape[::-1], want[::-1]))
        if not ok:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} must broadcast to (B, Hq, Sq, Sk) = "
                             f"{want}")


def _empty_keys(q, v, return_lse):
    """Sk = 0: every row attends to nothing -> zeros (SDPA's answer), LSE -inf."""
    out = q.new_zeros(q.shape[:3] + (v.shape[-1],))
    if return_lse:
        return out, torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), device=q.device)
    return out


# ------------------------------------------------------------------------------------------------- backends

def gpu_kernel_reason(call: Call) -> str | None:
    """Why our CUDA kernels cannot run `call` (device, dtype, mask, head dims, causal alignment), or None."""
    if call.device != "cuda":
        return "needs a CUDA tensor"
    if call.dtype not in _HALF:
        return f"needs float16/bfloat16, got {call.dtype}"
    if call.mask is not None:
        return "takes no attn_mask"
    if call.head_dim_v != call.head_dim:
        return "needs v's head dim equal to q's"
    if call.causal and call.seq_q > call.seq_k:
        return "causal with Sq > Sk (rows that see no key)"
    return None


def flash_kernel_reason(call: Call) -> str | None:
    """Why the Triton / Gluon flash kernel (the skip-list kernel, also dense) cannot run `call`, or None. Head dim
    256 runs on the Gluon kernel only: sm_90, inference, sequence- / head-major inputs, causal with Sq > 1 and
    Sk - Sq a multiple of 128 (the route cache keys on that alignment for Sq > 1 only)."""
    why = gpu_kernel_reason(call)
    if why:
        return why
    if call.head_dim == 256 and call.op == "attention":
        from ..skip import gluon
        from ..skip import triton as skip_triton
        if not (gluon.HAS_GLUON and skip_triton._GLUON_OK[0]) or call.arch is None or call.arch[0] != 9 \
                or call.interpret:
            return "head dim 256 runs on the Gluon kernel (sm_90) only"
        if call.needs_grad:
            return "head dim 256: inference only (no backward kernel)"
        if any(lay == "other" for lay in call.layouts):
            return "head dim 256 needs sequence- or head-major q/k/v"
        if call.causal and (call.seq_q == 1 or not gluon.causal_aligned(call.seq_q, call.seq_k)):
            return "head dim 256 causal needs Sq > 1 and Sk - Sq a multiple of 128"
        return None
    if call.head_dim not in (64, 128):
        return f"head dim {call.head_dim} (runs 64 / 128)"
    return None


def flash_measured_for(call: Call) -> bool:
    """The shipped sm_90 table measured flash_triton's prefill cells on the Gluon kernel; calls that kernel does not
    take (a layout other than sequence- / head-major; causal prefill with Sk - Sq not a multiple of its 128-key
    tile) run the slower Triton kernel, which those cells do not describe: for them flash_triton counts as
    unmeasured (SDPA runs). Decode cells (Sq = 1) were measured on the Triton kernel and stand."""
    if call.arch is None or call.arch[0] != 9:
        return True
    if any(lay == "other" for lay in call.layouts):
        return False
    from ..skip import gluon
    return not call.causal or call.seq_q == 1 or gluon.causal_aligned(call.seq_q, call.seq_k)


def unit_head_dim_stride(*ts):
    """The tensors, each copied only where its head dim (last axis) is not unit-stride, as the kernels index it."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in ts)


def _flash_run(q, k, v, *, causal, scale, attn_mask, return_lse):
    from ..skip import triton as skip_triton
    q, k, v = unit_head_dim_stride(q, k, v)
    try:
        return skip_triton.attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse)
    except skip_triton.GluonUnavailable:   # head dim 256 where the Gluon kernel cannot run: the same function
        return _splitd_run(q, k, v, causal=causal, scale=scale, attn_mask=attn_mask, return_lse=return_lse)


def _splitd_supports(call: Call) -> str | None:
    why = gpu_kernel_reason(call)
    if why:
        return why
    if call.head_dim % 32 or not 32 <= call.head_dim <= 1024:
        return f"head dim {call.head_dim} (runs multiples of 32 in [32, 1024])"
    return None


def _splitd_run(q, k, v, *, causal, scale, attn_mask, return_lse):
    from . import splitd
    q, k, v = unit_head_dim_stride(q, k, v)
    return splitd.attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse)


def _reference_run(q, k, v, *, causal, scale, attn_mask, return_lse):
    return reference.attention(q, k, v, causal=causal, scale=scale, attn_mask=attn_mask, return_lse=return_lse)


def _sdpa_backend(name, kernel):
    # Forcing one SDPA kernel costs the `sdpa_kernel` context (~15-20 us of host time, not in the table's
    # device-bound timings): small calls stay on torch's own choice unless the forced kernel saves more.
    return Backend(name, lambda call: sdpa.supports(call, kernel),
                   lambda q, k, v, **kw: sdpa.attention(q, k, v, kernel=kernel, **kw),
                   host_ms=0.0 if kernel is None else sdpa.FORCED_HOST_MS, baseline=True)


BACKENDS = [
    Backend("flash_triton", flash_kernel_reason, _flash_run, measured_for=flash_measured_for),
    Backend("flash_cudnn_bwd", flash_cudnn.supports, flash_cudnn.attention, measured_for=flash_measured_for),
    Backend("splitd_triton", _splitd_supports, _splitd_run),
    _sdpa_backend("sdpa_cudnn", "cudnn"),
    _sdpa_backend("sdpa_flash", "flash"),
    _sdpa_backend("sdpa_efficient", "efficient"),
    _sdpa_backend("sdpa", None),
    Backend("reference", lambda call: None, _reference_run),
]


def _prefer(call: Call) -> list:
    """Order where nothing is measured: SDPA (what an unpatched model runs) up to head dim 256; beyond it the
    split-D kernel (measured 1.9x SDPA efficient at D512, BENCHMARKS.md)."""
    if call.device == "cuda" and call.head_dim > 256:
        return ["splitd_triton", "sdpa", "flash_triton", "reference"]
    return ["sdpa", "flash_triton", "splitd_triton", "reference"]


DISPATCH = Dispatcher("attention", BACKENDS, _prefer)
_ON_CLEAR.append(lambda: _FAST.clear())


def explain(q, k, v, *, causal: bool = False, attn_mask=None, return_lse: bool = False, backend=None):
    """The route `attention` takes for these inputs: `Route` (backend, reason, every candidate with its cost)."""
    check_attention_inputs(q, k, v, attn_mask)
    return DISPATCH.route(Call.of("attention", q, k, v, causal=causal, attn_mask=attn_mask, return_lse=return_lse),
                          backend)


_FAST: dict = {}   # cheap key of a call already checked and routed -> backend name
_FAST_MAX = 4096


def _fast_key(q, k, v, causal, attn_mask, return_lse, backend):
    """Everything `check_attention_inputs` and the route depend on, without building a Call (host time: a patched
    decode step calls this once per layer)."""
    Sq, Sk = q.shape[1], k.shape[1]
    mask = None
    if attn_mask is not None:
        ms = attn_mask.shape
        mask = (attn_mask.dtype, attn_mask.device, ms[:-2], ms[-2:] == (Sq, Sk), ms[-2] == 1, ms[-1] == 1)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    # sequence lengths by class, so a decode step (Sk + 1 every call) reuses its route
    return (dispatch_length_class(Sq, Sk), memory_layout(q), memory_layout(k),
            memory_layout(v), q.shape[0], q.shape[2:], k.shape[0], k.shape[2:], v.shape[0],
            v.shape[1] == Sk, v.shape[2:], q.dtype, k.dtype, v.dtype, q.device, k.device, bool(causal), mask,
            bool(return_lse), grad, backend)


def backend_for(q, k, v, *, causal: bool = False, attn_mask=None, return_lse: bool = False,
                backend: str | None = None, scale=None) -> str:
    """The backend name `attention` runs for these inputs (checked and routed once per call shape class)."""
    try:
        name = _FAST.get(_fast_key(q, k, v, causal, attn_mask, return_lse, backend))
    except AttributeError:      # not tensors: the checks below say which argument
        name = None
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        name = None
    if name is None:
        check_attention_inputs(q, k, v, attn_mask, scale)
        if k.shape[1] == 0:
            return "empty"
        name = DISPATCH.route(Call.of("attention", q, k, v, causal=causal, attn_mask=attn_mask,
                                      return_lse=return_lse), backend).backend
        if len(_FAST) >= _FAST_MAX:
            _FAST.clear()
        _FAST[_fast_key(q, k, v, causal, attn_mask, return_lse, backend)] = name
    return name


def attention(q, k, v, *, causal: bool = False, scale=None, attn_mask=None, return_lse: bool = False,
              backend: str | None = None):
    """Dense attention. q (B, Sq, Hq, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv) -> (B, Sq, Hq, Dv)
    [, lse (B, Hq, Sq) fp32, natural log].

    causal: bottom-right aligned (query i sees keys <= Sk - Sq + i). attn_mask: bool (True = attend) or additive,
    broadcastable to (B, Hq, Sq, Sk). backend: force one of `BACKENDS` (None: the dispatcher's choice,
    `explain(...)` says which and why). Rows that see no key give zeros (LSE -inf).
    """
    name = backend_for(q, k, v, causal=causal, attn_mask=attn_mask, return_lse=return_lse, backend=backend,
                       scale=scale)
    if name == "empty":
        return _empty_keys(q, v, return_lse)
    return DISPATCH.backends[name].run(q, k, v, causal=bool(causal), scale=scale, attn_mask=attn_mask,
                                       return_lse=bool(return_lse))


# ------------------------------------------------------------------------------------------------- fp8

_WARNED: set = set()


def fp8_kernel_reason(call: Call) -> str | None:
    """Why the fp8 Triton kernels (dense and skip) cannot run `call`, or None: inference only, no mask, CUDA fp16 /
    bf16 at head dim 64 / 128, sm_90+, v's head dim equal to q's."""
    if call.needs_grad:
        return "inference only"
    if call.mask is not None:
        return "takes no attn_mask"
    if call.device != "cuda" or call.dtype not in _HALF or call.head_dim not in (64, 128):
        return "needs CUDA float16/bfloat16 at head dim 64 / 128"
    if call.arch is None or call.arch[0] < 9 or call.head_dim_v != call.head_dim:
        return "needs sm_90 and v's head dim equal to q's"
    return None


def _fp8_kernel_run(q, k, v, *, causal, scale, attn_mask, return_lse):
    from . import fp8
    if not fp8.fp8_supported(q):
        raise ValueError("the fp8 kernel needs Triton tensor descriptors (Triton >= 3.4)")
    return fp8.attention_fp8(q, k, v, causal=causal, scale=scale, return_lse=return_lse)


def _fp8_emulated_run(q, k, v, *, causal, scale, attn_mask, return_lse):
    """CPU: the reference on q/k/v rounded exactly as the kernel quantizes them (P's e4m3 rounding not modelled)."""
    from . import fp8
    qd, kd, vd = fp8.quantize_fp8_reference(q, k, v, q_block=fp8.FP8_CONFIG["block_m"])
    res = reference.attention(qd, kd, vd, causal=causal, scale=scale, attn_mask=attn_mask, return_lse=return_lse)
    return (res[0].to(q.dtype), res[1]) if return_lse else res.to(q.dtype)


def _native_run(q, k, v, **kw):
    key = (q.shape[-1], q.dtype, q.device.type, kw.get("attn_mask") is not None)
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning("sparsepatch: no fp8 kernel for head dim %d, %s on %s%s; running native precision", *key[:3],
                       " with an attention mask" if key[3] else "")
    return attention(q, k, v, **kw)


FP8_BACKENDS = [
    Backend("fp8_triton", fp8_kernel_reason, _fp8_kernel_run),
    Backend("fp8_emulated", lambda call: None if call.device == "cpu" and call.dtype != torch.float64 else
            "the emulation runs CPU float16/bfloat16/float32 inputs", _fp8_emulated_run),
    Backend("native", lambda call: None, _native_run),
]
FP8_DISPATCH = Dispatcher("attention_fp8", FP8_BACKENDS)


def attention_fp8(q, k, v, *, causal: bool = False, scale=None, attn_mask=None, return_lse: bool = False,
                  backend: str | None = None):
    """Low-precision dense attention forward (inference): q (B, Sq, Hq, D), k/v (B, Sk, Hk, D) -> (B, Sq, Hq, D)
    in q's dtype [, lse (B, Hq, Sq) fp32].

    Hopper CUDA, fp16/bf16, D 64/128, no mask: the fp8 Triton kernel (int8 Q K^T + e4m3 P V). CPU: the reference
    on q/k/v rounded exactly as the kernel quantizes them. Other inputs: `attention` (native precision), warned
    once. q/k/v that require grad raise (inference only).
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("precision='fp8' attention is inference-only: q/k/v require grad (run under "
                         "torch.no_grad(), or patch with DenseConfig(precision='native') for training)")
    check_attention_inputs(q, k, v, attn_mask, scale)
    if k.shape[1] == 0:
        return _empty_keys(q, v, return_lse)
    route = FP8_DISPATCH.route(Call.of("attention_fp8", q, k, v, causal=causal, attn_mask=attn_mask,
                                       return_lse=return_lse), backend)
    return FP8_DISPATCH.backends[route.backend].run(q, k, v, causal=bool(causal), scale=scale, attn_mask=attn_mask,
                                                    return_lse=bool(return_lse))
