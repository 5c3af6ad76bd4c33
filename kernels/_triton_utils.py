"""Shared plumbing for the Triton kernels: a guarded import, launch checks and block-size choices.

Importing this module never fails: without Triton, ``HAS_TRITON`` is False, ``triton``/``tl`` are None and the
kernel files skip their ``@triton.jit`` definitions, so the torch references keep working.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path must not depend on Triton
    triton = None
    tl = None

__all__ = [
    "HAS_TRITON",
    "LIB",
    "FirstOrderOnly",
    "check_launchable",
    "edge_block",
    "num_warps",
    "tl",
    "triton",
    "tuning",
    "widest_chunk",
]

HAS_TRITON = triton is not None
# Namespace of every custom op of the package: torch.ops.mlff_distiller.<name>.
LIB = "mlff_distiller"


def widest_chunk(n_cols: int) -> int:
    """Widest power-of-two chunk the kernels split ``n_cols`` into (20 -> 16 + 4), capped at 128."""
    return min(128, 1 << (max(1, int(n_cols)).bit_length() - 1))


def check_launchable(kernel, tensor: torch.Tensor) -> None:
    """Fail clearly when a kernel cannot run on ``tensor``'s device.

    ``triton.jit`` picks compiled vs interpreted code when the kernel is *defined*, from ``TRITON_INTERPRET``;
    a CPU tensor therefore needs the variable set before ``mlff_distiller.kernels`` is first imported.
    """
    if tensor.device.type == "cuda":
        return
    from triton.runtime.interpreter import InterpretedFunction

    if tensor.device.type != "cpu" or not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            f"Triton kernel {getattr(kernel, '__name__', kernel)} cannot run on a "
            f"{tensor.device.type} tensor: CPU tensors need the Triton interpreter, i.e. "
            "TRITON_INTERPRET=1 set before mlff_distiller.kernels "
            "is imported"
        )


# Launch knobs for tuning sweeps (benchmarks/bench_kernels.py --tune); the defaults are the shipped
# configuration.
_TUNING = {"block_scale": 1.0, "num_warps": 4}


@contextlib.contextmanager
def tuning(block_scale: float | None = None, num_warps: int | None = None) -> Iterator[None]:
    """Temporarily scale the GPU tile budget of every kernel and/or change its warps per program."""
    old = dict(_TUNING)
    if block_scale is not None:
        _TUNING["block_scale"] = float(block_scale)
    if num_warps is not None:
        _TUNING["num_warps"] = int(num_warps)
    try:
        yield
    finally:
        _TUNING.update(old)


def num_warps() -> int:
    return _TUNING["num_warps"]


def edge_block(device: torch.device, n_cols: int, elems: int) -> int:
    """Edges per program (a power of two) for a ``[BLOCK_E, n_cols]`` tile of about ``elems`` elements.

    On the GPU ``elems`` bounds the registers per thread; under the interpreter (CPU) each program costs
    Python overhead, so fewer, larger programs are much faster.
    """
    if device.type == "cuda":
        elems = int(elems * _TUNING["block_scale"])
    else:
        elems = max(elems, 131072)
    rows = max(16, min(4096, elems // max(1, n_cols)))
    return 1 << (rows.bit_length() - 1)


class FirstOrderOnly(torch.autograd.Function):
    """Guard of the inference-only fused ops (frozen weights, first derivative only) under ``create_graph=True``:
    ``FirstOrderOnly.apply(what, n, *grads_then_depends_on)`` passes the first ``n`` tensors through (one tensor
    for n = 1, else a tuple) and raises, naming ``what``, if they are differentiated. Not @once_differentiable: its
    error node hangs on detached copies of the outputs, which ``torch.autograd.grad(..., inputs=positions)`` never
    visits, so a second derivative would silently lose the op's terms; this guard hangs on everything passed in
    (the op's inputs and its upstream gradients)."""

    @staticmethod
    def forward(ctx, what: str, n: int, *tensors):
        ctx.what = what
        out = tuple(t.view_as(t) for t in tensors[:n])
        return out[0] if n == 1 else out

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            f"{ctx.what} (inference path: frozen weights, Triton backend) is differentiable once only; for second "
            "derivatives let a parameter require grad or use MLFF_DISTILLER_KERNELS=torch"
        )
