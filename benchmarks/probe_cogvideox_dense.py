"""Why did the CogVideoX-shaped DenseConfig step read 0.97-0.99x unpatched (session 16)? One process, one GPU:

  python benchmarks/probe_cogvideox_dense.py        (LAYERS=2 by default; OUT=dir for the JSON)

1. The arguments of the first SDPA kernel call of a step, unpatched and patched (aten op, shapes, strides, storage
   offsets, pointer alignment, equal values), captured with a TorchDispatchMode.
2. Those two captured calls timed alone, interleaved (do_bench medians).
3. The step unpatched vs DenseConfig in ABBA order, twice, and once with the SDPA router bypassed (the patched
   processor calls SDPA itself).
4. Host enqueue time per step, and per-kernel GPU time from the profiler (unpatched, patched, patched, unpatched).
On CPU it runs a 1-layer toy model (no profiler) to check the script.
"""
import json, os, sys, time
import torch
from torch.utils._python_dispatch import TorchDispatchMode
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_never_slower as bns
import sparsepatch as sp
from sparsepatch.patcher import sdpa_mode
import triton.testing

OUT = os.environ.get("OUT", "/tmp")
res = {}
DEV = "cuda" if torch.cuda.is_available() else "cpu"
def bench(fn, rep=60):
    if DEV == "cpu":
        t0 = time.perf_counter(); fn(); return (time.perf_counter() - t0) * 1e3
    return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))

from diffusers import CogVideoXTransformer3DModel
torch.manual_seed(0)
LAYERS = int(os.environ.get("LAYERS", "2"))
if DEV == "cuda":
    model, step = bns.cogvideox_5b_shaped(LAYERS)
else:
    model = CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=64, in_channels=16,
                                        out_channels=16, time_embed_dim=32, text_embed_dim=4096,
                                        num_layers=1, sample_width=8, sample_height=8, sample_frames=5,
                                        patch_size=2, use_rotary_positional_embeddings=True).eval()
    x = torch.randn(1, 2, 16, 8, 8); text = torch.randn(1, 8, 4096); t = torch.tensor([500])
    def step():
        with torch.no_grad():
            return model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

class Capture(TorchDispatchMode):
    def __init__(self):
        super().__init__(); self.calls = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "scaled_dot_product" in str(func) or "attention" in str(func):
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)

def desc(t):
    if isinstance(t, torch.Tensor):
        return dict(shape=list(t.shape), stride=list(t.stride()), off=t.storage_offset(), ptr_mod=t.data_ptr() % 1024,
                    dtype=str(t.dtype), contig=t.is_contiguous())
    return repr(t)

caps = {}
for name in ("unpatched", "patched"):
    h = sp.patch(model, sp.DenseConfig()) if name == "patched" else None
    step(); (torch.cuda.synchronize() if DEV == 'cuda' else None)
    with torch.no_grad():
        cap = Capture()
        with cap:
            step()
    (torch.cuda.synchronize() if DEV == 'cuda' else None)
    caps[name] = cap.calls
    res[f"calls_{name}"] = [dict(op=str(f), args=[desc(a) for a in a_], kwargs={k: desc(v) for k, v in kw.items()})
                            for f, a_, kw in cap.calls[:2]]
    print(name, len(cap.calls), json.dumps(res[f"calls_{name}"][:1], indent=None)[:1500], flush=True)
    if h is not None:
        res["backends"] = h.stats().get("backends")
        sp.unpatch(model)

# the captured first attention call of each path, timed alone, interleaved
def call_of(c):
    f, a, kw = c
    return lambda: f(*a, **kw)
if caps["unpatched"] and caps["patched"]:
    fu, fp = call_of(caps["unpatched"][0]), call_of(caps["patched"][0])
    iso = {"unpatched": [], "patched": []}
    for _ in range(4):
        iso["unpatched"].append(bench(fu)); iso["patched"].append(bench(fp))
    res["isolated_ms"] = iso
    print("isolated", iso, flush=True)
    # swap: unpatched inputs are the same tensors? compare values
    a_u = [x for x in caps["unpatched"][0][1] if isinstance(x, torch.Tensor)]
    a_p = [x for x in caps["patched"][0][1] if isinstance(x, torch.Tensor)]
    res["same_values"] = [bool(torch.equal(x, y)) if x.shape == y.shape else False for x, y in zip(a_u, a_p)]
    print("same values", res["same_values"], flush=True)
caps = None

# whole step: ABBA, and a variant with the SDPA router bypassed (patched object, processor calls SDPA itself)
def steps_abba(label, cfg, bypass=False):
    import contextlib
    saved = sdpa_mode.route_sdpa
    b1 = bench(step)
    h = sp.patch(model, cfg)
    if bypass:
        sdpa_mode.route_sdpa = lambda attend: contextlib.nullcontext()
    step(); o1, o2 = bench(step), bench(step)
    sdpa_mode.route_sdpa = saved
    sp.unpatch(model)
    b2 = bench(step)
    r = dict(base=(b1 + b2) / 2, ours=(o1 + o2) / 2, raw=[b1, o1, o2, b2])
    r["ratio"] = r["base"] / r["ours"]
    print(label, r, flush=True)
    return r
res["abba_dense"] = steps_abba("dense", sp.DenseConfig())
res["abba_dense_bypass"] = steps_abba("dense_bypass", sp.DenseConfig(), bypass=True)
res["abba_dense2"] = steps_abba("dense2", sp.DenseConfig())

# host time per step (no sync inside): CPU seconds to enqueue
def host_ms(n=5):
    (torch.cuda.synchronize() if DEV == 'cuda' else None); t0 = time.perf_counter()
    for _ in range(n):
        step()
    t1 = time.perf_counter(); (torch.cuda.synchronize() if DEV == 'cuda' else None); t2 = time.perf_counter()
    return (t1 - t0) / n * 1e3, (t2 - t0) / n * 1e3
res["host_unpatched"] = host_ms()
h = sp.patch(model, sp.DenseConfig()); step()
res["host_patched"] = host_ms()
sp.unpatch(model)
print("host (enqueue ms, wall ms) unpatched", res["host_unpatched"], "patched", res["host_patched"], flush=True)

# profiler kernel totals, both ways, twice (unpatched, patched, patched, unpatched)
from torch.profiler import profile, ProfilerActivity
def kernels(patched):
    h = sp.patch(model, sp.DenseConfig()) if patched else None
    step(); (torch.cuda.synchronize() if DEV == 'cuda' else None)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        (torch.cuda.synchronize() if DEV == 'cuda' else None)
    if h is not None:
        sp.unpatch(model)
    tot = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0):
            tot[e.key[:90]] = tot.get(e.key[:90], 0) + (getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)) / 3e3
    return tot
ku1 = kernels(False); kp1 = kernels(True); kp2 = kernels(True); ku2 = kernels(False)
keys = sorted(set(ku1) | set(kp1), key=lambda k: -(ku1.get(k, 0) + kp1.get(k, 0)))
rows = []
for k in keys[:25]:
    u = (ku1.get(k, 0) + ku2.get(k, 0)) / 2; p = (kp1.get(k, 0) + kp2.get(k, 0)) / 2
    rows.append(dict(kernel=k, unpatched_ms=u, patched_ms=p, u=[ku1.get(k, 0), ku2.get(k, 0)], p=[kp1.get(k, 0), kp2.get(k, 0)]))
res["kernels"] = rows
res["kernel_total"] = dict(unpatched=[sum(ku1.values()), sum(ku2.values())], patched=[sum(kp1.values()), sum(kp2.values())])
print("kernel totals", res["kernel_total"])
for r in rows[:15]:
    print(f"{r['kernel'][:70]:70s} U {r['u'][0]:.3f} {r['u'][1]:.3f}  P {r['p'][0]:.3f} {r['p'][1]:.3f}")
json.dump(res, open(os.path.join(OUT, "cogvideox-dense-probe.json"), "w"), indent=1, default=str)
