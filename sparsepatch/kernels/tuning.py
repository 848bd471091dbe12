"""Measure the dense dispatcher's cost table on this GPU: every backend of `attention` at a grid of shapes.

`tune()` measures the default grid (about 2-4 minutes on an H100, kernels compiled included), writes the table to
`dispatch.user_table_path` (or `path`) and uses it from then on. `measure(cells)` is the building block the
never-slower benchmark shares.
"""
from __future__ import annotations

import itertools
import json
import os
import time

import torch

from . import dispatch
from .dense import op as dense_op

# (causal, D, heads, kv heads): the shapes users run (non-causal video DiTs, causal LLM prefill), MHA and GQA 4
PREFILL_SEQS = (1024, 4096, 16384, 32768)
TOKENS = 16384                     # B * S per cell (one sequence at S >= 16K... 32K: B = 1)
DECODE_KEYS = (1024, 8192, 32768)
DECODE_BATCHES = (1, 16)


def heads_for(D: int) -> int:
    return 16 if D >= 256 else 32


def default_cells(dtypes=(torch.bfloat16, torch.float16), head_dims=(64, 128, 256)) -> list:
    """Prefill cells (B, Sq, Sk, Hq, Hk, D, causal, dtype) with B * S = 16K (B = 1 at 32K), plus decode cells
    (Sq = 1, causal: bottom-right = every key) at B 1 / 16."""
    cells = []
    for dtype, D, causal, gqa, S in itertools.product(dtypes, head_dims, (False, True), (1, 4), PREFILL_SEQS):
        H = heads_for(D)
        cells.append((max(TOKENS // S, 1), S, S, H, H // gqa, D, causal, dtype))
    for D, gqa, Sk, B in itertools.product(head_dims, (1, 4), DECODE_KEYS, DECODE_BATCHES):
        H = heads_for(D)
        cells.append((B, 1, Sk, H, H // gqa, D, True, torch.bfloat16))
    return cells


def _bench(fn, rep: int = 40) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def cell_inputs(cell, seed=0, layout="seq"):
    """Random (B, S, H, D) q, k, v of a cell: contiguous ("seq"), or ("head") the (B, S, H, D) views of contiguous
    (B, H, S, D) tensors, as SDPA callers (diffusers, transformers) hand them over."""
    B, Sq, Sk, Hq, Hk, D, causal, dtype = cell
    g = torch.Generator(device="cuda").manual_seed(seed)
    if layout not in ("seq", "head"):
        raise ValueError(f"layout must be 'seq' or 'head', got {layout!r}")
    if layout == "head":
        return tuple(torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
                     for S, H in ((Sq, Hq), (Sk, Hk), (Sk, Hk)))
    q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Sk, Hk, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Sk, Hk, D, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def measure(cells, backends=None, log=print, layout="seq", grad=False, rep: int = 40) -> list:
    """Time every backend of `attention` that supports each cell -> table entries (dispatch.CostTable JSON), on
    inputs of `layout` (`cell_inputs`; "head" entries carry "layout": "head"). grad: q / k / v require grad and
    each time is forward plus the backward of a fixed random dO (entries of op "attention+backward", which cost the
    calls that need gradients). rep: do_bench's time budget per backend, ms (a 100-ms call gets one repetition at 40).
    A backend that raises is recorded as unavailable (no entry), with the error logged."""
    names = backends or [b.name for b in dense_op.BACKENDS if b.name != "reference"]
    entries = []
    for cell in cells:
        B, Sq, Sk, Hq, Hk, D, causal, dtype = cell
        q, k, v = cell_inputs(cell, layout=layout)
        if grad:
            q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
            dout = torch.randn(q.shape[:3] + v.shape[3:], device=q.device, dtype=q.dtype)
        call = dispatch.Call.of("attention", q, k, v, causal=causal)
        ms = {}
        for name in names:
            b = dense_op.DISPATCH.backends[name]
            if b.supports(call):
                continue

            def fn(b=b):
                out = b.run(q, k, v, causal=causal, scale=None, attn_mask=None, return_lse=False)
                return torch.autograd.grad(out, (q, k, v), dout) if grad else out
            try:
                fn()
                torch.cuda.synchronize()
                ms[name] = _bench(fn, rep)
            except Exception as exc:  # noqa: BLE001  (a kernel that cannot run this shape here)
                log(f"  {name} failed at {cell[:7]}: {type(exc).__name__}: {str(exc)[:120]}")
        entries.append(dict(op="attention+backward" if grad else "attention", causal=causal, D=D, group=Hq // Hk,
                            dtype=str(dtype).replace("torch.", ""), B=B, Sq=Sq, Sk=Sk, Hq=Hq, ms=ms,
                            **({"layout": "head"} if layout == "head" else {})))
        del q, k, v
    return entries


def tune(path: str | None = None, cells=None, log=print) -> dispatch.CostTable:
    """Measure the cost table on this GPU, write it (default: `dispatch.user_table_path`) and use it."""
    if not torch.cuda.is_available():
        raise RuntimeError("tune() needs a CUDA GPU")
    arch = torch.cuda.get_device_capability()
    t0 = time.time()
    entries = measure(cells or default_cells(), log=log)
    data = dict(device=torch.cuda.get_device_name(), arch=list(arch), torch=torch.__version__,
                measured=time.strftime("%Y-%m-%d"), seconds=round(time.time() - t0, 1), entries=entries)
    path = path or dispatch.user_table_path(arch)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=0)
    table = dispatch.CostTable(data, source=path)
    dispatch.set_cost_table(table)
    log(f"sparsepatch: cost table of {len(entries)} cells measured in {data['seconds']} s -> {path}")
    return table
