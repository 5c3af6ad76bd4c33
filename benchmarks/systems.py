"""Benchmark systems: molecules from ASE's g2 set and liquid-water boxes at ~1 g/cm³."""

from __future__ import annotations

import numpy as np
from ase import Atoms
from ase.build import molecule
from ase.collections import g2

__all__ = ["g2_chno", "water_box"]


def g2_chno(count: int, seed: int = 0) -> list[Atoms]:
    """``count`` molecules drawn (with repetition) from the H/C/N/O members of ASE's g2 set, slightly rattled."""
    names = [a.get_chemical_formula() for a in g2]
    pool = [a for a, n in zip(g2, names, strict=True) if set(a.get_chemical_symbols()) <= {"H", "C", "N", "O"}]
    rng = np.random.default_rng(seed)
    out = []
    for k in rng.integers(0, len(pool), size=count):
        a = pool[int(k)].copy()
        a.rattle(0.02, seed=int(rng.integers(1 << 30)))
        out.append(a)
    return out


def water_box(n_atoms: int, seed: int = 0, density: float = 1.0) -> Atoms:
    """A periodic cubic box of ``n_atoms // 3`` randomly oriented water molecules on a jittered lattice (g/cm³)."""
    n_mol = max(1, n_atoms // 3)
    mass = n_mol * 18.015 / 6.02214076e23  # g
    side = (mass / density) ** (1 / 3) * 1e8  # Å
    per_side = int(np.ceil(n_mol ** (1 / 3)))
    spacing = side / per_side
    rng = np.random.default_rng(seed)
    h2o = molecule("H2O")
    pos, numbers = [], []
    sites = [(i, j, k) for i in range(per_side) for j in range(per_side) for k in range(per_side)]
    for i, j, k in [sites[s] for s in rng.permutation(len(sites))[:n_mol]]:
        q, r = np.linalg.qr(rng.normal(size=(3, 3)))
        rot = q * np.sign(np.diag(r))
        centre = (np.array([i, j, k]) + 0.5 + rng.uniform(-0.1, 0.1, 3)) * spacing
        pos.append(h2o.positions @ rot.T + centre)
        numbers += list(h2o.numbers)
    return Atoms(numbers=numbers, positions=np.concatenate(pos), cell=[side] * 3, pbc=True)
