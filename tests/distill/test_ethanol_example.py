"""examples/distill_ethanol.py (the issue-6 ethanol target): helpers and the --quick end-to-end run."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from mlff_distiller import load_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("distill_ethanol", ROOT / "examples/distill_ethanol.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_first_time_below(example):
    history = [
        {"step": 100, "seconds": 5.0, "val_force_mae_mev_a": 20.0},
        {"step": 200, "seconds": 10.0, "val_force_mae_mev_a": 5.3},
        {"step": 300, "seconds": 15.0, "val_force_mae_mev_a": 2.9},
    ]
    assert example.first_time_below(history, 5.4) == {"step": 200, "seconds": 10.0, "val_force_mae_mev_a": 5.3}
    assert example.first_time_below(history, 3.0)["seconds"] == 15.0
    assert example.first_time_below(history, 1.0) is None


def _with_zero_calc(atoms):
    """``atoms`` with zero energy and forces attached (the monitor only reads them)."""
    from ase.calculators.singlepoint import SinglePointCalculator

    atoms.calc = SinglePointCalculator(atoms, energy=0.0, forces=np.zeros((len(atoms), 3)))
    return atoms


class _Clock:
    def get_time(self):
        return 0.0


def test_stability_monitor_flags_broken_bond_and_close_pair(example):
    from ase.build import molecule

    atoms = _with_zero_calc(molecule("CH3CH2OH"))
    mon = example.StabilityMonitor(atoms, _Clock())
    mon()
    assert mon.failure is None and mon.summary()["min_pair_distance_a"] > 0.9
    o = int(np.flatnonzero(atoms.numbers == 8)[0])
    h = min((k for k in range(len(atoms)) if atoms.numbers[k] == 1), key=lambda k: atoms.get_distance(o, k))
    stretched = atoms.copy()
    stretched.set_distance(o, h, 2.0, fix=0)  # O-H (0.97 Å) pulled to 2.0 Å > 1.5 x (0.66 + 0.31) Å
    squeezed = atoms.copy()
    squeezed.positions[h] = squeezed.positions[o] + [0.3, 0.0, 0.0]
    for moved, message in ((stretched, "bond broke"), (squeezed, "< 0.5")):
        mon = example.StabilityMonitor(atoms, _Clock())  # the bond graph of the intact molecule
        mon.atoms = _with_zero_calc(moved)
        mon()
        assert message in mon.failure and not mon.summary()["stable"], mon.failure


def test_quick_run(example, tmp_path):
    pytest.importorskip("tblite")
    results = tmp_path / "results"
    rc = example.main(
        ["--quick", "--workers", "2", "--work", str(tmp_path / "work"), "--results", str(results), "--fp64-test"]
    )
    assert rc == 0
    m = json.loads((results / "metrics.json").read_text())
    fr = m["frames"]
    assert fr["train"] == 36 and fr["val"] > 0 and fr["test"] > 0
    assert fr["val_trajectories"] + fr["test_trajectories"] == 4  # held-out trajectories split, none shared
    assert m["training"]["steps"] > 0 and m["training"]["seconds"] < 30
    for key in ("test_fp32", "test_fp64", "md_step_timing", "stability_md"):
        assert "error" not in m[key], (key, m[key])
    assert m["test_fp32"]["frames"] == fr["test"] and np.isfinite(m["test_fp32"]["force_mae_mev_a"])
    assert m["md_step_timing"]["student_s_per_step"] > 0 and m["md_step_timing"]["teacher_s_per_step"] > 0
    assert m["stability_md"]["steps"] > 0 and m["stability_md"]["stable"] in (True, False)
    for name in ("summary.md", "history.json", "learning_curve.png", "parity.png", "stability.png"):
        assert (results / name).stat().st_size > 100, name
    assert "Ethanol" in (results / "summary.md").read_text()
    model = load_model(results / "ethanol-gfn2.pt")
    assert model.metadata["teacher"] == "gfn2-xtb" and "test" in model.metadata
