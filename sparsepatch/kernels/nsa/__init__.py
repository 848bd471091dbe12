"""Native Sparse Attention: `nsa_attention`, its decode cache `NSACache` and kernel parameters `NSAParams`."""
from .op import BACKENDS, nsa_attention
from .reference import NSACache, NSAParams, check_config, nsa_density

__all__ = ["nsa_attention", "NSACache", "NSAParams", "check_config", "nsa_density", "BACKENDS"]
