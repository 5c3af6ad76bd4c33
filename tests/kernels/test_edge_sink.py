"""The layers' ∂rbf, ∂u summed on a second stream (``kernels.defer_edge_grads``, ``EdgeGradSink``): which backward
passes use it; a backward over the weights alone, which never joins it, must not feed it."""

from __future__ import annotations

import importlib
import sys
import weakref
from pathlib import Path

import pytest
import torch
from helpers import edge_sink_spy, make_model

mp = importlib.import_module("mlff_distiller.kernels.message_passing")

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not mp.HAS_TRITON, reason="needs CUDA and Triton")


_ANSWERS: list[bool] = []


class _Probe(torch.autograd.Function):
    """y = Σ rbf · w; its backward records what ``sink.joins()`` answers there (as a layer's backward asks)."""

    @staticmethod
    def forward(ctx, rbf, w, sink):
        ctx.save_for_backward(rbf, w)
        ctx.sink = sink
        return (rbf * w).sum()

    @staticmethod
    def backward(ctx, g):
        _ANSWERS.append(ctx.sink.joins())
        rbf, w = ctx.saved_tensors
        return g * w, g * rbf, None


def _sink_graph():
    """positions -> rbf -> identity node (the sink's) -> probe(·, w): the model's graph, in miniature, on the CPU."""
    pos = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    rbf = pos.sin()
    unit = pos.cos()
    sink = mp.EdgeGradSink(None, rbf, unit)
    rbf2, unit2 = mp._DeferredEdgeGrads.apply(rbf, unit, sink)
    sink.node = weakref.ref(rbf2.grad_fn)
    y = _Probe.apply(rbf2, w, sink) + unit2.sum()
    return pos, w, sink, y


def test_sink_joins_only_backwards_that_reach_its_node():
    """``EdgeGradSink.joins`` (asked in each layer's backward): yes for the gradient over the positions, over
    positions and weights, and for ``backward()``; no for the gradient over the weights alone (that backward
    never runs the identity node, so a layer that fed the sink there would leave its stream unjoined); no outside
    a backward. The gradients are the plain ones in every case (the sink here is never filled)."""
    _ANSWERS.clear()
    pos, w, sink, y = _sink_graph()
    (g_pos,) = torch.autograd.grad(y, [pos], retain_graph=True)
    (g_w,) = torch.autograd.grad(y, [w], retain_graph=True)
    torch.autograd.grad(y, [pos, w], retain_graph=True)
    y.backward()
    assert _ANSWERS == [True, False, True, True]
    assert torch.allclose(g_pos, w * pos.cos() - pos.sin()) and torch.allclose(g_w, pos.sin())
    assert torch.allclose(pos.grad, g_pos) and torch.allclose(w.grad, g_w)
    assert not sink.joins()  # outside a backward
    del y
    assert sink.node() is None and not sink.joins()  # the graph freed: no node, no join


def test_no_sink_outside_a_capture():
    rbf = torch.randn(4, 3, requires_grad=True)
    unit = torch.randn(4, 3)
    r, u, sink = mp.defer_edge_grads(rbf, unit)
    assert sink is None and r is rbf and u is unit


# -- GPU ----------------------------------------------------------------------------------------------------------


def _water(hidden: int):
    """A random water student of width ``hidden`` (the shipped architecture otherwise) and a 192-atom box."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from systems import water_box

    from mlff_distiller import AtomsBatch

    model = make_model(seed=3, species=[1, 8], hidden=hidden, layers=3, n_rbf=20, cutoff=5.0).cuda()
    batch = AtomsBatch.from_atoms([water_box(192, seed=0)], dtype=torch.float32).to("cuda")
    return model, batch


def _graph(model, batch):
    from mlff_distiller.neighbors import neighbor_list

    nl = neighbor_list(batch.positions, batch.cell, batch.pbc, batch.batch, batch.ptr, model.cutoff)
    return nl.edge_index, nl.shift_vectors


def _captured(fn):
    """``fn`` captured in a CUDA graph (after a warm-up on the capture's side stream): ``(graph, outputs)``."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph, stream=stream):
            static = fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, static


@gpu
@needs_cuda
def test_a_backward_over_the_weights_alone_leaves_the_sink_out(monkeypatch):
    """Inside a CUDA-graph capture, the energy's gradient over the weights alone with positions that require
    grad: that backward never runs the sink's node, so the layers hand ∂rbf, ∂u to autograd themselves (a layer
    that fed the sink there left its stream unjoined and the capture failed); the capture completes and replays
    to the eager gradients. The gradient over the positions, captured the same way, still uses the sink in every
    layer and replays to the eager forces."""
    calls = edge_sink_spy(monkeypatch)
    model, batch = _water(hidden=64)
    params = list(model.parameters())
    edge_index, shifts = _graph(model, batch)
    pos = batch.positions.clone().requires_grad_(True)

    def grads(wrt):
        out = model(batch.numbers, pos, edge_index, shifts, batch.batch, batch.num_structures)
        return torch.autograd.grad(out["energy"].sum(), wrt)

    ref = [t.clone() for t in grads(params)]
    graph, static = _captured(lambda: grads(params))
    graph.replay()
    torch.cuda.synchronize()
    assert calls == []
    for a, b in zip(static, ref, strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max().clamp_min(1e-3)

    (ref_f,) = grads([pos])
    graph, (static_f,) = _captured(lambda: grads([pos]))
    graph.replay()
    torch.cuda.synchronize()
    assert len(calls) == len(model.interactions) and all(calls), calls
    assert (static_f - ref_f).abs().max() <= 1e-5 * ref_f.abs().max()


@gpu
@needs_cuda
def test_a_one_layer_student_captures_with_the_moments_alone():
    """A one-layer student on a water box: its only layer runs from the radial moments, whose backward adds ∂rbf,
    ∂u into the sink on the caller's stream, and no message layer forks the sink's stream. Waiting on that stream
    (outside the capture) invalidated the capture, so the step fell back to eager (stop 56); now the join waits
    only on a stream a layer forked. The capture completes and replays to the eager forces."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from systems import water_box

    from mlff_distiller import AtomsBatch

    model = make_model(seed=3, species=[1, 8], hidden=64, layers=1, n_rbf=20, cutoff=5.0).cuda().requires_grad_(False)
    batch = AtomsBatch.from_atoms([water_box(192, seed=0)], dtype=torch.float32).to("cuda")
    edge_index, shifts = _graph(model, batch)
    assert model.first_layer_moment_weights(batch.positions.shape[0], edge_index.shape[1]) is not None
    pos = batch.positions.clone().requires_grad_(True)

    def forces():
        out = model(batch.numbers, pos, edge_index, shifts, batch.batch, batch.num_structures)
        return torch.autograd.grad(out["energy"].sum(), [pos])

    (ref,) = forces()
    graph, (static,) = _captured(forces)
    graph.replay()
    torch.cuda.synchronize()
    assert (static - ref).abs().max() <= 1e-5 * ref.abs().max()
