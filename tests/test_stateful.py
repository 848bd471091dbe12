"""Skip lists carried across calls inside the sparsepatch::skip_step op (CPU backends: SDPA for warm-up calls, the CPU skip kernel)."""
import math

import torch

from kernel_checks import assert_agree, assert_rel, fp_bound
from sparsepatch.kernels.dense import reference
from sparsepatch.kernels.skip import reference as skip_reference
from sparsepatch.kernels.skip.stateful import SkipListBuffers, skip_step
from sparsepatch.testing import video_like_qkv


def fp32_attention_bound(q, k, v, magnitude=None):
    """Max-abs error bound of an fp32 attention (any backend: SDPA, the CPU skip kernel) against the fp64 oracle.

    Scores carry ~eps * D * |q||k| rounding; exp() turns an absolute score error into a relative weight error, so
    the output error is ~eps * (max |score| + sqrt(D) + log(Sk)) * max |v|; a margin of 8 covers the sum orders."""
    eps = torch.finfo(torch.float32).eps
    smax = (q.double().abs().amax() * k.double().abs().amax() * q.shape[-1] ** 0.5).item()
    magnitude = v.abs().max().item() if magnitude is None else float(magnitude)
    return 8 * eps * (smax + q.shape[-1] ** 0.5 + math.log(k.shape[1])) * magnitude


def test_skip_step_chains_reference_calls_with_warmup():
    steps = [video_like_qkv(frames=4, height=8, width=8, dim=32, step=i) for i in range(5)]
    q0 = steps[0][0]
    B, S, H, _ = q0.shape
    buffers = SkipListBuffers.create(B, H, S, S, (32, 32), q0.device)
    lst, densities = None, []
    for i, (q, k, v) in enumerate(steps):
        out = skip_step(q, k, v, buffers, -4.0, warmup_steps=1, must_do=[(0, 10)])
        if i < 1:
            expect = reference.attention(q, k, v)
            densities.append(1.0)
        else:
            expect, nxt = skip_reference.skip_attention(q, k, v, lst, -4.0, tile=(32, 32), must_do=[(0, 10)])
            densities.append(1.0 if lst is None else lst.density().item())
            lst = nxt
        assert (out - expect).abs().max() <= fp32_attention_bound(q, k, v), i
    hist = buffers.history()[:, 0].tolist()
    assert buffers.calls() == 5
    assert [round(x, 6) for x in hist] == [round(x, 6) for x in densities]
    assert hist[-1] < 0.9                        # the video-like workload is local: tiles really drop
    assert buffers.current(1).equal(lst)


def test_skip_step_compiles_once_for_all_steps():
    import torch._dynamo
    torch._dynamo.reset()
    q, k, v = video_like_qkv(frames=2, height=8, width=8, dim=32)
    buffers = SkipListBuffers.create(1, 2, 128, 128, (32, 32), q.device)
    frames = []

    def layer(q, k, v):
        return skip_step(q, k, v, buffers, -4.0, warmup_steps=1) * 2

    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(5):
            frames.append(compiled(*video_like_qkv(frames=2, height=8, width=8, dim=32, step=step)))
    assert buffers.calls() == 5
    assert buffers.history()[2:, 0].max() < 1.0   # state advanced inside the op, without Python-side guards


def test_differentiable_step_matches_op_and_gives_sparse_gradients():
    from sparsepatch.kernels.skip.stateful import skip_step_differentiable
    steps = [video_like_qkv(frames=4, height=8, width=8, dim=32, step=i) for i in range(3)]
    a = SkipListBuffers.create(1, 2, 256, 256, (32, 32), "cpu")
    b = SkipListBuffers.create(1, 2, 256, 256, (32, 32), "cpu")
    for q, k, v in steps:
        read_list = b.current(1).clone()
        q = q.clone().requires_grad_()
        out_op = skip_step(q.detach(), k, v, a, -4.0, 1)
        out = skip_step_differentiable(q, k, v, b, -4.0, 1)
        assert_agree(out, out_op, torch.float32)
    assert a.current(1).equal(b.current(1)) and torch.equal(a.history(), b.history())
    assert read_list.density() < 1.0
    out.square().sum().backward()
    q_ref = q.detach().clone().requires_grad_()
    ref, _ = skip_reference.skip_attention(q_ref, k, v, read_list, -4.0)
    ref.square().sum().backward()
    # the gradient of the sparse forward (fp32 autograd vs the oracle's), bounded relative to the gradient's size
    assert (q.grad - q_ref.grad).abs().max() <= fp32_attention_bound(q, k, v, q_ref.grad.abs().max())


def test_backward_skip_keeps_forward_value_and_drops_negligible_tiles_from_the_gradient():
    from sparsepatch.kernels.skip.stateful import skip_step_differentiable
    q0, k0, v0 = video_like_qkv(frames=4, height=8, width=8, dim=32, step=0)
    q, k, v = video_like_qkv(frames=4, height=8, width=8, dim=32, step=3, drift=0.3)
    runs = []
    for flag in (False, True):
        buffers = SkipListBuffers.create(1, 2, 256, 256, (32, 32), "cpu")
        skip_step_differentiable(q0, k0, v0, buffers, -3.0, 0)          # step k builds the list
        read = buffers.current(0).clone()
        qq = q.clone().requires_grad_()
        out = skip_step_differentiable(qq, k, v, buffers, -3.0, 0, backward_skip=flag)
        (out * v[..., :1, :].expand_as(out)).sum().backward()
        runs.append((out.detach(), qq.grad, read, buffers.current(0).clone()))
    (out_exact, g_exact, read, kept), (out_train, g_train, _, _) = runs
    assert torch.equal(out_exact, out_train)                            # same forward value
    assert read.density() < 0.95 and (kept.to_mask() != read.to_mask()).any()   # the backward walks fewer tiles
    # Independent check of the training-mode gradient: exact formula with the forward's lse, P zeroed off kept.
    _, _, lse = skip_reference.skip_attention(q.double(), k.double(), v.double(), read, -3.0, return_lse=True)
    qd = q.double()
    s = torch.einsum("bqhd,bkhd->bhqk", qd, k.double()) / 32 ** 0.5
    elem = (read.to_mask() & kept.to_mask()).repeat_interleave(32, 2).repeat_interleave(32, 3)
    p = torch.exp(s - lse.double()[..., None]) * elem
    do = v[..., :1, :].expand_as(out_train).double()
    o = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse.double()[..., None]) * read.to_mask().repeat_interleave(
        32, 2).repeat_interleave(32, 3), v.double())
    dP = torch.einsum("bqhd,bkhd->bhqk", do, v.double())
    delta = (do * o).sum(-1).transpose(1, 2)[..., None]
    want = torch.einsum("bhqk,bkhd->bqhd", p * (dP - delta) / 32 ** 0.5, k.double())
    # lse is stored in fp32: its rounding eps * |lse| (|lse| up to ~100 on this peaked workload) perturbs every p of
    # a row, on top of eps * sqrt(S) from the sums over the 256 keys; sum_k p (dP - delta) k cancels, so errors
    # scale with its terms' size, `cond` times the result's. A wrong tile set or normalisation gives ~1e-1.
    lse_max = lse.abs().max().item()
    terms = torch.einsum("bhqk,bkhd->bqhd", (p * (dP - delta)).abs() / 32 ** 0.5, k.double().abs())
    cond = (terms.norm() / want.norm()).item()
    assert_rel(g_train, want, bound=fp_bound(torch.float32, 256 + lse_max ** 2, cond), what="training-mode dq")
    cos = torch.nn.functional.cosine_similarity(g_exact.flatten(), g_train.flatten(), dim=0)
    assert 0.9 < cos < 1.0                                              # approximate, and close
