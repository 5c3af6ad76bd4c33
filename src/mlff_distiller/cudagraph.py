"""CUDA-graph capture of a whole energy + forces step (forward and the single ``autograd.grad``) per bucket.

A :class:`GraphRunner` owns one bucket's static inputs (a :class:`~mlff_distiller.buckets.PaddedGraph`), one
captured ``torch.cuda.CUDAGraph`` with its own memory pool, and the static outputs the graph writes. Each call
copies the new inputs into the static buffers (outside the graph: the neighbour list changes size) and replays:
one launch for ~all kernels of the forward and backward. Outputs are overwritten by the next replay; callers
copy what they keep.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Callable, Iterator

import torch

from mlff_distiller.buckets import PaddedGraph

__all__ = ["GraphRunner", "capturing", "cuda_graphs_available"]

# Eager runs on a side stream before capture: lazy initialisation (cuBLAS handles, autograd streams, Triton
# JIT, torch.compile) must not happen during capture.
WARMUP_RUNS = 2
# ``torch.cuda.graph``'s capture_error_mode for the step graphs: "global" (torch's default) lets an unsafe CUDA call
# from any thread invalidate the capture; "thread_local" only this thread's (the neighbour-list graphs use it).
CAPTURE_MODE = os.environ.get("MLFF_DISTILLER_CAPTURE_MODE", "global")


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, mode: str = CAPTURE_MODE, **kwargs) -> Iterator[None]:
    """``torch.cuda.graph(graph, capture_error_mode=mode, **kwargs)``, made safe to retry.

    * Python's garbage collector is off while the stream captures. ``torch.cuda.graph`` no longer collects before
      it begins (only with ``torch.compiler.config.force_cudagraph_gc``, torch 2.13), so a collection triggered
      by an allocation inside the capture could finalise unreachable objects of earlier work (another engine's
      graphs, streams, events, page-locked buffers) whose CUDA calls invalidate the capture.
    * On a failed capture the caller's stream is current again: ``torch.cuda.graph.__exit__`` restores it only
      after a successful ``capture_end``.
    * A failure names the Python threads alive at the time: in "global" mode any thread's unsafe call ends the
      capture, and such a thread is the first suspect.
    """
    enabled = gc.isenabled()
    stream = torch.cuda.current_stream() if torch.cuda.is_available() else None  # None: stand-ins in CPU tests
    gc.disable()
    try:
        with torch.cuda.graph(graph, capture_error_mode=mode, **kwargs):
            yield
    except RuntimeError as exc:
        if stream is not None:
            torch.cuda.set_stream(stream)
        names = sorted(t.name for t in threading.enumerate())
        exc.add_note(f"capture mode {mode!r}; Python threads alive: {', '.join(names)}")
        raise
    finally:
        if enabled:
            gc.enable()


def is_capture_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is CUDA refusing or invalidating a stream capture (cudaErrorStreamCapture*: "... during
    capture", "operation not permitted when stream is capturing", ...), not an error of the captured work."""
    return isinstance(exc, RuntimeError) and "captur" in str(exc).lower()


def cuda_graphs_available(device: torch.device | str) -> bool:
    """Whether CUDA graphs can be captured on ``device``."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


class GraphRunner:
    """One captured graph for one bucket.

    Args:
        fn: ``fn(*graph.inputs()) -> tuple[Tensor, ...]``: the step to capture (static shapes, no host sync).
        graph: the bucket's static input buffers (filled with valid content, e.g. all padding).
    """

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], graph: PaddedGraph) -> None:
        device = graph.positions.device
        if not cuda_graphs_available(device):
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.graph_inputs = graph
        self.fn = fn
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn(*graph.inputs())
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        self.cuda_graph = torch.cuda.CUDAGraph()
        # pool=None: a private memory pool for this bucket's graph.
        with capturing(self.cuda_graph):
            self.outputs = fn(*graph.inputs())

    def replay(self) -> tuple[torch.Tensor, ...]:
        """Run the captured step on the current content of the static inputs; returns the static outputs."""
        self.cuda_graph.replay()
        return self.outputs
