"""Flow-matching fine-tune of a Wan-architecture video denoiser with sparse (skip-list) attention.

    python -m sparsepatch.recipes.finetune_video --config skip-train --max-steps 100
    accelerate launch --cpu --num_processes 1 -m sparsepatch.recipes.finetune_video --max-steps 2
    accelerate launch --multi_gpu --num_processes 2 -m sparsepatch.recipes.finetune_video --model-size small
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m sparsepatch.recipes.finetune_video   # DDP on CPU (gloo)

Objective (rectified flow): for a clean latent clip x0, noise n ~ N(0, I) and t ~ U(0, 1),
x_t = (1 - t) x0 + t n; the transformer, called with timestep 1000 t, predicts the velocity n - x0; loss = MSE.
Options (all off by default, and then the draws are exactly those of the plain objective): `--t-dist
logit-normal` draws t = sigmoid(N(0, 1)) (more weight on mid noise levels), `--t-shift s` warps t to
s t / (1 + (s - 1) t) (s > 1: more high-noise steps, where a sample's layout is decided; the same warp as the
sampler's shift); `--cond-dropout p` replaces the text embedding by zeros for a fraction p of the clips, so the
model also learns the unconditional velocity that classifier-free guidance needs; `--colour-jitter j` draws clips
whose colour is fixed by the class up to j (`data.render_clip`).

Data: `data.ProceduralClips` draws moving / rotating shapes, textures and pans directly in a latent space of
shape (B, 4, F, H, W) (default (B, 4, 5, 16, 16)); no VAE is involved (see data.py for why). Each clip's class
picks a fixed random text embedding (text_len, text_dim) that plays the prompt. The model is built from a config
(`--model-size tiny|small`, random weights) or loaded with `--model-path` (a `save_pretrained` directory).

Configs: dense = the model unpatched (diffusers' SDPA); skip = `sp.SkipConfig(threshold, warmup_steps=0,
tile=(16, 16), backward=False)`; skip-train = the same with backward=True. In training the handle runs
`skip_step_differentiable`, so the backward is exactly the gradient of the sparse forward that ran (only the
tiles the forward computed contribute); skip-train additionally skips, in the backward, the tiles its forward found
negligible by the keep test (approximate gradient, `SkipConfig(backward=True)`).

Skip lists in training (`--list-refresh N`). At inference a list lives for one video: call k reads the list that
call k-1 of the same video wrote. Training batches are unrelated clips at random noise levels, so:
- N = 0 (default), "probe": before each step, `handle.reset()` and one no-grad forward on the very batch (x_t, t,
  text) of the step. That forward reads full lists (dense) and writes each (layer, sample, head, q-tile) list
  from this batch's own attention; the gradient forward then reads exactly those lists. The list used is always
  the one made for the data it is applied to (like a video's step k+1 reading step k's list), and the gradient is
  exactly that of this sparse forward. Cost: one extra no-grad forward (~1/3 of a dense step), so it pays off
  once the density is below ~2/3 (fwd + bwd ~ 3 forward units: 1 + 3 d < 3).
- N >= 1, "carry": `handle.reset()` every N steps; the step after a reset runs dense (full lists) and writes
  lists, the next N - 1 steps read the list the previous step wrote, from OTHER clips. Cheapest (no probe), but
  a list only ever shrinks between resets (unvisited tiles stay skipped), so keep N small. Each step's gradient
  is still exactly that of the sparse forward it ran.
Either way a list is never re-read after its forward: gradient checkpointing (which re-runs the forward and so
would advance the lists) is not used with skip configs, and the dataloader drops the last partial batch (a new
batch size would start new lists mid-run).

Returns (from `main`) and prints a summary: final loss, losses, step times (seconds: from the batch on the device
to the end of the optimizer step, probe included), attention calls and per-step density of the skip lists.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F

MODEL_SIZES = {
    # heads x head_dim, layers, ffn; text_dim matches the class text embeddings
    "tiny": dict(num_attention_heads=2, attention_head_dim=16, num_layers=2, ffn_dim=32, text_dim=16, freq_dim=16),
    "small": dict(num_attention_heads=4, attention_head_dim=32, num_layers=4, ffn_dim=256, text_dim=64,
                  freq_dim=64),
    # head_dim 64: the Triton kernels' size (with --mixed_precision bf16 the attention runs on them on a GPU)
    "base": dict(num_attention_heads=4, attention_head_dim=64, num_layers=4, ffn_dim=1024, text_dim=64,
                 freq_dim=64),
}
CONFIGS = ("dense", "skip", "skip-train")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparsepatch.recipes.finetune_video", description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=CONFIGS, default="skip-train")
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=2, help="clips per process per step")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                   help="cosine: linear warm-up over --lr-warmup steps, then cosine decay to 0 at --max-steps")
    p.add_argument("--lr-warmup", type=int, default=0, help="steps of linear learning-rate warm-up")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0 disables clipping")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threshold", type=float, default=-5.0, help="skip threshold, log2 units (< 0)")
    p.add_argument("--tile", type=int, nargs=2, default=(16, 16), metavar=("TM", "TN"))
    p.add_argument("--list-refresh", type=int, default=0,
                   help="0: probe each batch with a no-grad forward to make its lists; N>=1: reset every N steps")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny")
    p.add_argument("--model-path", default=None, help="a WanTransformer3DModel save_pretrained directory")
    p.add_argument("--frames", type=int, default=5, help="latent frames F")
    p.add_argument("--latent-size", type=int, default=16, help="latent height = width")
    p.add_argument("--text-len", type=int, default=8)
    p.add_argument("--output-dir", default=None, help="save the unpatched model here (save_pretrained)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--t-dist", choices=("uniform", "logit-normal"), default="uniform",
                   help="noise-level distribution in training (before --t-shift)")
    p.add_argument("--t-shift", type=float, default=1.0, help="warp t -> s t / (1 + (s - 1) t); 1: none")
    p.add_argument("--cond-dropout", type=float, default=0.0,
                   help="fraction of clips trained with an all-zero text embedding (for classifier-free guidance)")
    p.add_argument("--colour-jitter", type=float, default=None,
                   help="clip colours fixed per class up to this jitter (data.render_clip); default: random colours")
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="wall-clock budget of the training loop; 0: none. At step 40 the step count is cut to what fits "
                        "(timed over steps 10-40) and the learning-rate schedule is fitted to that count")
    return p


def build_model(size: str = "tiny", model_path: str | None = None):
    """A WanTransformer3DModel in train mode: from `model_path`, else random weights of `MODEL_SIZES[size]`.

    Latent channels 4, patch (1, 2, 2): a (B, 4, F, H, W) latent becomes F * H/2 * W/2 tokens.
    """
    from diffusers import WanTransformer3DModel
    if model_path:
        return WanTransformer3DModel.from_pretrained(model_path).train()
    cfg = MODEL_SIZES[size]
    return WanTransformer3DModel(patch_size=(1, 2, 2), in_channels=4, out_channels=4, cross_attn_norm=True,
                                 rope_max_seq_len=64, **cfg).train()


def flow_matching_inputs(x0: torch.Tensor, generator: torch.Generator, shard: tuple[int, int] = (0, 1),
                         t_dist: str = "uniform", t_shift: float = 1.0):
    """Rectified-flow training pair for clean latents x0 (B, C, F, H, W).

    shard = (process index, number of processes): noise and t are drawn for the whole global batch
    (B * processes rows) from a generator seeded alike on every process, and this process takes its rows, so
    N processes x batch B see exactly the noise of 1 process x batch N*B (the data loader shards batches the same
    way), and their losses can be compared step by step.
    t_dist "uniform" (t ~ U(0, 1)) or "logit-normal" (t = sigmoid(z), z ~ N(0, 1)); then t_shift s warps
    t -> s t / (1 + (s - 1) t). Defaults: the plain objective (the same draws as before these options).
    Returns x_t (same shape), timestep fp32 (B,) in [0, 1000] (the model's convention), target = noise - x0.
    """
    if t_dist not in ("uniform", "logit-normal"):
        raise ValueError(f"t_dist must be 'uniform' or 'logit-normal', got {t_dist!r}")
    if not t_shift > 0:
        raise ValueError(f"t_shift must be > 0, got {t_shift}")
    B = x0.shape[0]
    index, count = shard
    rows = slice(index * B, (index + 1) * B)
    noise = torch.randn((B * count, *x0.shape[1:]), generator=generator, device=x0.device, dtype=x0.dtype)[rows]
    if t_dist == "uniform":
        t = torch.rand(B * count, generator=generator, device=x0.device, dtype=torch.float32)[rows]
    else:
        t = torch.sigmoid(torch.randn(B * count, generator=generator, device=x0.device, dtype=torch.float32))[rows]
    if t_shift != 1.0:
        t = t_shift * t / (1.0 + (t_shift - 1.0) * t)
    tt = t.to(x0.dtype).view(B, *([1] * (x0.dim() - 1)))
    return (1 - tt) * x0 + tt * noise, t * 1000.0, noise - x0


def lr_factor(schedule: str, warmup: int, total):
    """Multiplier of the base learning rate at optimizer step s (0-based), for LambdaLR.

    total: the number of steps, an int or a one-element list (read at each step, so a wall-clock budget can
    shorten the schedule after it has started)."""
    if warmup < 0:
        raise ValueError(f"--lr-warmup must be >= 0, got {warmup}")
    steps = total if isinstance(total, list) else [total]

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = (s - warmup) / max(steps[0] - warmup, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return factor


def progress(total: int, enabled: bool, desc: str):
    """A tqdm bar (None when disabled or tqdm is missing; callers then print lines)."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, dynamic_ncols=True)


def log_line(accelerator, bar, text: str) -> None:
    if bar is not None:
        bar.write(text)
    else:
        accelerator.print(text)


def optimizer_step(accelerator, model, optimizer, loss, max_grad_norm: float, step: int) -> float:
    """Backward, clip, step; returns the loss averaged over processes (FloatingPointError when not finite)."""
    accelerator.backward(loss)
    if max_grad_norm > 0:
        accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    value = accelerator.reduce(loss.detach(), reduction="mean").item()   # syncs the device
    if not math.isfinite(value):
        raise FloatingPointError(f"step {step}: loss is {value}")
    return value


def report_step(accelerator, bar, step: int, max_steps: int, log_every: int, loss: float, step_s: float,
                density: float | None = None) -> None:
    """Progress-bar postfix every step, a log line every `log_every` steps (and the first)."""
    extra = {} if density is None else {"density": f"{density:.3f}"}
    if bar is not None:
        bar.set_postfix({"loss": f"{loss:.4f}", "ms": f"{1000 * step_s:.0f}", **extra})
        bar.update(1)
    if log_every and ((step + 1) % log_every == 0 or step == 0):
        tail = "" if density is None else f" density {density:.3f}"
        log_line(accelerator, bar, f"step {step + 1}/{max_steps} loss {loss:.5f} step_ms {1000 * step_s:.1f}{tail}")


def finish(accelerator, handle, raw, output_dir, **save_kwargs) -> int:
    """Unpatch (so the saved and returned model is the plain host model), save, return the attention calls."""
    accelerator.wait_for_everyone()
    calls = 0
    if handle is not None:
        calls = handle.stats()["calls"]
        handle.remove()
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
        raw.save_pretrained(output_dir, is_main_process=accelerator.is_main_process, **save_kwargs)
    accelerator.wait_for_everyone()
    return calls


def sync(device) -> None:
    """Wait for queued device work so step times measure the work, not the launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def list_density(handle) -> float:
    """Mean fraction of skip tiles the NEXT patched forward computes (1.0 when no lists are live: full first pass)."""
    lists = handle.skip_lists()
    if not lists:
        return 1.0
    return float(torch.stack([lst.density().to("cpu") for lst in lists.values()]).mean())


def train_from_initial(module: str, argv, build_initial, finetune_main, finetune_args: list, output_dir,
                       tail: int, **info) -> dict:
    """Save `build_initial`'s seeded weights to a temporary directory, fine-tune from them with
    `finetune_main(["--model-path", <dir>, *finetune_args])`, then record how (command, wall seconds, device, final
    loss, mean loss of the last `tail` steps, plus `info`) in `output_dir`/training_info.json. Returns the fine-tune's
    result with "info" added. `argv` None means the command line (sys.argv)."""
    import sys
    import tempfile
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as init:
        build_initial(init)
        result = finetune_main(["--model-path", init, *finetune_args])
    losses = result["losses"]
    given = sys.argv[1:] if argv is None else argv
    record = {"command": f"PYTHONPATH=. python -m {module} " + " ".join(given),
              "wall_seconds": round(time.perf_counter() - t0, 1),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "steps": len(losses), "final_loss": result["final_loss"],
              f"mean_loss_last_{tail}": sum(losses[-tail:]) / len(losses[-tail:]), **info}
    if output_dir:
        with open(os.path.join(output_dir, "training_info.json"), "w") as f:
            json.dump(record, f, indent=1)
    print("TRAINED " + json.dumps(record))
    result["info"] = record
    return result


def summarize(accelerator, name: str, result: dict) -> None:
    times = result["step_times"]
    steady = times[1:] or times   # the first step includes one-off setup (allocations, kernel compiles)
    line = (f"[{name}] config={result['config']} steps={len(result['losses'])} final_loss={result['final_loss']:.6f} "
            f"mean_step_ms={1000 * sum(steady) / max(len(steady), 1):.2f} attention_calls={result['attention_calls']}")
    if result.get("density"):
        line += f" mean_density={sum(result['density']) / len(result['density']):.4f}"
    if result.get("output_dir"):
        line += f" saved={result['output_dir']}"
    accelerator.print(line)
    accelerator.print("SUMMARY " + json.dumps({k: v for k, v in result.items() if k != "model"}))


def main(argv=None) -> dict:
    """Run the fine-tune; returns {"final_loss", "losses", "step_times", "attention_calls", "density",
    "config", "output_dir", "model" (the trained model, unpatched, unwrapped)}. losses are process-mean MSE."""
    args = build_parser().parse_args(argv)
    if args.max_steps < 1:
        raise ValueError(f"--max-steps must be >= 1, got {args.max_steps}")
    if args.list_refresh < 0:
        raise ValueError(f"--list-refresh must be >= 0, got {args.list_refresh}")
    if not 0.0 <= args.cond_dropout < 1.0:
        raise ValueError(f"--cond-dropout must be in [0, 1), got {args.cond_dropout}")
    if args.max_minutes < 0:
        raise ValueError(f"--max-minutes must be >= 0, got {args.max_minutes}")
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    import sparsepatch as sp
    from .data import ProceduralClips

    accelerator = Accelerator()
    set_seed(args.seed)                       # same initial weights on every process
    model = build_model(args.model_size, args.model_path)
    text_dim = model.config.text_dim
    handle = None
    if args.config != "dense":
        # Patch before prepare: DDP then wraps the patched processors; sp.patch keys the handle by the raw model.
        cfg = sp.SkipConfig(threshold=args.threshold, warmup_steps=0, tile=tuple(args.tile),
                            backward=args.config == "skip-train")
        handle = sp.patch(model, cfg)

    data = ProceduralClips(length=max(10_000, 4 * args.max_steps * args.batch_size * accelerator.num_processes),
                           frames=args.frames, size=args.latent_size, channels=model.config.in_channels,
                           text_len=args.text_len, text_dim=text_dim, seed=args.seed,
                           colour_jitter=args.colour_jitter)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                         num_workers=args.num_workers,
                                         generator=torch.Generator().manual_seed(args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    # Stepped by hand once per optimizer step (not prepared: accelerate would step it once per process).
    total_steps = [args.max_steps]     # cut by --max-minutes once the step time is known
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(args.lr_schedule, args.lr_warmup,
                                                                       total_steps))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    raw = accelerator.unwrap_model(model)
    # One noise stream for the global batch, seeded alike on every process (see flow_matching_inputs).
    gen = torch.Generator(device=accelerator.device).manual_seed(args.seed * 1000)
    shard = (accelerator.process_index, accelerator.num_processes)

    losses, step_times, density = [], [], []
    bar = progress(args.max_steps, accelerator.is_local_main_process, f"finetune_video[{args.config}]")
    batches = iter(loader)
    model.train()
    loop_start = time.perf_counter()
    for step in range(args.max_steps):
        if step >= total_steps[0]:
            break
        if args.max_minutes > 0 and step == 10:
            steady_start = time.perf_counter()   # the first steps carry compiles and allocator warm-up
        if args.max_minutes > 0 and step == 40:
            # Every process must cut at the same step: the mean of the processes' steady step times decides.
            now = time.perf_counter()
            per_step = torch.tensor((now - steady_start) / 30, device=accelerator.device)
            per_step = accelerator.reduce(per_step, reduction="mean") if accelerator.num_processes > 1 else per_step
            fits = step + int((args.max_minutes * 60 - (now - loop_start)) / float(per_step))
            total_steps[0] = max(step + 1, min(args.max_steps, fits))
            if total_steps[0] < args.max_steps:
                accelerator.print(f"--max-minutes {args.max_minutes}: {float(per_step) * 1000:.1f} ms per step, "
                                  f"training {total_steps[0]} of {args.max_steps} steps")
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            batch = next(batches)
        sync(accelerator.device)
        t0 = time.perf_counter()
        x0, text = batch["latents"], batch["text"]
        xt, timestep, target = flow_matching_inputs(x0, gen, shard, args.t_dist, args.t_shift)
        if args.cond_dropout > 0:   # drawn for the global batch like the noise, after it (no option: no draw)
            B = text.shape[0]
            keep = torch.rand(B * shard[1], generator=gen, device=gen.device)[shard[0] * B:(shard[0] + 1) * B]
            text = text * (keep >= args.cond_dropout).to(text.dtype).view(B, 1, 1)
        if handle is not None:
            if args.list_refresh == 0:
                handle.reset()
                with torch.no_grad():             # probe: full lists in, this batch's lists out
                    raw(hidden_states=xt, timestep=timestep, encoder_hidden_states=text, return_dict=False)
            elif step % args.list_refresh == 0:
                handle.reset()                    # this step runs full lists and writes fresh ones
            density.append(list_density(handle))  # the lists this step's gradient forward reads
        pred = model(hidden_states=xt, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
        loss = F.mse_loss(pred.float(), target.float())
        loss_value = optimizer_step(accelerator, model, optimizer, loss, args.max_grad_norm, step)
        scheduler.step()
        sync(accelerator.device)
        step_times.append(time.perf_counter() - t0)
        losses.append(loss_value)
        report_step(accelerator, bar, step, args.max_steps, args.log_every, loss_value, step_times[-1],
                    density[-1] if density else None)
    if bar is not None:
        bar.close()
    calls = finish(accelerator, handle, raw, args.output_dir)
    result = {"config": args.config, "final_loss": losses[-1], "losses": losses, "step_times": step_times,
              "attention_calls": calls, "density": density, "output_dir": args.output_dir,
              "list_refresh": args.list_refresh, "num_processes": accelerator.num_processes, "model": raw}
    summarize(accelerator, "finetune_video", result)
    accelerator.end_training()
    return result


if __name__ == "__main__":
    main()
