"""The CPU step's written-out backward (``mlff_distiller.model.analytic``): the energies and gradients of the autograd
path in float64 for every basis and envelope, finite differences, stress, the engine's choice of path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms
from helpers import make_model, random_molecule, silicon_cell

from mlff_distiller import AtomsBatch, ForceEngine, StudentCalculator, load_model
from mlff_distiller.model import analytic


def _structures(seed: int = 0) -> list[Atoms]:
    rng = np.random.default_rng(seed)
    out = [random_molecule(int(k), rng) for k in (1, 2, 5, 9, 13)]
    out.append(silicon_cell(seed=seed))  # periodic: shift vectors and stress
    twin = random_molecule(4, rng)
    twin.positions[1] = twin.positions[0]  # two coincident atoms: the reference's zero-distance handling
    out.append(twin)
    return out


def _engines(model, **kw):
    return ForceEngine(model, device="cpu", analytic=True, **kw), ForceEngine(model, device="cpu", analytic=False, **kw)


@pytest.mark.parametrize(("basis", "envelope"), [("bessel", "cosine"), ("gaussian", "polynomial")])
@pytest.mark.parametrize("layers", [1, 3])
def test_the_autograd_path_in_float64(basis, envelope, layers):
    model = make_model(seed=layers, basis=basis, envelope=envelope, layers=layers)
    fast, ref = _engines(model, precision="fp64")
    assert fast.analytic and not ref.analytic
    batch = AtomsBatch.from_atoms(_structures(layers))
    got = fast.compute(batch, stress=True, to_host=True)
    want = ref.compute(batch, stress=True, to_host=True)
    assert fast.n_analytic == 1 and ref.n_analytic == 0
    for key in ("energy", "atomic_energies", "forces", "stress"):
        scale = max(float(want[key].abs().max()), 1.0)
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-11 * scale, msg=key)
    assert bool(want["stress_valid"].any()) and torch.equal(got["stress_valid"], want["stress_valid"])


def test_forces_are_minus_the_energy_gradient():
    """Central differences of the energy (float64) against the forces of the written-out backward."""
    model = make_model(seed=4, layers=2)
    engine = ForceEngine(model, device="cpu", precision="fp64", analytic=True)
    atoms = random_molecule(6, np.random.default_rng(11))
    forces = engine.compute(AtomsBatch.from_atoms([atoms]), to_host=True)["forces"].numpy()
    h = 1e-5
    for a in range(len(atoms)):
        for k in range(3):
            e = []
            for sign in (1, -1):
                moved = atoms.copy()
                moved.positions[a, k] += sign * h
                e.append(float(engine.compute(AtomsBatch.from_atoms([moved]), forces=False)["energy"][0]))
            assert forces[a, k] == pytest.approx(-(e[0] - e[1]) / (2 * h), abs=1e-7)


def test_the_shipped_student_in_float32_and_the_calculator():
    model = load_model("builtin:chno-gfn2")
    fast, ref = _engines(model)
    batch = AtomsBatch.from_atoms(_structures(2)[:5] + _structures(3)[-1:])
    got, want = fast.compute(batch, to_host=True), ref.compute(batch, to_host=True)
    torch.testing.assert_close(got["energy"], want["energy"], rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(got["forces"], want["forces"], rtol=1e-4, atol=1e-4)
    calc = StudentCalculator(model, device="cpu")  # MD on a CPU takes it (Verlet list, the eager step)
    atoms = _structures(5)[3]
    atoms.calc = calc
    atoms.get_forces()
    assert calc.engine.analytic and calc.engine.n_analytic == 1


def test_where_it_does_not_apply():
    """GPUs keep their own path; a replaced block, a 16-bit copy of the layers or analytic=False take autograd."""
    model = make_model(seed=1)
    assert analytic.supports(model)
    model.updates[0].mix[1] = torch.nn.Tanh()
    assert not analytic.supports(model)
    engine = ForceEngine(model, device="cpu")
    assert not engine.analytic
    engine.compute(AtomsBatch.from_atoms(_structures()[:2]))
    assert engine.n_analytic == 0
    linear = make_model(seed=1)
    linear.interactions[1].filter = torch.nn.utils.parametrizations.weight_norm(linear.interactions[1].filter)
    assert not analytic.supports(linear)
    energies_only = ForceEngine(make_model(seed=2), device="cpu")
    energies_only.compute(AtomsBatch.from_atoms(_structures()[:2]), forces=False)
    assert energies_only.analytic and energies_only.n_analytic == 0  # no gradient asked: the plain forward


def test_a_forward_hook_keeps_the_models_own_forward():
    model = make_model(seed=3)
    engine = ForceEngine(model, device="cpu")
    seen = []
    hook = model.updates[0].register_forward_hook(lambda mod, args, out: seen.append(1))
    try:
        engine.compute(AtomsBatch.from_atoms(_structures()[:2]))
    finally:
        hook.remove()
    assert seen and engine.n_analytic == 0
    engine.compute(AtomsBatch.from_atoms(_structures()[:2]))
    assert engine.n_analytic == 1


def test_the_triton_backend_keeps_its_kernels():
    """With the Triton backend forced (the interpreter runs it on CPU tensors in CI), the step stays on its kernels."""
    from mlff_distiller.kernels import use_backend

    engine = ForceEngine(make_model(seed=5, hidden=8, layers=1), device="cpu", precision="fp64")
    with use_backend("triton"):
        assert not engine._analytic_now()
    assert engine._analytic_now()


def test_a_block_replaced_after_the_engine_was_built():
    """On the CPU the engine shares the caller's model: a block the caller replaces later is seen at the next call."""
    model = make_model(seed=6)
    engine = ForceEngine(model, device="cpu", precision="fp32")
    assert engine.model is model and engine._analytic_now()
    model.updates[1].mix[1] = torch.nn.Tanh()
    assert not engine._analytic_now()
    got = engine.compute(AtomsBatch.from_atoms(_structures()[:3]), to_host=True)
    want = ForceEngine(model, device="cpu", analytic=False).compute(
        AtomsBatch.from_atoms(_structures()[:3]), to_host=True
    )
    torch.testing.assert_close(got["forces"], want["forces"])


def test_structures_without_pairs():
    """A lone atom and two atoms beyond the cutoff: no pairs at all in the batch, the autograd path's numbers."""
    model = make_model(seed=7)
    fast, ref = _engines(model, precision="fp64")
    batch = AtomsBatch.from_atoms([Atoms("O", positions=[[0, 0, 0]]), Atoms("H2", positions=[[0, 0, 0], [0, 0, 9]])])
    got, want = fast.compute(batch, to_host=True), ref.compute(batch, to_host=True)
    assert fast.n_analytic == 1
    torch.testing.assert_close(got["energy"], want["energy"], rtol=1e-12, atol=0)
    assert not got["forces"].any() and torch.isfinite(got["forces"]).all()


@pytest.mark.parametrize("basis", ["bessel", "gaussian"])
@pytest.mark.parametrize("envelope", ["cosine", "polynomial"])
def test_the_written_out_geometry(basis, envelope, monkeypatch):
    """Without coincident atoms or the ZBL wall the geometry's derivative (basis x envelope, distance, unit
    vector) is written out: no autograd call at all, the autograd path's forces and stress in float64, pairs
    beyond the cutoff and periodic images included."""
    model = make_model(seed=8, basis=basis, envelope=envelope)
    fast, ref = _engines(model, precision="fp64")
    structures = _structures(8)[:-1]  # (the last one holds two coincident atoms)
    structures[3].positions *= 1.6  # some pairs beyond the cutoff
    batch = AtomsBatch.from_atoms(structures)
    want = ref.compute(batch, stress=True, to_host=True)

    def no_autograd(*a, **kw):
        raise AssertionError("the written-out geometry took autograd")

    monkeypatch.setattr(torch.autograd, "grad", no_autograd)
    got = fast.compute(batch, stress=True, to_host=True)
    assert fast.n_analytic == 1
    for key in ("energy", "forces", "stress"):
        scale = max(float(want[key].abs().max()), 1.0)
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-11 * scale, msg=key)


def test_the_wall_and_close_pairs_take_autograd_for_the_geometry():
    """Where the shipped student's ZBL wall acts (a squeezed pair) or a pair lies closer than 1e-4 Å (the Bessel
    basis's series branch), the geometry runs on autograd as the reference's; the energy and its gradient match
    the model's own forward and autograd in float64."""
    model = load_model("builtin:chno-gfn2").double()
    squeezed = Atoms("OH2", positions=[[0, 0, 0], [0.35, 0, 0], [-0.3, 0.9, 0]])  # an O-H pair inside the wall
    close = Atoms("CH2", positions=[[0, 0, 0], [5e-5, 0, 0], [1.0, 0.2, 0]])  # a C-H pair at 5e-5 Å
    for atoms in (squeezed, close):
        n = len(atoms)
        ei = torch.tensor([(a, b) for a in range(n) for b in range(n) if a != b]).t()
        pos = torch.tensor(atoms.positions, dtype=torch.float64)
        args = (torch.tensor(atoms.numbers), pos, ei, torch.zeros(ei.shape[1], 3, dtype=torch.float64))
        owner = torch.zeros(n, dtype=torch.long)
        calls = []
        real = torch.autograd.grad

        def counted(*a, calls=calls, real=real, **kw):
            calls.append(1)
            return real(*a, **kw)

        try:
            torch.autograd.grad = counted
            energy, _, g_pos, _ = analytic.energy_and_gradients(model, *args, owner, 1)
        finally:
            torch.autograd.grad = real
        assert calls  # the geometry on autograd
        p = pos.clone().requires_grad_(True)
        want_e = model(args[0], p, ei, args[3], owner, 1)["energy"]
        (want_g,) = torch.autograd.grad(want_e.sum(), [p])
        torch.testing.assert_close(energy, want_e.detach(), rtol=0, atol=1e-10)
        torch.testing.assert_close(g_pos, want_g, rtol=0, atol=1e-9)


def test_the_kept_weights_follow_the_model():
    """The engine keeps the parameters it reads; new data in them (load_state_dict, dtype changes) is read at the
    next call, and a parameter replaced by another object is fetched again."""
    model = make_model(seed=10)
    engine = ForceEngine(model, device="cpu", precision="fp32")
    batch = AtomsBatch.from_atoms(_structures()[:3])
    first = engine.compute(batch, to_host=True)["forces"]
    kept = engine._analytic_guard.weights()
    assert engine._analytic_guard.weights() is kept
    other = make_model(seed=11)
    model.load_state_dict(other.state_dict())  # in place: the same parameter objects
    assert engine._analytic_guard.weights() is kept
    want = ForceEngine(other, device="cpu", analytic=False).compute(batch, to_host=True)["forces"]
    torch.testing.assert_close(engine.compute(batch, to_host=True)["forces"], want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, first)
    model.updates[0].U.weight = torch.nn.Parameter(torch.zeros_like(model.updates[0].U.weight))
    assert engine._analytic_guard.weights() is not kept
    want = ForceEngine(model, device="cpu", analytic=False).compute(batch, to_host=True)["forces"]
    torch.testing.assert_close(engine.compute(batch, to_host=True)["forces"], want, rtol=1e-5, atol=1e-5)
    assert engine.n_analytic == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("basis", "envelope"), [(b, e) for b in ("bessel", "gaussian") for e in ("cosine", "polynomial")]
)
def test_the_written_out_geometry_has_the_reference_values(basis, envelope, dtype):
    """Distances, unit vectors and basis x envelope of the written-out geometry are the reference op's, bit for bit
    (pairs from 1e-4 Å to beyond the cutoff), and its derivative of basis x envelope is autograd's."""
    from mlff_distiller import kernels

    model = make_model(seed=12, basis=basis, envelope=envelope)
    c = model.config
    gen = torch.Generator().manual_seed(0)
    vec = torch.randn(400, 3, generator=gen, dtype=torch.float64)
    vec = vec / vec.norm(dim=1, keepdim=True) * torch.linspace(1e-4, 1.3 * c.cutoff, 400, dtype=torch.float64)[:, None]
    vec = vec.to(dtype)
    dist, unit, rbf, d_rbf = analytic._closed_geometry(vec, c)
    zeros = torch.zeros(1, 3, dtype=dtype)
    ei = torch.zeros(2, len(vec), dtype=torch.long)
    want = kernels.edge_basis_reference(zeros, ei, vec, c.n_rbf, c.cutoff, c.basis, c.envelope)
    for got, ref in zip((dist, unit, rbf), want, strict=True):
        assert torch.equal(got, ref)
    d = dist.detach().double().requires_grad_(True)
    r = kernels.rbf_cutoff_reference(d, c.n_rbf, c.cutoff, c.basis, c.envelope)
    jac = torch.stack([torch.autograd.grad(r[:, k].sum(), [d], retain_graph=True)[0] for k in range(c.n_rbf)], 1)
    # (in float32 the Bessel derivative cancels below ~0.1 Å, as autograd's own float32 derivative does)
    far = slice(None) if dtype == torch.float64 else dist >= 0.1
    tol = {"rtol": 1e-9, "atol": 1e-9} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(d_rbf.double()[far], jac[far], **tol)
    assert analytic._closed_geometry(torch.tensor([[5e-5, 0.0, 0.0]], dtype=dtype), c) is None


@pytest.mark.parametrize("chunk_edges", [None, 7, 64])
def test_the_messages_in_edge_chunks(chunk_edges, monkeypatch):
    """Graphs whose per-edge tensors hold at least CHUNK_MIN_FLOATS values run their messages in chunks (made
    again in the backward): the
    autograd path's energies, forces and stress in float64, with chunks of 7 and 64 edges (a ragged last chunk) and
    with the shipped chunk size on a 96-atom water cluster (2,310 edges: two chunks at this student's width). The
    threshold is lowered to 0 for all three (the shipped one: tens of thousands of edges at this width)."""
    if chunk_edges is None:
        from ase.build import molecule

        rng = np.random.default_rng(13)
        cluster = Atoms()
        for _ in range(32):
            w = molecule("H2O")
            w.rotate(rng.uniform(0, 360), rng.normal(size=3))
            w.translate(rng.uniform(0, 9.0, 3))
            cluster += w
        structures = [cluster]
    else:
        structures = _structures(14)
        monkeypatch.setattr(analytic, "CHUNK_FLOATS", chunk_edges * 3 * 32)  # make_model's hidden is 32
    monkeypatch.setattr(analytic, "CHUNK_MIN_FLOATS", 0)
    model = make_model(seed=14, species=[1, 6, 7, 8, 14, 29], hidden=32, layers=2)
    fast, ref = _engines(model, precision="fp64")
    batch = AtomsBatch.from_atoms(structures)
    chunks = []
    real = analytic._edge_chunks
    monkeypatch.setattr(analytic, "_edge_chunks", lambda *a: chunks.append(real(*a)) or chunks[-1])
    got = fast.compute(batch, stress=True, to_host=True)
    want = ref.compute(batch, stress=True, to_host=True)
    assert fast.n_analytic == 1 and chunks[0] is not None and len(chunks[0]) >= 2
    for key in ("energy", "forces", "stress"):
        scale = max(float(want[key].abs().max()), 1.0)
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-11 * scale, msg=key)


def test_which_graphs_are_chunked():
    """One piece below CHUNK_MIN_FLOATS per-edge values, chunks of CHUNK_FLOATS / 3F edges (the last ragged) above."""
    assert analytic._edge_chunks(1_562, 128) is None and analytic._edge_chunks(3_124, 64) is None
    chunks = analytic._edge_chunks(6_608, 128)
    assert chunks[0] == (0, 512) and chunks[-1] == (6_144, 6_608) and len(chunks) == 13
    assert analytic._edge_chunks(3_200, 64) == [(0, 1_024), (1_024, 2_048), (2_048, 3_072), (3_072, 3_200)]
