"""Where a cold start's time goes with the compile-ahead dry run, per size of its thread pool.

    python benchmarks/probe_compile_ahead.py [--workers off 1 4 16] [--repeats 1] [--out benchmarks/results]

Each row is a fresh process on an empty Triton cache: ``load_model("builtin:chno-gfn2")``, a CUDA-graph engine and
its first benzene energy + forces. ``off`` compiles each kernel at its first launch
(``MLFF_DISTILLER_COMPILE_AHEAD=0``); a number runs the dry run with that many threads, and the row splits its time
into the dry run's block (the step's Python with every launch turned into a compile request) and the wait that
follows for the compiles still running (each builds its launcher in the same worker).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = """
import json, sys, time
import torch
from ase.build import molecule
from mlff_distiller import AtomsBatch, ForceEngine, load_model
from mlff_distiller.kernels import _compile_ahead

workers = sys.argv[1]
if workers != "off":
    _compile_ahead.MAX_WORKERS = int(workers)
model = load_model("builtin:chno-gfn2")
batch = AtomsBatch.from_atoms([molecule("C6H6")])
engine = ForceEngine(model, device="cuda", mode="cudagraph")
t0 = time.perf_counter()
engine.compute(batch, forces=True)
torch.cuda.synchronize()
first = time.perf_counter() - t0
print(json.dumps({"first_s": first, "dry_run": _compile_ahead.LAST}))
"""


def run(workers: str, cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TORCHINDUCTOR_CACHE_DIR")}
    env["TRITON_CACHE_DIR"] = str(cache)
    env["MLFF_DISTILLER_COMPILE_AHEAD"] = "0" if workers == "off" else "1"
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD, workers], env=env, capture_output=True, text=True, timeout=300)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    row = json.loads(lines[-1]) if lines else {"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    row["process_s"] = time.perf_counter() - t0
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", nargs="+", default=["off", "1", "4", "16"])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="write probe_compile_ahead.md/json here")
    args = p.parse_args(argv)
    import torch
    import triton

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for i, w in enumerate(args.workers):  # a cache directory of its own for every row: all cold
                row = {"workers": w, "repeat": r, **run(w, Path(tmp) / f"cache_{r}_{i}")}
                rows.append(row)
                print(json.dumps(row), flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    lines = [
        f"# Cold start per compile-ahead pool size ({gpu}, torch {torch.__version__}, Triton {triton.__version__})",
        "",
        "Fresh process, empty Triton cache: first benzene energy + forces of a CUDA-graph engine (load excluded).",
        "",
        "| workers | first result s | dry run: block s | then waiting for compiles + launchers s | kernels compiled |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        sec = (row.get("dry_run") or {}).get("seconds") or {}
        cells = [f"{sec[k]:.2f}" if k in sec else "" for k in ("block", "compiles")]
        n = (row.get("dry_run") or {}).get("compiled", "")
        first = f"{row['first_s']:.2f}" if "first_s" in row else row.get("error", "")
        lines.append(f"| {row['workers']} | {first} | {' | '.join(cells)} | {n if row['workers'] != 'off' else ''} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_compile_ahead.md").write_text(text)
        (args.out / "probe_compile_ahead.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
