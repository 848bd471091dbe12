"""Native Sparse Attention forward / decode: sparsepatch Triton vs SDPA (cuDNN causal) vs fla parallel_nsa.

    python benchmarks/bench_nsa.py [--quick] [--out DIR] [--max-t N] [--bwd] [--bwd-only]

Prefill forward, bf16, D=128, B=1, NSAConfig() (block 64, 16 selected, window 512, compressed block 32 stride 16,
uniform gates) for HQ64/H4 (G=16), HQ32/H8 (G=4), HQ16/H16 (MHA), T = 8K..64K (128K for G=16 with --max-t).
Peers in the same process on the same inputs: SDPA causal with the cuDNN backend (k/v expanded to HQ heads outside
the timing) and fla's parallel_nsa (G=16 only: fla needs G >= 16; block 64, 16 blocks, window 512, its own
mean pooling with compressed block = stride = 64, gates given) — a cheaper compression than ours (T/64 vs T/16
compressed keys). Decode: one query token, HQ64/H4, context 8K..64K, NSACache(store_kv=False) prefilled, vs SDPA
(default backend, enable_gqa). Times: triton.testing.do_bench medians (ms). Also a per-kernel breakdown at the
largest T (CUDA events around each launch). Writes <out>/<gpu>-nsa.json and prints ratio tables.
--bwd adds a training section "fwd_bwd": forward + backward (torch.autograd.grad of q, k, v for a random dout,
uniform gates) of ours vs SDPA cuDNN causal (k/v expanded outside the timing, gradients of the expanded tensors)
at the same head configurations, T = 8K..32K (8K, 16K with --quick); --bwd-only skips the forward and decode
sections.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sparsepatch.config import NSAConfig  # noqa: E402
from sparsepatch.kernels import nsa_reference as ref  # noqa: E402

HEADS = [(64, 4), (32, 8), (16, 16)]
TS = [8192, 16384, 32768, 65536]
DECODE_S = [8192, 16384, 32768, 65536]
D = 128


def _bench(fn, rep=100, warmup=10):
    import triton
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")   # ms


def load_fla():
    try:
        from fla.ops.nsa import parallel_nsa
        return parallel_nsa, None
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"


def _err(exc):
    import traceback
    return (f"{type(exc).__name__}: {exc} | " + " <- ".join(
        f"{f.filename.split('/')[-1]}:{f.lineno}" for f in traceback.extract_tb(exc.__traceback__)[-4:]))[:400]


def cudnn_causal(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    G = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(G, 2).transpose(1, 2)
    vh = v.repeat_interleave(G, 2).transpose(1, 2)

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    return run


def fwd_bwd(fn, leaves, dout):
    """A closure running fn(*leaves) and its backward (gradients of every leaf for the upstream dout)."""
    def run():
        out = fn(*leaves)
        return torch.autograd.grad(out, leaves, dout)
    return run


def cudnn_causal_fwd_bwd(q, k, v, dout):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    G = q.shape[2] // k.shape[2]
    qh = q.detach().transpose(1, 2).requires_grad_(True)
    kh = k.detach().repeat_interleave(G, 2).transpose(1, 2).requires_grad_(True)
    vh = v.detach().repeat_interleave(G, 2).transpose(1, 2).requires_grad_(True)
    doh = dout.transpose(1, 2)

    def attn(a, b, c):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(a, b, c, is_causal=True)
    return fwd_bwd(attn, (qh, kh, vh), doh)


def bench_fwd_bwd(nsa, cfg, heads, ts):
    """Rows of forward + backward times (ms): ours (both selected-branch dk/dv modes of nsa_backward.BWD) vs SDPA
    cuDNN causal, bf16, D=128, B=1."""
    from sparsepatch.kernels import nsa_backward
    rows = []
    for HQ, H in heads:
        for T in ts:
            q = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dout = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16)
            row = dict(HQ=HQ, H=H, G=HQ // H, T=T)
            try:
                run = fwd_bwd(lambda a, b, c: nsa.nsa_attention(a, b, c, cfg), (q, k, v), dout)
                row["ours_ms"] = _bench(run, rep=50)            # selected dk/dv mode "list" (the default)
                bwd_cfg = nsa_backward.BWD
                mode = bwd_cfg["slc_dkdv"]
                try:
                    bwd_cfg["slc_dkdv"] = "atomic" if mode == "list" else "list"
                    row[f"ours_{bwd_cfg['slc_dkdv']}_ms"] = _bench(run, rep=50)
                finally:
                    bwd_cfg["slc_dkdv"] = mode
                with torch.no_grad():
                    row["ours_fwd_ms"] = _bench(lambda: nsa.nsa_attention(q, k, v, cfg), rep=50)
            except Exception as exc:  # noqa: BLE001
                row["ours_error"] = _err(exc)
            try:
                row["cudnn_ms"] = _bench(cudnn_causal_fwd_bwd(q, k, v, dout), rep=50)
            except Exception as exc:  # noqa: BLE001
                row["cudnn_error"] = _err(exc)
            if "ours_ms" in row and "cudnn_ms" in row:
                row["speedup_vs_cudnn"] = row["cudnn_ms"] / row["ours_ms"]
            rows.append(row)
            print("fwd+bwd", {kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in row.items()},
                  flush=True)
            del q, k, v, dout
            torch.cuda.empty_cache()
    return rows


def breakdown(nsa, q, k, v, cfg):
    """ms per kernel for one forward (CUDA events around each launch)."""
    names = ["_cmp_kernel", "_topk_kernel", "_slc_kernel", "_swa_kernel"]
    times, origs = {}, {}
    for n in names:
        kern = getattr(nsa, n)
        origs[n] = kern.run

        def run(*a, _o=origs[n], _n=n, **kw):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            r = _o(*a, **kw)
            e.record()
            times.setdefault(_n, []).append((s, e))
            return r
        kern.run = run
    try:
        with torch.no_grad():
            for _ in range(3):
                nsa.nsa_attention(q, k, v, cfg)
        torch.cuda.synchronize()
    finally:
        for n in names:
            getattr(nsa, n).run = origs[n]
    return {n: round(min(s.elapsed_time(e) for s, e in v_), 3) for n, v_ in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T = 8K, 16K only")
    ap.add_argument("--max-t", type=int, default=65536, help="largest T for G=16 (131072 adds 128K)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--sweep", action="store_true", help="try tile rows / warps at 32K first and keep the best")
    ap.add_argument("--bwd", action="store_true", help="add the forward+backward section (fwd_bwd) vs cuDNN")
    ap.add_argument("--bwd-only", action="store_true", help="only the forward+backward section")
    args = ap.parse_args(argv)
    from sparsepatch.kernels import nsa
    cfg = NSAConfig()
    dev = torch.cuda.get_device_name()
    gpu = "h100" if "H100" in dev else ("h200" if "H200" in dev else dev.split()[-1].lower())
    parallel_nsa, fla_err = load_fla()
    res = {"device": dev, "torch": torch.__version__, "config": vars(cfg), "fla_error": fla_err,
           "prefill": [], "decode": [], "breakdown": {}, "sweep": [], "fwd_bwd": []}
    ts = TS[:2] if args.quick else TS
    torch.manual_seed(0)
    if args.bwd or args.bwd_only:
        res["fwd_bwd"] = bench_fwd_bwd(nsa, cfg, HEADS, [t for t in ts if t <= 32768])
    if args.bwd_only:
        return _write(res, args.out, gpu)

    if args.sweep:
        best = None
        for w, st in ((4, 3), (2, 3), (4, 2)):
            if True:
                nsa.NUM_WARPS["slc"], nsa.NUM_STAGES["slc"] = w, st
                rows = st
                for HQ, H in ((64, 4), (16, 16)):
                    q = torch.randn(1, 32768, HQ, D, device="cuda", dtype=torch.bfloat16)
                    k = torch.randn(1, 32768, H, D, device="cuda", dtype=torch.bfloat16)
                    v = torch.randn_like(k)
                    with torch.no_grad():
                        ms = _bench(lambda: nsa.nsa_attention(q, k, v, cfg), rep=60)
                    res["sweep"].append(dict(stages=rows, warps=w, HQ=HQ, H=H, ms=round(ms, 3)))
                    print("sweep", res["sweep"][-1], flush=True)
        tot = {}
        for r in res["sweep"]:
            tot[(r["stages"], r["warps"])] = tot.get((r["stages"], r["warps"]), 0) + r["ms"]
        best = min(tot, key=tot.get)
        nsa.NUM_STAGES["slc"], nsa.NUM_WARPS["slc"] = best[0], best[1]
        res["chosen"] = dict(slc_stages=best[0], slc_warps=best[1])
        print("chosen", res["chosen"], flush=True)

    for HQ, H in HEADS:
        tl_ = ts + ([131072] if (HQ, H) == (64, 4) and args.max_t >= 131072 and not args.quick else [])
        for T in tl_:
            q = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            row = dict(HQ=HQ, H=H, G=HQ // H, T=T)
            with torch.no_grad():
                row["ours_ms"] = _bench(lambda: nsa.nsa_attention(q, k, v, cfg), rep=100)
                try:
                    row["cudnn_ms"] = _bench(cudnn_causal(q, k, v), rep=100)
                except Exception as exc:  # noqa: BLE001
                    row["cudnn_error"] = f"{type(exc).__name__}: {exc}"[:200]
                if parallel_nsa is not None and HQ // H >= 16:
                    g = torch.full((1, T, HQ), 1 / 3, device="cuda", dtype=torch.bfloat16)
                    try:
                        row["fla_ms"] = _bench(lambda: parallel_nsa(q, k, v, g, g, g, block_counts=16, block_size=64,
                                                                    window_size=512), rep=100)
                    except Exception as exc:  # noqa: BLE001
                        row["fla_error"] = _err(exc)
            row["ours_ms_per_qhead"] = row["ours_ms"] / HQ
            if "cudnn_ms" in row:
                row["speedup_vs_cudnn"] = row["cudnn_ms"] / row["ours_ms"]
            if "fla_ms" in row:
                row["speedup_vs_fla"] = row["fla_ms"] / row["ours_ms"]
            res["prefill"].append(row)
            print({kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in row.items()}, flush=True)
            if T == max(ts):
                res["breakdown"][f"HQ{HQ}_H{H}_T{T}"] = breakdown(nsa, q, k, v, cfg)
                print("breakdown", res["breakdown"][f"HQ{HQ}_H{H}_T{T}"], flush=True)
            del q, k, v
            torch.cuda.empty_cache()

    HQ, H = 64, 4
    for S in (DECODE_S[:2] if args.quick else DECODE_S):
        k = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q1 = torch.randn(1, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        cache = ref.NSACache(store_kv=False)
        with torch.no_grad():
            cache.update(k, v, cfg)
            ms = _bench(lambda: nsa.nsa_attention(q1, k, v, cfg, cache=cache), rep=100)
            qh, kh, vh = q1.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            sd = _bench(lambda: F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True), rep=100)
        row = dict(HQ=HQ, H=H, S=S, ours_us=ms * 1e3, sdpa_us=sd * 1e3, speedup=sd / ms)
        res["decode"].append(row)
        print({kk: (round(vv, 2) if isinstance(vv, float) else vv) for kk, vv in row.items()}, flush=True)

    return _write(res, args.out, gpu)


def _write(res, out, gpu):
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{gpu}-nsa.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)
    return res


if __name__ == "__main__":
    t0 = time.time()
    main(sys.argv[1:])
    print(f"total {time.time() - t0:.1f} s")
