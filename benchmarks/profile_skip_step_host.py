"""Host and device time per stateful `skip_step` call (the patcher's path) at tile 64 vs 128, d64-video-model shape.

B2 S4096 H4 D64 bf16, threshold -1, warm-up 2: 50 eager calls timed on the host without and with a final
synchronize, CUDA events around 50 more, then a cProfile of 20 calls (where the host time goes). Needs CUDA.

    python benchmarks/profile_skip_step_host.py > benchmarks/results/<gpu>-skip-step-host-time.txt
"""
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sparsepatch.kernels.skip import stateful, triton as skip_triton
from sparsepatch.kernels.skip import gluon as skip_gluon
B, S, H, D = 2, 4096, 4, 64
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
for tile in ((64, 64), (128, 128)):
    buf = stateful.SkipListBuffers.create(B, H, S, S, tile, "cuda")
    f = lambda: stateful.skip_step(q, k, v, buf, -1.0, 2)
    for _ in range(5): f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50): f()
    host = (time.perf_counter() - t0) / 50 * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 50 * 1e3
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(); [f() for _ in range(50)]; e1.record(); torch.cuda.synchronize()
    print(f"tile {tile}: host {host:.3f} ms/call, wall {wall:.3f}, events {e0.elapsed_time(e1)/50:.3f}, "
          f"gluon_ok {skip_triton._GLUON_OK[0]} supported {skip_gluon.supported(q, k, v, tile)} "
          f"plans {len(skip_gluon._PLANS)} direct {skip_gluon._DIRECT[0]}", flush=True)
    pr = cProfile.Profile(); pr.enable(); [f() for _ in range(20)]; torch.cuda.synchronize(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(14); print(s.getvalue()[-2500:])
