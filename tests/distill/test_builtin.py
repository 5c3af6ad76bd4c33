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
    # Held-out MAE of this student is ~41 meV/Å (benchmarks/results/builtin_chno_gfn2.md); allow margin.
    assert np.concatenate(errors).mean() < 0.1
