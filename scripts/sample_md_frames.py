"""``n`` frames drawn at random (seeded) from an ``mlff-distill md`` output, leaving out its first frames (time 0) and
frozen ones: where a student's own hot trajectories went, to label with the teacher and measure its error there.

    python scripts/sample_md_frames.py md.extxyz sample.extxyz 256 [SEED]
"""

from __future__ import annotations

import sys

import ase.io
import numpy as np
from ase import Atoms


def main(src: str, dst: str, n: int, seed: int = 0) -> None:
    frames = [
        f for f in ase.io.iread(src, index=":") if f.info.get("time_fs", 0.0) > 0 and not f.info.get("frozen", False)
    ]
    pick = np.random.default_rng(seed).choice(len(frames), size=min(n, len(frames)), replace=False)
    out = []
    for k in sorted(pick.tolist()):
        f = frames[k]
        a = Atoms(numbers=f.numbers, positions=f.positions, cell=f.cell, pbc=f.pbc)
        a.info.update(replica=f.info.get("replica", 0), time_fs=f.info.get("time_fs", 0.0))
        out.append(a)
    ase.io.write(dst, out, format="extxyz")
    print(f"{len(out)} of {len(frames)} frames", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 0)
