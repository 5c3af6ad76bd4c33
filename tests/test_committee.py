"""mlff_distiller.committee: the students' disagreement as an out-of-domain flag, and ``mlff-distill check``."""

import json

import ase.io
import numpy as np
import pytest
from ase import Atoms
from ase.build import molecule
from helpers import make_model

from mlff_distiller import load_model
from mlff_distiller.cli import main
from mlff_distiller.committee import DEFAULT_COMMITTEE, DISAGREEMENT_THRESHOLD, committee_disagreement


@pytest.fixture(scope="module")
def shipped():
    return [load_model(name) for name in DEFAULT_COMMITTEE]


def test_one_student_twice_agrees_with_itself(shipped):
    rows = committee_disagreement([shipped[0], shipped[0]], [molecule("H2O"), molecule("BDA")], device="cpu")
    for r in rows:
        assert r["force_disagreement_mev_a"] == r["max_force_disagreement_mev_a"] == 0.0
        assert r["energy_disagreement_mev_atom"] == 0.0 and not r["flagged"]


def test_the_shipped_students_flag_molecules_outside_their_training_set(shipped):
    """At their equilibrium geometries: g2 molecules (the training set) against ASE's extras (not in it)."""
    inside = [molecule(name) for name in ("H2O", "C6H6", "CH3CH2OH", "CH3COOH")]
    outside = [molecule(name) for name in ("BDA", "biphenyl")]
    rows = committee_disagreement(shipped, inside + outside, device="cpu", precision="fp64")
    assert [r["flagged"] for r in rows] == [False] * 4 + [True] * 2
    worst_inside = max(r["force_disagreement_mev_a"] for r in rows[:4])
    assert worst_inside < DISAGREEMENT_THRESHOLD < min(r["force_disagreement_mev_a"] for r in rows[4:])


def test_metrics_by_hand(shipped):
    atoms = molecule("CH3OH")
    rows = committee_disagreement([*shipped, shipped[0]], [atoms], device="cpu", precision="fp64", threshold=1e-3)
    f = [m_forces(m, atoms) for m in (*shipped, shipped[0])]
    pairs = [(0, 1), (0, 2), (1, 2)]
    want = np.mean([np.abs(f[a] - f[b]).mean() for a, b in pairs]) * 1000
    peak = max(np.linalg.norm(f[a] - f[b], axis=1).max() for a, b in pairs) * 1000
    assert rows[0]["force_disagreement_mev_a"] == pytest.approx(want, rel=1e-9)
    assert rows[0]["max_force_disagreement_mev_a"] == pytest.approx(peak, rel=1e-9)
    assert rows[0]["flagged"]  # above the tiny threshold


def m_forces(model, atoms):
    from mlff_distiller import predict_forces

    return predict_forces(model, [atoms], device="cpu", precision="fp64")[0]["forces"]


def test_one_structure_or_a_generator(shipped):
    one = committee_disagreement(shipped, molecule("H2O"), device="cpu", precision="fp64")
    gen = committee_disagreement(shipped, (molecule(m) for m in ("H2O", "CH4")), device="cpu", precision="fp64")
    assert len(one) == 1 and len(gen) == 2
    assert gen[0]["force_disagreement_mev_a"] == pytest.approx(one[0]["force_disagreement_mev_a"], rel=1e-6)


def test_bad_committees_are_clear_errors(shipped):
    with pytest.raises(ValueError, match="at least two students"):
        committee_disagreement(shipped[:1], [molecule("H2O")])
    with pytest.raises(ValueError, match="threshold"):
        committee_disagreement(shipped, [molecule("H2O")], threshold=0)
    with pytest.raises(ValueError, match="Cu"):
        committee_disagreement(shipped, [Atoms("Cu2", positions=[(0, 0, 0), (0, 0, 2.3)])], device="cpu")


def test_cli_check(tmp_path, capsys):
    structures = tmp_path / "in.xyz"
    ase.io.write(structures, [molecule("H2O"), molecule("BDA"), molecule("CH3CH2OH")])
    report = tmp_path / "report.json"
    assert main(["check", "--input", str(structures), "--device", "cpu", "--output", str(report)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["structures"] == 3 and out["flagged"] == 1 and out["flagged_indices"] == [1]
    assert out["models"] == list(DEFAULT_COMMITTEE) and out["worst"]["index"] == 1
    assert "1 of 3 structures" in out["verdict"]
    rows = json.loads(report.read_text())
    assert len(rows) == 3 and rows[1]["flagged"] and rows[1]["index"] == 1
    args = ["check", "--input", str(structures), "--device", "cpu", "--threshold", "1e6"]
    assert main([*args, "--models", f"{DEFAULT_COMMITTEE[0]},{DEFAULT_COMMITTEE[0]}"]) == 0
    assert json.loads(capsys.readouterr().out)["flagged"] == 0
    # One student: the check against its stored envelope. BDA's geometry lies inside the shipped student's (its
    # pairs and neighbour counts look like the training molecules'), though the committee above flags it: the
    # envelope is geometry only. A squeezed molecule lies outside.
    squeezed = molecule("CH3CH2OH")
    squeezed.positions *= 0.7
    ase.io.write(structures, [molecule("H2O"), molecule("BDA"), molecule("CH3CH2OH"), squeezed])
    assert main(["check", "--input", str(structures), "--models", DEFAULT_COMMITTEE[0], "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["envelope_frames"] == 13179 and out["flagged_indices"] == [3]
    # A student without an envelope cannot be checked alone.
    bare = tmp_path / "bare.pt"
    make_model(seed=1, species=[1, 6, 7, 8]).save(bare)
    assert main(["check", "--input", str(structures), "--models", str(bare)]) == 2
    assert "stores no training envelope" in capsys.readouterr().err


def test_committee_calculator_means_spread_and_warning(shipped):
    import warnings

    from ase.md.verlet import VelocityVerlet
    from ase.units import fs

    from mlff_distiller import StudentCalculator
    from mlff_distiller.committee import CommitteeCalculator, OutOfDomainWarning

    calc = CommitteeCalculator(shipped, device="cpu", precision="fp64")
    ethanol = molecule("CH3CH2OH")
    ethanol.calc = calc
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutOfDomainWarning)  # inside the training set: no warning
        energy, forces = ethanol.get_potential_energy(), ethanol.get_forces()
    own = []
    for model in shipped:
        a = ethanol.copy()
        a.calc = StudentCalculator(model, device="cpu", precision="fp64")
        own.append((a.get_potential_energy(), a.get_forces()))
    assert energy == pytest.approx((own[0][0] + own[1][0]) / 2, abs=1e-9)
    np.testing.assert_allclose(forces, (own[0][1] + own[1][1]) / 2, atol=1e-9)
    ref = committee_disagreement(shipped, [ethanol], device="cpu", precision="fp64")[0]
    assert calc.results["force_disagreement"] == pytest.approx(ref["force_disagreement_mev_a"], rel=1e-6)
    np.testing.assert_allclose(calc.results["forces_std"], np.abs(own[0][1] - own[1][1]) / 2, atol=1e-9)
    assert calc.results["energy_std"] == pytest.approx(abs(own[0][0] - own[1][0]) / 2, abs=1e-9)
    assert calc.flagged_calculations == 0

    bda = molecule("BDA")
    bda.calc = calc
    with pytest.warns(OutOfDomainWarning, match="likely outside their training data"):
        bda.get_forces()
    assert calc.flagged_calculations == 1 and calc.results["force_disagreement"] > DISAGREEMENT_THRESHOLD
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutOfDomainWarning)  # warns once, counts every time
        VelocityVerlet(bda, 0.5 * fs).run(3)
    assert calc.flagged_calculations >= 3 and np.isfinite(bda.get_forces()).all()
    with pytest.raises(ValueError, match="at least two students"):
        CommitteeCalculator(shipped[:1])
