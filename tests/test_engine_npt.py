"""Cells that change under a kept Verlet list: ASE's NPT and cell relaxations through ``StudentCalculator``'s padded
path (the list kept across the barostat's cell changes and equal to fresh lists, the speculative step discarded on
a cell change, stresses left out until read), and the shift vectors the padded Verlet path keeps on the device.
Split from ``test_engine_stress.py``.

``@pytest.mark.gpu`` tests run the CUDA-graph path against the eager reference.
"""

import warnings

import numpy as np
import pytest
import torch
from helpers import silicon_cell

from mlff_distiller import AtomsBatch, ForceEngine, StudentCalculator

gpu = pytest.mark.gpu


@pytest.mark.parametrize("speculate", [False, True])
def test_npt_keeps_the_verlet_list_and_equals_fresh_lists(model, speculate):
    """NPT through the calculator's padded path: the Verlet list is kept across the barostat's cell changes (its
    shift vectors follow the cell) and every step's stress and forces equal those of a fresh list, fp64. With the
    speculative launch (on by default on CUDA), the second calculation of each step (same cell) is launched before
    the list test; the first (a new cell) is not."""
    from mlff_distiller.engine_padded import COMPACT_MIN_EDGES

    atoms = silicon_cell().repeat((4, 4, 4))  # big enough for the in-step compaction of the skin list
    atoms.rattle(0.02, seed=3)
    atoms.calc = StudentCalculator(model, device="cpu", precision="fp64", mode="cudagraph")
    check = StudentCalculator(model, device="cpu", precision="fp64", mode="eager", skin=None)
    engine = atoms.calc.engine
    engine.speculative_verlet = speculate
    volumes = [atoms.get_volume()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cudagraph on a CPU: the padded eager path
        dyn = _fast_barostat(atoms)
        for _ in range(8):
            dyn.run(2)
            volumes.append(atoms.get_volume())
            ref = atoms.copy()
            ref.calc = check
            np.testing.assert_allclose(atoms.get_stress(), ref.get_stress(), rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(atoms.get_forces(), ref.get_forces(), rtol=1e-9, atol=1e-12)
    assert abs(volumes[-1] / volumes[0] - 1) > 2e-3, volumes  # the barostat did move the cell
    v = engine.verlet
    assert v.cell_updates >= 8 and v.n_builds < 4, (v.n_builds, v.cell_updates)
    assert engine._verlet_fill is not None  # the stress steps ran on the Verlet path's bucket
    assert engine.last_bucket.edges >= COMPACT_MIN_EDGES  # so the skin list's far pairs were compacted away
    if speculate:  # one launch per step (16 steps, the checks' calls on other atoms objects aside)
        assert 14 <= engine.n_speculated <= 17 and engine.n_discarded <= v.n_builds, (
            engine.n_speculated,
            engine.n_discarded,
        )
    else:
        assert engine.n_speculated == 0


def test_cell_changes_without_stress_discard_the_speculative_step(model):
    """Forces only, the cell changing between calls (a cell filter asking for forces, or MD after a barostat
    step): a speculative launch of the Verlet path would use the previous cell's shift vectors. A new cell tensor
    on the host with other values is not speculated on; one changed in place (the same tensor) is, and that
    launch is discarded and the step rerun with the kept list's new shift vectors. The forces equal a fresh
    list's, fp64."""
    rng = np.random.default_rng(2)
    atoms = silicon_cell().repeat((2, 2, 1))
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=True, neighbor_skin=1.0)
    engine.speculative_verlet = True
    ref = ForceEngine(model, device="cpu", precision="fp64")
    for step in range(6):
        e = rng.normal(0, 0.003, (3, 3))
        atoms.set_cell(atoms.cell[:] @ (np.eye(3) + 0.5 * (e + e.T)), scale_atoms=True)
        batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
        out, want = engine.compute(batch, to_host=True), ref.compute(batch)
        np.testing.assert_allclose(out["forces"].numpy(), want["forces"].numpy(), rtol=1e-9, atol=1e-12, err_msg=step)
    assert engine.verlet.n_builds == 1 and engine.verlet.cell_updates == 5  # the first call built the list
    assert engine.n_speculated == 0 and engine.n_discarded == 0  # every cell was new
    # The same cell values in a new tensor: speculated on, and kept.
    out = engine.compute(AtomsBatch.from_atoms(atoms, dtype=torch.float64), to_host=True)
    assert engine.n_speculated == 1 and engine.n_discarded == 0
    # A cell changed in place (the same tensor): speculated on, then discarded by the list's test.
    batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
    engine.compute(batch, to_host=True)
    for step in range(3):
        e = rng.normal(0, 0.003, (3, 3))
        atoms.set_cell(atoms.cell[:] @ (np.eye(3) + 0.5 * (e + e.T)), scale_atoms=True)
        batch.cell.copy_(torch.from_numpy(atoms.cell[:][None]))
        batch.positions.copy_(torch.from_numpy(atoms.positions))
        out, want = engine.compute(batch, to_host=True), ref.compute(batch)
        np.testing.assert_allclose(out["forces"].numpy(), want["forces"].numpy(), rtol=1e-9, atol=1e-12, err_msg=step)
    assert engine.n_speculated == 5 and engine.n_discarded == 3


@gpu
def test_npt_on_cuda_keeps_the_list_and_equals_fresh_lists(model):
    """The NPT path on CUDA (captured stress step, the kept list's shift vectors copied in on cell changes)
    against the eager fresh-list calculator, fp32."""
    atoms = silicon_cell().repeat((4, 4, 4))  # the skin list compacted in the step
    atoms.rattle(0.02, seed=3)
    atoms.calc = StudentCalculator(model, device="cuda", mode="cudagraph")
    check = StudentCalculator(model, device="cuda", mode="eager", skin=None)
    dyn = _fast_barostat(atoms)
    v0 = atoms.get_volume()
    for _ in range(6):
        dyn.run(3)
        ref = atoms.copy()
        ref.calc = check
        for got, want in ((atoms.get_stress(), ref.get_stress()), (atoms.get_forces(), ref.get_forces())):
            assert np.abs(got - want).max() <= 1e-4 * max(np.abs(want).max(), 1e-3)
    v = atoms.calc.engine.verlet
    assert abs(atoms.get_volume() / v0 - 1) > 2e-3 and v.cell_updates >= 6 and v.n_builds < 4
    assert atoms.calc.engine._stress_runners  # captured


def test_calculator_cell_change_reuses_its_batch_and_still_validates(model):
    """A barostat step changes cell and positions: the calculator swaps the new cell into its previous batch
    (no full from_atoms) after the same checks; a non-finite or zero-volume cell is still a clear ValueError."""
    atoms = silicon_cell().repeat((2, 1, 1))
    atoms.calc = StudentCalculator(model, device="cpu", precision="fp64")
    atoms.get_forces()
    first = atoms.calc._last_batch
    atoms.set_cell(atoms.cell[:] * 1.01, scale_atoms=True)
    forces, stress = atoms.get_forces(), atoms.get_stress()
    assert atoms.calc._last_batch.numbers is first.numbers  # the batch was reused, with the new cell
    np.testing.assert_allclose(atoms.calc._last_batch.cell[0].numpy(), atoms.cell[:])
    fresh = atoms.copy()
    fresh.calc = StudentCalculator(model, device="cpu", precision="fp64", skin=None)
    np.testing.assert_allclose(forces, fresh.get_forces(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(stress, fresh.get_stress(), rtol=1e-9, atol=1e-12)
    bad = atoms.cell[:].copy()
    bad[0, 0] = np.nan
    atoms.set_cell(bad)
    with pytest.raises(ValueError, match="non-finite cell"):
        atoms.get_forces()
    atoms.set_cell(np.diag([5.0, 5.0, 0.0]))
    with pytest.raises(ValueError, match="zero-volume cell"):
        atoms.get_forces()


def _fast_barostat(atoms):
    """Berendsen NPT that moves a small cell visibly within a few steps (0.1 / GPa, τ_P 20 fs, 2 fs steps)."""
    from mlff_distiller.distill import npt_berendsen

    return npt_berendsen(atoms, timestep_fs=2.0, pressure_bar=0.0, compressibility_per_bar=1e-5, taup_fs=20.0)


def test_unread_stress_after_cell_changes_is_left_out_until_wanted(model, monkeypatch):
    """The calculator learns which unrequested stresses get read. NPTBerendsen never reads the one computed right
    after its cell scaling: left out from the second step on, and the trajectory equals that of a calculator that
    computes every stress (fp64, bit for bit). A program that reads the stress after a cell change: a request
    that finds it left out computes it (one calculation more) and turns the rule off again."""
    from ase.filters import FrechetCellFilter
    from ase.md.nptberendsen import NPTBerendsen
    from ase.optimize import BFGS

    runs = []
    for learn in (True, False):
        atoms = silicon_cell().repeat((2, 2, 2))
        atoms.rattle(0.02, seed=3)
        atoms.set_momenta(np.random.default_rng(0).normal(0, 0.3, (len(atoms), 3)))
        atoms.calc = calc = StudentCalculator(model, device="cpu", precision="fp64")
        if not learn:  # the rule never switches on: every calculation in the window computes the stress
            never = property(lambda self: False, lambda self, value: None)
            monkeypatch.setattr(StudentCalculator, "_skip_after_cell_change", never, raising=False)
        calls = []
        compute = calc.engine.compute
        calc.engine.compute = lambda batch, _c=compute, _l=calls, **kw: (
            _l.append(kw.get("stress", False)) or _c(batch, **kw)
        )
        NPTBerendsen(atoms, timestep=1.0, temperature_K=300, pressure_au=0.0, compressibility_au=1e-4).run(6)
        runs.append((atoms, calls))
    monkeypatch.undo()
    (a1, calls1), (a2, calls2) = runs
    np.testing.assert_array_equal(a1.get_positions(), a2.get_positions())
    np.testing.assert_array_equal(a1.cell[:], a2.cell[:])
    # The run's first forces, the first step's stress request, then 2 calculations per step.
    assert calls1 == [False, True, True, True] + [False, True] * 5
    assert calls2 == [False] + [True] * 13  # 8 stress steps against 13

    # After a cell change, forces then stress (the order a program of its own might ask in): the stress was left
    # out, so the request computes it (one calculation more) and turns the rule off; the next cell change brings
    # the stress with the forces again.
    calc = a1.calc
    assert calc._skip_after_cell_change is True
    calls1.clear()
    for _ in range(2):
        a1.set_cell(a1.cell[:] * 1.001, scale_atoms=True)
        forces = a1.get_forces()
        stress = a1.get_stress()
    assert calls1 == [False, True, True] and calc._skip_after_cell_change is False
    fresh = a1.copy()
    fresh.calc = StudentCalculator(model, device="cpu", precision="fp64", mode="eager")
    np.testing.assert_allclose(forces, fresh.get_forces(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(stress, fresh.get_stress(), rtol=1e-9, atol=1e-12)
    # A cell relaxation (FrechetCellFilter asks for the stress first): one calculation per step, with its stress.
    calls1.clear()
    opt = BFGS(FrechetCellFilter(a1), logfile=None)
    opt.run(fmax=1e-12, steps=4)
    assert calls1 == [True] * opt.nsteps


def test_cell_relaxation_through_the_padded_path_equals_eager(model):
    """A cell relaxation (ASE's FrechetCellFilter + BFGS asks for stress and forces every step, with cell changes
    larger than an MD step's): the padded calculator, whose Verlet list is kept or rebuilt as the strain test
    decides, follows the same path as the eager fresh-list one, and both reach a small residual stress."""
    from ase.filters import FrechetCellFilter
    from ase.optimize import BFGS

    results = []
    for kw in (dict(mode="cudagraph"), dict(mode="eager", skin=None)):
        atoms = silicon_cell().repeat((2, 2, 2))
        atoms.rattle(0.03, seed=7)
        atoms.set_cell(atoms.cell[:] * 1.02, scale_atoms=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # cudagraph on a CPU: the padded eager path
            atoms.calc = StudentCalculator(model, device="cpu", precision="fp64", **kw)
            opt = BFGS(FrechetCellFilter(atoms), logfile=None)
            opt.run(fmax=1e-3, steps=60)
        results.append((atoms.get_volume(), atoms.get_potential_energy(), np.abs(atoms.get_stress()).max(), opt.nsteps))
        if kw["mode"] == "cudagraph":
            v = atoms.calc.engine.verlet
            assert v.cell_updates > 0, (v.n_builds, v.cell_updates)
    (v1, e1, s1, n1), (v2, e2, s2, n2) = results
    assert n1 == n2 and n1 > 3
    assert v1 == pytest.approx(v2, rel=1e-8) and e1 == pytest.approx(e2, rel=1e-10, abs=1e-10)
    assert max(s1, s2) < 1e-3


def test_padded_verlet_makes_kept_shift_vectors_on_the_device(model, monkeypatch):
    """Cell changes within the skin on the padded Verlet path (NPT), for one structure and for two: the kept
    list's shift vectors are made from its integer shifts and the caller's cell on the engine's device, never on
    the host (no ``_make_shift_vectors``), and forces and stress equal a fresh list's, fp64."""
    from helpers import triclinic_cu

    from mlff_distiller.neighbors.verlet import VerletNeighborList

    made = []
    original = VerletNeighborList._make_shift_vectors
    monkeypatch.setattr(VerletNeighborList, "_make_shift_vectors", lambda self: made.append(1) or original(self))
    rng = np.random.default_rng(8)
    ref = ForceEngine(model, device="cpu", precision="fp64")
    for systems in ([silicon_cell().repeat((2, 2, 1))], [silicon_cell().repeat((2, 2, 1)), triclinic_cu().repeat(2)]):
        engine = ForceEngine(model, device="cpu", precision="fp64", pad=True, neighbor_skin=1.0)
        for step in range(5):
            for atoms in systems:
                e = rng.normal(0, 0.002, (3, 3))
                atoms.set_cell(atoms.cell[:] @ (np.eye(3) + 0.5 * (e + e.T)), scale_atoms=True)
            batch = AtomsBatch.from_atoms(systems, dtype=torch.float64)
            out, want = engine.compute(batch, stress=True, to_host=True), ref.compute(batch, stress=True)
            for key in ("forces", "stress"):
                np.testing.assert_allclose(out[key].numpy(), want[key].numpy(), rtol=1e-9, atol=1e-12, err_msg=step)
        v = engine.verlet
        assert v.n_builds == 1 and v.cell_updates == 4 and engine._verlet_fill is not None, (v.n_builds, len(systems))
    assert not made


@pytest.mark.parametrize("structures", [1, 2])
def test_write_shift_vectors(model, structures):
    """``_write_shift_vectors`` (the padded Verlet path under a new cell): ``shifts[e] @ cell[structure[e]]`` in the
    engine dtype, for one structure and for several, equal to the float64 product."""
    from mlff_distiller.engine_verlet import _VerletFill

    rng = np.random.default_rng(3)
    e = 50
    engine = ForceEngine(model, device="cpu", precision="fp32", pad=True, neighbor_skin=1.0)
    shifts = torch.tensor(rng.integers(-2, 3, (e, 3)), dtype=torch.float32)
    structure = torch.tensor(rng.integers(0, structures, e)) if structures > 1 else None
    fill = _VerletFill(
        bucket=None,
        graph=None,
        builds=1,
        positions=torch.zeros(4, 3),
        staging=None,
        cell_updates=0,
        shifts=shifts,
        structure=structure,
        cell=torch.empty(structures, 3, 3),
    )
    cell = torch.tensor(np.diag([5.0, 6.0, 7.0]) + rng.normal(0, 0.5, (structures, 3, 3)))  # float64, as batches
    out = torch.full((e + 3, 3), 7.0)
    engine._write_shift_vectors(fill, cell, out[:e])
    rows = cell[0].expand(e, 3, 3) if structure is None else cell[structure]
    want = torch.einsum("ea,eab->eb", shifts.double(), rows)
    torch.testing.assert_close(out[:e].double(), want, rtol=1e-6, atol=1e-5)
    assert (out[e:] == 7.0).all()  # the rows beyond the list are left alone
