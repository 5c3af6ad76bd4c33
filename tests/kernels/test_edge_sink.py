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
from mlff_distiller.kernels import use_backend

mp = importlib.import_module("mlff_distiller.kernels.message_passing")
edge_sink = importlib.import_module("mlff_distiller.kernels.edge_sink")

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
    sink = edge_sink.EdgeGradSink(None, rbf, unit)
    rbf2, unit2 = edge_sink._DeferredEdgeGrads.apply(rbf, unit, sink)
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
    r, u, sink = edge_sink.defer_edge_grads(rbf, unit)
    assert sink is None and r is rbf and u is unit


def _layer_inputs(n, e, f, r, seed):
    """x, v, filter weight of one message layer and a receiver-sorted random graph's rbf, unit, edge_index (float64)."""
    gen = torch.Generator().manual_seed(seed)
    x, v = (
        torch.randn(n, 3 * f, generator=gen, dtype=torch.float64),
        torch.randn(n, 3, f, generator=gen, dtype=torch.float64),
    )
    w = torch.randn(3 * f, r, generator=gen, dtype=torch.float64) / r**0.5
    rbf = torch.randn(e, r, generator=gen, dtype=torch.float64)
    unit = torch.nn.functional.normalize(torch.randn(e, 3, generator=gen, dtype=torch.float64), dim=-1)
    ei = torch.randint(0, n, (2, e), generator=gen)
    return x, v, w, rbf, unit, ei[:, torch.argsort(ei[0], stable=True)]


@pytest.mark.parametrize("split", [1, 2])
def test_layers_add_into_a_sink_on_one_stream(triton_device, split, monkeypatch):
    """A sink on the caller's stream (``defer_edge_grads(..., one_stream=True)``'s, lazy: no memory until the
    backward) takes each layer's ∂rbf, ∂u (the first layer to run writes them, the next adds them, in the split's
    sum kernel where there is one) and hands the sum to autograd at its node, then lets it go: the gradients wrt
    rbf, unit, x and v equal the plain path's (autograd's adds), float64, unsplit and split in two."""
    if triton_device.type == "cpu":
        monkeypatch.setitem(mp._CPU_TILES, "block_f", 16)  # two feature chunks of F = 32: a split of 2 can run
    calls = edge_sink_spy(monkeypatch)
    x1, v1, w1, rbf, unit, ei = _layer_inputs(12, 70, 32, 8, seed=5)
    x2, v2, w2, _, _, _ = _layer_inputs(12, 70, 32, 8, seed=6)
    leaves = [t.to(triton_device).requires_grad_(True) for t in (rbf, unit, x1, v1, x2, v2)]
    w1, w2, ei = w1.to(triton_device), w2.to(triton_device), ei.to(triton_device)
    gen = torch.Generator().manual_seed(7)
    up = [torch.randn(12, k, generator=gen, dtype=torch.float64).to(triton_device) for k in (32, 96, 32, 96)]

    def grads(with_sink):
        rbf_, unit_, x1_, v1_, x2_, v2_ = leaves
        sink = None
        if with_sink:
            sink = edge_sink.EdgeGradSink(None, rbf_, unit_, lazy=True)
            assert sink.rbf is None  # nothing held through the forward
            rbf_, unit_ = edge_sink._DeferredEdgeGrads.apply(rbf_, unit_, sink)
            sink.node = weakref.ref(rbf_.grad_fn)
        with use_backend("triton"), mp._configured(bwd_edge_split=split):
            ds1, dv1 = mp.message_passing(x1_, v1_, rbf_, w1, unit_, ei, edge_sink=sink)
            ds2, dv2 = mp.message_passing(x2_, v2_, rbf_, w2, unit_, ei, edge_sink=sink)
            loss = sum((o.reshape(12, -1) * u).sum() for o, u in zip((ds1, dv1, ds2, dv2), up, strict=True))
            out = torch.autograd.grad(loss, leaves)
        if sink is not None:
            assert sink.rbf is None and not sink.filled  # handed over, not held
        return out

    plain = grads(False)
    assert calls == []
    with_sink = grads(True)
    assert calls == [False, False]  # both layers' backward fed the sink
    for name, a, b in zip(("rbf", "unit", "x1", "v1", "x2", "v2"), with_sink, plain, strict=True):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max(), name


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


@gpu
@needs_cuda
def test_eager_inference_sums_the_edge_gradients_into_a_sink_on_one_stream(monkeypatch):
    """Outside a capture an inference step (frozen weights) sums every layer's ∂rbf, ∂u into a sink on its own
    stream (``edge_sink_one_stream``): the eager engine's energies and forces equal those with the switch off
    (autograd's adds), each message layer's backward fed the sink; a model whose weights require grad (training,
    whose second derivative autograd takes through the plain path) gets no sink and still differentiates twice."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from systems import water_box

    from mlff_distiller import AtomsBatch, ForceEngine

    calls = edge_sink_spy(monkeypatch)
    model = make_model(seed=3, species=[1, 8], hidden=128, layers=3, n_rbf=20, cutoff=5.0)
    box = AtomsBatch.from_atoms([water_box(192, seed=0)])
    out = {}
    for on in (True, False):
        with mp._configured(edge_sink_one_stream=on):
            before = len(calls)
            out[on] = ForceEngine(model, device="cuda", precision="fp32", mode="eager").compute(box)
            used = calls[before:]
        assert (len(used) > 0 and not any(used)) if on else used == [], used
    for key in ("energy", "forces"):
        ref = out[False][key]
        assert (out[True][key] - ref).abs().max() <= 1e-5 * ref.abs().max().clamp_min(1e-3), key

    train = make_model(seed=3, species=[1, 8], hidden=32, layers=2, n_rbf=20, cutoff=5.0).cuda()
    batch = AtomsBatch.from_atoms([water_box(192, seed=0)], dtype=torch.float32).to("cuda")
    edge_index, shifts = _graph(train, batch)
    pos = batch.positions.clone().requires_grad_(True)
    before = len(calls)
    energy = train(batch.numbers, pos, edge_index, shifts, batch.batch, batch.num_structures)["energy"].sum()
    (forces,) = torch.autograd.grad(energy, [pos], create_graph=True)
    forces.square().sum().backward()
    assert calls[before:] == []
    # (the per-species energy shift, say, has no say in forces: its gradient stays None)
    grads = [p.grad for p in train.parameters() if p.grad is not None]
    assert len(grads) > len(list(train.parameters())) // 2 and all(torch.isfinite(g).all() for g in grads)


@gpu
@needs_cuda
def test_split_sums_reach_planes_past_2_to_the_31_entries():
    """The split edge kernel's sums (``_mp_sum_split_kernel``, which adds the layers' partial rows into the sink)
    at E * N_RBF > 2^31: a plane's offset computed in 32 bits wrapped there (a 2,000,004-atom water box, ~108M
    edges: an illegal address, stop 58). Plane 0 holds ones, plane 1 random rows at both ends; ACC adds both to
    what the outputs hold (the sink's second layer onwards). ~30 GB of device memory."""
    from mlff_distiller.kernels._mp_edge_kernels import _mp_sum_split_kernel

    dev = torch.device("cuda")
    e, n_rbf = 2**31 // 20 + 4096, 20
    if torch.cuda.get_device_properties(dev).total_memory < 48 * 2**30:
        pytest.skip("needs ~30 GB of device memory")
    gen = torch.Generator(device=dev).manual_seed(0)
    part_rbf = torch.ones((2, e, n_rbf), device=dev)
    part_unit = torch.ones((2, e, 3), device=dev)
    ends = (slice(0, 4096), slice(e - 4096, e))
    for rows in ends:
        part_rbf[1, rows] = torch.randn((4096, n_rbf), device=dev, generator=gen)
        part_unit[1, rows] = torch.randn((4096, 3), device=dev, generator=gen)
    g_rbf = torch.full((e, n_rbf), 0.5, device=dev)
    g_unit = torch.full((e, 3), 0.5, device=dev)
    _mp_sum_split_kernel[(-(-e // 128),)](
        part_rbf, part_unit, g_rbf, g_unit, e, N_RBF=n_rbf, R_PAD=32, SPLIT=2, BLOCK_E=128, PDL=False, ACC=True
    )
    torch.cuda.synchronize()
    for rows in ends:
        torch.testing.assert_close(g_rbf[rows], 1.5 + part_rbf[1, rows], rtol=0, atol=1e-6)
        torch.testing.assert_close(g_unit[rows], 1.5 + part_unit[1, rows], rtol=0, atol=1e-6)
    middle = slice(e // 2, e // 2 + 4096)
    assert bool((g_rbf[middle] == 2.5).all()) and bool((g_unit[middle] == 2.5).all())
