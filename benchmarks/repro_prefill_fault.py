"""Reproducer of the open GPU fault (not a benchmark): lightning prefill faults after a patched head_dim-512 Llama.

    CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=. python benchmarks/repro_prefill_fault.py plain   # eager ok, compiled ok
    CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=. python benchmarks/repro_prefill_fault.py llama   # eager FAILS

Findings (H100, torch 2.11, Triton 3.6, 2026-11-23): after `sp.patch(bf16 tiny Llama head_dim 512, DenseConfig())`
+ `generate` (split-D dense kernels), the very next `lightning_prefill` at B4 T1 H64 K=V=128 bf16 raises "illegal
memory access"; the same kernel variant (shared 36864 B, 3 stages, 4 warps) passes in a fresh process. Under
compute-sanitizer (PYTORCH_NO_CUDA_MEMORY_CACHING=1) the Llama test alone is clean (0 errors) and the pair reports
"Out-of-range shared or local address at _prefill_kernel lightning.py:245" (the dmat layout conversion) in every
block. The dense bf16 split-D tests (fwd+bwd, D 320-1024) before it do NOT trigger it; torch.compile is not needed.
So some process/context state left by the Llama path changes how the unchanged prefill binary runs.
Lead (not verified): the pattern matches a known Triton 3.6-3.7 Hopper code-generation fault, an intermittent
"Invalid __shared__ read" in small kernels with several tl.dot on 32-wide tiles and 4 warps that is clean on 3.5.1
(triton-lang/triton issues #11366 and #10486); `_prefill_kernel` has three tl.dot on (64 x 32) tiles with 4 warps.
Outcome (H100 run 4 of the lightning notes, CUDA_LAUNCH_BLOCKING=1, one process per setting): default (BV=32,
4 warps) faults; LIGHTNING_PREFILL_OVERRIDE='{"BV": 64}' passes B4 T1, B1 T4096 and the compiled call (outputs
match the reference); '{"num_warps": 8}' faults. BV=64 is now the default for V >= 64 (`_prefill_config`)."""
import json
import os
import sys
import torch
sys.path.insert(0, "tests")
import sparsepatch as sp
from sparsepatch.kernels.lightning import triton as tri
# LIGHTNING_PREFILL_OVERRIDE='{"BV": 64}' (or '{"num_warps": 8}'): the prefill launch settings to try
tri._PREFILL_OVERRIDE.update(json.loads(os.environ.get("LIGHTNING_PREFILL_OVERRIDE", "{}")))
print("prefill override", tri._PREFILL_OVERRIDE, flush=True)
import test_dense_splitd as D
import test_lightning as T
if "llama" in sys.argv:
    model = D._tiny_llama(torch.bfloat16, "cuda")
    ids = torch.randint(2, 64, (1, 40), generator=torch.Generator().manual_seed(0)).cuda()
    h = sp.patch(model, sp.DenseConfig())
    D._generate(model, ids)
    h.remove()
    torch.cuda.synchronize()
    print("llama done", torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(), flush=True)
q, k, v, decay, h0 = T.inputs(4, 1, 64, 128, 128, torch.bfloat16, "cuda", seed=9)
q2, k2, v2, _, h2 = T.inputs(1, 4096, 64, 128, 128, torch.bfloat16, "cuda", seed=10)
q2, k2 = q2 * 0.1, k2 * 0.1
compiled = torch.compile(lambda: tri.lightning_prefill(q, k, v, decay, initial_state=h0.clone()), fullgraph=True)
cases = [("eager B4 T1", lambda: tri.lightning_prefill(q, k, v, decay, initial_state=h0.clone()), (q, k, v, h0)),
         ("eager B1 T4096", lambda: tri.lightning_prefill(q2, k2, v2, decay, initial_state=h2.clone()),
          (q2, k2, v2, h2)),
         ("compiled B4 T1", compiled, (q, k, v, h0))]
for name, fn, (qq, kk, vv, hh) in cases:
    try:
        o, s = fn()
        torch.cuda.synchronize()
        o_r, s_r = T.ref.lightning_prefill(qq.cpu(), kk.cpu(), vv.cpu(), decay.cpu(), initial_state=hh.cpu())
        print(name, "ok", "rel err out %.1e state %.1e" % (T.rel(o.cpu(), o_r), T.rel(s.cpu(), s_r)), flush=True)
    except Exception as exc:
        print(name, "FAIL", repr(exc)[:150], flush=True)
        break
for key, kern in list(tri._prefill_kernel.device_caches[0][0].items())[:4]:
    md = kern.metadata
    print("variant", getattr(md, "shared", None), getattr(md, "num_stages", None), getattr(md, "num_warps", None), str(key)[:160])
