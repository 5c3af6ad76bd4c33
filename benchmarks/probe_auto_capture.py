"""Probe (GPU): mode "auto" on large periodic boxes with stop 51's width-aware capture limit, end to end.

Stop 51 moved mode "auto"'s largest CUDA-graph bucket from 2^19 edges for every student to
``engine.auto_max_edges(hidden)`` (edges x width up to 1e8). Per student width and water box this probe times
``ForceEngine.compute(batch, to_host=True)`` (neighbour list, fill, step, results on the host: what
``predict_forces`` and a calculator's non-MD call run) in three engines, alternating call by call in one process:

* ``old``: the ladder stopped at 2^19 edges (``BucketLadder(max_edges=AUTO_MAX_EDGES)``), so these boxes run eager
  (Morton-sorted from 10,000 atoms);
* ``new``: the shipped default (captured where ``auto_max_edges`` allows);
* ``new unsorted``: the same with ``spatial_sort_min_atoms=None`` (differs from ``new`` where a box runs eager).

Stop 51's file (``results/stop51_gpu/probe_auto_capture.md``) came from a tree whose padded path also sorted the
atoms (``padded_sort_dropped.diff``): there ``new`` was sorted and ``new unsorted`` was the shipped path.

It reports the median ms per call of ``--calls`` calls after three warm-up calls (the first captures), and the
largest force difference of ``new`` from ``old``.

    python benchmarks/probe_auto_capture.py --hidden 64,128 --atoms 12000,18000,24000 --out DIR [--name NAME]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import sync, write_lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", default="64,128")
    ap.add_argument("--atoms", default="12000,18000,24000")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_auto_capture")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_auto_capture: needs a CUDA device")
        return 0
    import triton
    from peers import make_student
    from systems import water_box

    from mlff_distiller import AtomsBatch, ForceEngine
    from mlff_distiller.buckets import BucketLadder
    from mlff_distiller.engine import AUTO_MAX_EDGES, auto_max_edges

    device = torch.device("cuda")
    rows = []
    for hidden in (int(h) for h in args.hidden.split(",")):
        model = make_student(hidden=hidden)
        for n in (int(a) for a in args.atoms.split(",")):
            batch = AtomsBatch.from_atoms([water_box(n, seed=0)], dtype=torch.float32)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engines = {
                    "old": ForceEngine(
                        model, device=device, mode="auto", buckets=BucketLadder(max_edges=AUTO_MAX_EDGES)
                    ),
                    "new": ForceEngine(model, device=device, mode="auto"),
                    "new unsorted": ForceEngine(model, device=device, mode="auto", spatial_sort_min_atoms=None),
                }
            outs = {}
            for name, eng in engines.items():
                for _ in range(3):
                    outs[name] = eng.compute(batch, to_host=True)
            times = {name: [] for name in engines}
            for _ in range(args.calls):
                for name, eng in engines.items():
                    sync(device)
                    t0 = time.perf_counter()
                    eng.compute(batch, to_host=True)
                    times[name].append((time.perf_counter() - t0) * 1e3)
            med = {name: statistics.median(t) for name, t in times.items()}
            df = float((outs["new"]["forces"] - outs["old"]["forces"]).abs().max())
            captured = {name: bool(eng._runners) for name, eng in engines.items()}
            rows.append((hidden, n, auto_max_edges(hidden), med, df, captured))
            print(rows[-1], flush=True)
            del engines, outs
            torch.cuda.empty_cache()
    lines = [
        "# probe_auto_capture.py: mode auto on large water boxes, the old 2^19-edge limit against stop 51's",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · random-weight "
        f"students (peers.make_student), float32; ForceEngine.compute(batch, to_host=True), median of {args.calls} "
        "calls per engine, the three engines alternating",
        "",
        "| hidden | water atoms | auto_max_edges | old ms (captured?) | new ms (captured?) | new unsorted ms | "
        "old / new | max abs ΔF new - old, eV/Å |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for hidden, n, most, med, df, cap in rows:
        lines.append(
            f"| {hidden} | {n:,} | {most:,} | {med['old']:.2f} ({'yes' if cap['old'] else 'no'}) | "
            f"{med['new']:.2f} ({'yes' if cap['new'] else 'no'}) | {med['new unsorted']:.2f} | "
            f"{med['old'] / med['new']:.3f} | {df:.2e} |"
        )
    write_lines(lines, Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
