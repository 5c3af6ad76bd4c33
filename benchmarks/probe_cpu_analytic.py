"""The CPU step with its backward written out against autograd's, interleaved in one process (no GPU).

    python benchmarks/probe_cpu_analytic.py [--out results/] [--threads 2]

For ethanol and clusters of 16 and 128 water molecules, ``ForceEngine(device="cpu").compute`` (energy + forces,
results on the host) with ``analytic=True`` (:mod:`mlff_distiller.model.analytic`, the CPU default) and
``analytic=False`` (``autograd.grad``), the two engines alternating call by call so that the load of a shared host
falls on both alike; median per call after two warm calls each, and the ratio. Both shipped students. The forces of
the two paths are compared first. Its numbers describe the machine it runs on.
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
from ase.build import molecule

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import write_lines
from probe_cpu_md import STUDENTS, water_cluster

from mlff_distiller import AtomsBatch, ForceEngine, load_model


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--name", default="cpu_analytic_ab")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = [
        "# probe_cpu_analytic.py: the CPU step, backward written out vs autograd, interleaved",
        "",
        f"{platform.processor() or platform.machine()} · {args.threads} torch threads · torch {torch.__version__} · "
        f"Python {platform.python_version()}; ForceEngine.compute, energy + forces, median per call",
        "",
        "| student | system | atoms | written out ms | autograd ms | autograd / written out | max |ΔF| eV/Å |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    cases = [("ethanol", molecule("CH3CH2OH"), 40), ("(H2O)16", water_cluster(16), 20)]
    cases.append(("(H2O)128", water_cluster(128), 8))
    for student in STUDENTS:
        model = load_model(student)
        for label, atoms, reps in cases:
            engines = {flag: ForceEngine(model, device="cpu", analytic=flag) for flag in (True, False)}
            assert engines[True].analytic and not engines[False].analytic
            batch = AtomsBatch.from_atoms([atoms])
            forces = {flag: e.compute(batch, to_host=True)["forces"] for flag, e in engines.items()}
            d_f = float((forces[True] - forces[False]).abs().max())
            times: dict[bool, list[float]] = {True: [], False: []}
            for rep in range(reps + 2):
                for flag, engine in engines.items():
                    t0 = time.perf_counter()
                    engine.compute(batch, to_host=True)
                    if rep >= 2:
                        times[flag].append(time.perf_counter() - t0)
            a, g = (1e3 * statistics.median(times[f]) for f in (True, False))
            lines.append(f"| {student} | {label} | {len(atoms)} | {a:.2f} | {g:.2f} | {g / a:.2f}x | {d_f:.1e} |")
            print(lines[-1], flush=True)
            assert np.isfinite(d_f)
    write_lines(lines, args.out, args.name)
    return lines


if __name__ == "__main__":
    main()
