"""Split-D dense flash attention (sparsepatch.kernels.dense.splitd) vs SDPA backends, head dims 128..1024.

B1 H48 S8192 fp16 by default, forward and forward+backward; TFLOP/s counts 4*B*H*Sq*Sk*D per forward (non-causal)
and 2.5x that per backward. Peers in the same process on the same inputs: SDPA efficient, math, flash, cuDNN
(where they run). `--sweep` also times alternative launch configs (FWD_SWEEP / BWD_SWEEP by head dim).
Writes benchmarks/results/<gpu>-dense.json (and $OUT/<gpu>-dense.json when $OUT is set).

    python benchmarks/bench_dense.py [--dims 128,256,320,384,512,768,1024] [--seq 8192] [--heads 48] [--sweep]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

def _f(M, N, BD, DC, NC, w, st, q, qs=3):
    return dict(BLOCK_M=M, BLOCK_N=N, BLOCK_D=BD, DC=DC, NC=NC, num_warps=w, num_stages=st, q=q, qk_stages=qs)


# Forward variants timed with --sweep (the default config of each D is timed in the main row). q: "res" resident Q
# + (K, V) pipelined num_stages deep; "flat" pipelined run-time loop over QK^T chunks; "flat2" one (k-block, chunk)
# ring. fp8: the ws / exp16 / magic switches timed in runs 1-3 were deleted (neutral or slower; benchmarks/NOTES.md).
FWD_SWEEP = {
    256: [_f(128, 64, 128, 64, 4, 8, 2, "res"), _f(128, 32, 128, 64, 4, 8, 2, "res")],
    320: [_f(64, 64, 64, 64, 5, 8, 2, "res"), _f(128, 32, 64, 64, 5, 8, 3, "res")],
    384: [_f(128, 32, 64, 64, 6, 8, 2, "res"), _f(128, 32, 128, 64, 3, 8, 2, "res")],
    1024: [_f(128, 64, 128, 256, 1, 8, 1, "flat2", 4)],
}
# Backward (materialised P / dS): _pds_kernel tile and pipeline depth, P / dS scratch budget (MiB). Runs 1-2 swept
# stages 2 / BLOCK_D 32 x 4 stages / BLOCK_N 64 / 2 GiB at D 320, 512, 1024 (benchmarks/NOTES.md).
BWD_SWEEP = {}
# fp8 rows (int8 Q K^T; e4m3 Q K^T misses cos 0.999 and is not timed): the default (64-row programs, one warpgroup)
# and the 128-row programs of two warpgroups (default before fp8 session 6). Session 6 also timed (deleted): the
# old quantize path, two key blocks per iteration, 2 stages, maxnreg 168 (benchmarks/NOTES.md).
FP8_SWEEP = [dict(qk_format="int8", cfg=dict()), dict(qk_format="int8", cfg=dict(block_m=128, num_warps=8))]


def _gpu_name():
    n = torch.cuda.get_device_name().lower()
    return "h100" if "h100" in n else "h200" if "h200" in n else n.replace(" ", "-")


def _bench(fn, rep=40):
    import triton
    try:
        return float(triton.testing.do_bench(fn, warmup=5, rep=rep))
    except Exception as exc:  # noqa: BLE001 (a peer that does not run this shape)
        import traceback
        traceback.print_exc(limit=2)
        msg = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return msg


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
          "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run(q, k, v):
        with sdpa_kernel([be]):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return run


def _time_pair(attn, q, k, v, do, with_bwd=True):
    """(fwd ms, fwd+bwd ms) of attn(q, k, v) on (B, S, H, D) tensors."""
    with torch.no_grad():
        f = _bench(lambda: attn(q, k, v))
    fb = None
    if with_bwd and not isinstance(f, str):
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))

        def step():
            o = attn(qg, kg, vg)
            torch.autograd.grad(o, (qg, kg, vg), do if o.shape == do.shape else do.transpose(1, 2))
        fb = _bench(step)
    return f, fb


def _prewarm(dims, H, S, sweep, fp8_seqs=()):
    """Compile every kernel config in parallel processes (Triton's disk cache is shared) to save wall time."""
    import multiprocessing as mp
    tasks = []
    for D in dims:
        tasks.append((D, H, None, None))
        if sweep:
            tasks += [(D, H, dict(c, strict=True), None) for c in FWD_SWEEP.get(D, [])]
            tasks += [(D, H, None, c) for c in BWD_SWEEP.get(D, [])]
    if fp8_seqs:
        tasks += [("fp8", H, f, None) for f in FP8_SWEEP]
    ctx = mp.get_context("spawn")
    with ctx.Pool(min(14, len(tasks))) as pool:
        for r in pool.imap_unordered(_warm_one, tasks):
            print("prewarm", r, flush=True)


def _warm_one(task):
    D, H, fcfg, bcfg = task
    t0 = time.time()
    try:
        from sparsepatch.kernels.dense import fp8, splitd as dense
        if D == "fp8":
            q, k, v = (torch.randn(1, 256, H, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            fp8.attention_fp8(q, k, v, qk_format=fcfg["qk_format"], cfg=fcfg["cfg"])
            fp8.attention_fp8(q, k, v, qk_format=fcfg["qk_format"], cfg=fcfg["cfg"], causal=True)
            torch.cuda.synchronize()
            return (D, "ok", round(time.time() - t0, 1))
        q, k, v = (torch.randn(1, 128, H, D, device="cuda", dtype=torch.float16) for _ in range(3))
        if fcfg is not None:
            dense._fwd_impl(q, k, v, False, D ** -0.5, False, cfg=fcfg)
        elif bcfg is not None:
            o, lse = dense._fwd_impl(q, k, v, False, D ** -0.5, True)
            dense._bwd_impl(q, k, v, o, lse, torch.randn_like(o), None, False, D ** -0.5, cfg=bcfg)
        else:
            dense._fwd_impl(q, k, v, False, D ** -0.5, False)
            o, lse = dense._fwd_impl(q, k, v, False, D ** -0.5, True)
            dense._bwd_impl(q, k, v, o, lse, torch.randn_like(o), None, False, D ** -0.5)
        torch.cuda.synchronize()
        return (D, "ok", round(time.time() - t0, 1))
    except Exception as exc:  # noqa: BLE001
        return (D, f"error {str(exc)[:200]}", round(time.time() - t0, 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="128,256,320,384,512,768,1024")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=48)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--peers", default="efficient,math,flash,cudnn")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-prewarm", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--fp8", default="", help="sequence lengths for the fp8 vs cuDNN bf16 rows at D128 (e.g. 8192)")
    ap.add_argument("--fp8-rounds", type=int, default=0,
                    help="interleaved timing rounds per fp8 S (default 5, 3 at 32K)")
    ap.add_argument("--prewarm-only", action="store_true")
    args = ap.parse_args(argv)
    from sparsepatch.kernels.dense import fp8, splitd as dense

    dims = [int(x) for x in args.dims.split(",") if x]  # --dims "": the fp8 rows only
    B, S, H = args.batch, args.seq, args.heads
    dt = torch.float16
    fp8_seqs = [int(x) for x in args.fp8.split(",") if x]
    if not args.no_prewarm:
        _prewarm(dims, H, S, args.sweep, fp8_seqs)
    if args.prewarm_only:
        return None
    gpu = _gpu_name()
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, shape=dict(B=B, S=S, H=H), dtype="fp16",
               flops="fwd 4*B*H*S*S*D, bwd 2.5x fwd", rows=[], sweep=[], fp8=[])
    out_dirs = [os.path.join(ROOT, "benchmarks", "results")] + ([os.environ["OUT"]] if os.environ.get("OUT") else [])
    if args.out:
        out_dirs.append(args.out)

    def dump():
        for d in out_dirs:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"{gpu}-dense.json"), "w") as f:
                json.dump(res, f, indent=1)

    for D in dims:
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=dt) for _ in range(4))
        fl = 4 * B * H * S * S * D
        row = dict(D=D)
        ours = lambda q_, k_, v_: dense.attention(q_, k_, v_)  # noqa: E731
        row["ours_fwd_ms"], row["ours_fwdbwd_ms"] = _time_pair(ours, q, k, v, do)
        o, lse = dense._fwd_impl(q, k, v, False, D ** -0.5, True)
        row["ours_bwd_ms"] = _bench(lambda: dense._bwd_impl(q, k, v, o, lse, do, None, False, D ** -0.5))
        del o, lse
        for peer in args.peers.split(","):
            if peer == "math" and D > 512:
                f, fb = _time_pair(_sdpa(peer), q, k, v, do, with_bwd=False)
            else:
                f, fb = _time_pair(_sdpa(peer), q, k, v, do)
            row[f"{peer}_fwd_ms"], row[f"{peer}_fwdbwd_ms"] = f, fb
        for key in list(row):
            if key.endswith("_ms") and isinstance(row[key], float):
                mult = 3.5 if "fwdbwd" in key else 2.5 if "_bwd_" in key else 1.0
                row[key.replace("_ms", "_tflops")] = round(fl * mult / row[key] * 1e-9, 1)
        for peer in args.peers.split(","):
            for kind in ("fwd", "fwdbwd"):
                a, b = row.get(f"ours_{kind}_ms"), row.get(f"{peer}_{kind}_ms")
                if isinstance(a, float) and isinstance(b, float):
                    row[f"x_vs_{peer}_{kind}"] = round(b / a, 2)
        row["configs"] = {"|".join(map(str, k_)): v_ for k_, v_ in dense.RESOLVED.items() if k_[1] == D}
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        dump()
        if args.sweep:
            for c in FWD_SWEEP.get(D, []):
                c = dict(c, strict=True)
                with torch.no_grad():
                    t = _bench(lambda: dense._fwd_impl(q, k, v, False, D ** -0.5, False, cfg=c))
                e = dict(D=D, kind="fwd", cfg=c, ms=t, tflops=round(fl / t * 1e-9, 1) if isinstance(t, float) else None)
                res["sweep"].append(e)
                print(json.dumps(e), flush=True)
            if BWD_SWEEP.get(D):
                o, lse = dense._fwd_impl(q, k, v, False, D ** -0.5, True)
                for c in BWD_SWEEP[D]:
                    t = _bench(lambda: dense._bwd_impl(q, k, v, o, lse, do, None, False, D ** -0.5, cfg=c))
                    e = dict(D=D, kind="bwd", cfg=c, ms=t,
                             tflops=round(2.5 * fl / t * 1e-9, 1) if isinstance(t, float) else None)
                    res["sweep"].append(e)
                    print(json.dumps(e), flush=True)
                t = _bench(lambda: dense._bwd_impl(q, k, v, o, lse, do, None, False, D ** -0.5))
                e = dict(D=D, kind="bwd", cfg="default", ms=t,
                         tflops=round(2.5 * fl / t * 1e-9, 1) if isinstance(t, float) else None)
                res["sweep"].append(e)
                print(json.dumps(e), flush=True)
            dump()
        del q, k, v, do
        torch.cuda.empty_cache()
    for S8 in fp8_seqs:
        res["fp8"] += _fp8_rows(B, S8, H, rounds=args.fp8_rounds or None)
        dump()
    _table(res)
    return res


def _cos(a, b):
    return float(F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def _fp8_quant_bytes(B, S, H, D, with_q):
    """Fewest bytes `quantize_fp8` moves (q/k read 2 B + write 1 B per element, v read twice + written once)."""
    n = B * S * H * D
    return n * (3 + 3 * with_q + 5)


def _fp8_rows(B, S, H, D=128, rounds=None):
    """fp8/int8 forward vs cuDNN bf16 at head dim D (B1 H48 by default, bf16, non-causal): the quantize pass alone
    (with and without q; ms and TB/s of its fewest bytes), then per FP8_SWEEP variant the end-to-end
    call and the kernel alone on the quantize outputs (the same path: fused q or q8), cos-sim vs cuDNN bf16.
    Every timer runs once per round, `rounds` rounds interleaved (the H100's clock drifts by a few % between
    back-to-back timings of one kernel: run 1 of fp8 session 6); rows give the median and the min / max."""
    import statistics
    from sparsepatch.kernels.dense import fp8, splitd as dense
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fl = 4 * B * H * S * S * D
    rounds = rounds or (5 if S <= 16384 else 3)
    cud = _sdpa("cudnn")
    timers = {("cudnn_bf16", None): lambda: cud(q, k, v)}
    for with_q in (False, True):
        timers[("quant", with_q)] = lambda with_q=with_q: fp8.quantize_fp8(q, k, v, "int8", quantize_q=with_q)
    prep = {}
    for i, v8 in enumerate(FP8_SWEEP):
        fmt, cfg = v8["qk_format"], v8["cfg"]
        c = fp8._fp8_cfg(cfg)
        timers[("e2e", i)] = lambda fmt=fmt, cfg=cfg: fp8.attention_fp8(q, k, v, qk_format=fmt, cfg=cfg)
        if c["fuse_q"] not in prep:  # one set of quantize outputs per q path
            prep[c["fuse_q"]] = fp8.quantize_fp8(q, k, v, fmt, quantize_q=not c["fuse_q"])
        q8, qs, k8, ks, vt8, vs = prep[c["fuse_q"]]
        timers[("kernel", i)] = (lambda cfg=cfg, c=c, q8=q8, qs=qs, k8=k8, ks=ks, vt8=vt8, vs=vs: fp8._fp8_launch(
            q if c["fuse_q"] else q8, qs, k8, ks, vt8, vs, B=B, Sq=S, Hq=H, Sk=S, causal=False, scale=None,
            return_lse=False, out_dtype=q.dtype, cfg=cfg, qfused=c["fuse_q"]))
    times = {key: [] for key in timers}
    with torch.no_grad():
        for _ in range(rounds):
            for key, fn in timers.items():
                times[key].append(_bench(fn, rep=30))
    med = {key: statistics.median(t) if all(isinstance(x, float) for x in t) else t[0] for key, t in times.items()}

    def spread(key):
        t = times[key]
        return dict(ms_min=min(t), ms_max=max(t)) if all(isinstance(x, float) for x in t) else {}
    t_ref = med[("cudnn_bf16", None)]
    rows = [dict(S=S, D=D, impl="cudnn_bf16", ms=t_ref, tflops=round(fl / t_ref * 1e-9, 1), rounds=rounds,
                 **spread(("cudnn_bf16", None)))]
    print(json.dumps(rows[-1]), flush=True)
    for with_q in (False, True):
        t = med[("quant", with_q)]
        rows.append(dict(S=S, D=D, impl="quant", with_q=with_q, ms=t, **spread(("quant", with_q)),
                         tb_s=round(_fp8_quant_bytes(B, S, H, D, with_q) / t * 1e-9, 2)))
        print(json.dumps(rows[-1]), flush=True)
    with torch.no_grad():
        ref = cud(q, k, v).transpose(1, 2)
        refc = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)
        for i, v8 in enumerate(FP8_SWEEP):
            fmt, cfg = v8["qk_format"], v8["cfg"]
            c = fp8._fp8_cfg(cfg)
            t, tk = med[("e2e", i)], med[("kernel", i)]
            try:
                out = fp8.attention_fp8(q, k, v, qk_format=fmt, cfg=cfg)
                outc = fp8.attention_fp8(q, k, v, qk_format=fmt, cfg=cfg, causal=True)
                r = dict(S=S, D=D, impl=f"ours_{fmt}", cfg=cfg, ms=t, **spread(("e2e", i)),
                         tflops=round(fl / t * 1e-9, 1), kernel_ms=tk,
                         kernel_spread=[round(x, 4) for x in spread(("kernel", i)).values()],
                         kernel_tflops=round(fl / tk * 1e-9, 1),
                         quant_ms=med[("quant", not c["fuse_q"])],
                         x_vs_cudnn=round(t_ref / t, 3), kernel_x_vs_cudnn=round(t_ref / tk, 3),
                         cos_vs_bf16=round(_cos(out, ref), 6), cos_vs_bf16_causal=round(_cos(outc, refc), 6),
                         rel_vs_bf16=float((out.float() - ref.float()).norm() / ref.float().norm()))
            except Exception as exc:  # noqa: BLE001
                r = dict(S=S, D=D, impl=f"ours_{fmt}", cfg=cfg, error=str(exc)[:300])
            rows.append(r)
            print(json.dumps(r), flush=True)
    del q, k, v, prep
    torch.cuda.empty_cache()
    return rows


def _table(res):
    print("\nD | ours fwd TF | eff fwd TF | x | ours f+b TF | eff f+b TF | x | ours bwd TF")
    for r in res["rows"]:
        print(r["D"], r.get("ours_fwd_tflops"), r.get("efficient_fwd_tflops"), r.get("x_vs_efficient_fwd"),
              r.get("ours_fwdbwd_tflops"), r.get("efficient_fwdbwd_tflops"), r.get("x_vs_efficient_fwdbwd"),
              r.get("ours_bwd_tflops"), sep=" | ")
    best = {}
    for e in res["sweep"]:
        if e["kind"] == "fwd" and e.get("tflops") and e["tflops"] > best.get(e["D"], (0,))[0]:
            best[e["D"]] = (e["tflops"], {k: v for k, v in e["cfg"].items() if k != "strict"})
    for D, (t, c) in sorted(best.items()):
        print("best sweep fwd", D, t, json.dumps(c))
    for e in res["sweep"]:
        if e["kind"] == "bwd":
            print("bwd", e["D"], e.get("tflops"), json.dumps(e["cfg"]))
    if res["fp8"]:
        print("\nfp8 S | impl | cfg | ms | TB/s or TFLOP/s | kernel ms | kernel TF | x cuDNN (e2e / kernel) | cos | "
              "cos causal")
    for r in res["fp8"]:
        cfg = r.get("cfg", r.get("with_q", ""))
        cfg = json.dumps(cfg, separators=(",", ":")) if isinstance(cfg, dict) else f"with_q={cfg}" if cfg != "" else ""
        ms = r.get("ms")
        print("fp8", r.get("S"), r.get("impl"), cfg, round(ms, 4) if isinstance(ms, float) else ms,
              r.get("tb_s", r.get("tflops")), r.get("kernel_ms") and round(r["kernel_ms"], 4), r.get("kernel_tflops"),
              f"{r.get('x_vs_cudnn')} / {r.get('kernel_x_vs_cudnn')}" if "x_vs_cudnn" in r else "",
              r.get("cos_vs_bf16"), r.get("cos_vs_bf16_causal"),
              r.get("error", "")[:80], sep=" | ")


if __name__ == "__main__":
    main(sys.argv[1:])
