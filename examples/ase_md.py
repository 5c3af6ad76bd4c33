"""Molecular dynamics with the student as an ASE calculator (NVE with VelocityVerlet, then Langevin NVT).

python examples/ase_md.py [checkpoint]       # default: the built-in student, else a fresh one
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from ase.build import molecule
from ase.constraints import FixCom
from ase.md.langevin import Langevin
from ase.md.verlet import VelocityVerlet
from ase.units import fs

from mlff_distiller import DEFAULT_MODEL, StudentCalculator, StudentModel, builtin_models
from mlff_distiller.ase_compat import maxwell_boltzmann


def main() -> None:
    if len(sys.argv) > 1:
        model = sys.argv[1]
    elif DEFAULT_MODEL.split(":", 1)[1] in builtin_models():
        model = DEFAULT_MODEL
    else:
        torch.manual_seed(0)
        model = StudentModel(species=[1, 6, 7, 8])
    atoms = molecule("C6H6")
    # fp64 for NVE: energy conservation is then limited by the time step, not by rounding.
    atoms.calc = StudentCalculator(model, precision="fp64")
    maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(0))
    e0 = atoms.get_total_energy()
    VelocityVerlet(atoms, 0.5 * fs).run(200)
    drift = (atoms.get_total_energy() - e0) / len(atoms)
    print(f"NVE 200 x 0.5 fs: total-energy drift {drift * 1e3:.3f} meV/atom")
    atoms.set_constraint(FixCom())  # keeps the molecule in place (Langevin's fixcm flag is deprecated in ASE)
    dyn = Langevin(atoms, 0.5 * fs, temperature_K=500, friction=0.02 / fs, fixcm=False, rng=np.random.default_rng(1))
    dyn.attach(lambda: print(f"  T = {atoms.get_temperature():6.1f} K  E = {atoms.get_potential_energy():.4f} eV"), 50)
    dyn.run(200)


if __name__ == "__main__":
    main()
