"""``AtomsBatch``: the one data contract between ``ase.Atoms`` and the model.

Many structures of different sizes are concatenated along the atom axis; ``batch`` maps each atom to its
structure and ``ptr`` holds the offsets. Every tensor of a batch lives on one device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

__all__ = ["AtomsBatch"]

# Periodic lattice vectors spanning less than this (Å, Å² or Å³) make a degenerate, zero-volume cell.
MIN_VOLUME = 1e-6


@dataclass(kw_only=True)
class AtomsBatch:
    """A batch of B structures holding N atoms in all.

    Attributes:
        numbers: ``[N]`` int64 atomic numbers.
        positions: ``[N, 3]`` Cartesian positions, Å.
        cell: ``[B, 3, 3]`` lattice vectors as rows, Å (zeros for a molecule).
        pbc: ``[B, 3]`` bool periodicity along each lattice vector.
        batch: ``[N]`` int64 index of each atom's structure.
        ptr: ``[B + 1]`` int64 offsets: atoms of structure b are ``ptr[b]:ptr[b+1]``.
    """

    numbers: torch.Tensor
    positions: torch.Tensor
    cell: torch.Tensor
    pbc: torch.Tensor
    batch: torch.Tensor
    ptr: torch.Tensor

    def __post_init__(self) -> None:
        n = self.numbers.shape[0]
        b = self.cell.shape[0]
        checks = [
            (self.numbers.dim() == 1, f"numbers must be [N], got {tuple(self.numbers.shape)}"),
            (tuple(self.positions.shape) == (n, 3), f"positions must be [{n}, 3], got {tuple(self.positions.shape)}"),
            (tuple(self.cell.shape) == (b, 3, 3), f"cell must be [B, 3, 3], got {tuple(self.cell.shape)}"),
            (tuple(self.pbc.shape) == (b, 3), f"pbc must be [{b}, 3], got {tuple(self.pbc.shape)}"),
            (tuple(self.batch.shape) == (n,), f"batch must be [{n}], got {tuple(self.batch.shape)}"),
            (tuple(self.ptr.shape) == (b + 1,), f"ptr must be [{b + 1}], got {tuple(self.ptr.shape)}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"AtomsBatch: {msg}")

    # ----------------------------------------------------------------------------------------------- build
    @classmethod
    def from_atoms(
        cls,
        structures: Sequence | object,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> AtomsBatch:
        """Build a batch from one ``ase.Atoms`` or a sequence of them, validating every input."""
        if hasattr(structures, "get_positions"):
            structures = [structures]
        structures = list(structures)
        if not structures:
            raise ValueError("AtomsBatch.from_atoms needs at least one structure")
        numbers, positions, cells, pbcs, counts = [], [], [], [], []
        for k, atoms in enumerate(structures):
            if not hasattr(atoms, "get_positions"):
                raise ValueError(f"structure {k} is not an ase.Atoms (got {type(atoms).__name__})")
            pos = np.asarray(atoms.get_positions(), dtype=np.float64)
            z = np.asarray(atoms.get_atomic_numbers(), dtype=np.int64)
            cell = np.asarray(atoms.get_cell().array, dtype=np.float64)
            pbc = np.asarray(atoms.get_pbc(), dtype=bool)
            _validate_structure(k, z, pos, cell, pbc)
            numbers.append(z)
            positions.append(pos)
            cells.append(cell)
            pbcs.append(pbc)
            counts.append(len(z))
        counts_t = torch.tensor(counts, dtype=torch.long)
        ptr = torch.zeros(len(counts) + 1, dtype=torch.long)
        ptr[1:] = torch.cumsum(counts_t, 0)
        out = cls(
            numbers=torch.from_numpy(np.concatenate(numbers)),
            positions=torch.from_numpy(np.concatenate(positions)).to(dtype),
            cell=torch.from_numpy(np.stack(cells)).to(dtype),
            pbc=torch.from_numpy(np.stack(pbcs)),
            batch=torch.repeat_interleave(torch.arange(len(counts)), counts_t),
            ptr=ptr,
        )
        return out if device is None else out.to(device)

    # ----------------------------------------------------------------------------------------------- views
    @property
    def num_structures(self) -> int:
        return self.cell.shape[0]

    @property
    def num_atoms(self) -> int:
        return self.numbers.shape[0]

    @property
    def counts(self) -> torch.Tensor:
        """``[B]`` atoms per structure."""
        return self.ptr[1:] - self.ptr[:-1]

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @property
    def dtype(self) -> torch.dtype:
        return self.positions.dtype

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> AtomsBatch:
        """Move to ``device``; ``dtype`` applies to the floating tensors (positions, cell) only."""
        kw = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if dtype is not None and t.is_floating_point():
                t = t.to(device=device, dtype=dtype)
            elif device is not None:
                t = t.to(device)
            kw[f.name] = t
        return replace(self, **kw)

    def split(self, per_atom: torch.Tensor) -> list[torch.Tensor]:
        """Split a per-atom tensor ``[N, ...]`` into one tensor per structure, in batch order."""
        return list(torch.split(per_atom, self.counts.tolist()))

    def to_atoms(self) -> list:
        """Split back into ``ase.Atoms`` (numbers, positions, cell, pbc)."""
        from ase import Atoms

        out = []
        numbers, positions = self.numbers.cpu().numpy(), self.positions.detach().cpu().double().numpy()
        cells, pbcs, ptr = self.cell.detach().cpu().double().numpy(), self.pbc.cpu().numpy(), self.ptr.tolist()
        for b in range(self.num_structures):
            s = slice(ptr[b], ptr[b + 1])
            out.append(Atoms(numbers=numbers[s], positions=positions[s], cell=cells[b], pbc=pbcs[b]))
        return out


def _validate_structure(k: int, z: np.ndarray, pos: np.ndarray, cell: np.ndarray, pbc: np.ndarray) -> None:
    where = f"structure {k}"
    if pos.ndim != 2 or pos.shape[1] != 3 or pos.shape[0] != z.shape[0]:
        raise ValueError(f"{where}: positions must be [{z.shape[0]}, 3], got {pos.shape}")
    if len(z) == 0:
        raise ValueError(f"{where} has no atoms")
    if not np.isfinite(pos).all():
        bad = int(np.argwhere(~np.isfinite(pos).all(1))[0, 0])
        raise ValueError(f"{where}: non-finite position for atom {bad}")
    if not np.isfinite(cell).all():
        raise ValueError(f"{where}: non-finite cell")
    if (z < 1).any() or (z > 118).any():
        raise ValueError(f"{where}: atomic numbers must be in 1..118, got {sorted(set(z.tolist()))}")
    if pbc.any():
        # Only the periodic lattice vectors must span a non-degenerate length/area/volume (slabs and wires may
        # leave their non-periodic vectors at zero, as ASE allows).
        periodic = cell[pbc]
        vol = float(np.sqrt(max(np.linalg.det(periodic @ periodic.T), 0.0)))
        if vol < MIN_VOLUME:
            raise ValueError(f"{where}: zero-volume cell (periodic vectors span {vol:.3g}) with pbc={pbc.tolist()}")
