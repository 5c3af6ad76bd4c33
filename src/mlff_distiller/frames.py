"""``FrameTable``: many structures as concatenated arrays, without an ``ase.Atoms`` for each.

NumPy only (ASE imported when one structure is indexed): the extxyz worker processes of
:mod:`mlff_distiller._extxyz_parallel` build these without importing torch. :mod:`mlff_distiller.batch` and the
package export the same class.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["FrameTable"]


class FrameTable(Sequence):
    """Many structures held as concatenated arrays, without an ``ase.Atoms`` for each: what a file reader gives.

    :meth:`ForceEngine.predict <mlff_distiller.engine.ForceEngine.predict>` and ``predict_forces`` take it where they
    take a list of ``Atoms``, and cut their batches from the arrays directly: building an ``Atoms`` costs ~12 µs,
    several times the GPU step of a small molecule, and ``mlff-distill predict`` would build one per structure read.
    Indexing one structure builds its ``Atoms`` (numbers, positions, cell, pbc), for the paths that need one (an
    error message, the envelope check); a slice is a ``FrameTable`` of the same arrays.

    Args:
        numbers: ``[N]`` atomic numbers of all structures, one after another.
        positions: ``[N, 3]`` Å.
        cells: ``[B, 3, 3]`` lattice vectors as rows, Å (zeros for a molecule).
        pbc: ``[B, 3]`` periodicity.
        counts: ``[B]`` atoms of each structure (at least 1), summing to N.
    """

    def __init__(self, numbers, positions, cells, pbc, counts) -> None:
        self.numbers = np.asarray(numbers)
        self.positions = np.asarray(positions, dtype=np.float64)
        self.cells = np.asarray(cells, dtype=np.float64)
        self.pbc = np.asarray(pbc, dtype=bool)
        self.counts = np.asarray(counts, dtype=np.int64)
        b, n = len(self.counts), len(self.numbers)
        if self.counts.ndim != 1 or self.numbers.ndim != 1 or self.numbers.dtype.kind not in "iu":
            raise ValueError("FrameTable: counts and numbers must be 1-D, numbers integers")
        shapes = {"positions": (n, 3), "cells": (b, 3, 3), "pbc": (b, 3)}
        for name, shape in shapes.items():
            if getattr(self, name).shape != shape:
                raise ValueError(f"FrameTable: {name} must be {list(shape)}, got {list(getattr(self, name).shape)}")
        if b and int(self.counts.min()) < 1:
            raise ValueError(f"FrameTable: structure {int(np.argmin(self.counts))} has no atoms")
        self.ptr = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(self.counts, out=self.ptr[1:])
        if int(self.ptr[-1]) != n:
            raise ValueError(f"FrameTable: counts sum to {int(self.ptr[-1])} atoms, numbers has {n}")

    @classmethod
    def concat(cls, tables: Sequence[FrameTable]) -> FrameTable:
        return cls(*(np.concatenate([getattr(t, k) for t in tables]) for k in _TABLE_FIELDS))

    def __len__(self) -> int:
        return len(self.counts)

    def __getitem__(self, k):
        if isinstance(k, slice):
            first, stop, step = k.indices(len(self))
            if step != 1:
                raise ValueError("FrameTable slices take every structure (step 1)")
            stop = max(first, stop)
            a, b = int(self.ptr[first]), int(self.ptr[stop])
            return FrameTable(
                self.numbers[a:b],
                self.positions[a:b],
                self.cells[first:stop],
                self.pbc[first:stop],
                self.counts[first:stop],
            )
        from ase import Atoms

        z, pos, cell, pbc = self.fields_of(range(len(self))[k])  # an IndexError past the end, as a list gives
        return Atoms(numbers=z, positions=pos, cell=cell, pbc=pbc)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(numbers int64, positions, cells, pbc, counts)``."""
        return self.numbers.astype(np.int64, copy=False), self.positions, self.cells, self.pbc, self.counts

    def fields_of(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Atomic numbers, positions, cell and pbc of structure ``k`` (views)."""
        a, b = int(self.ptr[k]), int(self.ptr[k + 1])
        return self.numbers[a:b], self.positions[a:b], self.cells[k], self.pbc[k]

    def atom_counts(self) -> list[int]:
        return self.counts.tolist()


_TABLE_FIELDS = ("numbers", "positions", "cells", "pbc", "counts")
