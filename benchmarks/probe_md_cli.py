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


def cli_step_ms(xyz: Path, out: Path, steps: int, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "mlff_distiller.cli", "md", "--input", str(xyz), "--output", str(out)]
    cmd += ["--steps", str(steps), "--precision", "fp32", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return 1e3 * json.loads(done.stdout)["s_per_step"]


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--molecule", default="C6H6")
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
        for name, extra in variants:
            ms = cli_step_ms(xyz, Path(tmp, "md.extxyz"), args.steps, extra)
            rows.append((name, ms))
            print(f"{name}: {ms:.3f} ms", flush=True)
    calc = calculator_step_ms(atoms, args.steps)
    env = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"), 0.0)
    lines = [
        "# probe_md_cli.py: `mlff-distill md` per step, against the calculator's own step",
        "",
        f"{env.device} · torch {env.torch} · Triton {env.triton} · commit {env.commit} · host {env.host}",
        "",
        f"{args.molecule}, the shipped student (fp32), {args.steps} steps of 0.5 fs; the command's `s_per_step` "
        "(its MD loop, start-up excluded), one fresh process each:",
        "",
        "| run | ms per step |",
        "|---|---:|",
        *(f"| `mlff-distill md`: {name} | {ms:.3f} |" for name, ms in rows),
        f"| `StudentCalculator` under ASE's `VelocityVerlet`, nothing written (this process; median of "
        f"{args.steps // 100} x 100 steps) | {calc:.3f} |",
    ]
    write_lines(lines, args.out, "probe_md_cli")


if __name__ == "__main__":
    main()
