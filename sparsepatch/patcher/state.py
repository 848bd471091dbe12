"""Per-patch state: skip lists per (layer, branch) across denoising steps, call counts, densities.

The patcher adapters (diffusers.py, transformers.py, sdpa_mode.py) hand every attention call they intercept to
`PatchHandle.attend`. Lists live in `SkipListBuffers` (device tensors updated by `stateful.skip_step`: the
`sparsepatch::skip_step` op when compiled, its body when eager), keyed by (layer, context); a context is the
pipeline's cache-context name ("cond", "uncond", ...).
"""
from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch

from .. import kernels
from ..config import DenseConfig, SkipConfig
from ..kernels import SkipListBuffers, skip_step, skip_step_differentiable

logger = logging.getLogger("sparsepatch")


def _fp8(config) -> bool:
    return isinstance(config, (DenseConfig, SkipConfig)) and config.precision == "fp8"


def dense_route(config, q, k, v, *, causal=False, attn_mask=None) -> str:
    """The backend name a dense call runs (for `stats()["backends"]`)."""
    if _fp8(config):
        return "attention_fp8"
    return kernels.backend_for(q, k, v, causal=causal, attn_mask=attn_mask)


def dense_kernel(config):
    """The dense attention function a config asks for: `kernels.attention_fp8` for precision="fp8" (DenseConfig, and
    the dense calls of a SkipConfig), `kernels.attention` otherwise."""
    if _fp8(config):
        return kernels.attention_fp8
    return kernels.attention


@dataclass
class CallSite:
    """Where an attention call comes from: the layer's qualified name and how to name its batch elements.

    batch_branches: None (the batch is one branch named after the context) or a function
        (context, batch_size) -> list of branch names per batch element (batched CFG: ["uncond", ..., "cond"]).
    grid_key: None, or the `PatchHandle.contexts` key under which the adapter records the latent grid of the
        current model call (e.g. the denoiser input's shape). Skip lists are keyed on it: two calls with the same
        token count but another (frames, height, width) arrangement do not share lists.
    """

    layer: str
    batch_branches: object = None
    grid_key: str | None = None


def batched_cfg_branches(context: str, batch: int) -> list[str]:
    """Batched classifier-free guidance: the first half of the batch is uncond, the second half cond."""
    if batch % 2:
        return [context] * batch
    return ["uncond"] * (batch // 2) + ["cond"] * (batch // 2)


class _UndoStack(list):
    """The undo closures of one patch. Owned by the patched object (an entry of its __dict__), so closures that
    hold the model's modules never keep the model alive from the handle or from a module-level registry."""


UNDO_ATTR = "_sparsepatch_undo"


class PatchHandle:
    """What `sp.patch` returns: undo stack, call counts, skip state and `stats()`.

    Adapters call `add_undo(fn)` for each thing they change (undone in reverse on `remove()`), `add_release(fn)` for
    process-wide registrations (run once: on `remove()`, or when the handle is garbage-collected after the patched
    model was deleted unpatched), `record_call` for calls they serve themselves, and `attend(...)` to run attention
    under the handle's config.

    Ownership: the patched object owns its undo stack; the handle refers to the object only weakly. Deleting a
    patched model frees it (no `sp.unpatch` needed), even while the handle is still referenced; `remove()` on the
    handle of a freed model only runs the releases.
    """

    def __init__(self, obj, config):
        self._obj = weakref.ref(obj)
        self.config = config
        undos = _UndoStack()
        obj.__dict__[UNDO_ATTR] = undos
        self._undos = weakref.ref(undos)
        self._releases = []
        # Runs the releases once when the handle dies unremoved; its callback must not refer to the handle.
        self._finalizer = weakref.finalize(self, _run_all, self._releases)
        self._finalizer.atexit = False
        self._removed = False
        self._calls = 0
        self._history = defaultdict(lambda: defaultdict(list))   # layer -> branch -> [density per call]
        self._served: dict = {}                                # layer -> backend -> calls served
        self._buffers: dict[tuple[str, str], tuple] = {}         # (layer, context) -> (buffers, site, names, grid)
        self.contexts: dict[str, str] = {}                       # denoiser prefix -> current cache context
        self.probe = None                                        # validate's hook: fn(site, branch_names, q, k, v, out)
        self._warned = set()

    @property
    def obj(self):
        """The patched pipeline/model, or None once it was garbage-collected."""
        return self._obj()

    # --- undo stack ---------------------------------------------------------------------------------------------
    def add_undo(self, fn) -> None:
        """fn() is called (in reverse order of registration) by `remove()`; it may hold the model's modules."""
        undos = self._undos()
        if undos is None:
            raise RuntimeError("the patched object was garbage-collected")
        undos.append(fn)

    def add_release(self, fn) -> None:
        """fn() is called once after every undo on `remove()`, or when the handle is garbage-collected. It releases
        a process-wide registration and must not refer to the model (or it would keep the model alive)."""
        self._releases.append(fn)

    def remove(self) -> None:
        """Restore everything the patch changed, bit-exactly. Idempotent."""
        if self._removed:
            return
        self.reset()
        obj = self._obj()
        try:
            undos = obj.__dict__.pop(UNDO_ATTR, None) if obj is not None else None
            while undos:
                undos.pop()()
        finally:
            self._removed = True
            self._finalizer()
            from . import _HANDLES
            if obj is not None and _HANDLES.get(obj) is self:
                del _HANDLES[obj]

    @property
    def removed(self) -> bool:
        return self._removed

    # --- accounting ---------------------------------------------------------------------------------------------
    def count_backend(self, layer_name: str, backend: str) -> None:
        """One call of layer_name served by `backend` (stats()["backends"]). Not counted inside torch.compile
        graphs: a Python counter there would be a guard that recompiles every call."""
        if torch.compiler.is_compiling():
            return
        counts = self._served.setdefault(layer_name, {})
        counts[backend] = counts.get(backend, 0) + 1

    def record_call(self, layer_name: str, branch: str, density: float) -> None:
        self._calls += 1
        self._history[layer_name][branch].append(float(density))

    def reset(self) -> None:
        """End of a video: move live skip-list densities into the history and drop the lists."""
        for key in list(self._buffers):
            self._archive(key)
        self._buffers.clear()

    def _archive(self, key) -> None:
        buffers, site, names, _ = self._buffers.pop(key)
        hist = buffers.history()                                    # (calls, B)
        self._calls += int(buffers.step.item())
        for branch in dict.fromkeys(names):
            cols = [i for i, n in enumerate(names) if n == branch]
            self._history[site.layer][branch].extend(hist[:, cols].mean(1).tolist())

    def stats(self) -> dict:
        """{"calls": int, "density": {layer: {branch: [density per call]}}, "per_step": [mean density per step]}.

        density is the fraction of skip tiles computed (1.0 = dense); calls counts every patched attention call.
        """
        density = {layer: {b: list(v) for b, v in branches.items()} for layer, branches in self._history.items()}
        calls = self._calls
        for (buffers, site, names, _) in self._buffers.values():
            hist = buffers.history()
            calls += int(buffers.step.item())
            for branch in dict.fromkeys(names):
                cols = [i for i, n in enumerate(names) if n == branch]
                density.setdefault(site.layer, {}).setdefault(branch, []).extend(hist[:, cols].mean(1).tolist())
        per_step = defaultdict(list)
        for branches in density.values():
            for values in branches.values():
                for i, d in enumerate(values):
                    per_step[i].append(d)
        return {"calls": calls, "density": density,
                "per_step": [sum(v) / len(v) for _, v in sorted(per_step.items())],
                "backends": {layer: dict(c) for layer, c in self._served.items()}}

    def skip_lists(self) -> dict:
        """{(layer, context): SkipList the next call will read} for the live lists (for inspection and tests)."""
        warm = self.config.warmup_steps if isinstance(self.config, SkipConfig) else 0
        return {key: entry[0].current(warm) for key, entry in self._buffers.items()}

    def warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg)

    # --- the attention call -------------------------------------------------------------------------------------
    def attend(self, site: CallSite, context: str, q, k, v, *, attn_mask=None, is_causal=False, scale=None,
               dropout_p=0.0, must_do=None, self_attention=True):
        """Attention for one intercepted call. q (B, Sq, Hq, D), k/v (B, Sk, Hk, D) -> (B, Sq, Hq, D).

        Masks (DenseConfig and SkipConfig alike): a boolean key-padding mask shared by the batch is applied by
        removing the masked keys, so a masked key contributes exactly nothing, even when its value is NaN or inf
        (HunyuanVideo's padded text tokens are NaN when the whole text mask is False); a query whose keys are all
        masked gets zeros, as torch SDPA gives. Any other mask goes to the kernel, which follows SDPA.
        """
        if dropout_p:
            raise ValueError(f"dropout_p={dropout_p}: sparsepatch attention has no dropout; call the model in eval "
                             "mode or set the attention dropout to 0")
        B = q.shape[0]
        names = site.batch_branches(context, B) if site.batch_branches else [context] * B
        cfg = self.config
        sparse = (isinstance(cfg, SkipConfig) and self_attention and not is_causal
                  and q.shape[1] == k.shape[1])
        if attn_mask is not None and not is_causal:
            q, k, v, attn_mask, must_do = _drop_padded_keys(q, k, v, attn_mask, must_do)
            if attn_mask is not None and sparse:
                self.warn_once("mask", f"{site.layer}: attention mask is not a key-padding mask shared by the "
                               "batch; running these calls dense")
                sparse = False
        if k.shape[1] == 0:   # every key masked
            out = q.new_zeros(q.shape[:3] + (v.shape[3],))
            sparse = False
        elif not sparse:
            self.count_backend(site.layer, dense_route(cfg, q, k, v, causal=is_causal, attn_mask=attn_mask))
            out = dense_kernel(cfg)(q, k, v, causal=is_causal, scale=scale, attn_mask=attn_mask)
        if not sparse:
            for branch in dict.fromkeys(names):
                self._history[site.layer][branch].append(1.0)
            self._calls += 1
        else:
            buffers = self._buffers_for(site, context, q, k, names)
            extra = [tuple(r) for r in (cfg.must_do or [])]
            ranges = (must_do or []) + extra
            if not hasattr(buffers, "backend"):   # routed once per list (shape, dtype and device fixed)
                buffers.backend = "skip:" + kernels.explain(q, k, v, op="skip_attention", tile=cfg.tile,
                                                            must_do=ranges, precision=cfg.precision).backend
            self.count_backend(site.layer, buffers.backend)
            training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
            if training and cfg.precision == "fp8":
                raise ValueError(f"{site.layer}: SkipConfig(precision='fp8') is inference-only and this call needs "
                                 "gradients; run under torch.no_grad() or patch with precision='native'")
            if training:
                out = skip_step_differentiable(q, k, v, buffers, cfg.threshold, cfg.warmup_steps, scale=scale,
                                               must_do=ranges, backward_skip=cfg.backward)
            else:
                out = skip_step(q, k, v, buffers, cfg.threshold, cfg.warmup_steps, scale=scale, must_do=ranges,
                                precision=cfg.precision)
        if self.probe is not None:
            self.probe(site, names, q, k, v, out, scale)
        return out

    def _buffers_for(self, site, context, q, k, names) -> SkipListBuffers:
        """The lists of (layer, context). A new video (lists archived, fresh ones made) whenever the batch layout,
        shapes, heads, dtype, device or the latent grid of the model call (`site.grid_key`) change."""
        key = (site.layer, context)
        B, Sq, Hq, _ = q.shape
        Sk = k.shape[1]
        sig = (tuple(names), self.contexts.get(site.grid_key) if site.grid_key else None)
        entry = self._buffers.get(key)
        if entry is not None and (not entry[0].matches(B, Hq, Sq, Sk, q.device) or entry[2] != sig[0]
                                  or entry[3] != sig[1] or entry[0].dtype != q.dtype):
            self._archive(key)
            entry = None
        if entry is None:
            buffers = SkipListBuffers.create(B, Hq, Sq, Sk, self.config.tile, q.device)
            buffers.dtype = q.dtype
            entry = (buffers, site, sig[0], sig[1])
            self._buffers[key] = entry
        return entry[0]


def _run_all(fns) -> None:
    while fns:
        fns.pop()()


_MASK_PLAN: dict = {}   # id(mask) -> (weakref, version, plan): one host sync per mask, not per layer


def _padding_plan(attn_mask):
    """How to serve a mask exactly without it: ("none",) all keys kept; ("suffix", n) keep the first n keys;
    ("gather", idx) keep those keys; ("mask",) not a key-padding mask shared by the batch — keep the mask."""
    if attn_mask.dtype != torch.bool:
        return ("mask",)
    if attn_mask.dim() != 4 or attn_mask.shape[1] != 1 or attn_mask.shape[2] != 1:
        return ("none",) if bool(attn_mask.all()) else ("mask",)
    keep = attn_mask[:, 0, 0, :]                                      # (B or 1, Sk)
    if not bool((keep == keep[:1]).all()):
        return ("mask",)
    keep = keep[0]
    n = int(keep.sum())
    if n == keep.numel():
        return ("none",)
    if bool(keep[:n].all()):
        return ("suffix", n)
    return ("gather", keep.nonzero().squeeze(1))


def _drop_padded_keys(q, k, v, attn_mask, must_do):
    """Turn a key-padding mask shared by every batch element into a shorter k/v (exactly the same attention).

    Keys that a mask removes contribute exactly 0 to the softmax, so removing them is exact. Returns
    (q, k, v, None, must_do) with the masked keys removed, or the inputs unchanged (mask kept) when the mask is not
    of that form. must_do ranges are token positions applied to q and k alike, so with must_do the removed keys must
    be a suffix (text padding at the end of a [video, text] sequence); otherwise the mask is kept.
    The plan is cached per mask tensor (diffusers passes one mask object to every layer of a forward).
    """
    seen = _MASK_PLAN.get(id(attn_mask))
    if seen is not None and seen[0]() is attn_mask and seen[1] == attn_mask._version:
        plan = seen[2]
    else:
        plan = _padding_plan(attn_mask)
        if len(_MASK_PLAN) > 64:
            _MASK_PLAN.clear()
        _MASK_PLAN[id(attn_mask)] = (weakref.ref(attn_mask), attn_mask._version, plan)
    if plan[0] == "none":
        return q, k, v, None, must_do
    if plan[0] == "suffix":
        return q, k[:, :plan[1]], v[:, :plan[1]], None, must_do
    if plan[0] == "gather" and not must_do:
        return q, k.index_select(1, plan[1]), v.index_select(1, plan[1]), None, must_do
    return q, k, v, attn_mask, must_do
