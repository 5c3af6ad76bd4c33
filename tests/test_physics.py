"""Physics of the student through the engine: forces, stress, symmetry, locality, extensivity, smoothness."""

import numpy as np
import pytest
from ase import Atoms
from ase.build import molecule
from helpers import benzene, random_molecule, silicon_cell, triclinic_cu

from mlff_distiller import predict_forces
from mlff_distiller.testing import (
    finite_difference_forces_error,
    finite_difference_stress_error,
    symmetry_errors,
)


def test_forces_match_finite_differences_molecule(model, device):
    atoms = molecule("CH3CH2OH")
    atoms.rattle(0.05, seed=3)
    assert finite_difference_forces_error(model, atoms, device=device) < 1e-6


def test_forces_match_finite_differences_periodic(model, device):
    for atoms in (silicon_cell(), triclinic_cu()):
        assert finite_difference_forces_error(model, atoms, device=device) < 1e-6


@pytest.mark.parametrize("make", [silicon_cell, triclinic_cu])
def test_stress_matches_strain_finite_differences(model, device, make):
    atoms = make()
    err = finite_difference_stress_error(model, atoms, device=device)
    stress = predict_forces(model, [atoms], precision="fp64", device=device, stress=True)[0]["stress"]
    assert np.abs(stress).max() > 1e-4  # the check is not vacuous
    assert err < 1e-7


@pytest.mark.parametrize("make", [benzene, silicon_cell])
def test_invariance_and_equivariance(model, device, make):
    errs = symmetry_errors(model, make(), seed=5, device=device)
    assert errs["rotation_energy"] < 1e-9 and errs["permutation_energy"] < 1e-9
    assert errs["rotation_forces"] < 1e-9 and errs["permutation_forces"] < 1e-9


def test_batch_equals_single(model, device):
    rng = np.random.default_rng(7)
    mols = [random_molecule(int(n), rng) for n in rng.integers(1, 31, size=12)]
    mols[0] = random_molecule(1, rng)
    mols.append(silicon_cell())
    batched = predict_forces(model, mols, precision="fp64", device=device, batch_size=len(mols))
    for atoms, row in zip(mols, batched, strict=True):
        single = predict_forces(model, [atoms], precision="fp64", device=device)[0]
        assert abs(single["energy"] - row["energy"]) < 1e-10
        np.testing.assert_allclose(row["forces"], single["forces"], atol=1e-10)


def test_far_apart_molecules_are_additive(model, device):
    a, b = molecule("H2O"), molecule("CH4")
    b.translate([20.0, 0, 0])
    both = a + b
    ra, rb, rab = predict_forces(model, [a, b, both], precision="fp64", device=device)
    assert abs(rab["energy"] - (ra["energy"] + rb["energy"])) < 1e-10
    np.testing.assert_allclose(rab["forces"], np.vstack([ra["forces"], rb["forces"]]), atol=1e-10)


@pytest.mark.parametrize("envelope", ["cosine", "polynomial"])
def test_energy_continuous_across_cutoff(device, envelope):
    from helpers import make_model

    model = make_model(envelope=envelope)
    rc = model.cutoff
    dists = rc + np.linspace(-1e-3, 1e-3, 21)
    dimers = [Atoms("CO", positions=[[0, 0, 0], [d, 0, 0]]) for d in dists]
    res = predict_forces(model, dimers, precision="fp64", device=device)
    e = np.array([r["energy"] for r in res])
    assert np.abs(np.diff(e)).max() < 1e-6
    beyond = [r for r, d in zip(res, dists, strict=True) if d >= rc]
    assert all(np.abs(r["forces"]).max() == 0.0 for r in beyond)
    # The pair does interact inside the cutoff.
    inside = predict_forces(model, [Atoms("CO", positions=[[0, 0, 0], [rc - 1.0, 0, 0]])], precision="fp64")[0]
    assert np.abs(inside["forces"]).max() > 1e-6


def test_supercell_extensivity_small_cell(model, device):
    atoms = triclinic_cu()
    big = atoms * (2, 2, 2)
    r1, r8 = predict_forces(model, [atoms, big], precision="fp64", device=device, stress=True)
    assert abs(r8["energy"] - 8 * r1["energy"]) < 1e-8 * max(1.0, abs(r8["energy"]))
    np.testing.assert_allclose(r8["forces"], np.tile(r1["forces"], (8, 1)), atol=1e-9)
    np.testing.assert_allclose(r8["stress"], r1["stress"], atol=1e-9)


def test_single_atom_reference_energy_and_zero_force(model, device):
    res = predict_forces(model, [Atoms("O", positions=[[0.1, 0.2, 0.3]])], precision="fp64", device=device)[0]
    np.testing.assert_array_equal(res["forces"], np.zeros((1, 3)))
    # With no neighbours the energy depends only on the species.
    other = predict_forces(model, [Atoms("O", positions=[[5.0, -2.0, 1.0]])], precision="fp64", device=device)[0]
    assert res["energy"] == pytest.approx(other["energy"], abs=1e-12)


def test_coincident_atoms_give_finite_results(model, device):
    atoms = Atoms("CH2", positions=[[0, 0, 0], [0, 0, 0], [1.0, 0, 0]])
    res = predict_forces(model, [atoms], precision="fp64", device=device)[0]
    assert np.isfinite(res["energy"]) and np.isfinite(res["forces"]).all()
    res32 = predict_forces(model, [atoms], precision="fp32", device=device)[0]
    assert np.isfinite(res32["energy"]) and np.isfinite(res32["forces"]).all()
