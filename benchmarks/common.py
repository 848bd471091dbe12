"""Helpers shared by the benchmark scripts: device short name and the fixed random skip lists they time."""
from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def gpu_name() -> str:
    """Short lowercase device name for result file names (h100, h200, ...)."""
    name = torch.cuda.get_device_name().lower()
    for short in ("h200", "h100", "a100", "b200", "l40", "a10"):
        if short in name:
            return short
    return name.replace(" ", "-")


def random_list(B, H, S, density, tile=(128, 128), seed=0, device="cuda"):
    """Fixed random SkipList with round(density * Tk) tiles per row (at least 1), diagonal always included."""
    from sparsepatch.kernels.skip.skiplist import SkipList, num_tiles
    tm, tn = tile
    tq, tk = num_tiles(S, tm), num_tiles(S, tn)
    g = torch.Generator(device=device).manual_seed(seed)
    score = torch.rand(B, H, tq, tk, generator=g, device=device)
    diag = (torch.arange(tq, device=device) * tm // tn).clamp(max=tk - 1)
    score[:, :, torch.arange(tq, device=device), diag] = 2.0
    n = max(1, round(density * tk))
    top = score.topk(n, dim=-1).indices
    mask = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, top, True)
    return SkipList.from_mask(mask, tile, S, S)


def save_results(res: dict, name: str, out: str | None) -> None:
    """Write `res` as JSON to `out`/name (created if needed) and, on the device machine, to $OUT/name as well."""
    import json
    for d in dict.fromkeys(filter(None, [out, os.environ.get("OUT")])):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, name), "w") as f:
            json.dump(res, f, indent=1)


def wan_1_3b_shaped(layers: int = 30, device="cuda"):
    """A WanTransformer3DModel with Wan2.1-T2V-1.3B's shape (12 heads x 128, ffn 8960, text_dim 4096, freq_dim 256,
    patch (1, 2, 2)), `layers` blocks, random weights from seed 0, bf16, eval mode."""
    return wan_shaped(layers, heads=12, ffn=8960, device=device)


def wan_shaped(layers: int, heads: int, ffn: int, head_dim: int = 128, text_dim: int = 4096, device="cuda",
               dtype=torch.bfloat16):
    """A WanTransformer3DModel (freq_dim 256, patch (1, 2, 2), 16 latent channels) with `heads` x `head_dim`
    attention, feed-forward width `ffn`, `layers` blocks, random weights from seed 0 (the same on every device of
    one type), in `dtype`, eval mode. Wan2.1-1.3B: 12 x 128, ffn 8960; Wan2.1-14B: 40 x 128, ffn 13824."""
    from diffusers import WanTransformer3DModel
    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=16,
            out_channels=16, text_dim=text_dim, freq_dim=256, ffn_dim=ffn, num_layers=layers, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
        )
    return model.to(dtype).eval()


def host_ms(fn, calls: int = 20, busy: bool = False, warmup: int = 1) -> float:
    """Host ms per call of fn: `calls` calls enqueued without a sync inside the timing (after `warmup` calls).
    busy: a long GPU sleep (~0.1 s on an H100) is queued first, so the queue never drains while they are timed."""
    import time
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if busy:
        torch.cuda._sleep(200_000_000)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    return t


def graph_replay(fn, warmup: int = 3):
    """fn() captured in a CUDA graph after `warmup` calls on a side stream (so lazy initialisation and autotuning
    stay out of the graph); returns the graph's replay method (the bound method keeps the graph alive)."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


class ClockSampler:
    """Mean SM clock (MHz) and board power (W) over a `with` block, sampled through NVML every `period_s` on a
    thread (the timed GPU work is asynchronous, so the sampler does not delay it). Without NVML (no pynvml), the
    means are None. Used to tell a slower kernel from the same kernel at a lower clock: on a power-limited H100 the
    SM clock moves by ~10% between benchmark calls."""

    def __init__(self, period_s: float = 0.002):
        self.period_s = period_s
        self.mhz = self.watts = None
        try:
            import pynvml
            pynvml.nvmlInit()
            index = torch.cuda.current_device()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # noqa: BLE001  (no NVML here: report nothing rather than fail the benchmark)
            self._nvml = None

    def __enter__(self):
        import threading
        self._samples = []
        self._stop = threading.Event()
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        nv, h = self._nvml, self._handle
        while not self._stop.is_set():
            self._samples.append((nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                                  nv.nvmlDeviceGetPowerUsage(h) / 1000.0))
            self._stop.wait(self.period_s)

    def __exit__(self, *exc):
        self._stop.set()
        if self._nvml is not None:
            self._thread.join()
            if self._samples:
                self.mhz = sum(s[0] for s in self._samples) / len(self._samples)
                self.watts = sum(s[1] for s in self._samples) / len(self._samples)
        return False
