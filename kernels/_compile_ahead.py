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
thread per CUDA device. The launch wrapper knows them by a mark in torch's thread-local state, which the autograd
engine carries into its thread with the rest of the caller's. A kernel launched meanwhile from another thread of the
process (or from another thread's backward) runs.

Why not Triton's ``AsyncCompileMode`` alone: it overlaps compiles only for ``warmup`` calls, and a plain launch
waits for its kernel at once. It also leaves the launchers to the first launch.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from ._triton_utils import HAS_TRITON

__all__ = ["compile_ahead", "compile_ahead_supported", "dry_run_active", "precompile"]

_OPEN = [0]  # dry runs open in the process (0 or 1): the launch wrapper's fast path when 0
_LOCK = threading.Lock()
# What the last dry run did (for tests and diagnostics): kernels submitted and compiled, failed compiles, and the
# exception it swallowed.
LAST: dict = {"compiled": 0, "error": None, "submitted": 0, "failed": []}
# The mark of a dry run: a Python object in torch's thread-local state (torch._C._stash_obj_in_tls), which the
# autograd engine copies into the thread that runs the backward of the caller's graph (as torch does with the
# caller's contextvars for its compiler's config). A context variable or a torch function mode would not reach
# that thread: the first stays in the caller's thread, and the second is off while its handler runs, which is when
# ``torch.autograd.grad`` hands the caller's state to the engine.
_KEY = "mlff_distiller_dry_run"
_TLS_FUNCTIONS = ("_stash_obj_in_tls", "_get_obj_in_tls", "_is_key_in_tls", "_remove_obj_from_tls")
_MARK = object()


def _marked() -> bool:
    try:
        return bool(torch._C._is_key_in_tls(_KEY)) and torch._C._get_obj_in_tls(_KEY) is _MARK
    except (AttributeError, RuntimeError):
        return False


def _set_mark(on: bool) -> None:
    if on:
        torch._C._stash_obj_in_tls(_KEY, _MARK)
    else:
        # Erased, not overwritten: an object left in a thread's map is freed when the thread ends, and for the main
        # thread that is after the interpreter is gone (a crash at exit; torch erases its own entries the same way).
        torch._C._remove_obj_from_tls(_KEY)


# Threads of the pool: ptxas, the LLVM passes and the launchers' host compiler run outside the GIL.
MAX_WORKERS = 16


def dry_run_active() -> bool:
    """True inside :func:`compile_ahead` (in the code it runs, the backward included): Triton launches do not run."""
    return _OPEN[0] > 0 and _marked()


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
    return (
        hasattr(_async_compile, "AsyncCompileMode")
        and hasattr(JITFunction, "run")
        and all(hasattr(torch._C, f) for f in _TLS_FUNCTIONS)
    )


@contextlib.contextmanager
def compile_ahead(workers: int | None = None) -> Iterator[bool]:
    """Run the block as a dry run that compiles its Triton kernels in parallel (see the module docstring).

    Yields True when the dry run is on; False (the block then runs normally, launches included) where it is not
    supported, inside another dry run or Triton async-compile block, or while another thread's dry run is open.
    Compile errors are not raised here: the failed kernel is left uncompiled, and the real run compiles it again and
    raises.
    """
    if not compile_ahead_supported() or dry_run_active():
        yield False
        return
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction

    # One dry run at a time in the process: it swaps Triton's launch method for its wrapper while it is open.
    if _async_compile.active_mode.get() is not None or not _LOCK.acquire(blocking=False):
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

    _set_mark(True)
    _OPEN[0] += 1
    opened = True
    JITFunction.run = dry_or_launch
    futures: list = []
    try:
        with mode:
            try:
                yield True
            finally:
                JITFunction.run = launch
                _OPEN[0] -= 1
                _set_mark(False)
                opened = False
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
        if opened:
            _OPEN[0] -= 1
            _set_mark(False)
        pool.shutdown(wait=True)
        _LOCK.release()


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
