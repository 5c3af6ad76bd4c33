"""Benchmark (GPU): end-to-end latency of small molecules and small batches through the engine, host work included.

``ForceEngine(mode="cudagraph", precision="fp32")`` on the default student (``bench_engine.make_student``), fed
``AtomsBatch`` es on the host as ``predict_forces`` and ``StudentCalculator`` (single points) feed it: the
neighbour list, the padded bucket's fill, the replay and the copy back, per call. Beside it, the captured step
alone (replay + sync) of the same bucket, so the difference is the host path. Also ``engine.predict`` (what
``predict_forces`` runs) on single molecules: ``ase.Atoms`` in, dicts out. Median and p20 of wall-clock calls
(each waits for its results).

``--parts`` (stop 74) adds, per case, the host pieces of one call timed alone: the host all-pairs list
(``molecular_pairs``), the fill of the bucket, and beside them the device alternatives (``molecular_pairs_device``
with the host's ``ptr`` as the engine calls it, in the Triton kernels and in torch ops, and the engine's general
device list on positions already on the GPU, each synchronised), so the crossover between a host and a device list
can be read off.

``--ab`` (stop 76) times each call with this tree's lists against stop 75's, alternating in one process (the host's
noise between calls is 1.5-2x): stop 75's way is a host list up to 32,768 candidate pairs and the torch device
enumeration beyond; this tree's is ``HOST_LIST_MAX_PAIRS`` and the Triton enumeration, and ``--ab-limits`` adds
columns with other host-list limits (the Triton enumeration beyond each), to choose the limit.

    python benchmarks/bench_small_e2e.py --out benchmarks/results [--name small_e2e_h100] [--hidden 64] [--parts]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import g2_batch, make_student
from harness import wall_us, write_lines

from mlff_distiller import AtomsBatch, ForceEngine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="small_e2e_h100")
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--profile", action="store_true", help="also a cProfile table of the host side (one benzene)")
    p.add_argument("--hidden", type=int, default=128, help="the student's width (64: the dense step for molecules)")
    p.add_argument("--batches", default="4,16,64,256,1024", help="g2 batch sizes, comma-separated")
    p.add_argument("--parts", action="store_true", help="also the host and device pieces of each call (see above)")
    p.add_argument(
        "--ab", action="store_true", help="also each call against stop 75's lists, alternating in this process (above)"
    )
    p.add_argument(
        "--ab-limits", default="", help="with --ab: other host-list limits (candidate pairs), comma-separated"
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_small_e2e: needs CUDA")
        return
    import triton
    from ase.build import molecule

    model = make_student(hidden=args.hidden).to("cuda")
    engine = ForceEngine(model, device="cuda", precision="fp32", mode="cudagraph")
    cases = [(name, [molecule(name)]) for name in ("H2", "H2O", "CH4", "C6H6")]
    cases += [(f"g2 x {b}", g2_batch(int(b))) for b in args.batches.split(",")]
    rows, parts, ab = [], [], []
    limits = [int(x) for x in args.ab_limits.split(",") if x]
    for name, structs in cases:
        batch = AtomsBatch.from_atoms(structs, dtype=engine.dtype)
        engine.compute(batch, to_host=True)  # capture
        e2e, e2e20 = wall_us(lambda b=batch: engine.compute(b, to_host=True), args.reps)
        bucket = engine.last_bucket
        runner = _runner_of(engine, bucket)

        def replay(r=runner):
            r.replay()
            torch.cuda.synchronize()

        step = wall_us(replay, args.reps)[0] if runner is not None else float("nan")
        per = len(structs)
        host = e2e - step
        rows.append(
            f"| {name} | {batch.num_atoms} | {e2e:.1f} | {e2e20:.1f} | {step:.1f} | {host:.1f} | {e2e / per:.2f} |"
        )
        if args.parts:
            parts.append(_parts_row(engine, name, batch, bucket, args.reps))
        if args.ab:
            ab.append(_ab_row(engine, name, batch, args.reps, limits))
    pf = []
    for name in ("H2O", "C6H6"):
        atoms = [molecule(name)]
        engine.predict(atoms)
        t = wall_us(lambda a=atoms: engine.predict(a), args.reps)
        pf.append(f"| engine.predict, one {name} (ase.Atoms in, dict out) | {t[0]:.1f} | {t[1]:.1f} |")
    for b in args.batches.split(",")[-1:]:
        mols = g2_batch(int(b))
        engine.predict(mols)
        t = wall_us(lambda m=mols: engine.predict(m), max(20, args.reps // 10), warmup=3)
        pf.append(
            f"| engine.predict, g2 x {b} (ase.Atoms in, dicts out; µs a structure) | {t[0] / int(b):.2f} | "
            f"{t[1] / int(b):.2f} |"
        )
    lines = [
        "# bench_small_e2e.py: small molecules end to end through ForceEngine (cudagraph, fp32)",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
        f"{args.reps} calls each · random-weight student {args.hidden} x 3 (bench_engine.make_student)",
        "",
        "| case | atoms | e2e µs (median) | e2e p20 | replay + sync µs | host path µs | e2e µs / structure |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "| call | median µs | p20 µs |",
        "|---|---:|---:|",
        *pf,
    ]
    if ab:
        import mlff_distiller.engine_eager as eager

        heads = [f"host list to {eager.HOST_LIST_MAX_PAIRS:,} (this tree)"] + [f"host list to {n:,}" for n in limits]
        lines += [
            "",
            "This tree's lists against stop 75's, alternating in this process (`--ab`: 6 rounds of `reps / 6` timed "
            "calls each way after 10 untimed; median µs end to end). Stop 75's way: the host list up to 32,768 "
            "candidate pairs, the torch device enumeration beyond; the other columns: the host list up to the "
            "limit named, the Triton enumeration beyond.",
            "",
            "| case | " + " | ".join(heads) + " | stop 75's lists | stop 75 / this tree |",
            "|---|" + "---:|" * (len(heads) + 2),
            *ab,
        ]
    if parts:
        lines += [
            "",
            "One call's pieces, each timed alone (median µs of wall-clock calls; the device ones synchronised): the "
            "host list (`molecular_pairs` on host tensors, what the engine builds for molecules given on the host), "
            "the bucket's fill from it, and the device alternatives on positions already on the GPU.",
            "",
            "| case | edges | host list µs | fill µs (host fill or device fill) | `molecular_pairs_device` µs "
            "(Triton) | the same in torch ops µs | engine's device list µs | positions to the GPU µs |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            *parts,
        ]
    if args.profile:
        import cProfile
        import io
        import pstats

        batch = AtomsBatch.from_atoms([molecule("C6H6")], dtype=engine.dtype)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.reps):
            engine.compute(batch, to_host=True)
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
        what = f"cProfile of {args.reps} calls of engine.compute (one benzene, to_host), by internal time:"
        lines += ["", what, "```", buf.getvalue(), "```"]
    write_lines(lines, args.out, args.name)


def _runner_of(engine: ForceEngine, bucket):
    """The captured runner of ``bucket``'s last step: the dense step's where the engine took it, else the model's."""
    from mlff_distiller.engine_padded import DENSE_SLOTS

    graph = engine._graphs.get(bucket)
    np_ = engine._dense_slots(graph) if graph is not None else None
    if np_ is not None and np_ in DENSE_SLOTS:
        return engine._dense_runners[np_].get(bucket)
    return engine._runners.get(bucket)


def _ab_row(engine: ForceEngine, name: str, batch: AtomsBatch, reps: int, limits: list[int]) -> str:
    """``compute(batch, to_host=True)`` with this tree's lists, with each other host-list limit in ``limits`` and
    with stop 75's lists, alternating (see ``--ab``)."""
    import time

    import numpy as np

    import mlff_distiller.engine_eager as eager
    from mlff_distiller.neighbors.molecular import _molecular_pairs_device_torch

    limit, device_pairs = eager.HOST_LIST_MAX_PAIRS, eager.molecular_pairs_device
    ways = [("this", limit, device_pairs)] + [(n, n, device_pairs) for n in limits]
    ways.append(("stop 75", 32_768, _molecular_pairs_device_torch))
    times = {key: [] for key, _, _ in ways}
    per = max(10, reps // 6)
    for _round in range(6):
        for key, host_limit, pairs in ways:
            eager.HOST_LIST_MAX_PAIRS, eager.molecular_pairs_device = host_limit, pairs
            try:
                for k in range(10 + per):
                    t0 = time.perf_counter()
                    engine.compute(batch, to_host=True)
                    if k >= 10:
                        times[key].append(time.perf_counter() - t0)
            finally:
                eager.HOST_LIST_MAX_PAIRS, eager.molecular_pairs_device = limit, device_pairs
    med = [float(np.median(times[key])) * 1e6 for key, _, _ in ways]
    return f"| {name} | " + " | ".join(f"{t:.1f}" for t in med) + f" | {med[-1] / med[0]:.2f}x |"


def _parts_row(engine: ForceEngine, name: str, batch: AtomsBatch, bucket, reps: int) -> str:
    from mlff_distiller.buckets import HOST_FILL_MAX_EDGES, fill_padded, fill_padded_host
    from mlff_distiller.neighbors.molecular import (
        _molecular_pairs_device_torch,
        molecular_pairs,
        molecular_pairs_device,
    )

    reps = max(20, reps // 4)
    host_list = wall_us(lambda: molecular_pairs(batch.positions, batch.ptr, engine.cutoff), reps)[0]
    nl = molecular_pairs(batch.positions, batch.ptr, engine.cutoff)
    graph = engine._graph(bucket)
    if bucket.edges <= HOST_FILL_MAX_EDGES:

        def fill():
            fill_padded_host(
                graph,
                batch.numbers.numpy(),
                batch.positions.numpy(),
                batch.batch.numpy(),
                batch.num_structures,
                nl.edge_index.numpy(),
                nl.row_ptr.numpy(),
                record=False,
            )
            torch.cuda.synchronize()

        how = "host"
    else:
        dev = batch.to("cuda", engine.dtype)
        dnl = engine._nl_to_device(nl)

        def fill():
            fill_padded(
                graph, dev.numbers, dev.positions, dev.batch, dev.num_structures, dnl.edge_index, dnl.shift_vectors
            )
            torch.cuda.synchronize()

        how = "device"
    filled = wall_us(fill, reps)[0]
    engine._graph_tokens[bucket] = -1  # the probe's fills leave no topology the engine may reuse
    dev = batch.to("cuda", engine.dtype)

    def synced(fn):
        def run():
            fn()
            torch.cuda.synchronize()

        return run

    dev_pairs = wall_us(synced(lambda: molecular_pairs_device(dev.positions, batch.ptr, engine.cutoff)), reps)[0]
    torch_pairs = wall_us(synced(lambda: _molecular_pairs_device_torch(dev.positions, batch.ptr, engine.cutoff)), reps)[
        0
    ]
    dev_list = wall_us(synced(lambda: engine._neighbors(dev)), reps)[0]
    to_gpu = wall_us(synced(lambda: batch.positions.to("cuda", non_blocking=False)), reps)[0]
    return (
        f"| {name} | {nl.num_edges} | {host_list:.1f} | {filled:.1f} ({how}) | {dev_pairs:.1f} | {torch_pairs:.1f} | "
        f"{dev_list:.1f} "
        f"| {to_gpu:.1f} |"
    )


if __name__ == "__main__":
    main()
