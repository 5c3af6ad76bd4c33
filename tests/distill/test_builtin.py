"""The shipped student ``builtin:chno-gfn2``."""

import numpy as np
import pytest
from ase.build import molecule

from mlff_distiller import builtin_models, load_model, predict_forces


def test_builtin_chno_gfn2_loads_with_measured_metadata():
    assert "chno-gfn2" in builtin_models()
    model = load_model("builtin:chno-gfn2")
    assert model.species_list == [1, 6, 7, 8]
    meta = model.metadata
    assert meta["teacher"] == "gfn2-xtb"
    for key in ("test_force_mae_mev_a", "test_energy_mae_mev_atom", "test_frames", "recipe"):
        assert key in meta
    assert 0 < meta["test_force_mae_mev_a"] < 100


def test_builtin_chno_gfn2_agrees_with_gfn2_on_rattled_molecules():
    tblite_ase = pytest.importorskip("tblite.ase")
    structures = []
    for k, name in enumerate(("CH3CH2OH", "CH3CONH2", "C5H5N")):
        a = molecule(name)
        a.rattle(0.05, seed=k)
        structures.append(a)
    preds = predict_forces("builtin:chno-gfn2", structures, device="cpu", precision="fp64")
    errors = []
    for a, p in zip(structures, preds, strict=True):
        ref = a.copy()
        ref.calc = tblite_ase.TBLite(method="GFN2-xTB", verbosity=0)
        errors.append(np.abs(p["forces"] - ref.get_forces()).ravel())
    # Held-out MAE of this student is 18.8 meV/Å (benchmarks/results/builtin_chno_gfn2.md). On these three
    # rattled molecules it measures 43 meV/Å (pyridine 72: a uniform 0.05 Å rattle of a ring is off the
    # sampled distribution); 60 catches a broken or swapped checkpoint (the previous one gave 64 here).
    err = np.concatenate(errors).mean()
    assert err < 0.060, f"builtin student force MAE {1e3 * err:.1f} meV/Å vs GFN2-xTB"
    # Energies too, absolute (no per-molecule offset allowed): the issue's ≤ 5 meV/atom; measured ≤ 1 here.
    for a, p in zip(structures, preds, strict=True):
        ref = a.copy()
        ref.calc = tblite_ase.TBLite(method="GFN2-xTB", verbosity=0)
        assert abs(p["energy"] - ref.get_potential_energy()) / len(a) < 0.005, a.get_chemical_formula()
