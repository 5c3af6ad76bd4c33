"""Student size against the speed targets of issues 5 and 7 (a probe for the planning round, not a benchmark).

The stop-20 measurements put the 0.05 ms benzene target at or below the floor of every design measured for the
default student (hidden 128, 3 layers) in strict fp32 (benchmarks/results/probe_megakernel_h100.md). This probe
measures, in one run on one GPU, how the target rows move with the student's width and depth (random weights, 20
Bessel functions, 5 Å, the g2 species; speed does not depend on training):

* benzene: the captured energy + forces step (replay, CUDA events) and one ASE velocity-Verlet step through
  ``StudentCalculator`` (wall clock, median of 1,000 steps);
* 1,024 and 4,096 g2 molecules: the captured step, µs per structure, fp32 (and tf32 at 4,096);
* water boxes of 3,000 atoms (captured step, mode auto) and 24,000 atoms (eager step, Morton-sorted, as the
  engine runs it).

Every row is the step alone on a prepared graph (peers.StepImpl), as bench_large and bench_engine report it. The
accuracy a smaller student gives up is not measured here.

    python benchmarks/probe_student_size.py --out benchmarks/results --name probe_student_size_h100
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import g2_batch
from harness import STUDENT_WEIGHTS, time_fn, write_lines
from peers import StepImpl, count_params, make_student
from probe_md_step import _benzene, _md_us
from systems import water_box

from mlff_distiller import StudentCalculator

CONFIGS = ((128, 3), (128, 2), (64, 3), (64, 2))
G2_SPECIES = (1, 3, 4, 5, 6, 7, 8, 9, 11, 13, 14, 15, 16, 17)


def _step_us(model, structures, **engine_kwargs) -> float:
    """Median µs of the energy + forces step alone (peers.StepImpl) on ``structures``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        impl = StepImpl("probe", "ours", model, "cuda", **engine_kwargs)
        run = impl.prepare(structures, forces=True)
    t = time_fn(run, torch.device("cuda"), warmup_ms=25, rep_ms=200).median_us
    del impl, run
    torch.cuda.empty_cache()
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="probe_student_size_h100")
    p.add_argument("--md-steps", type=int, default=1000)
    p.add_argument("--configs", default=",".join(f"{h}x{n}" for h, n in CONFIGS), help="hidden x layers, ...")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("probe_student_size: needs CUDA")
        return
    import triton

    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    g2, g2_1024 = g2_batch(4096), g2_batch(1024)
    water_small, water_large = water_box(3000, seed=0), water_box(24000, seed=0)
    lines = [
        "# Student size against the issue-5 / issue-7 speed targets (probe_student_size.py)",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
        f"student weights {STUDENT_WEIGHTS} · {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "Random-weight students (20 Bessel functions, 5 Å, the 14 g2 species), fp32 unless noted. Step = energy + "
        "forces on a prepared graph (replay of the captured step; eager for 24,000 atoms); MD = ASE velocity "
        "Verlet through StudentCalculator, wall clock per step. Targets (H100, fp32): benzene step ≤ 50 µs, MD "
        "step ≤ 200 µs, g2 ×1,024 ≤ 0.8 µs / structure, ×4,096 ≤ 0.6 (tf32 ≤ 0.3), 3,000 atoms ≤ 1.5 ms, "
        "24,000 atoms ≤ 10 ms.",
        "",
        "| hidden | layers | parameters | benzene step µs | benzene MD step µs | g2 ×1024 µs/structure | "
        "g2 ×4096 µs/structure | g2 ×4096 tf32 µs/structure | water 3,000 ms | water 24,000 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for hidden, layers in configs:
        model = make_student(species=list(G2_SPECIES), hidden=hidden, layers=layers, n_rbf=20, cutoff=5.0)
        t0 = time.perf_counter()
        benzene = _step_us(model, [_benzene()], mode="cudagraph")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calc = StudentCalculator(model, device="cuda")
        md, _ = _md_us(_benzene(), calc, args.md_steps)
        e = calc.engine
        print(
            f"{hidden} x {layers} MD: launches ahead {e.n_ahead_taken} taken, {e.n_ahead_missed} missed; "
            f"{e.verlet.n_builds} list builds, {e.n_discarded} discarded",
            flush=True,
        )
        del calc, e
        g2_1k = _step_us(model, g2_1024, mode="cudagraph") / len(g2_1024)
        g2_fp32 = _step_us(model, g2, mode="cudagraph") / len(g2)
        g2_tf32 = _step_us(model, g2, mode="cudagraph", precision="tf32") / len(g2)
        w3k = _step_us(model, [water_small], mode="auto") / 1e3
        w24k = _step_us(model, [water_large], mode="eager") / 1e3
        lines.append(
            f"| {hidden} | {layers} | {count_params(model):,} | {benzene:.1f} | {md:.1f} | {g2_1k:.3f} | "
            f"{g2_fp32:.3f} | {g2_tf32:.3f} | {w3k:.3f} | {w24k:.2f} |"
        )
        print(lines[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"wrote {write_lines(lines, args.out, args.name)}")


if __name__ == "__main__":
    main()
