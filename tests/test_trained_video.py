"""The committed tiny video denoiser (sparsepatch/assets/tiny_video) against the procedural clips it was trained on.

Clips are compared through statistics of the latent video (C, F, H, W), averaged over a batch of 8 clips, one per
procedural class (clip i prompted with class i, as `testing.trained_video_call_kwargs` does):
- amplitude: per-channel std, RMS over channels; channel_offset: |per-channel mean|, mean over channels;
- colour_rank1: fraction of the channel covariance in its top eigenvector (a clip is one scalar field times one
  colour vector: ~0.99; i.i.d. noise over 4 channels: ~0.26);
- temporal_diff: E[(x[f+1] - x[f])^2] / (2 var) (0: static, 1: independent frames);
- spatial_grad: the same over neighbouring pixels (0: smooth, 1: white noise);
- background: fraction of pixels within 0.4 std of the most common value of the clip's top-colour field.
Reference: 16 batches of 8 fresh procedural clips (`data.render_clip`, the training shapes and colour jitter, from
training_info.json), mean and std of each
statistic across batches. Band: mean +- max(3 std, a tolerance): for the four structure statistics the tolerance is
a third of the distance from the reference mean to pure Gaussian noise (the sampler's starting point), i.e. a clip
must be at least two thirds of the way from noise to the data; amplitude and channel_offset (which noise shares with
the data) get 0.1, 10% of the data's unit scale. Each test also checks that a control (the noised input, a
random-weight model of the same architecture) falls outside at least one band, so the bands can fail.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers", reason="diffusers not installed")

from kernel_checks import assert_close_to_oracle                                  # noqa: E402
from sparsepatch import testing                                                # noqa: E402
from sparsepatch.recipes.data import NUM_CLASSES, render_clip                   # noqa: E402

STRUCTURE = ("colour_rank1", "temporal_diff", "spatial_grad", "background")
MOMENTS = ("amplitude", "channel_offset")
STATS = MOMENTS + STRUCTURE
MOMENT_TOL = 0.1
REFERENCE_BATCHES = 16
STRENGTH = 0.5          # partial denoising: start from x_0.5 = 0.5 clip + 0.5 noise
PARTIAL_STEPS = 5
SAMPLE_STEPS = 6


def clip_stats(x: torch.Tensor) -> dict:
    """Statistics of one latent clip (C, F, H, W); see the module docstring."""
    x = x.double()
    c = x.shape[0]
    flat = x.reshape(c, -1)
    var = flat.var(dim=1)
    evals, evecs = torch.linalg.eigh(torch.cov(flat))
    field = torch.einsum("c,cfhw->fhw", evecs[:, -1], x - flat.mean(1)[:, None, None, None])
    field = field / field.std()
    hist = torch.histc(field.float(), bins=80, min=-4.0, max=4.0)
    mode = -4.0 + (int(hist.argmax()) + 0.5) * 0.1
    dx = (x[..., 1:] - x[..., :-1]).pow(2).mean() + (x[..., 1:, :] - x[..., :-1, :]).pow(2).mean()
    return dict(amplitude=var.mean().sqrt().item(), channel_offset=flat.mean(1).abs().mean().item(),
                colour_rank1=(evals[-1] / evals.sum()).item(),
                temporal_diff=((x[:, 1:] - x[:, :-1]).pow(2).mean() / (2 * var.mean())).item(),
                spatial_grad=(dx / (4 * var.mean())).item(),
                background=((field - mode).abs() < 0.4).double().mean().item())


def batch_stats(clips: torch.Tensor) -> dict:
    rows = [clip_stats(x) for x in clips]
    return {k: sum(r[k] for r in rows) / len(rows) for k in STATS}


def procedural_batch(seed: int, frames: int, size: int, channels: int = 4,
                     colour_jitter: float | None = None) -> torch.Tensor:
    """One clip of each procedural class, (NUM_CLASSES, C, F, H, W), from generators seeded seed * 100 + class;
    colour_jitter: the training distribution's (training_info.json), see `data.render_clip`."""
    return torch.stack([render_clip(c, frames, size, channels, generator=torch.Generator().manual_seed(seed * 100 + c),
                                    colour_jitter=colour_jitter)
                        for c in range(NUM_CLASSES)])


@pytest.fixture(scope="module")
def pipes():
    trained, info = testing.tiny_trained_video_pipeline()
    random, _ = testing.tiny_trained_video_pipeline(random_weights=True)
    return {"trained": trained, "random": random}, info


@pytest.fixture(scope="module")
def bands(pipes):
    _, info = pipes
    return reference_bands(info["frames"], info["latent_size"], info.get("colour_jitter"))


def reference_bands(frames: int, size: int, colour_jitter: float | None) -> dict:
    """{statistic: {mean, std, noise, lo, hi}}: the bands of the module docstring for clips (4, frames, size, size)."""
    # seeds >= 100_000: no overlap with the training stream (ProceduralClips seeds 0 .. dataset length)
    refs = [batch_stats(procedural_batch(1000 + j, frames, size, colour_jitter=colour_jitter))
            for j in range(REFERENCE_BATCHES)]
    noise = batch_stats(torch.randn(NUM_CLASSES, 4, frames, size, size, generator=torch.Generator().manual_seed(1)))
    out = {}
    for k in STATS:
        values = torch.tensor([r[k] for r in refs], dtype=torch.float64)
        mean, std = values.mean().item(), values.std().item()
        tol = MOMENT_TOL if k in MOMENTS else abs(noise[k] - mean) / 3
        half = max(3 * std, tol)
        out[k] = dict(mean=mean, std=std, noise=noise[k], lo=mean - half, hi=mean + half)
    return out


def outside(stats: dict, bands: dict) -> list[str]:
    return [k for k in STATS if not bands[k]["lo"] <= stats[k] <= bands[k]["hi"]]


def show(rows: dict, bands: dict) -> None:
    print(f"\n{'':<22}" + "".join(f"{k:>15}" for k in STATS))
    print(f"{'reference mean':<22}" + "".join(f"{bands[k]['mean']:>15.4f}" for k in STATS))
    print(f"{'reference std':<22}" + "".join(f"{bands[k]['std']:>15.4f}" for k in STATS))
    print(f"{'band':<22}" + "".join(f"{bands[k]['lo']:>7.3f}..{bands[k]['hi']:<6.3f}" for k in STATS))
    print(f"{'pure noise':<22}" + "".join(f"{bands[k]['noise']:>15.4f}" for k in STATS))
    for name, stats in rows.items():
        bad = outside(stats, bands)
        print(f"{name:<22}" + "".join(f"{stats[k]:>14.4f}{'*' if k in bad else ' '}" for k in STATS))
    print("(* outside the band)")


def _call_kwargs(pipe, info, steps, **extra):
    return dict(testing.trained_video_call_kwargs(pipe, info, batch=NUM_CLASSES, steps=steps, seed=0), **extra)


@pytest.fixture(scope="module")
def samples(pipes):
    """Dense samples from noise, one clip per class: the trained model with the sampler recorded with its weights
    (training_info.json "sampler": timestep shift and classifier-free guidance scale); the random-weight control
    without guidance (guidance cannot give random weights structure; it would only double the control's cost)."""
    models, info = pipes
    return {"trained": models["trained"](**_call_kwargs(models["trained"], info, SAMPLE_STEPS)),
            "random": models["random"](**_call_kwargs(models["random"], info, SAMPLE_STEPS, guidance_scale=1.0))}


def test_partial_denoising_lands_in_the_training_distribution(pipes, bands):
    """Held-out procedural clips noised to t = 0.5 and denoised by the sampler (conditional velocity only, no
    guidance, uniform steps: the layout is already in the input): the trained model brings every statistic back
    into its band; the noised input and the random-weight model do not."""
    models, info = pipes
    clips = procedural_batch(2000, info["frames"], info["latent_size"], colour_jitter=info.get("colour_jitter"))
    kwargs = _call_kwargs(models["trained"], info, PARTIAL_STEPS, latents=clips, strength=STRENGTH,
                          guidance_scale=1.0, shift=1.0)
    noise = torch.randn(kwargs["shape"], generator=torch.Generator().manual_seed(0))
    rows = {"held-out clips": batch_stats(clips),
            f"noised (t={STRENGTH})": batch_stats((1 - STRENGTH) * clips + STRENGTH * noise)}
    for name, pipe in models.items():
        rows[f"{name} denoised"] = batch_stats(pipe(**dict(kwargs, generator=torch.Generator().manual_seed(0))))
    show(rows, bands)
    assert outside(rows["held-out clips"], bands) == []
    assert outside(rows[f"noised (t={STRENGTH})"], bands), "the noised input already passes: the bands are too wide"
    assert outside(rows["random denoised"], bands), "a random-weight model passes: the bands do not discriminate"
    assert outside(rows["trained denoised"], bands) == []


def test_random_model_samples_fail_the_bands(samples, bands):
    rows = {name + " sample": batch_stats(x) for name, x in samples.items()}
    show(rows, bands)
    assert outside(rows["random sample"], bands)


def test_trained_model_samples_from_noise_match_the_training_distribution(samples, bands):
    stats = batch_stats(samples["trained"])
    show({"trained sample": stats}, bands)
    assert outside(stats, bands) == []


def test_sampler_timestep_grid():
    """The Euler grid: shift 1 is uniform; shift s warps u -> s u / (1 + (s - 1) u), so more steps at high noise;
    partial denoising starts exactly at t = strength."""
    grid = testing._euler_flow_sampler_class().timesteps
    # fp64 math rounded once to fp32
    assert_close_to_oracle(grid(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64), torch.float32)
    shifted = grid(4, shift=3.0)
    assert_close_to_oracle(shifted, torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0], dtype=torch.float64), torch.float32)
    assert_close_to_oracle(grid(5, shift=3.0, strength=0.5)[:1], torch.tensor([0.5], dtype=torch.float64),
                           torch.float32)
    assert bool((grid(7, shift=5.0, strength=0.8).diff() < 0).all())
    with pytest.raises(ValueError, match="strength"):
        grid(4, strength=1.5)
