"""The dispatcher: every backend computes its op's reference function; routing follows the cost table; bad input
gets a ValueError naming the argument."""
import math

import pytest
import torch

from kernel_checks import attention_bounds, check_bound, cpu_only, gpu, max_err

import sparsepatch as sp
from sparsepatch.kernels import dispatch
from sparsepatch.kernels.dense import op as dense_op
from sparsepatch.kernels.dense import reference
from sparsepatch.kernels.skip import op as skip_op
from sparsepatch.kernels.skip import reference as skip_reference
from sparsepatch.testing import video_like_qkv


def attention_bound(q, k, v, dtype):
    """Max-abs error bound of an attention computed in `dtype` storage with fp32 accumulation vs the fp64 oracle:
    inputs and output rounded to dtype (2 eps relative of |v|), score rounding eps32 * (max |score| + sqrt(D) +
    log Sk) carried through exp; margin 4."""
    eps_io = torch.finfo(dtype).eps if dtype != torch.float64 else 0.0
    eps32 = torch.finfo(torch.float32).eps
    D = q.shape[-1]
    smax = (q.double().abs().amax() * k.double().abs().amax() * math.sqrt(D)).item()
    vmax = v.double().abs().max().item()
    # half-precision inputs: the scores themselves move by ~eps_io * |s| (q and k are rounded)
    return 4 * vmax * (2 * eps_io * (1 + smax) + eps32 * (smax + math.sqrt(D) + math.log(max(k.shape[1], 2))))


def _inputs(B, Sq, Sk, Hq, Hk, D, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda S, H: torch.randn(B, S, H, D, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return mk(Sq, Hq), mk(Sk, Hk), mk(Sk, Hk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal,Sq,Sk", [(False, 70, 70), (True, 70, 70), (True, 1, 40), (True, 9, 40),
                                          (False, 9, 40)])
def test_cpu_attention_matches_oracle(dtype, causal, Sq, Sk):
    q, k, v = _inputs(2, Sq, Sk, 4, 2, 32, dtype, "cpu")
    out = sp.kernels.attention(q, k, v, causal=causal)
    want = reference.attention(q.double(), k.double(), v.double(), causal=causal)
    route = sp.kernels.explain(q, k, v, causal=causal)
    assert route.backend in {"sdpa", "reference"}
    assert (out.double() - want).abs().max() <= attention_bound(q, k, v, dtype)


def test_bool_mask_and_fully_masked_rows_give_zeros_like_the_reference():
    q, k, v = _inputs(1, 6, 10, 2, 2, 16, torch.float32, "cpu")
    mask = torch.rand(1, 1, 6, 10, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 2, :] = False
    out = sp.kernels.attention(q, k, v, attn_mask=mask)
    want = reference.attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert torch.all(out[:, 2] == 0)
    assert (out.double() - want).abs().max() <= attention_bound(q, k, v, torch.float32)


def test_cost_table_routes_to_the_fastest_measured_backend():
    table = dispatch.CostTable({"entries": [
        dict(op="attention", causal=False, D=64, group=1, dtype="float32", B=1, Sq=64, Sk=64, Hq=2,
             ms={"sdpa": 2.0, "reference": 1.0}),
    ]})
    q, k, v = _inputs(1, 64, 64, 2, 2, 64, torch.float32, "cpu")
    call = dispatch.Call.of("attention", q, k, v)
    assert table.costs(call) == {"sdpa": 2.0, "reference": 1.0}
    # CPU calls never read the (GPU) table; a CUDA-like call of the same class would pick the cheaper one
    cuda_call = dispatch.Call(**{**call.__dict__, "device": "cuda", "arch": (9, 0)})
    old = dispatch._TABLE[0]
    try:
        dispatch.set_cost_table(table)
        d = dispatch.Dispatcher("test_op", [dispatch.Backend("sdpa", lambda c: None, None),
                                            dispatch.Backend("reference", lambda c: None, None)])
        r = d.route(cuda_call)
        assert r.backend == "reference" and "fastest measured" in r.reason
        assert d.route(call).backend == "sdpa"          # no measurement: the default order
    finally:
        dispatch.set_cost_table(old)


def test_baseline_kept_unless_another_backend_measured_clearly_faster():
    """SDPA (what an unpatched model runs) keeps a call unless another backend measured more than BASELINE_MARGIN
    faster than the fastest SDPA entry: a lead inside the table's run-to-run spread is not known to be one."""
    q, k, v = _inputs(1, 64, 64, 2, 2, 64, torch.float32, "cpu")
    call = dispatch.Call.of("attention", q, k, v)
    cuda_call = dispatch.Call(**{**call.__dict__, "device": "cuda", "arch": (9, 0)})
    margin = dispatch.BASELINE_MARGIN
    assert 0.0 < margin < 0.1
    old = dispatch._TABLE[0]
    try:
        for ours, sdpa_flash, want in ((1.0, 1.0 + margin / 2, "sdpa_flash"),    # inside the margin: baseline
                                       (1.0, 1.0 + 2 * margin, "ours"),          # clearly faster: ours
                                       (1.2, 1.0, "sdpa_flash")):               # slower: baseline anyway
            dispatch.set_cost_table(dispatch.CostTable({"entries": [dict(
                op="attention", causal=False, D=64, group=1, dtype="float32", B=1, Sq=64, Sk=64, Hq=2,
                ms={"ours": ours, "sdpa_flash": sdpa_flash, "sdpa": 3.0})]}))
            d = dispatch.Dispatcher("test_op_margin", [
                dispatch.Backend("ours", lambda c: None, None),
                dispatch.Backend("sdpa_flash", lambda c: None, None, baseline=True),
                dispatch.Backend("sdpa", lambda c: None, None, baseline=True)])
            r = d.route(cuda_call)
            assert r.backend == want, (ours, sdpa_flash, r)
            assert ("within" in r.reason) == (want != "ours" and ours < sdpa_flash)
        assert all(b.baseline == b.name.startswith("sdpa") for b in dense_op.BACKENDS)
    finally:
        dispatch.set_cost_table(old)


def test_head_major_calls_are_costed_by_head_major_entries():
    """A q that is a (B, S, H, D) view of a contiguous (B, H, S, D) tensor (what SDPA callers pass; CogVideoX's v is
    sequence-major) is costed by "layout": "head" entries where the table has some for its class, else by the
    sequence-major ones; sequence-major calls never read head-major entries."""
    cell = dict(op="attention", causal=False, D=64, group=1, dtype="float32", B=1, Sq=64, Sk=64, Hq=2)
    table = dispatch.CostTable({"entries": [dict(cell, ms={"sdpa": 2.0, "ours": 1.0}),
                                            dict(cell, ms={"sdpa": 1.0, "ours": 2.0}, layout="head")]})
    seq = _inputs(1, 64, 64, 2, 2, 64, torch.float32, "cpu")
    head = tuple(torch.randn(1, 2, 64, 64).transpose(1, 2) for _ in range(3))
    assert all(dispatch.memory_layout(t) == "head" for t in head)
    assert table.costs(dispatch.Call.of("attention", *seq)) == {"sdpa": 2.0, "ours": 1.0}
    assert table.costs(dispatch.Call.of("attention", *head)) == {"sdpa": 1.0, "ours": 2.0}
    assert table.costs(dispatch.Call.of("attention", head[0], head[1], seq[2])) == {"sdpa": 1.0, "ours": 2.0}
    assert table.costs(dispatch.Call.of("attention", seq[0], head[1], head[2])) == {"sdpa": 2.0, "ours": 1.0}
    seq_only = dispatch.CostTable({"entries": [dict(cell, ms={"sdpa": 2.0, "ours": 1.0})]})
    assert seq_only.costs(dispatch.Call.of("attention", *head)) == {"sdpa": 2.0, "ours": 1.0}


def test_training_calls_are_costed_by_forward_plus_backward_entries_only():
    """A forward-only measurement must not route a call that needs gradients: our forward can win while our
    backward loses, so without "+backward" entries a training call takes the default order (SDPA)."""
    fwd = dict(op="attention", causal=False, D=64, group=1, dtype="float32", B=1, Sq=64, Sk=64, Hq=2,
               ms={"sdpa": 2.0, "reference": 1.0})
    q, k, v = _inputs(1, 64, 64, 2, 2, 64, torch.float32, "cpu")
    q.requires_grad_(True)
    call = dispatch.Call.of("attention", q, k, v)
    assert call.needs_grad
    cuda_call = dispatch.Call(**{**call.__dict__, "device": "cuda", "arch": (9, 0)})
    assert dispatch.CostTable({"entries": [fwd]}).costs(cuda_call) == {}
    train = dict(fwd, op="attention+backward", ms={"sdpa": 3.0, "reference": 5.0})
    table = dispatch.CostTable({"entries": [fwd, train]})
    assert table.costs(cuda_call) == {"sdpa": 3.0, "reference": 5.0}
    old = dispatch._TABLE[0]
    try:
        dispatch.set_cost_table(dispatch.CostTable({"entries": [fwd]}))
        d = dispatch.Dispatcher("test_op_train", [dispatch.Backend("sdpa", lambda c: None, None),
                                                  dispatch.Backend("reference", lambda c: None, None)])
        inference = dispatch.Call(**{**cuda_call.__dict__, "needs_grad": False})
        assert d.route(inference).backend == "reference"       # forward measured faster
        assert d.route(cuda_call).backend == "sdpa"             # training: unmeasured -> default order
    finally:
        dispatch.set_cost_table(old)


def test_shipped_sm90_table_routes_our_kernel_where_it_wins_and_sdpa_elsewhere():
    """The shipped table (H200 grid): non-causal D128 at 32K -> our kernel; causal D64 prefill and decode -> SDPA."""
    import json
    import os
    path = os.path.join(os.path.dirname(dispatch.__file__), "cost_tables", "sm90.json")
    with open(path) as f:
        table = dispatch.CostTable(json.load(f), source=path)
    assert len(table) >= 100

    def route(B, Sq, Sk, Hq, Hk, D, causal):
        call = dispatch.Call("attention", "cuda", (9, 0), torch.bfloat16, B, Sq, Sk, Hq, Hk, D, D, causal)
        costs = table.costs(call)
        ok = {b.name: costs[b.name] + b.host_ms for b in dense_op.BACKENDS
              if b.name in costs and b.name in ("flash_triton", "splitd_triton", "sdpa")}
        return min(ok, key=ok.get), costs

    best, costs = route(1, 32768, 32768, 12, 12, 128, False)       # Wan2.1-1.3B-like: our Gluon kernel wins
    assert best == "flash_triton" and costs["flash_triton"] < costs["sdpa"]
    best, costs = route(4, 4096, 4096, 32, 8, 64, True)            # LLM prefill at D64: SDPA wins
    assert best == "sdpa" and costs["flash_triton"] > costs["sdpa"]
    best, _ = route(16, 1, 8192, 32, 8, 128, True)                 # decode: SDPA
    assert best == "sdpa"


def test_memory_layout_names_sequence_and_head_major_views():
    x = torch.zeros(2, 64, 4, 16)
    assert dispatch.memory_layout(x) == "seq"
    assert dispatch.memory_layout(torch.zeros(2, 4, 64, 16).transpose(1, 2)) == "head"     # SDPA callers' views
    assert dispatch.memory_layout(torch.zeros(2, 64, 3, 4, 16)[:, :, 1]) == "seq"         # a fused-QKV view
    assert dispatch.memory_layout(torch.zeros(2, 64, 16, 4).transpose(2, 3)) == "other"   # D not unit-stride
    assert dispatch.memory_layout(torch.zeros(4, 2, 64, 16).permute(1, 2, 0, 3)) == "other"
    assert dispatch.memory_layout(torch.zeros(2, 64, 16)) == "other"                      # not 4-D: checks name it
    with pytest.raises(ValueError, match="q must be 4-D"):
        sp.kernels.attention(torch.zeros(2, 64, 16), torch.zeros(2, 64, 4, 16), torch.zeros(2, 64, 4, 16))


def test_flash_cells_do_not_stand_for_calls_the_measured_kernel_does_not_take():
    """On sm_90 the table's flash_triton cells are the Gluon kernel's: a layout it does not take, or causal prefill
    with Sk - Sq not a multiple of 128, runs the slower Triton kernel, so flash_triton counts as unmeasured there
    and SDPA runs; sequence- / head-major layouts, aligned causal calls and decode keep the measured route."""
    entries = [dict(op="attention", causal=c, D=128, group=1, dtype="bfloat16", B=1, Sq=sq, Sk=sk, Hq=16,
                    ms={"flash_triton": 1.0, "sdpa": 1.2})
               for c in (False, True) for sq, sk in ((4096, 4096), (1, 4096))]
    old = dispatch._TABLE[0]
    dispatch.set_cost_table(dispatch.CostTable(dict(entries=entries)))
    # (dense_op's flash_triton predicate on stand-in backends: the real SDPA backend asks torch.cuda)
    d = dispatch.Dispatcher("attention", [
        dispatch.Backend("flash_triton", lambda c: None, None, measured_for=dense_op.flash_measured_for),
        dispatch.Backend("sdpa", lambda c: None, None)])
    try:
        def route(Sq, Sk, causal, layouts=("seq", "seq", "seq"), arch=(9, 0)):
            call = dispatch.Call("attention", "cuda", arch, torch.bfloat16, 1, Sq, Sk, 16, 16, 128, 128, causal,
                                 layouts=layouts)
            return d.route(call).backend
        assert route(4096, 4096, False) == "flash_triton"
        assert route(4096, 4096, False, ("head", "head", "seq")) == "flash_triton"
        assert route(4096, 4096, False, ("head", "other", "seq")) == "sdpa"
        assert route(4096, 4096, False, ("head", "other", "seq"), arch=(8, 0)) == "flash_triton"   # Triton there
        assert route(4000, 4128, True) == "flash_triton"
        assert route(4000, 4100, True) == "sdpa"
        assert route(1, 4100, True) == "flash_triton"      # decode cells were measured on the Triton kernel
    finally:
        dispatch.set_cost_table(old)
        dispatch._DISPATCHERS["attention"] = dense_op.DISPATCH


def test_head_dim_256_runs_on_the_gluon_kernel_only_where_it_can():
    """flash_triton takes head dim 256 on sm_90 for inference calls with sequence- / head-major inputs and, causal,
    Sq > 1 with Sk - Sq a multiple of 128; every other D256 call gets a reason naming what it lacks."""
    from sparsepatch.kernels.skip import gluon

    def reason(Sq=4096, Sk=4096, causal=False, layouts=("seq", "head", "seq"), arch=(9, 0), grad=False):
        return dense_op.flash_kernel_reason(dispatch.Call(
            "attention", "cuda", arch, torch.bfloat16, 1, Sq, Sk, 16, 4, 256, 256, causal, needs_grad=grad,
            layouts=layouts))
    if not gluon.HAS_GLUON:
        assert "Gluon" in reason()
        return
    assert reason() is None
    assert reason(4000, 4128, causal=True) is None
    assert "sm_90" in reason(arch=(8, 0))
    assert "inference" in reason(grad=True)
    assert "head-major" in reason(layouts=("seq", "other", "seq"))
    assert "multiple of 128" in reason(4000, 4100, causal=True)
    assert "multiple of 128" in reason(1, 4097, causal=True)          # decode: the route cache keys no alignment
    assert "64 / 128" in dense_op.flash_kernel_reason(dispatch.Call(
        "attention", "cuda", (9, 0), torch.bfloat16, 1, 64, 64, 2, 2, 192, 192))


@cpu_only
@pytest.mark.parametrize("causal", [False, True])
def test_flash_backend_runs_head_dim_256_on_split_d_where_gluon_cannot(causal):
    """A head-dim-256 call routed to flash_triton that the Gluon kernel cannot take here (under the interpreter it
    never runs; on a GPU: no Gluon build, a failed launch, an unaligned pointer) runs on the split-D kernel: the same
    function (fp64 oracle, the attention error model of kernel_checks), not an error."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 40, 2, 256, generator=g)
    k, v = (torch.randn(1, 56, 1, 256, generator=g) for _ in range(2))
    from sparsepatch.kernels.skip import triton as skip_triton
    with pytest.raises(skip_triton.GluonUnavailable, match="head dim 256"):
        skip_triton.attention(q, k, v, causal=causal)
    out, lse = dense_op._flash_run(q, k, v, causal=causal, scale=None, attn_mask=None, return_lse=True)
    want = reference.attention(q.double(), k.double(), v.double(), causal=causal)
    check_bound(max_err(out, want), attention_bounds(q, k, v, torch.float32)[0], "out")


def test_forced_backend_and_explain():
    q, k, v = _inputs(1, 16, 16, 2, 2, 32, torch.float32, "cpu")
    out = sp.kernels.attention(q, k, v, backend="reference")
    assert torch.equal(out, reference.attention(q, k, v))
    with pytest.raises(ValueError, match="backend"):
        sp.kernels.attention(q, k, v, backend="flash_triton")     # needs CUDA
    with pytest.raises(ValueError, match="backend must be one of"):
        sp.kernels.attention(q, k, v, backend="nope")
    text = str(sp.kernels.explain(q, k, v))
    assert "sdpa" in text and "flash_triton" in text and "needs a CUDA tensor" in text


@pytest.mark.parametrize("bad", ["int", "mask_shape", "mask_dtype", "scale"])
def test_bad_inputs_raise_value_errors_naming_the_argument(bad):
    q, k, v = _inputs(1, 7, 9, 2, 2, 16, torch.float32, "cpu")
    kw = {}
    if bad == "int":
        q, k, v = (t.to(torch.int64) for t in (q, k, v))
        match = "q must have a floating dtype"
    elif bad == "mask_shape":
        kw["attn_mask"] = torch.ones(1, 1, 7, 8, dtype=torch.bool)
        match = "attn_mask of shape"
    elif bad == "mask_dtype":
        kw["attn_mask"] = torch.ones(1, 1, 7, 9, dtype=torch.int32)
        match = "attn_mask must be bool"
    else:
        kw["scale"] = "x"
        match = "scale must be"
    for fn in (sp.kernels.attention, lambda *a, **k_: sp.kernels.skip_attention(*a, tile=(16, 16), **k_)):
        with pytest.raises(ValueError, match=match):
            fn(q, k, v, **kw)


def test_empty_key_set_gives_zeros_and_minus_inf_lse():
    q = torch.randn(2, 8, 2, 16)
    k = v = torch.randn(2, 0, 2, 16)
    out, lse = sp.kernels.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 8, 2, 16) and torch.all(out == 0) and torch.all(lse == float("-inf"))
    assert sp.kernels.attention(q[:, :0], k, v).shape == (2, 0, 2, 16)


@pytest.mark.parametrize("tile,must_do,gqa", [((32, 32), None, 1), ((16, 32), [(0, 10)], 2), ((32, 16), None, 1)])
def test_cpu_skip_backend_matches_the_reference(tile, must_do, gqa):
    q, k, v = video_like_qkv(frames=3, height=6, width=8, dim=32, step=0)     # 144 tokens: partial last tiles
    if gqa > 1:
        k, v = k[:, :, : k.shape[2] // gqa], v[:, :, : v.shape[2] // gqa]
    lst = None
    for step in range(3):
        q, k2, v2 = video_like_qkv(frames=3, height=6, width=8, dim=32, step=step)
        if gqa > 1:
            k2, v2 = k2[:, :, : k2.shape[2] // gqa], v2[:, :, : v2.shape[2] // gqa]
        o_cpu, n_cpu, l_cpu = sp.kernels.skip_attention(q, k2, v2, lst, -3.0, must_do=must_do, tile=tile,
                                                        return_lse=True, backend="cpu")
        o_ref, n_ref, l_ref = skip_reference.skip_attention(q, k2, v2, lst, -3.0, must_do=must_do, tile=tile,
                                                            return_lse=True)
        assert n_cpu.equal(n_ref), step
        assert (o_cpu.double() - o_ref.double()).abs().max() <= attention_bound(q, k2, v2, torch.float32)
        assert torch.allclose(l_cpu, l_ref, rtol=0, atol=float(1e-5 * (1 + l_ref.abs().max())))
        lst = n_ref
    assert lst.density() < 1.0      # the lists really shrank: the comparison covered sparse calls


def test_cpu_skip_backend_first_call_takes_sdpa_for_the_output_and_keeps_the_exact_list():
    q, k, v = video_like_qkv(frames=3, height=6, width=8, dim=32, step=0)
    k, v = k[:, :, :1], v[:, :, :1]                       # GQA: every query head on one kv head
    o_cpu, n_cpu = sp.kernels.skip_attention(q, k, v, None, -3.0, tile=(32, 32), backend="cpu")
    o_ref, n_ref = skip_reference.skip_attention(q, k, v, None, -3.0, tile=(32, 32))
    assert n_cpu.equal(n_ref) and n_ref.density() < 1.0
    assert (o_cpu.double() - o_ref.double()).abs().max() <= attention_bound(q, k, v, torch.float32)


def test_cpu_skip_backend_gathers_below_the_dense_switch():
    q, k, v = video_like_qkv(frames=4, height=8, width=8, dim=32, step=0)
    B, S, H, _ = q.shape
    mask = torch.zeros(B, H, S // 32, S // 32, dtype=torch.bool)
    mask[..., 0] = True
    mask[..., 3] = True
    lst = sp.kernels.SkipList.from_mask(mask, (32, 32), S, S)
    o_cpu, n_cpu = sp.kernels.skip_attention(q, k, v, lst, -2.0, backend="cpu")
    o_ref, n_ref = skip_reference.skip_attention(q, k, v, lst, -2.0)
    assert n_cpu.equal(n_ref)
    assert (o_cpu - o_ref).abs().max() <= attention_bound(q, k, v, torch.float32)


def test_nonfinite_rows_keep_every_tile_they_read():
    q, k, v = video_like_qkv(frames=2, height=8, width=8, dim=32, step=0)
    _, lst = sp.kernels.skip_attention(q, k, v, None, -2.0, tile=(32, 32))
    assert lst.density() < 1.0
    bad_q = q.clone()
    bad_q[0, 5, 0, 0] = float("nan")          # row 5: q-tile 0 of head 0
    out, nxt = sp.kernels.skip_attention(bad_q, k, v, lst, -2.0)
    assert torch.isnan(out[0, 5, 0]).all()
    read, got = lst.to_mask(), nxt.to_mask()
    assert torch.equal(got[0, 0, 0], read[0, 0, 0])           # the poisoned q-tile keeps what it read
    _, clean = sp.kernels.skip_attention(q, k, v, lst, -2.0)
    assert torch.equal(got[0, 1], clean.to_mask()[0, 1])      # other heads are untouched


def test_skip_step_counts_nonfinite_calls_and_keeps_lists():
    q, k, v = video_like_qkv(frames=2, height=8, width=8, dim=32, step=0)
    B, S, H, _ = q.shape
    buf = sp.kernels.SkipListBuffers.create(B, H, S, S, (32, 32), q.device)
    sp.kernels.skip_step(q, k, v, buf, -2.0, 0)
    before = buf.current(0).to_mask().float().mean().item()
    bad = q.clone()
    bad[:, :, :, 0] = float("inf")
    sp.kernels.skip_step(bad, k, v, buf, -2.0, 0)
    assert int(buf.nonfinite[0]) == 1
    assert buf.current(0).to_mask().float().mean().item() >= before     # lists did not shrink


# --------------------------------------------------------------------------------------------------- GPU

GPU_CASES = [  # (B, Sq, Sk, Hq, Hk, D, causal)
    (2, 300, 300, 4, 4, 64, False), (2, 300, 300, 8, 2, 128, True), (1, 1, 700, 8, 2, 128, True),
    (1, 257, 257, 4, 4, 256, True), (1, 129, 500, 4, 2, 96, False), (1, 64, 640, 4, 4, 128, True),
]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES)
def test_every_supported_gpu_backend_matches_the_oracle(case, dtype):
    B, Sq, Sk, Hq, Hk, D, causal = case
    q, k, v = _inputs(B, Sq, Sk, Hq, Hk, D, dtype, "cuda")
    want = reference.attention(q.double(), k.double(), v.double(), causal=causal)
    call = dispatch.Call.of("attention", q, k, v, causal=causal)
    ran = []
    for b in dense_op.BACKENDS:
        if b.supports(call):
            continue
        out = sp.kernels.attention(q, k, v, causal=causal, backend=b.name)
        err = (out.double() - want).abs().max().item()
        assert err <= attention_bound(q, k, v, dtype), (b.name, err)
        ran.append(b.name)
    assert "sdpa" in ran or (causal and Sq not in (1, Sk))
    assert sp.kernels.explain(q, k, v, causal=causal).backend in ran


@gpu
def test_gpu_skip_backends_agree_and_repair_nonfinite_rows():
    q, k, v = (t.cuda().half() for t in video_like_qkv(frames=4, height=16, width=16, dim=64, step=0))
    out_t, n_t = sp.kernels.skip_attention(q, k, v, None, -3.0, tile=(64, 64))
    out_r, n_r = skip_reference.skip_attention(q, k, v, None, -3.0, tile=(64, 64))
    assert n_t.equal(n_r)
    assert (out_t.double() - out_r.double()).abs().max() <= attention_bound(q, k, v, torch.float16)
    bad = q.clone()
    bad[0, 3, 1, 0] = float("nan")
    _, n_bad = sp.kernels.skip_attention(bad, k, v, n_r, -3.0)
    assert torch.equal(n_bad.to_mask()[0, 1, 0], n_r.to_mask()[0, 1, 0])
    assert skip_op.DISPATCH.route(dispatch.Call.of("skip_attention", q, k, v, tile=(64, 64))).backend == \
        "flash_triton"
