"""Hot MD with and without the ZBL wall: how often a trajectory of the shipped student blows up (a probe).

The 61 closed-shell CHNO g2 molecules × ``--replicas`` replicas run in one ``BatchedMD`` (Langevin, 0.5 fs, FixCom),
at each bath temperature, once with the shipped student as it ships (the wall below its training data) and once
with the wall removed (``set_repulsion(None)``), the same seed. Reported per run: the steps completed, the step at
which a replica's energy, momenta or positions first stopped being finite (``NonFiniteOutputError``, checked every
``--every`` steps) and how many replicas that was, and how many replicas the last domain check found outside the
training envelope, and the runaway replicas: finite, but hotter than 10 times the bath (atoms shot off by huge
forces, which no finiteness check sees), with the largest extent of any replica.

    python benchmarks/probe_hot_md.py --out benchmarks/results --name probe_hot_md_h100
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_lines

from mlff_distiller import BatchedMD, load_model
from mlff_distiller.batching import NonFiniteOutputError
from mlff_distiller.distill.seeds import g2_chno


def _run(model, structures, temperature: float, steps: int, every: int, seed: int, freeze: float | None) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = dict(temperature_K=temperature, seed=seed, check_domain=every, freeze_force=freeze)
        md = BatchedMD(model, structures, **kw)
        t0 = time.perf_counter()
        failed_at, n_failed = None, 0
        try:
            for _ in range(steps // every):
                md.run(every)
        except NonFiniteOutputError as exc:
            failed_at, n_failed = md.nsteps, len(exc.indices)
        seconds = time.perf_counter() - t0
        # Runaway replicas: finite, but hotter than 10x the bath (atoms shot off by huge forces).
        temps = md.temperatures()
        finite = np.isfinite(temps)
        runaway = int(np.sum(finite & (temps > 10 * temperature)))
        spread = max(float(np.ptp(a.positions, axis=0).max()) for _, a, _ in md.states()) if failed_at is None else None
    return {
        "runaway": runaway,
        "spread": spread,
        "steps": md.nsteps,
        "failed_at": failed_at,
        "n_failed": n_failed,
        "outside": len(md.domain_findings or {}),
        "frozen": len(md.frozen),
        "seconds": seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="probe_hot_md_h100")
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--every", type=int, default=500)
    p.add_argument("--temperatures", default="1000,1500,2000")
    p.add_argument("--walls", default="yes,no", help="with the wall (yes), without (no), or both")
    p.add_argument("--seed", type=int, default=0, help="the velocities' and the Langevin noise's seed")
    p.add_argument("--freeze-force", type=float, default=None, help="BatchedMD's freeze_force, eV/Å (default none)")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    structures = [a for a in g2_chno() for _ in range(args.replicas)]
    lines = [
        "# Hot MD with and without the ZBL wall (probe_hot_md.py)",
        "",
        f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'} · torch {torch.__version__} · "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"builtin:chno-gfn2, {len(structures)} trajectories (61 g2 molecules × {args.replicas}), BatchedMD Langevin "
        f"0.5 fs, friction 0.01 / fs, FixCom, fp32, up to {args.steps} steps, checked every {args.every}, seed "
        f"{args.seed}, freeze_force {args.freeze_force}.",
        "",
        "| T (K) | wall | steps run | first non-finite at step | replicas then | outside the envelope (last check) "
        "| runaway replicas (> 10x the bath) | largest extent of a replica, Å | frozen replicas | seconds |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        for wall in [w == "yes" for w in args.walls.split(",")]:
            model = load_model("builtin:chno-gfn2")
            if not wall:
                model.set_repulsion(None)
            r = _run(model, structures, temperature, args.steps, args.every, args.seed, args.freeze_force)
            spread = "-" if r["spread"] is None else f"{r['spread']:.3g}"
            lines.append(
                f"| {temperature:.0f} | {'yes' if wall else 'no'} | {r['steps']} | {r['failed_at'] or '-'} | "
                f"{r['n_failed'] or '-'} | {r['outside']} | {r['runaway']} | "
                f"{spread} | {r['frozen']} | {r['seconds']:.1f} |"
            )
            print(lines[-1], flush=True)
    print(f"wrote {write_lines(lines, args.out, args.name)}")


if __name__ == "__main__":
    main()
