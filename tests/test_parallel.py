"""The sparsepatch diffusers backend under context parallelism: 2 CPU processes (gloo) via torchrun, tiny Wan pipeline
(head_dim 32, attention_gain 100, SkipConfig(threshold, tile=(16, 16)), fp32, 128x128x9 -> 192 tokens, 96 per rank).

Each launch runs sparsepatch.recipes.parallel_video --check: the patched CP run and the same pipeline patched in one
process, and reports the max abs difference of the frames, the rank's stats and whether its skip lists equal /
contain the single-process lists of its heads (Ulysses) or q tiles (ring) after every step.

What is proven and therefore asserted (see sparsepatch/patcher/parallel.py):
- Ulysses and ring "gather": the rank's lists are the single-process lists of its heads / q tiles, so lists are equal
  at every step and the frames equal the single-process run at any threshold (bitwise on the CPUs measured; asserted
  within the fp32 bound below, as the sharded linear layers may sum in another order elsewhere).
- ring "walk" (one skip call per k/v shard, LSE-merged by diffusers): keep-everything equals dense up to the fp32 LSE
  merge; the list written by the first skip call contains the single-process one, so the next step's density is >=.
  Later lists may differ either way, so outputs at threshold -3 are only checked finite (difference reported).
Frames are compared with kernel_checks.denoiser_bound: fp32, 192 tokens, STEPS CFG steps (guidance 5) through 2
blocks, frames in [0, 1]; twice that for two fp32 runs.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import sparsepatch as sp
from kernel_checks import assert_close_to_oracle, check_bound, denoiser_bound
from sparsepatch.kernels.dense import reference
from sparsepatch.patcher import parallel
from sparsepatch.testing import tiny_wan_pipeline, video_like_qkv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
LAYERS = {f"transformer.blocks.{i}.attn1" for i in range(2)}
# two fp32 runs of the pipeline (tiny_wan_pipeline: 2 blocks; 128x128x9 -> 192 tokens; guidance 5; frames in [0, 1])
FRAMES_BOUND = 2 * denoiser_bound(torch.float32, tokens=192, steps=STEPS, layers=2, guidance=5.0, magnitude=1.0)


def _launch(tmp_path_factory, *args):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("cp") / "report.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "sparsepatch.recipes.parallel_video", *args, f"--steps={STEPS}", "--threshold=-1e9,-3", "--check",
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(out.read_text())
    runs = {}
    for per_rank in report["runs"]:
        assert [e["rank"] for e in per_rank] == [0, 1]
        runs[(per_rank[0]["strategy"], per_rank[0]["threshold"])] = per_rank
    return runs


@pytest.fixture(scope="module")
def ulysses(tmp_path_factory):
    return _launch(tmp_path_factory, "--ulysses", "2")


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    return _launch(tmp_path_factory, "--ring", "2", "--ring-strategy", "gather,walk")


def _assert_stats(entry):
    """One entry per self-attention layer per branch on each rank; first step 1.0; non-increasing."""
    density = entry["density"]
    assert set(density) == LAYERS
    for layer in LAYERS:
        assert set(density[layer]) == {"cond", "uncond"}
        for series in density[layer].values():
            assert len(series) == STEPS and series[0] == 1.0
            assert all(b <= a + 1e-9 for a, b in zip(series, series[1:])), series
    assert entry["calls"] == 2 * 2 * STEPS


def _assert_exact(runs, strategy):
    for threshold in (-1e9, -3.0):
        for e in runs[(strategy, threshold)]:
            _assert_stats(e)
            assert e["lists_vs_single"] == ["equal"] * STEPS
            check_bound(e["err_vs_single"], FRAMES_BOUND, "vs single process")
            assert e["density_mean"] == pytest.approx(e["single_density"], abs=1e-6)
    keep_all = runs[(strategy, -1e9)]
    for e in keep_all:
        check_bound(e["err_vs_dense"], FRAMES_BOUND, "keep-all vs dense")
        assert e["density_rank"] == [1.0] * STEPS
    sparse = runs[(strategy, -3.0)]
    assert min(sparse[0]["density_mean"]) < 0.95                       # the sharpened tiny model really skips
    assert sparse[0]["density_rank"] != sparse[1]["density_rank"]       # each rank reports its own share


def test_ulysses_equals_single_process(ulysses):
    _assert_exact(ulysses, "-")


def test_ring_gather_equals_single_process(ring):
    _assert_exact(ring, "gather")


def test_ring_walk_keep_all_equals_dense_and_first_lists_contain_single_process(ring):
    for e in ring[("walk", -1e9)]:
        _assert_stats(e)
        assert e["lists_vs_single"] == ["equal"] * STEPS
        # diffusers merges the per-shard partial outputs in fp32: one more rounding inside each attention call
        check_bound(e["err_vs_dense"], FRAMES_BOUND, "walk keep-all vs dense")
    for e in ring[("walk", -3.0)]:
        _assert_stats(e)
        assert e["lists_vs_single"][0] == "equal"                       # warmup: full list
        assert e["lists_vs_single"][1] in ("equal", "contains")         # written by the first skip call
        assert e["density_rank"][:2] == [1.0, 1.0]
        assert e["err_vs_single"] == e["err_vs_single"] and e["err_vs_single"] < float("inf")
    mean = ring[("walk", -3.0)][0]
    assert mean["density_mean"][2] >= mean["single_density"][2] - 1e-9  # reads the containing list


# --- single-process pieces --------------------------------------------------------------------------------------
def test_merge_partial_of_shards_equals_dense():
    q, k, v = video_like_qkv(frames=2, height=8, width=8, dim=32)
    out, lse = reference.attention(q, k, v, return_lse=True)
    half = k.shape[1] // 2
    parts = [reference.attention(q, k[:, s], v[:, s], return_lse=True) for s in (slice(0, half), slice(half, None))]
    (oa, la), (ob, lb) = [(o, l.transpose(1, 2)) for o, l in parts]
    merged, merged_lse = parallel.merge_partial(oa, la, ob, lb)
    # The partial outputs and lses are fp64 results rounded to fp32 once; the merge weighs them by exp(lse_a - lse),
    # so the lse roundings (eps * |lse|) reach the output times |v|; 2 partials summed.
    want, want_lse = reference.attention(q.double(), k.double(), v.double(), return_lse=True)
    lse_max = want_lse.abs().max().item()
    vmax = v.abs().max().item()
    assert_close_to_oracle(merged, want, torch.float32, reduction=2, magnitude=vmax * (1 + lse_max), what="merged")
    assert_close_to_oracle(merged_lse, want_lse.transpose(1, 2), torch.float32, reduction=2, magnitude=lse_max,
                           what="merged lse")


def test_text_ranges_follow_the_local_layout():
    assert parallel.text_ranges("prefix", 3, 10, 2) == [(0, 3), (10, 13)]
    assert parallel.text_ranges("suffix", 3, 10, 2) == [(7, 10), (17, 20)]
    assert parallel.text_ranges(None, 3, 10, 2) == []


def test_backend_registered_context_parallel_and_released():
    from diffusers.models import attention_dispatch as ad
    pipe = tiny_wan_pipeline()
    sp.patch(pipe, sp.SkipConfig(tile=(16, 16)))
    try:
        member = ad.AttentionBackendName("sparsepatch")
        assert ad._AttentionBackendRegistry._is_context_parallel_available(member)
    finally:
        sp.unpatch(pipe)
    assert "sparsepatch" not in ad._AttentionBackendRegistry._supports_context_parallel
    assert "sparsepatch" not in ad.AttentionBackendName._value2member_map_


# --- the N-GPU benchmark (benchmarks/bench_parallel_step.py) -----------------------------------------------------
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_parallel_step as bench  # noqa: E402

BENCH_LAYERS = 2
BENCH_TOKENS = 256          # --shape tiny: 128x128 x 13 frames -> 4 x 8 x 8


def test_bench_resolves_modes_and_degrees():
    assert bench.resolve_modes("ulysses,ring,unified", 4, None, None) == [
        ("ulysses x4", 4, 1), ("ring x4", 1, 4), ("ulysses 2 x ring 2", 2, 2)]
    assert bench.resolve_modes(None, 4, None, None) == bench.resolve_modes("ulysses,ring,unified", 4, None, None)
    assert bench.resolve_modes(None, 2, None, None) == [("ulysses x2", 2, 1), ("ring x2", 1, 2)]
    assert bench.resolve_modes("unified", 8, None, None) == [("ulysses 4 x ring 2", 4, 2)]
    assert bench.resolve_modes("unified", 8, 2, None) == [("ulysses 2 x ring 4", 2, 4)]
    assert bench.resolve_modes("unified", 8, None, 4) == [("ulysses 2 x ring 4", 2, 4)]
    assert bench.default_split(6) == (3, 2) and bench.default_split(2) is None and bench.default_split(9) == (3, 3)
    for modes, world, u, r, what in (("unified", 2, None, None, "no split"), ("unified", 4, 4, 1, "both >= 2"),
                                     ("unified", 8, 2, 2, "world size 8"), ("spiral", 4, None, None, "unknown mode"),
                                     ("", 4, None, None, "at least one")):
        with pytest.raises(ValueError, match=what):
            bench.resolve_modes(modes, world, u, r)
    assert bench.tokens_of(bench.SHAPES["wan14b"]) == 75600
    assert bench.tokens_of(bench.SHAPES["wan1.3b"]) == 32760
    assert bench.tokens_of(bench.SHAPES["hunyuan"]) == 118800
    assert bench.tokens_of(bench.SHAPES["tiny"]) == BENCH_TOKENS
    args = bench.parse_args(["--quick", "--shape", "wan14b", "--size", "768x1024x81"])
    assert args.reps == 2 and args.size == (768, 1024, 81)
    for bad in (["--shape", "wan2"], ["--density", "0"], ["--size", "720x1281x81"], ["--layers", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_bench_rank_parts_tile_the_global_list():
    g = torch.Generator().manual_seed(0)
    H, T, tile = 6, 8, 16
    S = T * tile
    mask = torch.rand(1, H, T, T, generator=g) < 0.5
    for U, R in ((3, 1), (1, 2), (3, 2), (1, 4)):
        rows = [torch.cat([bench.rank_part(mask, (1, H // U, T // R, T), u, U, r, R, S, tile) for r in range(R)], 2)
                for u in range(U)]
        assert torch.equal(torch.cat(rows, 1), mask), (U, R)
    # shards of 1.5 tiles: each local q tile takes the global row of the tile holding its first row
    part = bench.rank_part(mask, (1, H, 2, T), 0, 1, 1, 4, 6 * tile, tile)    # rank 1 holds rows [24, 48)
    assert torch.equal(part, mask[:, :, [1, 2]])
    with pytest.raises(ValueError, match="does not match"):
        bench.rank_part(mask, (1, H, 3, T), 0, 2, 0, 1, S, tile)


@pytest.fixture(scope="module")
def bench4(tmp_path_factory):
    """4 CPU processes: the tiny shape through the 1-process baseline, Ulysses x4, ring x4, Ulysses 2 x ring 2."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("OUT", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           os.path.join(ROOT, "benchmarks", "bench_parallel_step.py"), "--cpu", "--shape", "tiny", "--reps", "1",
           "--layers", str(BENCH_LAYERS), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "| tiny | 256 | 2 | ulysses 2 x ring 2 |" in proc.stdout
    return json.loads((out / "cpux4-parallel-step.json").read_text())


def test_bench_four_ranks_equal_one_process_at_the_same_lists(bench4):
    """Every mode's lists are the rank's part of the 1-process list (shards of 4 x 16-token tiles), so the density-0.5
    output equals the 1-process one, keep-all equals keep-all, and every rank runs the 1-process density.
    Bound: two fp32 forwards through BENCH_LAYERS blocks of 256-token attention (one step, no guidance)."""
    e = bench4["shapes"]["tiny"]
    assert e["tokens"] == BENCH_TOKENS and e["layers"] == BENCH_LAYERS
    one = e["one_gpu"]
    assert "error" not in one, one
    assert one["lists_forced"] == BENCH_LAYERS and one["keep_all_density"] == 1.0
    assert one["density"] == 0.5                       # round(0.5 * 16) of 16 k tiles in every row
    bound = 2 * denoiser_bound(torch.float32, tokens=BENCH_TOKENS, steps=1, layers=BENCH_LAYERS,
                               magnitude=one["output_absmax"])
    assert set(e["modes"]) == {"ulysses x4", "ring x4", "ulysses 2 x ring 2"}
    for name, m in e["modes"].items():
        assert "error" not in m and "skipped" not in m, (name, m)
        U, R = m["ulysses_degree"], m["ring_degree"]
        assert m["lists_exact"] and m["lists_forced"] == BENCH_LAYERS
        assert sorted((p["u"], p["r"]) for p in m["ranks"]) == [(u, r) for u in range(U) for r in range(R)]
        for p in m["ranks"]:
            assert p["density"] == one["density"] and p["keep_all_density"] == 1.0, (name, p)
        check_bound(m["diff"]["keep_all_vs_1gpu"]["max_abs"], bound, f"{name} keep-all vs 1 process")
        check_bound(m["diff"]["skip_vs_1gpu"]["max_abs"], bound, f"{name} density 0.5 vs 1 process")
    # diffusers' own dense CP: Ulysses runs on CPU; its ring needs return_lse, which no CPU backend gives
    check_bound(e["modes"]["ulysses x4"]["diff"]["dense_cp_vs_1gpu_dense"]["max_abs"], bound, "dense Ulysses x4")
