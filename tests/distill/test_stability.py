"""mlff_distiller.distill.stability: the MD stability monitor and run (also used by the examples)."""

import numpy as np
from ase.build import molecule

from mlff_distiller import load_model
from mlff_distiller.distill import StabilityMonitor, stability_run


def test_stability_run_of_the_shipped_student():
    atoms = molecule("CH3OH")
    start = atoms.positions.copy()
    out, mon = stability_run(
        load_model("builtin:chno-gfn2-small"), atoms, "cpu", seconds=60, max_ps=0.02, temperature=300.0,
        timestep_fs=0.5, check=10, seed=0,
    )  # fmt: skip
    assert out["stable"] and out["failure"] is None and out["steps"] == 40
    assert out["checks"] == 5 and abs(out["simulated_ps"] - 0.02) < 1e-9
    assert 0.9 < out["min_pair_distance_a"] and np.isfinite(out["epot_mean_ev"])
    assert np.array_equal(atoms.positions, start) and atoms.calc is None  # the caller's atoms are not touched
    assert isinstance(mon, StabilityMonitor) and len(mon.rows) == 5  # at steps 0, 10, ..., 40


def test_stability_monitor_thresholds_are_settings():
    from ase.calculators.singlepoint import SinglePointCalculator

    atoms = molecule("H2O")
    atoms.calc = SinglePointCalculator(atoms, energy=0.0, forces=np.zeros((3, 3)))

    class Clock:
        def get_time(self):
            return 0.0

    mon = StabilityMonitor(atoms, Clock())
    mon()
    assert mon.failure is None
    mon = StabilityMonitor(atoms, Clock(), min_pair_distance=2.0)  # every O-H and H-H pair is closer than 2 Å
    mon()
    assert "< 2.0 Å" in mon.failure and not mon.summary()["stable"]
    stretched = atoms.copy()
    stretched.set_distance(0, 1, 1.2, fix=0)  # O-H 0.97 -> 1.2 Å: broken at bond_factor 1.1 x (0.66 + 0.31) Å
    stretched.calc = SinglePointCalculator(stretched, energy=0.0, forces=np.zeros((3, 3)))
    mon = StabilityMonitor(atoms, Clock(), bond_factor=1.1)
    mon.atoms = stretched
    mon()
    assert "bond broke (> 1.1" in mon.failure
