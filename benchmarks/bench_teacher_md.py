"""The teacher's MD throughput on this machine's CPU: GFN2-xTB (tblite) under ASE's Langevin, one molecule per
process, for the g2 molecules the shipped student learned; what :mod:`bench_batched_md` sets the student against.

    python benchmarks/bench_teacher_md.py --out results/ [--steps 40] [--workers 0]

* one process, one OpenMP thread: ms per step of each molecule (every ``--every``-th of the 61 closed-shell CHNO
  molecules of ASE's g2), median of ``--steps`` steps after 3;
* all cores: ``--workers`` processes (0: one per core), each with one thread, running trajectories of all 61
  molecules in turn, ``--steps`` steps each; the replica-steps per second of the whole CPU (wall clock of the
  pool, start-up excluded).

Writes ``<out>/bench_teacher_md.md``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _trajectory(args: tuple) -> list[float]:
    """Seconds per step of GFN2-xTB Langevin MD (300 K, 0.5 fs) on molecule ``index``, ``steps`` steps after 3."""
    index, steps, seed = args
    import numpy as np
    from ase import units
    from ase.constraints import FixCom
    from ase.md.langevin import Langevin

    from mlff_distiller.ase_compat import maxwell_boltzmann
    from mlff_distiller.distill.seeds import g2_chno
    from mlff_distiller.distill.teachers import get_teacher

    atoms = g2_chno()[index].copy()
    atoms.set_constraint(FixCom())  # as `mlff-distill md` runs a molecule (ASE's fixcm flag is deprecated)
    atoms.calc = get_teacher("gfn2-xtb", omp_threads=1)
    rng = np.random.default_rng(seed)
    maxwell_boltzmann(atoms, 300.0, rng=rng)
    dyn = Langevin(atoms, timestep=0.5 * units.fs, temperature_K=300.0, friction=0.01 / units.fs, rng=rng, fixcm=False)
    dyn.run(3)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        dyn.run(1)
        times.append(time.perf_counter() - t0)
    return times


def _warm(_: int) -> None:
    from mlff_distiller.distill.teachers import get_teacher  # noqa: F401  (imports tblite, ASE: outside the clock)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=6)
    ap.add_argument("--workers", type=int, default=0)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from mlff_distiller.distill.seeds import g2_chno

    pool = g2_chno()
    cores = os.cpu_count() or 1
    workers = args.workers or cores
    from importlib.metadata import version

    lines = [
        "# bench_teacher_md.py: GFN2-xTB MD on the CPU (the teacher of the shipped students)",
        "",
        f"{_cpu_name()} · {cores} cores · tblite {version('tblite')} · Python "
        f"{platform.python_version()} · host {platform.node()}",
        "",
        f"ASE's Langevin, 300 K, 0.5 fs, one OpenMP thread per process; {len(pool)} closed-shell CHNO molecules of g2.",
        "",
        "| molecule | atoms | ms per step (median) |",
        "|---|---:|---:|",
    ]
    per_step = []
    for k in range(0, len(pool), args.every):
        ms = 1e3 * statistics.median(_trajectory((k, args.steps, k)))
        per_step.append(ms)
        lines.append(f"| {pool[k].get_chemical_formula()} | {len(pool[k])} | {ms:.2f} |")
        print(lines[-1], flush=True)
    lines += ["", f"Mean over these {len(per_step)} molecules: **{statistics.mean(per_step):.2f} ms** per step.", ""]
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as procs:
        procs.map(_warm, range(workers))
        t0 = time.perf_counter()
        results = procs.map(_trajectory, [(k, args.steps, 100 + k) for k in range(len(pool))], chunksize=1)
        wall = time.perf_counter() - t0
    total_steps = sum(len(r) for r in results)  # the 3 warm-up steps per trajectory are in the wall clock too
    rate = (total_steps + 3 * len(pool)) / wall
    lines += [
        f"All {len(pool)} molecules, {args.steps} + 3 steps each, in {workers} processes: {wall:.2f} s, "
        f"**{rate:.0f} replica-steps per second** for the whole CPU ({1e3 / rate:.3f} ms per replica-step).",
    ]
    print(lines[-1], flush=True)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_teacher_md.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
