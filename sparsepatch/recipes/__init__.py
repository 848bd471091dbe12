"""Per-model-family presets: which config `sp.patch(obj)` uses when none is given. Data, not logic.

Thresholds are in log2 units relative to the running row max (see SkipConfig). Values follow the LiteAttention
defaults for video DiTs (-5: tiles below ~3% of the running max are dropped for the rest of the video) with one
dense warmup step, the step where the lists are least settled.
"""
from __future__ import annotations

from ..config import DenseConfig, SkipConfig

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
    # transformers LLMs: the bundled dense kernel (NSA / lightning arrive with their issues)
    "LlamaForCausalLM": (DenseConfig, {}),
    "Qwen2ForCausalLM": (DenseConfig, {}),
    "Qwen3ForCausalLM": (DenseConfig, {}),
    "MistralForCausalLM": (DenseConfig, {}),
}


def recipe_for(class_name: str):
    """A fresh config for a model class name; ValueError naming the class when there is no recipe."""
    if class_name not in RECIPES:
        raise ValueError(f"pipe_or_model: no sparsepatch recipe for {class_name}; pass a config explicitly "
                         f"(known: {sorted(RECIPES)})")
    cls, kwargs = RECIPES[class_name]
    return cls(**kwargs)
