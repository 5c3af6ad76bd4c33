"""Does the atom order matter to the energy + forces step? (GPU probe, issue 7.)

The water boxes of bench_large place molecules on lattice sites in random order, so consecutive atoms are far
apart and the message-passing kernels' per-edge gathers of sender rows (x, v: 6F floats) hit L2 at random. This
times the same step (``peers.StepImpl`` "ours", eager, neighbour list outside the timing) on each box as built
and with its atoms sorted along a Morton (Z-order) curve of their wrapped fractional coordinates, and checks
that energies and forces agree (forces compared after undoing the permutation).

    python benchmarks/probe_locality.py --sizes 3000 24000 --out /tmp/probe
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_large import box, measure
from peers import StepImpl, make_student


def morton_order(atoms, bits: int = 10) -> np.ndarray:
    """Permutation sorting the atoms along a Z-order curve of their wrapped fractional coordinates."""
    frac = atoms.get_scaled_positions(wrap=True)
    q = np.minimum((frac * (1 << bits)).astype(np.int64), (1 << bits) - 1)
    key = np.zeros(len(atoms), dtype=np.int64)
    for b in range(bits):
        for a in range(3):
            key |= ((q[:, a] >> b) & 1) << (3 * b + a)
    return np.argsort(key, kind="stable")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=[3000, 24000])
    p.add_argument("--out", type=Path, default=Path("/tmp/probe_locality"))
    p.add_argument("--rep-ms", type=float, default=200)
    p.add_argument(
        "--mode",
        default="eager",
        help="StepImpl mode: eager (which sorts batches of SPATIAL_SORT_MIN_ATOMS atoms itself) or cudagraph (the "
        "padded path, which keeps the caller's order)",
    )
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = make_student()
    impl = StepImpl(f"ours {args.mode}", "ours", model, device, backend="auto", mode=args.mode)
    rows = []
    for n in args.sizes:
        atoms = box(n)
        perm = morton_order(atoms)
        results = {}
        for name, a in (("as built", atoms), ("morton", atoms[perm])):
            run = impl.prepare([a], True)
            t = measure(run, device, 5.0, args.rep_ms)
            out = t.result
            forces = out[0] if isinstance(out, tuple) else out
            results[name] = (t, forces.detach().double().cpu())
            print(f"{n} atoms {name}: {t.median_us / 1e3:.3f} ms ({t.how})", flush=True)
            del run
            torch.cuda.empty_cache() if device.type == "cuda" else None
        f0 = results["as built"][1]
        f1 = torch.empty_like(results["morton"][1])
        if f1.shape[0] == len(perm):
            f1[torch.from_numpy(perm)] = results["morton"][1]
            err = float((f1 - f0).abs().max() / f0.abs().max())
        else:
            err = None
        row = dict(
            atoms=n,
            as_built_ms=results["as built"][0].median_us / 1e3,
            morton_ms=results["morton"][0].median_us / 1e3,
            speedup=results["as built"][0].median_us / results["morton"][0].median_us,
            max_rel_force_diff=err,
        )
        print(row, flush=True)
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__, mode=args.mode
    )
    (args.out / "probe_locality.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
