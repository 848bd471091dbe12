"""Per-model-family presets: which config `sp.patch(obj)` uses when none is given. Data, not logic.

Thresholds are in log2 units relative to the running row max (see SkipConfig). Values follow the LiteAttention
defaults for video DiTs (-5: tiles below ~3% of the running max are dropped for the rest of the video) with one
dense warmup step, the step where the lists are least settled.
"""
from __future__ import annotations

from ..config import DenseConfig, LightningConfig, SkipConfig

VIDEO_SKIP = dict(threshold=-5.0, warmup_steps=1, tile=(128, 128))

RECIPES: dict[str, tuple[type, dict]] = {
    # diffusers video denoisers: temporal skip lists
    "WanTransformer3DModel": (SkipConfig, VIDEO_SKIP),
    "WanVACETransformer3DModel": (SkipConfig, VIDEO_SKIP),
    "WanAnimateTransformer3DModel": (SkipConfig, VIDEO_SKIP),
    "HunyuanVideoTransformer3DModel": (SkipConfig, VIDEO_SKIP),
    "HunyuanVideoFramepackTransformer3DModel": (SkipConfig, VIDEO_SKIP),
    "CogVideoXTransformer3DModel": (SkipConfig, VIDEO_SKIP),
    "LTXVideoTransformer3DModel": (SkipConfig, VIDEO_SKIP),
    "MochiTransformer3DModel": (SkipConfig, VIDEO_SKIP),
    "FluxTransformer2DModel": (SkipConfig, dict(VIDEO_SKIP, threshold=-7.0)),
    # transformers LLMs, by model_type (any head: ForCausalLM, base model, ...): attention call sites checked
    # against the adapter (q/k/v (B, H, L, D), masks from create_causal_mask / sliding-window masks)
    "llama": (DenseConfig, {}),
    "mistral": (DenseConfig, {}),
    "qwen2": (DenseConfig, {}),
    "qwen3": (DenseConfig, {}),
    "minimax": (LightningConfig, {}),     # lightning layers through the lightning kernels
}


def recipe_for(*keys: str):
    """A fresh config for the first key (model class name or model_type) with a recipe; ValueError otherwise."""
    for key in keys:
        if key in RECIPES:
            cls, kwargs = RECIPES[key]
            return cls(**kwargs)
    raise ValueError(f"pipe_or_model: no sparsepatch recipe for {list(keys)}; pass a config explicitly, e.g. "
                     f"sp.patch(obj, sp.DenseConfig()) (known: {sorted(RECIPES)})")


def default_config(pipe_or_model):
    """The recipe config for a pipeline/model, chosen from its denoiser class or its transformers model_type."""
    from ..patcher import recipe_keys
    return recipe_for(*recipe_keys(pipe_or_model))
