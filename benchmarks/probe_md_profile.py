"""Where the host's time goes in one ASE MD step of benzene through ``StudentCalculator`` (issue 5's "≤ 0.20 ms per
MD step"): velocity Verlet under ``cProfile`` after a warm-up, the functions by their own time and by their
cumulative time (cProfile's overhead inflates small Python functions; read the ranking, not the µs). The shipped 64 x 3
student, fp32, mode auto (the dense step, the next step launched ahead).

    python benchmarks/probe_md_profile.py --steps 3000 > md_profile.txt
"""

from __future__ import annotations

import argparse
import cProfile
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import profile_tables
from probe_md_step import _benzene


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--model", default="builtin:chno-gfn2-small")
    p.add_argument("--top", type=int, default=45)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_md_profile: needs CUDA")
        return
    from ase import units
    from ase.md.verlet import VelocityVerlet

    from mlff_distiller import StudentCalculator, load_model

    atoms = _benzene()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        atoms.calc = StudentCalculator(load_model(args.model), device="cuda", precision="fp32")
    dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
    dyn.run(300)
    t0 = time.perf_counter()
    dyn.run(args.steps)
    plain = (time.perf_counter() - t0) / args.steps * 1e6
    prof = cProfile.Profile()
    prof.enable()
    dyn.run(args.steps)
    prof.disable()
    t0 = time.perf_counter()
    dyn.run(args.steps)
    after = (time.perf_counter() - t0) / args.steps * 1e6
    eng = atoms.calc.engine
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.steps} steps")
    print(f"# mean µs a step without the profiler: {plain:.1f} before, {after:.1f} after")
    print(f"# launches ahead taken {eng.n_ahead_taken}, missed {eng.n_ahead_missed}; list builds {eng.verlet.n_builds}")
    print(profile_tables(prof, args.top))


if __name__ == "__main__":
    main()
