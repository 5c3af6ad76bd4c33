"""The first layer from species-resolved radial moments (``StudentModel._first_layer_moments``,
``kernels.species_moments``): the energies, forces and stress of the message-passing kernel's first layer, on the
model's own forward and on the engine's padded step; the moment matrices follow weight edits; where it does not
apply (torch backend, unsorted edges, too many species, below the edge threshold) the message kernel runs."""

from __future__ import annotations

import contextlib
import importlib

import numpy as np
import pytest
import torch
from helpers import capture_spy, make_model, random_molecule, silicon_cell
from mlff_distiller.kernels import triton_available, use_backend

from mlff_distiller import AtomsBatch, ForceEngine

sm = importlib.import_module("mlff_distiller.kernels.species_moments")
interpreter = pytest.mark.skipif(
    not triton_available("cpu"), reason="needs the Triton interpreter (TRITON_INTERPRET=1)"
)


@contextlib.contextmanager
def _moments(least, degree=0):
    """The moments from ``least`` edges and ``degree`` edges per atom on (None: off)."""
    old = dict(sm._CONFIG)
    sm._CONFIG.update(model_min_edges=least, model_min_degree=degree)
    try:
        yield
    finally:
        sm._CONFIG.update(old)


def _frozen(model):
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    return AtomsBatch.from_atoms([random_molecule(k, rng) for k in (2, 6, 11)] + [silicon_cell()], dtype=torch.float64)


def _spy(monkeypatch):
    calls = []
    real = sm.first_layer_messages

    def spy(*args, **kw):
        calls.append(args[0].shape[0])
        return real(*args, **kw)

    monkeypatch.setattr(sm, "first_layer_messages", spy)
    return calls


def _forward(model, batch, least):
    from mlff_distiller.neighbors import neighbor_list

    nl = neighbor_list(batch.positions, batch.cell, batch.pbc, batch.batch, batch.ptr, model.cutoff, "brute")
    with _moments(least), use_backend("triton"):
        pos = batch.positions.clone().requires_grad_(True)
        out = model(batch.numbers, pos, nl.edge_index, nl.shift_vectors, batch.batch, batch.num_structures)
        (g,) = torch.autograd.grad(out["energy"].sum(), pos)
    return out["energy"].detach(), -g


@interpreter
def test_the_models_forward_with_moments_equals_the_message_kernel(monkeypatch):
    """float64 under the interpreter: the same energies and forces to 1e-10, and the moments ran once (the first
    layer), on a batch of molecules and a periodic cell of six species."""
    model = _frozen(make_model(seed=4).double())
    batch = _batch()
    calls = _spy(monkeypatch)
    e_m, f_m = _forward(model, batch, 0)
    assert len(calls) == 1
    e_k, f_k = _forward(model, batch, None)
    assert len(calls) == 1
    torch.testing.assert_close(e_m, e_k, rtol=0, atol=1e-10)
    torch.testing.assert_close(f_m, f_k, rtol=0, atol=1e-10)
    assert float(f_k.abs().max()) > 1e-3


@interpreter
@pytest.mark.parametrize("stress", [False, True])
def test_the_engines_padded_step_with_moments(stress, monkeypatch):
    """The engine's padded step (CSR buffers, padding edges past row_ptr[N]; on a CPU the padded eager path):
    energies, forces and stress with the moments equal the message kernel's."""
    model = make_model(seed=6).double()
    batch = _batch(1)
    calls = _spy(monkeypatch)
    outs = []
    for least in (0, None):
        with _moments(least), use_backend("triton"):
            engine = ForceEngine(model, device="cpu", precision="fp64", mode="cudagraph")
            outs.append(engine.compute(batch, stress=stress, to_host=True))
    assert calls, "the padded step did not take the moments"
    for key in ("energy", "forces", *(["stress"] if stress else [])):
        torch.testing.assert_close(outs[0][key], outs[1][key], rtol=0, atol=1e-10, msg=key)


@interpreter
def test_the_moment_matrices_follow_weight_edits(monkeypatch):
    model = _frozen(make_model(seed=8).double())
    batch = _batch(2)
    _forward(model, batch, 0)
    for w in (model.interactions[0].filter.weight, model.embedding.weight, model.interactions[0].phi[2].weight):
        with torch.no_grad():
            w.mul_(1.5).add_(0.02)
        e_m, f_m = _forward(model, batch, 0)
        e_k, f_k = _forward(model, batch, None)
        torch.testing.assert_close(e_m, e_k, rtol=0, atol=1e-10)
        torch.testing.assert_close(f_m, f_k, rtol=0, atol=1e-10)


@interpreter
def test_where_the_moments_do_not_apply(monkeypatch):
    model = _frozen(make_model(seed=9).double())
    batch = _batch(3)
    calls = _spy(monkeypatch)
    _forward(model, batch, 10**9)  # below the threshold
    with use_backend("torch"), _moments(0):  # the torch backend
        idx = model.z_to_index[batch.numbers]
        rbf, unit = torch.ones(4, model.config.n_rbf, dtype=torch.float64), torch.ones(4, 3, dtype=torch.float64)
        ei = torch.tensor([[0, 0, 1, 1], [1, 2, 0, 2]])
        assert model._first_layer_moments(idx[:3], rbf, unit, ei) is None
    with use_backend("triton"), _moments(0, degree=10):  # fewer edges per atom than asked for
        ei = torch.tensor([[0, 0, 1, 1], [1, 2, 0, 2]])
        assert model._first_layer_moments(idx[:3], rbf, unit, ei) is None
    with use_backend("triton"), _moments(0):  # edges not sorted by receiver
        ei = torch.tensor([[1, 0, 1, 0], [0, 2, 2, 1]])
        assert model._first_layer_moments(idx[:3], rbf, unit, ei) is None
    many = _frozen(make_model(seed=1, species=list(range(1, sm.MAX_SPECIES + 2))).double())
    with use_backend("triton"), _moments(0):
        ei = torch.tensor([[0, 0, 1, 1], [1, 2, 0, 2]])
        assert many._first_layer_moments(torch.tensor([0, 1, 2]), rbf, unit, ei) is None
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("stress", [False, True])
def test_captured_steps_with_moments_on_cuda(stress, monkeypatch):
    """float32 on CUDA, the shipped width: the captured step (and the eager one) with the moments against the
    message kernel's first layer, on a 192-atom water box and a batch of molecules."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from systems import water_box

    calls = _spy(monkeypatch)
    water = make_model(seed=3, species=[1, 8], hidden=128, layers=3, n_rbf=20, cutoff=5.0)
    mols = make_model(seed=5, species=[1, 6, 7, 8], hidden=128, layers=3, n_rbf=20, cutoff=5.0)
    rng = np.random.default_rng(4)
    cases = [
        (water, [water_box(192, seed=0)]),
        (mols, [random_molecule(k, rng, species=(1, 6, 7, 8)) for k in (5, 9, 14)]),
    ]
    for net, atoms in cases:
        batch = AtomsBatch.from_atoms(atoms)
        for mode in ("cudagraph", "eager"):
            outs = []
            for least in (0, None):
                with _moments(least):
                    engine = ForceEngine(net, device="cuda", precision="fp32", mode=mode)
                    for _ in range(2):  # capture, then a replay
                        out = engine.compute(batch, stress=stress and all(a.pbc.all() for a in atoms))
                    outs.append(out)
            for key in ("energy", "forces"):
                scale = outs[1][key].abs().max().clamp_min(1e-3)
                assert (outs[0][key] - outs[1][key]).abs().max() / scale <= 1e-5, (mode, key)
    assert calls


@pytest.mark.parametrize("layers", [1, 3])
def test_the_cpu_steps_written_out_backward_with_moments(layers, monkeypatch):
    """The CPU step (``model/analytic.py``) takes its first layer from the moments in torch (float64): energies,
    forces and stress equal the autograd path's (the message kernel's first layer) to 1e-11, on molecules and a
    periodic cell, and also when the edges run in chunks."""
    from mlff_distiller.model import analytic

    model = make_model(seed=layers, layers=layers)
    batch = _batch(5)
    used = []
    real = analytic._moments

    def spy(*args):
        used.append(True)
        return real(*args)

    monkeypatch.setattr(analytic, "_moments", spy)
    for chunked in (False, True):
        if chunked:
            monkeypatch.setattr(analytic, "CHUNK_MIN_FLOATS", 0)
            monkeypatch.setattr(analytic, "CHUNK_FLOATS", 64 * 3 * model.config.hidden)
        with _moments(0):
            fast = ForceEngine(model, device="cpu", precision="fp64", analytic=True)
            got = fast.compute(batch, stress=True, to_host=True)
        with _moments(None):
            ref = ForceEngine(model, device="cpu", precision="fp64", analytic=False)
            want = ref.compute(batch, stress=True, to_host=True)
        assert fast.n_analytic == 1 and used
        for key in ("energy", "atomic_energies", "forces", "stress"):
            scale = max(float(want[key].abs().max()), 1.0)
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-11 * scale, msg=key)
        used.clear()


def test_dense_periodic_cells_take_the_moments_on_the_cpu_step(monkeypatch):
    """The default bound (16 edges per atom): a dense periodic cell's CPU step takes the moments, a small molecule's
    does not."""
    from ase.build import bulk

    from mlff_distiller.model import analytic

    calls = []
    real = analytic._moments
    monkeypatch.setattr(analytic, "_moments", lambda *a: calls.append(1) or real(*a))
    model = make_model(seed=2)
    engine = ForceEngine(model, device="cpu", analytic=True)
    engine.compute(AtomsBatch.from_atoms(random_molecule(5, np.random.default_rng(1))))
    assert calls == []
    cu = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2)  # 4 Å cutoff: 18 neighbours per atom
    engine.compute(AtomsBatch.from_atoms(cu))
    assert calls == [1]


@pytest.mark.gpu
def test_captured_moments_add_into_the_edge_sink(monkeypatch):
    """A captured CUDA step on a 192-atom water box with the moments' first layer: its backward adds ∂rbf, ∂u into
    the second stream's edge-gradient sink (``into_sink``), inside the capture, and the forces and energies equal
    those with ``into_sink`` off (autograd's two adds), and those of the eager step."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from systems import water_box

    into = capture_spy(monkeypatch, "mlff_distiller.kernels.species_moments", "_moments_grads_into")
    calls = _spy(monkeypatch)
    net = make_model(seed=3, species=[1, 8], hidden=128, layers=3, n_rbf=20, cutoff=5.0)
    batch = AtomsBatch.from_atoms([water_box(192, seed=0)])
    outs = {}
    for way, mode, on in (("into", "cudagraph", True), ("off", "cudagraph", False), ("eager", "eager", True)):
        monkeypatch.setitem(sm._CONFIG, "into_sink", on)
        into.clear()
        with _moments(0):
            engine = ForceEngine(net, device="cuda", precision="fp32", mode=mode)
            for _ in range(2):  # capture, then a replay
                outs[way] = engine.compute(batch)
        assert (True in into) == (way == "into"), (way, into)
    assert calls
    for way in ("off", "eager"):
        for key in ("energy", "forces"):
            scale = outs[way][key].abs().max().clamp_min(1e-3)
            assert (outs["into"][key] - outs[way][key]).abs().max() / scale <= 1e-5, (way, key)
