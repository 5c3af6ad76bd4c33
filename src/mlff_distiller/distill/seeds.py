"""Seed structures for sampling: ASE's g2 set filtered to CHNO, named molecules, or files."""

from __future__ import annotations

from pathlib import Path

import ase.io
import numpy as np
from ase import Atoms

__all__ = ["g2_chno", "load_seeds"]

CHNO = frozenset({1, 6, 7, 8})


def g2_chno(*, closed_shell: bool = True, min_atoms: int = 2) -> list[Atoms]:
    """Molecules of ASE's g2 collection made only of H, C, N, O (sorted by name, so the order is stable).

    ``closed_shell`` keeps singlets (even electron count, no initial magnetic moment in g2; drops radicals
    and the triplets O2, NH, CH2): GFN2-xTB would treat them with fractional occupations, a different
    potential-energy surface that a spin-unaware student should not mix in.
    """
    from ase.collections import g2

    out = []
    for name in sorted(g2.names):
        atoms = g2[name]
        z = atoms.numbers
        if len(atoms) < min_atoms or not set(z.tolist()) <= CHNO:
            continue
        if closed_shell and (int(z.sum()) % 2 or abs(atoms.get_initial_magnetic_moments().sum()) > 1e-6):
            continue
        atoms = Atoms(numbers=z, positions=atoms.positions)
        atoms.info["name"] = name
        out.append(atoms)
    return out


def load_seeds(spec: str | Path) -> list[Atoms]:
    """Seed structures from ``spec``: ``"g2-chno"``, ``"molecule:NAME[,NAME...]"`` (``ase.build.molecule``
    names) or a structure file ASE can read (all frames). Raises ``ValueError`` for an unknown name."""
    spec = str(spec)
    if spec == "g2-chno":
        return g2_chno()
    if spec.startswith("molecule:"):
        from ase.build import molecule
        from ase.collections import g2

        out = []
        for name in filter(None, spec.split(":", 1)[1].split(",")):
            name = name.strip().removeprefix("molecule:")  # also "molecule:H2O,molecule:CH4"
            if name not in g2.names:
                raise ValueError(f"unknown molecule {name!r} (ase.build.molecule / g2 names)")
            atoms = molecule(name)
            atoms.info["name"] = name
            out.append(atoms)
        if not out:
            raise ValueError(f"no molecule names in {spec!r}")
        return out
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"seeds {spec!r}: not 'g2-chno', not 'molecule:NAMES' and no such file")
    frames = ase.io.read(path, index=":")
    frames = frames if isinstance(frames, list) else [frames]
    if not frames:
        raise ValueError(f"{path} holds no structures")
    for k, a in enumerate(frames):
        if not np.isfinite(a.positions).all():
            raise ValueError(f"{path}: structure {k} has non-finite positions")
    return frames
