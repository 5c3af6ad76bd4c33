"""Stress (the strain derivative) in every ForceEngine mode: the padded step per bucket, compiled and captured,
``predict_forces(stress=True)``, ASE's NPT through ``StudentCalculator``, and :func:`edge_virial`, the one reduction
from the pairs' gradient to ``dE/dε`` that the eager path, the padded step and training share.

``@pytest.mark.gpu`` tests run the CUDA-graph path against the eager reference.
"""

import warnings

import numpy as np
import pytest
import torch
from ase.build import molecule
from ase.md.verlet import VelocityVerlet
from helpers import assert_close_to, silicon_cell

from mlff_distiller import AtomsBatch, ForceEngine, StudentCalculator, predict_forces
from mlff_distiller.buckets import BucketLadder
from mlff_distiller.testing import finite_difference_stress

gpu = pytest.mark.gpu


def test_oversized_batches_use_the_eager_path_with_stress_too(model):
    ladder = BucketLadder(min_atoms=8, max_atoms=16, min_edges=16, max_edges=64, growth=2.0)
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=True, buckets=ladder)
    ref = ForceEngine(model, device="cpu", precision="fp64")
    big = AtomsBatch.from_atoms([molecule("C6H6"), molecule("C6H6")])  # 24 atoms: beyond the ladder
    assert_close_to(engine.compute(big), ref.compute(big), "fp64", 2)
    big_cells = AtomsBatch.from_atoms([silicon_cell().repeat((2, 2, 2))] * 3)  # 48 atoms: beyond it
    out = engine.compute(big_cells, stress=True)
    np.testing.assert_allclose(out["stress"], ref.compute(big_cells, stress=True)["stress"], atol=1e-12)
    assert not engine._graphs


def _stress_batches():
    """Periodic cells (cubic, triclinic, a rattled supercell) mixed with molecules, which get no valid stress."""
    from helpers import triclinic_cu

    rattled = silicon_cell().repeat((2, 1, 1))
    rattled.rattle(0.05, seed=4)
    return [
        [silicon_cell()],
        [triclinic_cu(), rattled],
        [molecule("H2O"), silicon_cell(), molecule("CH4"), triclinic_cu()],
    ]


def test_padded_stress_equals_eager(model):
    """Stress in the padded modes: one step with the strain derivative per bucket (its own captured graph on
    CUDA), no eager fallback; energies, forces, stress and its validity mask equal the eager path's in fp64."""
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=True)
    ref = ForceEngine(model, device="cpu", precision="fp64")
    for _ in range(2):  # the second round reuses the buckets
        for mols in _stress_batches():
            batch = AtomsBatch.from_atoms(mols)
            out, want = engine.compute(batch, stress=True), ref.compute(batch, stress=True)
            assert engine.last_bucket is not None and engine.last_bucket in engine._graphs
            assert torch.equal(out["stress_valid"], want["stress_valid"])
            assert out["stress_valid"].sum() == sum(m.pbc.all() for m in mols) > 0
            for key in ("energy", "atomic_energies", "forces", "stress"):
                np.testing.assert_allclose(out[key].numpy(), want[key].numpy(), rtol=1e-10, atol=1e-12, err_msg=key)
            assert out["stress"][out["stress_valid"]].abs().max() > 1e-4  # not vacuous
            # The same engine serves energy + forces from the other step of the same bucket.
            assert_close_to(engine.compute(batch), want, "fp64", batch.num_structures)
            again = engine.compute(batch, stress=True, as_numpy=True)["stress"]
            np.testing.assert_allclose(again, want["stress"], rtol=1e-10, atol=1e-12)


def test_compiled_stress_step_equals_eager(model):
    """mode="compile" (aot_eager on the CPU) with stress: the compiled forward under strained inputs, fp64."""
    engine = ForceEngine(model, device="cpu", precision="fp64", mode="compile", compile_backend="aot_eager")
    ref = ForceEngine(model, device="cpu", precision="fp64")
    for mols in _stress_batches()[:2]:
        batch = AtomsBatch.from_atoms(mols)
        out, want = engine.compute(batch, stress=True), ref.compute(batch, stress=True)
        assert engine.last_bucket is not None
        for key in ("energy", "forces", "stress"):
            np.testing.assert_allclose(out[key].numpy(), want[key].numpy(), rtol=1e-10, atol=1e-12, err_msg=key)
        assert_close_to(engine.compute(batch), want, "fp64", batch.num_structures)  # E+F of the same compiled bucket


def test_predict_forces_stress_padded_and_pipelined_equals_eager(model):
    """``predict_forces(stress=True)`` through the padded step and the pipelined loop: the same rows as eager
    (stress only for the periodic structures), in input order."""
    structures = [m for mols in _stress_batches() for m in mols]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cudagraph on a CPU: the padded eager path
        got = predict_forces(
            model,
            structures,
            device="cpu",
            precision="fp64",
            stress=True,
            mode="cudagraph",
            batch_size=3,
            pipeline=True,
        )
    want = predict_forces(model, structures, device="cpu", precision="fp64", stress=True, mode="eager", batch_size=3)
    for atoms, g, w in zip(structures, got, want, strict=True):
        assert ("stress" in g) == ("stress" in w) == bool(atoms.pbc.all())
        assert g["energy"] == pytest.approx(w["energy"], abs=1e-10)
        np.testing.assert_allclose(g["forces"], w["forces"], atol=1e-10)
        if "stress" in g:
            np.testing.assert_allclose(g["stress"], w["stress"], atol=1e-12)


def test_padded_stress_with_edge_compaction(model, monkeypatch):
    """A bucket big enough for the in-step edge compaction (which takes no gradient through the shift vectors):
    the stress step compacts first, then takes the pairs' gradient over the kept pairs."""
    from mlff_distiller import kernels
    from mlff_distiller.engine_padded import COMPACT_MIN_EDGES

    atoms = silicon_cell().repeat((2, 2, 2))
    atoms.rattle(0.05, seed=6)
    batch = AtomsBatch.from_atoms([atoms] * 4)
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=True, compact_edges=True)
    calls = []
    compact = kernels.edge_compact
    monkeypatch.setattr(kernels, "edge_compact", lambda *a: calls.append(1) or compact(*a))
    out = engine.compute(batch, stress=True)
    assert engine.last_bucket.edges >= COMPACT_MIN_EDGES and calls == [1]  # the compaction ran, once
    want = ForceEngine(model, device="cpu", precision="fp64").compute(batch, stress=True)
    np.testing.assert_allclose(out["stress"].numpy(), want["stress"].numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["forces"].numpy(), want["forces"].numpy(), rtol=1e-10, atol=1e-12)


def test_padded_stress_matches_strain_finite_differences(model):
    """The padded stress step's σ against central differences of the padded energies under a symmetric strain."""
    from helpers import triclinic_cu

    atoms = triclinic_cu().repeat((2, 1, 1))
    atoms.rattle(0.03, seed=2)
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=True)
    sigma = engine.compute(AtomsBatch.from_atoms(atoms), stress=True)["stress"][0].numpy()
    fd = finite_difference_stress(atoms, lambda frames: engine.compute(AtomsBatch.from_atoms(frames))["energy"])
    assert np.abs(sigma).max() > 1e-4
    np.testing.assert_allclose(sigma, fd, atol=1e-8)


def test_warmup_with_stress_runs_the_stress_step(model):
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=True)
    calls = {"stress": 0, "plain": 0}
    step, step_stress = engine._step, engine._step_stress
    engine._step = lambda *a: calls.__setitem__("plain", calls["plain"] + 1) or step(*a)
    engine._step_stress = lambda *a: calls.__setitem__("stress", calls["stress"] + 1) or step_stress(*a)
    times = engine.warmup(structures=[[silicon_cell()]], stress=True)
    assert len(times) == 1 and calls == {"stress": 1, "plain": 0}
    engine.warmup(buckets=list(times))
    assert calls == {"stress": 1, "plain": 1}


def test_calculator_stress_runs_padded(model):
    """ASE asking for stress (NPT, cell relaxations) goes through the padded step, not the eager path."""
    from ase.md.nptberendsen import NPTBerendsen

    atoms = silicon_cell().repeat((2, 2, 2))
    atoms.rattle(0.02, seed=1)
    atoms.calc = StudentCalculator(model, device="cpu", precision="fp64", mode="cudagraph")
    check = StudentCalculator(model, device="cpu", precision="fp64", mode="eager")
    engine = atoms.calc.engine
    calls = []
    step = engine._step_stress
    engine._step_stress = lambda *args: calls.append(1) or step(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cudagraph on a CPU: the padded eager path, with a warning
        dyn = NPTBerendsen(atoms, timestep=1.0, temperature_K=300, pressure_au=0.0, compressibility_au=1e-6)
        for _ in range(3):
            dyn.run(2)
            ref = atoms.copy()
            ref.calc = check
            np.testing.assert_allclose(atoms.get_stress(), ref.get_stress(), rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(atoms.get_forces(), ref.get_forces(), rtol=1e-9, atol=1e-12)
    assert len(calls) >= 6  # every stress request of the 6 steps ran the padded stress step


def test_calculator_returns_stress_with_forces_once_asked(model):
    """After the first stress request, a periodic system's forces come with its stress (one step for both): ASE's
    NPTBerendsen asks for both of the same positions in separate calls, and finds the stress cached."""
    from ase.md.nptberendsen import NPTBerendsen

    atoms = silicon_cell().repeat((2, 2, 2))
    atoms.rattle(0.02, seed=1)
    atoms.calc = StudentCalculator(model, device="cpu", precision="fp64")
    engine = atoms.calc.engine
    calls = []
    compute = engine.compute
    engine.compute = lambda batch, **kw: calls.append(kw.get("stress", False)) or compute(batch, **kw)
    atoms.get_forces()
    assert calls == [False]  # nothing asked for stress yet
    dyn = NPTBerendsen(atoms, timestep=1.0, temperature_K=300, pressure_au=0.0, compressibility_au=1e-6)
    dyn.run(1)
    assert calls[1:] == [True] * 3  # the stress asked, then with both calculations of the first step
    calls.clear()
    dyn.run(5)
    # 2 calculations per step (was 3). The first one's stress (after the cell scaling) went unread in the first
    # step, so from then on only the second one, whose positions the next step asks the stress of, computes it.
    assert calls == [False, True] * 5
    fresh = atoms.copy()
    fresh.calc = StudentCalculator(model, device="cpu", precision="fp64", mode="eager")
    np.testing.assert_allclose(atoms.get_stress(), fresh.get_stress(), rtol=1e-9, atol=1e-12)
    assert len(calls) == 10  # the stress of the current positions was already there
    # NVT after that: the stress stops coming with the forces after STRESS_WINDOW calculations.
    from mlff_distiller.calculator import STRESS_WINDOW

    calls.clear()
    VelocityVerlet(atoms, timestep=1.0).run(STRESS_WINDOW + 3)
    assert calls == [True] * STRESS_WINDOW + [False] * 3
    molecule_atoms = molecule("H2O")
    molecule_atoms.calc = atoms.calc
    atoms.get_stress()
    molecule_atoms.get_forces()  # not periodic: no stress computed, no error
    assert calls[-1] is False


@gpu
def test_cuda_graph_stress_equals_eager(model):
    """The captured stress step (its own graph per bucket) against the eager path on CUDA, twice (replays)."""
    eager = ForceEngine(model, device="cuda", precision="fp32")
    engine = ForceEngine(model, device="cuda", precision="fp32", mode="cudagraph")
    for _ in range(2):
        for mols in _stress_batches():
            batch = AtomsBatch.from_atoms(mols)
            out, ref = engine.compute(batch, stress=True), eager.compute(batch, stress=True)
            assert torch.equal(out["stress_valid"].cpu(), ref["stress_valid"].cpu())
            for key in ("energy", "forces", "stress"):
                scale = ref[key].abs().max().clamp_min(1e-3)
                assert (out[key] - ref[key]).abs().max() / scale <= 1e-5, key
    assert engine._stress_runners and set(engine._stress_runners) <= set(engine._graphs)
    captured = len(engine._stress_runners)
    engine.compute(AtomsBatch.from_atoms(_stress_batches()[0]), stress=True)
    assert len(engine._stress_runners) == captured  # a replay, not a new capture


@gpu
def test_warmup_captures_the_stress_steps(model):
    engine = ForceEngine(model, device="cuda", mode="cudagraph")
    times = engine.warmup(structures=[[silicon_cell()]], stress=True)
    assert list(times) == list(engine._stress_runners) and not engine._runners
    engine.warmup(buckets=[next(iter(times))])
    assert list(engine._runners) == list(times)  # the energy + forces step of the same bucket


def _strained_energy_gradient(model, batch, nl):
    """The reference dE/dε: a zero symmetric strain leaf moves the positions and each cell (the strain trick)."""
    strain = torch.zeros_like(batch.cell).requires_grad_(True)
    sym = 0.5 * (strain + strain.transpose(1, 2))
    pos = batch.positions + torch.einsum("ni,nij->nj", batch.positions, sym[batch.batch])
    cell = batch.cell + torch.einsum("bik,bkj->bij", batch.cell, sym)
    shift_vectors = torch.einsum("ei,eij->ej", nl.shifts.to(cell.dtype), cell[batch.batch[nl.edge_index[0]]])
    out = model(batch.numbers, pos, nl.edge_index, shift_vectors, batch.batch, batch.num_structures)
    (grad,) = torch.autograd.grad(out["energy"].sum(), strain)
    return grad


def test_edge_virial_equals_the_strain_derivative(model):
    """edge_virial (Σ r_ij ⊗ dE/dr_ij per structure, from the gradient over the shift vectors) against the strain
    leaf's autograd, fp64, over cells, a supercell and molecules in one batch; also for a batch moved far from the
    origin (the pair form does not depend on where the atoms sit)."""
    from mlff_distiller.engine_padded import edge_virial
    from mlff_distiller.neighbors import neighbor_list_batch

    model = model.double()
    for mols in _stress_batches():
        batch = AtomsBatch.from_atoms(mols).to("cpu", torch.float64)
        nl = neighbor_list_batch(batch, model.config.cutoff)
        want = _strained_energy_gradient(model, batch, nl)
        for offset in (0.0, 250.0):
            pos = (batch.positions + offset).requires_grad_(True)
            shifts = nl.shift_vectors.detach().requires_grad_(True)
            out = model(batch.numbers, pos, nl.edge_index, shifts, batch.batch, batch.num_structures)
            _, pair_grad = torch.autograd.grad(out["energy"].sum(), (pos, shifts))
            got = edge_virial(pos.detach(), shifts.detach(), pair_grad, nl.edge_index, batch.batch, len(mols))
            assert want.abs().max() > 1e-3
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_edge_virial_sums_each_structure_in_float64(device):
    """The per-structure sum of the virial's per-atom terms accumulates in float64 and is rounded once, like the
    energy's (kernels.linear.structure_sums): float32 inputs with large terms of both signs (one self-edge per atom,
    so r_ij is its shift vector and each atom's term is one float32 product) give the float64 sum of those terms
    within two float32 spacings (0.4 here on a CPU); summed in float32 (the switch off: the mutation), 21."""
    from mlff_distiller.kernels import linear

    from mlff_distiller.engine_padded import edge_virial

    n, b = 40_000, 2
    g = torch.Generator().manual_seed(0)
    shifts = (torch.rand(n, 3, generator=g) * 2 - 1) * 30.0
    pair_grad = (torch.rand(n, 3, generator=g) * 2 - 1) * 30.0
    batch = torch.arange(n) % b
    edge_index = torch.arange(n).repeat(2, 1)
    positions = torch.rand(n, 3, generator=g) * 100.0
    args = [t.to(device) for t in (positions, shifts, pair_grad, edge_index, batch)]
    outer = (shifts.unsqueeze(2) * pair_grad.unsqueeze(1)).double()  # the terms as float32 products, exact in f64
    exact = torch.zeros(b, 3, 3, dtype=torch.float64).index_add_(0, batch, outer)
    exact = 0.5 * (exact + exact.transpose(1, 2))
    spacing = np.spacing(np.float32(exact.abs().max()))
    got = edge_virial(*args, b).cpu().double()
    assert (got - exact).abs().max() <= 2 * spacing, ((got - exact).abs().max(), spacing)
    linear._CONFIG["energy_sum_f64"] = False
    try:
        off = edge_virial(*args, b).cpu().double()
    finally:
        linear._CONFIG["energy_sum_f64"] = True
    assert (off - exact).abs().max() > 5 * spacing, ((off - exact).abs().max(), spacing)


def test_edge_virial_is_differentiable_for_training(model):
    """The stress that training fits (create_graph through the pairs' gradient): its gradient over a weight equals
    central differences of the stress in that weight, fp64."""
    from ase.calculators.singlepoint import SinglePointCalculator

    from mlff_distiller.distill.dataset import FrameDataset
    from mlff_distiller.distill.objective import student_forward_stress

    model = model.double()
    cells = [silicon_cell(), silicon_cell(seed=3).repeat((2, 1, 1))]
    for atoms in cells:  # labels the dataset asks for; their values play no part here
        atoms.calc = SinglePointCalculator(atoms, energy=0.0, forces=np.zeros((len(atoms), 3)))
    batch = FrameDataset(cells, model.cutoff, dtype=torch.float64).batch(range(2))
    weight = model.readout[0].weight
    probe = torch.randn(2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    _, _, stress = student_forward_stress(model, batch, create_graph=True)
    (grad,) = torch.autograd.grad((stress * probe).sum(), weight)
    grad = grad.detach()
    k = (3, 5)
    h = 1e-5
    with torch.no_grad():
        values = []
        for sign in (1, -1):
            weight[k] += sign * h
            with torch.enable_grad():
                values.append((student_forward_stress(model, batch, create_graph=False)[2] * probe).sum())
            weight[k] -= sign * h
    fd = (values[0] - values[1]) / (2 * h)
    assert abs(float(grad[k])) > 1e-6
    assert float(grad[k]) == pytest.approx(float(fd), rel=1e-6, abs=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stress_conversion_paths_agree(dtype):
    """``stress_from_strain_gradient`` has two paths: host results without a gradient (NumPy: MD and NPT through
    the calculator, every call; one structure and several) and torch (devices, training). Same numbers and the same
    validity for triclinic cells, a cell that is not fully periodic, and a cell of zero volume."""
    from mlff_distiller.engine_padded import stress_from_strain_gradient

    rng = np.random.default_rng(7)
    cells = [np.diag([5.0, 6.0, 7.0]) + rng.normal(0, 0.8, (3, 3)) for _ in range(3)]
    cells.append(np.array([[4.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0]]))  # zero volume
    pbcs = [[True] * 3, [True] * 3, [True, True, False], [True] * 3]
    for cell, pbc in zip(cells, pbcs, strict=True):
        de = torch.tensor(rng.normal(size=(1, 3, 3)), dtype=dtype)
        c, p = torch.tensor(cell[None]), torch.tensor([pbc])
        one = stress_from_strain_gradient(de, c, p)  # one structure on the host
        two = stress_from_strain_gradient(de.repeat(2, 1, 1), c.repeat(2, 1, 1), p.repeat(2, 1))  # NumPy
        ref = stress_from_strain_gradient(de.clone().requires_grad_(True), c, p)  # torch
        valid = bool(pbc == [True] * 3) and abs(np.linalg.det(cell)) > 0
        assert (
            one["stress_valid"].tolist() == [valid] == ref["stress_valid"].tolist() == two["stress_valid"][:1].tolist()
        )
        assert one["stress"].dtype == dtype and one["stress"].shape == (1, 6)
        tol = 1e-6 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(one["stress"], ref["stress"].detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(one["stress"], two["stress"][:1], rtol=tol, atol=tol)
        if valid:
            sigma = de[0].double().numpy() / abs(np.linalg.det(cell))
            want = [sigma[0, 0], sigma[1, 1], sigma[2, 2], sigma[1, 2], sigma[0, 2], sigma[0, 1]]
            np.testing.assert_allclose(one["stress"][0].double().numpy(), want, rtol=tol)
