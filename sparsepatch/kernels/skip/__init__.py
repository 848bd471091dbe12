"""Temporal skip-list attention: `skip_attention` (one call, explicit lists) and `skip_step` (lists carried across
calls in device buffers, the patcher's path), with `SkipList` / `SkipListBuffers`."""
from .op import BACKENDS, explain, skip_attention
from .skiplist import DEFAULT_TILE, SkipList, num_tiles
from .stateful import MAX_CALLS, SkipListBuffers, skip_step, skip_step_differentiable

__all__ = ["skip_attention", "explain", "skip_step", "skip_step_differentiable", "SkipList", "SkipListBuffers",
           "DEFAULT_TILE", "MAX_CALLS", "num_tiles", "BACKENDS"]
