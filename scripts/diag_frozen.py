"""Where do hot replicas freeze? (a diagnosis for the planning notes, GPU)

Runs the 61 g2 molecules × 16 replicas at 2,000 K with ``BatchedMD(freeze_force=100)`` (the shipped student, its
wall on) and, for each frozen replica, reports where it stopped: its shortest pair relative to that pair's wall
radius (0.9 × the training data's shortest), the largest force, and the atom's element; and whether the geometry
is still one molecule (bonds by ASE's covalent radii × 1.3).

    python scripts/diag_frozen.py --out benchmarks/results/probe_hot_md_h100
"""

from __future__ import annotations

import argparse
import collections
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from harness import write_lines

from mlff_distiller import BatchedMD, load_model
from mlff_distiller.distill.seeds import g2_chno
from mlff_distiller.domain import DomainEnvelope


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--temperature", type=float, default=2000.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from ase.data import chemical_symbols, covalent_radii
    from ase.neighborlist import neighbor_list
    from scipy.sparse.csgraph import connected_components

    model = load_model("builtin:chno-gfn2")
    env = DomainEnvelope.of_model(model)
    radii = env.repulsion_radii(model.config.species)
    structures = [a for a in g2_chno() for _ in range(16)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        md = BatchedMD(model, structures, temperature_K=args.temperature, seed=args.seed, freeze_force=100.0)
        md.run(args.steps)
    frozen = md.frozen
    rows, ratios, kinds, pieces = [], [], collections.Counter(), []
    for k in frozen:
        atoms = md.get_atoms([k])[0]
        f = np.abs(atoms.get_forces())
        worst = int(np.argmax(f.max(axis=1)))
        i, j, d = neighbor_list("ijd", atoms, 2.0)
        best = (np.inf, None)
        for a, b, r in zip(i, j, d, strict=True):
            za, zb = sorted((int(atoms.numbers[a]), int(atoms.numbers[b])))
            ratio = r / radii.get((za, zb), np.inf)
            if ratio < best[0]:
                best = (ratio, (za, zb, r))
        ratios.append(best[0])
        if best[1] is not None:
            kinds[f"{chemical_symbols[best[1][0]]}-{chemical_symbols[best[1][1]]}"] += 1
        cut = covalent_radii[atoms.numbers] * 1.3
        bi, bj, bd = neighbor_list("ijd", atoms, float(cut.max() * 2))
        bonded = bd < cut[bi] + cut[bj]
        import scipy.sparse as sp

        graph = sp.coo_matrix((np.ones(int(bonded.sum())), (bi[bonded], bj[bonded])), shape=(len(atoms),) * 2)
        n_pieces = connected_components(graph, directed=False)[0]
        pieces.append(n_pieces)
        rows.append(
            f"| {k} | {atoms.get_chemical_formula()} | {f.max():.0f} | {chemical_symbols[atoms.numbers[worst]]} | "
            + (
                f"{chemical_symbols[best[1][0]]}-{chemical_symbols[best[1][1]]} {best[1][2]:.2f} Å ({best[0]:.2f}) | "
                if best[1] is not None
                else "- | "
            )
            + f"{n_pieces} |"
        )
    ratios = np.array(ratios)
    lines = [
        "# Where hot replicas freeze (scripts/diag_frozen.py)",
        "",
        f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'} · builtin:chno-gfn2 with its wall · "
        f"{len(structures)} trajectories, {args.temperature:.0f} K, {args.steps} steps of 0.5 fs, Langevin, seed "
        f"{args.seed}, freeze_force 100 eV/Å.",
        "",
        f"Frozen: {len(frozen)}. Shortest pair / its wall radius (r_off = 0.9 × the training data's shortest): "
        f"below 1 (inside the wall) {int(np.sum(ratios < 1))}, 1-1.5 {int(np.sum((ratios >= 1) & (ratios < 1.5)))}, "
        f"1.5 or more {int(np.sum(ratios >= 1.5))}. Shortest pairs by elements: {dict(kinds.most_common())}. "
        f"Frozen as one molecule: {sum(p == 1 for p in pieces)}; in 2 or more pieces: {sum(p > 1 for p in pieces)}.",
        "",
        "| replica | formula | largest force, eV/Å | on element | shortest pair (/ r_off) | pieces |",
        "|---:|---|---:|---|---|---:|",
        *rows,
    ]
    print("\n".join(lines[:8]), flush=True)
    write_lines(lines, args.out, "diag_frozen")


if __name__ == "__main__":
    main()
