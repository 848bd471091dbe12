"""transformers adapter: tiny Llama / Qwen3 (GQA, sliding window) on CPU fp32, patched vs unpatched."""
from __future__ import annotations

import collections
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (AttentionInterface, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,  # noqa: E402
                          Qwen3Config, Qwen3ForCausalLM)
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from kernel_checks import assert_agree, check_bound, denoiser_bound  # noqa: E402
import sparsepatch  # noqa: E402
from sparsepatch.config import DenseConfig, LightningConfig, NSAConfig, SkipConfig  # noqa: E402
from sparsepatch.kernels.dense import reference  # noqa: E402
from sparsepatch.patcher import transformers as tfa  # noqa: E402

VOCAB = 96
NEW_TOKENS = 10


def tol(want, tokens=20, layers=2):
    """Per-side fp32 bound for logits of a patched vs unpatched tiny model: `layers` attention calls over up to
    `tokens` keys (kernel_checks.denoiser_bound, one step), at the logits' magnitude; twice that for the pair."""
    return 2 * denoiser_bound(torch.float32, tokens, 1, layers, magnitude=want.abs().max().item())


class StandInHandle:
    """The PatchHandle surface the adapter uses: an undo stack and a call counter."""

    def __init__(self, config):
        self.config = config
        self.undos = []
        self.calls = collections.Counter()   # (layer, branch) -> n
        self.densities = []
        self.backends = collections.Counter()   # (layer, backend) -> n

    def count_backend(self, layer, backend):
        self.backends[(layer, backend)] += 1

    def add_undo(self, fn):
        self.undos.append(fn)

    def record_call(self, layer_name, branch, density):
        self.calls[(layer_name, branch)] += 1
        self.densities.append(density)

    def remove(self):
        while self.undos:
            self.undos.pop()()

    @property
    def total(self):
        return sum(self.calls.values())


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                      pad_token_id=0, bos_token_id=1, eos_token_id=None)   # no eos: fixed-length generate
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen3(seed=0, sliding=True):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                      use_sliding_window=sliding, sliding_window=8, max_window_layers=1,
                      layer_types=["full_attention", "sliding_attention" if sliding else "full_attention"],
                      pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return Qwen3ForCausalLM(cfg).eval()


MODELS = {"llama": tiny_llama, "qwen3": tiny_qwen3}


def prompts(batch=2, length=20, left_pad=(0, 7), seed=1):
    """input_ids (batch, length) with `left_pad[i]` pad tokens on the left of row i, and the 2-D mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for i, p in enumerate(left_pad[:batch]):
        ids[i, :p] = 0
        mask[i, :p] = 0
    return ids, mask


def patch(model, config=None):
    handle = StandInHandle(config or DenseConfig())
    tfa.patch_model(model, handle.config, handle)
    return handle


def greedy(model, ids, mask, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0, **kw)


def logits(model, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


@pytest.mark.parametrize("arch", list(MODELS))
def test_logits_match_and_calls_counted(arch):
    model, twin = MODELS[arch](), MODELS[arch]()
    ids, mask = prompts()
    want = logits(twin, ids, mask)
    h = patch(model)
    assert model.config._attn_implementation == tfa.ATTN_NAME
    got = logits(model, ids, mask)
    valid = mask.bool()   # left-pad query rows attend to nothing; SDPA and the kernel may disagree there
    err = (got - want)[valid].abs().max().item()
    check_bound(err, tol(want), "logits")
    assert torch.isfinite(got).all()
    n_layers = model.config.num_hidden_layers
    assert h.calls == {(f"model.layers.{i}.self_attn", "default"): 1 for i in range(n_layers)}
    assert set(h.densities) == {1.0}
    h.remove()


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("left_pad", [(0,), (0, 7)], ids=["b1", "b2-leftpad"])
def test_greedy_generate_same_tokens(arch, left_pad):
    model, twin = MODELS[arch](), MODELS[arch]()
    ids, mask = prompts(batch=len(left_pad), left_pad=left_pad)
    want = greedy(twin, ids, mask)
    h = patch(model)
    got = greedy(model, ids, mask)
    assert got.shape == want.shape == (len(left_pad), ids.shape[1] + NEW_TOKENS)
    assert torch.equal(got, want), (got, want)
    # 1 prefill + (NEW_TOKENS - 1) decode forwards, each through every layer.
    assert h.total == NEW_TOKENS * model.config.num_hidden_layers
    h.remove()


@pytest.mark.parametrize("left_pad", [(0,), (0, 7)], ids=["b1", "b2-leftpad"])
def test_static_cache_generate(left_pad):
    model, twin = tiny_qwen3(), tiny_qwen3()
    ids, mask = prompts(batch=len(left_pad), left_pad=left_pad)
    want = greedy(twin, ids, mask, cache_implementation="static")
    h = patch(model)
    got = greedy(model, ids, mask, cache_implementation="static")
    assert torch.equal(got, want), (got, want)
    assert h.total == NEW_TOKENS * model.config.num_hidden_layers
    # and the same tokens as a dynamic-cache run (the static padding of k/v changes nothing)
    assert torch.equal(got, greedy(twin, ids, mask))
    h.remove()


def test_sliding_window_is_applied():
    """Prompts (20) exceed the window (8): the sliding layer must see the window, or logits move a lot."""
    ids, mask = prompts(batch=1, left_pad=(0,))
    sliding, full = tiny_qwen3(sliding=True), tiny_qwen3(sliding=False)
    assert sliding.config.layer_types == ["full_attention", "sliding_attention"]
    gap = (logits(sliding, ids) - logits(full, ids)).abs().max().item()
    assert gap > 1e-2, gap      # the window matters at this length, so the comparison below can fail
    seen = []
    orig = sparsepatch.kernels.attention

    def spy(q, k, v, **kw):
        seen.append((k.shape[1], kw["attn_mask"], kw["causal"]))
        return orig(q, k, v, **kw)

    want = logits(sliding, ids)
    h = patch(sliding)
    sparsepatch.kernels.attention = spy
    try:
        got = logits(sliding, ids)
    finally:
        sparsepatch.kernels.attention = orig
    check_bound((got - want).abs().max().item(), tol(want), "sliding logits")
    # layer 0 (full, no padding): mask skipped, causal from the module; layer 1: the window arrives as a mask
    assert seen[0][1] is None and seen[0][2] is True
    m = seen[1][1]
    assert m is not None and m.dtype == torch.bool and seen[1][2] is False
    assert m[0, 0, 19].sum().item() == 8 and not m[0, 0, 19, 11] and m[0, 0, 19, 12]
    h.remove()


def test_float_additive_4d_mask():
    """A user-built 4-D float mask reaches the function as is (transformers early-exits mask creation)."""
    model, twin = tiny_llama(), tiny_llama()
    L = 12
    ids = prompts(batch=2, length=L)[0]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    keep = causal[None, None].repeat(2, 1, 1, 1)
    keep[1, :, :, :3] = False
    keep[1, :, :3, 0] = True          # no fully masked rows
    add = torch.zeros(2, 1, L, L).masked_fill(~keep, torch.finfo(torch.float32).min)
    want = logits(twin, ids, add)
    h = patch(model)
    got = logits(model, ids, add)
    check_bound((got - want).abs().max().item(), tol(want, tokens=12), "4-D mask logits")
    assert h.total == 2
    h.remove()


def test_mask_none_static_prefill_drops_padded_keys():
    """mask None with S > L (empty StaticCache prefill): keys past L are unwritten and must not be attended."""
    torch.manual_seed(3)
    B, Hq, Hk, L, S, D = 2, 4, 2, 5, 16, 8
    q, k, v = torch.randn(B, Hq, L, D), torch.randn(B, Hk, S, D), torch.randn(B, Hk, S, D)
    k[:, :, L:] = 50.0                 # garbage that would dominate if attended
    mod = torch.nn.Module()
    mod.is_causal = True
    out, w = tfa.attention_forward(mod, q, k, v, None, scaling=0.3)
    assert w is None and out.shape == (B, L, Hq, D)
    ref = reference.attention(q.transpose(1, 2), k[:, :, :L].transpose(1, 2), v[:, :, :L].transpose(1, 2),
                              causal=True, scale=0.3)
    assert_agree(out, ref, torch.float32)              # the reference both sides: fp64 math rounded once
    # decode (L == 1) sees every key; non-causal modules see every key
    out1, _ = tfa.attention_forward(mod, q[:, :, :1], k, v, None)
    ref1 = reference.attention(q[:, :, :1].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert_agree(out1, ref1, torch.float32)
    mod.is_causal = False
    out2, _ = tfa.attention_forward(mod, q, k[:, :, :L], v[:, :, :L], None)
    ref2 = reference.attention(q.transpose(1, 2), k[:, :, :L].transpose(1, 2), v[:, :, :L].transpose(1, 2))
    assert_agree(out2, ref2, torch.float32)
    assert (out2 - ref).abs().max().item() > 1e-3


@pytest.mark.parametrize("arch", list(MODELS))
def test_unpatch_restores_bit_exact(arch):
    model, twin = MODELS[arch](), MODELS[arch]()
    ids, mask = prompts()
    before = model.config._attn_implementation
    model.config._attn_implementation_internal = "eager"     # a non-default value must come back as is
    twin.config._attn_implementation_internal = "eager"
    h = patch(model)
    logits(model, ids, mask)
    h.remove()
    assert before == "sdpa"
    assert model.config._attn_implementation == "eager"
    assert all(m.config._attn_implementation == "eager" for m in model.modules() if hasattr(m, "layer_idx"))
    assert torch.equal(logits(model, ids, mask), logits(twin, ids, mask))
    assert h.total == model.config.num_hidden_layers      # nothing counted after unpatch
    assert tfa.ATTN_NAME not in AttentionInterface._global_mapping
    assert tfa.ATTN_NAME not in AttentionMaskInterface._global_mapping


def test_composite_model_sub_configs_restored():
    """Llava (CLIP vision tower + Llama): every sub-config is switched, and each gets its own value back."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    def build():
        torch.manual_seed(0)
        vc = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=8, patch_size=4, projection_dim=16)
        tc = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        m = LlavaForConditionalGeneration(LlavaConfig(vision_config=vc, text_config=tc, image_token_index=63,
                                                      vision_feature_layer=-1)).eval()
        m.set_attn_implementation({"vision_config": "eager"})     # mixed implementations before patching
        return m

    model, twin = build(), build()
    ids = torch.randint(1, 60, (1, 12), generator=torch.Generator().manual_seed(0))
    ids[0, 2:6] = 63                                              # 4 image tokens = (8 / 4) ** 2 patches
    px = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1))

    def run(m):
        with torch.no_grad():
            return m(input_ids=ids, pixel_values=px).logits

    impls = lambda m: (m.config._attn_implementation, m.config.text_config._attn_implementation,  # noqa: E731
                       m.config.vision_config._attn_implementation)
    assert impls(model) == ("sdpa", "sdpa", "eager")
    want = run(twin)
    h = patch(model)
    assert impls(model) == (tfa.ATTN_NAME,) * 3
    # non-causal vision attention with mask None too; 1 vision + 1 text layer, 12 tokens
    check_bound((run(model) - want).abs().max().item(), tol(want, tokens=12), "llava logits")
    assert h.calls == {("model.vision_tower.encoder.layers.0.self_attn", "default"): 1,
                       ("model.language_model.layers.0.self_attn", "default"): 1}
    h.remove()
    assert impls(model) == ("sdpa", "sdpa", "eager")
    assert torch.equal(run(model), want)


def test_registration_is_reference_counted():
    a, b = tiny_llama(), tiny_qwen3()
    ids, mask = prompts()
    ha, hb = patch(a), patch(b)
    ha.remove()
    assert tfa.ATTN_NAME in AttentionInterface._global_mapping     # b still uses it
    want = logits(tiny_qwen3(), ids, mask)
    got = logits(b, ids, mask)
    check_bound((got - want)[mask.bool()].abs().max().item(), tol(want), "logits")
    assert hb.total == 2 and ha.total == 0
    with pytest.raises(ValueError, match="already patched"):
        patch(b)
    hb.remove()
    assert tfa.ATTN_NAME not in AttentionInterface._global_mapping
    assert tfa.ATTN_NAME not in AttentionMaskInterface._global_mapping
    assert b.config._attn_implementation == "sdpa"


def test_dropout_in_training_raises():
    model = tiny_llama()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    h = patch(model)
    model.train()
    ids = prompts(batch=1, left_pad=(0,))[0]
    with pytest.raises(NotImplementedError, match="attention dropout"):
        model(ids)
    model.eval()                                   # eval: dropout is 0.0 and the call goes through
    assert model(ids).logits.shape == (1, 20, VOCAB)
    h.remove()


def test_configs_and_model_types():
    model = tiny_llama()
    assert tfa.is_transformers_model(model) and not tfa.is_transformers_model(torch.nn.Linear(2, 2))
    from sparsepatch.recipes import default_config
    assert isinstance(default_config(model), DenseConfig)
    assert isinstance(default_config(tiny_qwen3()), DenseConfig)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        default_config(gpt2)
    with pytest.raises(ValueError, match="model"):
        tfa.patch_model(torch.nn.Linear(2, 2), DenseConfig(), StandInHandle(DenseConfig()))
    patch(model, NSAConfig()).remove()   # NSA has its own adapter (tests/test_nsa.py); here: patches, restores
    with pytest.raises(ValueError, match="no MiniMaxLightningAttention"):   # LightningConfig is MiniMax-only
        patch(model, LightningConfig())
    with pytest.raises(ValueError, match="config"):
        patch(model, SkipConfig())
    assert model.config._attn_implementation == "sdpa"
    assert tfa.ATTN_NAME not in AttentionInterface._global_mapping


has_patch = pytest.mark.skipif(not hasattr(sparsepatch, "patch"), reason="sparsepatch.patch has not landed")


@has_patch
def test_sp_patch_generate_and_stats():
    model, twin = tiny_qwen3(), tiny_qwen3()
    ids, mask = prompts()
    handle = sparsepatch.patch(model, sparsepatch.DenseConfig())
    assert torch.equal(greedy(model, ids, mask), greedy(twin, ids, mask))
    stats = handle.stats()
    assert stats["calls"] == NEW_TOKENS * model.config.num_hidden_layers
    sparsepatch.unpatch(model)
    sparsepatch.unpatch(model)   # idempotent
    assert model.config._attn_implementation == "sdpa"


@has_patch
def test_sp_unpatch_bit_exact():
    model, twin = tiny_llama(), tiny_llama()
    ids, mask = prompts()
    sparsepatch.patch(model)     # recipe: DenseConfig
    assert model.config._attn_implementation == tfa.ATTN_NAME
    sparsepatch.unpatch(model)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(logits(model, ids, mask), logits(twin, ids, mask))
    assert not math.isnan(logits(model, ids, mask)[mask.bool()].sum().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_llama_triton_path():
    """bf16 on CUDA, head_dim 64: unpadded prefill and decode (mask None) take the Triton kernel through the
    transposed (strided) views; padded calls take the reference. Same greedy tokens as SDPA."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      pad_token_id=0, eos_token_id=None)
    model = LlamaForCausalLM(cfg).eval().to("cuda", torch.bfloat16)
    ids = torch.randint(2, VOCAB, (1, 300), device="cuda")
    want = logits(model, ids)
    want_tokens = greedy(model, ids, torch.ones_like(ids))
    from sparsepatch.kernels import dispatch
    from sparsepatch.kernels.dense import op as dense_op
    from sparsepatch.kernels.skip import triton as triton_skip
    used = []
    orig, orig_prefer, orig_table = triton_skip.attention, dense_op.DISPATCH.prefer, dispatch._TABLE[0]
    triton_skip.attention = lambda *a, **kw: (used.append(1), orig(*a, **kw))[1]
    # the dispatcher would pick SDPA at these shapes (faster); this test is about the Triton kernel on strided views
    dense_op.DISPATCH.prefer = lambda call: ["flash_triton"]
    dispatch.set_cost_table(dispatch.CostTable())
    try:
        h = patch(model)
        got = logits(model, ids)
        got_tokens = greedy(model, ids, torch.ones_like(ids))
    finally:
        triton_skip.attention = orig
        dense_op.DISPATCH.prefer = orig_prefer
        dispatch.set_cost_table(orig_table)
    assert len(used) == 2 + NEW_TOKENS * 2
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 0.05 * want.float().abs().max().item(), err
    assert (torch.nn.functional.cosine_similarity(got.float().flatten(), want.float().flatten(), 0) > 0.999)
    assert (got_tokens == want_tokens).float().mean().item() >= 0.9
    h.remove()
