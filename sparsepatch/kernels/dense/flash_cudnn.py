"""Training calls: our flash forward, torch's cuDNN backward (`flash_cudnn_bwd` backend of dense `attention`).

The backward of attention needs only q, k, v, the output O, dO and the row log-sum-exp (B, Hq, Sq) of the scaled
scores. Our forward (the Gluon kernel on sm_90) writes O and that LSE (natural log), the same two tensors cuDNN's
forward saves, so cuDNN's backward kernel (`aten::_scaled_dot_product_cudnn_attention_backward`) takes them as they
are: a training step then pays our forward (faster than cuDNN's where the cost table says so) plus cuDNN's backward
(the fastest backward measured on Hopper; our Triton one is ~0.75x of it). Same function as `reference.attention`
and its gradient; the dispatcher picks this backend for a call that needs gradients only where a measured
forward + backward entry ("attention+backward") says it beats SDPA's own fwd+bwd.
"""
from __future__ import annotations

import torch

from ..dispatch import Call

_HALF = (torch.float16, torch.bfloat16)


def _cudnn_backward_op():
    return getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward", None)


def supports(call: Call) -> str | None:
    """Why this backend does not run `call`, or None. Training calls only (inference is `flash_triton` itself), CUDA
    sm_90 fp16/bf16, no mask, no LSE output, head dim 64 / 128 with v's equal, causal only with Sq == Sk (cuDNN's
    causal mask is top-left aligned; ours bottom-right: equal there), and only where torch's cuDNN kernel itself
    takes the shape."""
    from . import op, sdpa
    if not call.needs_grad:
        return "training calls only (inference runs flash_triton)"
    if call.return_lse:
        return "returns no LSE (its gradient is not propagated)"
    if call.device != "cuda" or call.arch is None or call.arch[0] != 9:
        return "needs sm_90 (the Gluon forward)"
    if call.dtype not in _HALF:
        return f"needs float16/bfloat16, got {call.dtype}"
    if call.mask is not None:
        return "takes no attn_mask"
    if call.head_dim not in (64, 128) or call.head_dim_v != call.head_dim:
        return f"head dim {call.head_dim} / {call.head_dim_v} (runs 64 / 128, v's equal to q's)"
    if call.causal and call.seq_q != call.seq_k:
        return "causal with Sq != Sk (cuDNN's causal mask is top-left aligned)"
    if any(lay == "other" for lay in call.layouts):
        return "needs sequence- or head-major q/k/v"
    if _cudnn_backward_op() is None:
        return "this torch has no cuDNN attention backward op"
    why = op.flash_kernel_reason(call)
    return why or sdpa.supports(Call(**{**call.__dict__, "needs_grad": False}), "cudnn")


class _FlashCudnn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        from ..skip import triton as skip_triton
        out, lse = skip_triton._dense_fwd(q, k, v, causal, scale, True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        Sq, Sk = q.shape[1], k.shape[1]
        # cuDNN's graph is built from the tensors' strides; dO is given the layout of O (what its own forward saves)
        dout = dout.contiguous() if dout.stride() != out.stride() else dout
        seed = torch.zeros((), dtype=torch.int64, device=q.device)   # dropout 0: read by no kernel
        # the stats are (B, Hq, Sq, 1) in cuDNN's graph; attn_bias and the ragged offsets are undefined (None)
        dq, dk, dv = _cudnn_backward_op()(
            dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
            lse.unsqueeze(-1), seed, seed, None, None, None, Sq, Sk, 0.0, bool(ctx.causal) and Sq > 1,
            scale=ctx.scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None


def attention(q, k, v, *, causal=False, scale=None, attn_mask=None, return_lse=False):
    """q (B, Sq, Hq, D), k / v (B, Sk, Hk, D) -> out (B, Sq, Hq, D), differentiable; `supports` has the inputs."""
    if return_lse or attn_mask is not None:
        raise ValueError("flash_cudnn_bwd takes no attn_mask and returns no LSE")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    from .op import unit_head_dim_stride
    q, k, v = unit_head_dim_stride(q, k, v)
    return _FlashCudnn.apply(q, k, v, bool(causal), scale)
