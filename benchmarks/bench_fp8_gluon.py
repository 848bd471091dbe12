"""Gluon fp8 forward (`sparsepatch.kernels.fp8_gluon`) vs the Triton fp8 kernel and cuDNN bf16 SDPA, D128 non-causal.

Rows per S: cuDNN bf16 (SDPBackend.CUDNN_ATTENTION), Triton fp8 end to end (`dense.attention_fp8`) and kernel only
(fused q, on `quantize_fp8(..., quantize_q=False)` outputs), Gluon end to end (`attention_fp8_gluon`, quantize
included) and kernel only per config; k/v quantize time alone. do_bench medians; TFLOP/s = 4*B*H*S*S*D / t.
    python benchmarks/bench_fp8_gluon.py --seqs 4096,8192,16384,32768 --out results.json
--compile: offline sm_90 compile (no GPU; registers, spills, loop SASS opcode counts) of the kernel configs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def _bench(fn, rep=200):
    import triton
    return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


DEFAULT_CONFIGS = '[{"stages": 3}, {"ws": true}, {"block_m": 64}, {"block_m": 64, "stages": 2}]'


def rows_for(S, B=1, H=48, D=128, configs=({"stages": 3},)):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sparsepatch.kernels import dense
    from sparsepatch.kernels import fp8_gluon as fg
    g = torch.Generator(device="cuda").manual_seed(S)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    flops = 4.0 * B * H * S * S * D
    out = []

    def row(impl, ms, **kw):
        r = dict(S=S, impl=impl, ms=ms, tflops=flops / ms / 1e9 if ms else None, **kw)
        out.append(r)
        print(json.dumps(r), flush=True)

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2)
        t_cudnn = _bench(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt))
    row("cudnn_bf16", t_cudnn)
    _, _, k8, ks, vt8, vs = dense.quantize_fp8(q, k, v, "int8", quantize_q=False)
    row("quantize_kv", _bench(lambda: dense.quantize_fp8(q, k, v, "int8", quantize_q=False)))
    try:
        o = dense.attention_fp8(q, k, v)
        t = _bench(lambda: dense.attention_fp8(q, k, v))
        row("triton_fp8_e2e", t, x_vs_cudnn=t_cudnn / t, cos=_cos(o, ref))
        t = _bench(lambda: dense._fp8_launch(q, None, k8, ks, vt8, vs, B=B, Sq=S, Hq=H, Sk=S, causal=False,
                                             scale=None, return_lse=False, out_dtype=q.dtype, cfg=None,
                                             qfused=True))
        row("triton_fp8_kernel", t, x_vs_cudnn=t_cudnn / t)
    except Exception as e:  # the other helper edits dense.py at the same time: keep the Gluon rows
        row("triton_fp8", None, error=repr(e)[:300])
    for cfg in configs:
        name = "gluon_" + "_".join(f"{a}{b}" for a, b in cfg.items())
        try:
            o = fg.attention_fp8_gluon(q, k, v, cfg=cfg)
            torch.cuda.synchronize()
            t = _bench(lambda: fg.attention_fp8_gluon(q, k, v, cfg=cfg))
            row(name + "_e2e", t, x_vs_cudnn=t_cudnn / t, cos=_cos(o, ref))
            t = _bench(lambda: fg.attention_fp8_gluon_quantized(q, None, k8, ks, vt8, vs, Sk=S, cfg=cfg))
            row(name + "_kernel", t, x_vs_cudnn=t_cudnn / t)
        except Exception as e:
            row(name, None, error=repr(e)[:300])
    return out


def offline_compile(configs):
    """sm_90 compile without a GPU (Triton 3.6 on PYTHONPATH): registers, spills, loop opcode counts."""
    import re
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from sparsepatch.kernels import fp8_gluon as fg
    res = []
    for cfg in configs:
        ws = cfg.pop("WS", False)
        if cfg.get("BM") == 64:
            cfg["num_warps"] = 4
        k = fg._fp8_gluon_ws_kernel if ws else fg._fp8_gluon_fwd_kernel
        names = k.arg_names
        c = dict(D=128, BM=128, BN=128, STAGES=3, QFUSED=True, WRITE_LSE=False, LOG2_PS=8.0, num_warps=8)
        if ws:
            c.update(num_warps=4, CONSUMER_REGS=240, PRODUCER_REGS=24)
        c.update(cfg)
        ptr = dict(Q="*bf16" if c["QFUSED"] else "*i8", QS="*fp32", K8="*i8", KS="*fp32", VT8="*fp8e4nv",
                   VS="*fp32", O="*bf16", LSE="*fp32")
        sig = {n: ptr.get(n, "constexpr" if n in c else ("fp32" if n == "qk_scale" else "i32")) for n in names}
        div = [n for n in names if sig[n].startswith("*") or n.startswith("stride_") or n == "Sk_pad"]
        src = GluonASTSource(fn=k, signature=sig, constexprs={(names.index(a),): b for a, b in c.items()},
                             attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div})
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=c["num_warps"]))
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(ck.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
        r = dict(cfg=dict(cfg, WS=ws), smem=ck.metadata.shared, usage=re.findall(r"REG:\d+.*?LOCAL:\d+", usage),
                 igmma=sass.count("IGMMA"), qgmma=sass.count("QGMMA"), mufu_ex2=sass.count("MUFU.EX2"),
                 bar_sync=sass.count("BAR.SYNC"), local_mem=sass.count("STL") + sass.count("LDL"))
        print(json.dumps(r), flush=True)
        res.append(r)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="4096,8192,16384,32768")
    ap.add_argument("--heads", type=int, default=48)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="JSON list of Gluon cfg dicts")
    ap.add_argument("--out", default="")
    ap.add_argument("--compile", action="store_true", help="offline sm_90 compile only (no GPU)")
    args = ap.parse_args()
    configs = json.loads(args.configs)
    if args.compile:
        offline_compile([{"STAGES": c.get("stages", 3), "WS": c.get("ws", False), "BM": c.get("block_m", 128)}
                         for c in configs])
        return
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, time=time.strftime("%F %T"),
                B=1, H=args.heads, D=128, causal=False, flops="4*B*H*S*S*D")
    try:
        meta["git"] = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                     text=True).stdout.strip()
    except Exception:
        pass
    rows = []
    for S in (int(x) for x in args.seqs.split(",") if x):
        rows += rows_for(S, H=args.heads, configs=configs)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"\n{'S':>6} {'impl':<28} {'ms':>8} {'TFLOP/s':>8} {'x cuDNN':>8} {'cos':>8}")
    for r in rows:
        ms = f"{r['ms']:.3f}" if r.get("ms") else "ERR"
        tf = f"{r['tflops']:.0f}" if r.get("tflops") else ""
        x = f"{r['x_vs_cudnn']:.3f}" if r.get("x_vs_cudnn") else ""
        c = f"{r['cos']:.5f}" if r.get("cos") else ""
        print(f"{r['S']:>6} {r['impl']:<28} {ms:>8} {tf:>8} {x:>8} {c:>8}")


if __name__ == "__main__":
    main()
