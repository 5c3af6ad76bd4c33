"""Which ``tl.dot`` input precision the kernels use for float32 tensors on the GPU.

Strict float32 (the default) runs every dot as "tf32x3": three TF32 MMAs whose result carries float32 accuracy. Two
switches let the engine's reduced precisions trade accuracy for speed:

- ``torch.backends.cuda.matmul.allow_tf32`` (the engine's ``tf32``): one TF32 MMA per dot, as cuBLAS then does;
- :func:`matmul_dtype` (the engine's ``bf16`` and ``fp16``): the atom-wise GEMMs cast their operand tiles to that
  16-bit type in registers and run 16-bit MMAs with float32 accumulation; their inputs, weights, epilogues and
  outputs stay float32 in memory. The message-passing dots run in TF32 then, and on graphs of 1,024 atoms or more
  the message kernels gather 16-bit copies of their per-edge rows (the half gathers, ``_mp_config.py``).

Both are process-wide, like torch's own flag, because the backward runs on autograd's thread. The GEMMs' autograd
Functions decide in their forward and keep that choice for their backward; the message passing reads the switches
at each launch (the engine holds them over the forward and its ``autograd.grad``, captures included).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["dot_mode", "float32_dot", "matmul_dtype", "reduced_matmul_dtype"]

_DOTS = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_STATE: dict[str, torch.dtype | None] = {"matmul": None}


@contextlib.contextmanager
def matmul_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """Within the block the atom-wise Triton GEMMs of float32 CUDA tensors multiply in ``dtype`` (torch.bfloat16
    or torch.float16; None: float32), accumulating in float32."""
    if dtype is not None and dtype not in _DOTS:
        raise ValueError(f"matmul_dtype: {dtype} is not a 16-bit float type (torch.bfloat16 or torch.float16)")
    old = _STATE["matmul"]
    _STATE["matmul"] = dtype
    try:
        yield
    finally:
        _STATE["matmul"] = old


def reduced_matmul_dtype() -> torch.dtype | None:
    """The 16-bit type set by :func:`matmul_dtype`, or None."""
    return _STATE["matmul"]


def dot_mode(ref: torch.Tensor, strict: str = "tf32x3", *, gemm: bool = False) -> str:
    """The ``input_precision`` (or 16-bit mode) of a dot on ``ref``'s device and dtype: :func:`float32_dot` for
    float32 on the GPU; "ieee" for every other device and dtype, except that an atom-wise GEMM (``gemm``) of float32
    takes the 16-bit mode on the CPU interpreter too (which is how the CPU tests run that path)."""
    if ref.dtype != torch.float32:
        return "ieee"
    if not ref.is_cuda:
        low = _STATE["matmul"]
        return _DOTS[low] if gemm and low is not None else "ieee"
    return float32_dot(strict, gemm=gemm)


def float32_dot(strict: str = "tf32x3", *, gemm: bool = False) -> str:
    """A float32 GPU dot configured as ``strict`` under the switches above: "tf32" when TF32 is allowed, the 16-bit
    mode under :func:`matmul_dtype` for an atom-wise GEMM (``gemm``; other dots take "tf32" then), else ``strict``.
    A dot configured "ieee" stays "ieee"."""
    if strict == "ieee":
        return strict
    low = _STATE["matmul"]
    if low is not None:
        return _DOTS[low] if gemm else "tf32"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else strict
