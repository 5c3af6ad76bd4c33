"""Probe (GPU): the Verlet list of one large molecule rebuilt on the host or on the device, per MD step.

Until stop 74 ``ForceEngine`` listed every non-periodic structure of up to 4M candidate pairs (2,000 atoms) on the
host by all pairs in NumPy, which grows as n² (on the development CPU 3.2 / 20 / 183 ms for 200 / 500 / 1,500
atoms); since then only up to ``engine_eager.HOST_LIST_MAX_PAIRS`` (a molecule of 181 atoms), larger ones on the
device. Per water cluster (``probe_md_rebuilds.water_cluster``, not periodic) this probe runs ``StudentCalculator``
(the shipped 64 x 3 student, fp32, its defaults: mode auto, skin 1 Å) over a trajectory whose atoms drift at a fixed
random velocity (0.01 Å a step: deterministic, the student's forces play no part), ``get_forces`` once a step, the
two ways alternating in one process (``--rounds`` each, a new calculator each): this stop's, and stop 73's (the limit
set back to 4M). Reported: the mean wall-clock µs a step (what a trajectory costs), the median of the steps, the
rebuilds.

    python benchmarks/probe_molecule_rebuild.py --out DIR [--waters 167,500] [--steps 300] [--rounds 2]
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
from harness import write_lines
from probe_md_rebuilds import water_cluster


def run(atoms0, steps: int, old: bool) -> tuple[float, float, int]:
    import mlff_distiller.engine_eager as eager
    from mlff_distiller import StudentCalculator
    from mlff_distiller.neighbors.molecular import MOLECULAR_MAX_PAIRS

    limit = eager.HOST_LIST_MAX_PAIRS
    if old:
        eager.HOST_LIST_MAX_PAIRS = MOLECULAR_MAX_PAIRS
    try:
        atoms = atoms0.copy()
        atoms.calc = StudentCalculator("builtin:chno-gfn2-small", device="cuda")
        v = np.random.default_rng(1).normal(size=atoms.positions.shape)
        v *= 0.01 / np.linalg.norm(v, axis=1, keepdims=True)
        for _ in range(10):
            atoms.positions += v
            atoms.get_forces()
        times = []
        for _ in range(steps):
            atoms.positions += v
            t0 = time.perf_counter()
            atoms.get_forces()
            times.append(time.perf_counter() - t0)
        builds = atoms.calc.engine.verlet.n_builds
    finally:
        eager.HOST_LIST_MAX_PAIRS = limit
    return statistics.fmean(times) * 1e6, statistics.median(times) * 1e6, builds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waters", default="167,500")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_molecule_rebuild")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_molecule_rebuild: needs a CUDA device")
        return 0
    import triton

    lines = [
        "# probe_molecule_rebuild.py: one large molecule's Verlet list on the host (stop 73) or the device (stop 74)",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
        f"builtin:chno-gfn2-small, fp32, StudentCalculator defaults · {args.steps} steps a run, drift 0.01 Å a step",
        "",
        "| water cluster | atoms | way | round | mean µs / step | median µs / step | list builds |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    summary = []
    for k in (int(x) for x in args.waters.split(",")):
        atoms0 = water_cluster(k)
        means = {"stop 74": [], "stop 73": []}
        for r in range(args.rounds):
            for way in means:
                mean, median, builds = run(atoms0, args.steps, old=way == "stop 73")
                means[way].append(mean)
                lines.append(f"| {k} waters | {len(atoms0)} | {way} | {r + 1} | {mean:.1f} | {median:.1f} | {builds} |")
                print(lines[-1], flush=True)
        a, b = statistics.median(means["stop 74"]), statistics.median(means["stop 73"])
        summary.append(f"| {k} waters | {len(atoms0)} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    lines += [
        "",
        "| water cluster | atoms | mean µs / step, stop 74 | stop 73 | stop 73 / stop 74 |",
        "|---|---:|---:|---:|---:|",
        *summary,
    ]
    write_lines(lines, Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
