"""Probe (GPU): float32 forces against float64 as a periodic box grows, and how much of the difference is the
positions' own float32 rounding.

A float32 position of an atom at x Å is off by up to half of float32's spacing there (3.8e-6 Å at 64 Å, 7.6e-6 at
126 Å), so two neighbours' distance in a large box carries an error that does not shrink with the box's other
numbers. This probe runs ``ForceEngine`` (eager, the shipped student) on water boxes of growing size in float32
(F32) and float64 (F64), and float64 on the float32-rounded positions (F64r: what float32 storage of the positions
alone costs), and reports the largest and RMS differences beside the engine's float32 tolerance
(``TOLERANCES["fp32"]``: max abs ΔF ≤ 1e-4 · max(1, max abs F)). F32x: float32 with the pair vectors made in float64
from the float64 positions the batch keeps (``AtomsBatch.positions64``; the engine's default from 100 Å, here forced
for every box), F32 with them made from the float32 positions (forced for every box).

    python benchmarks/probe_large_precision.py --atoms 192,3000,24000,200001 --out DIR

Without CUDA it prints one line and returns.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import write_lines


def forces(engine, atoms, dtype, exact_pairs: bool = False) -> np.ndarray:
    from mlff_distiller import batch as batch_module
    from mlff_distiller.batch import AtomsBatch

    threshold = batch_module.PRECISE_PAIRS_FROM
    batch_module.PRECISE_PAIRS_FROM = 0.0 if exact_pairs else float("inf")
    try:
        batch = AtomsBatch.from_atoms([atoms], dtype=dtype)
    finally:
        batch_module.PRECISE_PAIRS_FROM = threshold
    out = engine.compute(batch, to_host=True)
    return out["forces"].double().numpy()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--atoms", default="192,3000,24000,200001")
    ap.add_argument("--model", default="builtin:chno-gfn2")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_large_precision")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_large_precision: needs a CUDA device")
        return 0
    import triton
    from bench_large import water_box_fast

    from mlff_distiller import ForceEngine, load_model

    model = load_model(args.model)
    e64 = ForceEngine(model, device="cuda", precision="fp64", mode="eager")
    e32 = ForceEngine(model, device="cuda", precision="fp32", mode="eager")
    rows = []
    for n in (int(x) for x in args.atoms.split(",")):
        atoms = water_box_fast(n)
        atoms.wrap()
        rounded = atoms.copy()
        rounded.positions = atoms.positions.astype(np.float32).astype(np.float64)
        f64 = forces(e64, atoms, torch.float64)
        f64r = forces(e64, rounded, torch.float64)
        f32 = forces(e32, atoms, torch.float32)
        f32x = forces(e32, atoms, torch.float32, exact_pairs=True)
        scale = max(1.0, float(np.abs(f64).max()))

        def stats(d):
            return float(np.abs(d).max()), float(np.sqrt((d**2).mean()))

        rows.append(
            (n, float(atoms.cell[0, 0]), scale, *stats(f32 - f64), *stats(f32x - f64), *stats(f64r - f64), 1e-4 * scale)
        )
        print(rows[-1], flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    lines = [
        "# probe_large_precision.py: float32 forces against float64 as the box grows",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · model "
        f"{args.model}, ForceEngine eager, wrapped water boxes",
        "",
        "F32 / F64: the float32 / float64 engine; F64r: float64 on the positions rounded to float32 (their storage "
        "alone). Tolerance: the engine's float32 check, 1e-4 · max(1, max abs F).",
        "",
        "| atoms | box Å | max abs F eV/Å | max abs F32 - F64 | RMS | max abs F32x - F64 | RMS | max abs F64r - F64 | "
        "RMS | tolerance |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, side, scale, m32, r32, mx, rx, mr, rr, tol in rows:
        lines.append(
            f"| {n} | {side:.1f} | {scale:.2f} | {m32:.2e} | {r32:.2e} | {mx:.2e} | {rx:.2e} | {mr:.2e} | {rr:.2e} | "
            f"{tol:.1e} |"
        )
    write_lines(lines, Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
