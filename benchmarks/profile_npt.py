"""Where an ASE NPTBerendsen step of the student goes: cProfile of the host side, per call of the calculator.

    python benchmarks/profile_npt.py --student PATH --atoms 192 --steps 200 --out results/

Runs ``--steps`` NPTBerendsen steps (300 K, 1 bar, water's compressibility, τ_P 200 fs, 0.5 fs) on a water box
through ``StudentCalculator`` (default mode) after a warm-up, first timed, then under cProfile. Writes
``<out>/<name>.txt``: the wall time per step, the engine calls per step, list builds and cell updates, and the
top functions by cumulative and by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import environment
from peers import make_student
from systems import water_box

from mlff_distiller import StudentCalculator, load_model


def main(argv: list[str] | None = None) -> str:
    from mlff_distiller.distill import npt_berendsen

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--student", default=None, help="checkpoint (default: seeded random 128 x 3)")
    ap.add_argument("--atoms", type=int, default=192)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--name", default="profile_npt")
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_model(args.student) if args.student else make_student()
    atoms = water_box(args.atoms, seed=2)
    atoms.calc = StudentCalculator(model, device=device)
    dyn = npt_berendsen(atoms, taup_fs=200.0)
    dyn.run(10)
    engine = atoms.calc.engine
    calls = []
    compute = engine.compute
    engine.compute = lambda batch, **kw: calls.append(kw.get("stress", False)) or compute(batch, **kw)
    t0 = time.perf_counter()
    dyn.run(args.steps)
    if device.type == "cuda":
        torch.cuda.synchronize()
    per_step = (time.perf_counter() - t0) / args.steps
    n_calls, n_stress = len(calls), sum(calls)
    profiler = cProfile.Profile()
    profiler.enable()
    dyn.run(args.steps)
    profiler.disable()
    env = environment(device, copy_gbps=0.0)
    v = engine.verlet
    head = [
        f"# profile_npt.py: {env.device} · torch {env.torch} · triton {env.triton} · commit {env.commit}",
        f"student: {args.student or 'seeded random 128 x 3'}; {args.atoms}-atom water box; {args.steps} steps",
        f"wall per NPT step (unprofiled): {1e3 * per_step:.3f} ms; engine calls per step: "
        f"{n_calls / args.steps:.2f} (with stress: {n_stress / args.steps:.2f})",
        f"list builds {v.n_builds if v else None}, cell updates {v.cell_updates if v else None}",
        "",
    ]
    text = "\n".join(head)
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats(key).print_stats(40)
        text += f"\n## by {key}\n" + buf.getvalue()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.txt").write_text(text)
    print("\n".join(head))
    return text


if __name__ == "__main__":
    main()
