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
    "bound_launch",
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


# Launch knobs for tuning sweeps (benchmarks/bench_kernels.py --tune) and A/B profiling
# (benchmarks/profile_kernels.py); the defaults are the shipped configuration. ``bound_launch``: launch
# through :func:`bound_launch`'s cache instead of ``kernel[grid](...)``.
_TUNING = {"block_scale": 1.0, "num_warps": 4, "bound_launch": True}


@contextlib.contextmanager
def tuning(
    block_scale: float | None = None, num_warps: int | None = None, bound_launch: bool | None = None
) -> Iterator[None]:
    """Temporarily scale the GPU tile budget of every kernel, change its warps per program and/or switch the
    bound launch path (:func:`bound_launch`) off."""
    old = dict(_TUNING)
    if block_scale is not None:
        _TUNING["block_scale"] = float(block_scale)
    if num_warps is not None:
        _TUNING["num_warps"] = int(num_warps)
    if bound_launch is not None:
        _TUNING["bound_launch"] = bool(bound_launch)
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


# -- bound launches ------------------------------------------------------------------------------------------
# ``kernel[grid](*args, **constexprs)`` re-binds every argument, re-derives the specialization and its cache
# key, checks the globals and reads the launch hooks on every call: tens of µs of Python per launch on a slow
# host, the whole cost of a kernel at 1e4-1e5 edges. ``bound_launch`` pays that once per specialization: the
# first call goes through ``kernel[grid]`` (compiling if needed) and keeps the CompiledKernel it returns;
# later calls whose specialization key matches call its launcher directly with the argument list Triton
# passes (every parameter in signature order, constexprs included). The key is at least as fine as Triton's
# own specialization of the runtime arguments (tensor dtype and 16-byte alignment; int == 1, int % 16 == 0
# and its 32/64-bit range), so a bound launch never runs a kernel compiled for other arguments. Anything
# unexpected (a CPU tensor, the interpreter, launch hooks set, a Triton whose CompiledKernel looks different,
# a launcher that rejects the argument list) falls back to ``kernel[grid](...)`` for good.

_BOUND: dict = {}
# Torch's own C getters (what Triton's torch-backed driver calls): a few hundred ns instead of a few µs.
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_BOUND_STATE = {
    "ok": HAS_TRITON and _get_device is not None and _get_stream is not None,
    "reason": "" if HAS_TRITON else "triton is not installed",
}
if HAS_TRITON and not _BOUND_STATE["ok"]:
    _BOUND_STATE["reason"] = "this torch lacks torch._C._cuda_getDevice / _cuda_getCurrentRawStream"
_INT32 = 1 << 31


def _runtime_knobs():
    knobs = getattr(triton, "knobs", None)
    return getattr(knobs, "runtime", None)


def _arg_spec(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool) or not isinstance(a, int):
        raise TypeError(f"bound_launch handles tensor and int arguments, got {type(a).__name__}")
    return a == 1, a % 16 == 0, -_INT32 <= a < _INT32


def _disable_bound(reason: str) -> None:
    _BOUND_STATE["ok"] = False
    _BOUND_STATE["reason"] = reason
    _BOUND.clear()


def bound_launch_status() -> tuple[bool, str]:
    """(whether bound launches are in use, why not): for tests and profiling."""
    return _BOUND_STATE["ok"] and _TUNING["bound_launch"], _BOUND_STATE["reason"]


def bound_launch(kernel, grid: int, args: tuple, consts: dict, consts_key, warps: int) -> None:
    """``kernel[(grid,)](*args, num_warps=warps, **consts)``, bound once per specialization (see above).

    ``args`` are the runtime arguments (tensors and ints) in signature order, all before the constexprs;
    ``consts`` maps every remaining parameter name to its value and ``consts_key`` is a hashable stand-in for
    it (the caller caches both). CUDA only; elsewhere this is the plain launch.
    """
    ref = args[0]
    if not (_BOUND_STATE["ok"] and _TUNING["bound_launch"] and ref.is_cuda):
        kernel[(grid,)](*args, num_warps=warps, **consts)
        return
    rt = _runtime_knobs()
    if rt is None or rt.launch_enter_hook is not None or rt.launch_exit_hook is not None:
        # Profiler hooks want the full launch path (and Tritons without ``knobs`` predate this layout).
        kernel[(grid,)](*args, num_warps=warps, **consts)
        return
    device = _get_device()
    key = (kernel, consts_key, warps, device, tuple(_arg_spec(a) for a in args))
    entry = _BOUND.get(key)
    if entry is None:
        compiled = kernel[(grid,)](*args, num_warps=warps, **consts)
        try:
            names = list(kernel.arg_names)
            const_vals = tuple(consts[n] for n in names[len(args) :])
            if len(names) != len(args) + len(consts):
                raise KeyError("constexprs do not match the kernel's parameters")
            run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
        except (AttributeError, KeyError, TypeError) as exc:
            _disable_bound(f"cannot bind {getattr(kernel, '__name__', kernel)}: {exc!r}")
            return
        _BOUND[key] = (run, function, packed, const_vals)
        return
    run, function, packed, const_vals = entry
    stream = _get_stream(device)
    try:
        run(grid, 1, 1, stream, function, packed, None, None, None, *args, *const_vals)
    except TypeError as exc:  # a launcher with another calling convention: it parses its arguments first
        _disable_bound(f"launcher rejected the bound arguments: {exc}")
        kernel[(grid,)](*args, num_warps=warps, **consts)
