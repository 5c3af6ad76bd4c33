"""Fixed-shape MD beyond ``AUTO_MAX_EDGES``: the eager step (shipped) against a captured bucket (a probe, GPU).

``mode="auto"`` pads and captures graphs of up to ``AUTO_MAX_EDGES`` (2^19) edges and runs larger ones eagerly:
for a one-off large graph a capture costs more than it saves. MD repeats one shape for thousands of steps, and an
eager step of a large batch costs ~10-14 ms of host launches (stop 21), which a replay does not. Stop 35 measured
4,096 benzenes in ``BatchedMD`` (≈ 540,000 edges with the skin, eager) at 4.18 µs per replica-step against 3.58 for
1,024 (captured). This probe runs the same trajectories with the engine's ladder as shipped and with its largest
bucket raised to 2^21 edges, the two alternating in one process:

* ``BatchedMD`` of N benzenes and of N g2 molecules (Langevin, 300 K, 0.5 fs): ms per step, median of 50-step
  blocks after 100 warm-up steps;
* ``ForceEngine`` MD-style calls on a water box (Verlet list, positions moved a little each call): ms per call.

    python benchmarks/probe_large_capture.py --out benchmarks/results --name probe_large_capture
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batched_md import g2_pool
from bench_large import box
from harness import environment, sync, write_lines

LARGE = 2**21


def _ladder(engine, large: bool) -> None:
    from mlff_distiller.buckets import BucketLadder

    if large:
        engine.buckets = BucketLadder(max_edges=LARGE)


def batched(model, structures, large: bool, device, blocks: int) -> float:
    from mlff_distiller.batched_md import BatchedMD

    md = BatchedMD(model, structures, device=device, seed=0)
    _ladder(md.engine, large)
    md.run(100)
    times = []
    for _ in range(blocks):
        sync(device)
        t0 = time.perf_counter()
        md.run(50)
        sync(device)
        times.append((time.perf_counter() - t0) / 50)
    assert np.isfinite(md.potential_energies()).all()
    return 1e3 * statistics.median(times)


def water_md(model, atoms, large: bool, device, calls: int) -> float:
    from mlff_distiller import AtomsBatch, ForceEngine

    engine = ForceEngine(model, device=device, mode="auto", neighbor_skin=1.0)
    _ladder(engine, large)
    rng = np.random.default_rng(0)
    pos = atoms.get_positions()
    times = []
    for k in range(calls + 20):
        a = atoms.copy()
        a.positions = pos + rng.normal(0, 0.005, pos.shape)
        batch = AtomsBatch.from_atoms([a])
        sync(device)
        t0 = time.perf_counter()
        out = engine.compute(batch, forces=True)
        sync(device)
        if k >= 20:
            times.append(time.perf_counter() - t0)
    assert torch.isfinite(out["forces"]).all()
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> list[str]:
    from ase.build import molecule

    from mlff_distiller import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="probe_large_capture")
    ap.add_argument("--model", default="builtin:chno-gfn2")
    ap.add_argument("--replicas", type=int, default=4096)
    ap.add_argument("--water", type=int, default=24000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the probe itself (no capture there)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    env = environment(device, 0.0)
    model = load_model(args.model)
    pool = g2_pool()
    systems = {
        f"BatchedMD, {args.replicas} benzenes": lambda large: batched(
            model, [molecule("C6H6") for _ in range(args.replicas)], large, device, args.blocks
        ),
        f"BatchedMD, {2 * args.replicas} g2 molecules": lambda large: batched(
            model, [pool[i % len(pool)] for i in range(2 * args.replicas)], large, device, args.blocks
        ),
        f"ForceEngine, water {args.water} atoms, skin 1 Å": lambda large: water_md(
            model, box(args.water), large, device, 30
        ),
    }
    lines = [
        "# Fixed-shape MD beyond AUTO_MAX_EDGES: eager (shipped) against a captured bucket (probe_large_capture.py)",
        "",
        f"{env.device} · torch {env.torch} · Triton {env.triton} · commit {env.commit} · {args.model}, fp32",
        "",
        f"ms per step (BatchedMD: median of 50-step blocks after 100 warm-up steps; water: median engine call), "
        f"the shipped ladder (largest bucket 2^19 edges: these run eagerly) and one up to 2^21 (captured), "
        f"alternating, {args.rounds} rounds.",
        "",
        "| system | shipped (eager) ms | largest bucket 2^21 (captured) ms | ratio |",
        "|---|---|---|---:|",
    ]
    for name, run in systems.items():
        got = {False: [], True: []}
        for r in range(args.rounds):
            for large in (False, True) if r % 2 == 0 else (True, False):
                got[large].append(run(large))
                torch.cuda.empty_cache()
                print(name, "large" if large else "shipped", f"{got[large][-1]:.3f} ms", flush=True)
        a, b = statistics.median(got[False]), statistics.median(got[True])
        fa, fb = ", ".join(f"{x:.3f}" for x in got[False]), ", ".join(f"{x:.3f}" for x in got[True])
        lines.append(f"| {name} | {fa} | {fb} | {a / b:.3f} |")
        print(lines[-1], flush=True)
    write_lines(lines, args.out, args.name)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
