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
