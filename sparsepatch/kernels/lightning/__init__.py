"""Lightning (linear) attention: `lightning_decode` and `lightning_prefill`."""
from .op import lightning_decode, lightning_prefill

__all__ = ["lightning_decode", "lightning_prefill"]
