"""Probe (GPU): where mode "auto" should stop capturing, timed end to end rather than the step alone.

Stop 51 set ``engine.auto_max_edges`` (edges x width <= ``AUTO_MAX_EDGE_FEATURES``) from the step alone (a prepared
graph: ``probe_eager_host.py``), where a 128-wide student's 18,000 / 24,000-atom water replay ran 0.97 / 0.95x of its
eager step. A user's call (``ForceEngine.compute``: the neighbour list, the batch's preparation, the step, the
results on the host) adds host work that an eager step cannot overlap with its own launches, so the crossover there
may differ. Per student width and water box this probe times, alternating call by call in one process:

* ``eager``: the ladder stopped at 2^19 edges (the box runs eager, Morton-sorted from ``SPATIAL_SORT_MIN_ATOMS``);
* ``eager unsorted``: the same with ``spatial_sort_min_atoms=None``;
* ``captured``: mode "cudagraph" with a ladder up to ``--max-edges`` (the box in a captured bucket);
* ``auto``: the shipped default (whichever of the above ``auto_max_edges`` picks).

and reports the median ms per call of ``--calls`` calls (after three warm-up calls; the first captures), each
engine's peak device memory over its warm-up calls (``max_memory_allocated`` above what was allocated before it, so
the captured bucket's pool counts), and the largest force difference of ``captured`` from ``eager``.

    python benchmarks/probe_capture_limit.py --hidden 128 --atoms 12000,18000,24000,36000 --out DIR [--name NAME]
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
    ap.add_argument("--max-edges", type=int, default=2**22)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument(
        "--engines",
        default="eager,eager unsorted,captured,auto",
        help="a comma-separated subset of: eager, eager unsorted, captured, auto",
    )
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_capture_limit")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_capture_limit: needs a CUDA device")
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
            settings = {
                "eager": {"mode": "auto", "buckets": BucketLadder(max_edges=AUTO_MAX_EDGES)},
                "eager unsorted": {
                    "mode": "auto",
                    "buckets": BucketLadder(max_edges=AUTO_MAX_EDGES),
                    "spatial_sort_min_atoms": None,
                },
                "captured": {"mode": "cudagraph", "buckets": BucketLadder(max_edges=args.max_edges)},
                "auto": {"mode": "auto"},
            }
            settings = {k: v for k, v in settings.items() if k in args.engines.split(",")}
            engines, outs, peak = {}, {}, {}
            for name, kwargs in settings.items():
                sync(device)
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    eng = engines[name] = ForceEngine(model, device=device, **kwargs)
                    for _ in range(3):
                        outs[name] = eng.compute(batch, to_host=True)
                sync(device)
                peak[name] = (torch.cuda.max_memory_allocated(device) - base) / 1e9
            times = {name: [] for name in engines}
            for _ in range(args.calls):
                for name, eng in engines.items():
                    sync(device)
                    t0 = time.perf_counter()
                    eng.compute(batch, to_host=True)
                    times[name].append((time.perf_counter() - t0) * 1e3)
            med = {name: statistics.median(t) for name, t in times.items()}
            first, other = next(iter(outs)), ("captured" if "captured" in outs else list(outs)[-1])
            df = float((outs[other]["forces"] - outs[first]["forces"]).abs().max())
            captured = {name: bool(eng._runners) for name, eng in engines.items()}
            last = engines["captured"].last_bucket if "captured" in engines else None
            edges = last.edges if last is not None else None
            rows.append((hidden, n, auto_max_edges(hidden), edges, med, peak, df, captured))
            print(rows[-1], flush=True)
            del engines, outs
            torch.cuda.empty_cache()
    lines = [
        "# probe_capture_limit.py: eager against captured, end to end, on large water boxes",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · random-weight "
        f"students (peers.make_student), float32; ForceEngine.compute(batch, to_host=True), median ms of "
        f"{args.calls} calls per engine, the engines alternating; peak GB above the memory allocated before each "
        "engine's first call (its warm-up calls: list, step, captured pool)",
        "",
        "| hidden | water atoms | bucket edges | auto_max_edges | eager ms | eager unsorted ms | captured ms | "
        "auto ms (captured?) | eager / captured | peak GB eager / captured | max abs ΔF, eV/Å |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    nan = float("nan")
    for hidden, n, most, edges, med, peak, df, cap in rows:
        med = {k: med.get(k, nan) for k in ("eager", "eager unsorted", "captured", "auto")}
        peak = {k: peak.get(k, nan) for k in ("eager", "captured")}
        lines.append(
            f"| {hidden} | {n:,} | {edges if edges is None else f'{edges:,}'} | {most:,} | {med['eager']:.2f} | "
            f"{med['eager unsorted']:.2f} | {med['captured']:.2f} | {med['auto']:.2f} "
            f"({'yes' if cap.get('auto') else 'no'}) | {med['eager'] / med['captured']:.3f} | "
            f"{peak['eager']:.2f} / {peak['captured']:.2f} | {df:.2e} |"
        )
    lines.append("")
    pair = "the captured and the first" if "captured" in args.engines else "the last and the first"
    lines.append(
        f"ΔF: the largest force difference between {pair} engine's results. nan: an engine not run (--engines)."
    )
    write_lines(lines, Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
