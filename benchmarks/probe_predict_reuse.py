"""What a call of ``predict_forces`` costs beyond its step, and where ``mlff-distill predict`` spends its time.

    python benchmarks/probe_predict_reuse.py --out results/ [--cli-structures 100000]

Section ``reuse``: per call, wall clock (median of ``--reps`` calls after two warm ones, results on the host):

* ``fresh engine``: ``ForceEngine(model).predict(structures)`` with a new engine each call, which is what
  ``predict_forces`` did before it kept its engines (a new engine captures its buckets again);
* ``one engine``: the same engine every call;
* ``predict_forces``: the public call as this tree ships it.

for one benzene, 64 and 1,024 CHNO g2 molecules (the shipped student, fp32, mode "auto").

Section ``cli``: ``predict_file`` (``mlff-distill predict``) over ``--cli-structures`` rattled g2 molecules written
as extxyz, in one process and with its default worker processes (the same structures and results, up to float32
rounding where the two runs' engines batch differently), and beside it, each timed alone: ASE reading the file,
``predict_forces`` on all structures in memory, and ASE writing the results: how much of the command is file I/O.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import environment, sync, write_lines
from systems import g2_chno

from mlff_distiller import ForceEngine, load_model, predict_forces
from mlff_distiller._extxyz_parallel import auto_workers
from mlff_distiller.predict_stream import predict_file


def _median_ms(fn, reps: int, device: torch.device) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def reuse_rows(model, device: torch.device, reps: int) -> list[str]:
    from ase.build import molecule

    lines = [
        "## reuse: ms per call (median)",
        "",
        "| structures | fresh engine per call | one engine | predict_forces (this tree) | fresh / one |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, structures in [
        ("benzene", [molecule("C6H6")]),
        ("64 g2", g2_chno(64, seed=1)),
        ("1,024 g2", g2_chno(1024, seed=2)),
    ]:
        fresh = _median_ms(lambda s=structures: ForceEngine(model, device=device, mode="auto").predict(s), reps, device)
        engine = ForceEngine(model, device=device, mode="auto")
        one = _median_ms(lambda s=structures, e=engine: e.predict(s), reps, device)
        public = _median_ms(lambda s=structures: predict_forces(model, s, device=device), reps, device)
        lines.append(f"| {name} | {fresh:.2f} | {one:.2f} | {public:.2f} | {fresh / one:.1f}x |")
        print(lines[-1], flush=True)
    return lines


def cli_rows(model, device: torch.device, count: int) -> list[str]:
    import ase.io
    from ase.calculators.singlepoint import SinglePointCalculator

    structures = g2_chno(count, seed=3)
    for k, a in enumerate(structures):
        a.rattle(0.02, seed=k)
    with tempfile.TemporaryDirectory() as tmp:
        src, out, alone = Path(tmp, "in.extxyz"), Path(tmp, "out.extxyz"), Path(tmp, "alone.extxyz")
        ase.io.write(src, structures, format="extxyz")
        t0 = time.perf_counter()
        result = predict_file(model, src, out, device=device, workers=0)
        whole = time.perf_counter() - t0
        print(f"one process: {whole:.2f} s", flush=True)
        workers = auto_workers(src)
        par_out = Path(tmp, "parallel.extxyz")
        t0 = time.perf_counter()
        predict_file(model, src, par_out, device=device, workers=workers)
        parallel = time.perf_counter() - t0
        a_frames, b_frames = ase.io.read(out, ":"), ase.io.read(par_out, ":")
        assert len(a_frames) == len(b_frames) == count
        pairs = list(zip(a_frames, b_frames, strict=True))
        d_e = max(abs(a.get_potential_energy() - b.get_potential_energy()) for a, b in pairs)
        d_f = max(float(np.abs(a.get_forces() - b.get_forces()).max()) for a, b in pairs)
        same = f"max |ΔE| {d_e:.1e} eV, |ΔF| {d_f:.1e} eV/Å"
        if out.read_bytes() == par_out.read_bytes():
            same = "the same bytes"
        print(f"{workers} workers: {parallel:.2f} s, {same}", flush=True)
        t0 = time.perf_counter()
        frames = list(ase.io.iread(str(src)))
        read = time.perf_counter() - t0
        t0 = time.perf_counter()
        preds = predict_forces(model, frames, device=device)
        compute = time.perf_counter() - t0
        t0 = time.perf_counter()
        written = []
        for a, p in zip(frames, preds, strict=True):
            b = a.copy()
            b.calc = SinglePointCalculator(b, energy=p["energy"], forces=p["forces"], energies=p["energies"])
            written.append(b)
        ase.io.write(alone, written, format="extxyz")
        write = time.perf_counter() - t0
    us = 1e6 / count
    lines = [
        f"## cli: {count:,} CHNO g2 molecules (mean {sum(len(a) for a in structures) / count:.1f} atoms), extxyz",
        "",
        "| part | s | µs per structure |",
        "|---|---:|---:|",
        f"| `predict_file` (the command's work), chunks of 10,000, one process | {whole:.2f} | {whole * us:.1f} |",
        f"| the same with {workers} worker processes reading and writing (against one process: {same}) | "
        f"{parallel:.2f} | "
        f"{parallel * us:.1f} |",
        f"| ASE `iread` of the input alone | {read:.2f} | {read * us:.1f} |",
        f"| `predict_forces` on the structures in memory | {compute:.2f} | {compute * us:.1f} |",
        f"| results into `Atoms` + ASE `write` alone | {write:.2f} | {write * us:.1f} |",
        "",
        f"predict_file wrote {result['structures']:,} structures.",
    ]
    print("\n".join(lines), flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--name", default="probe_predict_reuse")
    ap.add_argument("--sections", default="reuse,cli")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cli-structures", type=int, default=100_000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    model = load_model("builtin:chno-gfn2")
    env = environment(device, 0.0)
    lines = [
        "# probe_predict_reuse.py: a predict_forces call beyond its step, and mlff-distill predict's time",
        "",
        f"{env.device} · torch {env.torch} · Triton {env.triton} · commit {env.commit} · host {env.host}",
        "",
    ]
    sections = args.sections.split(",")
    if "reuse" in sections:
        lines += [*reuse_rows(model, device, args.reps), ""]
    if "cli" in sections:
        lines += cli_rows(model, device, args.cli_structures)
    print(write_lines(lines, args.out, args.name))


if __name__ == "__main__":
    main()
