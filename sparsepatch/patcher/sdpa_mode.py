"""Fallback for processors that call torch.nn.functional.scaled_dot_product_attention directly (CogVideoX, Mochi).

Inside `route_sdpa(attend)`, every SDPA call is redirected to `attend(q, k, v, attn_mask, dropout_p, is_causal,
scale)` with (B, S, H, D) views of SDPA's (B, H, S, D) tensors (transposes, no copies). The mode is entered only
around one patched processor's call, so nothing else in the process sees it.
"""
from __future__ import annotations

import contextlib

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class _SDPARouter(TorchFunctionMode):
    def __init__(self, attend):
        super().__init__()
        self.attend = attend

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        q, k, v = (bound[n].transpose(1, 2) for n in names[:3])
        out = self.attend(q, k, v, bound.get("attn_mask"), bound.get("dropout_p", 0.0),
                          bound.get("is_causal", False), bound.get("scale"))
        return out.transpose(1, 2)


@contextlib.contextmanager
def route_sdpa(attend):
    """Redirect F.scaled_dot_product_attention calls made inside the block to `attend`."""
    with _SDPARouter(attend):
        yield
