"""Skip lists on a trained video denoiser: the threshold x tile sweep (density, attention cos-sim, final PSNR / SSIM,
time per step vs dense SDPA) and the attention statistics that explain it (mass vs temporal / spatial distance,
the fewest tiles that hold a given share of the attention mass).

Used by benchmarks/sweep_tiny_video_d64.py (GPU and CPU sweep, JSON), the video notebook and tests. Token order is
Wan's patchified latents: frame-major, then rows, then columns, so token s sits at
(t, y, x) = (s // (h w), (s // w) % h, s % w) of a (frames, h, w) token grid.
"""
from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager

import torch

# ------------------------------------------------------------------------------------------- attention statistics


def _grid_coords(grid, device):
    f, h, w = grid
    s = torch.arange(f * h * w, device=device)
    return s // (h * w), (s // w) % h, s % w


def _check_qk(q, k, grid):
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q, k must be (B, S, H, D) with equal B, H, D; got {tuple(q.shape)} and {tuple(k.shape)}")
    if len(grid) != 3 or any(int(g) < 1 for g in grid):
        raise ValueError(f"grid must be (frames, height, width) token counts >= 1, got {grid!r}")
    if not q.shape[1] == k.shape[1] == math.prod(grid):
        raise ValueError(f"grid {tuple(grid)} holds {math.prod(grid)} tokens; q has {q.shape[1]}, k {k.shape[1]}")


def attention_distance_profile(q, k, grid, scale=None, max_queries: int = 256, seed: int = 0) -> dict:
    """Where the attention of a self-attention call goes, by distance on the video token grid.

    q, k: (B, S, H, D) (RoPE applied: what the attention kernel sees), S = frames * height * width of `grid`.
    For up to `max_queries` queries per (batch, head) (evenly strided from a seeded offset) the softmax row is
    computed in fp32 and its mass summed by temporal distance dt = |t_q - t_k| (frames, 0 .. frames-1) and by
    spatial distance ds = max(|y_q - y_k|, |x_q - x_k|) (tokens, Chebyshev, over all frames).
    Returns {"temporal": {...}, "spatial": {...}, "joint_mass": [[dt][ds]], "queries": n} where each marginal has
    "distance", "mass" (mean over queries of the probability on keys at that distance; sums to 1),
    "key_fraction" (mean share of keys at that distance) and "enrichment" = mass / key_fraction (1 everywhere =
    uniform attention; > 1 = attention concentrated there).
    """
    _check_qk(q, k, grid)
    B, S, H, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    f, h, w = (int(g) for g in grid)
    n = min(max_queries, S)
    offset = int(torch.randint(0, max(1, S // n), (1,), generator=torch.Generator().manual_seed(seed)))
    rows = (offset + torch.arange(n) * (S // n)).clamp(max=S - 1).to(q.device)
    t, y, x = _grid_coords(grid, q.device)
    dt = (t[rows, None] - t[None, :]).abs()                                # (n, S)
    ds = torch.maximum((y[rows, None] - y[None, :]).abs(), (x[rows, None] - x[None, :]).abs())
    ns = max(h, w)
    bins = dt * ns + ds                                                    # joint (dt, ds) bin of every pair
    joint = torch.zeros(f * ns, dtype=torch.float64, device=q.device)
    count = torch.zeros(f * ns, dtype=torch.float64, device=q.device)
    count.index_add_(0, bins.flatten(), torch.ones(bins.numel(), dtype=torch.float64, device=q.device))
    for b in range(B):
        for head in range(H):
            logits = (q[b, rows, head].float() @ k[b, :, head].float().T) * scale     # (n, S)
            p = torch.softmax(logits, dim=-1).double()
            joint.index_add_(0, bins.flatten(), p.flatten())
    joint = (joint / (B * H * n)).view(f, ns)
    frac = (count / (n * S)).view(f, ns)

    def marginal(mass, kfrac):
        enrich = [m / c if c > 0 else float("nan") for m, c in zip(mass.tolist(), kfrac.tolist())]
        return {"distance": list(range(mass.numel())), "mass": mass.tolist(), "key_fraction": kfrac.tolist(),
                "enrichment": enrich}
    return {"temporal": marginal(joint.sum(1), frac.sum(1)), "spatial": marginal(joint.sum(0), frac.sum(0)),
            "joint_mass": joint.tolist(), "queries": n, "grid": [f, h, w]}


def tile_mass_coverage(q, k, tile, levels=(0.9, 0.99, 0.999), scale=None) -> dict:
    """The oracle density of a tile mask: for each (batch, head, query tile) the key tiles sorted by the attention
    mass the tile's queries put on them (softmax rows in fp32, mass averaged over the query tile's rows), and the
    fewest tiles holding `level` of that mass, as a fraction of the key tiles. A skip list at threshold T keeps a
    tile when ANY row's max score in it comes within T of the row max, so it can never be sparser than this at
    equal lost mass: a model whose 0.99-coverage density is above 0.5 cannot reach density 0.5 without dropping
    more than 1% of the attention mass of an average query tile.

    q, k: (B, S, H, D); tile: (tm, tn). Returns {"tile": [tm, tn], "levels": [...], "density": [mean over rows,
    batch and heads per level], "density_max": [worst row per level]}.
    """
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"q, k must both be (B, S, H, D); got {tuple(q.shape)} and {tuple(k.shape)}")
    tm, tn = (int(v) for v in tile)
    if tm < 1 or tn < 1:
        raise ValueError(f"tile must be a pair of positive ints, got {tile!r}")
    if not all(0 < lv <= 1 for lv in levels):
        raise ValueError(f"levels must lie in (0, 1], got {levels!r}")
    B, S, H, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    tq, tk = -(-S // tm), -(-S // tn)
    dens = [[] for _ in levels]
    for b in range(B):
        for head in range(H):
            p = torch.softmax((q[b, :, head].float() @ k[b, :, head].float().T) * scale, dim=-1)   # (S, S)
            p = torch.nn.functional.pad(p, (0, tk * tn - S, 0, tq * tm - S))
            m = p.view(tq, tm, tk, tn).sum(3).sum(1)                                           # (tq, tk)
            m = m / m.sum(1, keepdim=True)
            cum = m.sort(dim=1, descending=True).values.cumsum(1)
            for i, lv in enumerate(levels):
                # tiles needed = 1 + how many cumulative sums are still below the level
                need = (cum < lv - 1e-6).sum(1) + 1
                dens[i].append(need.clamp(max=tk).double() / tk)
    per = [torch.cat(d) for d in dens]
    return {"tile": [tm, tn], "levels": list(levels), "density": [float(d.mean()) for d in per],
            "density_max": [float(d.max()) for d in per]}


def capture_self_attention(pipe, call_kwargs: dict, step: int, branch: str = "cond") -> dict:
    """q and k (RoPE applied, as the attention kernel gets them) of every self-attention layer of `pipe`'s
    transformer at denoising step `step` (0-based) of branch `branch`, from one dense sampling run.

    Patches with DenseConfig(layers="self") (dense attention through sparsepatch's dispatcher: same math) and
    reads the calls through the handle's probe. Returns {layer name: (q, k)} with q, k (B, S, H, D) fp32 on the
    model's device (batch elements of other branches dropped).
    """
    import sparsepatch as sp
    from .patcher import unpatch
    steps = call_kwargs.get("num_inference_steps")
    if steps is not None and not 0 <= step < steps:
        raise ValueError(f"step must be in [0, {steps - 1}] (num_inference_steps = {steps}), got {step}")
    current = {"step": 0}
    got: dict = {}

    def probe(site, names, q, k, v, out, scale):
        if current["step"] == step and q.shape[1] == k.shape[1] and site.layer not in got:
            rows = [i for i, n in enumerate(names) if n == branch]
            if rows:
                got[site.layer] = (q[rows].detach().float(), k[rows].detach().float())

    def on_step_end(p, i, timestep, cb):
        current["step"] = i + 1
        return cb

    handle = sp.patch(pipe, sp.DenseConfig(layers="self"))
    try:
        handle.probe = probe
        with torch.no_grad():
            pipe(**dict(call_kwargs, callback_on_step_end=on_step_end))
    finally:
        unpatch(pipe)
    if not got:
        raise ValueError(f"no self-attention call of branch {branch!r} at step {step}")
    return got


def token_grid(call_kwargs: dict, patch=(1, 2, 2)) -> tuple:
    """(frames, height, width) token grid of an EulerFlowSampler call (latents shape / patch size)."""
    _, _, f, h, w = call_kwargs["shape"]
    return f // patch[0], h // patch[1], w // patch[2]


# ------------------------------------------------------------------------------------------------------- the sweep


@contextmanager
def sdpa_backend(name: str | None):
    """torch SDPA restricted to one backend ("cudnn", "flash", "efficient", "math") inside the block; None: torch's
    own choice."""
    if name is None:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]
    with sdpa_kernel(backend):
        yield


def time_steps(pipe, call_kwargs: dict, config=None, reps: int = 3, sdpa: str | None = None) -> dict:
    """Seconds per denoising step of `pipe(**call_kwargs)`, dense (config None) or patched with `config`.

    One warm run (compiles kernels, builds nothing that persists: the pipeline resets the lists at its end), then
    `reps` timed runs; step i's time is the median over the runs (CUDA synchronized at every step end).
    sdpa: restrict torch SDPA (the dense run's attention, and the patched run's cross-attention) to one backend.
    Returns {"step_s": [median per step], "total_s": sum, "runs": reps, "backends": handle stats backends or None}.
    """
    import sparsepatch as sp
    from .patcher import unpatch
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    handle = sp.patch(pipe, config) if config is not None else None
    per_run = []
    try:
        with sdpa_backend(sdpa), torch.no_grad():
            for run in range(reps + 1):
                marks = []

                def on_step_end(p, i, timestep, cb):
                    sync()
                    marks.append(time.perf_counter())
                    return cb
                gen = call_kwargs.get("generator")
                kw = dict(call_kwargs, callback_on_step_end=on_step_end)
                if isinstance(gen, torch.Generator):
                    kw["generator"] = torch.Generator().manual_seed(int(gen.initial_seed()))
                sync()
                start = time.perf_counter()
                pipe(**kw)
                if run:
                    per_run.append([b - a for a, b in zip([start] + marks[:-1], marks)])
        backends = handle.stats().get("backends") if handle is not None else None
    finally:
        if handle is not None:
            unpatch(pipe)
    step_s = [statistics.median(col) for col in zip(*per_run)]
    return {"step_s": step_s, "total_s": sum(step_s), "runs": reps, "backends": backends}


def first_sparse_step(density_per_step) -> int:
    """Index of the first step with density < 1: the steps before it are the warm-up. With warmup_steps = w the
    first w steps run dense without lists and step w still computes every tile (it writes the first lists), so
    this is w + 1 unless a threshold keeps every tile; len(density_per_step) when no step skipped anything (the
    same rule as `ValidationReport.verdict`)."""
    return next((i for i, d in enumerate(density_per_step) if d < 1.0), len(density_per_step))


def summarize_report(report) -> dict:
    """The sweep row of one sp.validate report: per-step density / attention cos (mean over layers and branches),
    their means over the steps after warm-up (the steps from the first one that skipped a tile on; the last step
    if none did), per-layer attention cos (mean and min over those steps' calls) and density (mean), per-step and
    final latent PSNR / SSIM."""
    steps = report.per_step()
    first = first_sparse_step([r["density"] for r in steps])
    late = steps[first:] or steps[-1:]
    start = late[0]["step"]
    per_layer = {}
    for layer, branches in report.attention_cos.items():
        vals = [c for values in branches.values() for c in values[start:]] or \
               [c for values in branches.values() for c in values]
        per_layer[layer] = {"mean": sum(vals) / len(vals), "min": min(vals)}
    layer_density = {}
    for layer, branches in report.density.items():
        vals = [d for values in branches.values() for d in values[start:]] or \
               [d for values in branches.values() for d in values]
        layer_density[layer] = sum(vals) / len(vals)
    return dict(
        first_sparse_step=first,
        per_layer_density=layer_density,
        density_per_step=[r["density"] for r in steps],
        attn_cos_mean_per_step=[r["cos_mean"] for r in steps],
        attn_cos_min_per_step=[r["cos_min"] for r in steps],
        density_after_warmup=sum(r["density"] for r in late) / len(late),
        density_after_warmup_max=max(r["density"] for r in late),
        attn_cos_step_mean_min=min(r["cos_mean"] for r in late),
        attn_cos_min=min(r["cos_min"] for r in late),
        per_layer_cos=per_layer,
        step_psnr_db=list(report.extra.get("step_psnr_db", [])),
        step_ssim=list(report.extra.get("step_ssim", [])),
        psnr_db=report.output_psnr_db, ssim=report.output_ssim, output_cos=report.output_cos,
        patched_backends=report.backends.get("patched"), dtype=report.dtype, device=report.device)


def meets_acceptance(row: dict, density: float = 0.5, psnr_db: float = 32.0, cos: float = 0.995) -> bool:
    """Issue 26's bar: mean density over the steps after warm-up <= `density`, final PSNR >= `psnr_db`, and the
    attention cos (mean over the layers and branches of each step) >= `cos` at every step after warm-up."""
    return (row["density_after_warmup"] <= density and row["psnr_db"] >= psnr_db
            and row["attn_cos_step_mean_min"] >= cos)


def sweep(pipe, call_kwargs: dict, tiles, thresholds, warmups, *, reps: int = 3, dense_sdpa=("cudnn", None),
          time_it: bool = True, on_row=None, log=print) -> dict:
    """tiles x thresholds x warmups of SkipConfig on `pipe` (an EulerFlowSampler or any pipeline sp.validate takes).

    Quality: sp.validate(measure_speed=False) per config (dense run + probed patched run: density, attention cos
    vs dense attention on the same q/k/v, latent PSNR / SSIM per step and final). Speed (time_it): `time_steps`
    for dense under each SDPA restriction in `dense_sdpa` (None: torch's choice) and for every config under the
    first one (so cross-attention runs the same backend as dense). A "floor" row validates
    DenseConfig(layers="self"): the same dense attention through sparsepatch, i.e. what kernel rounding alone
    costs in PSNR. on_row(result_so_far) is called after every row (to save partial results).
    Returns {"dense": {sdpa name: timing}, "floor": row, "rows": [row, ...]}.
    """
    import sparsepatch as sp
    result = {"dense": {}, "floor": None, "rows": []}
    if time_it:
        for name in dense_sdpa:
            key = name or "default"
            try:
                result["dense"][key] = time_steps(pipe, call_kwargs, None, reps, sdpa=name)
            except RuntimeError as exc:     # a backend that cannot serve the shape
                result["dense"][key] = {"error": str(exc).splitlines()[0]}
            log(f"dense [{key}]: {_ms(result['dense'][key])}")
    base_sdpa = dense_sdpa[0] if dense_sdpa else None
    if base_sdpa is not None and "error" in result["dense"].get(base_sdpa, {}):
        base_sdpa = None
    t0 = time.perf_counter()
    floor = sp.validate(pipe, sp.DenseConfig(layers="self"), measure_speed=False, **call_kwargs)
    result["floor"] = dict(summarize_report(floor), config="DenseConfig(layers='self')",
                           validate_s=time.perf_counter() - t0)
    log(f"floor (sparsepatch dense): PSNR {result['floor']['psnr_db']:.2f} dB, attn cos min "
        f"{result['floor']['attn_cos_min']:.6f}")
    for tile in tiles:
        for warmup in warmups:
            for thr in thresholds:
                cfg = sp.SkipConfig(threshold=thr, warmup_steps=warmup, tile=tuple(tile))
                t0 = time.perf_counter()
                report = sp.validate(pipe, cfg, measure_speed=False, **call_kwargs)
                row = dict(tile=list(cfg.tile), threshold=thr, warmup_steps=warmup,
                           **summarize_report(report), validate_s=time.perf_counter() - t0)
                if time_it:
                    sdpa = base_sdpa
                    try:
                        timing = time_steps(pipe, call_kwargs, cfg, reps, sdpa=sdpa)
                    except RuntimeError as exc:   # a restricted SDPA that cannot serve a call of the patched run
                        row["timing_error"] = f"sdpa {sdpa}: {str(exc).splitlines()[0]}"
                        sdpa = None
                        timing = time_steps(pipe, call_kwargs, cfg, reps, sdpa=None)
                    dense = result["dense"].get(sdpa or "default", {})
                    row["timing"] = timing
                    row["dense_sdpa"] = sdpa or "default"
                    if "step_s" in dense:
                        row["speedup_total"] = dense["total_s"] / timing["total_s"]
                        first = row["first_sparse_step"]
                        d_late = dense["step_s"][first:] or dense["step_s"]
                        p_late = timing["step_s"][first:] or timing["step_s"]
                        row["speedup_after_warmup"] = sum(d_late) / sum(p_late)
                row["meets"] = meets_acceptance(row)
                result["rows"].append(row)
                log(format_row(row))
                if on_row is not None:
                    on_row(result)
    return result


def _ms(timing: dict) -> str:
    if "error" in timing:
        return "error: " + timing["error"]
    return f"{timing['total_s'] * 1e3:.1f} ms total, " + " ".join(f"{s * 1e3:.1f}" for s in timing["step_s"])


TABLE_HEADER = (f"{'tile':>7} {'thr':>6} {'wu':>3} {'dens':>6} {'cos/step':>9} {'cos min':>8} {'PSNR':>7} "
                f"{'SSIM':>7} {'ms/step':>8} {'speedup':>8} {'ok':>3}")


def format_row(row: dict) -> str:
    """One line of the printed sweep table (TABLE_HEADER's columns)."""
    timing = row.get("timing")
    ms = f"{timing['total_s'] * 1e3 / len(timing['step_s']):8.2f}" if timing else f"{'-':>8}"
    spd = row.get("speedup_total")
    ssim = row["ssim"]
    return (f"{row['tile'][0]:>3}x{row['tile'][1]:<3} {row['threshold']:>6.2f} {row['warmup_steps']:>3} "
            f"{row['density_after_warmup']:>6.3f} {row['attn_cos_step_mean_min']:>9.5f} {row['attn_cos_min']:>8.4f} "
            f"{row['psnr_db']:>7.2f} {'-' if ssim is None else format(ssim, '.4f'):>7} {ms} "
            f"{'-' if spd is None else format(spd, '.2f') + 'x':>8} {'yes' if row['meets'] else 'no':>3}")
