"""Probe (GPU host): where an MD step that rebuilds its Verlet list goes (stop 66: 1.3-2.1 ms against ~0.19 for one
that keeps it, benchmarks/results/stop66_gpu/h/, i/, j/).

Velocity Verlet on benzene through ``StudentCalculator`` (the shipped student, fp32, 0.5 fs, 300 K, skin 0.3 Å: a
rebuild every ~23 steps). Each ``get_forces`` call runs under its own ``cProfile`` profiler; the profiles of the
calls that rebuilt the list are summed, and so, separately, are those of the calls that kept it. Writes both
tables (cumulative time, the top functions) and the calls' median wall times.

    python benchmarks/probe_rebuild_step.py --out DIR [--steps 3000]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_lines

from mlff_distiller import StudentCalculator


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="probe_rebuild_step_h200")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--top", type=int, default=45)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("probe_rebuild_step: needs CUDA")
        return
    from ase import units
    from ase.build import molecule
    from ase.md.verlet import VelocityVerlet

    from mlff_distiller.ase_compat import maxwell_boltzmann

    atoms = molecule("C6H6")
    maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calc = StudentCalculator("builtin:chno-gfn2", device="cuda", skin=0.3)
    atoms.calc = calc
    dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
    dyn.run(50)
    v = calc.engine.verlet
    real = calc.calculate
    kept: dict[str, object] = {"rebuild": None, "keep": None}
    walls: dict[str, list[float]] = {"rebuild": [], "keep": []}

    def calculate(*a, **k):
        prof = cProfile.Profile()
        builds = v.n_builds
        t0 = time.perf_counter()
        prof.enable()
        try:
            return real(*a, **k)
        finally:
            prof.disable()
            kind = "rebuild" if v.n_builds > builds else "keep"
            walls[kind].append(time.perf_counter() - t0)
            if kept[kind] is None:
                kept[kind] = pstats.Stats(prof)
            else:
                kept[kind].add(prof)

    calc.calculate = calculate
    dyn.run(args.steps)
    import triton

    lines = [
        "# probe_rebuild_step.py: an MD step's calculation that rebuilds the Verlet list, against one that keeps it",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · benzene, "
        f"builtin:chno-gfn2, fp32, velocity Verlet 0.5 fs, skin 0.3 Å, {args.steps} steps",
        "",
    ]
    for kind in ("rebuild", "keep"):
        w = np.array(walls[kind]) * 1e6
        lines.append(f"{kind}: {len(w)} calculations, median {np.median(w):.1f} µs, mean {w.mean():.1f} µs (profiled)")
    for kind in ("rebuild", "keep"):
        buf = io.StringIO()
        st = kept[kind]
        st.stream = buf
        st.sort_stats("cumulative").print_stats(args.top)
        lines += ["", f"## {kind}: cumulative", "", "```", buf.getvalue().strip(), "```"]
        buf = io.StringIO()
        st.stream = buf
        st.sort_stats("tottime").print_stats(25)
        lines += ["", f"## {kind}: own time", "", "```", buf.getvalue().strip(), "```"]
    write_lines(lines, args.out, args.name)


if __name__ == "__main__":
    main()
