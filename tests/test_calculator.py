"""StudentCalculator inside ASE: properties, MD, optimisers, errors."""

import numpy as np
import pytest
from ase import units
from ase.build import molecule
from ase.calculators.calculator import PropertyNotImplementedError
from ase.md.langevin import Langevin
from ase.md.verlet import VelocityVerlet
from ase.optimize import BFGS, FIRE
from helpers import silicon_cell

from mlff_distiller import StudentCalculator, predict_forces
from mlff_distiller.ase_compat import maxwell_boltzmann


def test_properties_match_predict(model):
    atoms = molecule("CH3CH2OH")
    atoms.calc = StudentCalculator(model, device="cpu", precision="fp64")
    ref = predict_forces(model, [atoms], precision="fp64")[0]
    assert atoms.get_potential_energy() == pytest.approx(ref["energy"], abs=1e-12)
    assert atoms.get_potential_energy(force_consistent=True) == pytest.approx(ref["energy"], abs=1e-12)
    np.testing.assert_allclose(atoms.get_forces(), ref["forces"], atol=1e-12)
    np.testing.assert_allclose(atoms.get_potential_energies().sum(), ref["energy"], atol=1e-10)


def test_stress_periodic_only(model):
    cell = silicon_cell()
    cell.calc = StudentCalculator(model, device="cpu", precision="fp64")
    assert cell.get_stress().shape == (6,)
    assert cell.get_stress(voigt=False).shape == (3, 3)
    mol = molecule("H2O")
    mol.calc = StudentCalculator(model, device="cpu")
    with pytest.raises(PropertyNotImplementedError, match="fully periodic"):
        mol.get_stress()


def test_accepts_checkpoint_path(tmp_path, model):
    model.save(tmp_path / "m.pt")
    atoms = molecule("H2O")
    atoms.calc = StudentCalculator(str(tmp_path / "m.pt"), device="cpu")
    assert np.isfinite(atoms.get_potential_energy())


def test_nve_conserves_energy(model):
    atoms = molecule("CH3CH2OH")
    atoms.calc = StudentCalculator(model, device="cpu", precision="fp64")
    maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(0))
    e0 = atoms.get_total_energy()
    energies = []
    dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
    dyn.attach(lambda: energies.append(atoms.get_total_energy()), interval=10)
    dyn.run(200)
    drift = np.abs(np.array(energies) - e0).max() / len(atoms)
    assert drift < 1e-4, drift
    assert atoms.get_kinetic_energy() > 0


def test_langevin_and_optimisers_run(model):
    atoms = molecule("CH4")
    atoms.calc = StudentCalculator(model, device="cpu")
    Langevin(atoms, 0.5 * units.fs, temperature_K=300, friction=0.02, fixcm=False, rng=np.random.default_rng(1)).run(20)
    assert np.isfinite(atoms.get_positions()).all()
    for opt in (BFGS, FIRE):
        a = molecule("H2O")
        a.rattle(0.05, seed=2)
        a.calc = StudentCalculator(model, device="cpu", precision="fp64")
        f0 = np.abs(a.get_forces()).max()
        opt(a, logfile=None).run(fmax=0.05, steps=300)
        assert np.abs(a.get_forces()).max() < min(0.05, f0) + 1e-12


def test_verlet_skin_md_matches_fresh_list(model):
    """MD with the skin list (the calculator's default) gives the same forces as a fresh list every step."""
    from ase.md.verlet import VelocityVerlet

    atoms = silicon_cell(rattle=0.05)
    atoms.calc = StudentCalculator(model, device="cpu", precision="fp64", skin=0.5)
    maxwell_boltzmann(atoms, 1500, rng=np.random.default_rng(3))
    fresh = StudentCalculator(model, device="cpu", precision="fp64", skin=None)
    dyn = VelocityVerlet(atoms, 2.0 * units.fs)
    for _ in range(15):
        dyn.run(4)
        probe = atoms.copy()
        probe.calc = fresh
        np.testing.assert_allclose(atoms.get_forces(), probe.get_forces(), rtol=0, atol=1e-12)
        assert atoms.get_potential_energy() == pytest.approx(probe.get_potential_energy(), abs=1e-12)
    verlet = atoms.calc.engine.verlet
    assert verlet is not None and fresh.engine.verlet is None
    assert 1 <= verlet.n_builds < verlet.n_calls


def _same_as_a_copy(stored, atoms, ref=None):
    """``stored`` equals ``ref`` (default ``atoms.copy()``) in everything a copy carries, and shares no memory
    with ``atoms``."""
    ref = atoms.copy() if ref is None else ref
    assert stored is not atoms and type(stored) is type(ref)
    assert stored.arrays.keys() == ref.arrays.keys()
    for k, a in ref.arrays.items():
        b = stored.arrays[k]
        assert b.dtype == a.dtype and np.array_equal(b, a), k
        assert not np.shares_memory(b, atoms.arrays[k]), k
    np.testing.assert_array_equal(stored.cell.array, ref.cell.array)
    np.testing.assert_array_equal(stored.pbc, ref.pbc)
    np.testing.assert_array_equal(stored.get_celldisp(), ref.get_celldisp())
    assert stored.info == ref.info and stored.info is not atoms.info
    assert len(stored.constraints) == len(ref.constraints)


def test_calculator_atoms_stay_a_private_copy_in_md(model):
    """In MD the calculator refreshes its stored copy in place instead of ASE's ``atoms.copy()``: after every
    step ``calc.atoms`` is what a copy would be, changes of the caller's atoms are still seen (and trigger a
    calculation), and get_atoms / reset / other changes behave as with ASE's own path."""
    atoms = molecule("CH3CH2OH")
    atoms.info["tag"] = 1
    maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(1))
    calc = StudentCalculator(model, device="cpu", precision="fp64", skin=0.5)
    atoms.calc = calc
    calls = []
    original = calc.calculate

    def counting(atoms_arg, *args, **kwargs):
        calls.append(atoms_arg.copy())  # what ASE's Calculator.calculate would store
        original(atoms_arg, *args, **kwargs)
        _same_as_a_copy(calc.atoms, atoms_arg, calls[-1])

    calc.calculate = counting
    dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
    dyn.run(1)
    stored = calc.atoms
    snapshot = calc.get_atoms()
    for _ in range(4):
        dyn.run(1)  # the momenta change after the calculation: the stored copy keeps those it was given
        assert not np.array_equal(calc.atoms.get_momenta(), atoms.get_momenta())
        np.testing.assert_array_equal(calc.atoms.get_momenta(), calls[-1].get_momenta())
    assert calc.atoms is stored, "positions-only steps refresh the same private copy"
    assert not np.array_equal(snapshot.positions, atoms.positions), "get_atoms() copies stay as they were"
    n = len(calls)
    atoms.get_forces()
    assert len(calls) == n and calc.check_state(atoms) == []
    # the caller's atoms are not the stored copy: editing them is a change, seen by check_state
    atoms.positions[0, 0] += 1e-9
    assert calc.check_state(atoms) == ["positions"]
    atoms.get_forces()
    assert len(calls) == n + 1 and calc.atoms is stored
    _same_as_a_copy(calc.atoms, atoms)
    atoms.info["tag"] = 2  # info is not a system change; the next calculation's copy carries the new one
    atoms.positions[1, 1] += 1e-3
    atoms.get_forces()
    assert calc.atoms.info == {"tag": 2}
    # other changes take ASE's own path: a fresh copy
    atoms.set_initial_charges(np.full(len(atoms), 0.1))
    atoms.get_forces()
    assert calc.atoms is not stored
    _same_as_a_copy(calc.atoms, atoms)
    # reset: nothing stored, the next request recalculates and stores a fresh copy
    calc.reset()
    assert calc.atoms is None
    n = len(calls)
    f = atoms.get_forces()
    assert len(calls) == n + 1 and calc.atoms is not None
    _same_as_a_copy(calc.atoms, atoms)
    check = atoms.copy()
    check.calc = StudentCalculator(model, device="cpu", precision="fp64", skin=None)
    np.testing.assert_allclose(f, check.get_forces(), atol=1e-10)


def test_calculator_atoms_with_constraints_or_new_arrays_take_the_ase_path(model):
    """Constraints ride along on the in-place refresh (deep copies, as atoms.copy() makes: a constraint changed or
    replaced by the caller is seen at the next calculation); a new array takes ASE's own path."""
    from ase.constraints import FixAtoms, FixCom

    atoms = molecule("H2O")
    atoms.set_constraint(FixAtoms(indices=[0]))
    calc = StudentCalculator(model, device="cpu", precision="fp64")
    atoms.calc = calc
    atoms.get_forces()
    first = calc.atoms
    atoms.positions[1, 0] += 0.01
    atoms.get_forces()
    assert calc.atoms is first and len(calc.atoms.constraints) == 1
    assert calc.atoms.constraints[0] is not atoms.constraints[0]
    _same_as_a_copy(calc.atoms, atoms)
    np.testing.assert_array_equal(calc.atoms.constraints[0].index, [0])
    atoms.constraints[0].index[0] = 2  # changed in place by the caller: the next copy carries the change
    atoms.positions[1, 0] += 0.01
    atoms.get_forces()
    np.testing.assert_array_equal(calc.atoms.constraints[0].index, [2])
    atoms.set_constraint([FixCom(), FixAtoms(indices=[1])])
    atoms.positions[1, 0] += 0.01
    atoms.get_forces()
    assert calc.atoms is first and [type(c) for c in calc.atoms.constraints] == [FixCom, FixAtoms]
    assert calc.atoms.constraints[1].todict() == atoms.constraints[1].todict()
    atoms.set_constraint()
    atoms.positions[1, 0] += 0.01
    atoms.get_forces()
    second = calc.atoms
    atoms.set_momenta(np.ones((3, 3)))  # a new array: a copy carries it
    atoms.positions[1, 0] += 0.01
    atoms.get_forces()
    assert calc.atoms is not second and "momenta" in calc.atoms.arrays
    _same_as_a_copy(calc.atoms, atoms)
    atoms.positions[1, 0] += 0.01
    atoms.get_forces()
    _same_as_a_copy(calc.atoms, atoms)


def test_check_state_matches_ase_compare_atoms(model):
    """check_state gives ASE's compare_atoms answer (the same changes; cell and pbc first, then the arrays sorted,
    where ASE's order follows a set) for each kind of change, also after
    its NaN memo has seen the NaN-free contents: equal arrays holding a NaN are still a change (NaN is never
    close to itself), in the positions and in the cell."""
    from ase.calculators.calculator import compare_atoms

    atoms = silicon_cell(rattle=0.05)
    calc = StudentCalculator(model, device="cpu", precision="fp64")
    atoms.calc = calc
    atoms.get_forces()
    stored = calc.atoms

    def same_as_ase(other, ignored=()):
        want = compare_atoms(calc.atoms, other, tol=1e-15, excluded_properties=set(ignored))
        got = calc.check_state(other)
        head = [p for p in ("cell", "pbc") if p in want]
        assert got == head + sorted(set(want) - set(head)) and len(got) == len(want)
        return got

    assert same_as_ase(atoms.copy()) == []
    assert same_as_ase(atoms.copy()) == []  # the memo knows these contents now
    edits = {
        "positions": lambda a: a.positions.__setitem__((0, 0), a.positions[0, 0] + 1e-9),
        "tiny": lambda a: a.positions.__setitem__((0, 0), a.positions[0, 0] + 1e-16 * abs(a.positions[0, 0])),
        "cell": lambda a: a.set_cell(a.cell.array * 1.001),
        "pbc": lambda a: a.set_pbc([True, True, False]),
        "numbers": lambda a: a.set_atomic_numbers([1] * len(a)),
        "charges": lambda a: a.set_initial_charges(np.full(len(a), 0.1)),
        "momenta": lambda a: a.set_momenta(np.ones((len(a), 3))),
    }
    answers = {}
    for name, edit in edits.items():
        other = atoms.copy()
        edit(other)
        answers[name] = same_as_ase(other)
    assert answers["positions"] == ["positions"] and answers["cell"] == ["cell"] and answers["pbc"] == ["pbc"]
    assert answers["numbers"] == ["numbers"] and answers["charges"] == ["initial_charges"]
    assert answers["tiny"] == [] and answers["momenta"] == []
    both = atoms.copy()
    both.set_cell(both.cell.array * 1.001)
    both.set_atomic_numbers([1] * len(both))
    both.positions[1, 2] += 1e-6
    assert same_as_ase(both) == ["cell", "numbers", "positions"]
    calc.ignored_changes = {"positions", "cell"}
    assert same_as_ase(both, calc.ignored_changes) == ["numbers"]
    calc.ignored_changes = set()
    # NaN in both (equal bytes): a change, as in ASE, though the memo holds the NaN-free contents of both names
    for name in ("positions", "cell"):
        nan = atoms.copy()
        own = calc.atoms = stored.copy()
        if name == "positions":
            nan.positions[1, 1] = own.positions[1, 1] = np.nan
        else:
            nan.cell.array[1, 1] = own.cell.array[1, 1] = np.nan
        assert same_as_ase(nan) == [name]
        assert same_as_ase(nan) == [name]
    calc.atoms = stored
    assert same_as_ase(atoms.copy()) == []


def test_check_state_answers_unchanged_atoms_from_the_stored_bytes(model, monkeypatch):
    """After a calculation, atoms holding exactly the stored copy's bytes get "no change" from the snapshot taken
    with the copy (what ASE asks twice more per MD step), without the general comparison; any difference (a
    position, the cell, pbc, numbers, an added array), a stored copy replaced by the caller or one holding NaN
    goes the general way, whose answer is ASE's."""
    from ase.calculators.calculator import compare_atoms

    from mlff_distiller import _atoms_state
    from mlff_distiller import calculator as calc_module

    atoms = silicon_cell(rattle=0.05)
    calc = StudentCalculator(model, device="cpu", precision="fp64")
    atoms.calc = calc
    atoms.get_forces()
    general = []
    real_close = calc_module._close
    counted = lambda *a, **k: general.append(1) or real_close(*a, **k)  # noqa: E731
    monkeypatch.setattr(calc_module, "_close", counted)  # check_state's general path
    monkeypatch.setattr(_atoms_state, "_close", counted)  # _changes_from's
    assert calc.check_state(atoms) == [] and calc.check_state(atoms.copy()) == [] and not general
    evals = calc._calculations
    for _ in range(2):  # what ASE's MD loop asks after a step: the cached forces, no new calculation
        atoms.get_forces(md=True)
    assert calc._calculations == evals and not general
    edits = [
        lambda a: a.positions.__setitem__((0, 0), a.positions[0, 0] + 1e-9),
        lambda a: a.positions.__setitem__((0, 0), a.positions[0, 0] + 1e-16 * abs(a.positions[0, 0])),
        lambda a: a.set_cell(a.cell.array * 1.001),
        lambda a: a.set_pbc([True, True, False]),
        lambda a: a.set_atomic_numbers([1] * len(a)),
        lambda a: a.set_initial_charges(np.full(len(a), 0.1)),
        lambda a: a.set_momenta(np.ones((len(a), 3))),
    ]
    for edit in edits:
        other = atoms.copy()
        edit(other)
        general.clear()
        got = calc.check_state(other)
        assert general, "a difference must go the general way"
        assert sorted(got) == sorted(compare_atoms(calc.atoms, other, tol=1e-15))
    # an MD step's first request (the positions moved): the positions alone go through _close, the other contents
    # (cell, pbc, numbers) are settled by their bytes
    other = atoms.copy()
    other.positions[1, 1] += 1e-3
    general.clear()
    assert calc.check_state(other) == ["positions"] and len(general) == 1
    other.set_cell(other.cell.array * 1.001)
    general.clear()
    assert calc.check_state(other) == ["cell", "positions"] and len(general) == 2
    # the stored copy replaced (ASE's reset, a caller's assignment): the snapshot no longer speaks for it
    calc.atoms = calc.atoms.copy()
    calc.atoms.positions[0, 0] += 1.0
    general.clear()
    assert calc.check_state(atoms) == ["positions"] and general
    # contents with a NaN get no snapshot: equal bytes holding NaN are a change, as in ASE
    nan = atoms.copy()
    nan.positions[1, 1] = np.nan
    assert calc_module._snapshot(nan, {}) is None
    assert calc_module._snapshot(atoms, {})[0] is atoms
    # the class switch off: the general comparison every time (the probes time the two)
    calc.atoms.positions[0, 0] -= 1.0
    atoms.get_forces()
    monkeypatch.setattr(StudentCalculator, "snapshot_check", False)
    general.clear()
    assert calc.check_state(atoms) == [] and general


def test_md_batch_positions_cast_and_checked_like_a_fresh_batch(model):
    """The MD batch (previous batch, new positions) holds what AtomsBatch.from_atoms would: the positions cast to
    the engine's dtype (float32: round to nearest, from the first batch's origin, which a fresh batch would take from
    the moved first atom), the same other tensors; non-finite positions fail as in a fresh batch, finite ones
    whose sum overflows do not (in float32 they take the full way: float64 positions, AtomsBatch.positions64)."""
    import torch

    from mlff_distiller.batch import AtomsBatch

    for precision, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
        atoms = molecule("CH3CH2OH")
        calc = StudentCalculator(model, device="cpu", precision=precision)
        atoms.calc = calc
        atoms.get_forces()
        first = calc._last_batch
        rng = np.random.default_rng(3)
        atoms.positions = atoms.positions + rng.normal(0, 0.1, atoms.positions.shape) / 3.0
        atoms.get_forces()
        batch = calc._last_batch
        fresh = AtomsBatch.from_atoms(atoms, dtype=dtype)
        assert batch is not first and batch.numbers is first.numbers and batch.cell is first.cell
        assert batch.origin is first.origin and (first.origin is None) == (dtype == torch.float64)
        want = atoms.positions if first.origin is None else atoms.positions - first.origin.numpy()
        assert batch.positions.dtype == dtype and torch.equal(batch.positions, torch.from_numpy(want).to(dtype))
        if first.origin is None:
            assert torch.equal(batch.positions, fresh.positions)
        np.testing.assert_allclose(batch.to_atoms()[0].positions, fresh.to_atoms()[0].positions, rtol=0, atol=1e-6)
        calc.atoms.positions[0, 0] = 1e308  # finite; the sum overflows
        calc.atoms.positions[1, 0] = 1e308
        moved = calc._batch(["positions"], calc.atoms)
        if dtype == torch.float64:
            assert moved.positions[0, 0].item() == 1e308
        else:  # coordinates beyond PRECISE_PAIRS_FROM: the full way, which keeps them in float64
            fresh = AtomsBatch.from_atoms(calc.atoms, dtype=dtype)
            assert moved.positions64 is not None and torch.equal(moved.positions64, fresh.positions64)
        for bad in (np.nan, np.inf):
            calc.atoms.positions[2, 1] = bad
            with pytest.raises(ValueError, match="non-finite position"):
                calc._batch(["positions"], calc.atoms)
            calc.atoms.positions[2, 1] = 0.0


def test_md_steps_make_a_new_calculator_directory(model, tmp_path):
    """Positions-only steps create the calculator's directory as ASE's Calculator.calculate does, also one set
    after the first steps."""
    atoms = molecule("H2O")
    calc = StudentCalculator(model, device="cpu", precision="fp64", directory=str(tmp_path / "a"))
    atoms.calc = calc
    dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
    dyn.run(2)
    assert (tmp_path / "a").is_dir()
    calc.directory = str(tmp_path / "b")
    dyn.run(1)
    assert (tmp_path / "b").is_dir()


def test_cell_relaxation_padded_stress_equals_eager(model):
    """A variable-cell relaxation (ASE's FrechetCellFilter + BFGS) through the padded stress step takes the same
    path as through the eager one: same steps, volume and energy (fp64)."""
    import warnings

    from ase.filters import FrechetCellFilter

    results = []
    for mode in ("cudagraph", "eager"):  # cudagraph on a CPU: the padded eager path
        atoms = silicon_cell().repeat((2, 1, 1))
        atoms.rattle(0.05, seed=1)
        atoms.set_cell(atoms.cell * 1.03, scale_atoms=True)
        atoms.calc = StudentCalculator(model, device="cpu", precision="fp64", mode=mode)
        cell_filter = FrechetCellFilter(atoms)
        g0 = np.abs(cell_filter.get_forces()).max()
        opt = BFGS(cell_filter, logfile=None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert opt.run(fmax=2e-4, steps=300)
        assert np.abs(cell_filter.get_forces()).max() < min(2e-4, g0)
        results.append((opt.nsteps, atoms.get_volume(), atoms.get_potential_energy()))
    (n_pad, v_pad, e_pad), (n_eager, v_eager, e_eager) = results
    assert n_pad == n_eager > 5
    assert v_pad == pytest.approx(v_eager, rel=1e-9) and e_pad == pytest.approx(e_eager, abs=1e-9)


def test_maxwell_boltzmann_draws_like_ase_and_does_not_warn():
    """``ase_compat.maxwell_boltzmann`` gives the momenta of ASE's own draw for the same seed, without the
    deprecation warning ASE 3.29 gives for ``MaxwellBoltzmannDistribution``."""
    import warnings

    from ase.md import velocitydistribution

    from mlff_distiller.ase_compat import maxwell_boltzmann

    a, b = molecule("C6H6"), molecule("C6H6")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        maxwell_boltzmann(a, 450.0, rng=np.random.default_rng(7))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        velocitydistribution.MaxwellBoltzmannDistribution(b, temperature_K=450.0, rng=np.random.default_rng(7))
    assert np.abs(a.get_momenta()).max() > 0
    np.testing.assert_array_equal(a.get_momenta(), b.get_momenta())


def test_maxwell_boltzmann_before_ase_3_29(monkeypatch):
    """Without ``thermalize_momenta`` (ASE < 3.29) the helper calls ``MaxwellBoltzmannDistribution``."""
    from ase.md import velocitydistribution

    from mlff_distiller.ase_compat import maxwell_boltzmann

    calls = []
    monkeypatch.delattr(velocitydistribution, "thermalize_momenta")
    monkeypatch.setattr(velocitydistribution, "MaxwellBoltzmannDistribution", lambda *a, **k: calls.append((a, k)))
    atoms, rng = molecule("H2O"), np.random.default_rng(1)
    maxwell_boltzmann(atoms, 300.0, rng=rng)
    assert calls == [((atoms,), {"temperature_K": 300.0, "rng": rng})]


def test_a_force_beyond_the_limit_warns_once(model, monkeypatch):
    """A force component above domain.FORCE_LIMIT (a collision the student cannot describe; every number finite)
    warns with an OutOfDomainWarning on that calculation, once per calculator; check_domain=None: no warning."""
    import warnings

    import mlff_distiller.domain as domain
    from mlff_distiller.domain import OutOfDomainWarning

    atoms = molecule("H2O")
    calc = StudentCalculator(model, device="cpu")
    atoms.calc = calc
    peak = np.abs(atoms.get_forces()).max()
    monkeypatch.setattr(domain, "FORCE_LIMIT", float(peak) * 0.9)
    atoms.positions[0, 0] += 0.01
    with pytest.warns(OutOfDomainWarning, match=r"an atom felt a force of .* eV/Å in calculation 2"):
        atoms.get_forces()
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutOfDomainWarning)
        atoms.positions[0, 0] += 0.01
        atoms.get_forces()  # once per calculator
        quiet = molecule("H2O")
        quiet.calc = StudentCalculator(model, device="cpu", check_domain=None)
        quiet.get_forces()
        monkeypatch.setattr(domain, "FORCE_LIMIT", float(peak) * 10)
        fresh = molecule("H2O")
        fresh.calc = StudentCalculator(model, device="cpu")
        fresh.get_forces()  # below the limit: silent


@pytest.mark.parametrize("precision", ["fp32", "fp64"])
def test_md_batch_never_aliases_the_callers_arrays(model, precision):
    """The calculator builds an MD step's batch from the caller's atoms (its own copy of them is made while the
    engine computes), so the batch copies the positions and an NPT step's cell: changing the caller's arrays in
    place afterwards (as ASE's integrators and barostats do) leaves the batch and the stored copy as they were."""
    import torch
    from ase.build import bulk

    atoms = bulk("Si", "diamond", a=5.43, cubic=True)
    atoms.rattle(0.01, seed=1)
    calc = StudentCalculator(model, device="cpu", precision=precision)
    atoms.calc = calc
    atoms.get_forces()
    atoms.positions += 0.01  # positions only: the MD path
    atoms.get_forces()
    batch = calc._last_batch
    atoms.set_cell(atoms.cell.array * 1.001, scale_atoms=True)  # cell and positions: the NPT path
    atoms.get_forces()
    npt = calc._last_batch
    kept = [t.clone() for t in (batch.positions, npt.positions, npt.cell)]
    stored = calc.atoms.positions.copy(), calc.atoms.cell.array.copy()
    np.testing.assert_array_equal(stored[0], atoms.positions)  # the stored copy is the caller's state
    atoms.positions[:] += 1.0  # in place, as set_positions writes
    atoms.cell.array[:] *= 1.01
    for was, now in zip(kept, (batch.positions, npt.positions, npt.cell), strict=True):
        assert torch.equal(was, now)
    np.testing.assert_array_equal(calc.atoms.positions, stored[0])
    np.testing.assert_array_equal(calc.atoms.cell.array, stored[1])


def test_atoms_stored_before_or_during_the_step_give_the_same_md(model):
    """``store_while_running`` False (the copy of the atoms before the engine call, ASE's order) and True (during
    the engine's step) give the same trajectory, bit for bit (fp64)."""
    runs = []
    for during in (False, True):
        StudentCalculator.store_while_running = during
        try:
            atoms = molecule("CH3CH2OH")
            atoms.calc = StudentCalculator(model, device="cpu", precision="fp64")
            VelocityVerlet(atoms, timestep=1.0 * units.fs).run(20)
            runs.append((atoms.positions.copy(), atoms.get_forces(), atoms.calc.atoms.positions.copy()))
        finally:
            StudentCalculator.store_while_running = True
    for a, b in zip(*runs, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(runs[1][0], runs[1][2])  # the stored copy holds the last positions
