"""Dense forward, Triton grid kernel vs the Gluon kernel with skipping compiled out vs cuDNN, one process.

`python benchmarks/bench_skip_gluon_dense.py [--out DIR]`: B1 D128 bf16 non-causal at H12 / H40 S32760 and H16
S4096; each cell the fastest of 3 interleaved rounds (do_bench medians); errors vs cuDNN printed.
"""
import argparse
import json
import os

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    import triton
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from sparsepatch.kernels.skip import triton as skip
    from sparsepatch.kernels.skip import gluon as skip_gluon
    rows = []
    for B, H, S, D in ((1, 12, 32760, 128), (1, 40, 32760, 128), (1, 16, 4096, 128)):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt)
        def triton_dense():   # the Triton kernel (skip.attention dispatches to the Gluon one by default)
            cfg = skip.CONFIGS[(D, 128)]
            was = cfg.get("gluon")
            cfg["gluon"] = False
            try:
                return skip._dense_fwd_impl(q, k, v, False, D ** -0.5, False)[0]
            finally:
                cfg["gluon"] = was
        fns = dict(triton=triton_dense,
                   gluon=lambda: skip_gluon.dense_fwd(q, k, v, D ** -0.5, False)[0], cudnn=cudnn)
        ref = cudnn().transpose(1, 2).float()
        err = {n: (fn().float().reshape(ref.shape) - ref).abs().max().item() for n, fn in fns.items() if n != "cudnn"}
        ms = {n: [] for n in fns}
        for _ in range(3):
            for n, fn in fns.items():
                ms[n].append(triton.testing.do_bench(fn, warmup=25, rep=150))
        flops = 4 * B * H * S * S * D
        row = dict(shape=f"B{B} H{H} S{S} D{D}", ms={n: min(v) for n, v in ms.items()}, rounds=ms, max_err=err,
                   tflops={n: flops / min(v) * 1e-9 for n, v in ms.items()})
        rows.append(row)
        print(row, flush=True)
    print("\n| shape | Triton ms | Gluon ms | cuDNN ms | Gluon / Triton | TFLOP/s Triton / Gluon / cuDNN |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        m, t = r["ms"], r["tflops"]
        print(f"| {r['shape']} | {m['triton']:.3f} | {m['gluon']:.3f} | {m['cudnn']:.3f} | "
              f"{m['gluon'] / m['triton']:.3f} | {t['triton']:.0f} / {t['gluon']:.0f} / {t['cudnn']:.0f} |")
    res = dict(rows=rows, gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    for d in filter(None, [args.out, os.environ.get("OUT")]):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "h100-skip-gluon-dense.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
