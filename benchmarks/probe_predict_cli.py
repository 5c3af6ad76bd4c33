"""``mlff-distill predict`` as a user runs it: a fresh process from the shell prompt to its exit, and its start-up.

    python benchmarks/probe_predict_cli.py make FILE [--structures 100000] [--repeat 1]
    python benchmarks/probe_predict_cli.py time FILE [--workers N] [--label TEXT]

``make`` writes rattled CHNO g2 molecules as extxyz (ASE's writer), ``--repeat`` times over (the same structures
again: a large file without the cost of writing it). ``time`` prints one line of JSON with, each in a fresh
interpreter:

* ``help_s``: ``mlff-distill --help``, the whole process;
* ``import_s``: ``import mlff_distiller`` and all its public names (torch among them);
* ``pool_s``: 12 extxyz worker processes started from their forkserver and each having run a task (what
  ``predict_file`` waits for before the workers take over the file);
* ``predict_s``: ``mlff-distill predict --input FILE`` (the shipped student, default settings but ``--workers``
  when given), the whole process, and the output's frame count checked;
* ``us_per_structure``: ``predict_s`` over the structures.

Meant to run through ``scripts/ab_package.sh run`` (old package against the tree, alternating) on the GPU host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

POOL = """
import os, time
t0 = time.perf_counter()
from mlff_distiller._extxyz_parallel import _StartingPool
pool = _StartingPool(12)
[f.result() for f in [pool.submit(os.getpid) for _ in range(48)]]
print(time.perf_counter() - t0)
pool.shutdown()
"""


def _wall(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, out.stdout


def make(path: Path, structures: int, repeat: int) -> None:
    import ase.io
    from systems import g2_chno

    frames = g2_chno(structures, seed=3)
    for k, a in enumerate(frames):
        a.rattle(0.02, seed=k)
    ase.io.write(path, frames, format="extxyz")
    if repeat > 1:
        text = path.read_text()
        with path.open("a") as fh:
            for _ in range(repeat - 1):
                fh.write(text)
    print(f"wrote {structures * repeat:,} structures to {path} ({path.stat().st_size / 1e6:.0f} MB)")


def time_cli(path: Path, workers: int | None, label: str) -> dict:
    count = sum(1 for line in path.open() if "Properties=" in line)  # one comment line per frame
    py = sys.executable
    row = {"label": label, "side": os.environ.get("AB_SIDE", ""), "structures": count}
    row["help_s"], _ = _wall([py, "-m", "mlff_distiller.cli", "--help"])
    row["import_s"], _ = _wall([py, "-c", "import mlff_distiller as m; [getattr(m, n) for n in m.__all__]"])
    row["pool_s"] = float(_wall([py, "-c", POOL])[1].split()[-1])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "out.extxyz")
        cmd = [py, "-m", "mlff_distiller.cli", "predict", "--input", str(path), "--output", str(out)]
        if workers is not None:
            cmd += ["--workers", str(workers)]
        row["predict_s"], stdout = _wall(cmd)
        written = sum(1 for line in out.open() if "Properties=" in line)
        if written != count:
            raise RuntimeError(f"{written} frames written for {count} read: {stdout[-500:]}")
    row["us_per_structure"] = 1e6 * row["predict_s"] / count
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("make")
    p.add_argument("file", type=Path)
    p.add_argument("--structures", type=int, default=100_000)
    p.add_argument("--repeat", type=int, default=1)
    p = sub.add_parser("time")
    p.add_argument("file", type=Path)
    p.add_argument("--workers", type=int)
    p.add_argument("--label", default="")
    args = ap.parse_args()
    if args.cmd == "make":
        make(args.file, args.structures, args.repeat)
    else:
        time_cli(args.file, args.workers, args.label)


if __name__ == "__main__":
    main()
