import os

import pytest
import torch

# Tests build tiny models with random weights; keep CPU runs deterministic and light on a 2-core machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Without CUDA the Triton kernels run through the interpreter (read when a kernel module is imported, so it is set
# here, before any test module imports one).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    # The thread count changes how CPU kernels split their sums, hence their rounding: `make test-matrix` runs the
    # numeric tests at 1 and 2 threads (and two ATEN_CPU_CAPABILITY vector widths) to show the tolerances hold.
    parser.addoption("--threads", type=int, default=None, metavar="N",
                     help="torch.set_num_threads(N) before the tests (default min(2, CPU count))")


def pytest_configure(config):
    n = config.getoption("--threads")
    if n is not None:
        if n < 1:
            raise pytest.UsageError(f"--threads must be >= 1, got {n}")
        torch.set_num_threads(n)


def pytest_report_header(config):
    return (f"torch {torch.__version__}: CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} threads")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
