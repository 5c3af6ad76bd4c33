"""Structures shared by the tests."""

import numpy as np
from ase import Atoms
from ase.build import bulk, molecule


def random_molecule(n: int, rng: np.random.Generator, species=(1, 6, 7, 8), spacing: float = 1.2) -> Atoms:
    """n atoms placed with a minimum separation, so the geometry is chemical-ish and never coincident."""
    pos: list[np.ndarray] = []
    box = max(2.0, (n ** (1 / 3)) * 2.0)
    while len(pos) < n:
        p = rng.uniform(0, box, size=3)
        if all(np.linalg.norm(p - q) > spacing for q in pos):
            pos.append(p)
        else:
            box *= 1.01
    return Atoms(numbers=rng.choice(species, size=n), positions=np.array(pos))


def silicon_cell(rattle: float = 0.05, seed: int = 1) -> Atoms:
    atoms = bulk("Si", "diamond", a=5.43)
    atoms.rattle(rattle, seed=seed)
    return atoms


def triclinic_cu(seed: int = 2) -> Atoms:
    """A 2-atom triclinic cell much smaller than the cutoff (many periodic images)."""
    rng = np.random.default_rng(seed)
    cell = np.array([[2.6, 0.0, 0.0], [0.7, 2.5, 0.0], [0.4, 0.5, 2.7]])
    frac = rng.uniform(0, 1, size=(2, 3))
    return Atoms("Cu2", scaled_positions=frac, cell=cell, pbc=True)


def benzene() -> Atoms:
    return molecule("C6H6")
