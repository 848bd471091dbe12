"""Native Sparse Attention: `nsa_attention`, its decode cache `NSACache` and kernel parameters `NSAParams`."""
from .op import BACKENDS, nsa_attention
from .reference import NSACache, NSAParams

__all__ = ["nsa_attention", "NSACache", "NSAParams", "BACKENDS"]
