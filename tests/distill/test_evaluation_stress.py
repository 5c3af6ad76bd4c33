"""Stress errors in the evaluation, where the teacher labels carry a stress (periodic frames)."""

import itertools

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


def test_pressure_curve_finds_emt_coppers_equilibrium_and_bulk_modulus():
    """EMT copper: pressure falls with volume, the zero-pressure density is EMT's own equilibrium (where its
    stress vanishes, found by bisection on the lattice constant) and the bulk modulus is copper's (EMT: ~134 GPa,
    experiment 140)."""
    from ase.units import GPa

    from mlff_distiller.distill import pressure_curve

    def pressure(a):
        atoms = bulk("Cu", "fcc", a=a, cubic=True)
        atoms.calc = EMT()
        return -atoms.get_stress()[:3].mean() / GPa

    lo, hi = 3.4, 3.8
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if pressure(mid) > 0 else (lo, mid)
    a0 = 0.5 * (lo + hi)
    rho0 = 4 * 63.546 * 1.66053904 / a0**3
    frames = [bulk("Cu", "fcc", a=a0 * 1.01, cubic=True).repeat((2, 2, 2))]
    curve = pressure_curve(frames, {"emt": EMT(), "emt2": EMT()}, volume_ratios=(0.97, 0.99, 1.01, 1.03))
    p = curve["emt"]["pressure_gpa"]
    assert all(x > y for x, y in itertools.pairwise(p))  # compressed: higher pressure
    assert curve["emt"]["zero_pressure_density_g_cm3"] == pytest.approx(rho0, rel=2e-3)
    assert curve["emt"]["extrapolated"] is False
    assert 110 < curve["emt"]["bulk_modulus_gpa"] < 160
    assert curve["emt2"] == curve["emt"]
    with pytest.raises(ValueError, match="fully periodic"):
        pressure_curve([molecule("CH4")], {"emt": EMT()})


def test_pressure_error_in_the_metrics():
    torch.manual_seed(0)
    model = StudentModel(species=[1, 6, 29], hidden=16, layers=1).double()
    frames = _frames()[:3]
    preds = predict_frames(model, frames, device="cpu")
    m = error_metrics(frames, preds)
    dp = [np.mean(p["stress"][:3]) - np.mean(f.calc.results["stress"][:3]) for f, p in zip(frames, preds, strict=True)]
    assert m["pressure_mae_gpa"] == pytest.approx(np.abs(dp).mean() * 160.21766, rel=1e-5)
    assert m["pressure_mae_gpa"] > 0


def test_npt_run_relaxes_towards_the_zero_pressure_density():
    """EMT copper started 3 % expanded: the Berendsen barostat compresses it, the trace is finite and recorded
    every 5 steps, and a second run with the same seed repeats it (same start for a teacher and a student)."""
    from mlff_distiller.distill import npt_run

    atoms = bulk("Cu", "fcc", a=3.6 * 1.03, cubic=True).repeat((2, 2, 2))
    kw = dict(steps=40, timestep_fs=2.0, compressibility_per_bar=1e-5, taup_fs=100.0, record_every=5)
    out = npt_run(atoms, EMT(), **kw)
    assert len(out["density_g_cm3"]) == 9 and out["s_per_step"] > 0
    assert out["final_density"] > out["density_g_cm3"][0] * 1.01
    assert npt_run(atoms, EMT(), **kw)["density_g_cm3"] == out["density_g_cm3"]
    with pytest.raises(ValueError, match="fully periodic"):
        npt_run(molecule("CH4"), EMT(), steps=2)


def _water_box():
    """Eight water molecules in a 9 Å cube, one of them split across the cell boundary (wrapped)."""
    from ase import Atoms

    rng = np.random.default_rng(4)
    h2o = molecule("H2O")
    atoms = Atoms(cell=np.eye(3) * 9.0, pbc=True)
    for k, corner in enumerate(np.indices((2, 2, 2)).reshape(3, -1).T):
        m = h2o.copy()
        m.rotate(rng.uniform(0, 360), rng.normal(size=3), center="COM")
        m.translate(corner * 4.5 + 2.25 - m.get_center_of_mass())
        if k == 0:  # O just inside the cell, one H just outside it: wrapped back to the far side
            m = h2o.copy()
            m.positions = [[0.3, 2.25, 2.25], [-0.46, 2.84, 2.25], [1.06, 2.84, 2.25]]
        atoms += m
    atoms.wrap()
    return atoms


def test_rigid_molecule_scaling_keeps_bonds_and_scales_the_centres():
    """pressure_curve(molecules=True) scales a molecular liquid rigidly: every intramolecular distance (the
    wrapped molecule's too, by its bonded image) stays as it was, and the centres of mass scale with the cell;
    the default scaling stretches the bonds. Both give finite pressure curves that differ."""
    from ase.calculators.lj import LennardJones
    from ase.geometry import find_mic

    from mlff_distiller.distill import pressure_curve
    from mlff_distiller.distill.evaluation import _scaled_copy, _whole_molecules

    atoms = _water_box()
    apart = atoms.get_all_distances(mic=True)[np.repeat(np.arange(8), 3)[:, None] != np.repeat(np.arange(8), 3)]
    assert apart.min() > 1.8  # between molecules: beyond bonding range (O-O 1.58 Å), also after a 3 % compression
    labels, whole = _whole_molecules(atoms)
    assert labels.max() == 7 and np.bincount(labels).tolist() == [3] * 8
    assert np.abs(whole - atoms.positions).max() > 1.0  # the split molecule was made whole

    def bonds(a):
        lab, w = _whole_molecules(a)
        return np.array([np.linalg.norm(w[i] - w[j]) for i in range(len(a)) for j in range(i) if lab[i] == lab[j]])

    def centres(a):
        lab, w = _whole_molecules(a)
        m = a.get_masses()
        return np.array([(m[lab == k, None] * w[lab == k]).sum(0) / m[lab == k].sum() for k in range(8)])

    for f in (0.97, 1.04):
        rigid, affine = _scaled_copy(atoms, f, True), _scaled_copy(atoms, f, False)
        np.testing.assert_allclose(bonds(rigid), bonds(atoms), atol=1e-12)
        assert np.abs(bonds(affine) - f * bonds(atoms)).max() < 1e-12  # the default stretches the bonds
        _, d0 = find_mic(centres(atoms)[1:] - centres(atoms)[0], atoms.cell)  # lengths: half-cell ties have two signs
        _, d1 = find_mic(centres(rigid)[1:] - centres(rigid)[0], rigid.cell)
        np.testing.assert_allclose(d1, f * d0, atol=1e-10)
    calc = LennardJones(sigma=2.8, epsilon=0.01, rc=3.2, smooth=True)
    rigid = pressure_curve([atoms], {"lj": calc}, volume_ratios=(0.95, 1.0, 1.05), molecules=True)
    affine = pressure_curve([atoms], {"lj": calc}, volume_ratios=(0.95, 1.0, 1.05))
    assert rigid["molecules"] is True and np.isfinite(rigid["lj"]["pressure_gpa"]).all()
    assert rigid["lj"]["pressure_gpa"][1] == pytest.approx(affine["lj"]["pressure_gpa"][1])  # ratio 1: same frame
    assert rigid["lj"]["pressure_gpa"][0] != pytest.approx(affine["lj"]["pressure_gpa"][0], rel=1e-3)


def test_grouped_error_metrics_are_each_groups_own():
    """``grouped_error_metrics``: each group's numbers are :func:`error_metrics` of that group alone (one group's
    error does not leak into another's), frames without the key form "(none)", groups keep the order of first
    appearance, ``formula`` groups by chemical formula, and a length mismatch is a ValueError."""
    from ase.build import molecule
    from ase.calculators.singlepoint import SinglePointCalculator

    from mlff_distiller.distill.evaluation import error_metrics, grouped_error_metrics

    frames, preds = [], []
    for k, (name, kind, off) in enumerate(
        [("H2O", "md", 0.01), ("CH4", "rattle", 0.2), ("H2O", "md", 0.03), ("CH4", None, 0.5), ("H2O", "rattle", 0.1)]
    ):
        atoms = molecule(name)
        forces = np.linspace(-1, 1, 3 * len(atoms)).reshape(-1, 3) * (k + 1)
        atoms.calc = SinglePointCalculator(atoms, energy=-float(k), forces=forces)
        if kind is not None:
            atoms.info["kind"] = kind
        frames.append(atoms)
        preds.append({"energy": -float(k) + off * len(atoms), "forces": forces + off})
    got = grouped_error_metrics(frames, preds, "kind")
    assert list(got) == ["md", "rattle", "(none)"]
    for value, idx in {"md": [0, 2], "rattle": [1, 4], "(none)": [3]}.items():
        ref = error_metrics([frames[k] for k in idx], [preds[k] for k in idx])
        assert got[value] == {n: v for n, v in ref.items() if not n.startswith("_")}
    assert got["md"]["force_mae_mev_a"] == pytest.approx(20.0)
    by_formula = grouped_error_metrics(frames, preds, "formula")
    assert {k: v["frames"] for k, v in by_formula.items()} == {"H2O": 3, "CH4": 2}
    with pytest.raises(ValueError, match="predictions"):
        grouped_error_metrics(frames, preds[:-1], "kind")


def test_force_errors_by_element():
    """error_metrics' per-element force errors: each element's MAE / RMSE over its own atoms' components only, in
    order of atomic number, and the overall MAE is their atom-weighted mean."""
    from ase.build import molecule
    from ase.calculators.singlepoint import SinglePointCalculator

    frames, preds = [], []
    for name in ("H2O", "CH4", "NH3"):
        atoms = molecule(name)
        forces = np.zeros((len(atoms), 3))
        atoms.calc = SinglePointCalculator(atoms, energy=0.0, forces=forces)
        off = np.where(atoms.numbers == 1, 0.01, 0.1)[:, None] * np.array([1.0, -1.0, 2.0])  # H: 10 meV/Å, else 100
        frames.append(atoms)
        preds.append({"energy": 0.0, "forces": forces + off})
    m = error_metrics(frames, preds)
    assert list(m["force_mae_mev_a_by_element"]) == ["H", "C", "N", "O"]
    assert m["force_mae_mev_a_by_element"]["H"] == pytest.approx(10 * 4 / 3)
    for symbol in ("C", "N", "O"):
        assert m["force_mae_mev_a_by_element"][symbol] == pytest.approx(100 * 4 / 3)
        assert m["force_rmse_mev_a_by_element"][symbol] == pytest.approx(100 * np.sqrt(2))
    n_h, n_heavy = 2 + 4 + 3, 3
    overall = (n_h * 10 + n_heavy * 100) * 4 / 3 / (n_h + n_heavy)
    assert m["force_mae_mev_a"] == pytest.approx(overall)
