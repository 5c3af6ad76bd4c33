"""Probe (GPU): a single point on a large box through a fresh engine, captured at the first call or not.

``StudentCalculator``'s engine captures a bucket at its first call (``capture_after=0``); since stop 52 mode "auto"
captures up to 2^21 edges, so a one-off energy + forces call on a box of up to ~38,000 water atoms pays the capture
(two warm-up steps, the capture, the replay) where it ran one eager step before. Per water box this probe times, in
fresh engines (kernels compiled once beforehand by a throwaway engine, so compilation is not counted):

* the first ``compute(to_host=True)`` of an engine with ``capture_after=0`` (the calculator's) and with
  ``capture_after=1`` (``predict_forces``'s: that call runs the padded step eagerly);
* the next ``--calls`` calls of each (the second engine captures at its second call), as the total time of the
  first ``1 + --calls`` calls: where an MD run or a relaxation would make up for the eager first step.

    python benchmarks/probe_single_point.py --atoms 12000,24000 --out DIR [--name NAME]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import sync, write_lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--atoms", default="12000,24000")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_single_point")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_single_point: needs a CUDA device")
        return 0
    import triton
    from peers import make_student
    from systems import water_box

    from mlff_distiller import AtomsBatch, ForceEngine

    device = torch.device("cuda")
    model = make_student(hidden=args.hidden)
    rows = []
    for n in (int(a) for a in args.atoms.split(",")):
        batch = AtomsBatch.from_atoms([water_box(n, seed=0)], dtype=torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warm = ForceEngine(model, device=device, mode="auto")
            for _ in range(3):
                warm.compute(batch, to_host=True)
            del warm
        first = {0: [], 1: []}
        total = {0: [], 1: []}
        for _ in range(args.rounds):
            for after in (0, 1):
                torch.cuda.empty_cache()
                engine = ForceEngine(model, device=device, mode="auto", capture_after=after)
                times = []
                for _ in range(1 + args.calls):
                    sync(device)
                    t0 = time.perf_counter()
                    engine.compute(batch, to_host=True)
                    times.append((time.perf_counter() - t0) * 1e3)
                first[after].append(times[0])
                total[after].append(sum(times))
                del engine
        med = {k: sorted(v)[len(v) // 2] for k, v in first.items()}
        tot = {k: sorted(v)[len(v) // 2] for k, v in total.items()}
        rows.append((n, med, tot))
        print(n, med, tot, flush=True)
    lines = [
        "# probe_single_point.py: a fresh engine's first call on a large box, captured at once or not",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · random-weight "
        f"student {args.hidden} wide, float32, mode auto, compute(batch, to_host=True); medians of {args.rounds} "
        "fresh engines each, kernels compiled beforehand",
        "",
        f"| water atoms | first call, capture_after=0 ms | first call, capture_after=1 ms | first {1 + args.calls} "
        "calls, capture_after=0 ms | the same, capture_after=1 ms |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n, med, tot in rows:
        lines.append(f"| {n:,} | {med[0]:.1f} | {med[1]:.1f} | {tot[0]:.1f} | {tot[1]:.1f} |")
    write_lines(lines, Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
