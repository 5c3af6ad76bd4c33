"""Stress errors in the evaluation, where the teacher labels carry a stress (periodic frames)."""

import numpy as np
import pytest
import torch
from ase.build import bulk, molecule
from ase.calculators.emt import EMT
from ase.calculators.singlepoint import SinglePointCalculator

from mlff_distiller import StudentModel, predict_forces
from mlff_distiller.distill import error_metrics, predict_frames


def _labelled(atoms, stress=True):
    atoms.calc = EMT()
    results = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
    if stress:
        results["stress"] = atoms.get_stress()
    out = atoms.copy()
    out.calc = SinglePointCalculator(out, **results)
    return out


def _frames():
    frames = []
    for k, scale in enumerate((0.98, 1.0, 1.03)):
        a = bulk("Cu", "fcc", a=3.6 * scale, cubic=True).repeat((2, 1, 1))
        a.rattle(0.05, seed=k)
        frames.append(_labelled(a))
    frames.append(_labelled(molecule("CH4"), stress=False))  # a molecule: no stress label, none asked for
    return frames


def test_stress_errors_where_the_teacher_has_stress():
    torch.manual_seed(0)
    model = StudentModel(species=[1, 6, 29], hidden=16, layers=1).double()
    frames = _frames()
    preds = predict_frames(model, frames, device="cpu")
    assert all("stress" in p for p in preds[:3]) and "stress" not in preds[3]
    m = error_metrics(frames, preds)
    assert m["stress_frames"] == 3
    direct = predict_forces(model, frames[:3], device="cpu", precision="fp64", stress=True)
    ds = np.stack([p["stress"] - a.calc.results["stress"] for p, a in zip(direct, frames, strict=False)])
    assert m["stress_mae_mev_a3"] == pytest.approx(1000 * np.abs(ds).mean(), rel=1e-9)
    assert m["stress_rmse_mev_a3"] == pytest.approx(1000 * np.sqrt((ds**2).mean()), rel=1e-9)
    assert m["stress_mae_gpa"] == pytest.approx(np.abs(ds).mean() * 160.21766, rel=1e-5)
    assert m["stress_mae_mev_a3"] > 0


def test_no_stress_keys_without_teacher_stress():
    torch.manual_seed(0)
    model = StudentModel(species=[1, 6, 29], hidden=16, layers=1).double()
    frames = [_labelled(bulk("Cu", "fcc", a=3.6, cubic=True), stress=False), _labelled(molecule("CH4"), False)]
    preds = predict_frames(model, frames, device="cpu")
    assert all("stress" not in p for p in preds)
    assert "stress_mae_mev_a3" not in error_metrics(frames, preds)


def test_labelling_records_the_teachers_stress_for_periodic_frames(tmp_path):
    """A teacher that computes stress with the forces (EMT here; SevenNet, tblite too): periodic frames keep it
    through the database and the extxyz, with no extra teacher call; molecules get none."""
    import ase.io

    from mlff_distiller.distill import SamplingConfig, label, read_frames

    cell = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 1, 1))
    cfg = SamplingConfig(temperatures=[300], md_steps=8, sample_every=4, rattle_per_seed=2, dedup_rms=0.0)
    report = label([cell, molecule("CH4")], "emt", tmp_path / "lab", cfg, progress=False)
    frames = read_frames(tmp_path / "lab")
    assert report.total == len(frames) > 4
    periodic = [a for a in frames if a.pbc.all()]
    assert periodic and all("stress" not in a.calc.results for a in frames if not a.pbc.any())
    for a in periodic:
        check = a.copy()
        check.calc = EMT()
        np.testing.assert_allclose(a.calc.results["stress"], check.get_stress(), atol=1e-10)
    xyz = [a for a in ase.io.read(tmp_path / "lab" / "frames.extxyz", index=":") if a.pbc.all()]
    assert len(xyz) == len(periodic) and all(a.calc is not None and "stress" in a.calc.results for a in xyz)
    torch.manual_seed(0)
    model = StudentModel(species=[1, 6, 29], hidden=16, layers=1).double()
    m = error_metrics(frames, predict_frames(model, frames, device="cpu"))
    assert m["stress_frames"] == len(periodic)
