"""What a call of ``predict_forces`` costs beyond its step, and where ``mlff-distill predict`` spends its time.

    python benchmarks/probe_predict_reuse.py --out results/ [--cli-structures 100000]

Section ``reuse``: per call, wall clock (median of ``--reps`` calls after two warm ones, results on the host):

* ``fresh engine``: ``ForceEngine(model).predict(structures)`` with a new engine each call, which is what
  ``predict_forces`` did before it kept its engines (a new engine captures its buckets again);
* ``one engine``: the same engine every call;
* ``predict_forces``: the public call as this tree ships it.

for one benzene, 64 and 1,024 CHNO g2 molecules (the shipped student, fp32, mode "auto").

Section ``cli``: ``predict_file`` (``mlff-distill predict``) over ``--cli-structures`` rattled g2 molecules written
as extxyz, with ASE's extxyz reader and writer and with the fast codec (``mlff_distiller._extxyz_fast``), each in
one process and with the default worker processes (all four outputs compared with the first), and beside them,
each timed alone: reading the file, ``predict_forces`` on all structures in memory, writing the results.
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


def _difference(a: str, b: str) -> str:
    """How two outputs of the same structures differ: the same bytes, or the largest energy and force differences
    (CUDA's float32 sums of atomics vary from run to run in their last bits, so two runs need not print the same
    digits). Raises when the structures or their atoms differ."""
    if a == b:
        return "the same bytes"
    la, lb = a.split("\n"), b.split("\n")
    assert len(la) == len(lb), "outputs of different lengths"
    d_e = d_f = 0.0
    k = 0
    while k < len(la) and la[k].strip():
        n = int(la[k])
        ea, eb = (float(x.split(" energy=", 1)[1].split()[0]) for x in (la[k + 1], lb[k + 1]))
        d_e = max(d_e, abs(ea - eb))
        fa = np.array([r.split()[4:7] for r in la[k + 2 : k + 2 + n]], dtype=float)
        fb = np.array([r.split()[4:7] for r in lb[k + 2 : k + 2 + n]], dtype=float)
        assert [r.split()[:4] for r in la[k + 2 : k + 2 + n]] == [r.split()[:4] for r in lb[k + 2 : k + 2 + n]]
        d_f = max(d_f, float(np.abs(fa - fb).max()))
        k += 2 + n
    return f"max |ΔE| {d_e:.1e} eV, |ΔF| {d_f:.1e} eV/Å"


def cli_rows(
    model,
    device: torch.device,
    count: int,
    codecs: tuple[str, ...] = ("ASE", "fast"),
    workers_list=None,
    named: bool = False,
) -> list[str]:
    """``predict_file`` four ways in one run: ASE's extxyz reader and writer (the fast codec switched off, as
    before it) or the fast codec of ``mlff_distiller._extxyz_fast``, each in one process and with the automatic
    worker processes; every output compared with the first (a fixed batch size, so that all four compute the same
    batches); and the parts of the work, each alone."""
    import ase.io

    from mlff_distiller import _extxyz_fast, _extxyz_parallel
    from mlff_distiller._extxyz_parallel import frames_text
    from mlff_distiller.batch import FrameTable

    structures = g2_chno(count, seed=3)
    for k, a in enumerate(structures):
        a.rattle(0.02, seed=k)
        if named:  # each frame with name=<formula> in its comment line, as ASE writes the g2 set
            a.info["name"] = a.get_chemical_formula()
    workers = 0
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "in.extxyz")
        ase.io.write(src, structures, format="extxyz")
        workers = auto_workers(src)
        # Warm the process first (CUDA context, kernels compiled or loaded from Triton's cache): otherwise the first
        # variant timed pays them, which a second run of the command on the same machine does not.
        predict_forces(model, structures[:256], device=device)
        reference = None
        for codec in codecs:
            declined = lambda text, info=False: None  # noqa: E731 (ASE's codec: every block declined)
            _extxyz_parallel.parse_frames = _extxyz_fast.parse_frames if codec == "fast" else declined
            for n_workers in workers_list or (0, workers):
                out = Path(tmp, f"{codec}-{n_workers}.extxyz")
                t0 = time.perf_counter()
                done = predict_file(model, src, out, device=device, workers=n_workers, batch_size=4096)
                seconds = time.perf_counter() - t0
                parts = ", ".join(f"{k} {v:.2f}" for k, v in done["parts"].items())
                data = out.read_text()
                if reference is None:
                    reference, same = data, "(the reference)"
                else:
                    same = _difference(reference, data)
                out.unlink()
                runs.append((codec, n_workers, seconds, same, parts))
                print(f"{codec} codec, {n_workers} workers: {seconds:.2f} s, {same}", flush=True)
        _extxyz_parallel.parse_frames = _extxyz_fast.parse_frames
        text = src.read_text()
        t0 = time.perf_counter()
        frames = list(ase.io.iread(str(src)))
        ase_read = time.perf_counter() - t0
        t0 = time.perf_counter()
        arrays = _extxyz_fast.parse_frames(text, info=True)
        fast_read = time.perf_counter() - t0
        assert arrays is not None and len(arrays[4]) == count
        t0 = time.perf_counter()
        preds = predict_forces(model, frames, device=device)
        compute = time.perf_counter() - t0
        table = FrameTable(*arrays[:5])
        predict_forces(model, table, device=device)  # the engine kept from the call above: warm
        t0 = time.perf_counter()
        predict_forces(model, table, device=device)
        compute_table = time.perf_counter() - t0
        t0 = time.perf_counter()
        frames_text(frames, preds)
        ase_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        _extxyz_fast.format_frames(arrays, preds)
        fast_write = time.perf_counter() - t0
        del text
    us = 1e6 / count
    lines = [
        f"## cli: {count:,} CHNO g2 molecules (mean {sum(len(a) for a in structures) / count:.1f} atoms), extxyz",
        "",
        "`predict_file` (the command's work: chunks of 10,000 structures, batches of 4,096), each output against the "
        "first:",
        "",
        "| extxyz reader and writer | worker processes | s | µs per structure | output | this process's s: parts |",
        "|---|---:|---:|---:|---|---|",
        *(f"| {c} | {w} | {t:.2f} | {t * us:.1f} | {same} | {parts} |" for c, w, t, same, parts in runs),
        "",
        "Each part alone, in one process:",
        "",
        "| part | s | µs per structure |",
        "|---|---:|---:|",
        f"| ASE `iread` of the input | {ase_read:.2f} | {ase_read * us:.1f} |",
        f"| `parse_frames` (fast codec) of the input | {fast_read:.2f} | {fast_read * us:.1f} |",
        f"| `predict_forces` on the `Atoms` in memory (first call: engine built) | {compute:.2f} | "
        f"{compute * us:.1f} |",
        f"| `predict_forces` on a `FrameTable` of the same (engine kept) | {compute_table:.2f} | "
        f"{compute_table * us:.1f} |",
        f"| `frames_text` (results into `Atoms`, ASE's writer) | {ase_write:.2f} | {ase_write * us:.1f} |",
        f"| `format_frames` (fast codec) | {fast_write:.2f} | {fast_write * us:.1f} |",
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
    ap.add_argument("--cli-codecs", default="ASE,fast", help="extxyz readers and writers to time: ASE, fast")
    ap.add_argument("--cli-workers", default="", help="worker counts to time (default: 0 and the automatic one)")
    ap.add_argument("--cli-named", action="store_true", help="every frame with a name=<formula> info string")
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
        workers_list = [int(w) for w in args.cli_workers.split(",") if w] or None
        codecs = tuple(args.cli_codecs.split(","))
        lines += cli_rows(model, device, args.cli_structures, codecs, workers_list, named=args.cli_named)
    print(write_lines(lines, args.out, args.name))


if __name__ == "__main__":
    main()
