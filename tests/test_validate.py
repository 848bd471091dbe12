"""sp.validate on the tiny Wan pipeline, its report (PSNR / SSIM, labels, verdict) and the SSIM definition.
The demo command's output is tested in tests/test_cli.py."""
import json
import math
import re
import sys

import pytest
import torch

import sparsepatch as sp
from kernel_checks import check_bound, rel_bound
from sparsepatch.testing import tiny_wan_pipeline, wan_call_kwargs
from sparsepatch.validate import IDENTICAL_DB, ValidationReport, _as_images, _output_space, _ssim_gaussian, ssim


def test_validate_reports_per_layer_cos_output_psnr_and_restores(tmp_path):
    pipe = tiny_wan_pipeline(head_dim=32, attention_gain=100.0)
    pipe.set_progress_bar_config(disable=True)
    kwargs = wan_call_kwargs(height=96, width=96, num_frames=9, steps=4)
    events = []
    report = sp.validate(pipe, sp.SkipConfig(threshold=-3.0, tile=(16, 16)), progress=lambda **e: events.append(e),
                         **kwargs)
    assert sp.handle_of(pipe) is None
    # one progress event per step of each of the 4 runs, in order; the checked run carries the step's PSNR
    assert [(e["run"], e["step"]) for e in events] == [(r, i) for r in (1, 2, 3, 4) for i in (1, 2, 3, 4)]
    assert all(e["runs"] == 4 and e["steps"] == 4 and e["elapsed_s"] > 0 for e in events)
    assert [e["psnr_db"] for e in events if e["run"] == 2] == report.extra["step_psnr_db"]
    assert all(e["psnr_db"] is None for e in events if e["run"] != 2)
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
    # SSIM beside PSNR: the pipeline decodes (output_type "pt"), so pixel space; per step on the latents
    assert report.ssim_space == "pixel" and 0.5 < report.output_ssim < 1.0
    assert len(report.extra["step_ssim"]) == 4 and report.extra["step_ssim"][0] == pytest.approx(1.0, abs=1e-9)
    assert data["output_ssim"] == report.output_ssim and data["ssim_space"] == "pixel"
    assert [r["ssim"] for r in data["per_step"]] == report.extra["step_ssim"]
    assert report.device == "cpu" and report.dtype == "torch.float32"
    assert report.backends["dense"] == "diffusers attention (torch SDPA unless set otherwise)"
    # the handle's own account of what served the patched calls: "sparsepatch <backend> x<calls>, ..."
    served = re.findall(r"([\w:.-]+) x(\d+)", report.backends["patched"])
    assert report.backends["patched"].startswith("sparsepatch ") and served
    # 2 layers x 2 branches x 4 steps, in the checked and the timed patched run
    assert sum(int(n) for _, n in served) == 2 * 2 * 4 * 2
    assert "SSIM" in report.summary() and report.summary().splitlines()[-1] == report.verdict()

    # the same generator seed gives the same dense output: keep-everything validates to (near) identity
    exact = sp.validate(pipe, sp.SkipConfig(threshold=-1e9, tile=(16, 16)), measure_speed=False, **kwargs)
    assert exact.output_psnr_db > 80 and exact.patched_s is None
    assert exact.output_ssim > 1 - 1e-6


def test_validate_refuses_a_patched_object():
    pipe = tiny_wan_pipeline()
    sp.patch(pipe, sp.DenseConfig())
    try:
        import pytest
        with pytest.raises(ValueError, match="already patched"):
            sp.validate(pipe, sp.DenseConfig())
    finally:
        sp.unpatch(pipe)


def test_validate_gradients_exact_and_approximate():
    from sparsepatch.testing import tiny_wan_pipeline
    model = tiny_wan_pipeline(head_dim=32, attention_gain=100.0).transformer
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 4, 3, 16, 16, generator=g), timestep=torch.tensor([700]),
                  encoder_hidden_states=torch.randn(1, 16, 16, generator=g))
    keep_all = sp.validate_gradients(model, sp.SkipConfig(threshold=-1e9, tile=(16, 16)), **inputs)
    # keep-all gradients are two fp32 evaluations (forward + backward through 2 blocks over 192 tokens) of the dense
    # ones (dense: SDPA; keep-all: the CPU skip kernel): relative error r <= rel_bound, amplified by the score size
    # (an fp32 softmax turns the absolute score error eps * |s| into a relative weight error; this model multiplies
    # its logits by attention_gain / sqrt(head_dim)), and 1 - cos = r^2 / 2 for a perturbation orthogonal to the
    # gradient
    r = rel_bound(torch.float32, reduction=3 * 8 * 8, depth=2 * 2) * (1 + 100.0 / 32 ** 0.5)
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


# --- SSIM ---------------------------------------------------------------------------------------------------------

def _ssim_oracle(x, y, data_range):
    """SSIM by its definition, pixel by pixel in fp64 Python loops: an 11 x 11 gaussian window (sigma 1.5,
    normalised) over the image reflect-padded by 5 (numpy's "reflect": the edge pixel is not repeated)."""
    import numpy as np
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    g = np.exp(-0.5 * ((np.arange(11) - 5) / 1.5) ** 2)
    w = np.outer(g, g) / np.outer(g, g).sum()
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    total, count = 0.0, 0
    for a, b in zip(x.reshape(-1, *x.shape[-2:]), y.reshape(-1, *y.shape[-2:])):
        pa, pb = np.pad(a, 5, mode="reflect"), np.pad(b, 5, mode="reflect")
        for i in range(a.shape[0]):
            for j in range(a.shape[1]):
                wa, wb = pa[i:i + 11, j:j + 11], pb[i:i + 11, j:j + 11]
                mu_a, mu_b = (w * wa).sum(), (w * wb).sum()
                var_a = max((w * wa * wa).sum() - mu_a ** 2, 0.0)
                var_b = max((w * wb * wb).sum() - mu_b ** 2, 0.0)
                cov = (w * wa * wb).sum() - mu_a * mu_b
                total += ((2 * mu_a * mu_b + c1) * (2 * cov + c2)
                          / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2)))
                count += 1
    return total / count


def _pair(shape, noise, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g, dtype=torch.float64)
    return x, x + noise * torch.randn(shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("shape,noise", [((2, 9, 13), 0.05), ((1, 6, 6), 0.3), ((3, 16, 12), 0.01)])
def test_ssim_fallback_matches_the_definition(shape, noise):
    x, y = _pair(shape, noise)
    got = _ssim_gaussian(x, y, data_range=1.0)
    # fp64 both ways, sums of ~121 terms of magnitude <= 1: agreement far below 1e-12
    assert got == pytest.approx(_ssim_oracle(x, y, 1.0), abs=1e-12)
    assert 0.0 < got < 1.0


def test_ssim_in_chunks_equals_one_pass(monkeypatch):
    v = sys.modules["sparsepatch.validate"]          # the attribute sparsepatch.validate is the function
    x, y = _pair((7, 12, 10), 0.1, seed=3)
    whole = _ssim_gaussian(x, y, data_range=1.0)
    monkeypatch.setattr(v, "SSIM_CHUNK_PIXELS", 2 * 12 * 10)      # chunks of 2 images, the last one of 1
    assert _ssim_gaussian(x, y, data_range=1.0) == pytest.approx(whole, abs=1e-14)
    assert whole == pytest.approx(_ssim_oracle(x, y, 1.0), abs=1e-12)


@pytest.mark.parametrize("shape", [(2, 3, 16, 16), (1, 4, 3, 24, 20), (2, 5, 3, 12, 12)])
def test_ssim_matches_torchmetrics(shape):
    tm = pytest.importorskip("torchmetrics.functional.image")
    x, y = _pair(shape, 0.05, seed=1)
    images_x, images_y = _as_images(x), _as_images(y)
    ref = tm.structural_similarity_index_measure(images_y[:, None], images_x[:, None], data_range=0.7).item()
    assert _ssim_gaussian(images_x, images_y, data_range=0.7) == pytest.approx(ref, abs=1e-12)
    assert ssim(x, y, data_range=0.7) == pytest.approx(ref, abs=1e-12)


def test_ssim_properties_and_arguments():
    x, y = _pair((2, 8, 3, 16, 16), 0.1)            # (B, F, C, H, W) video
    assert ssim(x, x) == pytest.approx(1.0, abs=1e-12)
    assert ssim(x, y) < ssim(x, x + 0.01 * (y - x)) < 1.0          # more noise, lower SSIM
    assert ssim(x, y) == pytest.approx(ssim(y, x, data_range=(x.max() - x.min()).item()), abs=1e-12)
    # channels-last video (B, F, H, W, C) is the same images as (B, F, C, H, W)
    assert ssim(x.movedim(2, -1), y.movedim(2, -1)) == pytest.approx(ssim(x, y), abs=1e-12)
    assert ssim(torch.randn(4, 100), torch.randn(4, 100)) is None             # not images
    assert ssim(torch.randn(1, 3, 5, 5), torch.randn(1, 3, 5, 5)) is None     # under the 6 x 6 the window needs
    with pytest.raises(ValueError, match="patched: shape"):
        ssim(x, y[:1])
    with pytest.raises(ValueError, match="data_range must be > 0"):
        ssim(x, y, data_range=-1.0)


def test_output_space():
    class Out:
        def __init__(self, **kw):
            self.__dict__.update(kw)
    frames = torch.zeros(1, 9, 3, 64, 64)
    assert _output_space(Out(frames=frames), {"output_type": "pt"}) == "pixel"
    assert _output_space(Out(frames=frames), {"output_type": "latent"}) == "latent"
    assert _output_space(torch.zeros(1, 4, 3, 8, 8), {}) == "latent"             # a sampler returning latents
    assert _output_space(Out(logits=torch.zeros(1, 8, 10)), {}) is None


# --- the report's text ------------------------------------------------------------------------------------------

def _report(device="cpu", step_psnr=(math.inf, 163.77, 149.31, 50.13), output_psnr=29.77, patched_s=9.5):
    steps = len(step_psnr)
    return ValidationReport(
        config="SkipConfig(threshold=-0.15)", attention_cos={"l0": {"cond": [1.0, 1.0, 1.0, 0.98][:steps]}},
        density={"l0": {"cond": [1.0, 1.0, 1.0, 0.49][:steps]}}, output_cos=0.94, output_psnr_db=output_psnr,
        output_max_abs=2.5, dense_s=0.88, patched_s=patched_s,
        extra={"dense_step_s": [0.1] * steps, "patched_step_s": [0.9] * steps, "step_psnr_db": list(step_psnr),
               "step_ssim": [1.0, 1.0, 1.0, 0.93][:steps]},
        output_ssim=0.9312, ssim_space="latent", device=device, dtype="torch.float32",
        backends={"dense": "diffusers attention", "patched": "sparsepatch PyTorch reference"})


def test_summary_shows_identical_for_rounding_level_psnr():
    # 64 eps_fp32 of the value range: the bound documented in ValidationReport.identical_db
    assert IDENTICAL_DB == pytest.approx(-20 * math.log10(64 * 2.0 ** -23))
    rows = [l for l in _report().summary().splitlines() if l[:4].strip().isdigit()]
    assert [l.split()[4] for l in rows] == ["identical", "identical", "identical", "50.13"]
    assert "163.77" not in _report().summary()
    just_below = _report(step_psnr=(IDENTICAL_DB - 0.01,) * 4)
    assert "identical" not in " ".join(l.split()[4] for l in just_below.summary().splitlines()
                                       if l[:4].strip().isdigit())


def test_cpu_report_has_no_speed_ratio_and_labels_the_timings():
    text = _report().summary()
    timing = next(l for l in text.splitlines() if l.startswith("time on cpu"))
    assert timing == ("time on cpu (float32): dense 880.0 ms [diffusers attention], "
                      "patched 9500.0 ms [sparsepatch PyTorch reference]")
    assert "quality check; speed is measured on a GPU: see BENCHMARKS.md" in text.splitlines()
    assert "0.09x" not in text and not any(l.rstrip().endswith("x)") for l in text.splitlines())
    assert json.loads(_report().to_json())["speedup"] is None
    assert text.splitlines()[-1] == ("verdict: density 0.49 after warm-up, output PSNR 29.77 dB, "
                                     "SSIM 0.9312 (latent), speed not measured on cpu")


def test_gpu_report_shows_the_ratio():
    report = _report(device="cuda:0", patched_s=0.44)
    text = report.summary()
    assert "time on cuda:0 (float32): dense 880.0 ms [diffusers attention], patched 440.0 ms " \
           "[sparsepatch PyTorch reference] -> 2.00x" in text
    assert "quality check" not in text
    assert report.verdict().endswith("speed 2.00x vs dense on cuda:0")
    assert json.loads(report.to_json())["speedup"] == pytest.approx(2.0)


def test_plot_leaves_the_matplotlib_backend_alone(tmp_path):
    import matplotlib
    import matplotlib.pyplot as plt
    before = matplotlib.get_backend()
    plt.switch_backend("svg")          # stands in for Jupyter's inline backend: any backend other than Agg
    try:
        fig = _report().plot(tmp_path / "r.png")
        assert matplotlib.get_backend() == "svg"
        assert (tmp_path / "r.png").stat().st_size > 1000
        plt.close(fig)
    finally:
        plt.switch_backend(before)
