"""Patch configurations: one dataclass per attention method. Data only; validated on construction: a field of
the wrong type or out of range raises ValueError naming the field and what it accepts."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from .kernels import DEFAULT_TILE

PRECISIONS = ("native", "fp8")


def _int(name: str, value, minimum: int) -> int:
    """An integer >= minimum (bools and floats refused: 16.5 is not silently 16, True is not 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _choice(name: str, value, choices: tuple) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


@dataclass
class DenseConfig:
    """Route attention through the bundled dense flash kernel (no sparsity).

    layers: which attention layers to patch: "self" (self/joint attention only) or "all" (cross-attention too).
    precision: "native" (default: the inputs' fp16/bf16) or "fp8": inference-only low-precision forward (int8
        Q K^T with per-128-row scales, e4m3 P V with per-channel V scales; cos-sim ~0.999 vs bf16, see
        BENCHMARKS.md). Runs the fp8 Triton kernel on Hopper CUDA at head dim 64/128 without a mask; on CPU the
        reference on the same quantized q/k/v (emulation); on CUDA inputs the fp8 kernel cannot serve, the native
        kernel with a one-time warning. A call that needs gradients raises.
    """

    layers: str = "all"
    precision: str = "native"

    def __post_init__(self):
        _choice("layers", self.layers, ("self", "all"))
        _choice("precision", self.precision, PRECISIONS)


@dataclass
class SkipConfig:
    """Temporal skip-list attention (LiteAttention) for diffusion transformers.

    threshold: log2 units relative to the running row max, < 0 (-1 ~ 50%, -5 ~ 3%, -10 ~ 0.1%); tiles whose
        scores never come within it of the running max are skipped at every later step.
    warmup_steps: the first N denoising steps of each (layer, branch) run dense and leave the lists untouched.
    tile: (tm, tn) tokens per skip tile; positive multiples of 16 (the Triton kernel supports (128, 128) and
        (64, 64)).
    must_do: extra token ranges [(start, end), ...] (ints, 0 <= start < end) always computed, on top of the text
        tokens of joint attention that the adapter adds itself.
    backward: training mode: the backward also skips the tiles the forward found negligible.
    layers: "self" (default; cross-attention stays dense) — the only supported value for skip lists.
    precision: "native" (default: the inputs' fp16/bf16) or "fp8": inference-only skip lists on 8-bit attention
        (int8 Q K^T with per-128-row q/k scales, e4m3 P V with per-channel V scales, as DenseConfig's): the keep
        test runs on the quantized scores, so a tile whose gain lies within the quantization error of the
        threshold can be kept where bf16 drops it or the reverse (BENCHMARKS.md gives the measured fraction).
        Runs the fp8 skip kernel on Hopper CUDA at head dim 64/128 with tm in (64, 128); on CPU the reference on
        the same quantized q/k/v (emulation); elsewhere native precision with a one-time warning. The dense calls
        of the patch (warm-up steps, cross-attention) run `attention_fp8`. A call that needs gradients raises;
        backward=True is refused.
    """

    threshold: float = -5.0
    warmup_steps: int = 1
    tile: tuple = DEFAULT_TILE
    must_do: list | None = None
    backward: bool = False
    layers: str = "self"
    precision: str = "native"

    def __post_init__(self):
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or math.isnan(t) or not t < 0:
            raise ValueError(f"threshold must be a real number < 0 (log2 units relative to the running row max: "
                             f"-1 ~ 50%, -5 ~ 3%, -10 ~ 0.1%), got {t!r}")
        self.threshold = float(t)
        self.warmup_steps = _int("warmup_steps", self.warmup_steps, 0)
        tile = self.tile
        if isinstance(tile, (str, bytes)) or not hasattr(tile, "__len__") or len(tile) != 2:
            raise ValueError(f"tile must be a pair (tm, tn) of positive multiples of 16, got {tile!r}")
        tm, tn = (_int("tile", x, 16) for x in tile)
        if tm % 16 or tn % 16:
            raise ValueError(f"tile must be a pair (tm, tn) of positive multiples of 16, got {tile!r}")
        self.tile = (tm, tn)
        if self.must_do is not None:
            ranges = []
            if isinstance(self.must_do, (str, bytes)) or not hasattr(self.must_do, "__iter__"):
                raise ValueError(f"must_do must be None or a list of (start, end) token ranges, got {self.must_do!r}")
            for r in self.must_do:
                if isinstance(r, (str, bytes)) or not hasattr(r, "__len__") or len(r) != 2:
                    raise ValueError(f"must_do must be a list of (start, end) token ranges, got the item {r!r}")
                a, b = _int("must_do start", r[0], 0), _int("must_do end", r[1], 0)
                if not a < b:
                    raise ValueError(f"must_do ranges need 0 <= start < end, got {r!r}")
                ranges.append((a, b))
            self.must_do = ranges
        self.backward = _bool("backward", self.backward)
        if self.layers != "self":
            raise ValueError(f"layers must be 'self' for SkipConfig (cross-attention has no temporal lists), "
                             f"got {self.layers!r}")
        _choice("precision", self.precision, PRECISIONS)
        if self.precision == "fp8" and self.backward:
            raise ValueError("precision='fp8' is inference-only: it cannot be combined with backward=True")


@dataclass
class NSAConfig:
    """Native Sparse Attention (compressed + selected + sliding window, gated).

    selection: "token" (default) ranks blocks per query token; "tile" ranks them once per selection tile (the
    `block_size` query positions of one selection block) from the importance of the tile's first position, and every
    token of the tile attends to those blocks (causal: the first position precedes the rest; the per-token causal
    mask inside the local block stays). "tile" lets a tile's tokens share K/V loads (fast for small GQA groups and
    MHA) at a small quality cost (BENCHMARKS.md, selection granularity).
    """

    block_size: int = 64
    num_selected: int = 16
    window: int = 512
    compress_block: int = 32
    compress_stride: int = 16
    gates: str = "uniform"
    selection: str = "token"

    def __post_init__(self):
        for name in ("block_size", "num_selected", "window", "compress_block", "compress_stride"):
            setattr(self, name, _int(name, getattr(self, name), 1))
        _choice("gates", self.gates, ("uniform", "learned"))
        _choice("selection", self.selection, ("token", "tile"))


@dataclass
class LightningConfig:
    """Lightning (linear) attention layers of MiniMax models.

    state_dtype: storage of the recurrent (K, V) state per head in the model's cache: "float32" (default),
        "bfloat16" (half the decode bytes; math stays fp32, one rounding per step, drift in BENCHMARKS.md) or
        "float16" (can overflow on slowly decaying heads).
    """

    state_dtype: str = "float32"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        _choice("state_dtype", self.state_dtype, ("float32", "bfloat16", "float16"))
        if not isinstance(self.extra, dict):
            raise ValueError(f"extra must be a dict, got {self.extra!r} ({type(self.extra).__name__})")
