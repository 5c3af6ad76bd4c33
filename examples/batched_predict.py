"""Energies and forces of many structures in one call: ``predict_forces``.

python examples/batched_predict.py [checkpoint]
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from ase.build import bulk, molecule

from mlff_distiller import DEFAULT_MODEL, StudentModel, builtin_models, load_model, predict_forces


def main() -> None:
    if len(sys.argv) > 1:
        model = load_model(sys.argv[1])
    elif DEFAULT_MODEL.split(":", 1)[1] in builtin_models():
        model = load_model(DEFAULT_MODEL)
    else:
        torch.manual_seed(0)
        model = StudentModel(species=[1, 6, 7, 8, 14])
    rng = np.random.default_rng(0)
    names = ["H2O", "CH4", "NH3", "CH3OH", "C6H6", "HCOOH"]
    structures = []
    for k in range(1000):
        a = molecule(names[k % len(names)])
        a.positions += rng.normal(scale=0.03, size=a.positions.shape)
        structures.append(a)
    t0 = time.perf_counter()
    results = predict_forces(model, structures)  # batched by an atom budget, results in input order
    dt = time.perf_counter() - t0
    print(
        f"{len(results)} molecules in {dt:.2f} s; first: E = {results[0]['energy']:.4f} eV, "
        f"|F|max = {np.abs(results[0]['forces']).max():.3f} eV/Å"
    )
    if 14 in model.species_list:
        si = bulk("Si", "diamond", a=5.43) * (2, 2, 2)
        r = predict_forces(model, [si], stress=True)[0]
        print(f"Si 2x2x2: E = {r['energy']:.4f} eV, stress (Voigt, eV/Å³) = {np.round(r['stress'], 5)}")


if __name__ == "__main__":
    main()
