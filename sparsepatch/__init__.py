"""sparsepatch: sparse and fast attention kernels patched into diffusers pipelines and transformers models.

    import sparsepatch as sp
    h = sp.patch(pipe)            # recipe for the model class; or sp.patch(pipe, sp.SkipConfig(threshold=-6))
    pipe(...)                     # as before
    h.stats()                     # calls and per-layer, per-branch density per step
    sp.unpatch(pipe)              # bit-exact restore
"""
from . import kernels
from .config import DenseConfig, LightningConfig, NSAConfig, SkipConfig
from . import patcher, recipes
from .patcher import PatchHandle, handle_of, unpatch
from .validate import GradientReport, ValidationReport, validate, validate_gradients

__version__ = "0.1.0"


def patch(pipe_or_model, config=None) -> PatchHandle:
    """Swap the attention of a diffusers pipeline/model or a transformers model for sparsepatch kernels.

    config None picks the recipe for the model class (sparsepatch.recipes). Returns a PatchHandle; `unpatch`
    (or `handle.remove()`) restores the model bit-exactly. Patching an already patched object raises ValueError.
    """
    if config is None:
        config = recipes.default_config(pipe_or_model)
    return patcher.patch(pipe_or_model, config)
def tune(**kwargs):
    """Measure the dense dispatcher's cost table on this GPU once and cache it (`sparsepatch.kernels.tune`)."""
    return kernels.tune(**kwargs)


__all__ = ["tune", "patch", "unpatch", "handle_of", "PatchHandle", "SkipConfig", "DenseConfig", "NSAConfig",
           "LightningConfig", "validate", "ValidationReport", "validate_gradients", "GradientReport", "kernels"]
