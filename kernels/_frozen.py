"""Tensors derived from frozen weights (a stacked or transposed copy), made once and kept across calls.

The inference kernels take some weights in another form than the module stores them: ``[U; V]`` stacked for one
GEMM (:mod:`.painn_update`), a weight transposed so that a GEMM's B operand is K-major (:mod:`.linear`). Making
that form anew would cost a launch per use per step, and inside a CUDA graph it would be a node of every replay.

An entry is keyed by the weights' identities and holds weak references to them, detached aliases of their data and
their version counters. A hit needs the same tensors, the same data (``module.to()`` swaps a parameter's data and
keeps its version; the aliases keep the old storage alive, so new data can never sit at its address) and the same
versions (an in-place edit). A changed weight whose derived form keeps its shape, dtype and device is refreshed in
place, so the address stays valid for a CUDA graph that captured it (the graph reads the new values once an eager
call has refreshed them). The weak references drop the entry with the weights. Inference tensors have no version
counter: they are not cached.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["derived", "tf32_parts"]

_CACHE: dict[tuple, tuple] = {}


def derived(tag: str, make: Callable[..., Tensor], *weights: Tensor) -> Tensor:
    """``make(*weights)``, made once and returned again while none of ``weights`` changes (``tag`` names the form,
    so one weight can have several)."""
    try:
        versions = tuple(w._version for w in weights)
    except RuntimeError:  # inference tensors have no version counter: no caching
        return make(*weights)
    key = (tag, *(id(w) for w in weights))
    hit = _CACHE.get(key)
    if hit is not None and all(ref() is w for ref, w in zip(hit[0], weights, strict=True)):
        refs, aliases, old_versions, out = hit
        same_data = all(a.data_ptr() == w.data_ptr() for a, w in zip(aliases, weights, strict=True))
        if old_versions == versions and same_data:
            return out
        new = make(*weights)
        if new.shape == out.shape and new.dtype == out.dtype and new.device == out.device:
            with torch.no_grad():
                out.copy_(new)
            new = out
        _CACHE[key] = (refs, tuple(w.detach() for w in weights), versions, new)
        return new
    out = make(*weights)

    def drop(_, key=key):
        _CACHE.pop(key, None)

    refs = tuple(weakref.ref(w, drop) for w in weights)
    _CACHE[key] = (refs, tuple(w.detach() for w in weights), versions, out)
    return out


def split_tf32(w: Tensor) -> Tensor:
    """``[W_hi, W_lo]`` stacked (``[2, *W.shape]``, contiguous): W_hi is float32 W rounded to the nearest TF32 value
    (ties away from zero, as ``cvt.rna.tf32.f32`` and Triton's tf32x3 round), W_lo = W - W_hi, exact in float32."""
    with torch.no_grad():
        w = w.detach().contiguous()
        hi = ((w.view(torch.int32) + 0x1000) & -8192).view(torch.float32)  # -8192 = 0xFFFFE000: 13 low bits clear
        return torch.stack((hi, w - hi))


def tf32_parts(w: Tensor) -> Tensor:
    """:func:`split_tf32` of a float32 weight, made once while W is unchanged (:func:`derived`): what the kernels'
    "tf32x3w" dots take (three TF32 MMAs with only the other operand split in registers)."""
    return derived("tf32split", split_tf32, w)
