"""Probe (GPU): the out-of-memory retry with the update blocks' recompute, against a real CUDA out-of-memory error.

One structure that alone does not fit is tried once more with ``painn_update._CONFIG["recompute_uv_min_atoms"]``
lowered to its atom count (``batching.recompute_before_retry``: ``predict_forces``, ``StudentCalculator``,
``BatchedMD``, ``relax_batch``). The CPU tests inject the error; this probe makes the device run out. For each path
and water box it measures the peak of one call with the recompute off (P0) and on (P1), then caps the caching
allocator (``torch.cuda.set_per_process_memory_fraction``) at ``baseline + P1 + f (P0 - P1)`` for each ``f`` of
``--fractions`` and calls again with the recompute off: the first attempt must run out of memory, the retry
(with its warning) must fit, and the result must equal the uncapped one. A cap below P1 must raise the error.

    python benchmarks/probe_oom_retry.py --atoms 200001 --out DIR [--name probe_oom_retry]

Without CUDA it prints one line and returns.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import write_lines


def _update_config() -> dict:
    return importlib.import_module("mlff_distiller.kernels.painn_update")._CONFIG


def _fresh() -> None:
    from mlff_distiller.predict import clear_engine_cache

    clear_engine_cache()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _run(path: str, model, atoms) -> tuple[float, np.ndarray]:
    """One energy + forces call through ``path``: ``predict`` (predict_forces) or ``calculator`` (a fresh
    StudentCalculator, as a first MD step)."""
    from mlff_distiller import StudentCalculator, predict_forces

    if path == "predict":
        row = predict_forces(model, [atoms], device="cuda")[0]
        return row["energy"], row["forces"]
    a = atoms.copy()
    a.calc = StudentCalculator(model, device="cuda")
    return float(a.get_potential_energy()), a.get_forces()


def measure(path: str, model, atoms, fractions: list[float], caps: str = "reserved") -> list[dict]:
    config = _update_config()
    dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    peaks, results = {}, {}
    for label, limit in (("off", None), ("on", 0)):
        config["recompute_uv_min_atoms"] = limit
        _fresh()
        _run(path, model, atoms)  # the kernels compiled, the engine's buffers made
        _fresh()
        base = torch.cuda.memory_reserved(dev)  # the allocator's cap counts reserved (cudaMalloc'd) memory
        base_alloc = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        results[label] = _run(path, model, atoms)
        seconds = time.perf_counter() - t0
        peaks[label] = (
            torch.cuda.max_memory_reserved(dev) - base,
            torch.cuda.max_memory_allocated(dev) - base_alloc,
            seconds,
        )
    config["recompute_uv_min_atoms"] = None
    # caps from P1 (the recompute's peak: reserved, or allocated with --caps alloc) up to P0 (reserved, without it)
    p0, p1 = peaks["off"][0], peaks["on"][0 if caps == "reserved" else 1]
    rows = [
        dict(
            path=path,
            atoms=len(atoms),
            case=f"uncapped, recompute {k}",
            cap_gb=None,
            peak_gb=peaks[k][0] / 1e9,
            alloc_gb=peaks[k][1] / 1e9,
            outcome=f"fits ({peaks[k][2]:.2f} s)",
            d_e=abs(results[k][0] - results["off"][0]),
            d_f=float(np.abs(results[k][1] - results["off"][1]).max()),
        )
        for k in ("off", "on")
    ]
    for f in fractions:
        config["recompute_uv_min_atoms"] = None
        _fresh()
        cap = torch.cuda.memory_reserved(dev) + p1 + f * (p0 - p1)
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), dev)
        row = dict(path=path, atoms=len(atoms), case=f"cap at P1 + {f:g} (P0 - P1)", cap_gb=cap / 1e9)
        row |= dict(peak_gb=None, alloc_gb=None, d_e=None, d_f=None)
        caught = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                e, forces = _run(path, model, atoms)
            row["outcome"] = "result returned"
            row["d_e"] = abs(e - results["off"][0])
            row["d_f"] = float(np.abs(forces - results["off"][1]).max())
        except torch.OutOfMemoryError:
            row["outcome"] = "OutOfMemoryError raised"
        finally:
            retried = any("ran out of GPU memory" in str(w.message) for w in caught)
            row["outcome"] = ("after an OOM and the retry: " if retried else "no retry: ") + row.get("outcome", "?")
            row["limit_after"] = config["recompute_uv_min_atoms"]
            config["recompute_uv_min_atoms"] = None
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--atoms", default="200001", help="comma-separated water box sizes")
    ap.add_argument("--paths", default="predict,calculator")
    ap.add_argument("--fractions", default="0.5,0.2,-0.3", help="caps between P1 (0) and P0 (1); < 0: below P1")
    ap.add_argument(
        "--caps", choices=("reserved", "alloc"), default="reserved", help="P1 of the caps: reserved or allocated"
    )
    ap.add_argument("--model", default="builtin:chno-gfn2")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_oom_retry")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_oom_retry: needs a CUDA device")
        return 0
    import triton
    from bench_large import water_box_fast

    from mlff_distiller import load_model

    model = load_model(args.model)
    fractions = [float(f) for f in args.fractions.split(",")]
    rows = []
    for n in (int(x) for x in args.atoms.split(",")):
        atoms = water_box_fast(n)
        for path in args.paths.split(","):
            rows += measure(path, model, atoms, fractions, args.caps)
            print(rows[-1], flush=True)
    name = torch.cuda.get_device_name()
    lines = [
        "# probe_oom_retry.py: a real CUDA out-of-memory error, then the retry with the recompute",
        "",
        f"{name} · torch {torch.__version__} · triton {triton.__version__} · model {args.model}, fp32, mode auto",
        "",
        "P0 / P1 (`peak GB`): the call's peak of reserved memory above what was reserved before it, recompute off / "
        "on (`alloc GB`: the same of allocated memory). "
        f"Caps run from P1 = the recompute's {'reserved' if args.caps == 'reserved' else 'allocated'} peak to P0 = "
        "the reserved peak without it. Caps are the caching allocator's "
        "(`set_per_process_memory_fraction`, which counts reserved memory), counted from 0 (they include what was "
        "reserved before). ΔE, ΔF: against the uncapped call with the recompute off. "
        f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}.",
        "",
        "| path | atoms | case | cap GB | peak GB | alloc GB | outcome | limit after | ΔE eV | max ΔF eV/Å |",
        "|---|---:|---|---:|---:|---:|---|---:|---:|---:|",
    ]

    def fmt(x, spec):
        return "" if x is None else format(x, spec)

    for r in rows:
        lines.append(
            f"| {r['path']} | {r['atoms']} | {r['case']} | {fmt(r['cap_gb'], '.3f')} | {fmt(r['peak_gb'], '.3f')} | "
            f"{fmt(r['alloc_gb'], '.3f')} | {r['outcome']} | {fmt(r.get('limit_after'), 'd')} | "
            f"{fmt(r['d_e'], '.2e')} | {fmt(r['d_f'], '.2e')} |"
        )
    write_lines(lines, Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
