"""Probe (GPU): what stop 52's larger capture limit does to a relaxation whose batch lies between the old and new limit.

``relax_batch``'s engine (mode "auto", skin 1 Å) takes its ladder from ``engine.auto_max_edges``: 781,250 edges for
a 128-wide student at stop 51, 2^21 since stop 52. A batch of periodic water boxes whose skin list lies between the
two ran every FIRE step eagerly before and is captured now (each bucket the shrinking batch meets). This probe relaxes
the same rattled boxes with ``AUTO_MAX_EDGE_FEATURES`` at stop 51's value and at the shipped one, alternating, in one
process (the engine cache cleared between runs, so each run pays its own captures), and reports the wall time, the
FIRE steps, and the largest difference between the two runs' final positions.

    python benchmarks/probe_relax_limit.py --boxes 3 --atoms 5000 --out DIR [--name NAME]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import sync, write_lines

STOP51_EDGE_FEATURES = 100_000_000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--boxes", type=int, default=3)
    ap.add_argument("--atoms", type=int, default=5000)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--rattle", type=float, default=0.05)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_relax_limit")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_relax_limit: needs a CUDA device")
        return 0
    import triton
    from peers import make_student
    from systems import water_box

    from mlff_distiller import engine as engine_mod
    from mlff_distiller import relax_batch
    from mlff_distiller.predict import clear_engine_cache

    device = torch.device("cuda")
    model = make_student(hidden=args.hidden)
    boxes = []
    for k in range(args.boxes):
        atoms = water_box(args.atoms, seed=k)
        atoms.rattle(args.rattle, seed=k)
        boxes.append(atoms)
    settings = {"stop 51 limit": STOP51_EDGE_FEATURES, "shipped": engine_mod.AUTO_MAX_EDGE_FEATURES}
    shipped_value = engine_mod.AUTO_MAX_EDGE_FEATURES
    times = {k: [] for k in settings}
    finals, steps, limits = {}, {}, {}
    try:
        for _ in range(args.rounds):
            for name, value in settings.items():
                engine_mod.AUTO_MAX_EDGE_FEATURES = value
                limits[name] = engine_mod.auto_max_edges(args.hidden)
                clear_engine_cache()
                torch.cuda.empty_cache()
                sync(device)
                t0 = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    out = relax_batch(model, boxes, device=device, steps=args.steps, check_domain=False)
                sync(device)
                times[name].append(time.perf_counter() - t0)
                finals[name] = [a.get_positions() for a in out]
                steps[name] = [int(a.info["relax_steps"]) for a in out]
    finally:
        engine_mod.AUTO_MAX_EDGE_FEATURES = shipped_value
    names = list(settings)
    dx = max(float(np.abs(a - b).max()) for a, b in zip(finals[names[0]], finals[names[1]], strict=True))
    lines = [
        "# probe_relax_limit.py: relax_batch with stop 51's capture limit and the shipped one",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · random-weight "
        f"student {args.hidden} wide, float32; {args.boxes} water boxes of {args.atoms:,} atoms rattled by "
        f"{args.rattle} Å, relax_batch(steps={args.steps}, skin 1 Å), engine cache cleared before each run (its "
        f"captures included); {args.rounds} rounds alternating",
        "",
        "| setting | auto_max_edges | runs, s | median s | FIRE steps per box |",
        "|---|---:|---|---:|---|",
    ]
    for name in names:
        lines.append(
            f"| {name} | {limits[name]:,} | {', '.join(f'{t:.2f}' for t in times[name])} | "
            f"{statistics.median(times[name]):.2f} | {steps[name]} |"
        )
    lines += ["", f"Largest difference between the two settings' final positions: {dx:.2e} Å."]
    write_lines(lines, Path(args.out), args.name)
    print("\n".join(lines[-6:]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
