"""Probe: how exact a large periodic structure's float32 stress is, with its per-structure virial sum in float32 or
accumulated in float64 (``kernels.linear._CONFIG["energy_sum_f64"]``, which ``engine_padded.edge_virial`` shares
with the energy since stop 51).

Stop 50 moved the energy's per-structure sum to float64 and left the stress's: its per-atom virial terms have both
signs, so its partial sums were expected to stay small. This probe measures it. Per water box it calls
``ForceEngine.compute(..., stress=True)`` (eager, float32, the shipped student) ``--repeats`` times per sums setting
and reports the spread of the stresses between calls and their distance from a float64 engine's stress (``--fp64-max``
atoms and below), in eV/Å³ and in MPa (1 eV/Å³ = 160,217.66 MPa).

    python benchmarks/probe_stress_sum.py --atoms 3000,24000,200001 --out DIR [--device cuda] [--name NAME]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import write_lines

EV_A3_MPA = 160217.66


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--atoms", default="3000,24000,200001")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fp64-max", type=int, default=200001)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="builtin:chno-gfn2")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_stress_sum")
    args = ap.parse_args(argv)
    from bench_large import water_box_fast

    from mlff_distiller import ForceEngine, load_model
    from mlff_distiller.batch import AtomsBatch

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    model = load_model(args.model)
    device = torch.device(args.device)
    rows = []
    for n in (int(x) for x in args.atoms.split(",")):
        atoms = water_box_fast(n)
        s64 = None
        if n <= args.fp64_max:
            engine = ForceEngine(model, device=device, precision="fp64", mode="eager")
            out = engine.compute(AtomsBatch.from_atoms([atoms], dtype=torch.float64), stress=True, to_host=True)
            s64 = out["stress"][0].double().numpy()
            del engine, out
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        engine = ForceEngine(model, device=device, precision="fp32", mode="eager")
        batch = AtomsBatch.from_atoms([atoms], dtype=torch.float32)
        for wide in (False, True):
            lin._CONFIG["energy_sum_f64"] = wide
            try:
                stresses = []
                for _ in range(args.repeats):
                    out = engine.compute(batch, stress=True, to_host=True)
                    stresses.append(out["stress"][0].double().numpy())
            finally:
                lin._CONFIG["energy_sum_f64"] = True
            st = np.stack(stresses)
            if not np.isfinite(st).all():
                raise SystemExit(f"non-finite stress at {n} atoms")
            spread = float((st.max(axis=0) - st.min(axis=0)).max())
            d64 = float(np.abs(st - s64).max()) if s64 is not None else None
            scale = float(np.abs(s64).max()) if s64 is not None else float(np.abs(st).max())
            rows.append((n, "float64" if wide else "float32", scale, spread, d64))
            print(rows[-1], flush=True)
        del engine, batch
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    import triton

    dev = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    lines = [
        "# probe_stress_sum.py: a large box's float32 stress, its per-structure virial sum in float32 or float64",
        "",
        f"{dev} · torch {torch.__version__} · triton {triton.__version__} · {args.model} · eager, float32 engine, "
        f"{args.repeats} calls per setting; the reference is a float64 engine",
        "",
        "| water atoms | per-structure sum | max abs stress (fp64), eV/Å³ | spread of the calls, eV/Å³ | "
        "max abs σ - σ(fp64), eV/Å³ | the same, MPa |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for n, how, scale, spread, d64 in rows:
        d = "" if d64 is None else f"{d64:.3e}"
        mpa = "" if d64 is None else f"{d64 * EV_A3_MPA:.4f}"
        lines.append(f"| {n:,} | {how} | {scale:.4e} | {spread:.3e} | {d} | {mpa} |")
    write_lines(lines, Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
