"""Training mode on the synthetic video-like workload: gradient quality and backward speed vs dense.

For each threshold: the forward of "step k" builds the skip list on video-like q/k/v (sparsepatch.testing), the
forward+backward of "step k+1" (slightly drifted inputs) reads it. Reported per threshold:
- density of the list read, and the fraction of it the step-k+1 forward kept (what backward=True computes);
- cos-sim of dQ/dK/dV vs dense attention's gradients, for the exact sparse gradient (backward over the read
  list) and for training mode (backward over read ∩ kept);
- backward time of both, and of our dense backward and cuDNN's, on the same inputs.

    python -m sparsepatch bench training_mode [--seq 32760] [--heads 12] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import gpu_name  # noqa: E402


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--frames", type=int, default=21)
    p.add_argument("--height", type=int, default=30)
    p.add_argument("--width", type=int, default=52)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--thresholds", type=float, nargs="+", default=[-3.0, -5.0, -7.0, -10.0])
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args(argv)

    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sparsepatch.kernels.skip import triton as skip
    from sparsepatch.kernels.skip import backward as skip_backward
    from sparsepatch.testing import video_like_qkv

    dev = "cuda"
    shape = dict(B=1, heads=args.heads, frames=args.frames, height=args.height, width=args.width, dim=128,
                 dtype=torch.bfloat16, device=dev)
    q0, k0, v0 = video_like_qkv(step=0, **shape)
    q1, k1, v1 = video_like_qkv(step=1, **shape)
    S = q1.shape[1]
    do = torch.randn_like(q1)

    def grads(fn):
        q, k, v = (t.detach().requires_grad_() for t in (q1, k1, v1))
        out = fn(q, k, v)
        return torch.autograd.grad(out, (q, k, v), do)

    dense_g = grads(lambda q, k, v: skip.attention(q, k, v))
    out_d, lse_d = skip.attention(q1, k1, v1, return_lse=True)
    t_dense = triton.testing.do_bench(lambda: skip_backward.attention_backward(q1, k1, v1, out_d, lse_d, do))
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q1, k1, v1))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
        dot = do.transpose(1, 2)
        t_cudnn = triton.testing.do_bench(lambda: torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True))
    rows = []
    for th in args.thresholds:
        _, read = skip.skip_attention(q0, k0, v0, None, th)            # step k builds the list
        out, kept, lse = skip.skip_attention(q1, k1, v1, read, th, return_lse=True)   # step k+1 reads it
        exact = grads(lambda q, k, v: skip.skip_attention(q, k, v, read, th)[0])
        approx = skip_backward.attention_backward(q1, k1, v1, out, lse, do, skip_list=read, extra_skip=kept)
        t_exact = triton.testing.do_bench(
            lambda: skip_backward.attention_backward(q1, k1, v1, out, lse, do, skip_list=read))
        t_approx = triton.testing.do_bench(
            lambda: skip_backward.attention_backward(q1, k1, v1, out, lse, do, skip_list=read, extra_skip=kept))
        both = (read.to_mask() & kept.to_mask()).float().mean().item()
        row = dict(threshold=th, density_read=read.density().item(), density_backward=both,
                   cos_exact={n: cos(a, b) for n, a, b in zip(("dq", "dk", "dv"), exact, dense_g)},
                   cos_train={n: cos(a, b) for n, a, b in zip(("dq", "dk", "dv"), approx, dense_g)},
                   bwd_ms_exact=t_exact, bwd_ms_train=t_approx, bwd_ms_dense=t_dense, bwd_ms_cudnn=t_cudnn,
                   speedup_train_vs_dense=t_dense / t_approx)
        rows.append(row)
    result = dict(workload=dict(seq=S, heads=args.heads, head_dim=128, dtype="bf16",
                                device=torch.cuda.get_device_name()), rows=rows)
    gpu = gpu_name()
    text = json.dumps(result, indent=1)
    (ROOT / "benchmarks" / "results" / f"{gpu}-training-mode.json").write_text(text)
    if args.out:
        Path(args.out, f"{gpu}-training-mode.json").write_text(text)
    print(f"video-like workload S={S} H{args.heads} D128 bf16; dense bwd {t_dense:.2f} ms, cuDNN bwd {t_cudnn:.2f} ms")
    print(f"{'thr':>6} {'dens':>6} {'bwd dens':>8} {'min cos exact':>13} {'min cos train':>13} "
          f"{'bwd exact ms':>12} {'bwd train ms':>12} {'x dense':>7}")
    for r in rows:
        print(f"{r['threshold']:>6.1f} {r['density_read']:>6.3f} {r['density_backward']:>8.3f} "
              f"{min(r['cos_exact'].values()):>13.5f} {min(r['cos_train'].values()):>13.5f} "
              f"{r['bwd_ms_exact']:>12.2f} {r['bwd_ms_train']:>12.2f} {r['speedup_train_vs_dense']:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
