"""Compile a step's Triton kernels in parallel before its first real run.

A process with an empty Triton cache compiles each kernel the first time it is launched, one after another: Triton's
frontend, its MLIR and LLVM passes and ptxas, then, at the first launch, a C launcher built by the host compiler.
The first benzene result of a cold process took 15-18 s that way on the H100 host (``results/startup_h100_ab.md``).

:func:`compile_ahead` runs the code inside it as a *dry run*. No Triton kernel launched in it runs. Each one that is not
compiled yet for its arguments is handed to Triton's own ``AsyncCompileMode`` on a thread pool (ptxas and the host
compiler are subprocesses, so the compiles overlap). When the block ends, every compile is waited for and the kernels'
launchers are built on the same pool. The real run that follows finds everything compiled.

Contract for code run under it: a dry run leaves every Triton kernel's output as it was allocated (garbage). Its torch
ops still run, so the code must not index with, or read on the host, anything a Triton kernel wrote. The padded steps
of the engine qualify. Their torch index ops read only the bucket's inputs, and they make no host reads (they are
captured as CUDA graphs). The one Triton-made index array they use, the in-step edge compaction's output, is replaced
with zeros under a dry run (:func:`dry_run_active`).

Only the dry run's own launches are affected, also those of the backward, which the autograd engine runs on its own
thread per CUDA device. The launch wrapper knows them by a context variable (the opening thread) or by a no-op torch
function mode (:class:`_DryRun`), which the autograd engine carries into its threads with the rest of the caller's
thread-local state. A kernel launched meanwhile from another thread of the process runs.

Why not Triton's ``AsyncCompileMode`` alone: it overlaps compiles only for ``warmup`` calls, and a plain launch
waits for its kernel at once. It also leaves the launchers to the first launch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar

import torch

from ._triton_utils import HAS_TRITON

__all__ = ["compile_ahead", "compile_ahead_supported", "dry_run_active", "precompile"]

_DRY: ContextVar[bool] = ContextVar("mlff_distiller_dry_run", default=False)
_OPEN = [0]  # dry runs open in the process: the launch wrapper's fast path when 0
# What the last dry run did (for tests and diagnostics): kernels compiled, and the exception it swallowed.
LAST: dict = {"compiled": 0, "error": None, "submitted": 0, "failed": []}


class _DryRun(torch.overrides.TorchFunctionMode):
    """A torch function mode that changes nothing: it marks the dry run's thread-local state, which the autograd
    engine propagates into the thread that runs the backward."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # The mode is off while its handler runs (a custom op's launches happen in there): the context variable
        # marks them instead, also in the autograd engine's thread.
        token = _DRY.set(True)
        try:
            return func(*args, **(kwargs or {}))
        finally:
            _DRY.reset(token)


def _marked() -> bool:
    try:
        stack = torch.overrides._get_current_function_mode_stack()
    except AttributeError:  # a torch without it: the opening thread's context variable alone
        return False
    return any(isinstance(m, _DryRun) for m in stack)


# Threads of the pool: ptxas, the LLVM passes and the launchers' host compiler run outside the GIL.
MAX_WORKERS = 16


def dry_run_active() -> bool:
    """True inside :func:`compile_ahead` (in the code it runs, the backward included): Triton launches do not run."""
    return _DRY.get() or (_OPEN[0] > 0 and _marked())


def compile_ahead_supported() -> bool:
    """Whether this Triton can compile ahead (``AsyncCompileMode``, Triton >= 3.4; never under the interpreter, whose
    kernels are not compiled). ``MLFF_DISTILLER_COMPILE_AHEAD=0`` switches it off."""
    if not HAS_TRITON or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    if os.environ.get("MLFF_DISTILLER_COMPILE_AHEAD", "1") == "0":
        return False
    try:
        from triton.runtime import _async_compile
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return hasattr(_async_compile, "AsyncCompileMode") and hasattr(JITFunction, "run")


@contextlib.contextmanager
def compile_ahead(workers: int | None = None) -> Iterator[bool]:
    """Run the block as a dry run that compiles its Triton kernels in parallel (see the module docstring).

    Yields True when the dry run is on; False (the block then runs normally, launches included) where it is not
    supported, or inside another dry run or Triton async-compile block. Compile errors are not raised here: the
    failed kernel is left uncompiled, and the real run compiles it again and raises.
    """
    if _DRY.get() or not compile_ahead_supported():
        yield False
        return
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction

    if _async_compile.active_mode.get() is not None:
        yield False
        return
    launch = JITFunction.run
    n = int(workers) if workers is not None else min(MAX_WORKERS, os.cpu_count() or 1)
    pool = ThreadPoolExecutor(max_workers=max(1, n), thread_name_prefix="mlff-compile")
    mode = _async_compile.AsyncCompileMode(pool, ignore_errors=True)

    def dry_or_launch(self, *args, grid, warmup, **kwargs):
        if not dry_run_active():
            return launch(self, *args, grid=grid, warmup=warmup, **kwargs)
        if _async_compile.active_mode.get() is None:  # the autograd engine's thread: Triton's variable is unset
            token = _async_compile.active_mode.set(mode)
            try:
                return launch(self, *args, grid=grid, warmup=True, **kwargs)
            finally:
                _async_compile.active_mode.reset(token)
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    token = _DRY.set(True)
    _OPEN[0] += 1
    JITFunction.run = dry_or_launch
    futures: list = []
    try:
        with mode, _DryRun():
            try:
                yield True
            finally:
                JITFunction.run = launch
                _OPEN[0] -= 1
                _DRY.reset(token)
                token = None
                futures = list(mode.future_kernels.values())
                LAST["submitted"] = len(futures)
                LAST["failed"] = [repr(f.exception())[:300] for f in mode.raw_futures if f.exception() is not None]
        # Leaving ``mode`` waited for every compile. The launchers (a host-compiler build each on Triton 3.6) next.
        compiled = [f.kernel for f in futures if f.kernel is not None]
        LAST["compiled"] = len(compiled)
        list(pool.map(_build_launcher, compiled))
    finally:
        if JITFunction.run is dry_or_launch:
            JITFunction.run = launch
        if token is not None:
            _OPEN[0] -= 1
            _DRY.reset(token)
        pool.shutdown(wait=True)


def _build_launcher(kernel) -> None:
    """Build (and cache on disk) ``kernel``'s launcher; its first launch then loads it. A failure is left to that
    launch, which builds it again and raises."""
    try:
        from triton.runtime.driver import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # the real launch reports it
        pass


def precompile(fn, *args, **kwargs) -> bool:
    """``fn(*args, **kwargs)`` once as a dry run (results discarded); True if it ran as one.

    An exception inside the dry run is swallowed: the real run that follows raises it, with real data. Used by the
    engine before a bucket's first (captured) step, which is the part of a cold start that compiles.
    """
    LAST["compiled"], LAST["error"] = 0, None
    with compile_ahead() as on:
        if not on:
            return False
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # the real run reports it
            LAST["error"] = repr(exc)
            return False
    return True
