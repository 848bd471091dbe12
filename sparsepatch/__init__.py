"""sparsepatch: sparse and fast attention kernels patched into diffusers pipelines and transformers models.

    import sparsepatch as sp
    h = sp.patch(pipe)            # recipe for the model class; or sp.patch(pipe, sp.SkipConfig(threshold=-6))
    pipe(...)                     # as before
    h.stats()                     # calls and per-layer, per-branch density per step
    sp.unpatch(pipe)              # bit-exact restore
"""
from . import kernels
from .config import DenseConfig, LightningConfig, NSAConfig, SkipConfig
from .patcher import PatchHandle, handle_of, patch, unpatch
from .validate import ValidationReport, validate

__version__ = "0.1.0"
__all__ = ["patch", "unpatch", "handle_of", "PatchHandle", "SkipConfig", "DenseConfig", "NSAConfig",
           "LightningConfig", "validate", "ValidationReport", "kernels"]
