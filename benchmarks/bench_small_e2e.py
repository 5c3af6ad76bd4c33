"""Benchmark (GPU): end-to-end latency of small molecules and small batches through the engine, host work included.

``ForceEngine(mode="cudagraph", precision="fp32")`` on the default student (``bench_engine.make_student``), fed
``AtomsBatch`` es on the host as ``predict_forces`` and ``StudentCalculator`` (single points) feed it: the
neighbour list, the padded bucket's fill, the replay and the copy back, per call. Beside it, the captured step
alone (replay + sync) of the same bucket, so the difference is the host path. Also ``engine.predict`` (what
``predict_forces`` runs) on single molecules: ``ase.Atoms`` in, dicts out. Median and p20 of wall-clock calls
(each waits for its results).

    python benchmarks/bench_small_e2e.py --out benchmarks/results [--name small_e2e_h100]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import g2_batch, make_student
from harness import wall_us, write_lines

from mlff_distiller import AtomsBatch, ForceEngine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="small_e2e_h100")
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--profile", action="store_true", help="also a cProfile table of the host side (one benzene)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_small_e2e: needs CUDA")
        return
    import triton
    from ase.build import molecule

    model = make_student().to("cuda")
    engine = ForceEngine(model, device="cuda", precision="fp32", mode="cudagraph")
    cases = [(name, [molecule(name)]) for name in ("H2", "H2O", "CH4", "C6H6")]
    cases += [(f"g2 x {b}", g2_batch(b)) for b in (4, 16, 64, 256, 1024)]
    rows = []
    for name, structs in cases:
        batch = AtomsBatch.from_atoms(structs, dtype=engine.dtype)
        engine.compute(batch, to_host=True)  # capture
        e2e, e2e20 = wall_us(lambda b=batch: engine.compute(b, to_host=True), args.reps)
        bucket = engine.last_bucket
        runner = engine._runners.get(bucket)

        def replay(r=runner):
            r.replay()
            torch.cuda.synchronize()

        step = wall_us(replay, args.reps)[0] if runner is not None else float("nan")
        per = len(structs)
        host = e2e - step
        rows.append(
            f"| {name} | {batch.num_atoms} | {e2e:.1f} | {e2e20:.1f} | {step:.1f} | {host:.1f} | {e2e / per:.2f} |"
        )
    pf = []
    for name in ("H2O", "C6H6"):
        atoms = [molecule(name)]
        engine.predict(atoms)
        t = wall_us(lambda a=atoms: engine.predict(a), args.reps)
        pf.append(f"| engine.predict, one {name} (ase.Atoms in, dict out) | {t[0]:.1f} | {t[1]:.1f} |")
    lines = [
        "# bench_small_e2e.py: small molecules end to end through ForceEngine (cudagraph, fp32)",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
        f"{args.reps} calls each",
        "",
        "| case | atoms | e2e µs (median) | e2e p20 | replay + sync µs | host path µs | e2e µs / structure |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "| call | median µs | p20 µs |",
        "|---|---:|---:|",
        *pf,
    ]
    if args.profile:
        import cProfile
        import io
        import pstats

        batch = AtomsBatch.from_atoms([molecule("C6H6")], dtype=engine.dtype)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.reps):
            engine.compute(batch, to_host=True)
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
        what = f"cProfile of {args.reps} calls of engine.compute (one benzene, to_host), by internal time:"
        lines += ["", what, "```", buf.getvalue(), "```"]
    write_lines(lines, args.out, args.name)


if __name__ == "__main__":
    main()
