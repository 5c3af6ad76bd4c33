"""Labelling cost per given frame against the number of tasks: the progress journal (one line per task) against
the former record rewritten after every task (emulated: the same write the old code made, sorted and atomic, after
each task), ASE's EMT as the teacher, on the CPU.

    python benchmarks/probe_label_progress.py --sizes 2000,15000 --out benchmarks/results

Each size labels that many rattled water molecules as given (``label --as-given``: one task per structure) into a
fresh directory, once per variant, in one process. Writes ``probe_label_progress.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from ase.build import molecule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_lines

from mlff_distiller.distill import SamplingConfig, frame_store, label, labelling


def structures(n: int):
    rng = np.random.default_rng(0)
    base = molecule("H2O")
    out = []
    for _ in range(n):
        atoms = base.copy()
        atoms.positions += rng.normal(scale=0.02, size=atoms.positions.shape)
        out.append(atoms)
    return out


class _RewriteEveryTask(labelling._ProgressRecord):
    """The former behaviour: the whole sorted record written atomically after every task (the journal line too)."""

    def mark(self, key: str, given_up: bool = False) -> None:
        super().mark(key, given_up)
        frame_store._atomic_write_text(
            self.path, json.dumps({"done": sorted(self.done), "given_up": sorted(self.given_up)})
        )


def run(n: int, record_cls) -> float:
    old = labelling._ProgressRecord
    labelling._ProgressRecord = record_cls
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = SamplingConfig(label_seeds=True, md_steps=0, rattle_per_seed=0, dedup_rms=0.0)
            t0 = time.perf_counter()
            report = label(structures(n), "emt", tmp, cfg, progress=False)
            elapsed = time.perf_counter() - t0
            assert report.written == n, report
            return elapsed
    finally:
        labelling._ProgressRecord = old


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="2000,15000")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    lines = [
        "# probe_label_progress.py: labelling cost per given frame against the task count",
        "",
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}; ASE's EMT teacher, one "
        "rattled water molecule per task, `label --as-given` (one process). ms per frame = the whole `label` call "
        "over the frames written.",
        "",
        "| frames (= tasks) | progress journal (now), ms per frame | record rewritten per task (before), ms per frame "
        "| before / now |",
        "|---:|---:|---:|---:|",
    ]
    for n in (int(s) for s in args.sizes.split(",")):
        now = run(n, labelling._ProgressRecord)
        before = run(n, _RewriteEveryTask)
        lines.append(f"| {n:,} | {1e3 * now / n:.2f} | {1e3 * before / n:.2f} | {before / now:.2f} |")
        print(lines[-1], flush=True)
    write_lines(lines, args.out, "probe_label_progress")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
