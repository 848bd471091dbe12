"""Offline sm_90 compile of the NSA decode kernels (no GPU): Triton's compiler under a fake CUDA driver, the host code
of `nsa_decode` run on meta tensors with its kernel launches replaced by `warmup` compiles. Writes PTX / SASS per
kernel and prints registers, stack bytes, static shared memory and SASS instruction counts.

    PYTHONPATH=/path/to/triton-3.6:$PWD python benchmarks/offline_nsa_decode.py OUTDIR [NAME=VALUE ...]

NAME=VALUE sets a module switch of sparsepatch.kernels.nsa.decode first (e.g. GIVEN_EARLY=False TARGET_PROGRAMS=160).
Shapes: HQ64/H4 D128 bf16 B=1 at S 8192 and 65536, the per-token and the given-selection step (NSAConfig()).
Integer arguments are specialised as on the device (1 / multiples of 16), pointers as 16-byte aligned.
"""
import inspect
import json
import os
import re
import subprocess
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime.driver import driver as _drv


class FakeDriver(CudaDriver):
    def __init__(self):
        pass

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


_drv.set_active(FakeDriver())
from sparsepatch.config import NSAConfig  # noqa: E402
from sparsepatch.kernels.nsa import decode as dec  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
dec.num_sms = lambda d: 132                                     # H100 / H200
_src = inspect.getsource(dec.nsa_decode).replace('on_gpu = dev.type == "cuda"', 'on_gpu = True')
assert "on_gpu = True" in _src
exec(compile(_src, dec.__file__, "exec"), dec.__dict__)         # the host code as on a GPU, on meta tensors
COMPILED = []


class Fake:
    """kernel[grid](*args, **meta) -> kernel.warmup(...) with CPU stand-ins for the (meta) tensors."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kw):
            a2 = [torch.empty(64, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
            COMPILED.append((self.fn.__name__, grid, kw, self.fn.warmup(*a2, grid=grid, **kw)))
        return launch


for _n in ("_dec_cmp_kernel", "_dec_sel_kernel"):
    setattr(dec, _n, Fake(getattr(dec, _n)))


def step(S, given, HQ=64, H=4, D=128, B=1):
    cfg = NSAConfig()
    q = torch.empty(B, 1, HQ, D, device="meta", dtype=torch.bfloat16)
    k = torch.empty(B, S, H, D, device="meta", dtype=torch.bfloat16)
    n_c = (S - cfg.compress_block) // cfg.compress_stride + 1
    kc = torch.empty(B, n_c, H, D, device="meta", dtype=torch.bfloat16)
    idx = torch.empty(B, H, cfg.num_selected, device="meta", dtype=torch.int32) if given else None
    dec.nsa_decode(q, k, k, kc, kc, None, D ** -0.5, cfg, indices=idx)


def main(out, settings):
    os.makedirs(out, exist_ok=True)
    for kv in settings:
        n, val = kv.split("=", 1)
        setattr(dec, n, eval(val))
    rows = []
    for S in (8192, 65536):
        for given in (False, True):
            COMPILED.clear()
            step(S, given)
            for name, grid, meta, k in COMPILED:
                flags = "-".join(f"{a}{int(b)}" for a, b in sorted(meta.items()) if isinstance(b, bool) and a.isupper()
                                 and (a.startswith("DO_") or a in ("ONE_CNT", "SYNC")))
                tag = f"{name}-S{S}-{'given' if given else 'token'}-{flags}"
                with open(os.path.join(out, tag + ".ptx"), "w") as f:
                    f.write(k.asm["ptx"])
                cub = os.path.join(out, tag + ".cubin")
                with open(cub, "wb") as f:
                    f.write(k.asm["cubin"])
                res = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", cub],
                                     capture_output=True, text=True).stdout
                sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-sass", cub], capture_output=True,
                                      text=True).stdout
                with open(os.path.join(out, tag + ".sass"), "w") as f:
                    f.write(sass)
                reg, stack = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
                r = dict(tag=tag, grid=str(grid), regs=int(reg.group(1)) if reg else None,
                         stack=int(stack.group(1)) if stack else None, shared=k.metadata.shared,
                         sass_instr=len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M)))
                rows.append(r)
                print(f"{tag:90s} grid {r['grid']:9s} regs {r['regs']} stack {r['stack']} shared {r['shared']} "
                      f"sass {r['sass_instr']}", flush=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
