"""Probe (GPU): what the Verlet list's rebuilds cost an ASE MD run through ``StudentCalculator``, by system.

Velocity Verlet (0.5 fs, 300 K, the shipped student, fp32, the calculator's defaults: skin 1 Å, mode auto) on
molecules whose lists hold every pair (benzene: kept whatever the displacements since stop 67, ``keep_complete``;
and with that switch off, as before), on molecules whose lists do not (two of ASE's S22 dimers, a 20-water cluster:
their lists change at nearly every rebuild, ``results/stop67_gpu``), and on a periodic 192-atom water box (its list
built on the device). (ASE's adenine-thymine stack was dropped: the shipped student's MD of it heats to ~8,000 K and
flies apart within 500 steps, out of its training domain.) Wall clock between steps: the median of the steps that
kept the list, the median of those that rebuilt it, the mean of all (what a trajectory costs), the builds; with the
list rebuilt ahead of the launch that the calculator makes for the predicted positions
(``ForceEngine.rebuild_ahead``, stop 67) and without.

``--profile``: then ``torch.profiler`` (CPU and CUDA activity) over ``--profile-calls`` calculations of one system
that each rebuild its list (the list reset before each, positions moved by 0.01 Å), and over as many that keep it:
the top operations by self CPU time and by device time, to show where a rebuild's time goes.

    python benchmarks/probe_md_rebuilds.py --out DIR [--steps 1000] [--profile uracil-dimer] [--ab 2]
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

from mlff_distiller import StudentCalculator


def water_cluster(k: int, seed: int = 0):
    """``k`` randomly oriented waters at least 2.8 Å apart (oxygens), in a box of ~3.1 k^(1/3) Å, not periodic."""
    from ase import Atoms
    from ase.build import molecule

    rng = np.random.default_rng(seed)
    centers: list[np.ndarray] = []
    while len(centers) < k:
        p = rng.uniform(0.0, 3.1 * k ** (1 / 3), 3)
        if all(np.linalg.norm(p - q) > 2.8 for q in centers):
            centers.append(p)
    out = Atoms()
    for c in centers:
        w = molecule("H2O")
        w.rotate(float(rng.uniform(0, 360)), rng.normal(size=3))
        w.translate(c)
        out += w
    return out


def systems() -> dict:
    from ase.build import molecule
    from ase.collections import s22

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from systems import water_box

    return {
        "benzene": lambda: molecule("C6H6"),
        "benzene-dimer": lambda: s22["Benzene_dimer_parallel_displaced"],
        "uracil-dimer": lambda: s22["Uracil_dimer_h-bonded"],
        "water20": lambda: water_cluster(20),
        "water192-pbc": lambda: water_box(192),
    }


def run_md(
    atoms,
    steps: int,
    skin: float,
    keep_complete: bool,
    ahead: bool = True,
    host_fill: bool = True,
    device="cuda",
    caches: bool = True,
) -> dict:
    """One MD run; ``host_fill=False``: a molecule's rebuilt bucket filled on the device (as before stop 67);
    ``caches=False``: a device build copies the box's cell, pbc, batch and ptr, and its fill the numbers and batch
    vector, at every rebuild, and the list's molecular test reads the device (as before stop 67's last change)."""
    from unittest import mock

    import mlff_distiller.neighbors as nb
    from mlff_distiller import engine_verlet
    from mlff_distiller.neighbors.verlet import VerletNeighborList

    limit = engine_verlet.HOST_FILL_MAX_EDGES
    engine_verlet.HOST_FILL_MAX_EDGES = limit if host_fill else 0
    patches = []
    if not caches:
        patches = [
            mock.patch.object(VerletNeighborList, "_device_inputs", lambda self, ts, d: tuple(t.to(d) for t in ts)),
            mock.patch.object(
                engine_verlet.VerletPaths, "_fill_inputs", lambda self, n, b: (n.to(self.device), b.to(self.device))
            ),
            mock.patch.object(
                nb, "_molecular_on_device", lambda p, c, pbc, ptr, cut: nb.molecular_device_applicable(p, pbc, ptr)
            ),
        ]
    for patch in patches:
        patch.start()
    try:
        return _run_md(atoms, steps, skin, keep_complete, ahead, device)
    finally:
        engine_verlet.HOST_FILL_MAX_EDGES = limit
        for patch in patches:
            patch.stop()


def _run_md(atoms, steps: int, skin: float, keep_complete: bool, ahead: bool, device: str) -> dict:
    from ase import units
    from ase.md.verlet import VelocityVerlet

    from mlff_distiller.ase_compat import maxwell_boltzmann

    maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calc = StudentCalculator("builtin:chno-gfn2", device=device, skin=skin)
        atoms.calc = calc
        v = calc.engine.verlet
        v.keep_complete = keep_complete
        calc.engine.rebuild_ahead = ahead
        dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
        dyn.run(30)  # capture, warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        stamps: list[float] = []
        builds: list[int] = []

        def stamp() -> None:
            stamps.append(time.perf_counter())
            builds.append(v.n_builds)

        dyn.attach(stamp, interval=1)
        b0 = v.n_builds
        dyn.run(steps)
    t = np.diff(stamps) * 1e6
    rebuilt = np.diff(builds) > 0
    eng = calc.engine
    return {
        "atoms": len(atoms),
        "edges": v.last.num_edges,
        "complete": v.complete,
        "builds": v.n_builds - b0,
        "kept_us": float(np.median(t[~rebuilt])) if (~rebuilt).any() else float("nan"),
        "rebuild_us": float(np.median(t[rebuilt])) if rebuilt.any() else float("nan"),
        "mean_us": float(t.mean()),
        "ahead": f"{eng.n_ahead_taken} / {eng.n_ahead_missed}",
        "discarded": eng.n_discarded,
        "rebuilt_ahead": eng.n_rebuilt_ahead,
        "graphs": len(eng.captured_buckets),
    }


def profile_calls(atoms, calls: int, top: int) -> list[str]:
    """torch.profiler tables over ``calls`` calculations that rebuild (list reset before each) and as many that keep."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calc = StudentCalculator("builtin:chno-gfn2", device="cuda")
        atoms.calc = calc
        rng = np.random.default_rng(1)
        for _ in range(30):
            atoms.positions = atoms.positions + rng.uniform(-0.003, 0.003, atoms.positions.shape)
            atoms.get_forces()
        out: list[str] = []
        for kind in ("rebuild", "keep"):
            walls = []
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    atoms.positions = atoms.positions + rng.uniform(-0.003, 0.003, atoms.positions.shape)
                    if kind == "rebuild":
                        calc.engine.verlet.reset()
                    t0 = time.perf_counter()
                    atoms.get_forces()
                    walls.append(time.perf_counter() - t0)
            w = np.array(walls) * 1e6
            out += [
                "",
                f"## {kind}: {calls} calculations, median {np.median(w):.1f} µs (profiled)",
                "",
                "```",
                prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60),
                "```",
                "",
                "```",
                prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60),
                "```",
            ]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="probe_md_rebuilds_h200")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--systems", default="benzene,benzene-dimer,uracil-dimer,water20,water192-pbc")
    p.add_argument("--profile", default="", help="a system to profile (e.g. uracil-dimer); empty: none")
    p.add_argument("--profile-calls", type=int, default=40)
    p.add_argument("--top", type=int, default=30)
    p.add_argument(
        "--ab",
        type=int,
        default=0,
        help="rounds of stop 66's behaviour (every list rebuilt by the displacement test, after the launch on the "
        "old list, its bucket filled on the device) against stop 67's, alternating; 0: the switches one by one",
    )
    p.add_argument(
        "--caches-ab",
        type=int,
        default=0,
        help="rounds of the device builds' copies without the kept device inputs against with them, alternating",
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("probe_md_rebuilds: needs CUDA")
        return
    import triton

    makers = systems()
    lines = [
        "# probe_md_rebuilds.py: the Verlet list's rebuilds in an ASE MD run through StudentCalculator",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
        f"builtin:chno-gfn2, fp32, velocity Verlet 0.5 fs from 300 K, {args.steps} steps, mode auto",
        "",
        "| system | atoms | skin Å | keep_complete | rebuild_ahead | list pairs | complete | builds | kept step µs "
        "(median) | rebuild step µs (median) | mean µs | ahead taken / missed | rebuilt ahead | discarded | graphs |",
        "|---|---:|---:|---|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    cases = []
    if args.caches_ab:
        lines[-2] = lines[-2].replace("| rebuild_ahead |", "| rebuild_ahead, device caches |")
        for name in args.systems.split(","):
            for _ in range(args.caches_ab):
                for caches in (False, True):
                    r = run_md(makers[name](), args.steps, 1.0, True, True, True, caches=caches)
                    lines.append(
                        f"| {name} | {r['atoms']} | 1.0 | True | True, {caches} | {r['edges']} | {r['complete']} | "
                        f"{r['builds']} | {r['kept_us']:.1f} | {r['rebuild_us']:.1f} | {r['mean_us']:.1f} | "
                        f"{r['ahead']} | {r['rebuilt_ahead']} | {r['discarded']} | {r['graphs']} |"
                    )
                    print(lines[-1], flush=True)
        write_lines(lines, args.out, args.name)
        return
    for name in args.systems.split(","):
        if args.ab:  # (name, skin, keep_complete, rebuild_ahead, host fill): stop 66, then stop 67
            cases += [
                c for _ in range(args.ab) for c in ((name, 1.0, False, False, False), (name, 1.0, True, True, True))
            ]
        elif name == "benzene":  # complete: kept, or rebuilt by the displacement test (ahead or not)
            cases += [(name, s, True, True, True) for s in (1.0, 0.3)]
            cases += [(name, 0.3, False, a, True) for a in (True, False)]
        else:
            cases += [(name, 1.0, True, a, True) for a in (True, False)]
    if args.ab:
        lines[-2] = lines[-2].replace("| rebuild_ahead |", "| rebuild_ahead, host fill |")
    for name, skin, keep, ahead, fill in cases:
        r = run_md(makers[name](), args.steps, skin, keep, ahead, fill)
        lines.append(
            f"| {name} | {r['atoms']} | {skin} | {keep} | {ahead}{', ' + str(fill) if args.ab else ''} | "
            f"{r['edges']} | {r['complete']} | {r['builds']} | {r['kept_us']:.1f} | {r['rebuild_us']:.1f} | "
            f"{r['mean_us']:.1f} | {r['ahead']} | {r['rebuilt_ahead']} | {r['discarded']} | {r['graphs']} |"
        )
        print(lines[-1], flush=True)
    if args.profile:
        lines += ["", f"# torch.profiler: {args.profile}"]
        lines += profile_calls(makers[args.profile](), args.profile_calls, args.top)
    write_lines(lines, args.out, args.name)


if __name__ == "__main__":
    main()
