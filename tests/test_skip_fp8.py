"""fp8 skip-list forward (`SkipConfig(precision="fp8")`, kernels/skip/fp8.py).

CPU: the emulation is `reference.skip_attention` on the kernel's dequantized q/k/v (exactly); the dispatcher /
stateful / patcher plumbing routes precision="fp8" to it on CPU; the kernel's list walk, keep test, two-part
merge of 128-row q-tiles and next-list writing under the interpreter with fp16 stand-ins for the 8-bit operands
(the interpreter has no e4m3 / int8 tensor cores). GPU (`-m gpu`): the kernel against the emulation (same lists
except tiles within a quantization-error margin of the threshold, outputs within the fp8 error model), and the
video-like quality bar vs bf16 skip lists.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_checks import INTERP, cpu_only, gpu  # noqa: E402

from sparsepatch.kernels import SkipList, SkipListBuffers, skip_attention, skip_step  # noqa: E402
from sparsepatch.kernels.dense.fp8 import _QINV  # noqa: E402
from sparsepatch.kernels.dense.reference import LOG2E  # noqa: E402
from sparsepatch.kernels.skip import fp8 as skip_fp8  # noqa: E402
from sparsepatch.kernels.skip import reference  # noqa: E402
from sparsepatch.testing import video_like_qkv  # noqa: E402

QINV_E4M3 = _QINV["e4m3"]   # the kernel's q scale = amax * fp32(1 / 448)


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def gains(q, k, skip_list, scale=None):
    """Per visited tile (B, H, Tq, Tk): the keep-test statistic max over rows of (tile_max - running_before) in
    log2 units (+inf for a row's first tile), -inf where not listed. Mirrors reference.skip_attention."""
    B, Sq, Hq, D = q.shape
    Sk = k.shape[1]
    tm, tn = skip_list.tile
    scale = 1 / math.sqrt(D) if scale is None else scale
    from sparsepatch.kernels.dense.reference import scores
    s = scores(q.double(), k.double(), scale, None, False)
    tq, tk = skip_list.shape[2:]
    sp = torch.nn.functional.pad(s, (0, tk * tn - Sk), value=float("-inf"))
    tile_max = sp.reshape(B, Hq, Sq, tk, tn).amax(-1)
    listed = skip_list.to_mask().to(q.device)
    row_listed = listed.repeat_interleave(tm, 2)[:, :, :Sq]
    visited = tile_max.masked_fill(~row_listed, float("-inf"))
    run = torch.cummax(visited, -1).values
    before = torch.cat([torch.full_like(run[..., :1], float("-inf")), run[..., :-1]], -1)
    g = ((tile_max - before) * LOG2E).masked_fill(~row_listed, float("-inf"))
    g = torch.nn.functional.pad(g, (0, 0, 0, tq * tm - Sq), value=float("-inf"))
    return g.reshape(B, Hq, tq, tm, tk).amax(3)


def random_list(B, H, Sq, Sk, tile, density, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    tq, tk = -(-Sq // tile[0]), -(-Sk // tile[1])
    mask = torch.rand(B, H, tq, tk, generator=g) < density
    mask[..., 0] = True
    return SkipList.from_mask(mask.to(device), tile, Sq, Sk)


# ------------------------------------------------------------------------------------------------ CPU: emulation

def test_emulation_is_reference_on_dequantized_inputs():
    q, k, v = video_like_qkv(heads=2, frames=4, height=8, width=10, dim=64, seed=3)   # S = 320: partial tiles
    lst = random_list(1, 2, 320, 320, (128, 128), 0.6, seed=1)
    out, nxt, lse = skip_attention(q, k, v, lst, -5.0, return_lse=True, precision="fp8")
    qd, kd, vd = skip_fp8.quantize_skip_reference(q, k, v, (128, 128))
    o_ref, n_ref, l_ref = reference.skip_attention(qd, kd, vd, lst, -5.0, return_lse=True)
    assert torch.equal(out, o_ref.to(q.dtype)) and torch.equal(lse, l_ref) and nxt.equal(n_ref)
    assert skip_fp8.q_block((128, 128)) == 64 and skip_fp8.q_block((64, 64)) == 64
    assert skip_fp8.q_block((128, 128), {"block_m": 128}) == 128


def test_emulated_lists_vs_native_video_like():
    """Lists on the fp8 scores differ from the native ones only at tiles whose native gain lies within the score
    error of the threshold: |gain error| <= max |q . k - q_d . k_d| * scale * log2(e) (row-max shift included:
    2x)."""
    thr = -5.0
    q, k, v = video_like_qkv(heads=2, frames=4, height=8, width=16, dim=64, seed=0)   # S = 512
    lst = None
    for step in range(3):
        q, k, v = video_like_qkv(heads=2, frames=4, height=8, width=16, dim=64, seed=0, step=step)
        full = lst or SkipList.full(1, 2, 512, 512, (128, 128))
        o8, n8 = skip_attention(q, k, v, full, thr, precision="fp8")
        o, n = skip_attention(q, k, v, full, thr)
        qd, kd, _ = skip_fp8.quantize_skip_reference(q, k, v, (128, 128))
        err = ((q.double().transpose(1, 2) @ k.double().transpose(1, 2).transpose(-1, -2))
               - (qd.double().transpose(1, 2) @ kd.double().transpose(1, 2).transpose(-1, -2))).abs().max().item()
        margin = 2 * err / math.sqrt(64) * LOG2E
        g = gains(q, k, full)
        differ = n8.to_mask() ^ n.to_mask()
        near = (g - thr).abs() <= margin
        assert bool((differ <= near).all()), (differ & ~near).sum()
        assert differ.float().mean().item() <= 0.05
        assert cos(o8, o) >= 0.999
        lst = n


def test_fp8_precision_validation():
    from sparsepatch import SkipConfig
    q, k, v = video_like_qkv(heads=1, frames=2, height=8, width=8, dim=64)
    with pytest.raises(ValueError, match="precision"):
        skip_attention(q, k, v, None, -5.0, precision="int4")
    with pytest.raises(ValueError, match="inference-only"):
        skip_attention(q.requires_grad_(), k, v, None, -5.0, precision="fp8")
    with pytest.raises(ValueError, match="precision"):
        SkipConfig(precision="bf16")
    with pytest.raises(ValueError, match="backward"):
        SkipConfig(precision="fp8", backward=True)
    assert SkipConfig(precision="fp8").precision == "fp8"
    with pytest.raises(ValueError, match="unknown keys"):      # the schedule is not a cfg choice any more
        skip_fp8.q_block((128, 128), {"lsum_early": True})
    with pytest.raises(ValueError, match="block_m"):
        skip_fp8.q_block((128, 128), {"block_m": 32})


def test_skip_step_fp8_cpu_matches_emulation():
    """The stateful path (slots, warm-up, must_do) with precision fp8 on CPU: call n reads the list call n - 1 of the
    emulation wrote; warm-up calls are `attention_fp8` (dense, emulated)."""
    from sparsepatch.kernels import attention_fp8
    S, tile, thr = 384, (128, 128), -1.0
    bufs = SkipListBuffers.create(1, 2, S, S, tile, "cpu")
    lst = SkipList.full(1, 2, S, S, tile)
    must = [(256, 300)]
    forced = reference.must_do_tiles(must, S, S, tile)
    dens = [1.0]
    for step in range(4):
        q, k, v = video_like_qkv(heads=2, frames=6, height=8, width=8, dim=64, step=step)
        out = skip_step(q, k, v, bufs, thr, 1, must_do=must, precision="fp8")
        if step == 0:
            assert torch.equal(out, attention_fp8(q, k, v))
            continue
        dens.append((lst.to_mask() | forced).float().mean().item())
        want, lst = skip_fp8.skip_attention_emulated(q, k, v, lst, thr, must_do=must)
        assert torch.equal(out, want)
        assert bufs.current(1).equal(lst)
    assert bufs.calls() == 4 and torch.allclose(bufs.history()[:, 0], torch.tensor(dens))


def test_patcher_skipconfig_fp8_cpu():
    """sp.validate with SkipConfig(precision='fp8') on the tiny Wan pipeline (CPU): the skip calls route to the
    emulation ("skip:fp8_emulated" in the report), reported against dense: per-call attention cos and output cos."""
    import sparsepatch as sp
    from sparsepatch.testing import tiny_wan_pipeline, wan_call_kwargs
    pipe = tiny_wan_pipeline(head_dim=64, heads=1)
    pipe.set_progress_bar_config(disable=True)
    cfg = sp.SkipConfig(threshold=-3.0, warmup_steps=1, tile=(64, 64), precision="fp8")
    report = sp.validate(pipe, cfg, measure_speed=False,
                         **wan_call_kwargs(height=64, width=64, num_frames=5, steps=2))
    assert "fp8_emulated" in report.backends["patched"], report.backends
    per_call = [c for branches in report.attention_cos.values() for calls in branches.values() for c in calls]
    assert len(per_call) == 2 * 2 * 2 and min(per_call) >= 0.99      # layers x CFG x steps
    assert report.output_cos >= 0.999
    with pytest.raises(ValueError, match="inference-only"):
        sp.SkipConfig(precision="fp8", backward=True)


# ------------------------------------------------------------------------------------------------ interpreter

def _standin_quantized(k, v):
    """fp16 stand-ins for (k8, k_scale, vt8, v_scale): unit scales, V^T padded to 16 keys."""
    B, Sk, Hk, D = k.shape
    k8 = k.transpose(1, 2).contiguous().half()
    ks = torch.ones(B, Hk, -(-Sk // 128))
    s_pad = -(-Sk // 16) * 16
    vt = torch.zeros(B, Hk, D, s_pad, dtype=torch.float16)
    vt[..., :Sk] = v.permute(0, 2, 3, 1).half()
    return k8, ks, vt, torch.ones(B, Hk, D)


@cpu_only
@pytest.mark.parametrize("tile,block_m,must_do,keep_row", [((128, 128), 64, None, True),
                                                           ((128, 128), 64, [(130, 140)], True),
                                                           ((64, 64), 64, None, True), ((128, 128), 128, None, True),
                                                           ((128, 128), 64, None, False)])
def test_kernel_interpreter_lists(monkeypatch, tile, block_m, must_do, keep_row):
    """The fp8 skip kernel under the interpreter with fp16 operands in place of int8 / e4m3 (e4m3 path of the
    kernel: fp32 Q K^T, QMAX 448): output and next list vs the reference on the same operands (q rounded to fp16
    after its in-kernel block scaling), lists equal except within the score error of the threshold (the
    interpreter's fp16 dot rounds like its fp16 inputs: 2 eps_fp16 x max |score|), LSE within the same error.
    tile 128 with block_m 64 exercises the two-part merge of the keep words."""
    from sparsepatch.kernels.skip import triton as skip_triton
    B, H, Sq, Sk, D, thr = 1, 2, 300, 330, 64, -2.0
    q, k, v = (x[:, :Sq] if i == 0 else x[:, :Sk] for i, x in
               enumerate(video_like_qkv(heads=H, frames=6, height=8, width=8, dim=D, seed=5)))
    q, k, v = (x.half().float() for x in (q, k, v))
    lst = random_list(B, H, Sq, Sk, tile, 0.7, seed=2)
    k8, ks, vt, vs = _standin_quantized(k, v)
    monkeypatch.setattr(skip_fp8, "fp8_skip_supported", lambda q, tile=None: True)
    out, nxt, lse = skip_fp8.skip_attention_fp8(q, k, v, lst, thr, return_lse=True, tile=tile, must_do=must_do,
                                                cfg={"block_m": block_m, "keep_row": keep_row}, quantized=(k8, ks, vt, vs))
    # the q the kernel multiplies: per program block of block_m rows, scaled to amax ~448 and rounded to fp16
    bm = min(block_m, tile[0])
    qd = q.clone()
    for r in range(0, Sq, bm):
        blk = q[:, r:r + bm]
        sc = blk.abs().amax().clamp_min(1e-30) * QINV_E4M3
        qd[:, r:r + bm] = (blk * (1.0 / sc)).half().float() * sc
    o_ref, n_ref, l_ref = reference.skip_attention(qd, k, v, lst, thr, return_lse=True, must_do=must_do)
    forced = reference.must_do_tiles(must_do, Sq, Sk, tile)
    read = lst.to_mask() | (forced if forced is not None else False)
    differ = nxt.to_mask() ^ n_ref.to_mask()
    smax = (qd.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)).abs().max().item() / math.sqrt(D)
    score_err = 2 * 2.0 ** -11 * smax                                      # natural-log units
    near = (gains(qd, k, SkipList.from_mask(read, tile, Sq, Sk)) - thr).abs() <= 2 * score_err * LOG2E
    assert bool((differ <= near).all())
    assert differ.float().mean().item() <= 0.05
    # P in fp16 (x 256) and fp32 accumulation: error of the fp16 P rounding, relative to |v|
    assert (out - o_ref).abs().max().item() <= 4e-3 * v.abs().max().item()
    assert (lse - l_ref).abs().max().item() <= 2 * score_err


@cpu_only
def test_kernel_interpreter_keep_words(monkeypatch):
    """More than 32 visited tiles per row (keep words across a 32-tile boundary; split q-tile merge): cfg keep_row
    (per-row bits, OR across rows every 32 tiles) gives the same output and next list as the per-tile
    [rows, words] select, and that list is the reference's except near the threshold (as in the test above)."""
    B, H, D, thr, tile = 1, 1, 64, -3.0, (128, 64)
    q, k, v = video_like_qkv(heads=H, frames=36, height=8, width=8, dim=D, seed=7)   # S = 2304: 36 key tiles
    q, k, v = (x.half().float() for x in (q[:, :256], k, v))
    Sq, Sk = q.shape[1], k.shape[1]
    lst = random_list(B, H, Sq, Sk, tile, 0.97, seed=4)
    quant = _standin_quantized(k, v)
    monkeypatch.setattr(skip_fp8, "fp8_skip_supported", lambda q, tile=None: True)
    res = [skip_fp8.skip_attention_fp8(q, k, v, lst, thr, tile=tile, cfg={"block_m": 64, "keep_row": kr},
                                       quantized=quant) for kr in (True, False)]
    assert torch.equal(res[0][0], res[1][0])
    assert res[0][1].equal(res[1][1])
    assert int(lst.counts.max()) > 32
    dens = res[0][1].density().item()
    assert 0.0 < dens < lst.density().item()      # the list bookkeeping is exercised, not all-in or all-out
    qd = q.clone()
    for r in range(0, Sq, 64):
        blk = q[:, r:r + 64]
        sc = blk.abs().amax().clamp_min(1e-30) * QINV_E4M3
        qd[:, r:r + 64] = (blk * (1.0 / sc)).half().float() * sc
    _, n_ref = reference.skip_attention(qd, k, v, lst, thr)
    smax = (qd.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)).abs().max().item() / math.sqrt(D)
    near = (gains(qd, k, lst) - thr).abs() <= 2 * (2 * 2.0 ** -11 * smax) * LOG2E
    assert bool(((res[0][1].to_mask() ^ n_ref.to_mask()) <= near).all())


@cpu_only
def test_kernel_interpreter_stateful(monkeypatch):
    """STATEFUL launch (interpreter, stand-ins): warm-up call reads every tile and leaves the slots alone; the next
    calls read slot (n - warmup) % 2 and write the other, what the one-call entry writes; density recorded."""
    B, H, S, D, thr, tile = 1, 2, 260, 64, -2.0, (128, 128)
    q, k, v = (x[:, :S].half().float() for x in video_like_qkv(heads=H, frames=5, height=8, width=8, dim=D, seed=7))
    k8, ks, vt, vs = _standin_quantized(k, v)
    monkeypatch.setattr(skip_fp8, "fp8_skip_supported", lambda q, tile=None: True)
    monkeypatch.setattr(skip_fp8, "quantize_fp8", lambda q, k, v, fmt, quantize_q=False: (None, None, k8, ks, vt, vs))
    bufs = SkipListBuffers.create(B, H, S, S, tile, "cpu")
    lst = None
    for n in range(3):
        before = bufs.counts.clone(), bufs.indices.clone()
        skip_fp8.skip_step_fp8(q, k, v, bufs.counts, bufs.indices, bufs.step, bufs.density, thr, 1, 128, 128,
                               1 / math.sqrt(D), [])
        if n == 0:
            assert torch.equal(bufs.counts, before[0]) and torch.equal(bufs.indices, before[1])
            continue
        _, want = skip_fp8.skip_attention_fp8(q, k, v, lst, thr, tile=tile, quantized=(k8, ks, vt, vs))
        got = bufs.current(1)
        assert got.equal(want)
        lst = want
        if n == 1:
            lst = got
    assert bufs.calls() == 3
    assert bufs.density[0, 0].item() == 1.0


# ------------------------------------------------------------------------------------------------ GPU

def _cuda():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@gpu
@pytest.mark.parametrize("D,tile,block_m,full_tiles", [(128, (128, 128), 64, False), (64, (128, 128), 64, False),
                                                      (128, (64, 64), 64, False), (128, (128, 128), 128, False),
                                                      (128, (128, 128), 64, True), (64, (64, 64), 64, True)])
def test_gpu_kernel_vs_emulation(D, tile, block_m, full_tiles):
    """Kernel vs emulation on the same inputs. The kernel's int8 q (quantized in-kernel) is the emulation's bit for
    bit (`dense.fp8._quant_tile`: same scale multiply, IEEE reciprocal, uncontracted rounding; bf16 inputs have
    many exact rounding ties, so anything less flips whole rows: round 2 failed here with 3.6% of rows), and the
    emulation takes k8 / v8 / scales from `quantize_fp8` itself. So the scores differ by fp32 rounding only and the
    LSE of every row lies within `_lse_bounds` (no tie allowance); lists equal except tiles whose gain lies within
    twice that score bound of the threshold; outputs within the fp8 error model (P's e4m3 rounding: 2^-4 relative
    per probability, averaging over keys -> rel RMS <= 2e-2 vs the emulation). full_tiles: every third q-tile lists
    every k-tile (the partial last one included) beside rows listing about half."""
    if not _cuda():
        pytest.skip("needs sm_90")
    thr = -5.0
    q, k, v = video_like_qkv(heads=4, frames=8, height=16, width=24, dim=D, seed=1, dtype=torch.bfloat16,
                             device="cuda")    # S = 3072
    S = q.shape[1] - 100
    q, k, v = q[:, :S].contiguous(), k[:, :S].contiguous(), v[:, :S].contiguous()
    lst = random_list(1, 4, S, S, tile, 0.5, seed=3, device="cuda")
    cfg = {"block_m": block_m}
    if full_tiles:
        mask = lst.to_mask()
        mask[:, :, ::3] = True
        lst = SkipList.from_mask(mask, tile, S, S)
    from sparsepatch.kernels.dense.fp8 import quantize_fp8
    quant = quantize_fp8(q, k, v, "int8", quantize_q=False)[2:]
    k8, ks, vt8, vs = quant
    out, nxt, lse = skip_fp8.skip_attention_fp8(q, k, v, lst, thr, return_lse=True, cfg=cfg, quantized=quant)
    qd = skip_fp8.quantize_skip_reference(q, k, v, tile, cfg=cfg)[0]
    kd = (k8.float() * ks.repeat_interleave(128, -1)[..., :S, None]).transpose(1, 2)
    vd = (vt8.float()[..., :S] * vs[..., None]).permute(0, 3, 1, 2)
    o_ref, n_ref, l_ref = reference.skip_attention(qd, kd, vd, lst, thr, return_lse=True)
    bound = _lse_bounds(qd, kd, l_ref, S)
    d = (lse - l_ref).abs()
    assert bool((d <= bound).all()), ((d / bound).max().item(), int((d > bound).sum()), d.max().item())
    # a tile's gain (max over its rows of tile max - running max, log2 units) moves by at most twice the score
    # bound of its rows (both maxima move); the LSE bound's score part is that score bound
    margin = 2 * LOG2E * bound.max().item()
    differ = (nxt.to_mask() ^ n_ref.to_mask())
    near = (gains(qd, kd, lst) - thr).abs() <= margin
    visited = lst.to_mask().sum().item()
    assert (differ & ~near).sum().item() == 0, (int((differ & ~near).sum()), margin)
    assert differ.sum().item() <= 0.01 * visited
    rel = ((out.float() - o_ref.float()).norm() / o_ref.float().norm()).item()
    assert rel <= 2e-2, rel


def _lse_bounds(qd, kd, l_ref, Sk):
    """Error model of the kernel's LSE vs the emulation's (natural log, (B, H, S)) on bit-identical quantized
    operands: |dLSE_i| <= max_j |ds_ij| + (LSE evaluation error) (LSE is a smooth max: its gradient w.r.t. the scores
    is the softmax row, which sums to 1).
    Scores: the kernel's int32 dot is exact, times c = RN(RN(s_q * RN(scale log2 e)) * s_k) and one more rounding:
    <= 4 roundings; the emulation's dequantized qd, kd carry one rounding each and its dot runs in fp64 (the oracle
    computes fp32 inputs in fp64): |ds| <= 6 u |s~| with s~ = scale sum_d |qd_d kd_d| <= scale |qd_i| max_j |kd_j|
    (Cauchy-Schwarz), u = 2^-24; bound (D + 4) eps32 (eps32 = 2u) of that: margin >= 2 (D + 4) / 6.
    LSE evaluation: the kernel's ex2.approx / lg2.approx (<= 2 ulp each) and the fp32 running sum l (one rounding
    and one rescale by an ex2.approx alpha per 128-key block: <= 4 u relative per block, Sk / 128 blocks) and the
    final (m + log2 l - 8) * ln 2 (<= 4 u |lse|); the emulation's fp32 exp / sum / log on the same order: bound
    2 x (4 eps32 (Sk / 128 + 8) + 8 eps32 |lse|)."""
    B, S, H, D = qd.shape
    eps = torch.finfo(torch.float32).eps
    scale = 1.0 / math.sqrt(D)
    qn = qd.float().norm(dim=-1).transpose(1, 2)                                     # (B, H, S)
    kn = kd.float().norm(dim=-1).amax(dim=1)[:, :, None]                             # (B, Hk=H, 1)
    return ((D + 4) * eps * scale * qn * kn + 2 * (4 * eps * (Sk / 128 + 8) + 8 * eps * l_ref.abs()))


@gpu
def test_gpu_must_do_and_stateful():
    """must_do tiles computed and kept; the stateful path (patcher slots) writes what the one-call entry writes."""
    if not _cuda():
        pytest.skip("needs sm_90")
    q, k, v = video_like_qkv(heads=2, frames=8, height=16, width=16, dim=128, seed=2, dtype=torch.bfloat16,
                             device="cuda")
    S = q.shape[1]
    must = [(1000, 1100)]
    lst = random_list(1, 2, S, S, (128, 128), 0.3, seed=4, device="cuda")
    _, nxt = skip_attention(q, k, v, lst, -5.0, must_do=must, precision="fp8")
    forced = reference.must_do_tiles(must, S, S, (128, 128)).cuda()
    assert bool((nxt.to_mask() >= forced).all())
    bufs = SkipListBuffers.create(1, 2, S, S, (128, 128), "cuda")
    with torch.no_grad():
        skip_step(q, k, v, bufs, -5.0, 1, must_do=must, precision="fp8")       # warm-up
        first = bufs.current(1).clone()
        skip_step(q, k, v, bufs, -5.0, 1, must_do=must, precision="fp8")
    _, want = skip_attention(q, k, v, first, -5.0, must_do=must, precision="fp8")
    assert bufs.current(1).equal(want)


@gpu
def test_gpu_launch_plans():
    """The fp8 skip call and its quantize launches relaunch recorded plans (`_common.LaunchPlans`) with each call's
    tensors (fresh inputs and lists each call, so every pointer and descriptor is re-filled): bitwise equal to
    Triton's own launch path on the same inputs, no new plan per call, no fallback."""
    if not _cuda():
        pytest.skip("needs sm_90")
    import triton
    from sparsepatch.kernels._common import C_LAUNCH_VERSIONS
    from sparsepatch.kernels.dense import fp8 as dense_fp8
    skip_fp8._PLANS.plans.clear()
    dense_fp8._QUANT_PLANS.plans.clear()
    S, tile = 2000, (128, 128)

    def inputs(seed):
        q, k, v = (x[:, :S].contiguous() for x in video_like_qkv(heads=4, frames=8, height=16, width=16, dim=128,
                                                                 seed=seed, dtype=torch.bfloat16, device="cuda"))
        return q, k, v, random_list(1, 4, S, S, tile, 0.5, seed=seed, device="cuda")

    with torch.no_grad():
        skip_fp8.skip_attention_fp8(*inputs(20), -5.0, return_lse=True)   # Triton's launcher; plans recorded
        n = (len(skip_fp8._PLANS.plans), len(dense_fp8._QUANT_PLANS.plans))
        assert n == (1, 2) and skip_fp8._PLANS.enabled[0] and dense_fp8._QUANT_PLANS.enabled[0]
        if triton.__version__ in C_LAUNCH_VERSIONS:
            for plans in (skip_fp8._PLANS, dense_fp8._QUANT_PLANS):
                assert all(getattr(p, "direct", False) for p in plans.plans.values())
        for seed in (21, 22):
            q, k, v, lst = inputs(seed)
            via_plan = skip_fp8.skip_attention_fp8(q, k, v, lst, -5.0, return_lse=True)
            assert (len(skip_fp8._PLANS.plans), len(dense_fp8._QUANT_PLANS.plans)) == n
            assert skip_fp8._PLANS.enabled[0] and dense_fp8._QUANT_PLANS.enabled[0]
            skip_fp8._PLANS.enabled[0] = dense_fp8._QUANT_PLANS.enabled[0] = False    # Triton's launcher
            try:
                via_jit = skip_fp8.skip_attention_fp8(q, k, v, lst, -5.0, return_lse=True)
            finally:
                skip_fp8._PLANS.enabled[0] = dense_fp8._QUANT_PLANS.enabled[0] = True
            assert torch.equal(via_plan[0], via_jit[0]) and torch.equal(via_plan[2], via_jit[2])
            assert via_plan[1].equal(via_jit[1])
            assert 0.0 < via_plan[1].density().item() < lst.density().item()


@gpu
def test_gpu_video_like_quality_vs_bf16():
    """Acceptance: video-like workload, threshold -5, 10 steps of carried lists: per step, fp8 output cos >= 0.999
    vs bf16 skip on the bf16 lists, and fp8 next lists equal to bf16 next lists on >= 99% of tiles."""
    if not _cuda():
        pytest.skip("needs sm_90")
    thr = -5.0
    l8 = lb = None
    worst_cos, worst_eq = 1.0, 1.0
    for step in range(10):
        q, k, v = video_like_qkv(heads=4, frames=8, height=16, width=32, dim=128, step=step, dtype=torch.bfloat16,
                                 device="cuda")
        ob, nb = skip_attention(q, k, v, lb, thr)
        o8, n8 = skip_attention(q, k, v, l8, thr, precision="fp8")
        worst_cos = min(worst_cos, cos(o8, ob))
        worst_eq = min(worst_eq, (n8.to_mask() == nb.to_mask()).float().mean().item())
        l8, lb = n8, nb
    assert worst_cos >= 0.999, worst_cos
    assert worst_eq >= 0.99, worst_eq
