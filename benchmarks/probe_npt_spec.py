"""A/B of the speculative launch on the NPT path: the same student and box, NPTBerendsen with the speculative
launch on and off, alternating, several rounds in one process (the device host's noise moves whole runs).

    python benchmarks/probe_npt_spec.py --student PATH --rounds 3 --steps 300
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import environment
from peers import make_student
from systems import water_box

from mlff_distiller import StudentCalculator, load_model


def run(model, device, speculate: bool, steps: int) -> tuple[float, float, int, int]:
    from mlff_distiller.distill import npt_berendsen

    atoms = water_box(192, seed=2)
    atoms.calc = StudentCalculator(model, device=device)
    atoms.calc.engine.speculative_verlet = speculate
    dyn = npt_berendsen(atoms, taup_fs=200.0)
    dyn.run(3)
    stamps: list[float] = []
    dyn.attach(lambda: stamps.append(time.perf_counter()), interval=1)
    dyn.run(steps)
    torch.cuda.synchronize() if device.type == "cuda" else None
    per = np.diff(stamps) * 1e3
    e = atoms.calc.engine
    return float(np.median(per)), float(per.mean()), e.n_speculated, e.n_discarded


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--student", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(args.student) if args.student else make_student()
    env = environment(device, copy_gbps=0.0)
    lines = [
        f"# probe_npt_spec.py: {env.device} · torch {env.torch} · triton {env.triton} · commit {env.commit}",
        f"student {args.student or 'seeded random 128 x 3'}; 192-atom water; {args.steps} NPTBerendsen steps per run",
        "",
        "| round | speculative | median ms / step | mean | launched early | discarded |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in range(args.rounds):
        for spec in (True, False) if r % 2 == 0 else (False, True):
            med, mean, n_spec, n_disc = run(model, device, spec, args.steps)
            lines.append(f"| {r} | {spec} | {med:.3f} | {mean:.3f} | {n_spec} | {n_disc} |")
            print(lines[-1], flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_npt_spec.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
