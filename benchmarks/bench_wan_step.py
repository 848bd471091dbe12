"""One Wan2.1-1.3B-shaped transformer forward (a denoising step): dense cuDNN SDPA vs sparsepatch skip lists.

    python benchmarks/bench_wan_step.py [--layers 30] [--reps 3] [--fp8]

diffusers WanTransformer3DModel with Wan2.1-T2V-1.3B's shape (30 layers, 12 heads x 128, ffn 8960, text_dim 4096,
freq_dim 256, patch (1, 2, 2)), random weights, bf16, latent (1, 16, 21, 60, 104) = 480p x 81 frames = 32760
tokens, 512 text tokens. Dense: every attention on SDPA cuDNN. Sparse: self-attention calls go to
sparsepatch.kernels.skip.triton.skip_attention with fixed random lists at density 0.5 / 0.25 (diagonal always listed;
the kernel still runs its keep test and writes the next list); cross-attention stays on cuDNN. Stateful ("step_*"):
the same lists through `skip.skip_step`, the op the patcher's SkipConfig calls (list slots + call counter, density
bookkeeping; the counter is reset before each call so every call reads the forced list). --fp8 adds the same
modes on 8-bit attention: self-attention through `dense.attention_fp8` (fp8 dense), `skip.fp8.skip_attention_fp8`
and `skip.fp8.skip_step_fp8` (SkipConfig(precision="fp8")'s op), on the same lists. The attention call is
swapped locally in this script (module attribute of transformer_wan), not through sparsepatch.patcher.
Writes <out>/<gpu>-wan-step-skip.json and $OUT/... when OUT is set.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fp8", action="store_true", help="also the fp8 dense / fp8 skip / fp8 skip_step modes")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_wan_step: needs CUDA")
        return 1
    from diffusers.models.transformers import transformer_wan
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from common import gpu_name, random_list, save_results, wan_1_3b_shaped
    from sparsepatch.kernels.dense import fp8 as dense_fp8
    from sparsepatch.kernels.skip import fp8 as skip_fp8
    from sparsepatch.kernels.skip import triton as skip
    from sparsepatch.kernels.skip import stateful

    model = wan_1_3b_shaped(args.layers)
    x = torch.randn(1, 16, 21, 60, 104, device="cuda", dtype=torch.bfloat16)
    ctx = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16)
    ts = torch.tensor([500], device="cuda")
    S = 21 * 30 * 52
    lists = {rho: random_list(1, 12, S, rho) for rho in (0.5, 0.25)}
    state = {"list": None, "bufs": None, "self_calls": 0, "fp8": False}
    step_bufs = {}
    for rho, lst in lists.items():   # slot 0 holds the forced list; calls write slot 1
        b = stateful.SkipListBuffers.create(1, 12, S, S, (128, 128), "cuda")
        b.counts[0].copy_(lst.counts)
        b.indices[0].copy_(lst.indices)
        step_bufs[rho] = b
    orig = transformer_wan.dispatch_attention_fn

    def patched(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, backend=None,
                parallel_config=None, **kw):
        self_attn = attn_mask is None and query.shape[1] == key.shape[1]
        fp8 = state["fp8"]
        if self_attn and state["bufs"] is not None:
            state["self_calls"] += 1
            b = state["bufs"]
            b.step.zero_()
            fn = skip_fp8.skip_step_fp8 if fp8 else skip.skip_step
            return fn(query, key, value, b.counts, b.indices, b.step, b.density, -5.0, 0, 128, 128,
                      query.shape[-1] ** -0.5, [])
        if self_attn and state["list"] is not None:
            state["self_calls"] += 1
            fn = skip_fp8.skip_attention_fp8 if fp8 else skip.skip_attention
            out, _ = fn(query, key, value, state["list"], -5.0)
            return out
        if self_attn and fp8:
            state["self_calls"] += 1
            return dense_fp8.attention_fp8(query, key, value)
        return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    backend=backend, parallel_config=parallel_config, **kw)

    transformer_wan.dispatch_attention_fn = patched

    def step():
        with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return model(x, ts, ctx, return_dict=False)[0]

    def time_mode(lst, bufs=None, fp8=False):
        state["list"], state["bufs"], state["fp8"] = lst, bufs, fp8
        out = step()                     # warm-up (compiles)
        torch.cuda.synchronize()
        ms = []
        for _ in range(args.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            ms.append(a.elapsed_time(b))
        return statistics.median(ms), out

    res = dict(gpu=torch.cuda.get_device_name(), layers=args.layers, tokens=S, modes={})
    dense_ms, dense_out = time_mode(None)
    res["modes"]["dense_cudnn"] = dense_ms
    for rho, lst in lists.items():
        ms, out = time_mode(lst)
        cos = torch.nn.functional.cosine_similarity(out.float().flatten(), dense_out.float().flatten(), 0).item()
        res["modes"][f"skip_{rho}"] = ms
        res[f"cos_vs_dense_{rho}"] = cos
        ms, out_step = time_mode(None, step_bufs[rho])
        res["modes"][f"step_{rho}"] = ms
        res[f"step_max_abs_vs_skip_{rho}"] = (out_step.float() - out.float()).abs().max().item()
    if args.fp8:
        ms, fp8_out = time_mode(None, fp8=True)
        res["modes"]["fp8_dense"] = ms
        res["cos_fp8_dense_vs_dense"] = torch.nn.functional.cosine_similarity(
            fp8_out.float().flatten(), dense_out.float().flatten(), 0).item()
        for rho, lst in lists.items():
            ms, out = time_mode(lst, fp8=True)
            res["modes"][f"fp8_skip_{rho}"] = ms
            ms, out_step = time_mode(None, step_bufs[rho], fp8=True)
            res["modes"][f"fp8_step_{rho}"] = ms
            res[f"fp8_step_max_abs_vs_skip_{rho}"] = (out_step.float() - out.float()).abs().max().item()
    transformer_wan.dispatch_attention_fn = orig
    n_modes = 2 * len(lists) + (1 + 2 * len(lists) if args.fp8 else 0)
    res["self_attn_calls_per_step"] = state["self_calls"] // (n_modes * (args.reps + 1))
    save_results(res, f"{gpu_name()}-wan-step-skip.json", args.out)
    print(f"\n## Wan2.1-1.3B-shaped transformer step ({args.layers} layers, {S} tokens, bf16), "
          f"{torch.cuda.get_device_name()}")
    print("| mode | ms / step | speed-up vs cuDNN dense | target |")
    print("|---|---|---|---|")
    print(f"| dense (SDPA cuDNN) | {dense_ms:.1f} | 1.00x | |")
    for rho, tgt in ((0.5, 1.30), (0.25, 1.55)):
        ms = res["modes"][f"skip_{rho}"]
        print(f"| skip lists, density {rho} | {ms:.1f} | {dense_ms / ms:.2f}x | >= {tgt:.2f}x |")
        ms = res["modes"][f"step_{rho}"]
        print(f"| skip_step (patcher path), density {rho} | {ms:.1f} | {dense_ms / ms:.2f}x | >= {tgt:.2f}x |")
    if args.fp8:
        ms = res["modes"]["fp8_dense"]
        print(f"| fp8 dense (attention_fp8) | {ms:.1f} | {dense_ms / ms:.2f}x | |")
        for rho in lists:
            for key, name in (("fp8_skip", "fp8 skip lists"), ("fp8_step", "fp8 skip_step (patcher path)")):
                ms = res["modes"][f"{key}_{rho}"]
                print(f"| {name}, density {rho} | {ms:.1f} | {dense_ms / ms:.2f}x | |")
    print("(cos vs dense is not a quality figure: random weights, forced random lists)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
