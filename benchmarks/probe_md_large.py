"""Probe (GPU): an ASE MD step of a large periodic box through ``StudentCalculator``, captured against eager.

Since stop 51 a system of ``spatial_sort_min_atoms`` (10,000) atoms or more takes the padded (captured) Verlet path
while its ``cutoff + skin`` list fits the engine's ladder (mode "auto": ``engine.auto_max_edges`` of the student's
width), in the caller's atom order; before, such systems always ran eagerly in Morton order, and an eager step
costs ~10 ms of host launches on stop 51's H200 host. The padded step carries the skin's extra pairs (they
contribute zero but are computed), the eager one the list filtered to the cutoff. Per student width and water box
this probe runs velocity Verlet (0.5 fs, 300 K) through two calculators, alternating blocks of steps in one process:

* ``shipped``: the calculator as it is (captured where the list fits);
* ``eager``: the same with a ladder that holds no such box (64 edges at most): the pre-stop-51 path.

It reports the median ms per MD step over ``--blocks`` blocks of ``--steps`` steps (after ``--warmup`` steps),
the path each took, the edges of the skin list against the ladder's limit, and the largest force difference of
the two calculators on the same positions.

    python benchmarks/probe_md_large.py --hidden 64,128 --atoms 6000,12000,18000 --out DIR [--name NAME]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import write_lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", default="64,128")
    ap.add_argument("--atoms", default="6000,12000,18000")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_md_large")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_md_large: needs a CUDA device")
        return 0
    import triton
    from ase import units
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
    from ase.md.verlet import VelocityVerlet
    from bench_large import box
    from peers import make_student

    from mlff_distiller import StudentCalculator
    from mlff_distiller.buckets import BucketLadder
    from mlff_distiller.engine import auto_max_edges

    rows = []
    for hidden in (int(h) for h in args.hidden.split(",")):
        model = make_student(hidden=hidden)
        for n in (int(a) for a in args.atoms.split(",")):
            base = box(n).copy()
            MaxwellBoltzmannDistribution(base, temperature_K=300, rng=np.random.default_rng(0))
            runs = {}
            for name in ("shipped", "eager"):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    calc = StudentCalculator(model, device="cuda")
                if name == "eager":
                    calc.engine.buckets = BucketLadder(min_atoms=8, max_atoms=16, min_edges=16, max_edges=64)
                atoms = base.copy()
                atoms.calc = calc
                dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
                dyn.run(args.warmup)
                runs[name] = {"calc": calc, "atoms": atoms, "dyn": dyn, "blocks": []}
            for _ in range(args.blocks):
                for r in runs.values():
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    r["dyn"].run(args.steps)
                    r["blocks"].append((time.perf_counter() - t0) / args.steps * 1e3)
            probe = base.copy()  # the same positions through both calculators
            forces = {}
            for name, r in runs.items():
                probe.calc = r["calc"]
                forces[name] = probe.get_forces()
            eng = runs["shipped"]["calc"].engine
            last = eng.verlet.last if eng.verlet is not None else None
            row = {
                "hidden": hidden,
                "atoms": n,
                "edges": None if last is None else last.num_edges,
                "limit": auto_max_edges(hidden),
                "shipped": statistics.median(runs["shipped"]["blocks"]),
                "eager": statistics.median(runs["eager"]["blocks"]),
                "path": "captured" if eng._verlet_fill is not None and eng._verlet_sorted is False else "eager",
                "df": float(np.abs(forces["shipped"] - forces["eager"]).max()),
            }
            rows.append(row)
            print(row, flush=True)
            del runs, probe
            torch.cuda.empty_cache()
    lines = [
        "# probe_md_large.py: an ASE MD step of a large water box through StudentCalculator, captured against eager",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · random-weight "
        "students (peers.make_student), float32, mode auto, skin 1 Å; velocity Verlet 0.5 fs from 300 K; median ms "
        f"per step of {args.blocks} blocks of {args.steps} steps after {args.warmup}, the two calculators alternating",
        "",
        "| hidden | water atoms | skin-list edges | auto_max_edges | shipped ms/step (path) | eager ms/step | "
        "eager / shipped | max abs ΔF, eV/Å |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        edges = "" if r["edges"] is None else f"{r['edges']:,}"
        lines.append(
            f"| {r['hidden']} | {r['atoms']:,} | {edges} | {r['limit']:,} | {r['shipped']:.2f} ({r['path']}) | "
            f"{r['eager']:.2f} | {r['eager'] / r['shipped']:.3f} | {r['df']:.2e} |"
        )
    write_lines(lines, Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
