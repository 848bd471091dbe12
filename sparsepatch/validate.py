"""Compare a patched run with the dense one: per-layer attention cos-sim per step, output PSNR / SSIM / cos-sim,
timings labelled with the device and the attention backends that ran."""
from __future__ import annotations

import copy
import json
import math
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch

from . import kernels
from .patcher import handle_of, unpatch

IDENTICAL_DB = -20 * math.log10(64 * torch.finfo(torch.float32).eps)  # see ValidationReport.identical_db


@dataclass
class ValidationReport:
    """What `sp.validate` measured.

    attention_cos: {layer: {branch: [cos-sim per call]}} of the patched attention output against dense attention
        computed on the SAME q/k/v (the local error of each call, not accumulated drift).
    density: {layer: {branch: [fraction of tiles computed per call]}} (1.0 = dense).
    output_cos / output_psnr_db / output_max_abs: the final outputs, patched vs dense (PSNR over the dense output's
        value range, peak-to-peak).
    dense_s / patched_s: wall time of one dense and one patched call (seconds, CUDA synchronized).
    extra: for pipelines taking `callback_on_step_end`, "dense_step_s" / "patched_step_s" (seconds per step) and,
        where the callback is handed "latents", "step_psnr_db" / "step_ssim" (the latents after each step, patched
        vs dense; SSIM nan where the latents are smaller than the window).
    output_ssim / ssim_space: SSIM (`ssim`, data range = the dense output's peak-to-peak, as PSNR) of the final
        outputs when they are images or video, in "pixel" space when the pipeline decoded them and "latent" space
        otherwise; None (and ssim_space None) for other outputs (logits, hidden states) or images under 6 x 6.
    device / dtype: where and in what dtype the model ran ("cpu", "cuda:0"; "torch.float32", ...).
    backends: what ran the attention: {"dense": label of the unpatched model's attention, "patched": label of
        the sparsepatch backends (from `handle.stats()["backends"]` when the dispatcher reports them)}.
    """

    config: str
    attention_cos: dict
    density: dict
    output_cos: float
    output_psnr_db: float
    output_max_abs: float
    dense_s: float
    patched_s: float | None
    extra: dict = field(default_factory=dict)
    output_ssim: float | None = None
    ssim_space: str | None = None
    device: str = "cpu"
    dtype: str = "torch.float32"
    backends: dict = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        """dense_s / patched_s (None without a timed patched run). Only meaningful where `speed_measured`."""
        return None if not self.patched_s else self.dense_s / self.patched_s

    @property
    def speed_measured(self) -> bool:
        """True where the run's timings say something about speed: on CUDA, where the sparsepatch kernels run.
        Elsewhere attention runs a PyTorch path built for checking quality, and a ratio would mislead."""
        return self.device.startswith("cuda") and self.patched_s is not None

    def identical_db(self) -> float:
        """PSNR (dB) at and above which two outputs are shown as "identical": rms(diff) <= 64 eps_fp32 x the dense
        value range = 102.4 dB. The comparison runs in fp32; running the same dense attention through another
        kernel reorders its sums, and a reordered sum of n terms typically moves by sqrt(n) eps relative, so 64 eps
        covers sums over up to 4096 keys. Warm-up steps of an fp32 model land at 135-165 dB, the first sparse
        step of the demo at ~50 dB; bf16 models differ by bf16 rounding (~60 dB) and show their number."""
        return IDENTICAL_DB
    def _fmt_psnr(self, psnr: float, width: int = 0) -> str:
        if math.isnan(psnr):
            return f"{'-':>{width}}"
        return f"{'identical':>{width}}" if psnr >= self.identical_db() else f"{psnr:>{width}.2f}"

    def per_step(self) -> list[dict]:
        """[{step, density, cos_mean, cos_min, psnr_db, ssim, dense_ms, patched_ms}] aggregated over layers and
        branches (psnr_db / ssim: the pipeline's latents after the step, patched vs dense; nan where not recorded)."""
        dens, coss = defaultdict(list), defaultdict(list)
        for layer, branches in self.density.items():
            for values in branches.values():
                for i, d in enumerate(values):
                    dens[i].append(d)
        for layer, branches in self.attention_cos.items():
            for values in branches.values():
                for i, c in enumerate(values):
                    coss[i].append(c)
        dense_ms = self.extra.get("dense_step_s", [])
        patched_ms = self.extra.get("patched_step_s", [])
        psnr = self.extra.get("step_psnr_db", [])
        ssims = self.extra.get("step_ssim", [])
        rows = []
        for i in sorted(dens):
            rows.append(dict(step=i, density=sum(dens[i]) / len(dens[i]),
                             cos_mean=sum(coss[i]) / len(coss[i]) if coss[i] else float("nan"),
                             cos_min=min(coss[i]) if coss[i] else float("nan"),
                             psnr_db=psnr[i] if i < len(psnr) else float("nan"),
                             ssim=ssims[i] if i < len(ssims) and ssims[i] is not None else float("nan"),
                             dense_ms=dense_ms[i] * 1e3 if i < len(dense_ms) else float("nan"),
                             patched_ms=patched_ms[i] * 1e3 if i < len(patched_ms) else float("nan")))
        return rows

    def _density_after_warmup(self) -> tuple[float | None, bool]:
        """(mean density over the steps after the leading all-dense warm-up steps, whether there were any);
        (None, False) without density data."""
        dens = [r["density"] for r in self.per_step()]
        if not dens:
            return None, False
        first = next((i for i, d in enumerate(dens) if d < 1.0), len(dens))
        rest = dens[first:] or dens
        return sum(rest) / len(rest), 0 < first < len(dens)

    def timing_lines(self) -> list[str]:
        """The timing, labelled with the device and backends; on CPU a note instead of a speed ratio."""
        dense = self.backends.get("dense", "the model's own attention")
        patched = self.backends.get("patched", "sparsepatch")
        lines = [f"time on {self.device} ({self.dtype.replace('torch.', '')}): dense {self.dense_s * 1e3:.1f} ms "
                 f"[{dense}]" + (f", patched {self.patched_s * 1e3:.1f} ms [{patched}]" if self.patched_s else "")]
        if self.speed_measured:
            lines[0] += f" -> {self.speedup:.2f}x"
        elif self.patched_s is not None:
            lines.append("quality check; speed is measured on a GPU: see BENCHMARKS.md")
        return lines

    def verdict(self) -> str:
        """One line: density after warm-up, output PSNR / SSIM vs dense, speed where measured."""
        density, warmed = self._density_after_warmup()
        parts = ["density n/a" if density is None else
                 f"density {density:.2f}" + (" after warm-up" if warmed else "")]
        parts.append(f"output PSNR {self._fmt_psnr(self.output_psnr_db)}"
                     + ("" if self.output_psnr_db >= self.identical_db() else " dB"))
        if self.output_ssim is not None:
            parts.append(f"SSIM {self.output_ssim:.4f} ({self.ssim_space})")
        if self.speed_measured:
            parts.append(f"speed {self.speedup:.2f}x vs dense on {self.device}")
        elif self.patched_s is not None:
            parts.append(f"speed not measured on {self.device}")
        return "verdict: " + ", ".join(parts)

    def summary(self) -> str:
        rows = self.per_step()
        has_ssim = any(math.isfinite(r["ssim"]) for r in rows)
        lines = [f"sparsepatch validation — {self.config}",
                 f"{'step':>4} {'density':>8} {'attn cos mean':>14} {'attn cos min':>13} {'PSNR dB':>9} "
                 + (f"{'SSIM':>7} " if has_ssim else "") + f"{'dense ms':>9} {'patched ms':>10}"]
        for row in rows:
            lines.append(f"{row['step']:>4} {row['density']:>8.3f} {row['cos_mean']:>14.6f} {row['cos_min']:>13.6f} "
                         f"{self._fmt_psnr(row['psnr_db'], 9)} " + (f"{row['ssim']:>7.4f} " if has_ssim else "")
                         + f"{row['dense_ms']:>9.1f} {row['patched_ms']:>10.1f}")
        if any(math.isfinite(r["psnr_db"]) for r in rows):
            lines.append(f"(PSNR{' / SSIM' if has_ssim else ''} per step: the pipeline's latents after that step, "
                         f"patched vs dense; identical: within fp32 rounding, >= {self.identical_db():.1f} dB)")
        ssim = f"  SSIM {self.output_ssim:.4f}" if self.output_ssim is not None else ""
        space = f" ({self.ssim_space})" if self.ssim_space else ""
        psnr = self._fmt_psnr(self.output_psnr_db)
        lines.append(f"output{space}: cos {self.output_cos:.6f}  PSNR {psnr}{'' if psnr == 'identical' else ' dB'}"
                     f"{ssim}  max|diff| {self.output_max_abs:.3g}")
        lines += self.timing_lines()
        for key, value in self.extra.items():
            if not key.endswith("_step_s") and key not in ("step_psnr_db", "step_ssim"):
                lines.append(f"{key}: {value}")
        lines.append(self.verdict())
        return "\n".join(lines)

    def to_json(self, path=None) -> str:
        """The report as JSON (every field, plus per_step, speedup — null where speed is not measured —, verdict)."""
        data = asdict(self)
        data["per_step"] = self.per_step()
        data["speedup"] = self.speedup if self.speed_measured else None
        data["verdict"] = self.verdict()
        text = json.dumps(data, indent=1, default=float)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def plot(self, path=None):
        """Density and attention cos-sim per step (matplotlib). Saves to `path` if given; returns the figure.

        Leaves matplotlib's backend alone: in Jupyter the figure shows inline, headless it renders with Agg."""
        import matplotlib.pyplot as plt
        rows = self.per_step()
        steps = [r["step"] for r in rows]
        fig, (ax_d, ax_c) = plt.subplots(1, 2, figsize=(10, 3.5))
        ax_d.plot(steps, [r["density"] for r in rows], marker="o")
        ax_d.set(xlabel="step", ylabel="density (tiles computed)", ylim=(0, 1.05), title="density per step")
        ax_c.plot(steps, [r["cos_mean"] for r in rows], marker="o", label="mean")
        ax_c.plot(steps, [r["cos_min"] for r in rows], marker="x", label="min")
        ax_c.set(xlabel="step", ylabel="cos-sim vs dense", title="attention output cos-sim")
        ax_c.legend()
        psnr = self._fmt_psnr(self.output_psnr_db)
        ssim = f", SSIM {self.output_ssim:.3f} ({self.ssim_space})" if self.output_ssim is not None else ""
        fig.suptitle(f"{self.config}\noutput PSNR {psnr}{'' if psnr == 'identical' else ' dB'}{ssim}", fontsize=9)
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=100)
        return fig


def output_tensor(out) -> torch.Tensor:
    """The main tensor of a pipeline/model output (frames, images, sample, logits, ...)."""
    for attr in ("frames", "images", "sample", "logits", "last_hidden_state"):
        value = getattr(out, attr, None)
        if value is not None:
            out = value
            break
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        import numpy as np
        out = torch.from_numpy(np.asarray(out))
    return out.detach().float().cpu()


def compare_outputs(dense: torch.Tensor, patched: torch.Tensor) -> dict:
    """cos-sim, PSNR (dB, peak = dense value range) and max abs difference of two outputs."""
    d, p = dense.flatten().double(), patched.flatten().double()
    cos = torch.nn.functional.cosine_similarity(d, p, dim=0).item()
    mse = torch.mean((d - p) ** 2).item()
    peak = (d.max() - d.min()).item() or 1.0
    psnr = float("inf") if mse == 0 else 10 * math.log10(peak ** 2 / mse)
    return dict(cos=cos, psnr_db=psnr, max_abs=(d - p).abs().max().item())


SSIM_SIGMA = 1.5      # gaussian window std (pixels) and constants of Wang et al. 2004, as torchmetrics' defaults
SSIM_K1, SSIM_K2 = 0.01, 0.03
SSIM_CHUNK_PIXELS = 1 << 22   # images per chunk x H x W: bounds the fp64 temporaries to a few hundred MB


def _as_images(x: torch.Tensor) -> torch.Tensor | None:
    """(N, H, W) view of an image / video tensor: the two spatial axes last, every other axis (batch, frames,
    channels) flattened into N. Channels-last outputs (diffusers' "np" / "pil": (..., H, W, C) with C <= 4) are
    recognised by a last axis of at most 4 beside larger spatial axes; everything else is taken as (..., H, W).
    None for tensors of fewer than 3 axes (logits of one sequence, vectors)."""
    if x.dim() < 3:
        return None
    if x.shape[-1] <= 4 < min(x.shape[-3], x.shape[-2]):
        x = x.movedim(-1, 0)
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _gaussian_window(sigma: float, dtype, device) -> torch.Tensor:
    size = 2 * int(3.5 * sigma + 0.5) + 1          # 11 taps at sigma 1.5
    dist = torch.arange(size, dtype=dtype, device=device) - (size - 1) / 2
    g = torch.exp(-0.5 * (dist / sigma) ** 2)
    return g / g.sum()


def _ssim_gaussian(dense: torch.Tensor, patched: torch.Tensor, data_range: float) -> float:
    """Mean SSIM of (N, H, W) image stacks, fp64.

    SSIM(x, y) = (2 mu_x mu_y + C1)(2 s_xy + C2) / ((mu_x^2 + mu_y^2 + C1)(s_x^2 + s_y^2 + C2)) at every pixel, the
    local means / variances / covariance taken with a separable 11-tap gaussian window (sigma 1.5) over the image
    reflect-padded by 5 pixels (so every pixel has a full window), variances clamped at 0, C1 = (0.01 L)^2,
    C2 = (0.03 L)^2 with L = `data_range`, then averaged over all pixels of all images. This is the definition
    torchmetrics' `structural_similarity_index_measure` computes with its defaults (gaussian kernel, sigma 1.5),
    which tests/test_validate.py checks when torchmetrics is installed.
    """
    g = _gaussian_window(SSIM_SIGMA, torch.float64, dense.device)
    pad = (g.numel() - 1) // 2
    c1, c2 = (SSIM_K1 * data_range) ** 2, (SSIM_K2 * data_range) ** 2
    n, h, w = dense.shape
    chunk = max(1, SSIM_CHUNK_PIXELS // (h * w))
    total = 0.0
    for i in range(0, n, chunk):
        x, y = dense[i:i + chunk].double()[:, None], patched[i:i + chunk].double()[:, None]
        stack = torch.cat([x, y, x * x, y * y, x * y])                       # (5n, 1, H, W)
        stack = torch.nn.functional.pad(stack, (pad, pad, pad, pad), mode="reflect")
        stack = torch.nn.functional.conv2d(stack, g.view(1, 1, -1, 1))       # separable: rows, then columns
        stack = torch.nn.functional.conv2d(stack, g.view(1, 1, 1, -1))
        mu_x, mu_y, xx, yy, xy = stack.split(x.shape[0])
        var_x = (xx - mu_x ** 2).clamp_min(0)
        var_y = (yy - mu_y ** 2).clamp_min(0)
        cov = xy - mu_x * mu_y
        ssim_map = (2 * mu_x * mu_y + c1) * (2 * cov + c2) / ((mu_x ** 2 + mu_y ** 2 + c1) * (var_x + var_y + c2))
        total += ssim_map.sum().item()
    return total / (n * h * w)


def ssim(dense: torch.Tensor, patched: torch.Tensor, data_range: float | None = None) -> float | None:
    """Structural similarity of two image / video outputs of the same shape, in [-1, 1] (1 = identical).

    Images are the two last spatial axes (see `_as_images`: (B, F, C, H, W) video, (B, C, H, W) images, latents,
    or channels-last (..., H, W, C)); SSIM is computed per 2-D image and averaged. data_range: the value range
    L of the constants C1 = (0.01 L)^2, C2 = (0.03 L)^2; default the dense output's peak-to-peak, as the PSNR of
    `compare_outputs`. Computed by `_ssim_gaussian` (fp64), the definition of torchmetrics'
    `structural_similarity_index_measure` at its defaults; tests/test_validate.py checks the two agree to 1e-12
    where torchmetrics is installed. It is not called at run time: importing it costs seconds, more than the
    demo's whole SSIM work.
    None when the outputs are not images (fewer than 3 axes) or smaller than 6 x 6 (the window's reflect padding
    needs 5 pixels on each side).
    """
    if dense.shape != patched.shape:
        raise ValueError(f"patched: shape {tuple(patched.shape)} != dense {tuple(dense.shape)}")
    # fp64 convolutions are slow on CPUs (a 480p x 81-frame video: minutes) and fast on GPUs
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, y = _as_images(dense.detach().to(device)), _as_images(patched.detach().to(device))
    if x is None or min(x.shape[-2:]) < 6:
        return None
    if data_range is None:
        data_range = (x.max() - x.min()).item() or 1.0
    if data_range <= 0:
        raise ValueError(f"data_range must be > 0, got {data_range}")
    return _ssim_gaussian(x, y, data_range)


def _output_space(out, call_kwargs: dict) -> str | None:
    """"pixel" when the pipeline decoded its output (frames / images not requested as latents), "latent" for a
    sampler's or denoiser's latents, None for outputs that are not images (logits, hidden states)."""
    for attr in ("frames", "images"):
        if getattr(out, attr, None) is not None:
            return "latent" if call_kwargs.get("output_type") == "latent" else "pixel"
    if getattr(out, "logits", None) is not None or getattr(out, "last_hidden_state", None) is not None:
        return None
    return "latent"


def _device_dtype(obj) -> tuple[str, str]:
    """(device, dtype) of the denoiser / model parameters ("cpu", "torch.float32" when there are none).

    The dtype is the one holding most of the first module's floating-point parameter elements: diffusers keeps
    small modules in fp32 inside a bf16 model (WanTransformer3DModel's `_keep_in_fp32_modules`: the time
    embedder, scale-shift tables and norms, which come first in its parameter order), and the model computes its
    attention in the dtype of the bulk of its weights."""
    modules = [obj] if isinstance(obj, torch.nn.Module) else []
    components = getattr(obj, "components", None)
    if isinstance(components, dict):
        # the denoiser first: it is what gets patched, and what sets the compute dtype
        names = sorted(components, key=lambda n: n not in ("transformer", "unet", "transformer_2"))
        modules += [components[n] for n in names if isinstance(components[n], torch.nn.Module)]
    for module in modules:
        counts: dict = defaultdict(int)
        device = None
        for p in module.parameters():
            device = device or str(p.device)
            if p.is_floating_point():
                counts[p.dtype] += p.numel()
        if device is not None:
            dtype = max(counts, key=counts.get) if counts else next(module.parameters()).dtype
            return device, str(dtype)
    return "cpu", "torch.float32"


def _dense_label(obj) -> str:
    """What the unpatched model's attention runs, as far as public attributes tell."""
    config = getattr(obj, "config", None)
    impl = getattr(config, "_attn_implementation", None) if config is not None else None
    if isinstance(impl, str):
        return f"transformers {impl}"
    return "diffusers attention (torch SDPA unless set otherwise)"


def _patched_label(stats: dict, device: str) -> str:
    """The backends the patched run used: the handle's own account where it keeps one (stats["backends"]:
    {layer: {backend: calls}}), else what the dispatcher runs on this device."""
    backends = stats.get("backends")
    if backends:
        totals: dict = defaultdict(int)
        for per_layer in backends.values():
            for name, n in per_layer.items():
                totals[name] += n
        return "sparsepatch " + ", ".join(f"{name} x{n}" for name, n in sorted(totals.items(), key=lambda t: -t[1]))
    if device.startswith("cuda"):
        return "sparsepatch Triton kernels (PyTorch reference where a shape has none)"
    return "sparsepatch PyTorch reference"


def _fresh_kwargs(kwargs: dict, generator_states: dict) -> dict:
    """A copy of the call kwargs with every torch.Generator reset to its state at validate() entry."""
    out = {}
    for key, value in kwargs.items():
        if isinstance(value, torch.Generator):
            g = torch.Generator(device=value.device)
            g.set_state(generator_states[key])
            out[key] = g
        else:
            out[key] = value
    return out


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_call(fn, kwargs, seed, step_times=None, on_latents=None, on_step=None):
    """Call fn(**kwargs) under no_grad; returns (output, seconds). Appends per-step seconds to `step_times` when
    the callable is a diffusers pipeline (via callback_on_step_end); calls on_latents(step, latents) after each
    step where the callback receives "latents" (diffusers' default callback tensor input), then on_step(step)."""
    torch.manual_seed(seed)
    _sync()
    start = time.perf_counter()
    if step_times is not None or on_latents is not None or on_step is not None:
        marks = [start]

        def on_step_end(pipe, step, timestep, callback_kwargs):
            if step_times is not None:
                _sync()
                marks.append(time.perf_counter())
                step_times.append(marks[-1] - marks[-2])
            if on_latents is not None and isinstance(callback_kwargs.get("latents"), torch.Tensor):
                on_latents(step, callback_kwargs["latents"])
            if on_step is not None:
                on_step(step)
            return callback_kwargs
        kwargs = dict(kwargs, callback_on_step_end=on_step_end)
    with torch.no_grad():
        out = fn(**kwargs)
    _sync()
    return out, time.perf_counter() - start


def _accepts_step_callback(fn, kwargs) -> bool:
    import inspect
    try:
        params = inspect.signature(fn.__call__ if not inspect.isfunction(fn) else fn).parameters
    except (TypeError, ValueError):
        return False
    return "callback_on_step_end" in params and "callback_on_step_end" not in kwargs


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


PHASES = ("dense", "patched, attention checked vs dense", "patched, timed", "dense, timed")


def validate(pipe_or_model, config=None, *, seed: int = 0, measure_speed: bool = True, progress=None,
             **call_kwargs):
    """Run `pipe_or_model(**call_kwargs)` dense and patched with `config` (same seed and generators).

    Returns a ValidationReport. The object must not be patched already; it is left unpatched.
    measure_speed: time a second dense and a second, un-instrumented patched run (the instrumented one computes
        dense attention too); each timed run follows a warm run. Without it dense_s is the first (cold) dense run.
    progress: optional callable, called after every denoising step of every run (pipelines taking
        `callback_on_step_end`) or after every call otherwise, with keyword arguments run (1-based), runs (2 or 4),
        phase (one of PHASES), step (1-based; None for a model call), steps (`num_inference_steps` or None),
        elapsed_s (since the run started) and psnr_db (the latents after this step vs dense, in the checked run;
        else None).
    """
    if handle_of(pipe_or_model) is not None:
        raise ValueError("pipe_or_model is already patched; validate() patches it itself — sp.unpatch it first")
    if progress is not None and not callable(progress):
        raise ValueError(f"progress must be a callable or None, got {type(progress).__name__}")
    generator_states = {k: v.get_state() for k, v in call_kwargs.items() if isinstance(v, torch.Generator)}
    steps = {"dense": [], "patched": []} if _accepts_step_callback(pipe_or_model, call_kwargs) else None
    num_steps = call_kwargs.get("num_inference_steps")
    runs = 4 if measure_speed else 2
    step_psnr, step_ssim = [], []

    def call(run, step_times=None, on_latents=None):
        started = time.perf_counter()

        def report_step(i):
            progress(run=run, runs=runs, phase=PHASES[run - 1], step=i + 1, steps=num_steps,
                     elapsed_s=time.perf_counter() - started,
                     psnr_db=step_psnr[i] if run == 2 and i < len(step_psnr) else None)
        out = _timed_call(pipe_or_model, _fresh_kwargs(call_kwargs, generator_states), seed, step_times,
                          on_latents, report_step if progress is not None and steps is not None else None)
        if progress is not None and steps is None:
            progress(run=run, runs=runs, phase=PHASES[run - 1], step=None, steps=None, elapsed_s=out[1],
                     psnr_db=None)
        return out

    from . import patch   # the public entry (fills config=None from the recipes)
    # Per-step latents (pipelines whose step callback passes "latents"): kept from the first (untimed) dense run,
    # compared with the probed patched run's as it goes -> PSNR / SSIM of the sampler state after every step.
    dense_latents = []
    dense_out, dense_s = call(1, on_latents=(lambda i, x: dense_latents.append(x.detach().float().cpu()))
                              if steps is not None else None)

    def compare_step(i, x):
        if i < len(dense_latents):
            x = x.detach().float().cpu()
            step_psnr.append(compare_outputs(dense_latents[i], x)["psnr_db"])
            # same data range as the PSNR: the dense latents' peak-to-peak
            peak = (dense_latents[i].max() - dense_latents[i].min()).item() or 1.0
            step_ssim.append(ssim(dense_latents[i], x, data_range=peak))
    handle = patch(pipe_or_model, config)
    attention_cos = defaultdict(lambda: defaultdict(list))

    def probe(site, names, q, k, v, out, scale):
        ref = kernels.attention(q, k, v, scale=scale)
        for branch in dict.fromkeys(names):
            rows = [i for i, n in enumerate(names) if n == branch]
            attention_cos[site.layer][branch].append(_cos(out[rows], ref[rows]))

    device, dtype = _device_dtype(pipe_or_model)
    try:
        handle.probe = probe
        patched_out, _ = call(2, on_latents=compare_step if steps is not None else None)
        handle.probe = None
        handle.reset()   # a bare model call has no pipeline to end the video
        stats = handle.stats()
        density = stats["density"]
        patched_s = None
        if measure_speed:
            # Both timed runs come after a warm run of their own (the first dense run, the probed patched run),
            # so one-time costs (kernel compilation, allocator growth) are in neither.
            _, patched_s = call(3, steps and steps["patched"])
            handle.reset()
            stats = handle.stats()
    finally:
        unpatch(pipe_or_model)
    if measure_speed:
        _, dense_s = call(4, steps and steps["dense"])
    dense_t, patched_t = output_tensor(dense_out), output_tensor(patched_out)
    cmp = compare_outputs(dense_t, patched_t)
    space = _output_space(dense_out, call_kwargs)
    out_ssim = ssim(dense_t, patched_t) if space is not None else None
    extra = {}
    if steps:
        extra = {"dense_step_s": steps["dense"], "patched_step_s": steps["patched"]}
        if step_psnr:
            extra["step_psnr_db"] = step_psnr
        if any(v is not None for v in step_ssim):
            extra["step_ssim"] = step_ssim
    return ValidationReport(
        config=repr(handle.config), attention_cos={k: dict(v) for k, v in attention_cos.items()},
        density=copy.deepcopy(density), output_cos=cmp["cos"], output_psnr_db=cmp["psnr_db"],
        output_max_abs=cmp["max_abs"], dense_s=dense_s, patched_s=patched_s, extra=extra,
        output_ssim=out_ssim, ssim_space=space if out_ssim is not None else None, device=device, dtype=dtype,
        backends={"dense": _dense_label(pipe_or_model), "patched": _patched_label(stats, device)})


@dataclass
class GradientReport:
    """What `sp.validate_gradients` measured: the patched model's gradients against the dense model's.

    attention_grad_cos: {layer: {"dq": cos, "dk": cos, "dv": cos}} of the attention inputs' gradients.
    param_grad_cos: cos-sim of all parameter gradients flattened together; param_grad_cos_min: the worst single
        parameter tensor (name in `worst_param`).
    density: {layer: {branch: [per call]}} of the patched calls (the list-building calls included).
    loss_dense / loss_patched: the scalar losses of the two backward passes.
    """

    config: str
    attention_grad_cos: dict
    param_grad_cos: float
    param_grad_cos_min: float
    worst_param: str
    density: dict
    loss_dense: float
    loss_patched: float

    def summary(self) -> str:
        lines = [f"sparsepatch gradient validation — {self.config}",
                 f"loss dense {self.loss_dense:.6f}  patched {self.loss_patched:.6f}",
                 f"parameter grads: cos {self.param_grad_cos:.6f} (worst {self.param_grad_cos_min:.6f}: "
                 f"{self.worst_param})",
                 f"{'layer':<40} {'dq':>9} {'dk':>9} {'dv':>9}"]
        for layer, cos in self.attention_grad_cos.items():
            lines.append(f"{layer:<40} {cos['dq']:>9.5f} {cos['dk']:>9.5f} {cos['dv']:>9.5f}")
        return "\n".join(lines)

    def to_json(self, path=None) -> str:
        text = json.dumps(asdict(self), indent=1, default=float)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text


def _default_loss(out) -> torch.Tensor:
    value = out
    for attr in ("loss", "sample", "logits", "last_hidden_state"):
        if getattr(out, attr, None) is not None:
            value = getattr(out, attr)
            break
    if isinstance(value, (tuple, list)):
        value = value[0]
    return value if value.dim() == 0 else value.float().square().mean()


def validate_gradients(model, config, *, loss_fn=None, list_passes: int | None = None, seed: int = 0,
                       **inputs) -> GradientReport:
    """Gradients of a patched model vs the dense model on the same inputs (training mode as users run it).

    The patched model first runs `list_passes` no-grad forwards (default: warmup_steps + 1) so the skip lists are
    built from these inputs, then one forward+backward that reads them — the lists a fine-tune step would use.
    loss_fn(output) -> scalar; default: `output.loss` if present, else the mean square of the main output.
    Returns a GradientReport (dQ/dK/dV cos-sim per attention layer, parameter-gradient cos-sim).
    """
    from . import DenseConfig, SkipConfig
    from . import patch as sp_patch
    if handle_of(model) is not None:
        raise ValueError("model is already patched; validate_gradients() patches it itself — sp.unpatch it first")
    if list_passes is None:
        list_passes = config.warmup_steps + 1 if isinstance(config, SkipConfig) else 0
    loss_fn = loss_fn or _default_loss
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def run(cfg, passes):
        handle = sp_patch(model, cfg)
        captured = {}

        def probe(site, names, q, k, v, out, scale):
            if q.requires_grad:
                for t in (q, k, v):
                    t.retain_grad()
                captured[site.layer] = (q, k, v)
        try:
            with torch.no_grad():
                for _ in range(passes):
                    torch.manual_seed(seed)
                    model(**inputs)
            handle.probe = probe
            model.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            loss = loss_fn(model(**inputs))
            loss.backward()
            density = handle.stats()["density"]
        finally:
            unpatch(model)
        grads = {n: p.grad.detach().clone() for n, p in params if p.grad is not None}
        attn = {layer: tuple(t.grad.detach().clone() for t in qkv) for layer, qkv in captured.items()
                if qkv[0].grad is not None}
        model.zero_grad(set_to_none=True)
        return float(loss.detach()), grads, attn, density

    loss_d, grads_d, attn_d, _ = run(DenseConfig(layers="self"), 0)
    loss_p, grads_p, attn_p, density = run(config, list_passes)
    per_param = {n: _cos(grads_d[n], grads_p[n]) for n in grads_d if n in grads_p}
    flat_d = torch.cat([grads_d[n].flatten().double() for n in per_param])
    flat_p = torch.cat([grads_p[n].flatten().double() for n in per_param])
    worst = min(per_param, key=per_param.get) if per_param else ""
    attention = {layer: {name: _cos(a, b) for name, a, b in zip(("dq", "dk", "dv"), attn_d[layer], attn_p[layer])}
                 for layer in attn_d if layer in attn_p}
    return GradientReport(
        config=repr(config), attention_grad_cos=attention,
        param_grad_cos=torch.nn.functional.cosine_similarity(flat_d, flat_p, dim=0).item() if per_param else 1.0,
        param_grad_cos_min=per_param.get(worst, 1.0), worst_param=worst, density=copy.deepcopy(density),
        loss_dense=loss_d, loss_patched=loss_p)
