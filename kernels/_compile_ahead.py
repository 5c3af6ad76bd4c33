"""Compile a step's Triton kernels in parallel before its first real run.

A process with an empty Triton cache compiles each kernel the first time it is launched, one after another: Triton's
frontend, its MLIR and LLVM passes and ptxas, then, at the first launch, a C launcher built by the host compiler.
The first benzene result of a cold process took 15-18 s that way on the H100 host (``results/startup_h100_ab.md``).

:func:`compile_ahead` runs the code inside it as a *dry run*. No Triton kernel launched in it runs. Each one that is not
compiled yet for its arguments is handed to Triton's own ``AsyncCompileMode`` on a thread pool, and each worker
builds its kernel's launcher right after the compile (ptxas and the host compiler are subprocesses, so those parts
overlap; Triton's Python frontend shares the GIL). When the block ends, every compile is waited for. The real run that
follows finds everything compiled. Measured on the H100: the first benzene result of a cold process 16.0 -> 4.1 s
(``benchmarks/results/probe_compile_ahead_h100_run2/``). The engine runs it before a bucket's capture, over the
buckets of ``engine.warmup``, before its first eager step of each kind, and the training step before a capacity's
first step (loss and backward only).

Contract for code run under it: a dry run leaves every Triton kernel's output as it was allocated (garbage). Its torch
ops still run, so the code must not index with, or read on the host, anything a Triton kernel wrote. The padded steps
of the engine qualify. Their torch index ops read only the bucket's inputs, and they make no host reads (they are
captured as CUDA graphs). The one Triton-made index array they use, the in-step edge compaction's output, is replaced
with zeros under a dry run (:func:`dry_run_active`).

Only the dry run's own launches are affected, also those of the backward, which the autograd engine runs on its own
thread per CUDA device. The mark is the dry run's own CUDA stream: the block runs on it, the autograd engine runs
each backward op on its forward op's stream, and nothing else in the process launches there. A kernel launched
meanwhile from another thread (or another thread's backward) runs.

Why not Triton's ``AsyncCompileMode`` alone: it overlaps compiles only for ``warmup`` calls, and a plain launch
waits for its kernel at once. It also leaves the launchers to the first launch. ``MLFF_DISTILLER_COMPILE_AHEAD=0``
switches the dry runs off.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from ._triton_utils import HAS_TRITON

__all__ = ["compile_ahead", "compile_ahead_supported", "dry_run_active", "dry_run_for_capture", "precompile"]

_LOCK = threading.Lock()  # one dry run at a time in the process
# What the last dry run did (for tests and diagnostics): kernels submitted and compiled, failed compiles, and the
# exception it swallowed.
LAST: dict = {"compiled": 0, "error": None, "submitted": 0, "failed": [], "seconds": {}}
TOTAL: dict = {"dry_runs": 0, "compiled": 0}  # over the process
# The mark of a dry run: its own CUDA stream (the raw handle, as Triton's launch reads the current stream). The
# autograd engine runs each backward op on the stream of its forward op, also in the thread it runs the backward on,
# so the dry run's backward launches carry the mark too. Nothing else of the process launches on that stream. (A
# context variable stays in the caller's thread; a torch function mode is off while its handler runs, which is when
# ``torch.autograd.grad`` hands the caller's thread-local state to the engine; torch 2.11 cannot erase a
# thread-local Python object, and one left behind crashes the process at exit.)
_STREAM: list = [None]  # (device index, raw stream handle) while a dry run is open
_FOR_CAPTURE = [False]  # the open dry run's pass stands in for a CUDA-graph capture (precompile's for_capture)


def _marked() -> bool:
    open_ = _STREAM[0]
    if open_ is None:
        return False
    index, handle = open_
    return torch.cuda.current_stream(index).cuda_stream == handle


# A dry run that left more than this cached (for its stream only) gives the cache back.
RELEASE_BYTES = 64 << 20
# Threads of the pool: ptxas and the launchers' host compiler are subprocesses, so their work overlaps.
MAX_WORKERS = 16


def dry_run_active() -> bool:
    """True inside :func:`compile_ahead` (in the code it runs, the backward included): Triton launches do not run."""
    return _marked()


def dry_run_for_capture() -> bool:
    """True in the pass of a dry run that stands in for a CUDA-graph capture (:func:`precompile` with
    ``for_capture``). Code that launches other kernels inside a capture than outside one (the GEMM's
    tensor-descriptor kernel, ``linear.tma_launches``) takes the capture's kernels there."""
    return _FOR_CAPTURE[0] and _marked()


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
    return hasattr(_async_compile, "AsyncCompileMode") and hasattr(JITFunction, "run") and torch.cuda.is_available()


@contextlib.contextmanager
def compile_ahead(device: torch.device | str | int | None = None, workers: int | None = None) -> Iterator[bool]:
    """Run the block as a dry run that compiles its Triton kernels in parallel (see the module docstring).

    The block runs on a new stream of ``device`` (a CUDA device; default the current one), after the work already
    queued on the current stream; the current stream waits for it afterwards.

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
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        _LOCK.release()
        yield False
        return
    launch, do_compile = JITFunction.run, JITFunction._do_compile
    n = int(workers) if workers is not None else min(MAX_WORKERS, os.cpu_count() or 1)
    pool = _CompileThenLaunch(max_workers=max(1, n), thread_name_prefix="mlff-compile")
    try:
        mode = _async_compile.AsyncCompileMode(pool, ignore_errors=True)
    except Exception:  # a Triton whose async mode takes other arguments: no dry run (compiles at first launch)
        pool.shutdown(wait=False)
        _LOCK.release()
        yield False
        return
    pending: list = []  # (kernel cache, key, FutureKernel) put in place by do_compile_once

    def do_compile_once(self, key, *args, **kwargs):
        # Triton 3.6 leaves a kernel whose compile is in flight out of its cache, so each later launch of it asks
        # again (ASTSource, source hash; 57 requests for 23 compiles in a benzene step, with the GIL shared with
        # the pool): the pending compile goes into the cache instead (Triton 3.9 does the same itself).
        kernel = do_compile(self, key, *args, **kwargs)
        if kernel is not None and dry_run_active():
            from triton.runtime.driver import driver

            cache = self.device_caches[driver.active.get_current_device()][0]
            if key not in cache:
                cache[key] = kernel
                pending.append((cache, key, kernel))
        return kernel

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

    caller = torch.cuda.current_stream(dev)
    reserved = torch.cuda.memory_reserved(dev)
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(caller)
    _STREAM[0] = (dev.index if dev.index is not None else torch.cuda.current_device(), stream.cuda_stream)
    JITFunction.run, JITFunction._do_compile = dry_or_launch, do_compile_once
    futures: list = []
    t0 = time.perf_counter()
    try:
        with mode, torch.cuda.stream(stream):
            try:
                yield True
            finally:
                JITFunction.run, JITFunction._do_compile = launch, do_compile
                _STREAM[0] = None
                t1 = time.perf_counter()
                # Triton's bookkeeping read defensively: a renamed attribute costs the diagnostics, not the run.
                futures = list(getattr(mode, "future_kernels", {}).values())
                LAST["submitted"] = len(futures)
                errors = [f.exception() for f in getattr(mode, "raw_futures", [])]
                LAST["failed"] = [repr(e)[:300] for e in errors if e is not None]
        # Leaving ``mode`` waited for every compile, each followed by its launcher's build in the same worker.
        t2 = time.perf_counter()
        compiled = [k for k in (getattr(f, "kernel", None) for f in futures) if k is not None]
        LAST["compiled"] = len(compiled)
        TOTAL["dry_runs"] += 1
        TOTAL["compiled"] += len(compiled)
        # Where the time went: the block itself, then the wait for the compiles and launchers still running.
        LAST["seconds"] = {"block": t1 - t0, "compiles": t2 - t1}
    finally:
        if JITFunction.run is dry_or_launch:
            JITFunction.run = launch
        if JITFunction._do_compile is do_compile_once:
            JITFunction._do_compile = do_compile
        for cache, key, kernel in pending:  # a failed compile: the real run compiles it again, and raises
            if cache.get(key) is kernel and getattr(kernel, "kernel", None) is None:
                del cache[key]
        _STREAM[0] = None
        caller.wait_stream(stream)
        pool.shutdown(wait=True)
        _LOCK.release()
    # The dry run's memory is cached for its own stream, where nothing else allocates: give back a large amount.
    if torch.cuda.memory_reserved(dev) - reserved > RELEASE_BYTES:
        stream.synchronize()
        torch.cuda.empty_cache()


class _CompileThenLaunch(ThreadPoolExecutor):
    """A pool whose tasks (Triton's compiles) build their kernel's launcher as soon as the kernel is compiled, in the
    same worker, instead of after every compile has finished."""

    def submit(self, fn, /, *args, **kwargs):
        def compile_then_launcher():
            kernel = fn(*args, **kwargs)
            _build_launcher(kernel)
            return kernel

        return super().submit(compile_then_launcher)


def _build_launcher(kernel) -> None:
    """Build (and cache on disk) ``kernel``'s launcher; its first launch then loads it. A failure is left to that
    launch, which builds it again and raises."""
    try:
        from triton.runtime.driver import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # the real launch reports it
        pass


def precompile(fn, *args, device: torch.device | str | None = None, for_capture: bool = False, **kwargs) -> bool:
    """``fn(*args, **kwargs)`` once as a dry run (results discarded); True if it ran as one.

    ``device``: the CUDA device it runs on (default: that of the first CUDA tensor among ``args``; none: no dry run).
    ``for_capture``: a CUDA-graph capture follows, whose warm-up runs ``fn`` eagerly before the capture launches it
    again; the two launch different kernels (below 65,536 rows the GEMM takes its tensor-descriptor kernel inside
    captures only, ``linear.tma_launches``). The dry run then makes both passes, the second one as the capture
    (:func:`dry_run_for_capture`), and their compiles overlap. (Stop 74 found a cold ``warmup`` compiling the
    descriptor kernels one by one in its captures; a single pass as the capture left the pointer kernels to the
    eager warm-up instead.)
    An exception inside the dry run (or from the dry run's own machinery) is swallowed: the real run that follows
    raises it, with real data. Used by the engine before a bucket's first (captured) step, over the buckets of its
    warm-up and before its first eager step, and by the training step: the parts of a cold start that compile.
    """
    LAST["compiled"], LAST["error"], LAST["seconds"] = 0, None, {}
    if device is None:
        cuda = [a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda]
        device = cuda[0] if cuda else None
    if device is None or torch.device(device).type != "cuda":
        return False
    try:
        with compile_ahead(device) as on:
            if not on:
                return False
            fn(*args, **kwargs)
            if for_capture:
                _FOR_CAPTURE[0] = True
                try:
                    fn(*args, **kwargs)
                finally:
                    _FOR_CAPTURE[0] = False
    except Exception as exc:  # the real run reports what it raises; a dry run must never end the caller's run
        LAST["error"] = repr(exc)
        return False
    return True
