"""Probe (GPU): large structures of many sizes through ``predict_forces`` on a GPU with little memory.

Since stop 52 mode "auto" captures buckets of up to 2^21 edges, and each captured bucket keeps a private memory pool
for the engine's life. A user predicting large boxes of many sizes on a smaller GPU could fill it with those pools.
This probe caps the process's device memory (``torch.cuda.set_per_process_memory_fraction``, a stand-in for a
smaller card) and calls ``predict_forces`` twice over water boxes of ``--atoms`` sizes (``capture_after=1``: the
second pass captures each bucket), under two settings, one after the other in this process (the engine cache cleared
between them):

* ``release``: the shipped engine (an out-of-memory capture releases the other buckets' graphs once, the last retry
  of a structure releases them too);
* ``no release``: ``_may_release_for`` and ``release_captures`` stubbed to release nothing (stop 52's capture
  limit without the release).

Per setting: whether every result came back, the largest force difference from an eager float32 reference computed
first (mode "eager", the same cap), the warnings the calls raised (counted by kind), the engine's
``captures_released`` / ``capture_failures`` and the buckets left captured, and the wall time of each pass.

    python benchmarks/probe_capture_pressure.py --fraction 0.05 --atoms 9000,12000,15000,18000,21000,24000 --out DIR
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import sync, write_lines


def _kind(message: str) -> str:
    for key in (
        "released the captured graphs",
        "captured CUDA graphs of",
        "this bucket's step runs eagerly",
        "update blocks' U/V products",
    ):
        if key in message:
            return key
    return message[:60]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fraction", type=float, default=0.05)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--atoms", default="9000,12000,15000,18000,21000,24000")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_capture_pressure")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_capture_pressure: needs a CUDA device")
        return 0
    import triton
    from peers import make_student
    from systems import water_box

    from mlff_distiller import engine_padded as padded
    from mlff_distiller import predict_forces
    from mlff_distiller.engine import ForceEngine as _Engine
    from mlff_distiller.predict import clear_engine_cache

    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(args.fraction, device)
    model = make_student(hidden=args.hidden).to(device)
    boxes = [water_box(int(n), seed=0) for n in args.atoms.split(",")]
    reference = []
    for atoms in boxes:  # one eager engine at a time: the reference fits where the captures may not
        reference.append(predict_forces(model, [atoms], device=device, mode="eager")[0]["forces"])
        clear_engine_cache()
        torch.cuda.empty_cache()
    real_may, real_release = padded.PaddedPaths._may_release_for, _Engine.release_captures
    rows = []
    for setting in ("release", "no release"):
        clear_engine_cache()
        torch.cuda.empty_cache()
        if setting == "no release":
            padded.PaddedPaths._may_release_for = lambda self, bucket: False
            _Engine.release_captures = lambda self, keep=None: 0
        caught_all: list = []
        passes, results, error = [], [], None
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(2):
                    sync(device)
                    t0 = time.perf_counter()
                    results = predict_forces(model, boxes, device=device, batch_size=1)
                    sync(device)
                    passes.append(time.perf_counter() - t0)
            caught_all = [str(w.message) for w in caught]
        except torch.OutOfMemoryError as exc:
            error = f"OutOfMemoryError: {str(exc).splitlines()[0][:120]}"
            caught_all = []
        finally:
            padded.PaddedPaths._may_release_for, _Engine.release_captures = real_may, real_release
        from mlff_distiller.predict import _engines

        engine = next(iter(_engines.values()))[2] if _engines else None
        df = max(
            (float(abs(r["forces"] - f).max()) for r, f in zip(results, reference, strict=False)), default=float("nan")
        )
        row = {
            "setting": setting,
            "complete": error is None and len(results) == len(boxes),
            "error": error,
            "df": df,
            "warnings": dict(Counter(_kind(m) for m in caught_all)),
            "released": getattr(engine, "captures_released", None),
            "failures": getattr(engine, "capture_failures", None),
            "captured": len(getattr(engine, "captured_buckets", [])),
            "passes_s": passes,
            "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9,
        }
        rows.append(row)
        print(row, flush=True)
        torch.cuda.reset_peak_memory_stats(device)
    lines = [
        "# probe_capture_pressure.py: large boxes of many sizes through predict_forces on a capped device",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · random-weight "
        f"student {args.hidden} wide, float32; device memory capped at {args.fraction:.3f} of {total / 1e9:.0f} GB "
        f"({args.fraction * total / 1e9:.1f} GB); water boxes of {args.atoms} atoms; predict_forces twice over them "
        "(batch_size=1; the second pass captures each bucket)",
        "",
        "| setting | every result back | max abs ΔF vs eager, eV/Å | warnings | captures released / failed | "
        "buckets captured at the end | pass 1 / pass 2 s | error |",
        "|---|---|---:|---|---:|---:|---|---|",
    ]
    for r in rows:
        warned = "; ".join(f"{k}: {v}" for k, v in r["warnings"].items()) or "none"
        passes = " / ".join(f"{t:.2f}" for t in r["passes_s"]) or "-"
        lines.append(
            f"| {r['setting']} | {'yes' if r['complete'] else 'no'} | {r['df']:.2e} | {warned} | "
            f"{r['released']} / {r['failures']} | {r['captured']} | {passes} | {r['error'] or ''} |"
        )
    write_lines(lines, Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
