"""Compare a patched run with the dense one: per-layer attention cos-sim per step, output PSNR/cos-sim, timings."""
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
        where the callback is handed "latents", "step_psnr_db" (the latents after each step, patched vs dense).
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

    @property
    def speedup(self) -> float | None:
        return None if not self.patched_s else self.dense_s / self.patched_s

    def per_step(self) -> list[dict]:
        """[{step, density, cos_mean, cos_min, psnr_db, dense_ms, patched_ms}] aggregated over layers and branches
        (psnr_db: the pipeline's latents after the step, patched vs dense; nan where not recorded)."""
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
        rows = []
        for i in sorted(dens):
            rows.append(dict(step=i, density=sum(dens[i]) / len(dens[i]),
                             cos_mean=sum(coss[i]) / len(coss[i]) if coss[i] else float("nan"),
                             cos_min=min(coss[i]) if coss[i] else float("nan"),
                             psnr_db=psnr[i] if i < len(psnr) else float("nan"),
                             dense_ms=dense_ms[i] * 1e3 if i < len(dense_ms) else float("nan"),
                             patched_ms=patched_ms[i] * 1e3 if i < len(patched_ms) else float("nan")))
        return rows

    def summary(self) -> str:
        lines = [f"sparsepatch validation — {self.config}",
                 f"{'step':>4} {'density':>8} {'attn cos mean':>14} {'attn cos min':>13} {'PSNR dB':>8} "
                 f"{'dense ms':>9} {'patched ms':>10}"]
        for row in self.per_step():
            lines.append(f"{row['step']:>4} {row['density']:>8.3f} {row['cos_mean']:>14.6f} {row['cos_min']:>13.6f} "
                         f"{row['psnr_db']:>8.2f} {row['dense_ms']:>9.1f} {row['patched_ms']:>10.1f}")
        if any(math.isfinite(r["psnr_db"]) for r in self.per_step()):
            lines.append("(PSNR dB per step: the pipeline's latents after that step, patched vs dense)")
        lines.append(f"output: cos {self.output_cos:.6f}  PSNR {self.output_psnr_db:.2f} dB  "
                     f"max|diff| {self.output_max_abs:.3g}")
        timing = f"time: dense {self.dense_s * 1e3:.1f} ms"
        if self.patched_s:
            timing += f", patched {self.patched_s * 1e3:.1f} ms ({self.speedup:.2f}x)"
        lines.append(timing)
        for key, value in self.extra.items():
            if not key.endswith("_step_s") and key != "step_psnr_db":
                lines.append(f"{key}: {value}")
        return "\n".join(lines)

    def to_json(self, path=None) -> str:
        data = asdict(self)
        data["per_step"] = self.per_step()
        data["speedup"] = self.speedup
        text = json.dumps(data, indent=1, default=float)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def plot(self, path=None):
        """Density and attention cos-sim per step (matplotlib). Saves to `path` if given; returns the figure."""
        import matplotlib
        if path is not None:
            matplotlib.use("Agg", force=False)
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
        fig.suptitle(f"{self.config} — output PSNR {self.output_psnr_db:.1f} dB")
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


def _timed_call(fn, kwargs, seed, step_times=None, on_latents=None):
    """Call fn(**kwargs) under no_grad; returns (output, seconds). Appends per-step seconds to `step_times` when
    the callable is a diffusers pipeline (via callback_on_step_end); calls on_latents(step, latents) after each
    step where the callback receives "latents" (diffusers' default callback tensor input)."""
    torch.manual_seed(seed)
    _sync()
    start = time.perf_counter()
    if step_times is not None or on_latents is not None:
        marks = [start]

        def on_step_end(pipe, step, timestep, callback_kwargs):
            if step_times is not None:
                _sync()
                marks.append(time.perf_counter())
                step_times.append(marks[-1] - marks[-2])
            if on_latents is not None and isinstance(callback_kwargs.get("latents"), torch.Tensor):
                on_latents(step, callback_kwargs["latents"])
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


def validate(pipe_or_model, config=None, *, seed: int = 0, measure_speed: bool = True, **call_kwargs):
    """Run `pipe_or_model(**call_kwargs)` dense and patched with `config` (same seed and generators).

    Returns a ValidationReport. The object must not be patched already; it is left unpatched.
    measure_speed: time a second dense and a second, un-instrumented patched run (the instrumented one computes
        dense attention too); each timed run follows a warm run. Without it dense_s is the first (cold) dense run.
    """
    if handle_of(pipe_or_model) is not None:
        raise ValueError("pipe_or_model is already patched; validate() patches it itself — sp.unpatch it first")
    generator_states = {k: v.get_state() for k, v in call_kwargs.items() if isinstance(v, torch.Generator)}
    steps = {"dense": [], "patched": []} if _accepts_step_callback(pipe_or_model, call_kwargs) else None

    def call(step_times=None, on_latents=None):
        return _timed_call(pipe_or_model, _fresh_kwargs(call_kwargs, generator_states), seed, step_times,
                           on_latents)

    from . import patch   # the public entry (fills config=None from the recipes)
    # Per-step latents (pipelines whose step callback passes "latents"): kept from the first (untimed) dense run,
    # compared with the probed patched run's as it goes -> PSNR of the sampler state after every step.
    dense_latents, step_psnr = [], []
    dense_out, dense_s = call(on_latents=(lambda i, x: dense_latents.append(x.detach().float().cpu()))
                              if steps is not None else None)

    def compare_step(i, x):
        if i < len(dense_latents):
            step_psnr.append(compare_outputs(dense_latents[i], x.detach().float().cpu())["psnr_db"])
    handle = patch(pipe_or_model, config)
    attention_cos = defaultdict(lambda: defaultdict(list))

    def probe(site, names, q, k, v, out, scale):
        ref = kernels.attention(q, k, v, scale=scale)
        for branch in dict.fromkeys(names):
            rows = [i for i, n in enumerate(names) if n == branch]
            attention_cos[site.layer][branch].append(_cos(out[rows], ref[rows]))

    try:
        handle.probe = probe
        patched_out, _ = call(on_latents=compare_step if steps is not None else None)
        handle.probe = None
        handle.reset()   # a bare model call has no pipeline to end the video
        density = handle.stats()["density"]
        patched_s = None
        if measure_speed:
            # Both timed runs come after a warm run of their own (the first dense run, the probed patched run),
            # so one-time costs (kernel compilation, allocator growth) are in neither.
            _, patched_s = call(steps and steps["patched"])
            handle.reset()
    finally:
        unpatch(pipe_or_model)
    if measure_speed:
        _, dense_s = call(steps and steps["dense"])
    cmp = compare_outputs(output_tensor(dense_out), output_tensor(patched_out))
    return ValidationReport(
        config=repr(handle.config), attention_cos={k: dict(v) for k, v in attention_cos.items()},
        density=copy.deepcopy(density), output_cos=cmp["cos"], output_psnr_db=cmp["psnr_db"],
        output_max_abs=cmp["max_abs"], dense_s=dense_s, patched_s=patched_s,
        extra={} if not steps else {"dense_step_s": steps["dense"], "patched_step_s": steps["patched"],
                                    **({"step_psnr_db": step_psnr} if step_psnr else {})})


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
