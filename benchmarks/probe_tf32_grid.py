"""Weights on the TF32 grid in the ASE MD step (GPU): the benzene MD step through StudentCalculator with the
student's weights as drawn or rounded onto the grid, and the two-MMA form switched on or off, alternating in one
process; and how many weight checks (``_frozen.tf32_exact`` looking at a weight's bits, one device sync each) the
steps after the first make (0 expected: each weight is looked at once per version).

    python benchmarks/probe_tf32_grid.py --out DIR
"""

from __future__ import annotations

import argparse
import copy
import importlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import make_student
from harness import write_lines
from probe_md_step import _benzene, _md_us

from mlff_distiller import StudentCalculator

frozen = importlib.import_module("mlff_distiller.kernels._frozen")
linear = importlib.import_module("mlff_distiller.kernels.linear")
mp_config = importlib.import_module("mlff_distiller.kernels._mp_config")


def _switch(on: bool) -> None:
    linear._CONFIG["w_exact_two_mmas"] = on
    mp_config._CONFIG["w_exact_two_mmas"] = on


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="probe_tf32_grid")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_tf32_grid.py needs a CUDA device")
        return 0
    import harness
    import triton

    harness.STUDENT_WEIGHTS = "as-trained"  # the seeded draw as it is; rounded below for the other variant
    fresh = make_student().eval()
    grid = copy.deepcopy(fresh)
    grid.round_weights_tf32()
    students = {"as drawn": fresh, "TF32 grid": grid}
    assert grid.on_tf32_grid() and not fresh.on_tf32_grid()

    looks = []  # weights whose bits a check looked at (not answered from the kept answers)
    real_check = frozen.tf32_exact

    def counting(w):
        base = w._base if w._base is not None else w
        hit = frozen._EXACT.get(id(base))
        if not (hit is not None and hit[0]() is base and hit[2] == base._version) and not base.requires_grad:
            looks.append(tuple(base.shape))
        return real_check(w)

    linear.tf32_exact = counting
    mp_config.tf32_exact = counting

    lines = [
        "# Weights on the TF32 grid in the ASE MD step (probe_tf32_grid.py)",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "Benzene, the 128 x 3 g2 student (seeded draw), ASE velocity Verlet through StudentCalculator (fp32), "
        f"median µs per step over {args.steps} steps after 100, each variant a fresh calculator, alternating.",
        "",
        "| round | weights | two MMAs | MD step µs | p20 µs |",
        "|---:|---|---|---:|---:|",
    ]
    results: dict = {}
    for rnd in range(args.rounds):
        for label, model in students.items():
            for on in (True, False):
                _switch(on)
                calc = StudentCalculator(model, device="cuda", precision="fp32")
                med, p20 = _md_us(_benzene(), calc, args.steps)
                results.setdefault((label, on), []).append(med)
                lines.append(f"| {rnd + 1} | {label} | {'on' if on else 'off'} | {med:.1f} | {p20:.1f} |")
                print(lines[-1], flush=True)
    _switch(True)
    # Weight checks made by the steps after the first (a fresh calculator; its warm-up makes the first ones).
    calc = StudentCalculator(grid, device="cuda", precision="fp32")
    atoms = _benzene()
    atoms.calc = calc
    from ase import units
    from ase.md.verlet import VelocityVerlet

    dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
    dyn.run(5)
    first = len(looks)
    dyn.run(50)
    lines += [
        "",
        f"Weight checks that looked at a weight's bits: {first} in a fresh calculator's first 5 MD steps, "
        f"{len(looks) - first} in the 50 after (0 expected).",
    ]
    write_lines(lines, args.out, args.name)
    print("\n".join(lines[-2:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
