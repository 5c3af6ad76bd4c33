"""The main job on the embedded default: MD and batched predictions with the shipped student.

    python examples/demo.py              # (or: make demo)

Loads the default student ``mlff_distiller.DEFAULT_MODEL`` (``builtin:chno-gfn2-small``, 64 x 3: distilled from
GFN2-xTB, shipped inside the package). If this build has no
built-in student, a freshly initialised one stands in (its energies are then meaningless, but every code path
runs). It prints, for a few molecules: time per ASE MD step, batched-prediction throughput, whether the two shipped
students agree on a molecule inside and one outside their training set, and, when ``tblite`` is installed, the
student's error against GFN2-xTB on the same frames.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from ase.build import molecule
from ase.constraints import FixCom
from ase.md.langevin import Langevin
from ase.units import fs

from mlff_distiller import DEFAULT_MODEL, StudentCalculator, StudentModel, builtin_models, load_model, predict_forces
from mlff_distiller.ase_compat import maxwell_boltzmann

MOLECULES = ["CH4", "H2O", "CH3CH2OH", "C6H6", "CH3COOH", "HCOOH"]


def _student() -> tuple[StudentModel, str]:
    if DEFAULT_MODEL.split(":", 1)[1] in builtin_models():  # the default student (builtin:chno-gfn2-small, 64 x 3)
        return load_model(DEFAULT_MODEL), DEFAULT_MODEL
    torch.manual_seed(0)
    return StudentModel(species=[1, 6, 7, 8]), "freshly initialised (no built-in student in this build)"


def _teacher():
    try:
        from tblite.ase import TBLite
    except ImportError:
        return None
    return TBLite(method="GFN2-xTB", verbosity=0)


def main() -> None:
    model, name = _student()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"student: {name} on {device}; {sum(p.numel() for p in model.parameters()):,} parameters")

    # 1. MD: 200 steps of Langevin dynamics on ethanol at 300 K.
    atoms = molecule("CH3CH2OH")
    atoms.calc = StudentCalculator(model, device=device)
    maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(0))
    atoms.set_constraint(FixCom())  # keeps the molecule in place (Langevin's fixcm flag is deprecated in ASE)
    dyn = Langevin(atoms, 0.5 * fs, temperature_K=300, friction=0.01 / fs, fixcm=False, rng=np.random.default_rng(1))
    dyn.run(10)  # warm-up
    t0 = time.perf_counter()
    dyn.run(200)
    step_ms = (time.perf_counter() - t0) / 200 * 1e3
    print(f"MD: ethanol, 200 Langevin steps, {step_ms:.2f} ms/step, T = {atoms.get_temperature():.0f} K")

    # 2. Batched prediction over many rattled molecules.
    rng = np.random.default_rng(2)
    frames = []
    for k in range(256):
        a = molecule(MOLECULES[k % len(MOLECULES)])
        a.positions += rng.normal(scale=0.05, size=a.positions.shape)
        frames.append(a)
    predict_forces(model, frames, device=device)  # warm-up: compiles and captures; the engine is kept for the next call
    t0 = time.perf_counter()
    results = predict_forces(model, frames, device=device)
    dt = time.perf_counter() - t0
    print(f"predict_forces: {len(frames)} structures in {dt * 1e3:.1f} ms ({len(frames) / dt:,.0f} structures/s)")

    # 3. Can the student be trusted on a molecule? The two shipped students learned the same labels: where their
    #    forces disagree, they are outside what they learned (mlff-distill check; mlff_distiller.committee).
    if {"chno-gfn2", "chno-gfn2-small"} <= set(builtin_models()):
        from mlff_distiller.committee import DEFAULT_COMMITTEE, committee_disagreement

        probes = {"ethanol (in the training set)": "CH3CH2OH", "1,4-benzenediamine (not in it)": "BDA"}
        rows = committee_disagreement(DEFAULT_COMMITTEE, [molecule(m) for m in probes.values()], device=device)
        for label, r in zip(probes, rows, strict=True):
            verdict = "flagged: fine-tune before trusting it" if r["flagged"] else "the students agree"
            print(f"check: {label}: students differ by {r['force_disagreement_mev_a']:.0f} meV/Å, {verdict}")

    # 4. Error vs the teacher on the first frames (GFN2-xTB through tblite, when installed).
    teacher = _teacher()
    if teacher is None:
        print("tblite not installed: skipping the comparison with GFN2-xTB (pip install 'mlff-distiller[xtb]')")
        return
    n = 24
    de, df, t_teacher = [], [], 0.0
    for a, r in zip(frames[:n], results[:n], strict=True):
        a = a.copy()
        a.calc = teacher
        t0 = time.perf_counter()
        e, f = a.get_potential_energy(), a.get_forces()
        t_teacher += time.perf_counter() - t0
        de.append(abs(e - r["energy"]) / len(a))
        df.append(np.abs(f - r["forces"]).mean())
    print(
        f"vs GFN2-xTB on {n} frames: energy MAE {1e3 * np.mean(de):.1f} meV/atom, "
        f"force MAE {1e3 * np.mean(df):.1f} meV/Å; teacher {t_teacher / n * 1e3:.1f} ms/structure"
    )


if __name__ == "__main__":
    main()
