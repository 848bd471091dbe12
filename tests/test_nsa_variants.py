"""NSA forward switches: NSA_TMA (K / V through TMA descriptors) and CMP_MASK_SPLIT (unmasked full key tiles in
selection="tile"'s compressed launch), both on by default. Turning either off runs the same fp32 operations on the
same values, so the selected blocks equal the default's and the reference's exactly, and the outputs equal the
default's (interpreter: bit for bit; GPU bf16: same indices, outputs within bf16 rounding of the default).
Below them selection="tile"'s fused launch (FUSED_BRANCHES: the selected, window and compressed branches in one
`_tile_branches_kernel` launch) against the separate kernels (FUSED_BRANCHES=False: the o_cmp launch of
`_cmp_kernel`, the selected and window kernels): the same blocks, outputs within rounding of each other."""
from __future__ import annotations

import math
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
# CPU inputs through the kernels (fp32 runs them only under the interpreter; on CUDA see the gpu tests)
interpret_only = pytest.mark.skipif(not INTERPRET, reason="CPU tensors through the Triton interpreter")

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
    monkeypatch.setattr(nsa, "FUSED_BRANCHES", False)
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


# selection="tile" with block 16 and window 40: a program's window spans 3-4 blocks with its lower edge inside a
# block, so tiles from the 4th on have selected blocks before the window (the fused kernel's loop 1), at its edge
# (loop 2), whole inside it for every row (loop 0) and unselected window blocks (loop 3); T = 100 ends mid-tile (a
# partial last program)
FUSED_CFG = dict(block_size=16, num_selected=3, window=40, compress_block=8, compress_stride=4)


def _fused_loops_covered(idx, bs, window, bt):
    """(before, edge, whole, window_only) over the programs of bt tokens: some program has a selected block before
    its window, one inside the window but not whole for every row, one whole inside it, and an unselected window
    block (the four loops of `_tile_branches_kernel`)."""
    T = idx.shape[1]
    seen = [False, False, False, False]
    for t0 in range(0, T, bt):
        maxpos = min(t0 + bt, T) - 1
        wlo = max(t0 - window + 1, 0) // bs
        s = [b for b in idx[0, t0, 0].long().cpu().tolist() if b >= 0]
        seen[0] |= any(b < wlo for b in s)
        seen[1] |= any(b >= wlo and b * bs + window <= maxpos for b in s)
        seen[2] |= any(b * bs + window > maxpos for b in s)
        seen[3] |= any(b not in s for b in range(wlo, maxpos // bs + 1))
    return seen


class _Spy:
    """Stands in for a Triton kernel object: records the keyword arguments of each launch, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append(kw)
            return self.kernel[grid](*args, **kw)
        return launch


def _spy_launches(monkeypatch, nsa):
    """(compressed, fused) spies on `_cmp_kernel` and `_tile_branches_kernel`."""
    spies = _Spy(nsa._cmp_kernel), _Spy(nsa._tile_branches_kernel)
    monkeypatch.setattr(nsa, "_cmp_kernel", spies[0])
    monkeypatch.setattr(nsa, "_tile_branches_kernel", spies[1])
    return spies


def _path(spies):
    """(o_cmp launches (STORE_O), importance launches, fused launches) of the calls recorded since the last _path
    call."""
    cmp_, fused = spies
    got = (sum(kw["STORE_O"] for kw in cmp_.calls), sum(kw["SELECT"] for kw in cmp_.calls), len(fused.calls))
    cmp_.calls.clear()
    fused.calls.clear()
    return got


# `_path` of one tile-mode forward: the fused launch (the compressed branch inside it, the importance launch at the
# tiles' first tokens), or the separate kernels (FUSED_BRANCHES=False: the o_cmp launch of every token too)
FUSED = (0, 1, 1)
SEPARATE = (1, 1, 0)


def _n_visible(pos, cfg):
    """Compressed keys visible at key position pos (python int): complete compressed blocks ending at or before it."""
    return max(0, (pos + 1 - cfg.compress_block) // cfg.compress_stride + 1)


@interpret_only
@pytest.mark.parametrize("dtype, G, gated, tma", [(torch.float32, 3, True, True), (torch.float16, 2, False, True),
                                                  (torch.float32, 16, False, True), (torch.float32, 3, True, False),
                                                  (torch.float32, 1, True, False), (torch.float32, 4, False, False)])
def test_fused_equals_separate_kernels_and_reference(dtype, G, gated, tma, monkeypatch):
    """FUSED_BRANCHES (selection="tile"): `_tile_branches_kernel` computes the selected, window and compressed
    branches of its rows and the gate combine in one launch; `_cmp_kernel` runs only as the importance launch at the
    tiles' first tokens (no o_cmp launch) and the selected / window kernels not at all. Against FUSED_BRANCHES=False
    (the o_cmp launch, `_slc_tile_kernel`, `_swa_kernel`) it selects the same blocks and computes the same function:
    the selected and compressed branches are the same fp32 operations, the window sums its blocks in another order
    and the three gated terms are summed in another order (rounding only). fp32: within the reference bound; fp16:
    within 4e-3 (P and the output rounded to fp16 in the kernel, ~4 ulps), as test_nsa.test_triton_matches_reference.
    fp32 also checks the saved branch outputs / LSEs the backward reads. Covered: the fused kernel's four K / V
    loops (selected blocks whole inside every row's window, before it, at its edge, unselected window blocks),
    rows that see no compressed key (the first tokens), programs whose rows all see a full 16-key compressed tile
    (the unmasked loop) followed by a partial one (the masked loop), n_c = 0; G = 1 and groups padded to a power
    of two; TMA descriptors and pointer loads (loop 1 unmasked)."""
    from sparsepatch.kernels.nsa import forward as nsa
    T = 100
    cfg = NSAConfig(**FUSED_CFG, selection="tile")
    monkeypatch.setattr(nsa, "CMP_BLOCK_N", 16)
    monkeypatch.setattr(nsa, "NSA_TMA", tma)             # False: pointer loads (loop 1 unmasked)
    n_c = (T - cfg.compress_block) // cfg.compress_stride + 1
    bt = max(1, min(nsa.FUSED_ROWS // (1 << (G - 1).bit_length()), cfg.block_size))   # tokens per fused program
    assert _n_visible(0, cfg) == 0 and n_c == 24
    assert any(_n_visible(t0, cfg) >= 16 and _n_visible(min(t0 + bt, T) - 1, cfg) > 16 for t0 in range(0, T, bt))
    q, k, v = rand(1, T, G, 1, 16, dtype=dtype, seed=80 + G)
    gates = torch.rand(1, T, G, 3, generator=torch.Generator().manual_seed(G)) if gated else None
    want, widx = ref.nsa_attention(q, k, v, cfg, gates=gates, return_indices=True)
    spies = _spy_launches(monkeypatch, nsa)
    monkeypatch.setattr(nsa, "FUSED_BRANCHES", False)
    base, bidx = nsa.nsa_attention(q, k, v, cfg, gates=gates, return_indices=True)
    assert _path(spies) == SEPARATE
    assert all(_fused_loops_covered(bidx, cfg.block_size, cfg.window, bt))
    assert torch.equal(bidx.long(), widx)
    tol = nsa_tol(q.float(), k.float(), v.float()) if dtype == torch.float32 else 4e-3
    monkeypatch.setattr(nsa, "FUSED_BRANCHES", True)
    with monkeypatch.context() as m:
        m.setattr(nsa, "_slc_tile_kernel", None)    # the fused launch replaces both
        m.setattr(nsa, "_swa_kernel", None)
        out, idx = nsa.nsa_attention(q, k, v, cfg, gates=gates, return_indices=True)
    assert _path(spies) == FUSED
    assert torch.equal(idx, bidx)
    check_bound(max_err(out, base), tol, "fused vs separate kernels")
    check_bound(max_err(out, want), tol, "fused vs reference")
    if dtype == torch.float32:   # save=True: per-branch LSE (log2) and ungated outputs, as the backward reads them
        k_cmp, v_cmp = ref.compress_kv(k, v, cfg)
        scale = q.shape[-1] ** -0.5
        res = {}
        for fused in (True, False):
            monkeypatch.setattr(nsa, "FUSED_BRANCHES", fused)
            res[fused] = nsa._forward(q, k, v, k_cmp, v_cmp, gates, scale, cfg, save=True)
            assert _path(spies) == (FUSED if fused else SEPARATE)
        (out_f, _, lse_f, bo_f), (out_b, _, lse_b, bo_b) = res[True], res[False]
        check_bound(max_err(out_f, out_b), tol, "save=True output")
        check_bound(max_err(bo_f, bo_b), nsa_tol(q, k, v), "saved branch outputs")
        empty = torch.isinf(lse_b[0])
        assert empty[0, 0].all() and not empty[0, -1].any()          # the first token sees no compressed key
        assert torch.equal(torch.isinf(lse_f[0]), empty) and (lse_f[0][empty] > 0).all()
        assert torch.equal(bo_f[0][0, 0], torch.zeros_like(bo_f[0][0, 0]))   # o_cmp of a row that sees nothing
        # the same fp32 operations over the same keys; should the summation order differ, l (<= n_c terms in
        # [0, 1]) moves by <= n_c fp32 ulps relative: |d log2 l| <= n_c * 2^-24 / ln 2, margin x2, one ulp of m
        fin = lse_b[0][~empty]
        check_bound(max_err(lse_f[0][~empty], fin), 2 * n_c * 2.0 ** -24 / math.log(2)
                    + 2.0 ** -23 * fin.abs().max().item(), "saved compressed LSE")
        # selected / window LSE = m + log2(l): l a sum of <= T terms in [0, 1] summed in another order (each sum
        # within T fp32 ulps relative), so |d log2 l| <= T * 2^-24 / ln 2; margin x2 and one ulp of m
        lb = lse_b[1:]
        check_bound(max_err(lse_f[1:], lb), 2 * T * 2.0 ** -24 / math.log(2) + 2.0 ** -23 * lb.abs().max().item(),
                    "saved selected / window LSE")
    # no complete compressed block at all (n_c = 0: the compressed loop runs no tile, every row's o_cmp is 0)
    monkeypatch.setattr(nsa, "FUSED_BRANCHES", True)
    q6, k6, v6 = (x[:, :cfg.compress_block - 2] for x in (q, k, v))
    g6 = None if gates is None else gates[:, :cfg.compress_block - 2]
    assert ref.compress_kv(k6, v6, cfg)[0].shape[1] == 0
    out = nsa.nsa_attention(q6, k6, v6, cfg, gates=g6)
    assert _path(spies) == FUSED
    check_bound(max_err(out, ref.nsa_attention(q6, k6, v6, cfg, gates=g6)), tol, "n_c = 0 vs reference")
    assert nsa.fused_applies(64, 4, 0, 128) and nsa.fused_applies(16, 16, 32, 64)
    assert not nsa.fused_applies(64, 4, 3000, 128)            # a prefill starting mid-tile: the separate kernels
    assert not nsa.fused_applies(24, 4, 0, 128) and not nsa.fused_applies(128, 4, 0, 128)
    assert not nsa.fused_applies(16, 32, 0, 128) and not nsa.fused_applies(64, 4, 0, 256)



@interpret_only
def test_fused_reads_the_per_tile_selection(monkeypatch):
    """The fused launch reads one selection row per tile (SEL_ROWS = block_size), so a call that asks for no
    indices builds no per-token index tensor: B = 2, Hk = 2 (the batch / KV-head strides of the per-tile tensor),
    queries after a 48-token prefix (q_off > 0, at a tile boundary: still the fused launch) and from position 0.
    Each equals the same call with return_indices=True bit for bit (the same launches on the same selection) and
    the reference within its bound."""
    from sparsepatch.kernels.nsa import forward as nsa
    cfg = NSAConfig(**FUSED_CFG, selection="tile")
    monkeypatch.setattr(nsa, "CMP_BLOCK_N", 16)
    q, k, v = rand(2, 100, 6, 2, 16, seed=91)
    spies = _spy_launches(monkeypatch, nsa)
    for a in (0, 48):
        out = nsa.nsa_attention(q[:, a:], k, v, cfg)
        assert _path(spies) == FUSED and a % cfg.block_size == 0
        out_i, idx = nsa.nsa_attention(q[:, a:], k, v, cfg, return_indices=True)
        assert _path(spies) == FUSED
        assert torch.equal(out, out_i) and idx.shape == (2, 100 - a, 2, cfg.num_selected)
        want, widx = ref.nsa_attention(q[:, a:], k, v, cfg, return_indices=True)
        assert torch.equal(idx.long(), widx)
        check_bound(max_err(out, want), nsa_tol(q, k, v), f"per-tile selection read, queries from {a}")

@interpret_only
def test_fused_gradients_equal_separate_kernels(monkeypatch):
    """With a gradient needed the fused launch writes what the separate kernels write for the backward (o_cmp, o_slc,
    o_swa in q's dtype, their LSEs): the Triton gradients of q, k, v and the gates through the fused launch equal the
    reference's within test_nsa_backward.grad_tol, and those through the separate kernels (FUSED_BRANCHES=False)
    within twice that (each side carries its own error)."""
    from sparsepatch.kernels.nsa import forward as nsa
    from test_nsa_backward import _grads, _inputs, _rel, grad_tol
    cfg = NSAConfig(**FUSED_CFG, selection="tile")
    monkeypatch.setattr(nsa, "CMP_BLOCK_N", 16)
    leaves, dout = _inputs(1, 100, 2, 1, 16, seed=21, gates=True)
    tol = grad_tol(leaves)
    spies = _spy_launches(monkeypatch, nsa)
    got = {}
    for fused in (True, False):
        monkeypatch.setattr(nsa, "FUSED_BRANCHES", fused)
        ls = {n: x.detach().clone().requires_grad_(True) for n, x in leaves.items()}
        out, idx, got[fused] = _grads(nsa.nsa_attention, ls, dout, cfg)
        assert _path(spies) == (FUSED if fused else SEPARATE)
    ref_leaves = {n: x.detach().clone().requires_grad_(True) for n, x in leaves.items()}
    _, widx, want = _grads(ref.nsa_attention, ref_leaves, dout, cfg)
    assert torch.equal(idx.long(), widx)
    for n in got[True]:
        assert want[n].abs().max() > 0, n
        check_bound(_rel(got[True][n], want[n]), tol, f"d{n} fused vs reference")
        check_bound(_rel(got[True][n], got[False][n]), 2 * tol, f"d{n} fused vs separate kernels")


@pytest.mark.gpu
@pytest.mark.parametrize("G, Hk, T, gated", [(16, 4, 4096, False), (16, 4, 4096, True), (16, 2, 3000, True),
                                             (4, 4, 4000, True), (1, 8, 1000, False)])
def test_gpu_fused_equals_separate_kernels_bf16(G, Hk, T, gated, monkeypatch):
    """bf16, NSAConfig(selection="tile") sizes (HQ64 H4 D128 at 4K), CUDA: the fused launch and the separate kernels
    (FUSED_BRANCHES=False) select the same blocks, and their outputs agree to bf16 rounding (`_bf16_err`, as against
    the reference): each path rounds its probabilities P to bf16 for the P V products, against running maxima that
    differ between the two (the window's keys are tiled differently), so they are not one fp32 rounding apart (one
    bf16 ulp plus an fp32 sum bound failed by 1.5x on an H200). Also the reference's outputs where the selections
    agree, the path that ran (the fused launch: no o_cmp launch), and the gradients through the saved outputs."""
    from sparsepatch.kernels.nsa import forward as nsa
    cfg = NSAConfig(selection="tile")
    q, k, v = rand(1, T, G * Hk, Hk, 128, dtype=torch.bfloat16, seed=T + 7 * G, device="cuda")
    gates = torch.rand(1, T, G * Hk, 3, generator=torch.Generator().manual_seed(G)).cuda() if gated else None
    spies = _spy_launches(monkeypatch, nsa)
    res = {}
    for fused in (False, True):
        monkeypatch.setattr(nsa, "FUSED_BRANCHES", fused)
        res[fused] = nsa.nsa_attention(q, k, v, cfg, gates=gates, return_indices=True)
        assert _path(spies) == (FUSED if fused else SEPARATE)
    (out, idx), (base, bidx) = res[True], res[False]
    assert torch.equal(idx, bidx)
    assert _bf16_err(out, base) < 2e-2
    want, widx = ref.nsa_attention(q, k, v, cfg, gates=gates, return_indices=True)
    rows = (idx.long() == widx).all(-1).all(-1)[0]
    assert rows.float().mean().item() > 0.99
    assert _bf16_err(out[0, rows], want[0, rows]) < 2e-2
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)
    grads = []
    for fused in (True, False):
        monkeypatch.setattr(nsa, "FUSED_BRANCHES", fused)
        o = nsa.nsa_attention(qg, kg, vg, cfg, gates=gates)
        grads.append(torch.autograd.grad(o, (qg, kg, vg), dout))
        assert _path(spies) == (FUSED if fused else SEPARATE)
    for x, y in zip(*grads):
        assert _bf16_err(x, y) < 2e-2 * max(1.0, y.float().abs().max().item())
