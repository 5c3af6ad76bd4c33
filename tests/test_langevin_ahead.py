"""``mlff_distiller._langevin_ahead``: the next positions of ASE's ``Langevin``, predicted during its force call, are
the very positions its next step sets (byte for byte), and predicting them leaves the integrator's noise as it was.

Oracle: ASE's own ``Langevin.step`` on a cheap calculator (EMT) whose ``calculate`` makes the prediction; the next
calculation's positions must equal it bit for bit.
"""

import warnings

import numpy as np
import pytest
from ase import units
from ase.build import molecule
from ase.calculators.emt import EMT
from ase.constraints import FixAtoms, FixCom
from ase.md.langevin import Langevin
from ase.md.verlet import VelocityVerlet

from mlff_distiller import _langevin_ahead
from mlff_distiller.ase_compat import maxwell_boltzmann


class _Predicting(EMT):
    """EMT that predicts the followed Langevin's next positions at each calculation and checks the last one."""

    def __init__(self, predict: bool = True):
        super().__init__()
        self.dyn, self.predict, self.predicted, self.hits, self.misses, self.none = None, predict, None, 0, 0, 0

    def calculate(self, atoms=None, properties=("energy",), system_changes=()):
        super().calculate(atoms, properties, system_changes)
        if self.predicted is not None:
            same = self.predicted.tobytes() == atoms.positions.tobytes()
            self.hits, self.misses = self.hits + same, self.misses + (not same)
        self.predicted = None
        if self.predict and self.dyn is not None:
            self.predicted = _langevin_ahead.next_positions(self.dyn, atoms, self.results["forces"])
            self.none += self.predicted is None


def _run(rng_kind: str, constraint, fixcm: bool, predict: bool, steps: int = 25):
    atoms = molecule("CH3CH2OH")
    atoms.center(vacuum=4.0)
    maxwell_boltzmann(atoms, 600, rng=np.random.default_rng(4))
    if constraint is not None:
        atoms.set_constraint(constraint)
    calc = _Predicting(predict)
    atoms.calc = calc
    if rng_kind == "global":
        np.random.seed(11)  # noqa: NPY002 (Langevin without rng draws from the legacy global generator)
        rng = None
    else:
        rng = np.random.default_rng(11) if rng_kind == "generator" else np.random.RandomState(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # fixcm=True is deprecated since ASE 3.28
        dyn = Langevin(atoms, timestep=0.5 * units.fs, temperature_K=600, friction=0.02, rng=rng, fixcm=fixcm)
    calc.dyn = dyn
    dyn.run(steps)
    return atoms, calc


@pytest.mark.parametrize(
    ("rng_kind", "constraint", "fixcm"),
    [
        ("generator", "fixcom", False),  # the CLI's `mlff-distill md` default
        ("generator", None, True),
        ("global", None, False),
        ("randomstate", "fixatoms", False),
    ],
)
def test_prediction_is_the_next_step_bit_for_bit(rng_kind, constraint, fixcm):
    make = {None: lambda: None, "fixcom": FixCom, "fixatoms": lambda: FixAtoms(indices=[0, 3])}[constraint]
    atoms, calc = _run(rng_kind, make(), fixcm, predict=True)
    # the first calculation is before any step (no step under way: no prediction), then every one is predicted
    assert calc.none == 1 and calc.misses == 0 and calc.hits == 24, (calc.none, calc.hits, calc.misses)
    # the integrator's own noise untouched: the same trajectory without predictions
    plain, _ = _run(rng_kind, make(), fixcm, predict=False)
    np.testing.assert_array_equal(atoms.positions, plain.positions)
    np.testing.assert_array_equal(atoms.get_momenta(), plain.get_momenta())


def test_no_prediction_where_it_would_not_be_the_step():
    atoms = molecule("H2O")
    maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(0))
    atoms.calc = EMT()
    dyn = Langevin(
        atoms, timestep=0.5 * units.fs, temperature_K=300, friction=0.02, rng=np.random.default_rng(0), fixcm=False
    )
    forces = atoms.get_forces()
    assert _langevin_ahead.next_positions(dyn, atoms, forces) is None  # before any step: no velocities of a step
    dyn.run(1)
    other = atoms.copy()
    assert _langevin_ahead.next_positions(dyn, other, forces) is None  # not the integrator's atoms
    assert _langevin_ahead.next_positions(dyn, atoms, forces) is not None
    assert _langevin_ahead.is_langevin(dyn) and not _langevin_ahead.is_langevin(VelocityVerlet(atoms, 1.0))
