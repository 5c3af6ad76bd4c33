"""Does the atom order matter to the energy + forces step? (GPU probe, issue 7.)

The water boxes of bench_large place molecules on lattice sites in random order, so consecutive atoms are far
apart and the message-passing kernels' per-edge gathers of sender rows (x, v: 6F floats) hit L2 at random. This
times the same step (``peers.StepImpl`` "ours", eager, neighbour list outside the timing) on each box as built
and with its atoms sorted along a Morton (Z-order) curve of their wrapped fractional coordinates, and checks
that energies and forces agree (forces compared after undoing the permutation).

    python benchmarks/probe_locality.py --sizes 3000 24000 --out /tmp/probe
    python benchmarks/probe_locality.py --mode cudagraph --orders built,engine,engine:1.25,hilbert:2.5 --out DIR

``--orders``: ``built`` (as bench_large builds the box), ``morton`` (10-bit Z-order of the wrapped fractional
coordinates), ``engine`` / ``engine:<bin Å>`` (``ordering.spatial_order``, the eager path's sort, bins of half the
cutoff unless given), ``hilbert:<bin Å>`` (a 3-D Hilbert curve over bins of that edge, Skilling's transform). Use
``--mode cudagraph`` to time an order as given: the eager path sorts batches of ``SPATIAL_SORT_MIN_ATOMS`` atoms
itself.
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


def hilbert_order(atoms, bin_size: float) -> np.ndarray:
    """Permutation sorting the atoms along a 3-D Hilbert curve of their positions binned at ``bin_size`` Å from the
    lowest corner (Skilling, "Programming the Hilbert curve", AIP Conf. Proc. 707, 2004: axes to transpose, then
    the transpose's bits interleaved from the most significant)."""
    pos = atoms.get_positions()
    q = np.floor((pos - pos.min(axis=0)) / bin_size).astype(np.int64)
    bits = max(1, int(q.max()).bit_length())
    x = [q[:, a].copy() for a in range(3)]
    top = 1 << (bits - 1)
    b = top
    while b > 1:  # inverse undo excess work
        low = b - 1
        for i in range(3):
            hit = (x[i] & b) != 0
            x[0] = np.where(hit, x[0] ^ low, x[0])
            t = np.where(hit, 0, (x[0] ^ x[i]) & low)
            x[0] ^= t
            x[i] ^= t
        b >>= 1
    for i in range(1, 3):  # Gray encode
        x[i] ^= x[i - 1]
    t = np.zeros_like(x[0])
    b = top
    while b > 1:
        t = np.where((x[2] & b) != 0, t ^ (b - 1), t)
        b >>= 1
    for i in range(3):
        x[i] ^= t
    key = np.zeros(len(atoms), dtype=np.int64)
    for bit in range(bits - 1, -1, -1):
        for i in range(3):
            key = (key << 1) | ((x[i] >> bit) & 1)
    return np.argsort(key, kind="stable")


def engine_order(atoms, bin_size: float) -> np.ndarray:
    """``ordering.spatial_order`` of one structure (the eager path's sort) as a NumPy permutation."""
    from mlff_distiller.ordering import spatial_order

    pos = torch.as_tensor(atoms.get_positions())
    return spatial_order(pos, torch.zeros(len(atoms), dtype=torch.int64), 1, bin_size).numpy()


def order_of(name: str, atoms, cutoff: float) -> np.ndarray | None:
    kind, _, arg = name.partition(":")
    if kind == "built":
        return None
    if kind == "morton":
        return morton_order(atoms)
    if kind == "engine":
        return engine_order(atoms, float(arg) if arg else 0.5 * cutoff)
    if kind == "hilbert":
        return hilbert_order(atoms, float(arg) if arg else 0.5 * cutoff)
    raise ValueError(f"unknown order {name!r}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=[3000, 24000])
    p.add_argument("--out", type=Path, default=Path("/tmp/probe_locality"))
    p.add_argument("--rep-ms", type=float, default=200)
    p.add_argument("--orders", default="built,morton", help="comma list: built, morton, engine[:bin], hilbert[:bin]")
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
    orders = [o.strip() for o in args.orders.split(",") if o.strip()]
    rows = []
    for n in args.sizes:
        atoms = box(n)
        results = {}
        for name in orders:
            perm = order_of(name, atoms, model.cutoff)
            run = impl.prepare([atoms if perm is None else atoms[perm]], True)
            t = measure(run, device, 5.0, args.rep_ms)
            out = t.result
            forces = out[0] if isinstance(out, tuple) else out
            forces = forces.detach().double().cpu()
            if perm is not None and forces.shape[0] == len(perm):
                back = torch.empty_like(forces)
                back[torch.from_numpy(perm)] = forces
                forces = back
            results[name] = (t, forces if forces.shape[0] == n else None)
            print(f"{n} atoms {name}: {t.median_us / 1e3:.3f} ms ({t.how})", flush=True)
            del run
            torch.cuda.empty_cache() if device.type == "cuda" else None
        base_t, base_f = results[orders[0]]
        for name in orders:
            t, f = results[name]
            err = None
            if f is not None and base_f is not None:
                err = float((f - base_f).abs().max() / base_f.abs().max())
            row = dict(
                atoms=n,
                order=name,
                ms=t.median_us / 1e3,
                speedup_vs_first=base_t.median_us / t.median_us,
                max_rel_force_diff=err,
            )
            # (the first two orders' columns as before, for older readers of the json)
            if name == "morton" and orders[0] == "built":
                row.update(as_built_ms=base_t.median_us / 1e3, morton_ms=t.median_us / 1e3)
            print(row, flush=True)
            rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__, mode=args.mode
    )
    (args.out / "probe_locality.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    lines = [
        f"# probe_locality: the step by atom order ({env['device']}, torch {env['torch']}, mode {args.mode})",
        "",
        f"| atoms | order | ms | speed-up vs {orders[0]} | max rel. force diff vs {orders[0]} |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        err = "—" if r["max_rel_force_diff"] is None else f"{r['max_rel_force_diff']:.1e}"
        lines.append(f"| {r['atoms']} | {r['order']} | {r['ms']:.3f} | {r['speedup_vs_first']:.3f} | {err} |")
    (args.out / "probe_locality.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
