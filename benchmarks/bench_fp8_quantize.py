"""k/v quantize pass of the fp8 attention paths (`dense.fp8.quantize_fp8(..., quantize_q=False)`, what
`attention_fp8` and the fp8 skip calls run before their kernel), old vs new in one process, bf16, CUDA only:
B1 H12 S32760 D128 (Wan2.1-1.3B self-attention; S % 16 = 8) and B2 H24 S17776 D64 (S % 16 = 0).

"old" = the first launch as before + the V^T kernel of before (2-D grid, store mask s < S: one-byte stores when
S % 16 != 0; its source is copied below). "new" = `quantize_fp8`. Every timer
runs once per round, rounds interleaved, medians of the rounds; each cell is triton do_bench's median of CUDA-graph
replays (device time, L2 flushed between replays); the two launches alone ("kqv", "vt_old", "vt_new"); and 100
eager calls back to back (host ms per call, and wall ms per call once the device has finished them). GB/s = the
fewest bytes (read k, v, v again; write k8, vt8) / time. Asserts that the new outputs are bitwise the old ones (vt8
up to Sk), that they dequantize to `quantize_fp8_reference`'s, and that the new vt8 padding columns are zero.

Prediction (written before any GPU run; H200, B1 H12 S32760 D128, 402 MB): old 0.29 ms = kqv ~0.075 + vt_old
~0.21 (vt_old's byte stores: 16x the L2 write transactions); new: kqv unchanged, vt_new ~0.04 ms (151 MB at ~3.8
TB/s; 40 registers, up to 6 programs per SM) -> 0.11-0.12 ms (~3.5 TB/s, 2.4-2.6x old). (Session 14 also timed a
reversed V^T order with L2 eviction hints: within 2% of "new", deleted.) B2 H24 S17776 D64 (S % 16 = 0, old stores already
16-byte): 1.0-1.15x old. Host time per eager call ~20-30 us less (launch plans for both launches).

    python benchmarks/bench_fp8_quantize.py [--rounds 3]
    (JSON: benchmarks/results/<gpu>-fp8-quantize.json and $OUT/bench_fp8_quantize.json)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

from common import ROOT, gpu_name, graph_replay, save_results

from sparsepatch.kernels.dense import fp8 as dense  # noqa: E402

SHAPES = [(1, 32760, 12, 128), (2, 17776, 24, 64)]   # (B, S, H, D), k and v (B, S, H, D) bf16


@triton.jit
def _old_vt_kernel(X, Y, SC, VAMAX, stride_b, stride_s, stride_h, S, S_pad, H, D: tl.constexpr, BS: tl.constexpr):
    # the V^T pass before this change (2-D grid, stores masked at S), for the A/B only
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    offs_d = tl.arange(0, D)
    rows = pid * BS + tl.arange(0, BS)
    ok = rows < S
    x = tl.load(X + b * stride_b + h * stride_h + rows[None, :] * stride_s + offs_d[:, None], mask=ok[None, :],
                other=0.0).to(tl.float32)
    amax = tl.load(VAMAX + bh.to(tl.int64) * D + offs_d).to(tl.float32, bitcast=True)
    sc = tl.maximum(amax, 1e-30) * dense.FP8_INV_MAX_C
    if pid == 0:
        tl.store(SC + bh.to(tl.int64) * D + offs_d, sc)
    inv = dense._recip_rn(sc)
    y = dense._mul_rn(x, tl.zeros_like(x) + inv[:, None]).to(Y.dtype.element_ty)
    tl.store(Y + (bh.to(tl.int64) * D + offs_d[:, None]) * S_pad + rows[None, :], y, mask=ok[None, :])


class Bufs:
    """Preallocated outputs of one quantize call (so graph replays and the per-launch timers write the same
    buffers)."""

    def __init__(self, k, v):
        B, S, H, D = k.shape
        dev = k.device
        self.nkb = triton.cdiv(S, dense.FP8_BLOCK)
        self.s_pad = -(-S // 16) * 16
        self.k8 = torch.empty((B, H, S, D), dtype=torch.int8, device=dev)
        self.ks = torch.empty((B, H, self.nkb), dtype=torch.float32, device=dev)
        self.vt = torch.empty((B, H, D, self.s_pad), dtype=torch.float8_e4m3fn, device=dev)
        self.vamax = torch.zeros((B, H, D), dtype=torch.int32, device=dev)
        self.vs = torch.empty((B, H, D), dtype=torch.float32, device=dev)


def kqv(k, v, o):
    B, S, H, D = k.shape
    n_k = o.nkb * B * H
    dense._fp8_quant_kqv_kernel[(n_k,)](
        k, v, k, o.k8, o.ks, o.vamax, o.k8, o.ks, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), k.stride(0), k.stride(1), k.stride(2), S, S, H, H, o.nkb, o.nkb, n_k,
        D=D, BLK=dense.FP8_BLOCK, QINV=dense._QINV["int8"], INT8=True, num_warps=8)


def vt_old(v, o):
    B, S, H, D = v.shape
    _old_vt_kernel[(triton.cdiv(S, 128), B * H)](v, o.vt, o.vs, o.vamax, v.stride(0), v.stride(1), v.stride(2), S,
                                                 o.s_pad, H, D=D, BS=128, num_warps=8)


def old_quantize(k, v, o):
    o.vamax.zero_()
    kqv(k, v, o)
    vt_old(v, o)


def median_ms(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def run_shape(B, S, H, D, rounds, log):
    g = torch.Generator(device="cuda").manual_seed(S)
    k, v = (torch.randn(B, S, H, D, generator=g, device="cuda").bfloat16() for _ in range(2))
    k[:, 0::128, :, 0] = 6.0         # each k block's amax (|randn| > 6: ~2e-9 per element) ...
    k[:, 1::128, :, 1] = 3.0         # ... and amax / 2: the int8 rounding tie y = 63.5
    n = B * S * H * D
    s_pad = -(-S // 16) * 16
    nbytes = n * 2 * 3 + n + B * H * D * s_pad
    # correctness first: old vs new (raw bits), new vs the torch model
    ob = Bufs(k, v)
    ob.vt.fill_(1.0)
    old_quantize(k, v, ob)
    _, _, k8, ks, vt, vs = dense.quantize_fp8(k, k, v, "int8", quantize_q=False)
    checks = {"new": dict(
        k8=torch.equal(k8, ob.k8), ks=torch.equal(ks, ob.ks),
        vt=torch.equal(vt[..., :S].view(torch.uint8), ob.vt[..., :S].view(torch.uint8)),
        vs=torch.equal(vs, ob.vs), vt_pad_zero=bool((vt[..., S:].view(torch.uint8) == 0).all()))}
    _, kd, vd = dense.quantize_fp8_reference(k[:, :1], k, v, "int8")
    checks["model"] = dict(
        k=torch.equal((k8.float() * ks.repeat_interleave(128, -1)[..., :S, None]).transpose(1, 2), kd),
        v=torch.equal((vt.float()[..., :S] * vs[..., None]).permute(0, 3, 1, 2), vd))
    del kd, vd, k8, ks, vt, vs
    bad = {n: c for n, c in checks.items() if not all(c.values())}
    log(f"B{B} H{H} S{S} D{D}: bit checks {'all equal' if not bad else bad}")
    assert not bad, bad

    nb = Bufs(k, v)
    timers = {"old": graph_replay(lambda: old_quantize(k, v, ob)),
              "new": graph_replay(lambda: dense.quantize_fp8(k, k, v, "int8", quantize_q=False))}
    timers["kqv"] = graph_replay(lambda: kqv(k, v, nb))
    timers["vt_old"] = graph_replay(lambda: vt_old(v, nb))
    timers["vt_new"] = graph_replay(lambda: dense._launch_vt(v, nb.vt, nb.vs, nb.vamax))
    ms = {name: [] for name in timers}
    for _ in range(rounds):
        for name, fn in timers.items():
            ms[name].append(median_ms(fn))
    med = {name: statistics.median(x) for name, x in ms.items()}
    # eager calls back to back: host time per call (Python + launches, no sync) and the rate when host and device
    # overlap (max of the two)
    for _ in range(3):
        dense.quantize_fp8(k, k, v, "int8", quantize_q=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):
        dense.quantize_fp8(k, k, v, "int8", quantize_q=False)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    host = dict(host_ms_per_call=(t1 - t0) * 10, eager_ms_per_call=(t2 - t0) * 10)
    bytes_vt = n * 2 + B * H * D * s_pad
    bytes_kqv = n * 2 * 2 + n
    row = dict(shape=dict(B=B, S=S, H=H, D=D), bytes=nbytes, ms=med, rounds=ms,
               gbps={name: (nbytes if name not in ("kqv", "vt_old", "vt_new") else
                            bytes_kqv if name == "kqv" else bytes_vt) / (t * 1e-3) / 1e9 for name, t in med.items()},
               checks=checks, **host)
    for name, t in med.items():
        log(f"  {name:11s} {t:7.4f} ms  {row['gbps'][name]:7.0f} GB/s" + (
            f"  ({med['old'] / t:4.2f}x old)" if name == "new" else ""))
    log(f"  eager calls: host {host['host_ms_per_call']:.4f} ms/call, back to back {host['eager_ms_per_call']:.4f} "
        "ms/call")
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description="the fp8 k/v quantize pass: old vs new V^T kernel, GB/s, bit checks")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_quantize: needs CUDA")
        return 1
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    log(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    rows = [run_shape(*shape, args.rounds, log) for shape in SHAPES]
    res = dict(device=torch.cuda.get_device_name(), triton=triton.__version__, torch=torch.__version__,
               rows=rows, log=lines)
    save_results(res, f"{gpu_name()}-fp8-quantize.json", os.path.join(ROOT, "benchmarks", "results"))
    save_results(res, "bench_fp8_quantize.json", None)


if __name__ == "__main__":
    sys.exit(main())
