"""In-kernel writer of the next skip list (`SkipList` format: count + ascending indices per q-tile), shared by the
Triton (`triton.py`) and fp8 (`fp8.py`) skip forward kernels."""
from __future__ import annotations

import triton
import triton.language as tl

from .._common import popc32

CHUNK = 32  # visited tiles per keep-bit word (one int32)
CHUNK_C = tl.constexpr(CHUNK)


@triton.jit
def write_next_list(words, keep1, head, idx_in, idx_out, cnt_out, FCOL, n_plain, Tk, warm, write_ok, frow,
                    NWORDS: tl.constexpr, STATEFUL: tl.constexpr, HAS_FORCED: tl.constexpr,
                    HEAD_CHUNK: tl.constexpr, POPC: tl.constexpr, SUM_AFTER_STORE: tl.constexpr):
    """Write one q-tile's next list from its keep bits.

    words (NWORDS,) int32: bit i of word w set iff visited tile 32 w + i (of the listed full k-tiles
    0 .. n_plain - 1, whose indices are idx_in[0:n_plain]; with warm, tile `it` is index `it`) passed the keep test.
    keep1 (int32 0 / 1): the partial last k-tile (index Tk - 1) was visited and kept; it is the largest index, so
    it goes last. HAS_FORCED: forced columns (FCOL (Tk,) int8 != 0) and forced rows (frow 1) are kept too.
    HEAD_CHUNK: head holds idx_in[0:32] already (else unused). POPC (not with HAS_FORCED): each kept index is placed
    by a popcount of the keep word below its lane (no scan, no cross-thread sum). SUM_AFTER_STORE (without POPC):
    the chunk's kept count is reduced after its index store instead of before (the fp8 kernel's instruction order).
    Writes the kept indices ascending to idx_out and their count to *cnt_out; STATEFUL: only where write_ok."""
    widx = tl.arange(0, NWORDS)
    offs_c = tl.arange(0, CHUNK_C)
    out_cnt = tl.full([], 0, tl.int32)
    for c0 in range(0, n_plain, CHUNK_C):
        c1 = tl.minimum(c0 + CHUNK_C, n_plain)
        word = tl.sum(tl.where(widx == (c0 >> 5), words, 0), 0)
        inb = offs_c < (c1 - c0)
        if HEAD_CHUNK:  # the first chunk is already in registers
            jv = tl.where(c0 == 0, head, tl.load(idx_in + c0 + offs_c, mask=inb & (c0 > 0), other=0))
        else:
            jv = tl.load(idx_in + c0 + offs_c, mask=inb, other=0)
        if STATEFUL:
            jv = tl.where(warm, c0 + offs_c, jv)
        keep = (((word >> offs_c) & 1) != 0) & inb
        if HAS_FORCED:
            fc = (tl.load(FCOL + jv, mask=inb, other=0) != 0).to(tl.int32)
            keep = ((keep.to(tl.int32) | fc | frow) != 0) & inb
        if POPC and not HAS_FORCED:
            # kept bits of this chunk; lane i goes to out_cnt + (kept bits below i)
            wv = word & tl.where(c1 - c0 >= 32, -1, (1 << (c1 - c0)) - 1)
            pos = out_cnt + popc32(wv & ((1 << offs_c) - 1))
            nk = popc32(wv)
        else:
            ki = keep.to(tl.int32)
            pos = out_cnt + tl.cumsum(ki, 0) - ki
            if not SUM_AFTER_STORE:
                nk = tl.sum(ki, 0)
        if STATEFUL:
            keep_w = (keep.to(tl.int32) & write_ok) != 0
        else:
            keep_w = keep
        tl.store(idx_out + pos, jv, mask=keep_w)
        if SUM_AFTER_STORE and not (POPC and not HAS_FORCED):
            nk = tl.sum(keep.to(tl.int32), 0)
        out_cnt += nk
    if STATEFUL:
        keep1_w = (keep1 & write_ok) != 0
    else:
        keep1_w = keep1 != 0
    tl.store(idx_out + out_cnt, Tk - 1, mask=keep1_w)
    out_cnt += keep1
    if STATEFUL:
        tl.store(cnt_out, out_cnt, mask=write_ok != 0)
    else:
        tl.store(cnt_out, out_cnt)
    return out_cnt
