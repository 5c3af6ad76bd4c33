"""Many MD trajectories at once: the 61 g2 molecules the shipped student learned, several replicas each, advanced
together by BatchedMD (one engine call per step for all of them), with their trajectories written as extxyz.

python examples/batched_md.py [--replicas 4] [--steps 200] [--output runs.extxyz]

On a GPU, thousands of trajectories cost little more per step than one (``docs/performance.md``, "Stop 35").
"""

from __future__ import annotations

import argparse
import time

import ase.io
import numpy as np
import torch

from mlff_distiller import DEFAULT_MODEL, BatchedMD, StudentModel, builtin_models
from mlff_distiller.distill.seeds import g2_chno


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--output", default="")
    args = ap.parse_args()
    if DEFAULT_MODEL.split(":", 1)[1] in builtin_models():
        model = DEFAULT_MODEL
    else:
        torch.manual_seed(0)
        model = StudentModel(species=[1, 6, 7, 8])
    molecules = g2_chno()
    structures = [m for m in molecules for _ in range(args.replicas)]
    md = BatchedMD(model, structures, ensemble="langevin", temperature_K=300.0, friction_per_fs=0.02, seed=0)
    frames = []

    def report(m: BatchedMD) -> None:
        t = m.temperatures()
        print(f"  {m.time_fs:6.1f} fs  mean T = {t.mean():6.1f} K  (replicas {t.min():.0f}-{t.max():.0f} K)")
        if args.output:
            frames.extend(m.get_atoms())

    t0 = time.perf_counter()
    md.run(args.steps, observer=report, interval=max(args.steps // 4, 1))
    seconds = time.perf_counter() - t0
    n = md.n_replicas
    print(
        f"{n} trajectories ({len(molecules)} molecules x {args.replicas}), {args.steps} Langevin steps on "
        f"{md.device}: {seconds:.2f} s, {1e6 * seconds / (n * args.steps):.1f} µs per replica-step, "
        f"{md.engine.verlet.n_builds} list builds"
    )
    e = md.potential_energies()
    assert np.isfinite(e).all()
    if args.output:
        ase.io.write(args.output, frames)  # each frame's info names its replica: split with a.info["replica"]
        print(f"wrote {len(frames)} frames to {args.output}")


if __name__ == "__main__":
    main()
