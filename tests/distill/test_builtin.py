"""The shipped students ``builtin:chno-gfn2`` (128 features x 3 layers) and ``builtin:chno-gfn2-small`` (64 x 3, the
default student since stop 85: ``mlff_distiller.DEFAULT_MODEL``)."""

import numpy as np
import pytest
from ase.build import molecule

from mlff_distiller import builtin_models, load_model, predict_forces

# name -> (hidden, layers, held-out force MAE recorded in its metadata, meV/Å; benchmarks/results/builtin_chno_gfn2*)
# (stop 85 retrained the 64 x 3 student: 19.46 before; benchmarks/results/stop85_gpu/)
BUILTINS = {"chno-gfn2": (128, 3, 18.75), "chno-gfn2-small": (64, 3, 18.29)}


def test_the_default_student_is_the_64_wide_one():
    from mlff_distiller import DEFAULT_MODEL
    from mlff_distiller.cli_jobs import EvaluateJob, MDJob, PredictJob, RelaxJob

    assert DEFAULT_MODEL == "builtin:chno-gfn2-small"
    assert DEFAULT_MODEL.split(":", 1)[1] in builtin_models()
    assert {job().model for job in (EvaluateJob, MDJob, PredictJob, RelaxJob)} == {DEFAULT_MODEL}
    # It is the more accurate of the two shipped students in force MAE and RMSE on the same held-out frames.
    small, wide = load_model(DEFAULT_MODEL).metadata, load_model("builtin:chno-gfn2").metadata
    assert small["test_force_mae_mev_a"] < wide["test_force_mae_mev_a"]
    assert small["test_force_rmse_mev_a"] < wide["test_force_rmse_mev_a"]


def test_builtin_models_lists_both_students():
    assert set(BUILTINS) <= set(builtin_models())


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_loads_with_measured_metadata(name):
    hidden, layers, mae = BUILTINS[name]
    model = load_model(f"builtin:{name}")
    assert model.species_list == [1, 6, 7, 8]
    assert (model.config.hidden, model.config.layers) == (hidden, layers)
    meta = model.metadata
    assert meta["teacher"] == "gfn2-xtb"
    for key in ("test_force_mae_mev_a", "test_energy_mae_mev_atom", "test_frames", "recipe"):
        assert key in meta
    assert meta["test_frames"] == 1830
    assert meta["test_force_mae_mev_a"] == pytest.approx(mae, abs=0.01)  # the checkpoint the docs describe
    assert meta["test_energy_mae_mev_atom"] < 5.0  # issue 6's energy target


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_students_are_on_the_tf32_grid(name):
    """Both shipped students have every Linear weight on the TF32 grid (two TF32 MMAs per weight product in fp32 on
    a GPU), with their errors as trained kept beside the rounded ones, which differ from them by a few thousandths
    of a meV/Å: the 128 x 3 student was rounded at stop 59 (its held-out errors both ways,
    benchmarks/results/stop59_cpu/eval_tf32_grid.json), the 64 x 3 one by its trainer at stop 85 (the validation
    frames both ways, TrainConfig.tf32_grid)."""
    model = load_model(f"builtin:{name}")
    meta = model.metadata
    assert model.on_tf32_grid() and meta["tf32_grid"] is True
    if "as_trained_test" in meta:
        before, after = meta["as_trained_test"]["test_force_mae_mev_a"], meta["test_force_mae_mev_a"]
    else:
        before, after = meta["val"]["force_mae_mev_a"], meta["val_tf32_grid"]["force_mae_mev_a"]
    assert before != after and abs(after - before) < 0.01
    assert model.round_weights_tf32() == 0  # nothing left to round


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_agrees_with_gfn2_on_rattled_molecules(name):
    tblite_ase = pytest.importorskip("tblite.ase")
    structures = []
    for k, formula in enumerate(("CH3CH2OH", "CH3CONH2", "C5H5N")):
        a = molecule(formula)
        a.rattle(0.05, seed=k)
        structures.append(a)
    preds = predict_forces(f"builtin:{name}", structures, device="cpu", precision="fp64")
    errors = []
    for a, p in zip(structures, preds, strict=True):
        ref = a.copy()
        ref.calc = tblite_ase.TBLite(method="GFN2-xTB", verbosity=0)
        errors.append(np.abs(p["forces"] - ref.get_forces()).ravel())
    # Held-out MAE: 18.8 (chno-gfn2) and 18.3 meV/Å (small, stop 85; 19.5 before). On these three rattled molecules
    # they measure 43 and 33 meV/Å (the stop-22 small one: 39; pyridine 72 and 51: a uniform 0.05 Å rattle of a
    # ring is off the sampled distribution); 60 catches a broken or swapped checkpoint (the chno-gfn2 checkpoint
    # before the current one gave 64 here). Energies: at most 0.9 and 2.0 meV/atom.
    err = np.concatenate(errors).mean()
    assert err < 0.060, f"builtin:{name} force MAE {1e3 * err:.1f} meV/Å vs GFN2-xTB"
    # Energies too, absolute (no per-molecule offset allowed): the issue's ≤ 5 meV/atom; measured ≤ 2.0 here.
    for a, p in zip(structures, preds, strict=True):
        ref = a.copy()
        ref.calc = tblite_ase.TBLite(method="GFN2-xTB", verbosity=0)
        assert abs(p["energy"] - ref.get_potential_energy()) / len(a) < 0.005, a.get_chemical_formula()
