"""Probe (GPU): how exact a large structure's float32 energy is, with its per-structure sum in float32 atomics or
accumulated in float64 (``kernels.linear._CONFIG["energy_sum_f64"]``).

Stop 50's out-of-memory probe saw a 200,001-atom water box's energy (-5e5 eV) differ by 46 eV between two calls of
the same float32 step whose forces agreed to 1.4e-6 eV/Å. This probe calls ``ForceEngine.compute`` (eager, float32,
the shipped student) ``--repeats`` times per water box and sums setting, and reports the spread of the energies, their
distance from the float64 sum of the same call's atomic energies, and from a float64 engine's energy (``--fp64-max``
atoms and below).

    python benchmarks/probe_energy_sum.py --atoms 24000,200001,1000002 --out DIR [--name probe_energy_sum]

Without CUDA it prints one line and returns.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import write_lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--atoms", default="24000,200001,1000002")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fp64-max", type=int, default=200001)
    ap.add_argument("--model", default="builtin:chno-gfn2")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_energy_sum")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_energy_sum: needs a CUDA device")
        return 0
    import triton
    from bench_large import water_box_fast

    from mlff_distiller import ForceEngine, load_model
    from mlff_distiller.batch import AtomsBatch

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    model = load_model(args.model)
    rows = []
    for n in (int(x) for x in args.atoms.split(",")):
        atoms = water_box_fast(n)
        e64 = None
        if n <= args.fp64_max:
            engine = ForceEngine(model, device="cuda", precision="fp64", mode="eager")
            e64 = float(engine.compute(AtomsBatch.from_atoms([atoms], dtype=torch.float64))["energy"][0])
            del engine
            gc.collect()
            torch.cuda.empty_cache()
        engine = ForceEngine(model, device="cuda", precision="fp32", mode="eager")
        batch = AtomsBatch.from_atoms([atoms], dtype=torch.float32)
        for wide in (False, True):
            lin._CONFIG["energy_sum_f64"] = wide
            energies, sums = [], []
            for _ in range(args.repeats):
                out = engine.compute(batch, to_host=True)
                energies.append(float(out["energy"][0]))
                sums.append(float(out["atomic_energies"].double().sum()))
            lin._CONFIG["energy_sum_f64"] = True
            spread = max(energies) - min(energies)
            d_sum = max(abs(e - s) for e, s in zip(energies, sums, strict=True))
            d64 = max(abs(e - e64) for e in energies) if e64 is not None else None
            rows.append((n, "float64" if wide else "float32 atomics", energies[0], spread, d_sum, d64))
            print(rows[-1], flush=True)
        del engine, batch
        gc.collect()
        torch.cuda.empty_cache()
    lines = [
        "# probe_energy_sum.py: a large structure's float32 energy, its per-structure sum in float32 or float64",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · model "
        f"{args.model}, ForceEngine eager, float32, {args.repeats} calls per row",
        "",
        "spread: max - min of the calls' energies; |E - Σε|: the largest distance of a call's energy from the float64 "
        "sum of its own atomic energies; |E - E64|: from a float64 engine's energy of the same box.",
        "",
        "| atoms | per-structure sum | E (first call) eV | spread eV | max abs E - Σε eV | max abs E - E64 eV |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for n, how, e, spread, d_sum, d64 in rows:
        d64s = "" if d64 is None else f"{d64:.4f}"
        lines.append(f"| {n} | {how} | {e:.4f} | {spread:.4f} | {d_sum:.4f} | {d64s} |")
    write_lines(lines, Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
