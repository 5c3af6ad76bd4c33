"""The layers' ∂rbf, ∂u of one step summed into a sink (:func:`defer_edge_grads`, :class:`EdgeGradSink`).

Each message-passing layer's backward has two independent halves: the sender kernel (∂x, ∂v), which the next
layer's backward waits for, and the edge kernel (∂rbf, ∂u), which only the geometry's backward at the very end
reads. The sink lets the edge kernels of every layer add into one pair of sums, on a second stream inside a
CUDA-graph capture (so they overlap the rest of the backward) or on the caller's stream, and hands the sums to
autograd once, before the geometry's backward. The kernels' side of it (``_edge_grads_into``) is in
``message_passing.py``.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from ._backend import resolve_backend
from ._mp_config import _CONFIG
from ._triton_utils import HAS_TRITON

__all__ = ["EdgeGradSink", "defer_edge_grads"]

_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream of ``device`` (one per device, made on first use: an eager call before a capture)."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


class EdgeGradSink:
    """∂E/∂rbf and ∂E/∂u of every message-passing layer of one step, summed on a second stream (see
    :func:`defer_edge_grads`): ``rbf [E, R]`` and ``unit [E, 3]`` (written by the first layer's backward to run,
    added to by the others; ``filled`` says whether one has)."""

    def __init__(self, stream, rbf: Tensor, unit: Tensor, lazy: bool = False) -> None:
        self.stream = stream
        # lazy (a sink on the caller's stream): the sums' memory is taken at the first write, in the backward, so
        # that it is not held through the forward as well.
        self._like = (rbf, unit) if lazy else None
        self.rbf = None if lazy else torch.empty_like(rbf)
        self.unit = None if lazy else torch.empty_like(unit)
        self.filled = False
        # Whether a layer's edge kernel forked the stream off the caller's (in this backward): only then is there
        # anything to join. A step whose layers all skip the sink (a one-layer student, whose first layer's radial
        # moments add into it on the caller's stream) must not wait on a stream outside its capture: that wait
        # invalidated the capture (stop 56).
        self.forked = False
        # What the edge kernels read, held until the join (see _edge_grads_into).
        self.keep: list[Tensor] = []
        # The identity node whose backward joins (a weak reference: the node holds the sink), set by
        # defer_edge_grads; ``joins`` asks autograd whether the running backward will execute it.
        self.node = None

    def buffers(self) -> tuple[Tensor, Tensor]:
        """The sums ``(rbf [E, R], unit [E, 3])``, made here the first time for a lazy sink."""
        if self.rbf is None:
            rbf, unit = self._like
            self.rbf, self.unit = torch.empty_like(rbf), torch.empty_like(unit)
        return self.rbf, self.unit

    def joins(self) -> bool:
        """Whether the backward now running will execute the sink's node (and so join its stream). A backward
        over the weights alone does not: the layers then hand ∂rbf, ∂u to autograd as usual. Called from a
        layer's backward only (autograd's engine answers for the graph task it is running)."""
        node = self.node() if self.node is not None else None
        if node is None:
            return False
        try:
            return bool(torch._C._will_engine_execute_node(node))
        except (AttributeError, RuntimeError):  # not inside a backward, or a torch without the query
            return False


class _DeferredEdgeGrads(torch.autograd.Function):
    """Identity on (rbf, unit) whose backward joins the sink's stream and adds the sink's sums to whatever other
    gradient reached rbf and unit: autograd runs it after the backward of every layer that read them."""

    @staticmethod
    def forward(ctx, rbf, unit, sink):
        ctx.sink = sink
        ctx.set_materialize_grads(False)
        return rbf.view_as(rbf), unit.view_as(unit)

    @staticmethod
    def backward(ctx, g_rbf, g_unit):
        sink = ctx.sink
        if not sink.filled:
            return g_rbf, g_unit, None
        sink.filled = False  # a second backward over the same graph starts a new sum
        if sink.stream is not None and sink.forked:  # (None: a sink on one stream, as the CPU tests make)
            torch.cuda.current_stream(sink.rbf.device).wait_stream(sink.stream)
        sink.forked = False
        sink.keep.clear()  # read by now: their memory may go to the caller's stream again
        r = sink.rbf if g_rbf is None else sink.rbf + g_rbf
        u = sink.unit if g_unit is None else sink.unit + g_unit
        if sink._like is not None:  # lazy: handed over, not held (a second backward takes new sums)
            sink.rbf = sink.unit = None
        return r, u, None


def defer_edge_grads(rbf: Tensor, unit: Tensor, one_stream: bool = False) -> tuple[Tensor, Tensor, EdgeGradSink | None]:
    """``(rbf', unit', sink)`` for a step's message-passing layers (pass ``edge_sink=sink`` and rbf', unit' to each
    :func:`message_passing`), or ``(rbf, unit, None)`` where it does not apply.

    Each layer's backward has two independent halves: the sender kernel (∂x, ∂v), which the next layer's backward
    waits for, and the edge kernel (∂rbf, ∂u), which only the geometry's backward at the very end reads. Inside a
    CUDA-graph capture on the Triton path, for graphs of at most ``edge_stream_max_edges`` edges, the edge kernels
    run on a second stream and add into the sink; one join before the geometry's backward hands the sums to
    autograd. So in the captured step they overlap the rest of the backward instead of lying on its path.

    The join is the identity node's backward. A first-derivative backward that runs the layers' backward but not
    that node (``torch.autograd.grad`` of the energy over the weights alone, with positions that require grad)
    would leave the second stream unjoined; each layer's backward asks autograd whether the node will run
    (:meth:`EdgeGradSink.joins`) and, where it will not, hands ∂rbf, ∂u to autograd on its own stream.

    Eager steps keep one stream: the same second stream in an eager 24,000-atom water step (1.3M edges, 1.3 ms per
    layer's edge kernel) measured 1.004x / 0.999x (benchmarks/results/stop45_gpu/probe_ncu_sweep_eager_sink.md).
    There, and in captures over the edge limit, ``one_stream`` (the caller's promise of an inference step: frozen
    filter weights; ``edge_sink_one_stream`` on) gives a sink on the caller's stream (its sums made at the first
    write): each layer's edge kernel adds into it (in its split sum's epilogue, or one add each where it runs
    unsplit) where autograd would add every layer's ∂rbf, ∂u in two more kernels."""
    if not HAS_TRITON or not rbf.is_cuda or torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return rbf, unit, None
    if not (rbf.requires_grad or unit.requires_grad) or resolve_backend(rbf.device) != "triton":
        return rbf, unit, None
    limit = _CONFIG["edge_stream_max_edges"]
    side = limit is not None and rbf.shape[0] <= int(limit)
    if side:
        stream = _side_stream(rbf.device)  # made on an eager call before the capture
        side = torch.cuda.is_current_stream_capturing()
    if side:
        sink = EdgeGradSink(stream, rbf, unit)
    elif one_stream and _CONFIG["edge_sink_one_stream"]:
        sink = EdgeGradSink(None, rbf, unit, lazy=True)
    else:
        return rbf, unit, None
    rbf, unit = _DeferredEdgeGrads.apply(rbf, unit, sink)
    sink.node = weakref.ref(rbf.grad_fn)
    return rbf, unit, sink
