"""Patcher trust (issue 22): cloned processors, collectable patched models, output_attentions, clear errors, skip
state keyed on the latent grid, masked keys removed alike by every config, private host APIs in compat modules.

Tiny models built from configs on CPU, `.eval()` before comparing. Tolerances: an fp64 run of the same model is the
oracle; fp32 results must be within EPS_BUDGET * eps(fp32) * max|oracle| of it (a few dozen rounding steps of
relative size eps along the model's sequential ops; measured errors are 1-2 eps * max|oracle|).
"""
from __future__ import annotations

import copy
import gc
import logging
import pathlib
import re
import weakref

import pytest
import torch

import sparsepatch as sp
from sparsepatch.patcher import diffusers as dfa
from sparsepatch.patcher import diffusers_compat, transformers_compat
from sparsepatch.patcher import transformers as tfa
from sparsepatch.patcher.state import CallSite, PatchHandle
from sparsepatch.testing import _sharpen, hunyuan_inputs, tiny_hunyuan_video_transformer, tiny_wan_pipeline

KEEP_ALL = -1e9
EPS32 = torch.finfo(torch.float32).eps
EPS_BUDGET = 32


def within_budget(out, oracle):
    err = (out.double() - oracle).abs().max().item()
    bound = EPS_BUDGET * EPS32 * oracle.abs().max().item()
    return err <= bound, (err, bound)


def as_double(inputs):
    return {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()}


# --- tiny models -------------------------------------------------------------------------------------------------
def tiny_flux(seed=0):
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(seed)
    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=8,
                                  pooled_projection_dim=8, axes_dims_rope=(4, 6, 6)).eval()


def flux_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 16, 4, generator=g), encoder_hidden_states=torch.randn(1, 5, 8, generator=g),
                pooled_projections=torch.randn(1, 8, generator=g), timestep=torch.tensor([0.5]),
                img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3))


def tiny_wan(seed=0, gain=1.0):
    from diffusers import WanTransformer3DModel
    torch.manual_seed(seed)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
                                  cross_attn_norm=True, rope_max_seq_len=32).eval()
    _sharpen(model, gain)
    return model


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                      eos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen3(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128, use_sliding_window=True,
                      sliding_window=8, max_window_layers=1, layer_types=["full_attention", "sliding_attention"],
                      pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return Qwen3ForCausalLM(cfg).eval()


def left_padded_prompts(batch=2, length=20, pads=(0, 7), seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 96, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for i, p in enumerate(pads[:batch]):
        ids[i, :p] = 0
        mask[i, :p] = 0
    return ids, mask


def _sample(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


# --- 1. processors cloned with type(proc)() ----------------------------------------------------------------------
def test_cloned_processor_is_served_patched_and_restored_by_unpatch():
    model, twin = tiny_flux(), tiny_flux()
    inputs = flux_inputs()
    dense = _sample(twin, inputs)
    oracle = _sample(copy.deepcopy(twin).double(), as_double(inputs))
    handle = sp.patch(model, sp.DenseConfig())
    joint = model.transformer_blocks[0].attn
    single = model.single_transformer_blocks[0].attn
    original_cls = type(joint.processor).__mro__[1]
    joint.set_processor(type(joint.processor)())        # what diffusers' IP-adapter loaders do
    try:
        out = _sample(model, inputs)
        assert handle.stats()["calls"] == 2             # both layers went through sparsepatch, the clone too
        assert set(handle.stats()["density"]) == {"transformer_blocks.0.attn", "single_transformer_blocks.0.attn"}
        ok, info = within_budget(out, oracle)
        assert ok, info
        single.set_processor(type(single.processor)())  # this clone is never called before unpatch
    finally:
        sp.unpatch(model)
    for attn in (joint, single):
        assert type(attn.processor) is original_cls
        assert not any(a.startswith("_sparsepatch") or a == "_attention_backend" for a in vars(attn.processor))
    assert torch.equal(_sample(model, inputs), dense)


def test_clone_called_outside_a_patched_model_runs_the_host_attention(caplog):
    model, twin = tiny_flux(), tiny_flux()
    inputs = flux_inputs()
    dense = _sample(twin, inputs)
    sp.patch(model, sp.DenseConfig())
    try:
        clone = type(model.transformer_blocks[0].attn.processor)()
    finally:
        sp.unpatch(model)
    twin.transformer_blocks[0].attn.set_processor(clone)   # a patched-class clone in an unpatched model
    dfa._WARNED.discard("orphan")
    with caplog.at_level(logging.WARNING, logger="sparsepatch"):
        out = _sample(twin, inputs)
    assert torch.equal(out, dense)
    assert "outside a patched module" in caplog.text
    assert "_sparsepatch_original_class" not in type(clone).__dict__   # back to its original class


# --- 2. a deleted patched model is freed --------------------------------------------------------------------------
def _wan_call(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model(torch.randn(1, 4, 3, 8, 8, generator=g), timestep=torch.tensor([500]),
              encoder_hidden_states=torch.randn(1, 8, 16, generator=g))


def _llama_call(model):
    with torch.no_grad():
        model(left_padded_prompts(batch=1, pads=(0,))[0])


def _wan_pipe_call(pipe):
    with torch.no_grad():
        pipe(prompt="a cat", height=16, width=16, num_frames=5, num_inference_steps=1, output_type="latent",
             max_sequence_length=16, generator=torch.Generator().manual_seed(0))


def _backend_users():
    return dfa._BACKEND_USERS[0]


def _registration_users():
    return tfa._REGISTRATION.count


@pytest.mark.parametrize("build, call, config, users", [
    (tiny_llama, _llama_call, sp.DenseConfig(), _registration_users),
    (tiny_wan, _wan_call, sp.SkipConfig(tile=(16, 16)), _backend_users),
    (lambda: tiny_wan_pipeline(num_layers=1), _wan_pipe_call, sp.SkipConfig(tile=(16, 16)), _backend_users),
], ids=["llama", "wan-transformer", "wan-pipeline"])
def test_deleted_patched_model_is_freed(build, call, config, users):
    before = users()
    model = build()
    handle = sp.patch(model, config)
    call(model)
    assert handle.stats()["calls"] > 0 and users() == before + 1
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None                      # freed although the handle is still held
    assert handle.obj is None and handle.stats()["calls"] > 0
    del handle
    gc.collect()
    assert users() == before                  # the shared registration went with it


def test_handle_keeps_working_and_unpatch_stays_bit_exact_while_model_lives():
    model, twin = tiny_llama(), tiny_llama()
    ids = left_padded_prompts(batch=1, pads=(0,))[0]
    with torch.no_grad():
        want = twin(ids).logits
    handle = sp.patch(model, sp.DenseConfig())
    del handle
    gc.collect()                              # the model owns its patch: dropping the handle unpatches nothing
    _llama_call(model)
    assert sp.handle_of(model).stats()["calls"] == 2
    sp.unpatch(model)
    assert sp.handle_of(model) is None and "_sparsepatch_undo" not in vars(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)


# --- 3. output_attentions on a patched LLM ------------------------------------------------------------------------
@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3-sliding"])
def test_output_attentions_equal_the_eager_model(build):
    model, eager = build(), build()
    eager.set_attn_implementation("eager")
    oracle_model = copy.deepcopy(eager).double()
    pads = (0, 7)
    ids, mask = left_padded_prompts(pads=pads)
    sp.patch(model, sp.DenseConfig())
    try:
        with torch.no_grad():
            got = model(ids, attention_mask=mask, output_attentions=True)
            plain = model(ids, attention_mask=mask).logits
    finally:
        sp.unpatch(model)
    with torch.no_grad():
        want = eager(ids, attention_mask=mask, output_attentions=True)
        # fp64 oracle per sequence without its padding (fp64 eager turns padded rows into NaN that then leaks into
        # every key); RoPE and the sliding window are relative, so the valid block is the same function.
        oracle = [oracle_model(ids[b:b + 1, p:], output_attentions=True).attentions for b, p in enumerate(pads)]
    assert torch.equal(got.logits, plain)                    # asking for weights does not change the outputs
    assert len(got.attentions) == len(want.attentions) == model.config.num_hidden_layers
    assert torch.equal(got.attentions[0], want.attentions[0])   # layer 0 sees identical q/k: same math, same bits
    for layer, (a, w) in enumerate(zip(got.attentions, want.attentions)):
        assert a.shape == w.shape == (2, 4, 20, 20)
        for b, p in enumerate(pads):
            o = oracle[b][layer][0]
            assert not a[b, :, p:, :p].any()                 # padded keys get exactly zero weight
            for x in (a, w):                                  # the budget holds for transformers' own eager too
                ok, info = within_budget(x[b, :, p:, p:], o)
                assert ok, (layer, b, info)


def test_output_attentions_with_nsa_raises_clearly():
    model = tiny_llama()
    sp.patch(model, sp.NSAConfig(block_size=16, num_selected=2, window=16, compress_block=16, compress_stride=8))
    try:
        with pytest.raises(NotImplementedError, match="output_attentions"):
            with torch.no_grad():
                model(left_padded_prompts(batch=1, pads=(0,))[0], output_attentions=True)
    finally:
        sp.unpatch(model)


# --- 4. clear errors ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls, kwargs, name", [
    (sp.SkipConfig, dict(threshold="abc"), "threshold"),
    (sp.SkipConfig, dict(threshold="-5"), "threshold"),
    (sp.SkipConfig, dict(threshold=True), "threshold"),
    (sp.SkipConfig, dict(threshold=None), "threshold"),
    (sp.SkipConfig, dict(warmup_steps=1.5), "warmup_steps"),
    (sp.SkipConfig, dict(warmup_steps=True), "warmup_steps"),
    (sp.SkipConfig, dict(warmup_steps="1"), "warmup_steps"),
    (sp.SkipConfig, dict(tile=(16.5, 16)), "tile"),
    (sp.SkipConfig, dict(tile="ab"), "tile"),
    (sp.SkipConfig, dict(tile=(16, 16, 16)), "tile"),
    (sp.SkipConfig, dict(tile=None), "tile"),
    (sp.SkipConfig, dict(must_do=[(5, 2)]), "must_do"),
    (sp.SkipConfig, dict(must_do=[(-1, 2)]), "must_do"),
    (sp.SkipConfig, dict(must_do=[(0,)]), "must_do"),
    (sp.SkipConfig, dict(must_do="0:10"), "must_do"),
    (sp.SkipConfig, dict(must_do=5), "must_do"),
    (sp.SkipConfig, dict(must_do=[(0.5, 3)]), "must_do"),
    (sp.SkipConfig, dict(backward="yes"), "backward"),
    (sp.SkipConfig, dict(backward=1), "backward"),
    (sp.DenseConfig, dict(layers=["all"]), "layers"),
    (sp.DenseConfig, dict(precision=None), "precision"),
    (sp.DenseConfig, dict(precision="int4"), "precision"),
    (sp.NSAConfig, dict(block_size=True), "block_size"),
    (sp.NSAConfig, dict(window=512.0), "window"),
    (sp.NSAConfig, dict(num_selected="16"), "num_selected"),
    (sp.NSAConfig, dict(compress_stride=0), "compress_stride"),
    (sp.NSAConfig, dict(gates=None), "gates"),
    (sp.NSAConfig, dict(selection=["tile"]), "selection"),
    (sp.LightningConfig, dict(state_dtype=torch.float32), "state_dtype"),
    (sp.LightningConfig, dict(extra=[("a", 1)]), "extra"),
])
def test_config_fields_are_validated_by_name(cls, kwargs, name):
    with pytest.raises(ValueError, match=name):
        cls(**kwargs)


def test_config_accepts_good_values():
    import numpy as np
    cfg = sp.SkipConfig(threshold=np.float32(-3), warmup_steps=np.int64(2), tile=[64, 128], must_do=[[0, 10]],
                        backward=True)
    assert (cfg.threshold, cfg.warmup_steps, cfg.tile, cfg.must_do) == (-3.0, 2, (64, 128), [(0, 10)])
    assert type(cfg.threshold) is float and type(cfg.warmup_steps) is int
    assert sp.SkipConfig(threshold=float("-inf")).threshold == float("-inf")
    assert sp.NSAConfig(block_size=np.int32(32)).block_size == 32


@pytest.mark.parametrize("obj", ["a string", None, 42, torch.nn.Linear(2, 2)], ids=["str", "None", "int", "module"])
def test_unpatch_of_unpatched_objects_is_a_noop_and_patch_names_the_argument(obj):
    assert sp.unpatch(obj) is None
    assert sp.handle_of(obj) is None
    for config in (None, sp.DenseConfig()):
        with pytest.raises(ValueError, match="pipe_or_model"):
            sp.patch(obj, config)


# --- 5. skip state keyed on the latent grid -----------------------------------------------------------------------
def test_wan_transformer_swapped_height_width_starts_fresh_lists():
    model = tiny_wan(gain=100.0)
    fresh = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 3, 8, 16, generator=g)                    # (F, H, W) = (3, 8, 16): 3 x 4 x 8 tokens
    x_swapped = x.transpose(3, 4).contiguous()                      # (3, 16, 8): same token count, other grid
    kw = dict(timestep=torch.tensor([500]), encoder_hidden_states=torch.randn(1, 8, 16, generator=g))
    config = sp.SkipConfig(threshold=-3.0, tile=(16, 16), warmup_steps=0)
    handle, fresh_handle = sp.patch(model, config), sp.patch(fresh, config)
    try:
        with torch.no_grad():
            model(x, **kw)
            out = model(x_swapped, **kw).sample
            want = fresh(x_swapped, **kw).sample
            # the same grid again does carry its lists over (so the comparison above can fail)
            model(x_swapped, **kw)
        density = handle.stats()["density"]["blocks.0.attn1"]["default"]
        assert density[:2] == [1.0, 1.0] and density[2] < 1.0, density
    finally:
        sp.unpatch(model)
        sp.unpatch(fresh)
    assert torch.equal(out, want)
    assert fresh_handle.stats()["density"]["blocks.0.attn1"]["default"] == [1.0]


# --- 6. masked keys: DenseConfig and SkipConfig compute the same function -----------------------------------------
def test_hunyuan_all_false_text_mask_dense_and_skip_agree():
    model = tiny_hunyuan_video_transformer()
    inputs = dict(hunyuan_inputs(frames=3, size=8, text_len=10, valid=0), timestep=torch.tensor([500]))
    assert not inputs["encoder_attention_mask"].any()
    assert not torch.isfinite(_sample(model, inputs)).all()        # unpatched diffusers: NaN text leaks through
    model64 = copy.deepcopy(model).double()
    outs = {}
    for name, config in (("dense", sp.DenseConfig()), ("skip", sp.SkipConfig(threshold=KEEP_ALL, tile=(16, 16)))):
        for key, m, inp in ((name, model, inputs), (name + "64", model64, as_double(inputs))):
            sp.patch(m, config)
            try:
                outs[key] = _sample(m, inp)
            finally:
                sp.unpatch(m)
    assert torch.isfinite(outs["dense"]).all() and torch.isfinite(outs["skip"]).all()
    assert (outs["dense64"] - outs["skip64"]).abs().max().item() <= 1e-12     # one function, two kernels
    for key in ("dense", "skip"):
        ok, info = within_budget(outs[key], outs["dense64"])
        assert ok, (key, info)


@pytest.mark.parametrize("config", [sp.DenseConfig(), sp.SkipConfig(threshold=KEEP_ALL, tile=(16, 16))],
                         ids=["dense", "skip"])
def test_masked_keys_contribute_nothing_and_all_masked_rows_are_zero(config):
    model = torch.nn.Linear(1, 1)
    handle = PatchHandle(model, config)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 40, 2, 16, generator=g, dtype=torch.float64) for _ in range(3))
    keep = torch.ones(1, 1, 1, 40, dtype=torch.bool)
    keep[..., 30:] = False
    v_bad = v.clone()
    v_bad[:, 30:] = float("nan")                                    # masked values must not leak (0 * NaN)
    out = handle.attend(CallSite("layer"), "cond", q, k, v_bad, attn_mask=keep)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k[:, :30].transpose(1, 2), v[:, :30].transpose(1, 2)).transpose(1, 2)
    assert (out - want).abs().max().item() <= 1e-12
    none = torch.zeros(1, 1, 1, 40, dtype=torch.bool)
    out = handle.attend(CallSite("layer"), "cond", q, k, v, attn_mask=none)
    assert torch.equal(out, torch.zeros_like(q))                    # like torch SDPA for fully masked rows
    handle.remove()


# --- 7. private host APIs only in the compat modules --------------------------------------------------------------
def test_diffusers_compat_pieces_are_in_place():
    assert diffusers_compat.check() == [], f"diffusers {diffusers_compat.version()}"


def test_transformers_compat_pieces_are_in_place():
    assert transformers_compat.check() == [], f"transformers {transformers_compat.version()}"


def test_compat_check_names_a_moved_piece(monkeypatch):
    from diffusers.models import attention_dispatch as ad
    from transformers import AttentionInterface
    monkeypatch.delattr(ad._AttentionBackendRegistry, "_constraints")
    assert any("_constraints" in p for p in diffusers_compat.check())
    monkeypatch.setattr(AttentionInterface, "_global_mapping", None)
    assert any("AttentionInterface._global_mapping" in p for p in transformers_compat.check())


PRIVATE_HOST_NAMES = {
    "_AttentionBackendRegistry", "_value2member_map_", "_member_map_", "_member_names_", "_backends",
    "_supports_context_parallel", "_global_mapping", "_attn_implementation_internal", "_can_set_attn_implementation",
    "_templated_context_parallel_attention", "TemplatedUlyssesAttention", "_ring_mesh", "_ring_local_rank",
    "_reset_stateful_cache", "_active_collector"}


def test_no_private_host_names_outside_the_compat_modules():
    """Code (strings and comments excluded) of the patcher names no private diffusers/transformers attribute except
    in the compat modules (transformers_lightning.py documents its own MiniMax reach-ins)."""
    import io
    import tokenize
    patcher = pathlib.Path(dfa.__file__).parent
    offenders = []
    for path in sorted(patcher.glob("*.py")):
        if path.name.endswith("_compat.py") or path.name == "transformers_lightning.py":
            continue
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type == tokenize.NAME and tok.string in PRIVATE_HOST_NAMES:
                offenders.append(f"{path.name}:{tok.start[0]}: {tok.line.strip()}")
    assert offenders == []
