"""The CPU step with the last layer's update making s' alone (``StudentModel.last_update_scalars_only``, stop 56)
against it making v' too, interleaved call by call in one process (no GPU).

    python benchmarks/probe_last_update_cpu.py [--out results/] [--threads 2]

For ethanol and clusters of 16 and 128 water molecules, both shipped students: ``ForceEngine(device="cpu").compute``
(energy + forces on the host; the written-out backward of :mod:`mlff_distiller.model.analytic`, the CPU default) with
the switch on and off, alternating call by call, median per call after two warm calls each, and the ratio; the
forces of the two are compared first. Its numbers describe the machine it runs on.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from ase.build import molecule

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import write_lines
from probe_cpu_md import STUDENTS, water_cluster

from mlff_distiller import AtomsBatch, ForceEngine, StudentModel, load_model


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=float, default=1.0, help="a scale of each system's timed calls (at least 1)")
    ap.add_argument("--systems", default="ethanol,(H2O)16,(H2O)128")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--name", default="probe_last_update_cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = [
        "# probe_last_update_cpu.py: the CPU step, the last layer's update making s' alone vs v' too, interleaved",
        "",
        f"{platform.processor() or platform.machine()} · {args.threads} torch threads · torch {torch.__version__} · "
        f"Python {platform.python_version()}; ForceEngine.compute, energy + forces, median per call",
        "",
        "| student | system | atoms | s' alone ms | v' too ms | v' too / s' alone | max abs ΔF eV/Å |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    cases = [("ethanol", molecule("CH3CH2OH"), 60), ("(H2O)16", water_cluster(16), 30)]
    cases.append(("(H2O)128", water_cluster(128), 10))
    cases = [c for c in cases if c[0] in args.systems.split(",")]
    saved = StudentModel.last_update_scalars_only
    try:
        for student in STUDENTS:
            model = load_model(student)
            engine = ForceEngine(model, device="cpu")
            for label, atoms, reps in cases:
                batch = AtomsBatch.from_atoms([atoms])
                forces, times = {}, {True: [], False: []}
                for rep in range(max(1, round(reps * args.reps)) + 2):
                    for flag in (True, False):
                        StudentModel.last_update_scalars_only = flag
                        t0 = time.perf_counter()
                        out = engine.compute(batch, to_host=True)
                        if rep >= 2:
                            times[flag].append(time.perf_counter() - t0)
                        forces[flag] = out["forces"]
                d_f = float((forces[True] - forces[False]).abs().max())
                on, off = (1e3 * statistics.median(times[f]) for f in (True, False))
                row = f"| {student} | {label} | {len(atoms)} | {on:.3f} | {off:.3f} | {off / on:.3f}x | {d_f:.1e} |"
                lines.append(row)
                print(row, flush=True)
    finally:
        StudentModel.last_update_scalars_only = saved
    write_lines(lines, args.out, args.name)
    return lines


if __name__ == "__main__":
    main()
