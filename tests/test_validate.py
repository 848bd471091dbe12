"""sp.validate and the demo CLI on the tiny Wan pipeline."""
import json
import math
import subprocess
import sys

import torch

import sparsepatch as sp
from kernel_checks import check_bound, rel_bound
from sparsepatch.testing import tiny_wan_pipeline, wan_call_kwargs


def test_validate_reports_per_layer_cos_output_psnr_and_restores(tmp_path):
    pipe = tiny_wan_pipeline(head_dim=32, attention_gain=100.0)
    pipe.set_progress_bar_config(disable=True)
    kwargs = wan_call_kwargs(height=96, width=96, num_frames=9, steps=4)
    report = sp.validate(pipe, sp.SkipConfig(threshold=-3.0, tile=(16, 16)), **kwargs)
    assert sp.handle_of(pipe) is None
    rows = report.per_step()
    assert len(rows) == 4 and rows[0]["density"] == 1.0 and rows[-1]["density"] < 0.95
    assert rows[0]["cos_mean"] > 0.999999                    # step 0 is warmup: exactly dense attention
    assert all(0.5 < r["cos_min"] <= 1.0 + 1e-9 for r in rows)
    assert set(report.attention_cos) == {"transformer.blocks.0.attn1", "transformer.blocks.1.attn1"}
    assert set(report.attention_cos["transformer.blocks.0.attn1"]) == {"cond", "uncond"}
    assert 0.99 < report.output_cos <= 1.0 and 20 < report.output_psnr_db < math.inf
    assert report.dense_s > 0 and report.patched_s > 0
    assert len(report.extra["dense_step_s"]) == 4 and len(report.extra["patched_step_s"]) == 4
    data = json.loads(report.to_json(tmp_path / "r.json"))
    assert data["per_step"][0]["density"] == 1.0 and (tmp_path / "r.json").exists()
    report.plot(tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert "PSNR" in report.summary()

    # the same generator seed gives the same dense output: keep-everything validates to (near) identity
    exact = sp.validate(pipe, sp.SkipConfig(threshold=-1e9, tile=(16, 16)), measure_speed=False, **kwargs)
    assert exact.output_psnr_db > 80 and exact.patched_s is None


def test_validate_refuses_a_patched_object():
    pipe = tiny_wan_pipeline()
    sp.patch(pipe, sp.DenseConfig())
    try:
        import pytest
        with pytest.raises(ValueError, match="already patched"):
            sp.validate(pipe, sp.DenseConfig())
    finally:
        sp.unpatch(pipe)


def test_demo_cli_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "sparsepatch", "demo", "--steps", "3", "--size", "64", "--cpu"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    table = [l for l in lines if l.strip()[:1].isdigit()]
    assert len(table) == 3
    assert "PSNR" in out.stdout and "density" in out.stdout


def test_validate_gradients_exact_and_approximate():
    from sparsepatch.testing import tiny_wan_pipeline
    model = tiny_wan_pipeline(head_dim=32, attention_gain=100.0).transformer
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 4, 3, 16, 16, generator=g), timestep=torch.tensor([700]),
                  encoder_hidden_states=torch.randn(1, 16, 16, generator=g))
    keep_all = sp.validate_gradients(model, sp.SkipConfig(threshold=-1e9, tile=(16, 16)), **inputs)
    # keep-all gradients are two fp32 evaluations (forward + backward through 2 blocks over 192 tokens) of the dense
    # ones: relative error r <= rel_bound, and 1 - cos = r^2 / 2 for a perturbation orthogonal to the gradient
    r = rel_bound(torch.float32, reduction=3 * 8 * 8, depth=2 * 2)
    check_bound(1 - keep_all.param_grad_cos, r * r / 2, "1 - cos")
    check_bound(1 - keep_all.param_grad_cos_min, r * r / 2, "1 - min cos")
    assert set(keep_all.attention_grad_cos) == {"blocks.0.attn1", "blocks.1.attn1"}
    check_bound(max(1 - c for layer in keep_all.attention_grad_cos.values() for c in layer.values()), r * r / 2,
                "attention 1 - cos")

    exact = sp.validate_gradients(model, sp.SkipConfig(threshold=-2.0, tile=(16, 16)), **inputs)
    approx = sp.validate_gradients(model, sp.SkipConfig(threshold=-2.0, tile=(16, 16), backward=True), **inputs)
    density = exact.density["blocks.0.attn1"]["default"]
    assert density[0] == 1.0 and density[-1] < 0.9                       # the grad pass read a pruned list
    assert 0.9 < exact.param_grad_cos < 1.0 and 0.9 < approx.param_grad_cos < 1.0
    assert exact.loss_patched == approx.loss_patched                      # backward=True changes only gradients
    # lists built from these very inputs: the forward keeps every tile it reads, so backward=True drops nothing
    # cos moves by at most the relative change of either gradient: two fp32 evaluations, 2 r
    check_bound(abs(approx.param_grad_cos - exact.param_grad_cos), 2 * r, "cos exact vs approx")
    assert sp.handle_of(model) is None and "dq" in approx.summary()
