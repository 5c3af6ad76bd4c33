"""What writing relaxations in resumable chunks costs (a probe): ``mlff-distill relax``'s path before stop 40 (one
``relax_batch`` call over the whole list, then ``ase.io.write``) against ``relax_file`` at several chunk sizes, on
one extxyz file of rattled g2 molecules (each with its ``name``), the engine kept, alternating, each timed
``--reps`` times. ``--ase-path``: also ``relax_file`` with every chunk read by ASE into ``Atoms`` (stop 40's
``relax_file``; since stop 41 extxyz goes from text to arrays and back without them).

    python benchmarks/probe_relax_file.py --out benchmarks/results --name probe_relax_file_h100
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batched_relax import rattled
from harness import environment, sync, write_lines


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="probe_relax_file_h100")
    ap.add_argument("--structures", type=int, default=16384)
    ap.add_argument("--chunks", default="8192,4096,2048")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ase-path", action="store_true", help="also relax_file with plain extxyz read by ASE (stop 40)")
    ap.add_argument("--model", default="builtin:chno-gfn2")
    args = ap.parse_args(argv)
    import ase.io
    import numpy as np

    from mlff_distiller import load_model
    from mlff_distiller.batched_relax import relax_batch
    from mlff_distiller.relax_stream import relax_file

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device, 0.0)
    model = load_model(args.model)
    tmp = Path(tempfile.mkdtemp())
    src = tmp / "in.extxyz"
    ase.io.write(src, rattled(args.structures), format="extxyz")
    relax_batch(model, ase.io.read(src, ":256"), device=device)  # warm-up: the engine, its captures

    def whole(out: Path) -> None:
        relaxed = relax_batch(model, ase.io.read(src, ":"), device=device)
        ase.io.write(out, relaxed, format="extxyz")

    import mlff_distiller.relax_stream as rs

    real_parse = rs.parse_frames

    def through_ase(out: Path, c: int) -> None:  # stop 40's relax_file: ASE's reader, an Atoms per structure
        rs.parse_frames = lambda text, info=False: None
        try:
            relax_file(model, src, out, chunk=c, device=device)
        finally:
            rs.parse_frames = real_parse

    variants = {"one call + ase.io.write (before)": whole}
    for c in [int(x) for x in args.chunks.split(",")]:
        variants[f"relax_file, chunk {c}"] = lambda out, c=c: relax_file(model, src, out, chunk=c, device=device)
        if args.ase_path:
            variants[f"relax_file, chunk {c}, through ASE's reader and Atoms"] = lambda out, c=c: through_ase(out, c)
    times: dict[str, list[float]] = {k: [] for k in variants}
    outs = {}
    for rep in range(args.reps):
        for k, (label, fn) in enumerate(variants.items()):
            out = tmp / f"out{k}_{rep}.extxyz"
            sync(device)
            t0 = time.perf_counter()
            fn(out)
            sync(device)
            times[label].append(time.perf_counter() - t0)
            outs[label] = out
            print(label, times[label][-1], flush=True)
    ref = ase.io.read(outs[next(iter(variants))], ":")
    lines = [
        "# relax_file: resumable chunks against one relax_batch call (probe_relax_file.py)",
        "",
        f"{env.device} · torch {env.torch} · Triton {env.triton} · commit {env.commit} · {args.model}, fp32",
        "",
        f"{args.structures} rattled g2 molecules from one extxyz file, fmax 0.05, the engine kept (warm-up on 256), "
        f"each variant {args.reps}x, alternating; seconds include reading and writing the file. max |Δpos|: "
        "against the first variant's output (fp32 forces of different batches round differently).",
        "",
        "| variant | seconds (each run) | median | vs one call | max abs Δpos Å | structures written |",
        "|---|---|---:|---:|---:|---:|",
    ]
    base = statistics.median(times[next(iter(variants))])
    for label, ts in times.items():
        got = ase.io.read(outs[label], ":")
        dpos = max(float(np.abs(a.positions - b.positions).max()) for a, b in zip(got, ref, strict=True))
        med = statistics.median(ts)
        lines.append(
            f"| {label} | {', '.join(f'{t:.2f}' for t in ts)} | {med:.2f} | {base / med:.2f}x | {dpos:.1e} | "
            f"{len(got)} |"
        )
    write_lines(lines, args.out, args.name)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
