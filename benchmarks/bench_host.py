"""Host side of batched prediction: what ``predict_forces`` spends on the CPU around the GPU step.

For batches of ASE g2 molecules (the issue-5 sweep's structures) this times, on the host:

* ``from_atoms``: ``AtomsBatch.from_atoms`` (read and validate every structure), against a reference that reads
  each structure through its getters and validates it alone (the code before stop 19);
* ``molecular list``: the all-pairs NumPy neighbour list of :mod:`mlff_distiller.neighbors.molecular`, against
  the reference arithmetic (int64, separate // and %, fancy indexing);
* ``result rows``: one dict per structure from the batch's outputs, against per-structure ``torch.split`` +
  ``.numpy()``;

and, on a GPU, ``engine.predict`` end to end (ASE structures in, one dict per structure out) in eager and CUDA-graph
mode, with the GPU step alone beside it, and (``--pipeline N``) N molecules in several batches through the
sequential and the pipelined loop of :mod:`mlff_distiller.batching`, timed alternately. Medians of repeated
runs; writes ``bench_host_<device>.md``.
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

from bench_engine import g2_batch, make_student
from harness import write_lines

from mlff_distiller import AtomsBatch, ForceEngine
from mlff_distiller.batch import _validate_structure
from mlff_distiller.batching import result_rows
from mlff_distiller.neighbors.molecular import molecular_pairs


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


# ------------------------------------------------------------------------------------------ the references
def from_atoms_reference(structures) -> AtomsBatch:
    """Getters and validation per structure (AtomsBatch.from_atoms before stop 19)."""
    numbers, positions, cells, pbcs = [], [], [], []
    for k, atoms in enumerate(structures):
        pos = np.asarray(atoms.get_positions(), dtype=np.float64)
        z = np.asarray(atoms.get_atomic_numbers(), dtype=np.int64)
        cell = np.asarray(atoms.get_cell().array, dtype=np.float64)
        pbc = np.asarray(atoms.get_pbc(), dtype=bool)
        _validate_structure(k, z, pos, cell, pbc)
        numbers.append(z)
        positions.append(pos)
        cells.append(cell)
        pbcs.append(pbc)
    counts = torch.tensor([len(z) for z in numbers])
    ptr = torch.zeros(len(numbers) + 1, dtype=torch.long)
    ptr[1:] = torch.cumsum(counts, 0)
    return AtomsBatch(
        numbers=torch.from_numpy(np.concatenate(numbers)),
        positions=torch.from_numpy(np.concatenate(positions)),
        cell=torch.from_numpy(np.stack(cells)),
        pbc=torch.from_numpy(np.stack(pbcs)),
        batch=torch.repeat_interleave(torch.arange(len(numbers)), counts),
        ptr=ptr,
    )


def molecular_reference(pos: np.ndarray, p: np.ndarray, cutoff: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``molecular_pairs`` before stop 19 (int64, // and %, fancy indexing): edges and CSR offsets, with the
    zero shift tensors it also makes."""
    if not np.isfinite(pos).all():
        raise ValueError("NaN")
    counts = np.diff(p)
    n_pairs = counts * counts
    owner = np.repeat(np.arange(counts.shape[0]), n_pairs)
    local = np.arange(int(n_pairs.sum()), dtype=np.int64) - np.repeat(np.cumsum(n_pairs) - n_pairs, n_pairs)
    width = counts[owner]
    i = p[owner] + local // width
    j = p[owner] + local % width
    d = pos[j] - pos[i]
    r2 = np.einsum("ij,ij->i", d, d)
    keep = (r2 > 0.0) & (r2 < cutoff**2)
    i, j = i[keep], j[keep]
    row_ptr = np.zeros(pos.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(i, minlength=pos.shape[0]), out=row_ptr[1:])
    torch.zeros((i.shape[0], 3), dtype=torch.int64), torch.zeros((i.shape[0], 3), dtype=torch.float32)
    return torch.from_numpy(np.stack([i, j])), torch.from_numpy(row_ptr)


def rows_reference(batch: AtomsBatch, out: dict) -> list[dict]:
    energy = out["energy"].double().numpy()
    forces = [f.double().numpy() for f in batch.split(out["forces"])]
    atomic = [e.double().numpy() for e in batch.split(out["atomic_energies"])]
    return [{"energy": float(energy[b]), "forces": forces[b], "energies": atomic[b]} for b in range(len(forces))]


# ------------------------------------------------------------------------------------------------ the runs
def host_rows(sizes: list[int], reps: int) -> list[str]:
    lines = [
        "## Host phases (ms per batch, median)",
        "",
        "| structures | atoms | phase | reference ms | shipped ms | reference / shipped | µs / structure (shipped) |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for n in sizes:
        mols = g2_batch(n)
        batch = AtomsBatch.from_atoms(mols, dtype=torch.float32)
        ref = from_atoms_reference(mols)
        # (float32 batches hold each structure from its mean position since stop 50: AtomsBatch.origin)
        ref_pos = ref.positions - torch.repeat_interleave(batch.origin, batch.counts, dim=0)
        assert torch.equal(ref_pos.float(), batch.positions) and torch.equal(ref.numbers, batch.numbers)
        pos, p = batch.positions.double().numpy(), batch.ptr.numpy()
        edges, row_ptr = molecular_reference(pos, p, 5.0)
        nl = molecular_pairs(batch.positions, batch.ptr, 5.0)
        assert torch.equal(edges, nl.edge_index) and torch.equal(row_ptr, nl.row_ptr)
        gen = torch.Generator().manual_seed(n)
        out = {
            "energy": torch.randn(n, generator=gen),
            "forces": torch.randn(batch.num_atoms, 3, generator=gen),
            "atomic_energies": torch.randn(batch.num_atoms, generator=gen),
        }
        phases = [
            ("from_atoms", lambda m=mols: from_atoms_reference(m), lambda m=mols: AtomsBatch.from_atoms(m)),
            (
                "molecular list (5 Å)",
                lambda x=pos, q=p: molecular_reference(x, q, 5.0),
                lambda b=batch: molecular_pairs(b.positions, b.ptr, 5.0),
            ),
            ("result rows", lambda b=batch, o=out: rows_reference(b, o), lambda b=batch, o=out: result_rows(b, o)),
        ]
        for name, ref_fn, fn in phases:
            t_ref, t_new = median_ms(ref_fn, reps), median_ms(fn, reps)
            lines.append(
                f"| {n} | {batch.num_atoms} | {name} | {t_ref:.3f} | {t_new:.3f} | {t_ref / t_new:.2f}x | "
                f"{t_new * 1e3 / n:.2f} |"
            )
            print(lines[-1], flush=True)
    return lines


def gpu_rows(sizes: list[int], reps: int) -> list[str]:
    lines = [
        "",
        "## engine.predict end to end on the GPU (ASE structures in, one dict per structure out)",
        "",
        "`predict`: `ForceEngine.predict(structures, batch_size=len(structures))`, wall clock, median. `step`: the "
        "energy + forces step alone (a replay in cudagraph mode), from bench_engine's StepImpl.",
        "",
        "| mode | structures | atoms | predict ms | µs / structure | structures / s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    model = make_student()
    for mode in ("eager", "cudagraph"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = ForceEngine(model, device="cuda", mode=mode)
        for n in sizes:
            mols = g2_batch(n)
            atoms = sum(len(m) for m in mols)

            def run(mols=mols, engine=engine):
                engine.predict(mols, batch_size=len(mols))
                torch.cuda.synchronize()

            t = median_ms(run, reps)
            lines.append(f"| {mode} | {n} | {atoms} | {t:.3f} | {t * 1e3 / n:.2f} | {n / t * 1e3:.3g} |")
            print(lines[-1], flush=True)
    return lines


def ab_ms(fa, fb, reps: int) -> tuple[float, float]:
    """Medians (ms) of ``fa`` and ``fb`` timed alternately (which goes first alternates too), after one warm-up
    call of each: both see the same host and device state."""
    fa(), fb()
    ta, tb = [], []
    for r in range(reps):
        for fn, out in ((fa, ta), (fb, tb)) if r % 2 == 0 else ((fb, tb), (fa, ta)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(ta) * 1e3, statistics.median(tb) * 1e3


def pipeline_rows(n: int, batch_sizes: list[int | None], reps: int) -> list[str]:
    """``engine.predict`` over ``n`` g2 molecules in several batches, sequential (``pipeline=False``) against
    pipelined (the default on CUDA), timed alternately in one process; the rows are checked equal first."""
    lines = [
        "",
        f"## engine.predict over {n} g2 molecules in batches: sequential vs pipelined (same run, alternating)",
        "",
        "`batch`: structures per batch (`budget`: batches filled to the engine's atom budget, the default). "
        "Wall clock per predict call, median; `max |ΔF|`: pipelined vs sequential rows.",
        "",
        "| mode | batch | batches | sequential ms | pipelined ms | sequential µs / structure | "
        "pipelined µs / structure | speed-up | max abs ΔF eV/Å |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    model = make_student()
    mols = g2_batch(n)
    for mode in ("eager", "cudagraph"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = ForceEngine(model, device="cuda", mode=mode)
        for bs in batch_sizes:

            def run(pipeline, bs=bs, engine=engine):
                out = engine.predict(mols, batch_size=bs, pipeline=pipeline)
                torch.cuda.synchronize()
                return out

            seq, pipe = run(False), run(True)
            diff = max(float(np.abs(a["forces"] - b["forces"]).max()) for a, b in zip(seq, pipe, strict=True))
            assert len(seq) == len(pipe) == n and diff <= 1e-4, diff
            budget = engine.atom_budget()
            n_batches = -(-n // bs) if bs else sum(1 for _ in _budget_chunks(mols, budget))
            t_seq, t_pipe = ab_ms(lambda r=run: r(False), lambda r=run: r(True), reps)
            label = str(bs) if bs else f"budget ({budget} atoms)"
            lines.append(
                f"| {mode} | {label} | {n_batches} | {t_seq:.2f} | {t_pipe:.2f} | {t_seq * 1e3 / n:.2f} | "
                f"{t_pipe * 1e3 / n:.2f} | {t_seq / t_pipe:.2f}x | {diff:.1e} |"
            )
            print(lines[-1], flush=True)
    return lines


def _budget_chunks(mols, budget):
    from mlff_distiller.batching import chunks

    return chunks(mols, None, budget)


def profile_predict(n: int, mode: str) -> list[str]:
    """cProfile of one ``engine.predict`` over ``n`` g2 molecules on CUDA (after a warm-up call), top 30 by
    internal time: where the host time of the end-to-end rows goes."""
    import cProfile
    import io
    import pstats

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = ForceEngine(make_student(), device="cuda", mode=mode)
    mols = g2_batch(n)
    engine.predict(mols, batch_size=n)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    engine.predict(mols, batch_size=n)
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    return ["", f"## cProfile of one engine.predict, {n} g2 molecules, mode {mode}", "", "```", buf.getvalue(), "```"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 256, 1024, 4096])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--gpu", action="store_true", help="also engine.predict end to end on CUDA")
    ap.add_argument("--pipeline", type=int, default=0, help="with --gpu: N molecules, sequential vs pipelined")
    ap.add_argument("--pipeline-batches", type=int, nargs="+", default=[512, 2048, 0], help="0: the atom budget")
    ap.add_argument("--profile-modes", nargs="+", default=["cudagraph"], help="engine modes --profile runs")
    ap.add_argument("--profile", type=int, default=0, help="with --gpu: cProfile one predict of this many molecules")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    import platform

    import triton

    cpu = platform.processor() or platform.machine()
    head = [
        "# Host side of batched prediction (bench_host.py)",
        "",
        f"torch {torch.__version__} · triton {triton.__version__} · Python {platform.python_version()} · "
        f"{cpu}, {torch.get_num_threads()} threads"
        + (f" · {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
        "",
        "Structures: ASE's g2 molecules, cycled (bench_engine.g2_batch). Reference and shipped code timed in the "
        "same run and checked equal first.",
        "",
    ]
    lines = head + host_rows(args.sizes, args.reps)
    if args.gpu:
        if not torch.cuda.is_available():
            print("--gpu needs CUDA", file=sys.stderr)
            return 2
        if args.sizes:
            lines += gpu_rows(args.sizes, max(3, args.reps // 3))
        if args.pipeline:
            lines += pipeline_rows(args.pipeline, [b or None for b in args.pipeline_batches], max(3, args.reps // 2))
        if args.profile:
            for mode in args.profile_modes:
                lines += profile_predict(args.profile, mode)
    name = args.name or f"bench_host_{'cuda' if args.gpu else 'cpu'}"
    print(f"wrote {write_lines(lines, args.out, name)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
