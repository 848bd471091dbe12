"""Shared by the Triton kernel tests: markers for interpreter / GPU runs and the relative error they assert on.

conftest.py sets TRITON_INTERPRET=1 on machines without CUDA before any test module imports Triton.
"""
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
cpu_only = pytest.mark.skipif(not INTERP, reason="interpreter tests (TRITON_INTERPRET=1, no CUDA)")
gpu = pytest.mark.gpu


def rel(got, want) -> float:
    """||got - want|| / ||want|| in fp64 (want is the reference)."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
