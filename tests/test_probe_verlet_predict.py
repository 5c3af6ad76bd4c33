"""benchmarks/probe_verlet_predict.py: its NumPy reference is ASE's velocity-Verlet move bit for bit, its counter
sees a one-rounding difference, and the device forms it runs here (torch on the CPU, the Triton kernel on the
interpreter) equal the reference."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.calculators.calculator import Calculator, all_changes
from ase.md.verlet import VelocityVerlet

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_verlet_predict as probe


class _FixedForces(Calculator):
    """Returns the same forces (float32 values, as the student's) everywhere; records each calculation's state."""

    implemented_properties: ClassVar[list[str]] = ["energy", "forces"]

    def __init__(self, forces: np.ndarray):
        super().__init__()
        self.forces = forces.astype(np.float64)
        self.seen = []

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        self.seen.append((self.atoms.positions.copy(), self.atoms.get_momenta().copy()))
        self.results = {"energy": 0.0, "forces": self.forces.copy()}


@pytest.mark.parametrize("dt_fs", [0.5, 1.0, 0.013])
def test_the_reference_is_ases_next_positions_bit_for_bit(dt_fs):
    x, p, f32, m, _ = probe._inputs(9, seed=3)
    atoms = Atoms("CH4OH3", positions=x)
    atoms.set_masses(m[:, 0])
    atoms.set_momenta(p)
    calc = _FixedForces(f32)
    atoms.calc = calc
    dt = dt_fs * units.fs
    VelocityVerlet(atoms, timestep=dt).run(2)
    (x1, p1), (x2, _) = calc.seen[1], calc.seen[2]  # the state at a calculation, and the next one's positions
    predicted, _ = probe.numpy_predict(x1, p1, f32, atoms.get_masses()[:, None], np.zeros(3), dt)
    assert predicted.tobytes() == x2.tobytes()
    assert probe.FS == units.fs


def test_the_counter_sees_one_rounding_instead_of_two():
    x, p, f32, m, origin = probe._inputs(200, seed=5)
    dt = 0.5 * probe.FS
    ref64, ref32 = probe.numpy_predict(x, p, f32, m, origin, dt)
    assert probe._mismatch(ref64, ref64.copy()) == 0
    once = x + dt * (p + 2 * (0.5 * dt * f32.astype(np.float64))) / m  # both kicks added at once
    assert probe._mismatch(once, ref64) > 0
    nudged = ref32.copy()
    nudged[3, 1] = np.nextafter(nudged[3, 1], np.float32(np.inf))
    assert probe._mismatch(nudged, ref32) == 1


def test_the_device_forms_equal_numpy_here():
    rows = probe.run([12, 40], trials=2, device=torch.device("cpu"), dts_fs=[0.5])
    forms = {r["form"] for r in rows}
    assert {"torch", "numpy (host)"} <= forms
    if probe.HAS_TRITON and probe.INTERPRETING:
        assert {"triton", "triton, no fusion"} <= forms
    for r in rows:
        assert r["coords"] == 3 * r["atoms"] * 2
        assert (r["differ64"], r["differ32"]) == (0, 0), r
