"""Skip lists carried across calls inside the sparsepatch::skip_step op (reference path on CPU)."""
import torch

from sparsepatch.kernels import reference
from sparsepatch.kernels.stateful import SkipListBuffers, skip_step
from sparsepatch.testing import video_like_qkv


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
            expect, nxt = reference.skip_attention(q, k, v, lst, -4.0, tile=(32, 32), must_do=[(0, 10)])
            densities.append(1.0 if lst is None else lst.density().item())
            lst = nxt
        assert (out - expect).abs().max() < 1e-6, i
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
    from sparsepatch.kernels.stateful import skip_step_differentiable
    steps = [video_like_qkv(frames=4, height=8, width=8, dim=32, step=i) for i in range(3)]
    a = SkipListBuffers.create(1, 2, 256, 256, (32, 32), "cpu")
    b = SkipListBuffers.create(1, 2, 256, 256, (32, 32), "cpu")
    for q, k, v in steps:
        read_list = b.current(1).clone()
        q = q.clone().requires_grad_()
        out_op = skip_step(q.detach(), k, v, a, -4.0, 1)
        out = skip_step_differentiable(q, k, v, b, -4.0, 1)
        assert (out - out_op).abs().max() < 1e-6
    assert a.current(1).equal(b.current(1)) and torch.equal(a.history(), b.history())
    assert read_list.density() < 1.0
    out.square().sum().backward()
    q_ref = q.detach().clone().requires_grad_()
    ref, _ = reference.skip_attention(q_ref, k, v, read_list, -4.0)
    ref.square().sum().backward()
    assert (q.grad - q_ref.grad).abs().max() < 1e-5          # the gradient of the sparse forward


def test_backward_skip_keeps_forward_value_and_drops_negligible_tiles_from_the_gradient():
    from sparsepatch.kernels.stateful import skip_step_differentiable
    q, k, v = video_like_qkv(frames=4, height=8, width=8, dim=32)
    exact = SkipListBuffers.create(1, 2, 256, 256, (32, 32), "cpu")
    approx = SkipListBuffers.create(1, 2, 256, 256, (32, 32), "cpu")
    grads = []
    for buffers, flag in ((exact, False), (approx, True)):
        qq = q.clone().requires_grad_()
        out = skip_step_differentiable(qq, k, v, buffers, -3.0, 0, backward_skip=flag)
        out.square().sum().backward()
        grads.append((out.detach(), qq.grad))
    assert torch.equal(grads[0][0], grads[1][0])                       # same forward value
    kept = exact.current(0)
    assert kept.density() < 0.9
    q_ref = q.clone().requires_grad_()
    ref_kept, _ = reference.skip_attention(q_ref, k, v, kept, -3.0)
    (2 * grads[0][0] * ref_kept).sum().backward()                      # d/dq of sum(out^2) through kept tiles
    assert (grads[1][1] - q_ref.grad).abs().max() < 1e-5
    cos = torch.nn.functional.cosine_similarity(grads[0][1].flatten(), grads[1][1].flatten(), dim=0)
    assert 0.9 < cos < 1.0                                             # approximate, and close
