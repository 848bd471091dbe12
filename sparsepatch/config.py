"""Patch configurations: one dataclass per attention method. Data only; validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from .kernels.skip.reference import check_threshold
from .kernels.skip.skiplist import DEFAULT_TILE, check_tile

PRECISIONS = ("native", "fp8")


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
        if self.layers not in ("self", "all"):
            raise ValueError(f"layers must be 'self' or 'all', got {self.layers!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")


@dataclass
class SkipConfig:
    """Temporal skip-list attention (LiteAttention) for diffusion transformers.

    threshold: log2 units relative to the running row max, < 0 (-1 ~ 50%, -5 ~ 3%, -10 ~ 0.1%); tiles whose
        scores never come within it of the running max are skipped at every later step.
    warmup_steps: the first N denoising steps of each (layer, branch) run dense and leave the lists untouched.
    tile: (tm, tn) tokens per skip tile; multiples of 16 (the Triton kernel supports (128, 128) and (64, 64)).
    must_do: extra token ranges [(start, end), ...] always computed, on top of the text tokens of joint
        attention that the adapter adds itself.
    backward: training mode: the backward also skips the tiles the forward found negligible.
    layers: "self" (default; cross-attention stays dense) — the only supported value for skip lists.
    """

    threshold: float = -5.0
    warmup_steps: int = 1
    tile: tuple = DEFAULT_TILE
    must_do: list | None = None
    backward: bool = False
    layers: str = "self"

    def __post_init__(self):
        self.threshold = check_threshold(self.threshold)
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        self.tile = check_tile(self.tile)
        if self.layers != "self":
            raise ValueError(f"layers must be 'self' for SkipConfig (cross-attention has no temporal lists), "
                             f"got {self.layers!r}")
        if self.must_do is not None:
            self.must_do = [tuple(int(x) for x in r) for r in self.must_do]


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
            val = getattr(self, name)
            if not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if self.gates not in ("uniform", "learned"):
            raise ValueError(f"gates must be 'uniform' or 'learned', got {self.gates!r}")
        if self.selection not in ("token", "tile"):
            raise ValueError(f"selection must be 'token' or 'tile', got {self.selection!r}")


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
        if self.state_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"state_dtype must be 'float32', 'bfloat16' or 'float16', got {self.state_dtype!r}")
