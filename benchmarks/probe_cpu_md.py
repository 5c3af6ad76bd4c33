"""On a CPU, where does the student overtake its GFN2-xTB teacher? One ASE MD step per system size (no GPU).

    python benchmarks/probe_cpu_md.py --out results/ [--threads 2] [--sizes 1 4 16 64]

For molecules of growing size (ethanol, then clusters of n water molecules), one velocity-Verlet step (0.5 fs) with
energy + forces from:

* the shipped students (``builtin:chno-gfn2``, 128 x 3, and ``builtin:chno-gfn2-small``, 64 x 3) through
  ``StudentCalculator`` on the CPU (the eager path: the Triton kernels are GPU-only);
* with ``--autograd``, the same students on autograd's backward (``ForceEngine(analytic=False)``), the CPU path
  before :mod:`mlff_distiller.model.analytic`;
* GFN2-xTB through tblite's ASE calculator (``tblite.ase.TBLite``), the teacher those students were distilled from.

Wall clock per MD step, median over ``--steps`` steps after ``--warmup`` steps, all in one process with
``torch.set_num_threads(--threads)``. Before timing, each student's forces on the starting structure are checked to
be finite. Writes ``<out>/<name>.md``. Its numbers describe the machine it runs on (say which in the results).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from ase import Atoms, units
from ase.build import molecule
from ase.md.verlet import VelocityVerlet

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import write_lines

from mlff_distiller import StudentCalculator, load_model
from mlff_distiller.ase_compat import maxwell_boltzmann

STUDENTS = ("builtin:chno-gfn2", "builtin:chno-gfn2-small")


def water_cluster(n: int, seed: int = 0) -> Atoms:
    """``n`` water molecules on a jittered cubic lattice of 3.1 Å spacing, randomly oriented: a compact cluster
    at roughly liquid density, no cell."""
    rng = np.random.default_rng(seed)
    side = int(np.ceil(n ** (1 / 3)))
    sites = np.array([(i, j, k) for i in range(side) for j in range(side) for k in range(side)][:n], float) * 3.1
    h2o = molecule("H2O")
    h2o.positions -= h2o.get_center_of_mass()
    out = Atoms()
    for site in sites:
        m = h2o.copy()
        m.rotate(rng.uniform(0, 360), rng.normal(size=3), center=(0, 0, 0))
        m.positions += site + rng.normal(0, 0.1, 3)
        out += m
    return out


def systems(sizes: list[int]) -> list[tuple[str, Atoms]]:
    out = [("ethanol", molecule("CH3CH2OH"))]
    out += [(f"(H2O){n}", water_cluster(n)) for n in sizes]
    return out


def md_step_ms(atoms: Atoms, calc, warmup: int, steps: int) -> float:
    atoms = atoms.copy()
    atoms.calc = calc
    maxwell_boltzmann(atoms, 300.0, rng=np.random.default_rng(1))
    dyn = VelocityVerlet(atoms, 0.5 * units.fs)
    dyn.run(warmup)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        dyn.run(1)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[1, 4, 16, 64], help="water molecules per cluster")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--teacher-steps", type=int, default=5)
    ap.add_argument("--no-teacher", action="store_true", help="students only (no tblite)")
    ap.add_argument(
        "--autograd", action="store_true", help="also each student on autograd's backward (ForceEngine(analytic=False))"
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--name", default="cpu_md_student_vs_gfn2")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = {name: load_model(name) for name in STUDENTS}
    teacher = None
    if not args.no_teacher:
        from tblite.ase import TBLite

        teacher = TBLite
    paths = [(name, True) for name in STUDENTS]  # the CPU's written-out backward (the default)
    if args.autograd:
        paths += [(name, False) for name in STUDENTS]
    cols = [f"{n}{'' if a else ' (autograd)'}" for n, a in paths] + (["GFN2-xTB (tblite)"] if teacher else [])
    lines = [
        "# probe_cpu_md.py: one ASE MD step on a CPU, the students against their GFN2-xTB teacher",
        "",
        f"{platform.processor() or platform.machine()} · {args.threads} torch threads · torch {torch.__version__} · "
        f"Python {platform.python_version()}; velocity Verlet 0.5 fs, wall clock per step, median of {args.steps} "
        f"steps (teacher: {args.teacher_steps}) after {args.warmup}",
        "",
        "| system | atoms | " + " | ".join(f"{c} ms" for c in cols) + " | teacher / 128 x 3 | teacher / 64 x 3 |",
        "|---|---:|" + "---:|" * (len(cols) + 2),
    ]
    for label, atoms in systems(args.sizes):
        row = []
        for name, written_out in paths:
            calc = StudentCalculator(models[name], device="cpu")
            calc.engine.analytic = calc.engine.analytic and written_out
            probe = atoms.copy()
            probe.calc = calc
            if not np.isfinite(probe.get_forces()).all():
                raise AssertionError(f"{name} gave non-finite forces on {label}")
            row.append(md_step_ms(atoms, calc, args.warmup, args.steps))
        if teacher:
            t = md_step_ms(atoms, teacher(method="GFN2-xTB", verbosity=0), 1, args.teacher_steps)
            ratios = f"{t / row[0]:.2f}x | {t / row[1]:.2f}x"  # the default path of each student
            row.append(t)
        else:
            ratios = "— | —"
        lines.append(f"| {label} | {len(atoms)} | " + " | ".join(f"{v:.2f}" for v in row) + f" | {ratios} |")
        print(lines[-1], flush=True)
    write_lines(lines, args.out, args.name)
    return lines


if __name__ == "__main__":
    main()
