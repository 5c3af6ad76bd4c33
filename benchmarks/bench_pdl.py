"""Benchmark (GPU, sm90+): the energy + forces step with programmatic dependent launch (PDL) off and on.

Every Triton kernel of the step is launched with ``launch_pdl`` and starts with ``pdl_prologue`` (kernels/
_triton_utils.py) unless PDL is off (``pdl_enabled(False)``, ``MLFF_DISTILLER_PDL=0``). This times, in one run and
in the order off, on, off, on (the better of each pair's two rounds is not taken: both are reported):

* ``benzene``: the captured step of one benzene (ForceEngine mode cudagraph), replay only;
* ``water192``: the captured step of a 192-atom water box, replay only (the MD-sized graph);
* ``g2x1024``, ``g2x4096``: the captured step of a batch of ASE g2 molecules, per structure;
* ``water3000``: the captured step of a 3,000-atom water box;
* ``md``: one ASE velocity-Verlet step of benzene through StudentCalculator (wall clock, 1,000 steps);

and compares the forces with PDL on and off (max |ΔF|) beside two runs with it off (the forces' scatter uses
atomics, so runs differ by a few ulp whatever the launch mode).

    python benchmarks/bench_pdl.py --out benchmarks/results [--name bench_pdl_h100]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import _step_fn, g2_batch, make_student
from bench_large import water_box_fast
from harness import time_fn, write_lines
from mlff_distiller.kernels._triton_utils import pdl_enabled

from mlff_distiller import AtomsBatch, ForceEngine, StudentCalculator, kernels


def cases():
    from ase.build import molecule

    return [
        ("benzene", [molecule("C6H6")], "cudagraph", 1),
        ("water192", [water_box_fast(192)], "cudagraph", 1),
        ("g2x1024", g2_batch(1024), "cudagraph", 1024),
        ("g2x4096", g2_batch(4096), "cudagraph", 4096),
        ("water3000", [water_box_fast(3000)], "cudagraph", 1),
    ]


def step_row(model, name, atoms, mode, per, on: bool) -> tuple[dict, dict]:
    with pdl_enabled(on):
        engine = ForceEngine(model, device="cuda", precision="fp32", mode=mode)
        batch = AtomsBatch.from_atoms(atoms, dtype=engine.dtype)
        out = engine.compute(batch, to_host=True)  # capture (padded modes), compile, warm-up
        out = engine.compute(batch, to_host=True)
        t = time_fn(_step_fn(engine, batch, "auto"), engine.device)
    res = {"energy": out["energy"].clone(), "forces": out["forces"].clone()}
    row = dict(case=name, mode=mode, pdl=on, atoms=batch.num_atoms, us=t.median_us / per, p20=t.p20_us / per)
    return row, res


def md_row(model, on: bool, steps: int = 1000) -> dict:
    from ase.build import molecule
    from ase.md.verlet import VelocityVerlet

    with pdl_enabled(on), kernels.use_backend("auto"):
        atoms = molecule("C6H6")
        atoms.calc = StudentCalculator(model, device="cuda", precision="fp32", mode="auto")
        dyn = VelocityVerlet(atoms, timestep=0.5)
        dyn.run(20)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dyn.run(steps)
        per_step = (time.perf_counter() - t0) / steps
    return dict(case="md benzene (ASE step, wall)", mode="auto", pdl=on, atoms=12, us=1e6 * per_step, p20=None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="bench_pdl_h100")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    model = make_student().cuda()
    lines = [
        f"# Programmatic dependent launch in the energy + forces step ({torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, triton {triton.__version__})",
        "",
        "Default student (hidden 128, 3 layers, 20 Bessel, 5 Å, random weights), fp32. µs per structure: the step",
        "alone (`_step_fn` of bench_engine: a replay in mode cudagraph, model + grad on a prebuilt graph in eager),",
        "median (p20) of do_bench; the MD row is the wall clock of one ASE velocity-Verlet step of benzene. Rounds run",
        "off, on, off, on; `off/on`: the round's off time over its on time. `|ΔF| on-off`: max |ΔF| (eV/Å) between",
        "the round's on and off results; `|ΔF| off-off`: the same between this round's and the first round's off",
        "results (run-to-run noise of the atomic scatter).",
        "",
        "| case | mode | atoms | round | off µs (p20) | on µs (p20) | off/on | |ΔF| on-off | |ΔF| off-off |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, atoms, mode, per in cases():
        first = None
        for rnd in range(args.rounds):
            off, r_off = step_row(model, name, atoms, mode, per, False)
            on, r_on = step_row(model, name, atoms, mode, per, True)
            first = r_off if first is None else first
            d_on = (r_on["forces"] - r_off["forces"]).abs().max().item()
            d_off = (r_off["forces"] - first["forces"]).abs().max().item()
            lines.append(
                f"| {name} | {mode} | {off['atoms']} | {rnd + 1} | {off['us']:.3f} ({off['p20']:.3f}) | "
                f"{on['us']:.3f} ({on['p20']:.3f}) | {off['us'] / on['us']:.3f} | {d_on:.1e} | {d_off:.1e} |"
            )
            print(lines[-1], flush=True)
    for rnd in range(args.rounds + 1):
        off, on = md_row(model, False), md_row(model, True)
        lines.append(
            f"| {off['case']} | auto | 12 | {rnd + 1} | {off['us']:.1f} | {on['us']:.1f} | "
            f"{off['us'] / on['us']:.3f} | — | — |"
        )
        print(lines[-1], flush=True)
    write_lines(lines, args.out, args.name)


if __name__ == "__main__":
    main()
