"""Dense attention: `attention` (any head dim, masks, GQA, causal; never slower than SDPA where measured) and the
inference-only `attention_fp8`. Backends in op.py; the oracle in reference.py."""
from .op import BACKENDS, FP8_BACKENDS, attention, attention_fp8, backend_for, check_attention_inputs, explain

__all__ = ["attention", "backend_for", "attention_fp8", "explain", "check_attention_inputs", "BACKENDS", "FP8_BACKENDS"]
