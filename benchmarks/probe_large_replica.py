"""Probe (GPU): are the largest boxes' results right? A periodic box A and its two-fold replica B = A x (2, 1, 1)
must give E_B = 2 E_A and, atom for atom, the forces of A twice.

Issue 7's largest-box row says what fits (1,000,002 water atoms in 52 GB; 2,000,001 ran in 103 GB), not whether the
numbers are right, and a float64 reference does not fit there. An index that overflows 32 bits in a kernel or in
the neighbour list (2,000,001 atoms: ~108M pairs, ~2.2e9 entries of the [E, 20] radial basis) would show here as
forces that differ between the two copies, or from A's. What float32 allows: A's copy in B sits one box length
further out, so its positions round differently (``probe_large_precision.py``: ~5e-4 eV/Å at 126 Å).

    python benchmarks/probe_large_replica.py --atoms 120000,500001,1000002 --out DIR

Without CUDA it prints one line and returns.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import sync, write_lines


def compute(engine, atoms) -> tuple[float, np.ndarray, float]:
    """Energy, forces and seconds (a first call of its size: compiles included) of one ``engine.compute`` on a
    device-resident batch (as bench_large's largest-box row calls it)."""
    from mlff_distiller.batch import AtomsBatch

    batch = AtomsBatch.from_atoms([atoms], dtype=torch.float32).to(engine.device)
    sync(engine.device)
    t0 = time.perf_counter()
    out = engine.compute(batch, to_host=True)
    seconds = time.perf_counter() - t0
    return float(out["energy"][0]), out["forces"].double().numpy(), seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--atoms", default="120000,500001,1000002", help="sizes of A (B has twice as many atoms)")
    ap.add_argument("--model", default="builtin:chno-gfn2")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_large_replica")
    ap.add_argument("--device", default="cuda", help="cpu: a check of the probe itself on small boxes")
    ap.add_argument(
        "--pairs",
        default="float64",
        choices=("float64", "float32", "both"),
        help="pair vectors from float64 positions (the engine's default beyond 100 Å), from float32 ones, or both",
    )
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("probe_large_replica: needs a CUDA device")
        return 0
    import triton
    from bench_large import water_box_fast

    from mlff_distiller import ForceEngine, load_model
    from mlff_distiller import batch as batch_module

    model = load_model(args.model)
    engine = ForceEngine(model, device=args.device, precision="fp32", mode="eager")
    where = torch.cuda.get_device_name() if cuda else "CPU"

    threshold = batch_module.PRECISE_PAIRS_FROM
    pairs = ("float64", "float32") if args.pairs == "both" else (args.pairs,)
    rows = []
    for n, kind in ((int(x), kind) for x in args.atoms.split(",") for kind in pairs):
        a = water_box_fast(n)
        a.wrap()
        b = a.repeat((2, 1, 1))
        # float64: every box, A too (a wrapped A's coordinates from its first atom may all stay below the threshold)
        batch_module.PRECISE_PAIRS_FROM = 0.0 if kind == "float64" else float("inf")
        try:  # the batches are made inside compute
            e_a, f_a, _ = compute(engine, a)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            e_b, f_b, t_b = compute(engine, b)
        finally:
            batch_module.PRECISE_PAIRS_FROM = threshold
        peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan")
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        na = len(a)
        d1 = float(np.abs(f_b[:na] - f_a).max())
        d2 = float(np.abs(f_b[na:] - f_a).max())
        finite = bool(np.isfinite(f_b).all() and np.isfinite(e_b))
        rel = abs(e_b - 2 * e_a) / abs(2 * e_a)
        ok = finite and rel <= 1e-6 and max(d1, d2) <= 2e-3
        rows.append((na, len(b), kind, e_a, e_b, rel, d1, d2, float(np.abs(f_a).max()), t_b, peak, ok))
        print(rows[-1], flush=True)
    lines = [
        "# probe_large_replica.py: a water box A and its replica B = A x (2, 1, 1), float32",
        "",
        f"{where} · torch {torch.__version__} · triton {triton.__version__} · model "
        f"{args.model}, ForceEngine eager (cell list), device-resident batches",
        "",
        "Pass: finite, abs(E_B - 2 E_A) / abs(2 E_A) ≤ 1e-6, and each copy's forces within 2e-3 eV/Å of A's (float32 "
        "positions one box length further out round differently: ~5e-4 eV/Å at 126 Å).",
        "",
        "Pair vectors: float64, made from the float64 positions a float32 batch keeps (`AtomsBatch.positions64`; "
        "the engine's default from 100 Å, here for A and B alike), or float32, from the float32 positions.",
        "",
        "| atoms A | atoms B | pair vectors | E_A eV | E_B eV | rel. abs E_B - 2 E_A | max abs ΔF copy 1 | copy 2 | "
        "max abs F_A | B s (first call) | B peak GB | pass |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for na, nb, kind, e_a, e_b, rel, d1, d2, fmax, t_b, peak, ok in rows:
        lines.append(
            f"| {na} | {nb} | {kind} | {e_a:.2f} | {e_b:.2f} | {rel:.1e} | {d1:.2e} | {d2:.2e} | {fmax:.2f} | "
            f"{t_b:.2f} | {peak:.1f} | {'yes' if ok else 'NO'} |"
        )
    write_lines(lines, Path(args.out), args.name)
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
