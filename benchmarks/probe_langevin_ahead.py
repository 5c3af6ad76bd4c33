"""Probe (GPU): ASE Langevin MD through ``StudentCalculator``, its next positions predicted or not (stop 68).

``mlff-distill md``'s default integrator is ASE's ``Langevin`` with ``FixCom`` on a molecule. Until stop 68 the
calculator's launch ahead (stop 66) predicted velocity Verlet only: a Langevin step could not be launched before ASE
asked for it, its noise being drawn at the start of the step. With ``StudentCalculator.follow(dyn)`` the calculator
draws the same noise from a copy of the integrator's generator (``mlff_distiller._langevin_ahead``). Here, per
system, the wall clock per step (median, mean) of Langevin followed and not followed, alternating rounds, and
velocity Verlet beside; the launches taken and missed.

    python benchmarks/probe_langevin_ahead.py --out DIR [--steps 1000] [--rounds 2] [--model builtin:chno-gfn2-small]
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


def _run(model: str, name: str, kind: str, steps: int) -> tuple[float, float, int, int]:
    from ase import units
    from ase.build import molecule
    from ase.constraints import FixCom
    from ase.md.langevin import Langevin
    from ase.md.verlet import VelocityVerlet

    from mlff_distiller.ase_compat import maxwell_boltzmann

    atoms = molecule(name)
    maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calc = StudentCalculator(model, device="cuda")
    atoms.calc = calc
    if kind == "verlet":
        dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
    else:
        atoms.set_constraint(FixCom())  # as mlff-distill md runs a molecule
        dyn = Langevin(
            atoms, timestep=0.5 * units.fs, temperature_K=300, friction=0.01 / units.fs,
            rng=np.random.default_rng(1), fixcm=False,
        )  # fmt: skip
        if kind == "langevin followed":
            calc.follow(dyn)
    dyn.run(50)  # warm-up: the capture, the first launches
    eng = calc.engine
    taken0, missed0 = eng.n_ahead_taken, eng.n_ahead_missed
    t = np.empty(steps)
    prev = time.perf_counter()
    for k in range(steps):
        dyn.run(1)
        now = time.perf_counter()
        t[k], prev = now - prev, now
    return float(np.median(t) * 1e6), float(t.mean() * 1e6), eng.n_ahead_taken - taken0, eng.n_ahead_missed - missed0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--name", default="probe_langevin_ahead")
    ap.add_argument("--model", default="builtin:chno-gfn2-small")
    ap.add_argument("--systems", default="C6H6,CH3CH2OH")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cli-steps", type=int, default=0, help="also time mlff-distill md's run_md (0: not)")
    args = ap.parse_args()
    import triton

    lines = [
        f"# {args.name}",
        "",
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}; {args.model}, "
        f"fp32, 0.5 fs, 300 K, friction 0.01 / fs, FixCom (Langevin); {args.steps} steps after 50 of warm-up; wall "
        "clock between steps; the integrators' order rotates from round to round.",
        "",
        "| system | integrator | round | median µs | mean µs | launches taken | missed |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name in args.systems.split(","):
        for r in range(args.rounds):
            kinds = ("langevin followed", "langevin", "verlet")
            for kind in kinds[r % 3 :] + kinds[: r % 3]:  # the order rotated from round to round
                med, mean, taken, missed = _run(args.model, name, kind, args.steps)
                lines.append(f"| {name} | {kind} | {r + 1} | {med:.1f} | {mean:.1f} | {taken} | {missed} |")
                print(lines[-1], flush=True)
    if args.cli_steps:
        lines += [
            "",
            f"## `mlff-distill md` (run_md), benzene, its defaults (builtin:chno-gfn2, Langevin with FixCom, a frame "
            f"every 10 steps), {args.cli_steps} steps: s_per_step",
            "",
            "| round | followed µs/step | not followed µs/step |",
            "|---:|---:|---:|",
        ]
        for r in range(args.rounds):
            if r % 2:  # the order alternated from round to round
                b, a = _cli_step_us(args.out, args.cli_steps, False), _cli_step_us(args.out, args.cli_steps, True)
            else:
                a, b = _cli_step_us(args.out, args.cli_steps, True), _cli_step_us(args.out, args.cli_steps, False)
            lines.append(f"| {r + 1} | {a:.1f} | {b:.1f} |")
            print(lines[-1], flush=True)
    write_lines(lines, args.out, args.name)


def _cli_step_us(out: Path, steps: int, follow: bool) -> float:
    """``run_md``'s own s_per_step (start-up apart), with the calculator's ``follow`` made a no-op for False."""
    from ase.build import molecule
    from ase.io import write

    from mlff_distiller.cli_commands import run_md
    from mlff_distiller.cli_jobs import MDJob

    src = out / "benzene_cli.xyz"
    write(src, molecule("C6H6"))
    saved = StudentCalculator.follow
    if not follow:
        StudentCalculator.follow = lambda self, dyn: self
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = run_md(MDJob(input=str(src), output=str(out / "md_cli.extxyz"), steps=steps, device="cuda"))
    finally:
        StudentCalculator.follow = saved
    return 1e6 * float(res["s_per_step"])


if __name__ == "__main__":
    main()
