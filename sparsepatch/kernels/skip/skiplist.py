"""The skip-list format shared by the reference and the Triton skip-attention kernels.

A skip list says, for every (batch element, query head, q-tile), which k-tiles an attention call computes.
It is the only thing the patcher knows about the kernels' tiling.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_TILE = (128, 128)


def check_tile(tile) -> tuple[int, int]:
    """Validate a (tm, tn) skip-tile size: two positive multiples of 16."""
    try:
        tm, tn = (int(t) for t in tile)
    except (TypeError, ValueError):
        raise ValueError(f"tile must be a pair of ints (tm, tn), got {tile!r}") from None
    if tm <= 0 or tn <= 0 or tm % 16 or tn % 16:
        raise ValueError(f"tile must be two positive multiples of 16, got {tile!r}")
    return tm, tn


def num_tiles(seq_len: int, tile_len: int) -> int:
    """Number of tiles of `tile_len` covering `seq_len` tokens (the last one may be partial)."""
    return -(-seq_len // tile_len)


@dataclass
class SkipList:
    """Per-row lists of the k-tiles an attention call computes.

    counts:  int32 (B, H, Tq): how many k-tiles row (b, h, i) computes.
    indices: int32 (B, H, Tq, Tk): the row's k-tile indices, ascending, in the first `counts` slots;
             the slots after `counts` are unspecified (kernels never read them).
    tile:    (tm, tn) tokens per q-tile and per k-tile.
    seq_q, seq_k: the sequence lengths the list was made for (Tq = ceil(seq_q / tm), Tk = ceil(seq_k / tn)).
    H counts query heads.
    """

    counts: torch.Tensor
    indices: torch.Tensor
    tile: tuple[int, int]
    seq_q: int
    seq_k: int

    def __post_init__(self):
        self.tile = check_tile(self.tile)
        if self.counts.dim() != 3 or self.indices.dim() != 4 or self.indices.shape[:3] != self.counts.shape:
            raise ValueError(
                f"counts must be (B, H, Tq) and indices (B, H, Tq, Tk); got {tuple(self.counts.shape)} "
                f"and {tuple(self.indices.shape)}"
            )
        tq, tk = num_tiles(self.seq_q, self.tile[0]), num_tiles(self.seq_k, self.tile[1])
        if self.indices.shape[2:] != (tq, tk):
            raise ValueError(
                f"indices have {tuple(self.indices.shape[2:])} tiles but seq_q={self.seq_q}, seq_k={self.seq_k} "
                f"with tile={self.tile} need ({tq}, {tk})"
            )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, H, Tq, Tk)."""
        return tuple(self.indices.shape)

    @classmethod
    def full(cls, B: int, H: int, Sq: int, Sk: int, tile=DEFAULT_TILE, device=None) -> "SkipList":
        """The list that computes every tile (what a first call uses)."""
        tm, tn = check_tile(tile)
        tq, tk = num_tiles(Sq, tm), num_tiles(Sk, tn)
        indices = torch.arange(tk, dtype=torch.int32, device=device).expand(B, H, tq, tk).contiguous()
        counts = torch.full((B, H, tq), tk, dtype=torch.int32, device=device)
        return cls(counts, indices, (tm, tn), Sq, Sk)

    @classmethod
    def from_mask(cls, mask: torch.Tensor, tile=DEFAULT_TILE, seq_q: int | None = None,
                  seq_k: int | None = None) -> "SkipList":
        """Build from a bool mask (B, H, Tq, Tk), True = compute. seq_q/seq_k default to whole tiles."""
        if mask.dtype != torch.bool or mask.dim() != 4:
            raise ValueError(f"mask must be a bool tensor (B, H, Tq, Tk), got {mask.dtype} {tuple(mask.shape)}")
        tm, tn = check_tile(tile)
        tq, tk = mask.shape[2:]
        seq_q = tq * tm if seq_q is None else seq_q
        seq_k = tk * tn if seq_k is None else seq_k
        counts = mask.sum(-1, dtype=torch.int32)
        # Stable sort on "not kept" puts kept tiles first, in ascending tile order.
        order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)
        return cls(counts, order.to(torch.int32), (tm, tn), seq_q, seq_k)

    def to_mask(self) -> torch.Tensor:
        """Bool (B, H, Tq, Tk), True where the tile is computed."""
        tk = self.indices.shape[-1]
        slot = torch.arange(tk, device=self.indices.device)
        valid = slot < self.counts.unsqueeze(-1)
        idx = torch.where(valid, self.indices.long(), 0)
        hits = torch.zeros(self.indices.shape, dtype=torch.int32, device=self.indices.device)
        hits.scatter_add_(-1, idx, valid.to(torch.int32))   # add, not assign: unused slots also point at tile 0
        return hits > 0

    def density(self, dim=None) -> torch.Tensor:
        """Fraction of tiles computed: a 0-dim tensor, or per index along `dim` (e.g. dim=0 -> per batch)."""
        tk = self.indices.shape[-1]
        frac = self.counts.to(torch.float32) / tk
        if dim is None:
            return frac.mean()
        dims = [d for d in range(3) if d != dim]
        return frac.mean(dim=dims)

    def equal(self, other: "SkipList") -> bool:
        """Same tiles computed (slots after counts are ignored)."""
        return (self.tile == other.tile and self.shape == other.shape
                and torch.equal(self.to_mask().cpu(), other.to_mask().cpu()))

    def clone(self) -> "SkipList":
        return SkipList(self.counts.clone(), self.indices.clone(), self.tile, self.seq_q, self.seq_k)

    def to(self, device) -> "SkipList":
        return SkipList(self.counts.to(device), self.indices.to(device), self.tile, self.seq_q, self.seq_k)
