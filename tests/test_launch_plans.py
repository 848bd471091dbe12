"""`_common.LaunchPlans` (the direct-launch plans of the fp8 quantize and fp8 skip launches): host logic on CPU with
a stand-in kernel. The first launch of a key goes through the kernel's runner (fn[grid](...)) with host descriptors
as Triton TensorDescriptors; later launches with the same key relaunch the recorded plan with the new tensors and
descriptors; anything Triton specialises on (a plain value, a tensor's dtype or 16-byte alignment, a descriptor's
geometry) gives a new key; a failing relaunch turns the caller's plans off. The GPU side (the compiled launcher
itself) is tests/test_skip_fp8.py::test_gpu_launch_plans."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparsepatch.kernels import _common  # noqa: E402
from sparsepatch.kernels._common import DescriptorArgs, LaunchPlans  # noqa: E402


class _Compiled:
    """Stands in for a CompiledKernel: kern[grid](*args, stream=...) records a planned launch."""

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            self.log.append(("plan", grid, args, stream))
        return runner


class _Jit:
    """Stands in for a JITFunction: fn[grid](*args, **opts) records a runner launch and returns a compiled kernel."""

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **opts):
            self.log.append(("jit", grid, args, opts))
            return _Compiled(self.log)
        return launch


@pytest.fixture
def plans(monkeypatch):
    # CPU tensors stand for device 0's: the plan's device, current device and stream are the only CUDA queries
    monkeypatch.setattr(_common, "_plan_device", lambda args: 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_common, "current_stream", lambda index: f"stream{index}")
    p = LaunchPlans("test")
    p.enabled[0] = True            # (off under the interpreter, where nothing is planned)
    return p


def _args(n=4, shape=(64, 32)):
    x = torch.zeros(shape, dtype=torch.int8)
    y = torch.zeros(8, dtype=torch.float32)
    desc = DescriptorArgs(x, list(shape), [shape[1], 1], [16, shape[1]], "zero")
    return [x, y, desc, n, 0.5, True]


def test_launch_plans_reuse_and_keys(plans):
    fn = _Jit()
    a = _args()
    plans.launch(fn, (3, 2), a, num_warps=4, num_stages=3)
    kind, grid, args, opts = fn.log[-1]
    assert kind == "jit" and grid == (3, 2) and opts == dict(num_warps=4, num_stages=3)
    from triton.tools.tensor_descriptor import TensorDescriptor
    assert isinstance(args[2], TensorDescriptor) and args[2].base is a[0] and list(args[2].block_shape) == [16, 32]
    assert args[0] is a[0] and args[3:] == (4, 0.5, True)
    assert len(plans.plans) == 1

    b = _args()                                        # new tensors, same key: the recorded plan, new pointers
    plans.launch(fn, (3, 2), b, num_warps=4, num_stages=3)
    kind, grid, args, stream = fn.log[-1]
    assert kind == "plan" and grid == (3, 2, 1) and stream == "stream0"
    assert args[0] is b[0] and args[1] is b[1] and args[2] is b[2] and args[3:] == (4, 0.5, True)
    assert len(plans.plans) == 1 and len(fn.log) == 2

    changed = [_args(n=5),                                           # a plain value
               _args(shape=(32, 32)),                                # a descriptor's geometry
               [*_args()[:1], torch.zeros(8, dtype=torch.float64), *_args()[2:]]]   # a tensor's dtype
    raw = torch.zeros(64 * 32 + 1, dtype=torch.int8)
    unaligned = _args()
    unaligned[0] = raw[1:].view(64, 32)                # 1 byte off a 16-byte boundary
    unaligned[2] = DescriptorArgs(torch.zeros(64, 32, dtype=torch.int8), [64, 32], [32, 1], [16, 32], "zero")
    changed.append(unaligned)
    for i, c in enumerate(changed):
        plans.launch(fn, (3, 2), c, num_warps=4, num_stages=3)
        assert fn.log[-1][0] == "jit", i
        assert len(plans.plans) == 2 + i
    plans.launch(fn, (4, 2), _args(), num_warps=4, num_stages=3)   # the grid
    plans.launch(fn, (3, 2), _args(), num_warps=8, num_stages=3)   # the warps
    assert [e[0] for e in fn.log[-2:]] == ["jit", "jit"] and len(plans.plans) == 1 + len(changed) + 2
    plans.launch(fn, (3, 2), _args(n=5), num_warps=4, num_stages=3)  # an earlier key again: its plan
    assert fn.log[-1][0] == "plan"


def test_launch_plans_failure_turns_plans_off(plans):
    fn = _Jit()
    plans.launch(fn, (2,), _args(), num_warps=8)
    assert fn.log[-1][3] == dict(num_warps=8)          # no num_stages given: the kernel's default

    def broken(stream, *args):
        raise RuntimeError("launcher mismatch")
    key = next(iter(plans.plans))
    plans.plans[key] = broken
    with pytest.warns(UserWarning, match="direct relaunch failed"):
        plans.launch(fn, (2,), _args(), num_warps=8)
    assert fn.log[-1][0] == "jit"                      # the call still ran, through the runner
    assert plans.enabled[0] is False and not plans.plans
    plans.launch(fn, (2,), _args(), num_warps=8)
    assert fn.log[-1][0] == "jit" and not plans.plans  # and every later call


def test_launch_plans_limit(plans):
    plans.limit = 3
    fn = _Jit()
    for n in range(5):
        plans.launch(fn, (1,), _args(n=n), num_warps=4)
    assert 1 <= len(plans.plans) <= 3


def test_launch_plans_cpu_tensors_not_planned(monkeypatch):
    """Without the stand-in device: CPU tensors are never planned (every launch through the runner)."""
    p = LaunchPlans("test")
    p.enabled[0] = True
    fn = _Jit()
    for _ in range(2):
        p.launch(fn, (1,), _args(), num_warps=4)
    assert [e[0] for e in fn.log] == ["jit", "jit"] and not p.plans
