"""One dispatcher for every op: an ordered list of backends per op; a call runs the cheapest one that supports it.

A backend computes the same function as its op's reference. It says whether it runs a call (`supports(call)` ->
None, or the reason it does not) and how to run it. Cost: milliseconds from a measured table, keyed by what decides
speed (op, causal, head dim, GQA group, dtype, and the nearest measured sequence lengths and batch x heads). The
table for sm_90 (H100/H200) ships in `cost_tables/`; `sparsepatch.kernels.tune()` measures the user's GPU once and
caches it; `SPARSEPATCH_COST_TABLE=<file>` names another. Where no backend of a call has a measurement (an unknown
GPU, a head dim never measured) the op's `prefer(call)` order decides: for dense attention that puts torch SDPA
first, so an unmeasured case runs what the user had.

Routes are cached per call shape, so a call costs one dict lookup; `explain(call)` returns the route with every
candidate, its reason and its cost.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

logger = logging.getLogger("sparsepatch.kernels")

_TABLE_DIR = os.path.join(os.path.dirname(__file__), "cost_tables")


@dataclass(frozen=True)
class Call:
    """What a backend needs to know to decide support and cost. Shapes: q (B, Sq, Hq, D), k (B, Sk, Hk, D),
    v (B, Sk, Hk, Dv)."""

    op: str
    device: str
    arch: tuple | None            # CUDA compute capability, None off CUDA
    dtype: torch.dtype
    batch: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_k: int
    head_dim: int
    head_dim_v: int
    causal: bool = False
    mask: str | None = None       # None, "bool" or "float"
    return_lse: bool = False
    needs_grad: bool = False
    tile: tuple | None = None     # skip ops
    must_do: bool = False
    interpret: bool = False       # TRITON_INTERPRET=1: Triton kernels run on CPU tensors
    params: tuple = ()            # op parameters that decide support (NSA: block sizes), hashable
    layouts: tuple = ()           # `memory_layout` of q, k, v (what a kernel's speed may depend on)

    @property
    def group(self) -> int:
        return self.heads_q // max(self.heads_k, 1)

    @staticmethod
    def of(op: str, q, k, v, *, causal=False, attn_mask=None, return_lse=False, tile=None, must_do=None,
           params=()) -> "Call":
        dev = q.device
        arch = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
        mask = None if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "float")
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return Call(op, dev.type, arch, q.dtype, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2],
                    q.shape[3], v.shape[3], bool(causal), mask, bool(return_lse), needs_grad,
                    None if tile is None else tuple(tile), bool(must_do),
                    os.environ.get("TRITON_INTERPRET", "0") == "1", tuple(params),
                    tuple(memory_layout(t) for t in (q, k, v)))


def memory_layout(t) -> str:
    """How a (B, S, H, D) tensor lies in memory: "seq" (sequence-major: unit-stride D, heads adjacent, one row stride
    over B * S, as a (B, S, H * D) projection or a fused-QKV view), "head" (the transposed view of a contiguous
    (B, H, S, D) tensor, as SDPA callers hand over) or "other" (also anything not 4-D: the op's checks name it)."""
    if t.dim() != 4:
        return "other"
    B, S, H, D = t.shape
    st = t.stride()
    if st[3] != 1 and D > 1:
        return "other"
    if (H == 1 or st[2] == D) and (B == 1 or st[0] == S * st[1]):
        return "seq"
    if (S == 1 or st[1] == D) and (H == 1 or st[2] == S * D) and (B == 1 or st[0] == H * S * D):
        return "head"
    return "other"


@dataclass(frozen=True)
class Backend:
    """name: what `stats()["backends"]` and `explain` show. supports(call) -> None or why not. run(*args, **kw):
    the op's signature."""

    name: str
    supports: Callable[[Call], "str | None"]
    run: Callable
    host_ms: float = 0.0     # host time a call adds beyond what the table measured (added to the table's cost)
    # whether the table's measurements of this backend hold for a call (None: always); where they do not (e.g. the
    # measured kernel cannot take the call's layout and a slower one runs it), the backend counts as unmeasured
    measured_for: Callable[[Call], bool] | None = None
    # what an unpatched model runs (SDPA's kernels): kept unless another backend measured more than BASELINE_MARGIN
    # faster (`Dispatcher._decide`)
    baseline: bool = False


@dataclass(frozen=True)
class Route:
    """The backend a call gets, why, and every candidate as (name, reason it cannot run or None, cost ms or None)."""

    op: str
    backend: str
    reason: str
    candidates: tuple

    def __str__(self) -> str:
        rows = [f"{self.op} -> {self.backend}: {self.reason}"]
        for name, why, cost in self.candidates:
            state = f"cannot run: {why}" if why else ("no measurement" if cost is None else f"{cost:.4f} ms")
            rows.append(f"  {name:16s} {state}")
        return "\n".join(rows)


# ------------------------------------------------------------------------------------------------- cost table

def _bucket(n: int) -> float:
    return math.log2(max(int(n), 1))


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


class CostTable:
    """Measured milliseconds per backend at grid points. JSON: {"device": str, "entries": [{"op", "causal", "D",
    "group", "dtype", "B", "Sq", "Sk", "Hq", "ms": {backend: ms}, optional "layout": "seq" (default) or "head"}]}. A
    call is costed at the nearest point of its (op, causal, D, GQA or not, dtype, layout) class in log2 (Sq, Sk,
    B * Hq) space (a call whose q is a head-major view uses head-major points where there are any). A call
    that needs gradients is costed by entries of op "<op>+backward" (forward plus backward times) only: a forward that
    wins says nothing about its backward, so without such entries training calls take the default order (SDPA, what an
    unpatched model runs)."""

    def __init__(self, data: dict | None = None, source: str = "empty"):
        self.source = source
        self.device = (data or {}).get("device", "")
        self._points: dict = {}
        for e in (data or {}).get("entries", []):
            key = (e["op"], bool(e["causal"]), int(e["D"]), int(e["group"]) > 1, e["dtype"], e.get("layout", "seq"))
            pos = (_bucket(e["Sq"]), _bucket(e["Sk"]), _bucket(e["B"] * e["Hq"]))
            self._points.setdefault(key, []).append((pos, dict(e["ms"])))

    def __len__(self) -> int:
        return sum(len(v) for v in self._points.values())

    def costs(self, call: Call) -> dict:
        """{backend: ms} at the nearest measured point of the call's class, or {}."""
        dtype = _dtype_name(call.dtype)
        alt = {"bfloat16": "float16", "float16": "bfloat16"}.get(dtype, dtype)
        op = call.op + "+backward" if call.needs_grad else call.op
        # a head-major q (what SDPA callers hand over; k / v may differ, e.g. CogVideoX's v) is costed by head-major
        # entries where the table has them: SDPA's kernels and ours do not rank the same on both layouts
        layouts = ("head", "seq") if call.layouts and call.layouts[0] == "head" else ("seq",)
        for lay, dt in ((lay, dt) for lay in layouts for dt in (dtype, alt)):
            points = self._points.get((op, call.causal, call.head_dim, call.group > 1, dt, lay))
            if points:
                break
        else:
            return {}
        pos = (_bucket(call.seq_q), _bucket(call.seq_k), _bucket(call.batch * call.heads_q))
        # decode (Sq = 1) and prefill are different regimes: Sq weighs most
        best = min(points, key=lambda p: 4 * abs(p[0][0] - pos[0]) + abs(p[0][1] - pos[1]) + abs(p[0][2] - pos[2]))
        return best[1]


_TABLE: list = [None]


def _arch_name(arch) -> str:
    return f"sm{arch[0]}{arch[1]}"


def user_table_path(arch) -> str:
    """Where `tune()` caches the table for this GPU."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    name = torch.cuda.get_device_name().replace(" ", "_") if torch.cuda.is_available() else "cpu"
    return os.path.join(root, "sparsepatch", f"cost_{_arch_name(arch)}_{name}.json")


def cost_table(arch=None) -> CostTable:
    """The table in use: $SPARSEPATCH_COST_TABLE, else this GPU's `tune()` cache, else the shipped table of its
    architecture, else an empty table (every call then follows the op's `prefer` order)."""
    if _TABLE[0] is not None:
        return _TABLE[0]
    paths = [os.environ.get("SPARSEPATCH_COST_TABLE")]
    if arch is None and torch.cuda.is_available():
        arch = torch.cuda.get_device_capability()
    if arch is not None:
        paths += [user_table_path(arch), os.path.join(_TABLE_DIR, f"{_arch_name(arch)}.json")]
    table = CostTable()
    for p in paths:
        if p and os.path.exists(p):
            with open(p) as f:
                table = CostTable(json.load(f), source=p)
            break
    set_cost_table(table)
    return table


def set_cost_table(table: CostTable | None) -> None:
    """Use `table` from now on (None: load again on the next call). Clears every cached route."""
    _TABLE[0] = table
    for d in _DISPATCHERS.values():
        d.clear()
    for hook in _ON_CLEAR:
        hook()


_ON_CLEAR: list = []   # callbacks that drop route caches kept outside the dispatchers (the ops' fast paths)


# ------------------------------------------------------------------------------------------------- dispatcher

def length_class(seq_q: int, seq_k: int) -> tuple:
    """What a route depends on in the sequence lengths: decode or not, the Sq / Sk relation (causal alignment, and
    for more than one query whether Sk - Sq is a multiple of 128, the largest kernel key tile), an empty key set,
    and the lengths' power-of-two buckets (the cost table's resolution)."""
    return (seq_q == 1, seq_q == seq_k, seq_q > seq_k, seq_q > 1 and (seq_k - seq_q) % 128 == 0, seq_k == 0,
            int(seq_q).bit_length(), int(seq_k).bit_length())


def _route_key(call: Call) -> tuple:
    return (dataclasses.replace(call, seq_q=0, seq_k=0), length_class(call.seq_q, call.seq_k))


_DISPATCHERS: dict = {}
_ROUTE_CACHE_MAX = 4096
# A backend that is not a baseline must measure more than this fraction faster than the fastest measured baseline
# to replace it. The same kernel's ratio to SDPA moved by up to 3% between two table runs on one H200 (non-causal
# D64: 1.01-1.04 in session 14, 0.96-1.01 in session 15), so a smaller lead is not known to be one, and never
# slower than unpatched comes first.
BASELINE_MARGIN = 0.02


class Dispatcher:
    """Routes calls of one op over its backends. prefer(call) -> backend names in the order used where no
    supported backend has a measured cost (names it omits come after, in list order)."""

    def __init__(self, op: str, backends: list, prefer: Callable[[Call], list] | None = None):
        names = [b.name for b in backends]
        if len(set(names)) != len(names):
            raise ValueError(f"backends of {op} must have distinct names, got {names}")
        self.op = op
        self.backends = {b.name: b for b in backends}
        self.prefer = prefer or (lambda call: names)
        self._routes: dict = {}
        self._logged: set = set()
        _DISPATCHERS[op] = self

    def clear(self) -> None:
        self._routes.clear()

    def route(self, call: Call, backend: str | None = None) -> Route:
        """The route for `call`; `backend` forces one (ValueError if it does not support the call)."""
        if backend is not None:
            b = self.backends.get(backend)
            if b is None:
                raise ValueError(f"backend must be one of {sorted(self.backends)} for {self.op}, got {backend!r}")
            why = b.supports(call)
            if why:
                raise ValueError(f"backend {backend!r} cannot run this {self.op} call: {why}")
            return Route(self.op, backend, "forced by the caller", ())
        key = _route_key(call)
        r = self._routes.get(key)
        if r is None:
            r = self._decide(call)
            if len(self._routes) >= _ROUTE_CACHE_MAX:
                self._routes.clear()
            self._routes[key] = r
            self._log(call, r)
        return r

    def _decide(self, call: Call) -> Route:
        costs = cost_table(call.arch).costs(call) if call.device == "cuda" else {}
        cands = []
        for b in self.backends.values():
            why = b.supports(call)
            cost = None if why or b.name not in costs or (b.measured_for is not None and not b.measured_for(call)) \
                else costs[b.name] + b.host_ms
            cands.append((b.name, why, cost))
        ok = [c for c in cands if c[1] is None]
        if not ok:
            raise ValueError(f"no backend of {self.op} runs this call: "
                             + "; ".join(f"{n}: {w}" for n, w, _ in cands))
        measured = [c for c in ok if c[2] is not None]
        if measured:
            name, _, ms = min(measured, key=lambda c: c[2])
            others = ", ".join(f"{n} {c:.3f}" for n, _, c in sorted(measured, key=lambda c: c[2]) if n != name)
            reason = f"fastest measured ({ms:.3f} ms{'; ' + others if others else ''})"
            base = [c for c in measured if self.backends[c[0]].baseline]
            if base and not self.backends[name].baseline:
                b_name, _, b_ms = min(base, key=lambda c: c[2])
                if b_ms <= ms * (1.0 + BASELINE_MARGIN):
                    reason = (f"the baseline: {b_name} {b_ms:.3f} ms is within {BASELINE_MARGIN:.0%} of the fastest "
                              f"measured, {name} {ms:.3f} ms")
                    name = b_name
        else:
            order = [n for n in self.prefer(call) if n in self.backends]
            order += [n for n in self.backends if n not in order]
            name = next(n for n in order if any(c[0] == n for c in ok))
            reason = "first supported in the default order (no measurement for this case)"
        return Route(self.op, name, reason, tuple(cands))

    def _log(self, call: Call, r: Route) -> None:
        key = (r.backend, call.device, call.causal, call.head_dim, int(_bucket(call.seq_q)), int(_bucket(call.seq_k)))
        if key not in self._logged:
            self._logged.add(key)
            logger.debug("sparsepatch: %s on %s (D %d, Sq %d, Sk %d, causal %s): %s -- %s", self.op, call.device,
                         call.head_dim, call.seq_q, call.seq_k, call.causal, r.backend, r.reason)


def dispatcher(op: str) -> Dispatcher:
    return _DISPATCHERS[op]


__all__ = ["Call", "Backend", "Route", "Dispatcher", "CostTable", "cost_table", "set_cost_table", "dispatcher",
           "user_table_path", "memory_layout"]
