"""torch SDPA as a dense backend: torch's own kernel choice, or forced onto cuDNN / flash / memory-efficient.

Same function as `reference.attention` where `supports` says yes: no LSE, causal only where SDPA's top-left
causal mask equals our bottom-right one (Sq == Sk) or is not needed (Sq == 1 sees every key), masks that are
bool or in q's dtype. Inputs stay (B, S, H, D): SDPA gets (B, H, S, D) views, the output is the (B, S, H, D) view
of SDPA's result (no copy, as diffusers' own SDPA path returns it).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..dispatch import Call

KERNELS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION}
FORCED_HOST_MS = 0.02   # host time of entering and leaving `sdpa_kernel` (measured ~15-20 us)
_CAN_USE = {"cudnn": "can_use_cudnn_attention", "flash": "can_use_flash_attention",
            "efficient": "can_use_efficient_attention"}


@functools.lru_cache(maxsize=1024)
def _kernel_reason(call: Call, kernel: str) -> str | None:
    """Ask torch whether its `kernel` runs this call (on stand-in tensors of the call's shape, no allocation)."""
    check = getattr(torch.backends.cuda, _CAN_USE[kernel], None)
    params_cls = getattr(torch.backends.cuda, "SDPAParams", None)
    if check is None or params_cls is None:
        return f"this torch has no {kernel} check"

    def stand_in(B, H, S, D):
        return torch.empty((1, 1, 1, D), dtype=call.dtype, device="cuda").expand(B, H, S, D)

    q = stand_in(call.batch, call.heads_q, call.seq_q, call.head_dim)
    k = stand_in(call.batch, call.heads_k, call.seq_k, call.head_dim)
    v = stand_in(call.batch, call.heads_k, call.seq_k, call.head_dim_v)
    mask = None
    if call.mask is not None:
        mask = torch.empty((1, 1, 1, 1), dtype=torch.bool if call.mask == "bool" else call.dtype,
                           device="cuda").expand(call.batch, call.heads_q, call.seq_q, call.seq_k)
    try:
        params = params_cls(q, k, v, mask, 0.0, call.causal and call.seq_q > 1, call.group > 1)
        return None if check(params, False) else f"torch's {kernel} kernel does not take this shape / dtype"
    except Exception as exc:  # noqa: BLE001  (an older SDPAParams signature: treat as unsupported)
        return f"torch's {kernel} check failed ({type(exc).__name__})"


def supports(call: Call, kernel: str | None) -> str | None:
    if call.return_lse:
        return "returns no LSE"
    if not call.dtype.is_floating_point:
        return f"needs a floating dtype, got {call.dtype}"
    if call.causal and not (call.seq_q == call.seq_k or call.seq_q == 1):
        return "causal with Sq != Sk (SDPA's causal mask is top-left aligned)"
    if call.mask == "float" and call.dtype not in (torch.float32, torch.float64) and call.device != "cuda":
        return "float masks in half precision on CPU"
    if kernel is None:
        return None
    if call.device != "cuda":
        return "needs a CUDA tensor"
    return _kernel_reason(call, kernel)


def attention(q, k, v, *, kernel=None, causal=False, scale=None, attn_mask=None, return_lse=False):
    """SDPA over (B, S, H, D) inputs -> (B, Sq, Hq, Dv). kernel: None (torch's choice) or a key of KERNELS."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        attn_mask = attn_mask.to(q.dtype)
    kw = dict(attn_mask=attn_mask, is_causal=bool(causal) and q.shape[1] > 1, scale=scale,
              enable_gqa=q.shape[2] != k.shape[2])
    if kernel is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, **kw)
    else:
        try:
            with sdpa_kernel(KERNELS[kernel]):
                out = F.scaled_dot_product_attention(qh, kh, vh, **kw)
        except RuntimeError:   # the kernel declined a length of this shape class: torch's own choice, same function
            out = F.scaled_dot_product_attention(qh, kh, vh, **kw)
    return out.transpose(1, 2)
