"""Host ms per piece of one eager NSA forward (HQ64 H4 D128 bf16, 4K tokens, selection tile and token): perf_counter
around each Triton launch (`JITFunction.run` of every NSA forward kernel), `compress_kv`, `_descs` and the input
checks; "rest" = the call's other Python and PyTorch work. Run on a GPU:

    PYTHONPATH=. python benchmarks/profile_nsa_host.py          # JSON: $OUT or benchmarks/results, <gpu>-nsa-host-pieces.json

Issue 27, session 19: a tile-mode call at 4K waits on the host when its host time exceeds its ~0.49 ms of GPU work
(`bench_nsa.py --host-bound`)."""
import json
import os
import time

import torch

from sparsepatch.config import NSAConfig
from sparsepatch.kernels.nsa import forward as nsa
from sparsepatch.kernels.nsa import reference as ref

KERNELS = ("_cmp_kernel", "_topk_kernel", "_tile_branches_kernel", "_slc_tile_kernel", "_slc_kernel", "_swa_kernel")


def _timed(obj, name, key, acc):
    """Replace obj.name by a wrapper adding its host seconds to acc[key]."""
    orig = getattr(obj, name)

    def run(*a, **kw):
        t = time.perf_counter()
        r = orig(*a, **kw)
        acc[key] = acc.get(key, 0.0) + time.perf_counter() - t
        return r
    setattr(obj, name, run)


def main(T=4096, n=100):
    acc = {}
    for kn in KERNELS:
        _timed(getattr(nsa, kn), "run", kn, acc)
    _timed(nsa, "compress_kv", "compress_kv", acc)
    _timed(nsa, "_descs", "_descs", acc)          # the host TMA descriptors (none of these pieces nests another)
    _timed(ref, "_check_common", "_check_common", acc)
    g = torch.Generator(device="cuda").manual_seed(T)
    q, k, v = (torch.randn(1, T, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (64, 4, 4))
    res = {"device": torch.cuda.get_device_name(), "T": T}
    with torch.no_grad():
        for sel in ("tile", "token"):
            cfg = NSAConfig(selection=sel)
            for _ in range(5):
                nsa.nsa_attention(q, k, v, cfg)
            torch.cuda.synchronize()
            acc.clear()
            t0 = time.perf_counter()
            for _ in range(n):
                nsa.nsa_attention(q, k, v, cfg)
            total = time.perf_counter() - t0
            torch.cuda.synchronize()
            r = {kk: round(vv / n * 1e3, 4) for kk, vv in acc.items()}
            r["total"] = round(total / n * 1e3, 4)
            r["rest"] = round(r["total"] - sum(vv for kk, vv in r.items() if kk != "total"), 4)
            res[sel] = r
            print(sel, "host ms per call:", json.dumps(r), flush=True)
    dev = res["device"]
    gpu = "h100" if "H100" in dev else ("h200" if "H200" in dev else dev.split()[-1].lower())
    out = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{gpu}-nsa-host-pieces.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
