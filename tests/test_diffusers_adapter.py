"""diffusers adapter on tiny pipelines built from configs: skip state per layer/branch/step, exactness, unpatch."""
import pytest
import torch

import sparsepatch as sp
from kernel_checks import assert_agree, denoiser_bound, max_err
from sparsepatch.testing import (cogvideox_call_kwargs, hunyuan_inputs, tiny_cogvideox_pipeline,
                                 tiny_hunyuan_video_transformer, tiny_wan_pipeline, wan_call_kwargs)

KEEP_ALL = -1e9
WAN_TOKENS = 3 * 6 * 6           # wan_kwargs: 9 frames 96x96 -> latents (3, 12, 12) -> patches (1, 2, 2)
WAN_GUIDANCE = 5.0               # wan_call_kwargs' guidance_scale


@pytest.fixture(scope="module")
def wan():
    pipe = tiny_wan_pipeline(head_dim=32, attention_gain=100.0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def wan_kwargs(steps=4, **kw):
    return wan_call_kwargs(height=96, width=96, num_frames=9, steps=steps, **kw)


def _frames(pipe, **kw):
    with torch.no_grad():
        return pipe(**kw).frames


def _snapshot(pipe):
    """Everything the patch may touch: processor identities/classes/instance dicts, model instance attrs."""
    from diffusers.models import attention_dispatch as ad
    procs = {}
    for comp in ("transformer", "transformer_2"):
        model = getattr(pipe, comp, None)
        if model is None:
            continue
        for name, module in model.named_modules():
            if hasattr(module, "processor"):
                procs[(comp, name)] = (id(module.processor), type(module.processor), dict(vars(module.processor)))
        procs[(comp, "__dict__")] = sorted(vars(model))
    return procs, ad._AttentionBackendRegistry._active_backend, sorted(ad.AttentionBackendName._member_map_)


def dense_bound(dense, steps, tokens, guidance, layers=2):
    """fp32 rounding bound (per side) for a tiny pipeline's output: `steps` CFG steps through `layers` blocks whose
    attention sums over `tokens` keys (kernel_checks.denoiser_bound), at the output's magnitude."""
    return denoiser_bound(torch.float32, tokens, steps, layers, guidance, dense.abs().max().item())


def assert_equals_dense(out, dense, steps, tokens=WAN_TOKENS, guidance=WAN_GUIDANCE):
    """The patched run and the unpatched run are two fp32 evaluations of the same function."""
    assert_agree(out, dense, bound=dense_bound(dense, steps, tokens, guidance), what="patched vs dense")


def assert_monotone_stats(stats, layers, branches, steps):
    assert set(stats["density"]) == set(layers)
    for layer in layers:
        assert set(stats["density"][layer]) == set(branches), layer
        for branch in branches:
            series = stats["density"][layer][branch]
            assert len(series) == steps
            assert series[0] == 1.0
            assert all(b <= a + 1e-9 for a, b in zip(series, series[1:])), series


def test_wan_cfg_branches_density_and_unpatch_bit_exact(wan):
    dense = _frames(wan, **wan_kwargs())
    before = _snapshot(wan)   # after a first call: the pipeline itself adds a hook registry on first use
    handle = sp.patch(wan, sp.SkipConfig(threshold=-3.0, tile=(16, 16)))
    sparse = _frames(wan, **wan_kwargs())
    stats = handle.stats()
    layers = [f"transformer.blocks.{i}.attn1" for i in range(2)]
    assert_monotone_stats(stats, layers, {"cond", "uncond"}, 4)
    assert stats["calls"] == 2 * 2 * 4                            # layers x branches x steps
    assert min(stats["per_step"]) < 0.95                           # sharpened tiny model really skips
    assert stats["density"][layers[0]]["cond"][1] == 1.0          # warmup step, then the full list
    assert max_err(sparse, dense) > 2 * dense_bound(dense, 4, WAN_TOKENS, WAN_GUIDANCE)   # skipping shows above fp32
    # state was reset at the end of the pipeline call: a second video starts dense again
    _frames(wan, **wan_kwargs(steps=2))
    assert handle.stats()["density"][layers[0]]["cond"][4:] == [1.0, 1.0]
    sp.unpatch(wan)
    sp.unpatch(wan)                                                # idempotent
    assert _snapshot(wan) == before
    assert torch.equal(_frames(wan, **wan_kwargs()), dense)


def test_keep_everything_equals_dense_fp32(wan):
    dense = _frames(wan, **wan_kwargs())
    handle = sp.patch(wan, sp.SkipConfig(threshold=KEEP_ALL, tile=(16, 16)))
    try:
        out = _frames(wan, **wan_kwargs())
        assert all(d == 1.0 for layer in handle.stats()["density"].values() for s in layer.values() for d in s)
    finally:
        sp.unpatch(wan)
    assert_equals_dense(out, dense, steps=4)


def test_patch_twice_and_unknown_objects_raise(wan):
    sp.patch(wan, sp.DenseConfig())
    try:
        with pytest.raises(ValueError, match="already patched"):
            sp.patch(wan, sp.DenseConfig())
        with pytest.raises(ValueError, match="shares modules"):
            sp.patch(wan.transformer, sp.DenseConfig())
    finally:
        sp.unpatch(wan)
    with pytest.raises(ValueError, match="pipe_or_model"):
        sp.patch(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="config"):
        sp.patch(wan, config="fast please")


def test_dense_config_matches_and_counts_cross_attention(wan):
    dense = _frames(wan, **wan_kwargs(steps=2))
    handle = sp.patch(wan, sp.DenseConfig())
    try:
        out = _frames(wan, **wan_kwargs(steps=2))
        stats = handle.stats()
    finally:
        sp.unpatch(wan)
    assert "transformer.blocks.0.attn2" in stats["density"]        # cross-attention routed too with layers="all"
    assert stats["calls"] == 2 * 2 * 2 * 2                         # (attn1 + attn2) x layers x branches x steps
    assert_equals_dense(out, dense, steps=2)


def test_wan22_transformer_2_has_its_own_states():
    pipe = tiny_wan_pipeline(head_dim=32, attention_gain=100.0, two_transformers=True)
    pipe.set_progress_bar_config(disable=True)
    handle = sp.patch(pipe, sp.SkipConfig(threshold=-3.0, tile=(16, 16)))
    try:
        _frames(pipe, **wan_kwargs(steps=4))
        density = handle.stats()["density"]
    finally:
        sp.unpatch(pipe)
    high = density["transformer.blocks.0.attn1"]["cond"]
    low = density["transformer_2.blocks.0.attn1"]["cond"]
    assert len(high) + len(low) == 4 and len(high) >= 1 and len(low) >= 1
    assert low[0] == 1.0                                          # transformer_2 starts with its own warmup


def test_cogvideox_batched_cfg_and_direct_sdpa():
    pipe = tiny_cogvideox_pipeline(attention_gain=50.0)
    pipe.set_progress_bar_config(disable=True)
    kw = dict(cogvideox_call_kwargs(), output_type="latent")

    def make_kwargs():
        return dict(kw, generator=torch.Generator().manual_seed(0))
    dense = _frames(pipe, **make_kwargs())
    handle = sp.patch(pipe, sp.SkipConfig(threshold=KEEP_ALL, tile=(16, 16)))
    try:
        out = _frames(pipe, **kw)
        stats = handle.stats()
    finally:
        sp.unpatch(pipe)
    layers = [f"transformer.transformer_blocks.{i}.attn1" for i in range(2)]
    assert_monotone_stats(stats, layers, {"uncond", "cond"}, 4)   # batch halves named as CFG branches
    # 64x64x9 -> latents (4, 8, 8) -> 2x2 patches (48 tokens) after 16 text tokens; guidance 6; latents ~30
    assert_equals_dense(out, dense, steps=4, tokens=48 + 16, guidance=6.0)
    assert torch.equal(_frames(pipe, **make_kwargs()), dense)

    handle = sp.patch(pipe, sp.SkipConfig(threshold=-2.0, tile=(16, 16)))
    try:
        _frames(pipe, **dict(make_kwargs(), num_inference_steps=5))
        assert_monotone_stats(handle.stats(), layers, {"uncond", "cond"}, 5)
    finally:
        sp.unpatch(pipe)


def test_hunyuan_joint_attention_text_is_must_do_and_mask_is_exact():
    model = tiny_hunyuan_video_transformer()
    inputs, t = hunyuan_inputs(frames=3, size=8, text_len=10, valid=7), torch.tensor([500])
    with torch.no_grad():
        dense = model(timestep=t, **inputs).sample
    handle = sp.patch(model, sp.SkipConfig(threshold=KEEP_ALL, tile=(16, 16)))
    try:
        with torch.no_grad():
            for branch in ("cond", "uncond"):
                with model.cache_context(branch):
                    out = model(timestep=t, **inputs).sample
                    # padded text keys dropped exactly: one call, 2 blocks over 192 video + 7 text keys
                    assert_agree(out, dense, bound=dense_bound(dense, 1, 192 + 7, 1.0), what="hunyuan")
        assert set(handle.stats()["density"]) == {"transformer_blocks.0.attn", "single_transformer_blocks.0.attn"}
    finally:
        sp.unpatch(model)

    handle = sp.patch(model, sp.SkipConfig(threshold=-0.5, tile=(16, 16), warmup_steps=0))
    try:
        with torch.no_grad():
            for step in range(3):
                with model.cache_context("cond"):
                    model(timestep=t, **inputs)
        lists = handle.skip_lists()
        lst = lists[("transformer_blocks.0.attn", "cond")]
        # 192 video tokens then 7 valid text tokens (3 padded ones removed from the keys): text tiles stay
        assert lst.seq_q == 202 and lst.seq_k == 199
        mask = lst.to_mask()
        assert mask[..., -1].all() and mask[..., -1, :].all()
        assert_monotone_stats(handle.stats(), list(handle.stats()["density"]), {"cond"}, 3)
    finally:
        sp.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(timestep=t, **inputs).sample, dense)


def test_backend_enum_member_is_removed_and_global_backend_untouched(wan):
    from diffusers.models import attention_dispatch as ad
    active = ad._AttentionBackendRegistry._active_backend
    sp.patch(wan, sp.SkipConfig(tile=(16, 16)))
    assert ad.AttentionBackendName("sparsepatch").value == "sparsepatch"
    assert ad._AttentionBackendRegistry._active_backend == active
    sp.unpatch(wan)
    with pytest.raises(ValueError):
        ad.AttentionBackendName("sparsepatch")
    assert all(m.value != "sparsepatch" for m in ad._AttentionBackendRegistry._backends)


def test_default_recipe_and_stats_shape(wan):
    handle = sp.patch(wan)
    try:
        assert isinstance(handle.config, sp.SkipConfig) and handle.config.threshold == -5.0
        assert handle.stats() == {"calls": 0, "density": {}, "per_step": [], "backends": {}}
    finally:
        handle.remove()
    assert sp.handle_of(wan) is None


def test_model_cpu_offload_hooks_survive_patch_and_unpatch():
    pipe = tiny_wan_pipeline(head_dim=32, attention_gain=100.0)
    pipe.set_progress_bar_config(disable=True)
    dense = _frames(pipe, **wan_kwargs(steps=2))
    pipe.enable_model_cpu_offload(device="cpu")          # accelerate hooks wrap forward; we never touch forward
    handle = sp.patch(pipe, sp.SkipConfig(threshold=-3.0, tile=(16, 16)))
    try:
        _frames(pipe, **wan_kwargs(steps=2))
        assert handle.stats()["calls"] == 2 * 2 * 2
    finally:
        sp.unpatch(pipe)
    assert hasattr(pipe.transformer, "_hf_hook")
    assert torch.equal(_frames(pipe, **wan_kwargs(steps=2)), dense)


def test_compiled_transformer_does_not_recompile_after_step_1():
    import torch._dynamo as dynamo
    dynamo.reset()
    pipe = tiny_wan_pipeline(head_dim=32, attention_gain=100.0)
    model = pipe.transformer
    handle = sp.patch(pipe, sp.SkipConfig(threshold=-3.0, tile=(16, 16)))
    compiled = torch.compile(model, backend="eager")
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 4, 3, 12, 12, generator=g), torch.randn(1, 16, 16, generator=g)
    try:
        with torch.no_grad():
            for step in range(5):
                with dynamo.config.patch(error_on_recompile=step >= 2):
                    for branch in ("cond", "uncond"):
                        with model.cache_context(branch):
                            compiled(x + 0.01 * step, timestep=torch.tensor([900 - 100 * step]),
                                     encoder_hidden_states=text)
        density = handle.stats()["density"]["transformer.blocks.0.attn1"]["cond"]
        assert len(density) == 5 and density[-1] < 1.0     # the lists advanced inside the compiled graph
    finally:
        sp.unpatch(pipe)
        dynamo.reset()


def test_padding_masks_are_served_exactly_or_kept():
    from sparsepatch.patcher.state import _drop_padded_keys
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 40, 2, 16, generator=g) for _ in range(3))
    suffix = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    suffix[..., 33:] = False
    q2, k2, v2, mask, _ = _drop_padded_keys(q, k, v, suffix, [(30, 40)])
    assert mask is None and k2.shape[1] == 33 and k2.data_ptr() == k.data_ptr()    # a view, no copy
    holes = suffix.clone()
    holes[..., 5] = False
    assert _drop_padded_keys(q, k, v, holes, [(30, 40)])[3] is holes               # must_do + holes: keep the mask
    _, k3, _, mask, _ = _drop_padded_keys(q, k, v, holes, None)
    assert mask is None and k3.shape[1] == 32
    per_batch = suffix.clone()
    per_batch[1, ..., 20:] = False
    assert _drop_padded_keys(q, k, v, per_batch, None)[3] is per_batch             # differs across the batch
    suffix[..., 10:] = False                                                      # in-place edit: plan recomputed
    assert _drop_padded_keys(q, k, v, suffix, None)[1].shape[1] == 10
