import os

import pytest
import torch

# Tests build tiny models with random weights; keep CPU runs deterministic and light on a 2-core machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Without CUDA the Triton kernels run through the interpreter (read when a kernel module is imported, so it is set
# here, before any test module imports one).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
