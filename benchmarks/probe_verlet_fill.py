"""Probe (GPU): a molecule's Verlet rebuild step with the bucket filled on the host (``fill_padded_host``, stop 66)
against the device fill (``fill_padded``), alternating in one process.

Velocity Verlet on benzene through ``StudentCalculator`` (the shipped student, fp32, 0.5 fs, 300 K, skin 0.3 Å so
that the list is rebuilt every few dozen steps), wall clock per step: the median, the mean, and the mean of the
steps that rebuilt the list. The device fill is forced by ``engine_padded.HOST_FILL_MAX_EDGES = 0``.

    python benchmarks/probe_verlet_fill.py --out DIR [--steps 3000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_lines

from mlff_distiller import StudentCalculator, engine_padded


def _run(steps: int, host_fill: bool) -> tuple[float, float, float, int]:
    from ase import units
    from ase.build import molecule
    from ase.md.verlet import VelocityVerlet

    from mlff_distiller.ase_compat import maxwell_boltzmann

    limit = engine_padded.HOST_FILL_MAX_EDGES
    engine_padded.HOST_FILL_MAX_EDGES = limit if host_fill else 0
    try:
        atoms = molecule("C6H6")
        maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(0))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            atoms.calc = StudentCalculator("builtin:chno-gfn2", device="cuda", skin=0.3)
        dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
        dyn.run(50)
        v = atoms.calc.engine.verlet
        stamps, builds = [], []

        def stamp():
            stamps.append(time.perf_counter())
            builds.append(v.n_builds)

        dyn.attach(stamp, interval=1)
        dyn.run(steps)
    finally:
        engine_padded.HOST_FILL_MAX_EDGES = limit
    t = np.diff(stamps) * 1e6
    rebuilt = np.diff(builds) > 0
    return float(np.median(t)), float(t.mean()), float(t[rebuilt].mean()) if rebuilt.any() else 0.0, int(rebuilt.sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="probe_verlet_fill_h200")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("probe_verlet_fill: needs CUDA")
        return
    import triton

    lines = [
        "# probe_verlet_fill.py: a molecule's Verlet rebuild, host fill against device fill",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · benzene, "
        f"builtin:chno-gfn2, fp32, velocity Verlet 0.5 fs, skin 0.3 Å, {args.steps} steps a row",
        "",
        "| fill | round | median µs / step | mean µs / step | mean µs of a rebuild step | rebuilds |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for rnd in range(1, args.rounds + 1):
        for host in (False, True):
            med, mean, build, n = _run(args.steps, host)
            lines.append(f"| {'host' if host else 'device'} | {rnd} | {med:.1f} | {mean:.1f} | {build:.1f} | {n} |")
            print(lines[-1], flush=True)
    write_lines(lines, args.out, args.name)


if __name__ == "__main__":
    main()
