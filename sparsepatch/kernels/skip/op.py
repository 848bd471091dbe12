"""Skip-list attention: the backend list and the public entry `skip_attention`.

Backends (each computes `reference.skip_attention`: same output, same next list):
  flash_triton  the Triton kernel (Gluon warp-specialised build at tile 128 x 128 on sm_90): triton.py, gluon.py
  cpu           batched GEMMs over each q-tile's listed tiles: cpu.py
  reference     the oracle (attn_mask, fp64, anything else)
A skip call always runs a backend that writes the next list; dense attention never stands in for it.

precision="fp8" (inference only; `FP8_DISPATCH`, the op "skip_attention_fp8"): the same skip semantics applied to
the scores of the fp8-quantized inputs (int8 Q K^T with per-block q/k scales, e4m3 P V, as `dense.attention_fp8`):
  fp8_triton    the fp8 skip kernel (Hopper CUDA, fp16/bf16, head dim 64 / 128, tm in 64/128): fp8.py
  fp8_emulated  CPU: the reference on q/k/v rounded exactly as the kernel quantizes them: fp8.skip_attention_emulated
  native        anything else: the native-precision op above, warned once
The fp8 lists can differ from the native ones where a tile's gain lies within the quantization's score error of
the threshold (fp8.py's docstring; measured fraction in BENCHMARKS.md).

Non-finite rows: a q-tile whose output holds a NaN / inf keeps every tile it read (its next list is its read list
plus must_do tiles), so one bad step cannot shrink the lists of the steps after it.
"""
from __future__ import annotations

import logging

import torch

from ..dense.op import check_attention_inputs, flash_kernel_reason, fp8_kernel_reason, unit_head_dim_stride
from ..dispatch import Backend, Call, Dispatcher
from . import reference
from .skiplist import DEFAULT_TILE, SkipList, check_tile, num_tiles

def triton_tile_ok(tile) -> bool:
    """Tiles the Triton kernel runs: tm in {16, 32, 64, 128}, tn a multiple of 16 up to 512."""
    tm, tn = tile
    return tm in (16, 32, 64, 128) and tn % 16 == 0 and tn <= 512


def _flash_supports(call: Call) -> str | None:
    why = flash_kernel_reason(call)
    if why:
        return why
    if not triton_tile_ok(call.tile):
        return f"tile {call.tile} (runs tm in 16/32/64/128, tn a multiple of 16 <= 512)"
    return None


def _flash_run(q, k, v, skip_list, threshold, **kw):
    from . import triton as skip_triton
    kw.pop("attn_mask")
    q, k, v = unit_head_dim_stride(q, k, v)
    return skip_triton.skip_attention(q, k, v, skip_list, threshold, **kw)


def _cpu_supports(call: Call) -> str | None:
    if call.device != "cpu":
        return "needs a CPU tensor"
    if call.mask is not None:
        return "takes no attn_mask"
    return None


def _cpu_run(q, k, v, skip_list, threshold, **kw):
    from . import cpu
    kw.pop("attn_mask")
    return cpu.skip_attention(q, k, v, skip_list, threshold, **kw)


def _reference_run(q, k, v, skip_list, threshold, **kw):
    return reference.skip_attention(q, k, v, skip_list, threshold, **kw)


BACKENDS = [
    Backend("flash_triton", _flash_supports, _flash_run),
    Backend("cpu", _cpu_supports, _cpu_run),
    Backend("reference", lambda call: None, _reference_run),
]
DISPATCH = Dispatcher("skip_attention", BACKENDS)

PRECISIONS = ("native", "fp8")
logger = logging.getLogger("sparsepatch.kernels")
_WARNED: set = set()


def _fp8_kernel_supports(call: Call) -> str | None:
    from . import fp8
    why = fp8_kernel_reason(call)
    if why:
        return why
    if not fp8.supports_tile(call.tile):
        return f"tile {call.tile} (runs tm in 64/128, tn a multiple of 64 <= 512)"
    return None


def _fp8_kernel_run(q, k, v, skip_list, threshold, **kw):
    from . import fp8
    kw.pop("attn_mask")
    q, k, v = unit_head_dim_stride(q, k, v)
    return fp8.skip_attention_fp8(q, k, v, skip_list, threshold, **kw)


def _fp8_emulated_supports(call: Call) -> str | None:
    if call.device != "cpu" or call.dtype == torch.float64:
        return "the emulation runs CPU float16/bfloat16/float32 inputs"
    return None


def _fp8_emulated_run(q, k, v, skip_list, threshold, **kw):
    from . import fp8
    return fp8.skip_attention_emulated(q, k, v, skip_list, threshold, **kw)


def _fp8_native_run(q, k, v, skip_list, threshold, **kw):
    warn_native_once(q, kw.get("tile"), kw.get("attn_mask") is not None)
    return skip_attention(q, k, v, skip_list, threshold, **kw)


def warn_native_once(q, tile, masked=False) -> None:
    key = (q.shape[-1], q.dtype, q.device.type, tuple(tile or ()), masked)
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning("sparsepatch: no fp8 skip kernel for head dim %d, %s on %s, tile %s%s; running native "
                       "precision", key[0], key[1], key[2], key[3], " with an attention mask" if masked else "")


FP8_BACKENDS = [
    Backend("fp8_triton", _fp8_kernel_supports, _fp8_kernel_run),
    Backend("fp8_emulated", _fp8_emulated_supports, _fp8_emulated_run),
    Backend("native", lambda call: None, _fp8_native_run),
]
FP8_DISPATCH = Dispatcher("skip_attention_fp8", FP8_BACKENDS)


def check_precision(precision) -> str:
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


def check_inference(q, k, v) -> None:
    """precision='fp8' is inference-only: a call whose inputs require grad raises."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("precision='fp8' skip attention is inference-only: q/k/v require grad (run under "
                         "torch.no_grad(), or use SkipConfig(precision='native') for training)")


def nonfinite_tiles(out: torch.Tensor, tm: int) -> torch.Tensor:
    """Bool (B, Hq, Tq): q-tiles whose output (B, Sq, Hq, D) holds a NaN or inf. No host sync."""
    B, Sq, Hq, _ = out.shape
    bad = ~torch.isfinite(out).all(-1)                       # (B, Sq, Hq)
    Tq = num_tiles(Sq, tm)
    pad = Tq * tm - Sq
    if pad:
        bad = torch.nn.functional.pad(bad, (0, 0, 0, pad))
    return bad.reshape(B, Tq, tm, Hq).any(2).transpose(1, 2)


def keep_read_where_nonfinite(out, read: SkipList, nxt: SkipList, must_do=None) -> SkipList:
    """nxt with every q-tile whose output is non-finite replaced by the tiles it read (plus must_do tiles)."""
    tm, tn = read.tile
    bad = nonfinite_tiles(out, tm)
    forced = reference.must_do_tiles(must_do, read.seq_q, read.seq_k, read.tile)
    if forced is None:
        counts = torch.where(bad, read.counts, nxt.counts)
        indices = torch.where(bad[..., None], read.indices, nxt.indices)
        return SkipList(counts, indices, nxt.tile, nxt.seq_q, nxt.seq_k)
    mask = torch.where(bad[..., None], read.to_mask() | forced.to(out.device), nxt.to_mask())
    return SkipList.from_mask(mask, nxt.tile, nxt.seq_q, nxt.seq_k)


def explain(q, k, v, skip_list=None, *, attn_mask=None, tile=DEFAULT_TILE, must_do=None, return_lse=False,
            backend=None, precision: str = "native"):
    """The route `skip_attention` takes for these inputs (`Route`: backend, reason, candidates)."""
    check_attention_inputs(q, k, v, attn_mask)
    tile = check_tile(tile if skip_list is None else skip_list.tile)
    disp = FP8_DISPATCH if check_precision(precision) == "fp8" else DISPATCH
    return disp.route(Call.of(disp.op, q, k, v, attn_mask=attn_mask, return_lse=return_lse, tile=tile,
                                  must_do=must_do), backend)


def skip_attention(q, k, v, skip_list: SkipList | None = None, threshold: float = -5.0, *, scale=None,
                   must_do=None, return_lse: bool = False, tile=DEFAULT_TILE, attn_mask=None,
                   backend: str | None = None, precision: str = "native"):
    """Temporal skip-list attention (DESIGN.md section 5; `reference.skip_attention` is the oracle).

    q (B, Sq, Hq, D), k/v (B, Sk, Hk, D); skip_list None = every tile on `tile`. Returns (out (B, Sq, Hq, D),
    next_list) or (out, next_list, lse (B, Hq, Sq) fp32). backend: force one of `BACKENDS` (precision "fp8": of
    `FP8_BACKENDS`). precision: "native" or "fp8" (inference only: the skip semantics on the fp8-quantized scores,
    see the module docstring; inputs that require grad raise).
    """
    check_attention_inputs(q, k, v, attn_mask, scale)
    fp8 = check_precision(precision) == "fp8"
    if fp8:
        check_inference(q, k, v)
    threshold = reference.check_threshold(threshold)
    B, Sq, Hq = q.shape[:3]
    Sk = k.shape[1]
    if skip_list is None:
        tile = check_tile(tile)
        skip_list = SkipList.full(B, Hq, Sq, Sk, tile, device=q.device)
    else:
        reference.check_skip_list(skip_list, B, Hq, Sq, Sk)
        tile = skip_list.tile
    if Sk == 0 or Sq == 0:
        raise ValueError(f"q and k must hold at least one token for skip attention, got Sq={Sq}, Sk={Sk}")
    disp = FP8_DISPATCH if fp8 else DISPATCH
    route = disp.route(Call.of(disp.op, q, k, v, attn_mask=attn_mask, return_lse=return_lse,
                               tile=tile, must_do=must_do), backend)
    res = disp.backends[route.backend].run(q, k, v, skip_list, threshold, scale=scale, must_do=must_do,
                                               return_lse=bool(return_lse), tile=tile, attn_mask=attn_mask)
    nxt = keep_read_where_nonfinite(res[0], skip_list, res[1], must_do)
    return (res[0], nxt) + tuple(res[2:])
