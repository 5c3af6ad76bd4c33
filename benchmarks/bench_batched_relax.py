"""Many relaxations at once (:func:`~mlff_distiller.batched_relax.relax_batch`) against ASE's FIRE with
:class:`~mlff_distiller.StudentCalculator`, one structure at a time, in the same run.

    python benchmarks/bench_batched_relax.py --out results/ [--sizes 1,64,1024,4096] [--ase-count 16]

Structures: the 61 closed-shell CHNO g2 molecules (cycled), each rattled by 0.1 Å (seeded), fmax 0.05 eV/Å,
at most 1,000 steps, fp32. ASE: the first ``--ase-count`` of them relaxed one after another (seconds per structure,
mean). Each size is timed twice: with a new engine (after ``clear_engine_cache()``: the engine's start and bucket
captures in the call) and with the engine the first call kept. Writes ``<out>/bench_batched_relax.md``, and a
cProfile of the kept call of ``--profile`` structures (``relax_profile_<n>.txt``).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import environment, sync, write_lines


def rattled(n: int) -> list:
    from mlff_distiller.distill.seeds import g2_chno

    pool = g2_chno()
    out = []
    for k in range(n):
        a = pool[k % len(pool)].copy()
        a.rattle(0.1, seed=k)
        out.append(a)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--model", default="builtin:chno-gfn2")
    ap.add_argument("--sizes", default="1,64,1024,4096")
    ap.add_argument("--ase-count", type=int, default=16)
    ap.add_argument("--fmax", type=float, default=0.05)
    ap.add_argument("--profile", type=int, default=64, help="cProfile the kept call of this size (0: none)")
    ap.add_argument(
        "--stream",
        default="",
        help="N:MAX_ATOMS: also relax N structures all at once and with max_atoms=MAX_ATOMS (streamed), same run",
    )
    args = ap.parse_args()
    from ase.optimize import FIRE

    from mlff_distiller import StudentCalculator, load_model
    from mlff_distiller.batched_relax import relax_batch
    from mlff_distiller.batching import NonFiniteOutputError
    from mlff_distiller.predict import clear_engine_cache

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device, 0.0)
    model = load_model(args.model)
    lines = [
        "# bench_batched_relax.py: many FIRE relaxations in one engine call per step",
        "",
        f"{env.device} · torch {env.torch} · Triton {env.triton} · commit {env.commit} · host {env.host} · "
        f"student {args.model}",
        "",
        f"g2 molecules (61 closed-shell CHNO, cycled), rattled 0.1 Å, fmax {args.fmax} eV/Å, at most 1,000 FIRE "
        "steps, fp32.",
        "",
    ]
    # ASE, one structure at a time (warm: the calculator's engine is built and its bucket captured before the clock)
    calc = StudentCalculator(model, check_domain=None)
    warm = rattled(1)[0]
    warm.calc = calc
    FIRE(warm, logfile=None).run(fmax=args.fmax, steps=50)
    ase_s, ase_steps, ase_failed = [], [], 0
    for a in rattled(args.ase_count):
        a.calc = calc
        opt = FIRE(a, logfile=None)
        t0 = time.perf_counter()
        try:
            opt.run(fmax=args.fmax, steps=1000)
        except NonFiniteOutputError:  # the student let the structure collapse (see the note below the table)
            ase_failed += 1
            continue
        ase_s.append(time.perf_counter() - t0)
        ase_steps.append(opt.nsteps)
    per_ase = float(np.mean(ase_s))
    lines += [
        f"ASE's FIRE + `StudentCalculator` (one shared calculator), the first {args.ase_count} structures one after "
        f"another: **{1e3 * per_ase:.1f} ms per structure** (mean; {np.mean(ase_steps):.0f} steps on average, "
        f"{1e3 * sum(ase_s) / sum(ase_steps):.3f} ms per step; {ase_failed} stopped by non-finite forces, not "
        "counted).",
        "",
        "| structures | atoms | seconds, new engine | seconds, engine kept | ms per structure (kept) | "
        "x ASE one by one (new / kept) | converged | non-finite | most steps | ms per step (kept) | "
        "seconds, kept, all stay (`compact=0`) | all stay / compacting |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    print(lines[-4], flush=True)
    for n in [int(x) for x in args.sizes.split(",") if x]:
        structures = rattled(n)
        timings = []
        # A new engine (its buckets captured in the call), then the kept one, then the kept one with every
        # structure left in the batch to the end (compact=0, as before stop 37).
        for kept, compact in ((False, 0.5), (True, 0.5), (True, 0.0)):
            if not kept:
                clear_engine_cache()
            profile = cProfile.Profile() if kept and compact and n == args.profile else None
            sync(device)
            t0 = time.perf_counter()
            if profile is not None:
                profile.enable()
            try:
                out = relax_batch(model, structures, fmax=args.fmax, steps=1000, device=device, compact=compact)
                failed = 0
            except NonFiniteOutputError as exc:  # named structures stopped; the others are relaxed
                out = [a for a in exc.results if a is not None]
                failed = len(exc.indices)
            sync(device)
            timings.append(time.perf_counter() - t0)
            if profile is not None:
                profile.disable()
                with open(Path(args.out) / f"relax_profile_{n}.txt", "w") as fh:
                    pstats.Stats(profile, stream=fh).sort_stats("tottime").print_stats(30)
        new_s, kept_s, whole_s = timings
        done = sum(bool(a.info["relax_converged"]) for a in out)
        most = max(int(a.info["relax_steps"]) for a in out)
        atoms = sum(len(a) for a in structures)
        lines.append(
            f"| {n} | {atoms} | {new_s:.3f} | {kept_s:.3f} | {1e3 * kept_s / n:.3f} | "
            f"{per_ase * n / new_s:.1f} / {per_ase * n / kept_s:.1f} | {done} | {failed} | {most} | "
            f"{1e3 * kept_s / (most + 1):.2f} | {whole_s:.3f} | {whole_s / kept_s:.2f} |"
        )
        print(lines[-1], flush=True)
    lines += [
        "",
        "New engine: the call after `clear_engine_cache()`, which builds its engine and captures its buckets. Engine "
        "kept: the same call again (relax_batch keeps its engine like predict_forces). The batch runs until its "
        "slowest structure converges (ms per step: the kept call over its most steps + 1 force calls). "
        "Non-finite: structures whose forces stopped being finite (a student without the ZBL wall let two atoms "
        "collapse). All stay: the kept engine with `compact=0`, every structure in the batch to the end; by default "
        "the finished structures leave it once half are done (batches of at least `COMPACT_MIN_ATOMS` atoms).",
    ]
    if args.stream:
        n, budget = (int(x) for x in args.stream.split(":"))
        structures = rattled(n)
        lines += [
            "",
            f"Streaming: {n} structures ({sum(len(a) for a in structures)} atoms) all at once against at most "
            f"`max_atoms={budget}` at a time (finished structures make room for the next), the engine kept (a "
            "warm-up call of each first).",
            "",
            "| how | seconds | ms per structure | converged | most steps |",
            "|---|---:|---:|---:|---:|",
        ]
        for label, limit in (("all at once", None), (f"max_atoms={budget}", budget), ("max_atoms='auto'", "auto")):
            relax_batch(model, structures[:256], fmax=args.fmax, steps=1000, device=device, max_atoms=limit)
            sync(device)
            t0 = time.perf_counter()
            out = relax_batch(model, structures, fmax=args.fmax, steps=1000, device=device, max_atoms=limit)
            sync(device)
            seconds = time.perf_counter() - t0
            done = sum(bool(a.info["relax_converged"]) for a in out)
            most = max(int(a.info["relax_steps"]) for a in out)
            lines.append(f"| {label} | {seconds:.3f} | {1e3 * seconds / n:.3f} | {done} | {most} |")
            print(lines[-1], flush=True)
    write_lines(lines, args.out, "bench_batched_relax")


if __name__ == "__main__":
    main()
