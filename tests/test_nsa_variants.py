"""NSA forward switches (session 15): NSA_TMA (K / V through TMA descriptors) and CMP_MASK_SPLIT (unmasked full key
tiles in selection="tile"'s compressed launch), both on by default. Turning either off runs the same fp32
operations on the same values, so the selected blocks equal the default's and the reference's
exactly, and the outputs equal the default's (interpreter: bit for bit; GPU bf16: same indices, outputs within bf16
rounding of the default)."""
from __future__ import annotations

import os

import pytest
import torch

from kernel_checks import check_bound, max_err
from sparsepatch.config import NSAConfig
from sparsepatch.kernels.nsa import reference as ref
from test_nsa import _bf16_err, nsa_tol, rand

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not (CUDA or INTERPRET), reason="Triton kernels need CUDA or TRITON_INTERPRET=1")

SWITCHES = {
    "pointer_loads": dict(NSA_TMA=False),
    "no_split": dict(CMP_MASK_SPLIT=False),
    "neither": dict(NSA_TMA=False, CMP_MASK_SPLIT=False),
}
# block 16, compress 8 / 4 (R = 4, the last compressed block of each selection block spills into the next),
# 16-key compressed tiles: at T = 100 the last programs see 24 compressed blocks, so the mask-split loops run a full
# (unmasked) tile before the masked tail, and the descriptors cover tails that end mid-tile
CFG = dict(block_size=16, num_selected=3, window=24, compress_block=8, compress_stride=4)
# block 24 (loaded as 32-key boxes: the descriptor brings in the next block's first 8 keys, which the mask drops, and
# the last block's box runs past S)
CFG24 = dict(CFG, block_size=24, compress_block=12, compress_stride=3)
T_CPU = 100


@needs_triton
@pytest.mark.parametrize("selection, names, slc_rows, cfg_kw, T", [
    ("token", ["pointer_loads"], None, CFG, T_CPU),   # the tiny config routes to the token-tile kernel
    ("token", ["pointer_loads"], 0, CFG, 40),         # the per-token selected kernel (one program per token)
    ("token", ["pointer_loads"], 0, CFG24, 40),
    ("tile", list(SWITCHES), None, CFG, T_CPU)])
def test_switch_equals_default_and_reference(selection, names, slc_rows, cfg_kw, T, monkeypatch):
    """Each switch set (per-token selection: only the loads differ; tile selection: the mask split too) against the
    default kernels and the reference. slc_rows: nsa.SLC_TILE_ROWS (0 = the per-token selected kernel)."""
    from sparsepatch.kernels.nsa import forward as nsa
    dev = "cuda" if CUDA and not INTERPRET else "cpu"
    cfg = NSAConfig(**cfg_kw, selection=selection)
    monkeypatch.setattr(nsa, "CMP_BLOCK_N", 16)
    monkeypatch.setattr(nsa, "SLC_TILE_ROWS", slc_rows)
    assert (nsa.slc_tile_rows(3, -(-T // cfg.block_size)) == 0) == (slc_rows == 0)
    q, k, v = rand(1, T, 6, 2, 16, seed=70, device=dev)   # G = 3: a padded head row per token
    if selection == "tile":
        assert (T - cfg.compress_block) // cfg.compress_stride + 1 > 16       # a full compressed tile exists
    base, bidx = nsa.nsa_attention(q, k, v, cfg, return_indices=True)
    want, widx = ref.nsa_attention(q, k, v, cfg, return_indices=True)
    assert torch.equal(bidx.long().cpu(), widx.cpu())
    for name in names:
        with monkeypatch.context() as m:
            for attr, val in SWITCHES[name].items():
                m.setattr(nsa, attr, val)
            assert nsa.tma_enabled(q.device) == (nsa.NSA_TMA and (INTERPRET or
                                                                  torch.cuda.get_device_capability()[0] >= 9))
            out, idx = nsa.nsa_attention(q, k, v, cfg, return_indices=True)
        assert torch.equal(idx, bidx), name
        if INTERPRET:
            assert torch.equal(out, base), name
        else:
            check_bound(max_err(out, base), nsa_tol(q, k, v), f"{name} vs default")
        check_bound(max_err(out.float(), want.float()), nsa_tol(q, k, v), f"{name} vs reference")


@pytest.mark.gpu
@pytest.mark.parametrize("selection, slc_rows", [("token", None), ("token", 0), ("tile", None)])
@pytest.mark.parametrize("G, Hk, T", [(16, 2, 4096), (4, 4, 3000), (1, 8, 1000)])
def test_gpu_switches_equal_default_bf16(G, Hk, T, selection, slc_rows, monkeypatch):
    """bf16, NSAConfig() sizes, CUDA: every switch set (TMA descriptors off, the mask split off) selects exactly the
    default's blocks and gives its outputs to bf16 rounding; a non-contiguous k (a slice of a wider tensor:
    16-byte aligned strides) goes through the descriptors too, an odd head stride falls back to pointer loads.
    slc_rows 0: the per-token selected kernel (these lengths otherwise route to the token-tile kernel)."""
    from sparsepatch.kernels.nsa import forward as nsa
    cfg = NSAConfig(selection=selection)
    monkeypatch.setattr(nsa, "SLC_TILE_ROWS", slc_rows)
    q, k, v = rand(1, T, G * Hk, Hk, 128, dtype=torch.bfloat16, seed=T + G, device="cuda")
    gates = torch.rand(1, T, G * Hk, 3, generator=torch.Generator().manual_seed(G)).cuda()
    base, bidx = nsa.nsa_attention(q, k, v, cfg, gates=gates, return_indices=True)
    want, widx = ref.nsa_attention(q, k, v, cfg, gates=gates, return_indices=True)
    for name, sw in SWITCHES.items():
        with monkeypatch.context() as m:
            for attr, val in sw.items():
                m.setattr(nsa, attr, val)
            out, idx = nsa.nsa_attention(q, k, v, cfg, gates=gates, return_indices=True)
        assert torch.equal(idx, bidx), name
        assert _bf16_err(out, base) < 2e-2, name
        same = (idx.long() == widx).all(-1)
        assert same.float().mean().item() > 0.99, name
    wide = torch.randn(1, T, Hk, 136, device="cuda", dtype=torch.bfloat16)[..., :128]   # row stride 136: aligned
    odd = torch.randn(1, T, Hk, 129, device="cuda", dtype=torch.bfloat16)[..., :128]    # 129 * 2 bytes: not aligned
    for kk in (wide, odd):
        kk.copy_(k)
        ref_out, ref_idx = nsa.nsa_attention(q, kk, v, cfg, gates=gates, return_indices=True)
        with monkeypatch.context() as m:
            m.setattr(nsa, "NSA_TMA", True)
            assert (nsa._descs(q, (kk, 64))[0] is None) == (kk is odd)
            out, idx = nsa.nsa_attention(q, kk, v, cfg, gates=gates, return_indices=True)
        assert torch.equal(idx, ref_idx)
        assert _bf16_err(out, ref_out) < 2e-2
