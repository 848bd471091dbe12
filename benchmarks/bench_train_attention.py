"""Training attention (forward + backward) at the dispatcher's prefill cells, every backend in one process.

  python benchmarks/bench_train_attention.py [--dims 64,128] [--seqs 1024,4096,16384,32768] [--layouts seq,head]
                                             [--tokens 16384] [--forward]
                                             [--dtypes bfloat16] [--rep 200] [--tag=-s17] [--out DIR]

1. Gradient check (bf16 at D 64 / 128 and fp16 at D 128, S 1K-2K, MHA and GQA 4, causal or not): `flash_cudnn_bwd`
   (our flash forward + torch's cuDNN backward) vs an fp32 oracle (relative rms of out, dq, dk, dv against the
   error model's bound, tests/kernel_checks.attention_rel_bound) and vs SDPA cuDNN's own gradients.
2. Every backend that runs a call needing gradients (`kernels.tuning.measure(grad=True)`: the time of forward +
   backward of a fixed dO, do_bench medians) at B * S = 16K (B = 1 at 32K), 32 heads, MHA / GQA 4, causal or not,
   on sequence-major and head-major inputs (`--tokens` sets B * S; `--forward` also times the forward alone): cost-
   table entries of op "attention+backward"
   ({"entries": {"train": [...]}}, merged into the shipped table by `update_cost_table.py RESULTS train "why"`).
Prints ours / best SDPA per cell last; JSON: results/<gpu>-train-attention<tag>.json.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from common import gpu_name, save_results  # noqa: E402

from sparsepatch.kernels import tuning  # noqa: E402
from sparsepatch.kernels.dense import op as dense_op  # noqa: E402
from sparsepatch.kernels.dense import reference  # noqa: E402

SDPA = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa")
OURS = ("flash_cudnn_bwd", "flash_triton")
# sdpa_flash / sdpa_efficient measured 1.6x / 3.5-4x sdpa_cudnn's fwd+bwd at every H200 cell (results/h200-train-
# attention-s17.json): --all-sdpa times them again


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def grad_checks(log) -> list:
    from kernel_checks import attention_rel_bound
    rows = []
    cases = [(torch.bfloat16, D, causal, hh, S) for D, causal, hh, S in
             itertools.product((64, 128), (False, True), ((8, 8), (8, 2)), (1024, 2048))]
    cases += [(torch.float16, 128, causal, (8, 2), 2048) for causal in (False, True)]
    for dtype, D, causal, (Hq, Hk), S in cases:
        g = torch.Generator(device="cuda").manual_seed(S + D)
        q, k, v = (torch.randn(1, S, H, D, device="cuda", dtype=dtype, generator=g) for H in (Hq, Hk, Hk))
        do = torch.randn(1, S, Hq, D, device="cuda", dtype=dtype, generator=g)
        got = {}
        try:
            for name in ("flash_cudnn_bwd", "sdpa_cudnn"):
                b = dense_op.DISPATCH.backends[name]
                qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
                out = b.run(qq, kk, vv, causal=causal, scale=None, attn_mask=None, return_lse=False)
                got[name] = (out, *torch.autograd.grad(out, (qq, kk, vv), do))
        except Exception as exc:  # noqa: BLE001  (recorded: a shape cuDNN's backward does not take)
            rows.append(dict(dtype=str(dtype), D=D, causal=causal, Hq=Hq, Hk=Hk, S=S, ok=False,
                             error=f"{name}: {type(exc).__name__}: {str(exc)[:300]}"))
            log(f"  grad {str(dtype)[6:]} D{D} causal={causal} {Hq}/{Hk} S{S}: {rows[-1]['error']}")
            continue
        qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
        out_f = reference.attention(qf, kf, vf, causal=causal)
        want = (out_f, *torch.autograd.grad(out_f, (qf, kf, vf), do.float()))
        bound = attention_rel_bound(q, k, v)
        errs = {n: [_rel(a, w) for a, w in zip(got[n], want)] for n in got}
        agree = [_rel(a, b) for a, b in zip(got["flash_cudnn_bwd"], got["sdpa_cudnn"])]
        ok = max(errs["flash_cudnn_bwd"]) <= bound
        rows.append(dict(dtype=str(dtype), D=D, causal=causal, Hq=Hq, Hk=Hk, S=S, bound=bound, ok=ok,
                         rel_out_dq_dk_dv=errs, rel_vs_sdpa_cudnn=agree))
        log(f"  grad {str(dtype)[6:]} D{D} causal={causal} {Hq}/{Hk} S{S}: ours "
            + " ".join(f"{e:.2e}" for e in errs["flash_cudnn_bwd"]) + " cudnn "
            + " ".join(f"{e:.2e}" for e in errs["sdpa_cudnn"]) + f" bound {bound:.2e} {'ok' if ok else 'FAIL'}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqs", default="1024,4096,16384,32768")
    ap.add_argument("--tokens", type=int, default=tuning.TOKENS, help="B * S per cell (B = max(tokens // S, 1))")
    ap.add_argument("--forward", action="store_true",
                    help="also the forward alone (flash_triton vs SDPA) at the same cells: entries['forward']")
    ap.add_argument("--layouts", default="seq,head")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--all-sdpa", action="store_true", help="also sdpa_flash and sdpa_efficient")
    ap.add_argument("--ours", default=",".join(OURS), help="our backends to time, comma-separated")
    ap.add_argument("--rep", type=int, default=200, help="do_bench time budget per backend and cell, ms")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    log = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.time()
    checks = [] if args.no_check else grad_checks(log)
    dims = [int(x) for x in args.dims.split(",")]
    seqs = [int(x) for x in args.seqs.split(",")]
    dtypes = [getattr(torch, x) for x in args.dtypes.split(",")]
    cells = [(max(args.tokens // c[1], 1),) + c[1:]
             for c in tuning.default_cells(dtypes=tuple(dtypes), head_dims=tuple(dims)) if c[1] in seqs]
    sdpa = SDPA if args.all_sdpa else ("sdpa_cudnn", "sdpa")
    names = [b.name for b in dense_op.BACKENDS if b.name in tuple(args.ours.split(",")) + sdpa]
    entries = []
    for layout in args.layouts.split(","):   # results saved after each layout
        entries += tuning.measure(cells, backends=names, log=log, layout=layout, grad=True, rep=args.rep)
        res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, checks=checks,
                   entries={"train": entries}, seconds=round(time.time() - t0, 1))
        save_results(res, f"{gpu_name()}-train-attention{args.tag}.json", args.out)
        log(f"{layout}: {len(entries)} cells in {time.time() - t0:.0f} s")
    if args.forward:
        fwd = []
        for layout in args.layouts.split(","):
            fwd += tuning.measure(cells, backends=["flash_triton", *sdpa], log=log, layout=layout, rep=args.rep)
        res["entries"]["forward"] = fwd
        save_results(res, f"{gpu_name()}-train-attention{args.tag}.json", args.out)
        for e in fwd:
            log(f"forward {e.get('layout', 'seq')} causal={e['causal']} D{e['D']} {e['Hq']}/{e['Hq'] // e['group']} "
                f"{e['B']}x{e['Sq']}: " + " ".join(f"{n} {t:.3f}" for n, t in e["ms"].items()))
    log("\n| layout | causal | D | Hq/Hk | B x S | flash_cudnn_bwd | flash_triton | best SDPA | ours / best SDPA |")
    log("|---|---|---|---|---|---|---|---|---|")
    for e in entries:
        ms = e["ms"]
        sd = {n: ms[n] for n in SDPA if n in ms}
        best = min(sd, key=sd.get) if sd else None
        ours = ms.get("flash_cudnn_bwd")
        ratio = f"{sd[best] / ours:.3f}" if best and ours else "-"
        log(f"| {e.get('layout', 'seq')} | {e['causal']} | {e['D']} | {e['Hq']}/{e['Hq'] // e['group']} | "
            f"{e['B']}x{e['Sq']} | {ours or float('nan'):.3f} | {ms.get('flash_triton', float('nan')):.3f} | "
            f"{best} {sd.get(best, float('nan')):.3f} | {ratio} |")
    if checks:
        log(f"gradient checks: {sum(r['ok'] for r in checks)} of {len(checks)} within the bound")
    return 0


if __name__ == "__main__":
    sys.exit(main())
