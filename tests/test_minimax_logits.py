"""MiniMax lightning decode, step by step: the patched model's `generate` scores against the unpatched model's
scores and against an fp64 no-cache forward, at every generated position.

Greedy tokens are a weak check: a decode step that is off by 1e-3 almost never flips an argmax of a tiny random
model. This file compares the scores (the logits `generate` returns with `output_scores=True`) of EVERY step:
step 0 comes from the prefill, steps 1.. from one-token decode steps on the cached recurrent state.

Error model (fp32, unit roundoff u = 2^-24 ~ 6e-8): a logit is the end of a chain of dot products; a length-n dot
product carries at most n * u * sum|terms| of rounding error (worst case, errors all of one sign). Along the chain,
per layer: q/k/v and gate projections (n = hidden = 32), the recurrence over <= 75 tokens with K <= 32 (~110),
RMSNorm and out_proj over H * D <= 128 (~260), the MoE (32 + 48), full attention over <= 75 keys with D <= 32
(~110); three layers and the LM head (32) add up to ~1.7e3 terms, i.e. <= 1.0e-4 times the size of the summed
terms, which the RMSNorm before every block and before the head keeps O(1) (the logits are <= 1 here; the bound
scales with max(1, max |logit|)). So TOL = 1e-4 is the deterministic worst case. Measured over these cases: at
most 7.7e-8 (rounding errors accumulate like sqrt(n), not n; max |logit| 0.41), while each of these decode bugs
moves some step by >= 9e-4 in EVERY case: no decay or a doubled decay per step, a step that updates a copy of the
state instead of the cached one, an output read from the state before the step's update.

Left padding: transformers' MiniMaxCache keeps plain DynamicLayers for the linear layers, so the causal-mask
helper takes layer 0 as the first full-attention layer; with a linear layer 0 and a full-attention layer, the
padded row's decode steps then get a wrongly sized padding mask and the UNPATCHED model disagrees with its own
no-cache forward (by ~2e-3, measured with transformers 5.23). The padded cases therefore put a full-attention
layer first; the unpadded cases use MiniMax's own order (lightning layer 0).
"""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

pytest.importorskip("transformers")

import sparsepatch as sp  # noqa: E402

L, F = "linear_attention", "full_attention"
NEW_TOKENS = 5                    # 1 prefill score + 4 decode scores
TOL = 1e-4                        # see the module docstring
PAD = 3                           # left-padding tokens of row 0 in the padded cases
HEADS = 4


@pytest.fixture(autouse=True)
def one_thread():
    """The models are tiny (matrices of 32 x 128): a second thread only adds contention on the shared cores
    (measured: generate 1.4 s with 2 threads under load, 0.07 s with 1)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _cases():
    """A covering subset of head_dim {8,16,32} x block_size {8,16,32} x {1,2} lightning layers x {GQA, MHA} x
    {prompt a multiple of block_size, not} x {batch 1, batch 2 left-padded}: every (head_dim, block_size) pair
    twice, and the 16 combinations of the four two-level factors each at least once."""
    binary = list(itertools.product((1, 2), (True, False), (True, False), (False, True)))
    pairs = list(itertools.product((8, 16, 32), (8, 16, 32))) * 2
    out = []
    for i, (hd, bs) in enumerate(pairs):
        n_lin, gqa, multiple, padded = binary[i % 16]
        if multiple:
            T = 2 * bs
        else:
            T = bs - 3 if hd == 16 else 2 * bs + 5     # shorter than a block; or crossing the reference's 64 chunk
        name = f"hd{hd}-bs{bs}-lin{n_lin}-{'gqa' if gqa else 'mha'}-T{T}-{'B2pad' if padded else 'B1'}"
        out.append(pytest.param(hd, bs, n_lin, gqa, T, padded, id=name))
    return out


def _layer_types(n_lin: int, padded: bool) -> list:
    """Every case has a lightning layer that is not the last layer: MiniMax scales layer i's decay rates by
    1 - i / (layers - 1), so the last layer's decay is ~0 and a decay bug would not show there."""
    if padded:
        return [F, L, F] if n_lin == 1 else [F, L, L]
    return [L, F] if n_lin == 1 else [L, F, L]


def _model(hd, bs, n_lin, gqa, padded, seed):
    from transformers import MiniMaxConfig, MiniMaxForCausalLM
    torch.manual_seed(seed)
    types = _layer_types(n_lin, padded)
    cfg = MiniMaxConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=len(types),
                        num_attention_heads=HEADS, num_key_value_heads=2 if gqa else HEADS, head_dim=hd,
                        num_local_experts=2, num_experts_per_tok=1, block_size=bs, max_position_embeddings=256,
                        pad_token_id=0, bos_token_id=1, eos_token_id=None, layer_types=types)
    return MiniMaxForCausalLM(cfg).eval()


def _generate(model, ids, mask):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.scores, 1)                # (B, T + n), (B, n, vocab) fp32


def _no_cache_fp64(model, seqs, mask):
    """Logits of the unpatched model in fp64, one forward without a cache over the whole sequence, at the positions
    whose logits pick generated tokens: (B, n, vocab)."""
    m64 = copy.deepcopy(model).double()
    m64.config._experts_implementation = "eager"                   # grouped_mm has no fp64
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], NEW_TOKENS)], 1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0)                  # the positions generate gives left-padded rows
    with torch.no_grad():
        logits = m64(input_ids=seqs, attention_mask=full_mask, position_ids=pos, use_cache=False).logits
    T = mask.shape[1]
    return logits[:, T - 1:T - 1 + NEW_TOKENS]


@pytest.mark.parametrize("hd,bs,n_lin,gqa,T,padded", _cases())
def test_patched_decode_scores_match_every_step(hd, bs, n_lin, gqa, T, padded):
    model = _model(hd, bs, n_lin, gqa, padded, seed=hd * 1000 + bs * 10 + T)
    B = 2 if padded else 1
    ids = torch.randint(2, 96, (B, T), generator=torch.Generator().manual_seed(T))
    mask = torch.ones_like(ids)
    if padded:
        ids[0, :PAD] = 0
        mask[0, :PAD] = 0

    seq0, scores0 = _generate(model, ids, mask)
    handle = sp.patch(model)
    try:
        seq1, scores1 = _generate(model, ids, mask)
        decode_calls = sum(len(b.get("decode", [])) for b in handle.stats()["density"].values())
    finally:
        sp.unpatch(model)
    oracle = _no_cache_fp64(model, seq1, mask)                      # at the patched run's tokens

    assert decode_calls == n_lin * (NEW_TOKENS - 1)                 # the decode branch ran, once per layer per step
    tol = TOL * max(1.0, oracle.abs().max().item())
    # per step, so a failure names the first bad one
    err_unpatched = (scores1 - scores0).abs().amax(dim=(0, 2))
    err_oracle = (scores1.double() - oracle).abs().amax(dim=(0, 2))
    oracle0 = oracle if torch.equal(seq0, seq1) else _no_cache_fp64(model, seq0, mask)
    err_model = (scores0.double() - oracle0).abs().amax(dim=(0, 2))
    assert err_model.max().item() <= tol, f"the unpatched model itself, per step: {err_model.tolist()}"
    assert err_unpatched.max().item() <= tol, f"patched vs unpatched scores, per step: {err_unpatched.tolist()}"
    assert err_oracle.max().item() <= tol, f"patched scores vs fp64 no-cache logits, per step: {err_oracle.tolist()}"
    assert torch.equal(seq1, seq0)
