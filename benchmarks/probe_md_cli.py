"""``mlff-distill md`` as a user runs it: seconds per MD step of the command, against the calculator's own step.

    python benchmarks/probe_md_cli.py --out results/ [--steps 3000] [--molecule C6H6]

Runs the command (a fresh process each) on one molecule with the shipped student: Langevin (the default) writing a
frame every 10 steps (the default) and every 1,000 steps (almost none), and velocity Verlet (``--ensemble nve``)
every 10 steps; each prints its own ``s_per_step`` (the MD loop only, start-up excluded), which is what the table
holds. Beside them, in this process: ``StudentCalculator`` under ASE's ``VelocityVerlet`` with no writing, the
number the README gives for an MD step. Writes ``<out>/probe_md_cli.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import environment, write_lines


def cli_run(xyz: Path, out: Path, steps: int, extra: list[str]) -> dict:
    """One fresh ``mlff-distill md`` process: its report and its wall clock from launch to exit."""
    cmd = [sys.executable, "-m", "mlff_distiller.cli", "md", "--input", str(xyz), "--output", str(out)]
    cmd += ["--steps", str(steps), "--precision", "fp32", *extra]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    report = json.loads(done.stdout)
    report["wall_s"] = time.perf_counter() - t0
    # The loop's seconds with the first forces in them, as before stop 34 (which reports them as startup_s).
    report["with_first_s"] = report["seconds"] + report.get("startup_s", 0.0)
    return report


def cli_step_ms(xyz: Path, out: Path, steps: int, extra: list[str]) -> dict:
    """Milliseconds per MD step of the command: (its loop with the first forces, at ``steps`` steps, minus the same
    at 1 step) / (steps - 1). The same formula whether or not the package reports its start-up apart."""
    long = cli_run(xyz, out, steps, extra)
    one = cli_run(xyz, out, 1, extra)
    return {
        "ms": 1e3 * (long["with_first_s"] - one["with_first_s"]) / (steps - 1),
        "reported_ms": 1e3 * long["s_per_step"],
        "startup_s": long.get("startup_s"),
        "wall_s": long["wall_s"],
    }


def calculator_step_ms(atoms, steps: int) -> float:
    from ase import units
    from ase.md.verlet import VelocityVerlet

    from mlff_distiller import StudentCalculator

    atoms = atoms.copy()
    atoms.calc = StudentCalculator("builtin:chno-gfn2", precision="fp32")
    dyn = VelocityVerlet(atoms, 0.5 * units.fs)
    dyn.run(200)
    times = []
    for _ in range(steps // 100):
        t0 = time.perf_counter()
        dyn.run(100)
        times.append((time.perf_counter() - t0) / 100)
    return 1e3 * statistics.median(times)


def step_rows(atoms, steps: int) -> list[str]:
    """Per-step wall clock of the same MD driven in this process, every step stamped: median, mean, p99, and the
    steps where the Verlet list was rebuilt, for velocity Verlet, Langevin, Langevin with ``FixCom`` (what the
    command uses for a molecule) and that writing a frame every 10 steps as the command does."""
    import ase.io
    import numpy as np
    from ase import units
    from ase.constraints import FixCom
    from ase.md.langevin import Langevin
    from ase.md.verlet import VelocityVerlet

    from mlff_distiller import StudentCalculator
    from mlff_distiller.ase_compat import maxwell_boltzmann

    rows = [
        "| driver | median ms | mean ms | p99 ms | list builds | mean ms of a build step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    try:
        from mlff_distiller._extxyz_fast import format_md_frame  # the command's frame writer from stop 34 on
    except ImportError:
        format_md_frame = None
    names = ["verlet", "langevin", "langevin + FixCom", "langevin + FixCom + a frame every 10 steps (ase.io.write)"]
    if format_md_frame is not None:
        names.append("langevin + FixCom + a frame every 10 steps (format_md_frame)")
    for name in names:
        a = atoms.copy()
        a.calc = StudentCalculator("builtin:chno-gfn2", precision="fp32")
        rng = np.random.default_rng(0)
        maxwell_boltzmann(a, 300.0, rng=rng)
        if "FixCom" in name:
            a.set_constraint(FixCom())
        if name == "verlet":
            dyn = VelocityVerlet(a, 0.5 * units.fs)
        else:
            dyn = Langevin(a, 0.5 * units.fs, temperature_K=300, friction=0.01 / units.fs, rng=rng, fixcm=False)
        if "ase.io.write" in name:
            out = Path(tempfile.mkdtemp(), "md.extxyz")

            def write(a=a, out=out):
                frame = a.copy()
                frame.calc = a.calc
                frame.info["total_energy"] = float(a.get_total_energy())
                ase.io.write(out, frame, format="extxyz", append=True)

            dyn.attach(write, interval=10)
        if "format_md_frame" in name:
            handle = open(Path(tempfile.mkdtemp(), "md.extxyz"), "w")  # open for the whole run

            def write(a=a, handle=handle):
                handle.write(format_md_frame(a, a.calc.results, {"total_energy": float(a.get_total_energy())}))
                handle.flush()

            dyn.attach(write, interval=10)
        dyn.run(100)
        verlet = a.calc.engine.verlet
        stamps, builds = [], []

        def stamp(v=verlet, s=stamps, b=builds):
            s.append(time.perf_counter())
            b.append(v.n_builds)

        dyn.attach(stamp, interval=1)
        dyn.run(steps)
        t = np.diff(stamps) * 1e3
        rebuilt = np.diff(np.asarray(builds)) > 0
        build_ms = float(t[rebuilt].mean()) if rebuilt.any() else float("nan")
        rows.append(
            f"| {name} | {np.median(t):.3f} | {t.mean():.3f} | {np.percentile(t, 99):.3f} | {int(rebuilt.sum())} | "
            f"{build_ms:.2f} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--molecule", default="C6H6")
    ap.add_argument("--sections", default="cli,steps")
    args = ap.parse_args()
    import ase.io
    from ase.build import molecule

    atoms = molecule(args.molecule)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        xyz = Path(tmp, "start.xyz")
        ase.io.write(xyz, atoms)
        variants = [
            ("langevin, a frame every 10 steps (the defaults)", []),
            ("langevin, a frame every 1,000 steps", ["--interval", "1000"]),
            ("nve (velocity Verlet), a frame every 10 steps", ["--ensemble", "nve"]),
        ]
        for name, extra in variants if "cli" in args.sections else []:
            r = cli_step_ms(xyz, Path(tmp, "md.extxyz"), args.steps, extra)
            rows.append((name, r))
            print(f"{name}: {r}", flush=True)
    calc = calculator_step_ms(atoms, args.steps)
    env = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"), 0.0)
    lines = [
        "# probe_md_cli.py: `mlff-distill md` per step, against the calculator's own step",
        "",
        f"{env.device} · torch {env.torch} · Triton {env.triton} · commit {env.commit} · host {env.host}",
        "",
        f"{args.molecule}, the shipped student (fp32), {args.steps} steps of 0.5 fs, one fresh process per run. "
        "ms per step: (the loop's seconds with the first forces, at that many steps, minus the same at 1 step) / "
        f"({args.steps} - 1), the same formula for every package version; the command's own `s_per_step` beside it "
        "(before stop 34 it included the first forces: the model's load, kernels and capture), its `startup_s` "
        "(stop 34 on) and the process's wall clock:",
        "",
        "| run | ms per step | command's s_per_step (ms) | startup_s | process wall s |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| `mlff-distill md`: {name} | {r['ms']:.3f} | {r['reported_ms']:.3f} | "
            f"{'-' if r['startup_s'] is None else format(r['startup_s'], '.2f')} | {r['wall_s']:.1f} |"
            for name, r in rows
        ),
        f"| `StudentCalculator` under ASE's `VelocityVerlet`, nothing written (this process; median of "
        f"{args.steps // 100} x 100 steps) | {calc:.3f} | | | |",
    ]
    if "steps" in args.sections:
        lines += ["", "Every step stamped, in this process (the shipped student, fp32, 300 K start):", ""]
        lines += step_rows(atoms, args.steps)
    write_lines(lines, args.out, "probe_md_cli")


if __name__ == "__main__":
    main()
