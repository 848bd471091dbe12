"""Tiny models built from configs (no download) and synthetic workloads, for tests, the demo and notebooks."""
from __future__ import annotations

import math
import re

import torch

_WORDS = ["<pad>", "</s>", "<unk>", "a", "cat", "dog", "runs", "on", "the", "beach", "red", "ball", "sunset",
          "city", "night", "rain", "blurry", "low", "quality"]


def tiny_tokenizer(model_max_length: int = 16):
    """A WordLevel fast tokenizer over a few words (T5-style: pad=0, eos=1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(_WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=model_max_length)


def _tiny_t5_encoder(cls_name: str, d_model: int):
    import transformers
    cfg = transformers.UMT5Config if cls_name == "UMT5EncoderModel" else transformers.T5Config
    config = cfg(vocab_size=len(_WORDS), d_model=d_model, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                 relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=0,
                 eos_token_id=1, decoder_start_token_id=0)
    return getattr(transformers, cls_name)(config).eval()


def tiny_wan_pipeline(num_layers: int = 2, heads: int = 2, head_dim: int = 16, seed: int = 0,
                      attention_gain: float = 1.0, two_transformers: bool = False):
    """A WanPipeline with random tiny components. attention_gain scales q/k projections (sharper attention)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    torch.manual_seed(seed)
    text_dim = 16

    def transformer():
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4,
            out_channels=4, text_dim=text_dim, freq_dim=16, ffn_dim=32, num_layers=num_layers,
            cross_attn_norm=True, rope_max_seq_len=32).eval()
        _sharpen(model, attention_gain)
        return model

    vae = AutoencoderKLWan(base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                           latents_std=[1.0] * 4).eval()
    return WanPipeline(
        tokenizer=tiny_tokenizer(), text_encoder=_tiny_t5_encoder("UMT5EncoderModel", text_dim), vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=transformer(),
        transformer_2=transformer() if two_transformers else None,
        boundary_ratio=0.5 if two_transformers else None)


def wan_call_kwargs(height: int = 64, width: int = 64, num_frames: int = 9, steps: int = 4, seed: int = 0,
                    guidance_scale: float = 5.0) -> dict:
    """Arguments for a tiny WanPipeline call; latents are (1, 4, (F-1)/4+1, H/8, W/8)."""
    return dict(prompt="a cat runs on the beach", negative_prompt="blurry low quality", height=height,
                width=width, num_frames=num_frames, num_inference_steps=steps, guidance_scale=guidance_scale,
                generator=torch.Generator().manual_seed(seed), output_type="pt", max_sequence_length=16)


_SAMPLER_CLASS = None


def _euler_flow_sampler_class():
    """EulerFlowSampler, defined on first use (importing diffusers' DiffusionPipeline costs seconds)."""
    global _SAMPLER_CLASS
    if _SAMPLER_CLASS is not None:
        return _SAMPLER_CLASS
    from diffusers import DiffusionPipeline

    class EulerFlowSampler(DiffusionPipeline):
        """Rectified-flow Euler sampler around a bare WanTransformer3DModel, in latent space (no VAE).

        x_1 ~ N(0, I); x_{t'} = x_t + (t' - t) v(x_t, t) over `num_inference_steps` steps on the grid
        t_i = shift u_i / (1 + (shift - 1) u_i), u uniform from 1 to 0 (shift > 1 spends more steps at high noise,
        where a sample's layout is decided: the scheduler shift of Wan / SD3); returns x_0 (B, C, F, H, W) fp32.
        With `latents` (clean clips) and `strength` s in (0, 1]: start from x_s = (1 - s) latents + s noise and
        integrate s -> 0 on the same warped grid (SDEdit-style partial denoising).
        guidance_scale w != 1: classifier-free guidance, v = v(null) + w (v(text) - v(null)), the null prompt being
        `negative_text` or, by default, an all-zero text embedding (what condition dropout trains on).
        A DiffusionPipeline, so `sp.patch` / `sp.validate` treat it like any pipeline: each transformer call runs
        inside `transformer.cache_context("cond")` (and "uncond" for the guidance call, like diffusers' Wan
        pipelines), so the skip state advances one step per call and branch; `callback_on_step_end(pipe, step,
        timestep, {"latents": x})` after each step, and `maybe_free_model_hooks()` at the end resets the skip lists
        between videos, as every diffusers pipeline. The Euler state stays fp32 whatever the transformer's dtype.
        """

        def __init__(self, transformer):
            super().__init__()
            self.register_modules(transformer=transformer)

        @staticmethod
        def timesteps(num_inference_steps: int, shift: float = 1.0, strength: float = 1.0) -> torch.Tensor:
            """The noise levels t_0 > ... > t_n = 0 (fp32, n + 1 values) the sampler visits; t_0 = strength."""
            if num_inference_steps < 1:
                raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
            if shift <= 0:
                raise ValueError(f"shift must be > 0, got {shift}")
            if not 0.0 < strength <= 1.0:
                raise ValueError(f"strength must be in (0, 1], got {strength}")
            u0 = strength / (shift - (shift - 1.0) * strength)        # the warp's inverse at t = strength
            u = torch.linspace(u0, 0.0, num_inference_steps + 1, dtype=torch.float64)
            return (shift * u / (1.0 + (shift - 1.0) * u)).float()

        @torch.no_grad()
        def __call__(self, text, shape, num_inference_steps=10, generator=None, callback_on_step_end=None,
                     latents=None, strength: float = 1.0, shift: float = 1.0, guidance_scale: float = 1.0,
                     negative_text=None):
            tr = self.transformer
            x = torch.randn(shape, generator=generator, dtype=torch.float32).to(tr.device)
            if latents is not None:
                x = (1.0 - strength) * latents.to(x.device, torch.float32) + strength * x
            text = text.to(tr.device, tr.dtype)
            guided = guidance_scale != 1.0
            if guided:
                null = torch.zeros_like(text) if negative_text is None else negative_text.to(tr.device, tr.dtype)
                if null.shape != text.shape:
                    raise ValueError(f"negative_text: shape {tuple(null.shape)} != text {tuple(text.shape)}")
            ts = self.timesteps(num_inference_steps, shift, strength if latents is not None else 1.0)
            for i in range(num_inference_steps):
                t = float(ts[i])
                timestep = torch.full((shape[0],), 1000.0 * t, device=tr.device)
                with tr.cache_context("cond"):
                    v = tr(hidden_states=x.to(tr.dtype), timestep=timestep, encoder_hidden_states=text,
                           return_dict=False)[0].float()
                if guided:
                    with tr.cache_context("uncond"):
                        v_null = tr(hidden_states=x.to(tr.dtype), timestep=timestep, encoder_hidden_states=null,
                                    return_dict=False)[0].float()
                    v = v_null + guidance_scale * (v - v_null)
                x = x + (float(ts[i + 1]) - t) * v
                if callback_on_step_end is not None:
                    out = callback_on_step_end(self, i, timestep, {"latents": x})
                    x = (out or {}).get("latents", x)
            self.maybe_free_model_hooks()    # ends the video: resets the skip lists
            return x

    _SAMPLER_CLASS = EulerFlowSampler
    return EulerFlowSampler


def euler_flow_sampler(transformer):
    """An EulerFlowSampler pipeline (see `_euler_flow_sampler_class`) around `transformer`."""
    return _euler_flow_sampler_class()(transformer)


def tiny_trained_video_pipeline(path=None, dtype=None, random_weights: bool = False):
    """The committed trained tiny video denoiser (`sparsepatch/assets/tiny_video`) in an EulerFlowSampler.

    Returns (pipe, info); info has "frames", "latent_size", "text_len" (the latent shapes it was trained on) and
    the rest of training_info.json. random_weights: the same architecture at its random initialisation
    (`train_tiny_video.build_initial`'s seed) instead, as a control.
    """
    from .recipes import train_tiny_video as ttv
    transformer, info = ttv.load_trained(path, dtype=dtype)
    if random_weights:
        from diffusers import WanTransformer3DModel
        torch.manual_seed(ttv.SEED)
        transformer = WanTransformer3DModel.from_config(transformer.config).eval()
        if dtype is not None and dtype != torch.float32:
            transformer = transformer.to(dtype)
    return euler_flow_sampler(transformer), info


def trained_video_call_kwargs(pipe, info: dict, batch: int = 2, frames: int | None = None,
                              latent_size: int | None = None, steps: int = 10, seed: int = 0,
                              shift: float | None = None, guidance_scale: float | None = None) -> dict:
    """Arguments for `tiny_trained_video_pipeline`'s sampler: clip i of the batch is prompted with procedural
    class i % NUM_CLASSES (its fixed text embedding, `data.class_text_embeddings`, as in training); latents
    (batch, C, frames, latent_size, latent_size), by default the trained shape. shift / guidance_scale: the
    sampler's timestep shift and CFG scale, by default those recorded with the weights (info["sampler"], else 1)."""
    from .recipes.data import class_text_embeddings
    tr = pipe.transformer
    table = class_text_embeddings(text_len=info["text_len"], text_dim=tr.config.text_dim, seed=0)
    size = latent_size or info["latent_size"]
    shape = (batch, tr.config.in_channels, frames or info["frames"], size, size)
    sampler = info.get("sampler") or {}
    return dict(text=table[torch.arange(batch) % len(table)], shape=shape, num_inference_steps=steps,
                generator=torch.Generator().manual_seed(seed),
                shift=float(sampler.get("shift", 1.0) if shift is None else shift),
                guidance_scale=float(sampler.get("guidance_scale", 1.0) if guidance_scale is None else guidance_scale))


def tiny_cogvideox_pipeline(num_layers: int = 2, seed: int = 0, attention_gain: float = 1.0):
    """A CogVideoXPipeline (batched CFG, F.scaled_dot_product_attention called directly, text-prefix joint attn)."""
    from diffusers import (AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline,
                           CogVideoXTransformer3DModel)
    torch.manual_seed(seed)
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=16, num_layers=num_layers, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=16).eval()
    _sharpen(transformer, attention_gain)
    vae = AutoencoderKLCogVideoX(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
        layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4).eval()
    return CogVideoXPipeline(tokenizer=tiny_tokenizer(), text_encoder=_tiny_t5_encoder("T5EncoderModel", 16),
                             vae=vae, transformer=transformer, scheduler=CogVideoXDDIMScheduler())


def cogvideox_call_kwargs(steps: int = 4, seed: int = 0) -> dict:
    return dict(prompt="a dog runs on the beach", negative_prompt="blurry", height=64, width=64, num_frames=9,
                num_inference_steps=steps, guidance_scale=6.0, generator=torch.Generator().manual_seed(seed),
                output_type="pt", max_sequence_length=16)


def tiny_hunyuan_video_transformer(num_layers: int = 1, num_single_layers: int = 1, seed: int = 0):
    """A HunyuanVideoTransformer3DModel (joint text+video attention, text after video, key-padding mask)."""
    from diffusers import HunyuanVideoTransformer3DModel
    torch.manual_seed(seed)
    return HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=num_layers,
        num_single_layers=num_single_layers, num_refiner_layers=1, patch_size=1, patch_size_t=1,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(4, 6, 6)).eval()


def hunyuan_inputs(steps_seed: int = 0, frames: int = 3, size: int = 8, text_len: int = 10, valid: int = 7):
    """Inputs for one HunyuanVideo transformer call: latents (1, 4, F, H, W) and a padded text of `text_len`."""
    g = torch.Generator().manual_seed(steps_seed)
    mask = torch.zeros(1, text_len, dtype=torch.long)
    mask[:, :valid] = 1
    return dict(hidden_states=torch.randn(1, 4, frames, size, size, generator=g),
                encoder_hidden_states=torch.randn(1, text_len, 16, generator=g), encoder_attention_mask=mask,
                pooled_projections=torch.randn(1, 8, generator=g), guidance=torch.tensor([4.0]) * 1000)


def _sharpen(model, gain: float) -> None:
    """Multiply attention logits by `gain`: random weights attend almost uniformly, real DiTs do not; a gain > 1
    gives the tiny model peaked attention so skipping has something to find. Scales the q/k RMSNorm weights where
    the model normalises q and k (Wan, CogVideoX, HunyuanVideo), else the q/k projections."""
    if gain == 1.0:
        return
    with torch.no_grad():
        names = [n for n, _ in model.named_parameters()]
        normed = any(re.search(r"norm_(q|k)\.weight$", n) for n in names)
        pattern = r"norm_(q|k)\.weight$" if normed else r"(to_q|to_k)\.(weight|bias)$"
        for name, p in model.named_parameters():
            if re.search(pattern, name):
                p.mul_(math.sqrt(gain))


def video_like_qkv(B=1, heads=2, frames=4, height=8, width=8, dim=32, step=0, drift=0.02, seed=0,
                   locality=6.0, dtype=torch.float32, device="cpu"):
    """Synthetic video-like attention inputs (B, S, H, D), S = frames*height*width.

    Queries and keys are sinusoidal embeddings of each token's (t, y, x) position plus noise, so scores fall with
    3D distance (local attention, like video DiTs); `step` drifts the noise slowly, like denoising steps.
    """
    g = torch.Generator().manual_seed(seed)
    t, y, x = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    pos = torch.stack([t, y, x], -1).reshape(-1, 3).float()                  # (S, 3)
    nfreq = dim // 6
    freqs = torch.exp(-torch.arange(nfreq).float() / max(nfreq, 1) * math.log(8.0)) * 0.9
    ang = pos[:, :, None] * freqs                                            # (S, 3, nfreq)
    emb = torch.cat([ang.sin(), ang.cos()], -1).reshape(pos.shape[0], -1)    # (S, 6*nfreq)
    emb = torch.nn.functional.pad(emb, (0, dim - emb.shape[1]))
    base = emb[None, :, None, :].expand(B, -1, heads, -1)
    noise0 = torch.randn(3, B, pos.shape[0], heads, dim, generator=g)
    noise1 = torch.randn(3, B, pos.shape[0], heads, dim, generator=g)
    noise = noise0 * math.cos(drift * step) + noise1 * math.sin(drift * step)
    q = base * locality + 0.3 * noise[0]
    k = base * locality + 0.3 * noise[1]
    v = noise[2]
    return tuple(t.to(dtype=dtype, device=device).contiguous() for t in (q, k, v))

