"""What the MD command's default precision costs: the ``StudentCalculator`` step in fp64 (the ``md`` command's
default before stop 34) and fp32 (the calculator's and ``predict``'s), and energy conservation in each.

    python benchmarks/probe_md_precision.py --out results/ [--steps 2000]

Systems: benzene and water boxes of 192 and 3,000 atoms (the shipped student; water lies outside its data, so the
step is timed on a random walk of the positions, not in MD). Drift: total energy over ``--steps`` NVE steps of
benzene, last minus first and the largest deviation, per precision. Writes ``<out>/probe_md_precision.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import environment, write_lines
from systems import water_box


def step_ms(atoms, precision: str, steps: int) -> float:
    """ms per ``get_forces`` of ``StudentCalculator`` on a random walk of the positions (1 mÅ per step, the MD
    calculator path: kept Verlet list, captured step): no dynamics, so a structure outside the student's data (the
    water boxes) cannot blow up."""
    from mlff_distiller import StudentCalculator

    atoms = atoms.copy()
    atoms.calc = StudentCalculator("builtin:chno-gfn2", precision=precision, check_domain=None)
    rng = np.random.default_rng(0)
    kicks = rng.normal(0.0, 1e-3, (200 + steps, len(atoms), 3))
    for k in range(200):
        atoms.positions += kicks[k]
        atoms.get_forces()
    times = []
    for b in range(max(steps // 100, 1)):
        t0 = time.perf_counter()
        for k in range(100):
            atoms.positions += kicks[200 + 100 * b + k]
            atoms.get_forces()
        times.append((time.perf_counter() - t0) / 100)
    return 1e3 * statistics.median(times)


def nve_energies(atoms, precision: str, steps: int) -> np.ndarray:
    from ase import units
    from ase.md.verlet import VelocityVerlet

    from mlff_distiller import StudentCalculator
    from mlff_distiller.ase_compat import maxwell_boltzmann

    atoms = atoms.copy()
    maxwell_boltzmann(atoms, 300.0, rng=np.random.default_rng(0))
    atoms.calc = StudentCalculator("builtin:chno-gfn2", precision=precision)
    dyn = VelocityVerlet(atoms, 0.5 * units.fs)
    energies = [atoms.get_total_energy()]
    dyn.attach(lambda: energies.append(atoms.get_total_energy()), interval=10)
    dyn.run(steps)
    return np.asarray(energies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--systems", type=int, default=3, help="the first N of benzene, 192 and 3,000 water atoms")
    args = ap.parse_args()
    from ase.build import molecule

    systems = [
        ("benzene", molecule("C6H6")),
        ("water, 192 atoms", water_box(192)),
        ("water, 3,000 atoms", water_box(3000)),
    ][: args.systems]
    env = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"), 0.0)
    lines = [
        "# probe_md_precision.py: the MD calculator step in fp64 and fp32",
        "",
        f"{env.device} · torch {env.torch} · Triton {env.triton} · commit {env.commit} · host {env.host}",
        "",
        "`StudentCalculator` (the shipped student), `get_forces` on a random walk of the positions (1 mÅ a step: the "
        f"MD path, kept Verlet list and captured step, without dynamics); ms per call, median of 100-call blocks over "
        f"{args.steps} calls after 200:",
        "",
        "| system | fp64 ms | fp32 ms | fp64 / fp32 |",
        "|---|---:|---:|---:|",
    ]
    for name, atoms in systems:
        t64, t32 = step_ms(atoms, "fp64", args.steps), step_ms(atoms, "fp32", args.steps)
        lines.append(f"| {name} | {t64:.3f} | {t32:.3f} | {t64 / t32:.2f}x |")
        print(lines[-1], flush=True)
    lines += [
        "",
        f"Benzene under velocity Verlet, 0.5 fs, 300 K start, {args.steps} steps; total energy sampled every 10 steps "
        "(meV): last minus first, and the largest deviation from the first.",
        "",
        "| precision | drift | max deviation |",
        "|---|---:|---:|",
    ]
    for precision in ("fp64", "fp32"):
        e = nve_energies(molecule("C6H6"), precision, args.steps)
        lines.append(f"| {precision} | {1e3 * (e[-1] - e[0]):.3f} | {1e3 * np.abs(e - e[0]).max():.3f} |")
        print(lines[-1], flush=True)
    write_lines(lines, args.out, "probe_md_precision")


if __name__ == "__main__":
    main()
