"""StudentCalculator inside ASE: properties, MD, optimisers, errors."""

import numpy as np
import pytest
from ase import units
from ase.build import molecule
from ase.calculators.calculator import PropertyNotImplementedError
from ase.md.langevin import Langevin
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
from ase.md.verlet import VelocityVerlet
from ase.optimize import BFGS, FIRE
from helpers import silicon_cell

from mlff_distiller import StudentCalculator, predict_forces


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
    MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(0))
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
    Langevin(atoms, 0.5 * units.fs, temperature_K=300, friction=0.02, rng=np.random.default_rng(1)).run(20)
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
    MaxwellBoltzmannDistribution(atoms, temperature_K=1500, rng=np.random.default_rng(3))
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
