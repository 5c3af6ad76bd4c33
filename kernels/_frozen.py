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

__all__ = ["derived", "tf32_exact", "tf32_parts"]

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


# tf32_exact's answers: id(w) -> (weak reference, alias of the data, version, answer)
_EXACT: dict[int, tuple] = {}


def tf32_exact(w: Tensor) -> bool:
    """Whether every entry of the frozen float32 weight ``w`` is a TF32 value (its 13 low significand bits zero,
    so ``W_lo`` of :func:`split_tf32` is zero): then tf32x3's product ``A_hi W_lo`` is an exact zero, and two TF32
    MMAs (``A_hi W + A_lo W``) give bit for bit the sum of its three (``_triton_utils.dot_w``'s "tf32x2w"). A
    student trained or rounded onto the TF32 grid (``StudentModel.round_weights_tf32``) gets this on every weight
    dot: 1.07-1.12x a whole step on the H200 (benchmarks/results/stop59_gpu/b/probe_ncu_sweep_x2.md).

    Looked at once per version of ``w`` (one wait for the device), remembered like :func:`derived`'s forms. False
    without looking where that wait is not allowed or the answer would not last: a weight that requires grad
    (training changes it every step), an inference tensor (no version counter), a tensor without data (fake
    tensors under ``torch.compile``), or inside a CUDA-graph capture before any eager call looked (the engines'
    warm-up calls look first). The three-MMA form is then used, which is right for any W."""
    if w.dtype != torch.float32 or w.requires_grad:
        return False
    if w._base is not None and w._base.dtype == torch.float32:  # a view of an exact weight is exact (a view made
        return tf32_exact(w._base)  # anew per call would otherwise be looked at per call)
    try:
        version, ptr = w._version, w.data_ptr()
    except (RuntimeError, NotImplementedError):  # an inference tensor, a fake tensor
        return False
    hit = _EXACT.get(id(w))
    if hit is not None and hit[0]() is w and hit[2] == version and hit[1].data_ptr() == ptr:
        return hit[3]
    if torch.compiler.is_compiling() or (w.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    with torch.no_grad():
        exact = bool(((w.detach().contiguous().view(torch.int32) & 0x1FFF) == 0).all())

    key = id(w)

    def drop(_, key=key):
        _EXACT.pop(key, None)

    _EXACT[key] = (weakref.ref(w, drop), w.detach(), version, exact)
    return exact


def round_tf32_(w: Tensor) -> Tensor:
    """``w`` (float32) rounded in place to the nearest TF32 values (ties away from zero, W_hi of
    :func:`split_tf32`); other dtypes are left as they are. Returns ``w``."""
    if w.dtype == torch.float32:
        with torch.no_grad():
            bits = w.view(torch.int32)
            bits.copy_((bits + 0x1000) & -8192)
    return w
