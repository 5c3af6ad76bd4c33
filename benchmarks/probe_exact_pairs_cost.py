"""Probe (GPU): what float64 pair vectors cost a large box's step (``AtomsBatch.positions64``).

A float32 batch whose coordinates reach ``PRECISE_PAIRS_FROM`` (100 Å) keeps float64 positions, and the engine's
eager step makes the pair vectors from them (``_exact_pairs``: two gathers, the shifts times the cell, one rounding
per edge) and hands them to the model as shift vectors with zero positions. This probe times the same wrapped water
box both ways in one process, alternating: ``engine.compute`` on a device-resident batch (the step with the pair
vectors, wall clock, synchronised), median of ``--reps`` calls after two untimed ones, and ``AtomsBatch.from_atoms``
(the host's check of the coordinates and the float64 copy). Ratio = float64 pairs / float32 pairs.

    python benchmarks/probe_exact_pairs_cost.py --atoms 24000,200001 --out DIR

Without CUDA it prints one line and returns (``--device cpu``: a check of the probe itself on a small box).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import sync, write_lines


def _batch(atoms, exact: bool):
    from mlff_distiller import batch as batch_module
    from mlff_distiller.batch import AtomsBatch

    threshold = batch_module.PRECISE_PAIRS_FROM
    batch_module.PRECISE_PAIRS_FROM = 0.0 if exact else float("inf")
    try:
        return AtomsBatch.from_atoms([atoms], dtype=torch.float32)
    finally:
        batch_module.PRECISE_PAIRS_FROM = threshold


def _median_s(fn, reps: int, device) -> float:
    t = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        t.append(time.perf_counter() - t0)
    return float(np.median(t))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--atoms", default="24000,200001")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--model", default="builtin:chno-gfn2")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_exact_pairs_cost")
    ap.add_argument("--device", default="cuda", help="cpu: a check of the probe itself on a small box")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("probe_exact_pairs_cost: needs a CUDA device")
        return 0
    import triton
    from bench_large import water_box_fast

    from mlff_distiller import ForceEngine, load_model

    device = torch.device(args.device)
    engine = ForceEngine(load_model(args.model), device=device, precision="fp32", mode="eager")
    rows = []
    for n in (int(x) for x in args.atoms.split(",")):
        atoms = water_box_fast(n)
        atoms.wrap()
        batches = {exact: _batch(atoms, exact).to(device) for exact in (False, True)}
        assert batches[True].positions64 is not None and batches[False].positions64 is None
        out = {}
        for exact, b in batches.items():  # two untimed calls each (compiles, the allocator's cache)
            for _ in range(2):
                out[exact] = engine.compute(b, to_host=True)["forces"].double().numpy()
        step = {False: [], True: []}
        host = {False: [], True: []}
        for _ in range(2):  # alternating rounds
            for exact, b in batches.items():
                step[exact].append(_median_s(lambda b=b: engine.compute(b), args.reps, device))
                host[exact].append(_median_s(lambda e=exact, a=atoms: _batch(a, e), args.reps, torch.device("cpu")))
        diff = float(np.abs(out[True] - out[False]).max())
        s32, s64 = float(np.median(step[False])), float(np.median(step[True]))
        h32, h64 = float(np.median(host[False])), float(np.median(host[True]))
        rows.append((n, float(atoms.cell[0, 0]), s32 * 1e3, s64 * 1e3, s64 / s32, h32 * 1e3, h64 * 1e3, diff))
        print(rows[-1], flush=True)
    where = torch.cuda.get_device_name() if cuda else "CPU"
    lines = [
        "# probe_exact_pairs_cost.py: a step with float64 pair vectors against float32 ones",
        "",
        f"{where} · torch {torch.__version__} · triton {triton.__version__} · model {args.model}, ForceEngine "
        f"eager, float32, wrapped water boxes, device-resident batches; medians of {args.reps} calls, two "
        "alternating rounds",
        "",
        "| atoms | box Å | step ms, float32 pairs | float64 pairs | ratio | from_atoms ms, float32 pairs | float64 "
        "pairs | max abs ΔF eV/Å between them |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, side, s32, s64, ratio, h32, h64, diff in rows:
        lines.append(f"| {n} | {side:.1f} | {s32:.3f} | {s64:.3f} | {ratio:.3f} | {h32:.3f} | {h64:.3f} | {diff:.2e} |")
    write_lines(lines, Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
