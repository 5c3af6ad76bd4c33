"""Many MD trajectories at once (:class:`~mlff_distiller.batched_md.BatchedMD`) against one trajectory at a time
through ASE and :class:`~mlff_distiller.StudentCalculator`, in the same run.

    python benchmarks/bench_batched_md.py --out results/ [--sizes 1,16,64,256,1024,4096] [--steps 400]

Rows, each Langevin at 300 K, 0.5 fs, fp32, the shipped student (``--model``):

* ``ASE loop``: ASE's ``Langevin`` with the calculator (CUDA graphs, 1 Å skin), one molecule, the way a single
  trajectory runs today; ms per step, median of 100-step blocks after 200 warm-up steps. Its replica-steps per
  second are 1 / that.
* ``BatchedMD``: N copies of benzene, and N molecules cycled from the 61 closed-shell H/C/N/O g2 molecules (the shipped
  student's training set), all advanced together; ms per step (median of 50-step blocks after 100 warm-up steps,
  synchronised), µs per replica-step, and the list's builds per 1,000 steps.
* ``reference``: the same BatchedMD on the plain-PyTorch reference kernels, eager (``--ref-sizes``).
* ``integrator eager``: BatchedMD with ``cuda_graphs=False`` (``--eager-sizes``).
* ``not speculative``: the engine's speculative launch off (``--nospec-sizes``): a step launched before the
  displacement test is discarded when the list is rebuilt, and many replicas rebuild often.
* ``engine only``: the engine call of the BatchedMD step alone (same batch, no integration), to show the
  integrator's own cost.

Writes ``<out>/bench_batched_md.md``.
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

from harness import environment, sync, write_lines

TABLE_HEAD = [
    "| system | replicas | atoms | ms per step (p20-p80) | µs per replica-step | x ASE loop | builds / 1k steps "
    "| engine call ms | with a rebuild ms | first step s | mean T K |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
]


def g2_pool() -> list:
    """The 61 closed-shell CHNO molecules of ASE's g2 (the shipped students' training set; runs before stop 35's
    last took all 85 CHNO entries, radicals included)."""
    from mlff_distiller.distill.seeds import g2_chno

    return g2_chno()


def ase_loop_ms(model, atoms, steps: int) -> float:
    """ms per step of ASE's Langevin with the calculator, one molecule (median of 100-step blocks)."""
    from ase import units
    from ase.constraints import FixCom
    from ase.md.langevin import Langevin

    from mlff_distiller import StudentCalculator
    from mlff_distiller.ase_compat import maxwell_boltzmann

    atoms = atoms.copy()
    atoms.set_constraint(FixCom())
    atoms.calc = StudentCalculator(model, check_domain=None)
    rng = np.random.default_rng(0)
    maxwell_boltzmann(atoms, 300.0, rng=rng)
    dyn = Langevin(atoms, timestep=0.5 * units.fs, temperature_K=300.0, friction=0.01 / units.fs, rng=rng, fixcm=False)
    dyn.run(200)
    times = []
    for _ in range(max(steps // 100, 3)):
        t0 = time.perf_counter()
        dyn.run(100)
        times.append((time.perf_counter() - t0) / 100)
    return 1e3 * statistics.median(times)


def batched_ms(model, structures, steps: int, device, **kw) -> dict:
    """ms per BatchedMD step (median of 50-step blocks after 100 warm-up steps), list builds per 1,000 steps, and the
    engine call alone."""
    from mlff_distiller.batched_md import BatchedMD

    speculative = kw.pop("speculative", None)
    t0 = time.perf_counter()
    md = BatchedMD(model, structures, device=device, seed=0, **kw)
    md.engine.speculative_verlet = speculative
    md.run(1)
    sync(device)
    startup = time.perf_counter() - t0
    md.run(99)
    builds0 = md.engine.verlet.n_builds
    times = []
    blocks = max(steps // 50, 3)
    for _ in range(blocks):
        sync(device)
        t0 = time.perf_counter()
        md.run(50)
        sync(device)
        times.append((time.perf_counter() - t0) / 50)
    builds = md.engine.verlet.n_builds - builds0
    # the engine call alone, on the current positions (the list kept: no rebuild)
    engine_times = []
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(20):
            md.engine.compute(md._batch)
        sync(device)
        engine_times.append((time.perf_counter() - t0) / 20)
    # the engine call with a list rebuild (what a step costs when some atom moved more than skin / 2)
    rebuild_times = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        md.engine.verlet.reset()
        md.engine.compute(md._batch)
        sync(device)
        rebuild_times.append(time.perf_counter() - t0)
    temps = md.temperatures()
    return {
        "rebuild_ms": 1e3 * statistics.median(rebuild_times),
        "ms": 1e3 * statistics.median(times),
        "p20": 1e3 * float(np.percentile(times, 20)),
        "p80": 1e3 * float(np.percentile(times, 80)),
        "builds_per_1000": 1000.0 * builds / (50 * blocks),
        "engine_ms": 1e3 * statistics.median(engine_times),
        "startup_s": startup,
        "mean_T": float(np.mean(temps)),
        "finite": bool(np.isfinite(md.potential_energies()).all()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--model", default="builtin:chno-gfn2")
    ap.add_argument("--sizes", default="1,16,64,256,1024,4096")
    ap.add_argument("--ref-sizes", default="1,64,1024")
    ap.add_argument("--eager-sizes", default="1,1024", help="g2 rows with the integrator launched kernel by kernel")
    ap.add_argument("--nospec-sizes", default="64,1024,4096", help="g2 rows without the speculative launch")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--budget-s", type=float, default=420.0, help="rows left once this many seconds have passed")
    args = ap.parse_args()
    from ase.build import molecule

    from mlff_distiller import kernels, load_model

    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device, 0.0)
    model = load_model(args.model)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    ref_sizes = [int(x) for x in args.ref_sizes.split(",") if x]
    pool = g2_pool()
    lines = [
        "# bench_batched_md.py: many MD trajectories in one engine call per step",
        "",
        f"{env.device} · torch {env.torch} · Triton {env.triton} · commit {env.commit} · host {env.host} · "
        f"student {args.model}",
        "",
        "Langevin, 300 K, 0.5 fs, friction 0.01/fs, fp32, 1 Å skin. ASE loop: ASE's `Langevin` + `StudentCalculator` "
        "(with `FixCom`), one molecule, ms per step (median of 100-step blocks after 200). BatchedMD: BAOAB, all "
        "replicas in one engine call per step, ms per step (median of 50-step blocks after 100; p20-p80), µs per "
        "replica-step, the list's builds per 1,000 steps, the engine call alone (same batch, list kept) and with the "
        "list rebuilt, and the first step (engine set-up, kernels, capture). x ASE loop: replica-steps per second "
        "against the ASE loop's.",
        "",
    ]
    ase_ms = {}
    lines += ["| ASE loop, one molecule | ms per step |", "|---|---:|"]
    for name in ("C6H6", "H2O", "CH3CH2OH"):
        ase_ms[name] = ase_loop_ms(model, molecule(name), args.steps)
        lines.append(f"| {name} | {ase_ms[name]:.3f} |")
        print(lines[-1], flush=True)
    # the g2 mixture's ASE figure: the mean over a sample of its molecules
    sample = [pool[k] for k in range(0, len(pool), 8)]
    g2_ms = statistics.mean(ase_loop_ms(model, a, 300) for a in sample)
    lines.append(f"| mean over {len(sample)} g2 molecules (every 8th) | {g2_ms:.3f} |")
    print(lines[-1], flush=True)
    lines += [
        "",
        *TABLE_HEAD,
    ]
    skipped = []

    def row(label, structures, base_ms, **kw):
        if time.perf_counter() - t_start > args.budget_s:
            skipped.append(f"{label} x {len(structures)}")
            return
        r = batched_ms(model, structures, args.steps, device, **kw)
        n = len(structures)
        atoms = sum(len(a) for a in structures)
        lines.append(
            f"| {label} | {n} | {atoms} | {r['ms']:.3f} ({r['p20']:.3f}-{r['p80']:.3f}) | {1e3 * r['ms'] / n:.2f} | "
            f"{base_ms * n / r['ms']:.1f} | {r['builds_per_1000']:.1f} | {r['engine_ms']:.3f} | "
            f"{r['rebuild_ms']:.3f} | {r['startup_s']:.2f} | "
            f"{r['mean_T']:.0f}{'' if r['finite'] else ' NON-FINITE'} |"
        )
        print(lines[-1], flush=True)

    for n in sizes:
        row("benzene", [molecule("C6H6")] * n, ase_ms["C6H6"])
        row("g2 mix", [pool[k % len(pool)] for k in range(n)], g2_ms)
    lines += ["", "The same BatchedMD with its integrator's kernels launched one by one (`cuda_graphs=False`):", ""]
    lines += TABLE_HEAD
    for n in [int(x) for x in args.eager_sizes.split(",") if x]:
        row("g2 mix, integrator eager", [pool[k % len(pool)] for k in range(n)], g2_ms, cuda_graphs=False)
    lines += ["", "Without the engine's speculative launch (`engine.speculative_verlet = False`):", ""]
    lines += TABLE_HEAD
    for n in [int(x) for x in args.nospec_sizes.split(",") if x]:
        row("g2 mix, not speculative", [pool[k % len(pool)] for k in range(n)], g2_ms, speculative=False)
    lines += ["", "The plain-PyTorch reference kernels, eager, the same BatchedMD:", ""]
    lines += TABLE_HEAD
    previous = kernels.get_backend()
    kernels.set_backend("torch")
    try:
        for n in ref_sizes:
            row("g2 mix, reference", [pool[k % len(pool)] for k in range(n)], g2_ms, mode="eager")
    finally:
        kernels.set_backend(previous)
    if skipped:
        lines += ["", f"Skipped (past the {args.budget_s:.0f} s budget): {', '.join(skipped)}."]
    lines += ["", f"Run: {time.perf_counter() - t_start:.0f} s."]
    write_lines(lines, args.out, "bench_batched_md")


if __name__ == "__main__":
    main()
