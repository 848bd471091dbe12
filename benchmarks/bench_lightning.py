"""Lightning attention decode / prefill: sparsepatch Triton vs fla (fused_recurrent / chunk_simple_gla) vs torch.

    python benchmarks/bench_lightning.py [--quick] [--sweep] [--out DIR]

Decode: H=64, K=V=128, bf16 q/k/v, fp32 state (B, H, K, V), B in 1..256. Bandwidth = state bytes read + written
(2 * B*H*K*V*4) / time, against a device-to-device copy ceiling measured in the same run. Eager times are
triton.testing.do_bench medians (L2 flushed before each call, host launch time included when it dominates);
graph times are one CUDA graph of `steps` decode calls cycling over enough state buffers to defeat L2, / steps.
Prefill: B=1, H=64, K=V=128 bf16, MiniMax layer-0 slopes, T = 1K..32K, with final state, vs fla chunk_simple_gla.
Writes <out>/<gpu>-lightning.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sparsepatch.kernels.lightning import reference as ref  # noqa: E402
from common import host_ms  # noqa: E402

H, D = 64, 128
DECODE_B = [1, 4, 16, 32, 64, 128, 256]
PREFILL_T = [1024, 2048, 4096, 8192, 16384, 32768]


def _bench(fn, rep=200):
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3   # us


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def minimax_slopes(h=H, layer=0, layers=80):
    base = 1 / (2 ** (8 / h))
    rate = base ** (torch.arange(h) + 1.0)
    return (rate * (1 - layer / (layers - 1 + 1e-5) + 1e-5)).float()


def copy_ceiling():
    n = 1 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    us = _bench(lambda: y.copy_(x), rep=300)
    return 2 * n / (us * 1e-6) / 1e12, us


def load_fla():
    try:
        from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
        return chunk_simple_gla, fused_recurrent_simple_gla, None
    except Exception as exc:  # noqa: BLE001
        return None, None, f"{type(exc).__name__}: {exc}"


def graph_time(step_fns, steps):
    """us per step for a CUDA graph of `steps` calls cycling over step_fns (each a zero-arg call on its buffers)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in step_fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(steps):
            step_fns[i % len(step_fns)]()
    g.replay()
    torch.cuda.synchronize()
    return _bench(g.replay, rep=300) / steps


def host_time(fn, n=2000):
    """Host us per call of fn (`common.host_ms` after 50 warm-up calls)."""
    return host_ms(fn, n, warmup=50) * 1e3


def bench_decode(fused_recurrent, batches, graph=True):
    from sparsepatch.kernels.lightning import triton as tri
    rows = []
    decay = minimax_slopes().cuda()
    for B in batches:
        g = torch.Generator(device="cuda").manual_seed(B)
        q, k, v = (torch.randn(B, 1, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
        state_bytes = B * H * D * D * 4
        nbuf = min(40, max(1, math.ceil((160 << 20) / state_bytes)))    # >= 160 MiB: 3x the 50 MB L2
        states = [torch.randn(B, H, D, D, device="cuda", generator=g) * 0.1 for _ in range(nbuf)]
        out = torch.empty(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
        row = {"B": B, "state_MB": state_bytes / 1e6}
        # correctness against the reference (one step)
        s_ref, s_tri = states[0].clone(), states[0].clone()
        for _ in range(2):                               # the second call relaunches the cached kernel directly
            o_ref = ref.lightning_decode(q, k, v, s_ref, decay, scale=1.0)
            o_tri = tri.lightning_decode(q, k, v, s_tri, decay, scale=1.0)
        row["rel_err_out"], row["rel_err_state"] = _rel(o_tri, o_ref), _rel(s_tri, s_ref)
        del s_ref, s_tri

        row["ours_us"] = _bench(lambda: tri.lightning_decode(q, k, v, states[0], decay, scale=1.0))
        row["ours_out_us"] = _bench(lambda: tri.lightning_decode(q, k, v, states[0], decay, scale=1.0, out=out))
        torch_step = lambda st=states[0]: ref.lightning_decode(q, k, v, st, decay, scale=1.0)  # noqa: E731
        row["torch_us"] = _bench(torch_step)
        gg = -decay
        if fused_recurrent is not None:
            fla_step = lambda st=states[0]: fused_recurrent(q, k, v, g_gamma=gg, scale=1.0, initial_state=st,  # noqa
                                                            output_final_state=True)
            o_f, s_f = fla_step()
            s_ref = states[0].clone()
            o_r = ref.lightning_decode(q, k, v, s_ref, decay, scale=1.0)
            row["fla_rel_err_out"], row["fla_rel_err_state"] = _rel(o_f, o_r), _rel(s_f, s_ref)
            del s_ref, o_f, s_f
            row["fla_us"] = _bench(fla_step)
        if graph:
            steps = max(16 if B <= 32 else 4, len(states))
            row["graph_steps"] = steps
            row["ours_graph_us"] = graph_time(
                [lambda st=st: tri.lightning_decode(q, k, v, st, decay, scale=1.0, out=out) for st in states], steps)
            row["torch_graph_us"] = graph_time(
                [lambda st=st: ref.lightning_decode(q, k, v, st, decay, scale=1.0) for st in states], steps)
            if fused_recurrent is not None:
                try:
                    row["fla_graph_us"] = graph_time(
                        [lambda st=st: fused_recurrent(q, k, v, g_gamma=gg, scale=1.0, initial_state=st,
                                                       output_final_state=True) for st in states], steps)
                except Exception as exc:  # noqa: BLE001
                    row["fla_graph_error"] = repr(exc)[:200]
        # bf16 state storage (fp32 math): half the bytes; TB/s below counts the bf16 bytes actually moved
        nb16 = min(80, max(1, math.ceil((160 << 20) / (state_bytes // 2))))
        sb = [(torch.randn(B, H, D, D, device="cuda", generator=g) * 0.1).to(torch.bfloat16) for _ in range(nb16)]
        s16, s32 = sb[0].clone(), sb[0].float()
        o16 = tri.lightning_decode(q, k, v, s16, decay, scale=1.0)
        o32 = ref.lightning_decode(q, k, v, s32, decay, scale=1.0)
        row["bf16_rel_err_out"], row["bf16_rel_err_state"] = _rel(o16, o32), _rel(s16, s32)
        row["bf16_us"] = _bench(lambda: tri.lightning_decode(q, k, v, sb[0], decay, scale=1.0))
        if graph:
            row["bf16_graph_us"] = graph_time(
                [lambda st=st: tri.lightning_decode(q, k, v, st, decay, scale=1.0, out=out) for st in sb],
                max(steps, len(sb)))
        del sb, s16, s32
        for key in [k_ for k_ in row if k_.endswith("_us")]:
            nbytes = state_bytes // 2 if key.startswith("bf16") else state_bytes
            row[key.replace("_us", "_TBps")] = 2 * nbytes / (row[key] * 1e-6) / 1e12
        if B == 1:
            row["host_us_ours"] = host_time(lambda: tri.lightning_decode(q, k, v, states[0], decay, scale=1.0))
            row["host_us_ours_out"] = host_time(
                lambda: tri.lightning_decode(q, k, v, states[0], decay, scale=1.0, out=out))
            row["host_us_checks"] = host_time(lambda: ref.check_decode_args(q, k, v, states[0], decay, 1.0, None,
                                                                            "bhkv"))
            row["host_us_new_empty"] = host_time(lambda: q.new_empty((B, 1, H, D)))
            row["host_us_launch"] = host_time(
                lambda: tri._launch_decode(q, k, v, states[0], decay, out, 1.0, False, B, H, D, D))
            row["direct_relaunch_active"] = bool(tri._PLANS) and tri._DIRECT[0]
            ok = tri._DIRECT[0]
            tri._DIRECT[0] = False
            row["host_us_launch_jit_only"] = host_time(
                lambda: tri._launch_decode(q, k, v, states[0], decay, out, 1.0, False, B, H, D, D))
            row["ours_us_jit_only"] = _bench(lambda: tri.lightning_decode(q, k, v, states[0], decay, scale=1.0))
            tri._DIRECT[0] = ok
            row["host_us_custom_op"] = host_time(
                lambda: torch.ops.sparsepatch.lightning_decode_(q, k, v, states[0], decay, out, 1.0, False))
            if fused_recurrent is not None:
                row["host_us_fla"] = host_time(fla_step)
        rows.append(row)
        print("decode", {k_: (round(v_, 3) if isinstance(v_, float) else v_) for k_, v_ in row.items()}, flush=True)
        del states
        torch.cuda.empty_cache()
    return rows


def bench_prefill(chunk_gla, lengths):
    from sparsepatch.kernels.lightning import triton as tri
    rows = []
    decay = minimax_slopes().cuda()
    for T in lengths:
        g = torch.Generator(device="cuda").manual_seed(T)
        q, k, v = (torch.randn(1, T, H, D, device="cuda", generator=g, dtype=torch.bfloat16) * s
                   for s in (0.1, 0.1, 1.0))
        row = {"T": T}
        o, s = tri.lightning_prefill(q, k, v, decay, scale=1.0)
        if T <= 4096:
            o_r, s_r = ref.lightning_prefill(q, k, v, decay, scale=1.0)
            row["rel_err_out"], row["rel_err_state"] = _rel(o, o_r), _rel(s, s_r)
            del o_r, s_r
        row["ours_us"] = _bench(lambda: tri.lightning_prefill(q, k, v, decay, scale=1.0), rep=300)
        if chunk_gla is not None:
            o_f, s_f = chunk_gla(q, k, v, g_gamma=-decay, scale=1.0, output_final_state=True)
            row["vs_fla_rel_out"], row["vs_fla_rel_state"] = _rel(o, o_f), _rel(s, s_f)
            row["fla_us"] = _bench(lambda: chunk_gla(q, k, v, g_gamma=-decay, scale=1.0, output_final_state=True),
                                   rep=300)
            row["speedup_vs_fla"] = row["fla_us"] / row["ours_us"]
        flops = 1 * H * T * (4 * D * D + 2 * 64 * D + 2 * 64 * D)   # q@S, S update, qk^T, pv (chunk 64)
        row["ours_TFLOPs"] = flops / (row["ours_us"] * 1e-6) / 1e12
        row["io_GBps"] = 4 * T * H * D * 2 / (row["ours_us"] * 1e-6) / 1e9
        rows.append(row)
        print("prefill", {k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()}, flush=True)
        del q, k, v, o, s
        torch.cuda.empty_cache()
    return rows


def sweep(lengths, batches):
    from sparsepatch.kernels.lightning import triton as tri
    out = {"decode": [], "prefill": []}
    decay = minimax_slopes().cuda()
    for B in batches:
        q, k, v = (torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        st = torch.randn(B, H, D, D, device="cuda") * 0.1
        o = torch.empty(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
        for bv, w in ((64, 2), (128, 4), (32, 2), (16, 1), (16, 2)):
            if B > 1 and bv == 16:
                continue
            tri._DECODE_OVERRIDE.update(BV=bv, num_warps=w)
            try:
                us = _bench(lambda: tri.lightning_decode(q, k, v, st, decay, scale=1.0, out=o), rep=100)
                r = {"B": B, "BV": bv, "warps": w, "us": us,
                     "TBps": 2 * st.numel() * 4 / (us * 1e-6) / 1e12}
                if B == 1:   # per step in a CUDA graph over 16 states (cold L2): the launch latency hidden
                    sts = [torch.randn_like(st) for _ in range(16)]
                    r["graph_us"] = graph_time([lambda x=x: tri.lightning_decode(q, k, v, x, decay, scale=1.0, out=o)
                                                for x in sts], 16)
            except Exception as exc:  # noqa: BLE001
                r = {"B": B, "BV": bv, "warps": w, "error": repr(exc)[:200]}
            out["decode"].append(r)
        tri._DECODE_OVERRIDE.clear()
        print("sweep decode B", B, sorted([(round(r["us"], 2), r.get("graph_us"), r["BV"], r["warps"]) for r in out["decode"]
                                          if r["B"] == B and "us" in r]), flush=True)
    for T in lengths:
        q, k, v = (torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16) * 0.1 for _ in range(3))
        for c, bv, w, st in ((64, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 8, 3)):
            tri._PREFILL_OVERRIDE.update(BV=bv, num_warps=w, num_stages=st, C=c)
            try:
                us = _bench(lambda: tri.lightning_prefill(q, k, v, decay, scale=1.0), rep=60)
                r = {"T": T, "C": c, "BV": bv, "warps": w, "stages": st, "us": us}
            except Exception as exc:  # noqa: BLE001
                r = {"T": T, "C": c, "BV": bv, "warps": w, "stages": st, "error": repr(exc)[:200]}
            out["prefill"].append(r)
        tri._PREFILL_OVERRIDE.clear()
        print("sweep prefill T", T, sorted([(round(r["us"], 1), r["C"], r["BV"], r["warps"], r["stages"])
                                            for r in out["prefill"] if r["T"] == T and "us" in r]),
              [r for r in out["prefill"] if r["T"] == T and "error" in r], flush=True)
    return out


def _grid(B):
    """Decode configs swept at batch B: (BV, warps). The persistent-loop and cache-hint variants of the v4 sweep
    were deleted (measured 4-60% slower / not adopted; benchmarks/NOTES.md, lightning v4)."""
    if B == 1:
        return [(8, 1), (16, 1), (16, 2), (32, 1), (32, 2), (64, 2)]
    return [(32, 1), (32, 2), (64, 1), (64, 2), (64, 4), (128, 4), (128, 8)]


def sweep_decode(batches, bf16_batches=(1, 64, 256)):
    """Every decode launch variant at each B (eager do_bench; B=1 also per CUDA-graph step). The default config
    is timed twice (first and last) to show the run's noise."""
    from sparsepatch.kernels.lightning import triton as tri
    rows = []
    decay = minimax_slopes().cuda()
    for sdt, bs in ((torch.float32, batches), (torch.bfloat16, bf16_batches)):
        for B in bs:
            q, k, v = (torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            st = (torch.randn(B, H, D, D, device="cuda") * 0.1).to(sdt)
            o = torch.empty(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
            nst = math.ceil((160 << 20) / (st.numel() * st.element_size()))   # >= 160 MiB of states: no L2 reuse
            sts = [torch.randn_like(st, dtype=torch.float32).to(sdt) for _ in range(nst)] if B == 1 else None
            nbytes = 2 * st.numel() * st.element_size()
            cfgs = _grid(B)
            if sdt != torch.float32 and B > 1:
                cfgs += [(128, 2)]
            cfgs = [("default",)] + cfgs + [("default",)]
            for c in cfgs:
                tri._DECODE_OVERRIDE.clear()
                if c[0] != "default":
                    tri._DECODE_OVERRIDE.update(BV=c[0], num_warps=c[1])
                r = {"B": B, "state": str(sdt).split(".")[-1], "cfg": list(c)}
                try:
                    s_ref, s_tri = st.clone(), st.clone()
                    o_ref = ref.lightning_decode(q, k, v, s_ref, decay, scale=1.0)
                    o_tri = tri.lightning_decode(q, k, v, s_tri, decay, scale=1.0)
                    r["rel_err"] = max(_rel(o_tri, o_ref), _rel(s_tri, s_ref))
                    del s_ref, s_tri
                    r["us"] = _bench(lambda: tri.lightning_decode(q, k, v, st, decay, scale=1.0, out=o), rep=100)
                    r["TBps"] = nbytes / (r["us"] * 1e-6) / 1e12
                    if B == 1:
                        r["graph_us"] = graph_time(
                            [lambda x=x: tri.lightning_decode(q, k, v, x, decay, scale=1.0, out=o) for x in sts],
                            len(sts))
                except Exception as exc:  # noqa: BLE001
                    r["error"] = repr(exc)[:200]
                rows.append(r)
            tri._DECODE_OVERRIDE.clear()
            mine = [r for r in rows if r["B"] == B and r["state"] == str(sdt).split(".")[-1]]
            ok = [r for r in mine if "us" in r]
            fmt = lambda r: (round(r["us"], 2), round(r.get("graph_us", 0), 2), round(r["TBps"], 3), r["cfg"])  # noqa
            print(f"sweep decode B={B} {sdt}: default", [fmt(r) for r in ok if r["cfg"] == ["default"]],
                  "best eager", [fmt(r) for r in sorted(ok, key=lambda r: r["us"])[:4]],
                  "best graph", [fmt(r) for r in sorted(ok, key=lambda r: r.get("graph_us", 1e9))[:4]] if B == 1 else "",
                  "errors/wrong", [r["cfg"] for r in mine if "error" in r or r.get("rel_err", 0) > 2e-2], flush=True)
            del st, sts
            torch.cuda.empty_cache()
    return rows


def drift(steps=4096, B=4, layers=(0, 40, 79)):
    """bf16-state vs fp32-state decode over `steps` tokens from a zero state: relative error of the state and of
    o at checkpoints, MiniMax slopes of a few layers (79 of 80: almost no decay, the state keeps growing).
    Inputs silu(randn) like MiniMax's activated qkv projection."""
    from sparsepatch.kernels.lightning import triton as tri
    out = []
    for layer in layers:
        decay = minimax_slopes(layer=layer).cuda()
        g = torch.Generator(device="cuda").manual_seed(layer)
        s32 = torch.zeros(B, H, D, D, device="cuda")
        s16 = torch.zeros(B, H, D, D, device="cuda", dtype=torch.bfloat16)
        shf = torch.zeros(B, H, D, D, device="cuda", dtype=torch.bfloat16)   # transformers' bf16 decode update
        ratio = torch.exp(-decay.to(torch.bfloat16))[None, :, None, None]
        marks = {1, 16, 256, 1024, steps}
        err_o = []
        for t in range(1, steps + 1):
            q, k, v = (torch.nn.functional.silu(torch.randn(B, 1, H, D, device="cuda", generator=g))
                       .to(torch.bfloat16) for _ in range(3))
            o32 = tri.lightning_decode(q, k, v, s32, decay, scale=1.0).float()
            o16 = tri.lightning_decode(q, k, v, s16, decay, scale=1.0).float()
            qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))            # (B, H, 1, D), as MiniMax does
            shf = ratio * shf + torch.matmul(kh.transpose(-1, -2), vh)
            ohf = torch.matmul(qh, shf).transpose(1, 2).float()
            err_o.append(((o16 - o32).norm() / o32.norm()).item() if t in marks else None)
            if t in marks:
                out.append({"layer": layer, "step": t, "rel_err_state": _rel(s16, s32), "rel_err_out": err_o[-1],
                            "hf_bf16_rel_err_state": _rel(shf, s32), "hf_bf16_rel_err_out": _rel(ohf, o32),
                            "state_rms": s32.pow(2).mean().sqrt().item(),
                            "rel_err_out_bf16_rounding_floor": _rel(o32.to(torch.bfloat16), o32)})
        print("drift layer", layer, "(step, state/out rel err: ours bf16 nearest | transformers bf16)",
              [(r["step"], f"{r['rel_err_state']:.1e}/{r['rel_err_out']:.1e}",
                f"{r['hf_bf16_rel_err_state']:.1e}/{r['hf_bf16_rel_err_out']:.1e}")
               for r in out if r["layer"] == layer], flush=True)
    return out


def _plain_kernel():
    """The plain decode of issue 6 (a minimal Triton kernel, contiguous tensors, one (K, BV) tile per program): the
    yardstick for our launch settings, timed in the same harness (bench-only)."""
    import triton
    import triton.language as tl

    @triton.jit
    def plain(Q, Kt, Vt, S, G, O, scale, H, D: tl.constexpr, BV: tl.constexpr):
        pv = tl.program_id(0)
        bh = tl.program_id(1)
        ok = tl.arange(0, D)
        ov = pv * BV + tl.arange(0, BV)
        sp = S + bh.to(tl.int64) * D * D + ok[:, None] * D + ov[None, :]
        s = tl.load(sp)
        q = tl.load(Q + bh * D + ok).to(tl.float32)
        k = tl.load(Kt + bh * D + ok).to(tl.float32)
        v = tl.load(Vt + bh * D + ov).to(tl.float32)
        s = s * tl.exp(-tl.load(G + bh % H)) + k[:, None] * v[None, :]
        tl.store(sp, s)
        tl.store(O + bh * D + ov, tl.sum(s * (q * scale)[:, None], 0).to(O.dtype.element_ty))

    def run(q, k, v, st, decay, out, BV, warps):
        B, _, Hh, Dd = q.shape
        plain[(Dd // BV, B * Hh)](q, k, v, st, decay, out, 1.0, Hh, D=Dd, BV=BV, num_warps=warps)
        return out
    return run


def decode_ab(fused_recurrent, batches, old=None):
    """Old vs new decode path, the plain kernel, fla and a same-bytes copy, in one process on the same inputs:
    eager do_bench (new and old three times, interleaved: the run's noise), per step in a CUDA graph cycling over >= 160 MiB of states
    (cold L2), and at B=1 also per step on ONE state (L2-resident: 4.2 MB of the 50 MB L2 stays hot between
    replays). Host time per call at B=1 (wall clock of back-to-back calls). Launch variants of the new kernel
    (runtime row strides, other tiles). `old`: a module with the previous
    lightning_decode (benchmarks/NOTES.md, lightning v5), or None."""
    from sparsepatch.kernels.lightning import triton as tri
    plain = _plain_kernel()
    decay = minimax_slopes().cuda()
    rows = []
    for B in batches:
        g = torch.Generator(device="cuda").manual_seed(100 + B)
        q, k, v = (torch.randn(B, 1, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
        state_bytes = B * H * D * D * 4
        nbuf = max(2, math.ceil((160 << 20) / state_bytes))
        states = [torch.randn(B, H, D, D, device="cuda", generator=g) * 0.1 for _ in range(nbuf)]
        out = torch.empty(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
        gg = -decay
        fns = {"new": lambda st, o=None: tri.lightning_decode(q, k, v, st, decay, scale=1.0, out=o)}
        if old is not None:
            fns["old"] = lambda st, o=None: old.lightning_decode(q, k, v, st, decay, scale=1.0, out=o)
        bv, w = (16, 1) if B == 1 else (64, 2)                  # our default tiles
        fns[f"plain{bv}_{w}w"] = lambda st, o=None, bv=bv, w=w: plain(q, k, v, st, decay, out if o is None else o,
                                                                        bv, w)
        if fused_recurrent is not None:
            fns["fla"] = lambda st, o=None: fused_recurrent(q, k, v, g_gamma=gg, scale=1.0, initial_state=st,
                                                            output_final_state=True)
        row = {"B": B, "state_MB": state_bytes / 1e6, "n_states": nbuf}
        for name, fn in fns.items():                                  # one step vs the reference, twice
            if name == "fla":
                continue
            s_ref, s_x = states[0].clone(), states[0].clone()
            for _ in range(2):
                o_ref = ref.lightning_decode(q, k, v, s_ref, decay, scale=1.0)
                o_x = fn(s_x).clone()
            row[f"{name}_rel_err"] = max(_rel(o_x, o_ref), _rel(s_x, s_ref))
            del s_ref, s_x
        half = nbuf // 2
        for name, fn in fns.items():
            try:
                row[f"{name}_us"] = _bench(lambda: fn(states[0]))
                row[f"{name}_graph_us"] = graph_time([lambda i=i: fn(states[i], out) for i in range(nbuf)],
                                                     max(nbuf, 16 if B <= 16 else 4))
                if B == 1:
                    row[f"{name}_graph_hot_us"] = graph_time([lambda: fn(states[0], out)], 40)
            except Exception as exc:  # noqa: BLE001
                row[f"{name}_error"] = repr(exc)[:200]
        for rep in (2, 3):                                            # eager again, interleaved: the noise
            for name in [n for n in ("new", "old") if n in fns]:
                row[f"{name}_us_r{rep}"] = _bench(lambda: fns[name](states[0]))
        # the same bytes as one step moved by torch's copy (read one state, write another): the floor at this size
        row["copy_us"] = _bench(lambda: states[1].copy_(states[0]))
        row["copy_graph_us"] = graph_time([lambda i=i: states[(i + half) % nbuf].copy_(states[i]) for i in range(nbuf)],
                                          max(nbuf, 16 if B <= 16 else 4))
        if B == 1:
            row["copy_graph_hot_us"] = graph_time([lambda: states[1].copy_(states[0])], 40)
            for name in [n for n in ("new", "old") if n in fns]:
                row[f"host_us_{name}"] = host_time(lambda: fns[name](states[0]))
                row[f"host_us_{name}_out"] = host_time(lambda: fns[name](states[0], out))
            row["host_us_checks"] = host_time(lambda: ref.check_decode_args(q, k, v, states[0], decay, 1.0, None,
                                                                            "bhkv"))
            row["direct_relaunch_active"] = bool(tri._PLANS) and tri._DIRECT[0]
        # launch variants of our kernel (sweep overrides: triton's launcher, same binary as a plan would run)
        variants = [({"CS": False}, "nocs")] + [({"BV": bv, "num_warps": w}, f"{bv}_{w}w") for bv, w in
                                                {1: ((32, 1), (16, 2)), 16: ((32, 1), (16, 1))}.get(B, ((16, 1),))]
        for ov, tag in variants:
            tri._DECODE_OVERRIDE.update(ov)
            try:
                row[f"new_{tag}_us"] = _bench(lambda: fns["new"](states[0]))
                row[f"new_{tag}_graph_us"] = graph_time(
                    [lambda i=i: fns["new"](states[i], out) for i in range(nbuf)], max(nbuf, 16 if B <= 16 else 4))
                if B == 1:
                    row[f"new_{tag}_graph_hot_us"] = graph_time([lambda: fns["new"](states[0], out)], 40)
            except Exception as exc:  # noqa: BLE001
                row[f"new_{tag}_error"] = repr(exc)[:200]
            finally:
                tri._DECODE_OVERRIDE.clear()
        for key in [k_ for k_ in row if k_.endswith("_us") and not k_.startswith("host")]:
            row[key.replace("_us", "_TBps")] = 2 * state_bytes / (row[key] * 1e-6) / 1e12
        rows.append(row)
        print("ab", {k_: (round(v_, 3) if isinstance(v_, float) else v_) for k_, v_ in row.items()}, flush=True)
        del states
        torch.cuda.empty_cache()
    return rows


def ab_table(rows):
    nan = float("nan")
    names = [n for n in ("new", "new_nocs", "old", "plain16_1w", "plain64_2w", "fla", "copy")
             if any(f"{n}_us" in r for r in rows)]
    lines = ["| B | " + " | ".join(f"{n} eager / graph us" for n in names) + " | new / old eager r2, r3 |",
             "|---|" + "---|" * (len(names) + 1)]
    for r in rows:
        lines.append(f"| {r['B']} | " + " | ".join(f"{r.get(n + '_us', nan):.1f} / {r.get(n + '_graph_us', nan):.1f}"
                                                   for n in names)
                     + f" | {r.get('new_us_r2', nan):.1f}, {r.get('new_us_r3', nan):.1f} / "
                       f"{r.get('old_us_r2', nan):.1f}, {r.get('old_us_r3', nan):.1f} |")
    r1 = [r for r in rows if r["B"] == 1]
    if r1:
        lines.append("B=1 graph per step on one L2-resident state: " + ", ".join(
            f"{n} {r1[0].get(n + '_graph_hot_us', nan):.2f}" for n in names + ["new_32_1w", "new_16_2w"]))
        lines.append("B=1 host us/call: " + ", ".join(f"{k_[8:]} {v_:.1f}" for k_, v_ in r1[0].items()
                                                      if k_.startswith("host_us_")))
    for r in rows:
        extra = {k_: round(v_, 2) for k_, v_ in r.items() if k_.startswith("new_") and k_[4].isdigit()
                 and k_.endswith("_us")}
        if extra:
            lines.append(f"B={r['B']} other tiles: {extra}")
    return "\n".join(lines)


def table(res):
    lines = ["| B | ours eager us | ours graph us/step | fla eager us | fla graph us/step | torch eager us | "
             "ours TB/s (eager / graph) | fla TB/s (eager / graph) | ours/fla |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["decode"]:
        lines.append("| {B} | {a:.1f} | {b:.1f} | {c:.1f} | {d:.1f} | {e:.1f} | {f:.2f} / {g:.2f} | {h:.2f} / {i:.2f} "
                     "| {j:.2f}x |".format(
                         B=r["B"], a=r["ours_us"], b=r.get("ours_graph_us", float("nan")),
                         c=r.get("fla_us", float("nan")), d=r.get("fla_graph_us", float("nan")), e=r["torch_us"],
                         f=r["ours_TBps"], g=r.get("ours_graph_TBps", float("nan")),
                         h=r.get("fla_TBps", float("nan")), i=r.get("fla_graph_TBps", float("nan")),
                         j=r.get("fla_us", float("nan")) / r["ours_us"]))
    lines += ["", "| B | bf16-state eager us | bf16-state graph us/step | TB/s (bf16 bytes) eager / graph | "
              "fla / bf16-state (eager) | rel err out / state vs fp32 step |",
              "|---|---|---|---|---|---|"]
    for r in res["decode"]:
        if "bf16_us" in r:
            lines.append("| {B} | {a:.1f} | {b:.1f} | {c:.2f} / {d:.2f} | {e:.2f}x | {f:.1e} / {g:.1e} |".format(
                B=r["B"], a=r["bf16_us"], b=r.get("bf16_graph_us", float("nan")), c=r["bf16_TBps"],
                d=r.get("bf16_graph_TBps", float("nan")), e=r.get("fla_us", float("nan")) / r["bf16_us"],
                f=r["bf16_rel_err_out"], g=r["bf16_rel_err_state"]))
    lines += ["", "| T | ours us | fla us | speedup | ours TFLOP/s | rel err vs fla |", "|---|---|---|---|---|---|"]
    for r in res["prefill"]:
        lines.append("| {T} | {a:.0f} | {b:.0f} | {c:.2f}x | {d:.0f} | {e:.1e} |".format(
            T=r["T"], a=r["ours_us"], b=r.get("fla_us", float("nan")), c=r.get("speedup_vs_fla", float("nan")),
            d=r["ours_TFLOPs"], e=r.get("vs_fla_rel_out", float("nan"))))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes")
    p.add_argument("--sweep", action="store_true", help="also sweep kernel configs")
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--sweep-only", action="store_true", help="only the config sweep and the B=1 decode row")
    p.add_argument("--drift", action="store_true", help="also: bf16-state drift vs fp32 over 4096 steps")
    p.add_argument("--decode-sweep", action="store_true",
                   help="only the decode launch-variant sweep (fp32 and bf16 state) and the bf16 drift run")
    p.add_argument("--ab", action="store_true",
                   help="only the decode A/B: old vs new path, plain kernel, fla, same-bytes copy (B 1..256)")
    p.add_argument("--old", default=None,
                   help="importable module with the previous lightning_decode, for --ab (run 6/7: commit 2e7d38c's "
                        "kernels/lightning.py saved as sparsepatch/kernels/_lightning_v4_old.py with its "
                        "'sparsepatch::' op names renamed, not committed)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_lightning: needs CUDA")
        return 1
    import triton
    chunk_gla, fused_rec, fla_err = load_fla()
    name = torch.cuda.get_device_name()
    gpu = "h100" if "H100" in name else "h200" if "H200" in name else name.split()[-1].lower()
    res = {"gpu": name, "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "fla_error": fla_err, "shape": {"H": H, "K": D, "V": D, "dtype": "bfloat16", "state": "float32"}}
    res["copy_TBps"], res["copy_us_1GiB"] = copy_ceiling()
    print(f"{name}: device copy {res['copy_TBps']:.3f} TB/s; fla: {fla_err or 'ok'}", flush=True)
    if args.ab:
        import importlib
        import inspect
        try:
            from triton.compiler.compiler import CompiledKernel
            res["triton_getitem_src"] = inspect.getsource(CompiledKernel.__getitem__)
            from triton.backends.nvidia.driver import CudaLauncher
            res["triton_launcher_call_src"] = inspect.getsource(CudaLauncher.__call__)
        except Exception as exc:  # noqa: BLE001
            res["triton_getitem_src"] = repr(exc)
        old = importlib.import_module(args.old) if args.old else None
        res["decode_ab"] = decode_ab(fused_rec, [1, 16, 64, 128, 256], old)
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"{gpu}-lightning-ab.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"copy ceiling {res['copy_TBps']:.3f} TB/s")
        print(ab_table(res["decode_ab"]))
        print("wrote", path)
        return 0
    if args.decode_sweep:
        res["drift"] = drift()
        res["decode_sweep"] = sweep_decode([1, 16, 64, 128, 256])
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"{gpu}-lightning-decode-sweep.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", path)
        return 0
    batches = [1, 64, 256] if args.quick else DECODE_B
    lengths = [4096, 32768] if args.quick else PREFILL_T
    if args.sweep_only:
        res["decode"] = bench_decode(fused_rec, [1], graph=True)
        res["prefill"] = []
        res["sweep"] = sweep([4096, 32768], [1, 64, 256])
        path = os.path.join(args.out, f"{gpu}-lightning-sweep.json")
        os.makedirs(args.out, exist_ok=True)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", path)
        return 0
    res["decode"] = bench_decode(fused_rec, batches, graph=not args.no_graph)
    res["prefill"] = bench_prefill(chunk_gla, lengths)
    if args.drift:
        res["drift"] = drift()
    if args.sweep:
        res["sweep"] = sweep([4096, 32768], [1, 64, 256])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{gpu}-lightning.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"copy ceiling {res['copy_TBps']:.3f} TB/s")
    print(table(res))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
