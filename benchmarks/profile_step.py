# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
"""Where does one small-molecule step spend its time? (GPU diagnostic for the engine issue.)

Prints, for benzene and a batch of g2 molecules: the CUDA-graph replay time, the kernels of one padded step
(names, counts, device time) from ``torch.profiler``, and cProfile tables of the host side of
``ForceEngine.compute`` and of an ASE MD step through ``StudentCalculator``.

    python benchmarks/profile_step.py --out DIR
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from systems import g2_chno

from mlff_distiller import ForceEngine, StudentCalculator, load_model
from mlff_distiller.batch import AtomsBatch


def _kernel_table(fn, reps: int = 5, rows: int = 40) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.device_time for e in events) / reps
    head = f"device kernels per call: {len(events) / reps:.0f}, summed device time per call: {total_us:.1f} µs\n"
    return head + prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)


def _host_profile(fn, reps: int, rows: int = 35) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(rows)
    return s.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import triton
    from ase import units
    from ase.build import molecule
    from ase.md.verlet import VelocityVerlet

    model = load_model("builtin:chno-gfn2")
    report = [f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}"]
    for name, structs in [("benzene", [molecule("C6H6")]), ("g2x1024", g2_chno(1024))]:
        eng = ForceEngine(model, device="cuda", mode="cudagraph")
        batch = AtomsBatch.from_atoms(structs)
        eng.compute(batch, to_host=True)
        eng.compute(batch, to_host=True)
        bucket, runner = next(iter(eng._runners.items()))
        t_replay = triton.testing.do_bench(runner.replay, warmup=50, rep=300, return_mode="median")
        t_e2e = triton.testing.do_bench(
            lambda: eng.compute(batch, to_host=True), warmup=20, rep=300, return_mode="median"
        )
        report.append(f"\n===== {name}: bucket {bucket}, replay {t_replay * 1e3:.1f} µs, e2e {t_e2e * 1e3:.1f} µs")
        graph = eng._graph(bucket)
        report.append("--- kernels of one graph replay")
        report.append(_kernel_table(runner.replay))
        report.append("--- kernels of the same padded step run eagerly")
        report.append(_kernel_table(lambda: eng._step(*graph.inputs())))
        report.append("--- host profile of engine.compute (to_host), 200 calls")
        report.append(_host_profile(lambda: eng.compute(batch, to_host=True), 200))
    atoms = molecule("C6H6")
    atoms.calc = StudentCalculator(model, device="cuda")
    dyn = VelocityVerlet(atoms, 0.5 * units.fs)
    dyn.run(20)
    report.append("\n===== ASE MD step (benzene, StudentCalculator defaults), host profile of 200 steps")
    report.append(_host_profile(lambda: dyn.run(1), 200))
    text = "\n".join(report)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile_step.txt").write_text(text)


if __name__ == "__main__":
    main()
