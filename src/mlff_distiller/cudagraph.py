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

__all__ = ["GraphRunner", "HostBuffer", "capturing", "copy_bits", "cuda_graphs_available"]

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


class _ArrayInterface:
    """``__cuda_array_interface__`` over the bytes of a page-locked CPU tensor (see :class:`HostBuffer`)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape),
            "typestr": t.numpy().dtype.str,
            "data": (t.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


class HostBuffer:
    """A host buffer that a captured step reads or writes in place, with no copy of its own in the step.

    On CUDA ``host`` is page-locked and ``view`` is a CUDA tensor over the same bytes: under unified addressing
    (every 64-bit CUDA process) a page-locked host address is also a device address, so a kernel reads and writes
    that memory across the bus (zero-copy). An MD step of a small molecule moves a few hundred bytes each way, and
    as DMA copies (a host call and a copy-engine transfer each, in the graph or not) they cost more than an
    elementwise kernel reading or writing them in place: the benzene step's device path took 162.3 µs with the
    copies, 152.4 with the two kernels (results/stop66_gpu/b/). After the step, a stream synchronisation makes the
    device's writes visible to the host. ``check()`` runs once per engine before the first such step, and a
    device that cannot address the buffer (no unified addressing) keeps the copies. On the CPU, ``view`` is
    ``host`` itself (the same code path, for tests)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=cuda)
        self.array = self.host.numpy()
        self.view = torch.as_tensor(_ArrayInterface(self.host), device=device) if cuda else self.host
        if self.view.data_ptr() != self.host.data_ptr():
            raise RuntimeError("the device view of a page-locked buffer has another address")


def copy_bits(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst.copy_(src)`` bit for bit as an elementwise kernel: a same-dtype ``copy_`` of contiguous CUDA tensors is
    a DMA copy (cudaMemcpyAsync), which is what a :class:`HostBuffer` view is there to avoid. Entries of 4 or 8
    bytes move as int32 words (every bit kept: NaN payloads too, and the packed output's float64 energies held
    as pairs of float32 words)."""
    if src.dtype.itemsize % 4 or src.dtype != dst.dtype:
        dst.copy_(src)
        return
    torch.add(src.view(torch.int32), 0, out=dst.view(torch.int32))


# synchronize_current_stream: Stream objects by what torch._C._cuda_getCurrentStream returns (at most STREAMS_KEPT).
_STREAMS: dict[tuple, torch.cuda.Stream] = {}
STREAMS_KEPT = 64


def current_stream_cached(device: torch.device) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)`` for less host time (see :func:`synchronize_current_stream`): the
    current stream read through ``torch._C._cuda_getCurrentStream``, its ``Stream`` object made once per stream."""
    get = getattr(torch._C, "_cuda_getCurrentStream", None)
    if get is None or device.index is None:
        return torch.cuda.current_stream(device)
    data = get(device.index)
    key = data if isinstance(data, tuple) else tuple(data)
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) >= STREAMS_KEPT:
            _STREAMS.clear()
        stream = _STREAMS[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return stream


def synchronize_current_stream(device: torch.device) -> None:
    """``torch.cuda.current_stream(device).synchronize()`` for less host time: the current stream read as
    ``current_stream`` reads it (``torch._C._cuda_getCurrentStream`` of the device index), without its
    initialisation check and device parsing, and its ``Stream`` object made once per stream instead of on every
    call. ``current_stream`` took ~7 µs of a ~120 µs benzene MD step on the H200 host (results/stop78_gpu/c/), for
    the step's one wait. ``device``: a CUDA device with its index (the engine's); anything else, or a torch without
    that binding, goes through ``current_stream``."""
    current_stream_cached(device).synchronize()


def host_views_work(device: torch.device) -> bool:
    """Whether a kernel on ``device`` reads and writes a :class:`HostBuffer`'s bytes through its view: a known
    pattern through a round trip (host → device → host), once per engine before its first zero-copy step."""
    try:
        buf = HostBuffer((64,), torch.float32, device)
        want = torch.arange(64, dtype=torch.float32) * 0.5 - 7.25
        buf.host.copy_(want)
        on_device = torch.empty(64, dtype=torch.float32, device=device)
        copy_bits(buf.view, on_device)  # read across the bus
        read = bool(torch.equal(on_device.cpu(), want))  # (a synchronising copy)
        copy_bits(on_device * 2.0, buf.view)  # written across the bus
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return read and bool(torch.equal(buf.host, want * 2.0))
    except (RuntimeError, TypeError, ValueError):
        return False
