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
