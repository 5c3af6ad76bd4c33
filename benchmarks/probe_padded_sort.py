"""Probe (GPU): the padded (captured) path sorting large periodic batches along a Morton curve per call, end to end.

Mode "auto" captures water boxes up to ``auto_max_edges`` edges (128 wide: to ~38,000 atoms), in the caller's atom
order; the eager path sorts from ``SPATIAL_SORT_MIN_ATOMS``. The captured 24,000-atom step alone runs 1.039x faster
on a Morton-sorted box (stop64_gpu/f/), but stop 51 timed a per-call sort in the padded path as a loss end to end
(``padded_sort_dropped.diff``, a host twice as slow). This times ``ForceEngine.compute(batch, to_host=True)`` (list,
sort, fill, step, results on the host) with ``padded_sort_min_atoms`` None (shipped) and 1, the two engines
alternating call by call, and checks that their forces agree.

    python benchmarks/probe_padded_sort.py --hidden 128,64 --atoms 12000,24000,36000 --out DIR
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
    ap.add_argument("--hidden", default="128,64")
    ap.add_argument("--atoms", default="12000,24000,36000")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_padded_sort")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_padded_sort: needs a CUDA device")
        return 0
    import triton
    from peers import make_student
    from systems import water_box

    from mlff_distiller import AtomsBatch, ForceEngine

    device = torch.device("cuda")
    rows = []
    for hidden in (int(h) for h in args.hidden.split(",")):
        model = make_student(hidden=hidden)
        for n in (int(a) for a in args.atoms.split(",")):
            batch = AtomsBatch.from_atoms([water_box(n, seed=0)], dtype=torch.float32)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engines = {"unsorted": ForceEngine(model, device=device, mode="auto")}
                engines["sorted"] = ForceEngine(model, device=device, mode="auto")
            engines["sorted"].padded_sort_min_atoms = 1
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
            f0 = outs["unsorted"]["forces"]
            df = float((outs["sorted"]["forces"] - f0).abs().max() / f0.abs().max())
            captured = {name: bool(eng._runners) for name, eng in engines.items()}
            rows.append((hidden, n, med, df, captured))
            print(rows[-1], flush=True)
            del engines, outs
            torch.cuda.empty_cache()
    lines = [
        "# probe_padded_sort.py: the padded path sorting large periodic batches per call, end to end",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · random-weight "
        f"students (peers.make_student), float32; ForceEngine.compute(batch, to_host=True), mode auto, median of "
        f"{args.calls} calls per engine, the two engines alternating",
        "",
        "| hidden | water atoms | unsorted ms (captured?) | sorted ms (captured?) | unsorted / sorted | max rel. ΔF |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for hidden, n, med, df, cap in rows:
        lines.append(
            f"| {hidden} | {n:,} | {med['unsorted']:.2f} ({'yes' if cap['unsorted'] else 'no'}) | "
            f"{med['sorted']:.2f} ({'yes' if cap['sorted'] else 'no'}) | {med['unsorted'] / med['sorted']:.3f} | "
            f"{df:.1e} |"
        )
    write_lines(lines, Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
