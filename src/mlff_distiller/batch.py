"""``AtomsBatch``: the one data contract between ``ase.Atoms`` and the model.

Many structures of different sizes are concatenated along the atom axis; ``batch`` maps each atom to its
structure and ``ptr`` holds the offsets. Every tensor of a batch lives on one device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from mlff_distiller.frames import FrameTable

__all__ = ["AtomsBatch", "FrameTable"]

# Periodic lattice vectors spanning less than this (Å, Å² or Å³) make a degenerate, zero-volume cell.
MIN_VOLUME = 1e-6
# A float32 (or lower) batch keeps float64 positions and cell beside its own where some coordinate, relative to
# its structure's origin, reaches this many Å: the engine then makes the pair vectors from them in float64 and
# rounds them once (``AtomsBatch.positions64``). Below it the pair vectors made from float32 positions are within
# the engine's float32 tolerance (stop 50, H200: the forces' error from the positions' rounding grows with the
# coordinates, 1.9e-4 eV/Å at 62 Å and 4.7e-4 at 126 Å, against a tolerance of 5.9e-4 there; 1.7e-3 at 430 Å).
PRECISE_PAIRS_FROM = 100.0


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
        origin: ``[B, 3]`` float64 (CPU) or None: where each structure's coordinates start, Å; the positions given
            are ``positions + origin[batch]``. ``from_atoms`` in float32 (or lower) stores every structure relative
            to its first atom's position, subtracted in float64 (exact for nearby atoms, and the same whatever else
            is in the batch, unlike a mean, whose float64 rounding followed the structure's place in the batch):
            float32 keeps ~7 digits of a coordinate, so a molecule at 10,000 Å from the origin had forces 0.05 eV/Å
            off (CPU, shipped student); a translation changes no energy, force or stress. None: the positions as
            given (float64 batches).
        positions64: ``[N, 3]`` float64 or None: the positions before their rounding to ``positions``' dtype (the
            same frame, relative to ``origin``), with ``cell64`` ``[B, 3, 3]`` the cell's. ``from_atoms`` keeps
            both for a batch of float32 (or lower) where some coordinate reaches :data:`PRECISE_PAIRS_FROM` Å
            from its origin (a periodic box of more than ~100 Å, a cluster of that size): float32 positions are
            only good to half a spacing at their size (3.8e-6 Å at 126 Å, 1.5e-5 at 430), and their pair
            vectors, near the cutoff's size, would carry that whole error. From these the engine makes the pair
            vectors in float64 and rounds them once, as nequip makes a float32 model's edge vectors from
            float64 positions. They move with the batch's device but keep float64; a batch cast to float64
            takes them as its positions.
    """

    numbers: torch.Tensor
    positions: torch.Tensor
    cell: torch.Tensor
    pbc: torch.Tensor
    batch: torch.Tensor
    ptr: torch.Tensor
    origin: torch.Tensor | None = None
    positions64: torch.Tensor | None = None
    cell64: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # The shapes compared first and a message made only for a failure: formatting every message up front cost
        # ~7 µs of each batch (a small molecule's predict_forces builds one per call).
        n = self.numbers.shape[0]
        b = self.cell.shape[0]
        shapes = (
            self.numbers.dim() == 1,
            tuple(self.positions.shape) == (n, 3),
            tuple(self.cell.shape) == (b, 3, 3),
            tuple(self.pbc.shape) == (b, 3),
            tuple(self.batch.shape) == (n,),
            tuple(self.ptr.shape) == (b + 1,),
            (self.positions64 is None) == (self.cell64 is None),
            self.positions64 is None or tuple(self.positions64.shape) == (n, 3),
            self.cell64 is None or tuple(self.cell64.shape) == (b, 3, 3),
        )
        if all(shapes):
            return
        messages = (  # (made only here, for a batch that fails)
            f"numbers must be [N], got {tuple(self.numbers.shape)}",
            f"positions must be [{n}, 3], got {tuple(self.positions.shape)}",
            f"cell must be [B, 3, 3], got {tuple(self.cell.shape)}",
            f"pbc must be [{b}, 3], got {tuple(self.pbc.shape)}",
            f"batch must be [{n}], got {tuple(self.batch.shape)}",
            f"ptr must be [{b + 1}], got {tuple(self.ptr.shape)}",
            "positions64 and cell64 come together (both or neither)",
            f"positions64 must be [{n}, 3]",
            f"cell64 must be [{b}, 3, 3]",
        )
        raise ValueError(f"AtomsBatch: {messages[shapes.index(False)]}")

    # ----------------------------------------------------------------------------------------------- build
    @classmethod
    def from_atoms(
        cls,
        structures: Sequence | object,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> AtomsBatch:
        """Build a batch from one ``ase.Atoms`` or a sequence of them, validating every input.

        The checks run over the whole batch at once (finite positions and cells, atomic numbers, non-degenerate
        periodic cells); the first structure that fails any of them is then checked alone, which raises the
        same error, naming it, as checking structure by structure would (~1 µs per small molecule instead of
        ~12 µs: batched prediction over many molecules built its batches slower than the GPU ran them)."""
        if hasattr(structures, "get_positions"):
            structures = [structures]
        if isinstance(structures, FrameTable):  # already concatenated: no per-structure work at all
            if not len(structures):
                raise ValueError("AtomsBatch.from_atoms needs at least one structure")
            z_all, pos_all, cell_all, pbc_all, counts = structures.arrays()
            counts = counts.tolist()
            one = structures.fields_of
        else:
            structures = list(structures)
            if not structures:
                raise ValueError("AtomsBatch.from_atoms needs at least one structure")
            fields = _plain_fields(structures)
            if fields is None:
                fields = _fields_one_by_one(structures)
            numbers, positions, cells, pbcs, counts = fields
            z_all = np.concatenate(numbers).astype(np.int64, copy=False)
            pos_all = np.concatenate(positions).astype(np.float64, copy=False)
            # One concatenate, not np.stack (which expands every [3, 3] array first: ~2.5 ms for 4,096 structures).
            cell_all = np.concatenate(cells).astype(np.float64, copy=False).reshape(len(cells), 3, 3)
            pbc_all = np.concatenate(pbcs).astype(bool, copy=False).reshape(len(pbcs), 3)

            def one(k: int) -> tuple:
                return numbers[k], positions[k], cells[k], pbcs[k]

        bad = _invalid_structures(z_all, pos_all, cell_all, pbc_all, np.asarray(counts))
        if bad is not None:
            _validate_structure(bad, *one(bad))
            raise AssertionError(f"structure {bad} failed a batched check but not its own")  # pragma: no cover
        # The index tensors made in NumPy and wrapped (torch.from_numpy): torch's CPU ops cost a few µs each, and
        # repeat_interleave ~25 µs, more than a small molecule's GPU step (stop 74).
        counts_np = np.asarray(counts, dtype=np.int64)
        ptr_np = np.zeros(counts_np.shape[0] + 1, dtype=np.int64)
        np.cumsum(counts_np, out=ptr_np[1:])
        ptr = torch.from_numpy(ptr_np)
        origin = pos64 = cell64 = None
        if dtype != torch.float64:  # each structure from its first atom (see the class docstring)
            origin = pos_all[ptr_np[:-1]]
            pos_all = pos_all - np.repeat(origin, counts, axis=0)
            origin = torch.from_numpy(origin)
            if pos_all.size and float(np.abs(pos_all).max()) >= PRECISE_PAIRS_FROM:
                # (a copy of the cells: a FrameTable's may be views of the caller's arrays)
                pos64, cell64 = torch.from_numpy(pos_all), torch.from_numpy(cell_all.copy())
        out = cls(
            numbers=torch.from_numpy(z_all),
            positions=_as_tensor(pos_all, dtype),
            cell=_as_tensor(cell_all, dtype),
            pbc=torch.from_numpy(pbc_all),
            batch=torch.from_numpy(np.repeat(np.arange(counts_np.shape[0], dtype=np.int64), counts_np)),
            ptr=ptr,
            origin=origin,
            positions64=pos64,
            cell64=cell64,
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

    def pair_vectors64(self, edge_index: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
        """``[E, 3]`` float64 pair vectors ``positions64[j] - positions64[i] + shifts @ cell64[batch[i]]`` (Å) of
        a neighbour list's ``edge_index`` and integer ``shifts`` (see ``positions64``)."""
        if self.positions64 is None:
            raise ValueError("pair_vectors64 needs a batch with positions64 (AtomsBatch.from_atoms keeps them)")
        dev = self.positions64.device
        structure = None if self.cell64.shape[0] == 1 else self.batch.to(dev).index_select(0, edge_index[0])
        return pair_vectors64(self.positions64, self.cell64.to(dev), edge_index, shifts, structure)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> AtomsBatch:
        """Move to ``device``; ``dtype`` applies to the floating tensors (positions, cell) only. ``positions64``
        and ``cell64`` move and stay float64; cast to float64, the batch takes them as its positions and cell."""
        src, kw = self, {}
        if dtype == torch.float64 and self.positions64 is not None:
            kw = {"positions64": None, "cell64": None}
            src = replace(self, positions=self.positions64, cell=self.cell64, **kw)
        for f in fields(src):
            t = getattr(src, f.name)
            if f.name == "origin" or t is None:  # origin: float64 on the CPU, whatever the batch's device and dtype
                continue
            if f.name in ("positions64", "cell64"):
                kw[f.name] = t.to(device) if device is not None else t
                continue
            if dtype is not None and t.is_floating_point():
                t = t.to(device=device, dtype=dtype)
            elif device is not None:
                t = t.to(device)
            kw[f.name] = t
        return replace(src, **kw)

    def split(self, per_atom: torch.Tensor) -> list[torch.Tensor]:
        """Split a per-atom tensor ``[N, ...]`` into one tensor per structure, in batch order."""
        return list(torch.split(per_atom, self.counts.tolist()))

    def to_atoms(self) -> list:
        """Split back into ``ase.Atoms`` (numbers, positions, cell, pbc)."""
        from ase import Atoms

        out = []
        exact = self.positions if self.positions64 is None else self.positions64
        numbers, positions = self.numbers.cpu().numpy(), exact.detach().cpu().double().numpy()
        if self.origin is not None:
            positions = positions + np.repeat(self.origin.numpy(), self.counts.tolist(), axis=0)
        cell = self.cell if self.cell64 is None else self.cell64
        cells, pbcs, ptr = cell.detach().cpu().double().numpy(), self.pbc.cpu().numpy(), self.ptr.tolist()
        for b in range(self.num_structures):
            s = slice(ptr[b], ptr[b + 1])
            out.append(Atoms(numbers=numbers[s], positions=positions[s], cell=cells[b], pbc=pbcs[b]))
        return out


def needs_float64_pairs(batch: AtomsBatch, engine_dtype: torch.dtype) -> bool:
    """Whether an engine of ``engine_dtype`` below float64 should make ``batch``'s pair vectors from its float64
    positions: a float64 batch without ``positions64`` with a coordinate of :data:`PRECISE_PAIRS_FROM` Å or more
    in the caller's frame (its float32 rounding there: a molecule 10,000 Å from the origin 0.016 eV/Å off). One
    wait for the device where the batch lives there; NaN coordinates give False (their own checks name them). The
    engine (host batches, fresh lists), ``BatchedMD`` and ``relax_batch`` decide with it."""
    if (
        batch.positions64 is not None
        or batch.dtype != torch.float64
        or engine_dtype == torch.float64
        or batch.num_atoms == 0
    ):
        return False
    return float(batch.positions.detach().abs().max()) >= PRECISE_PAIRS_FROM


def pair_vectors64(
    positions64: torch.Tensor,
    cell64: torch.Tensor,
    edge_index: torch.Tensor,
    shifts: torch.Tensor,
    structure: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[E, 3]`` float64 ``positions64[j] - positions64[i] + shifts[e] @ cell64[structure[e]]`` (Å):
    ``edge_index [2, E]`` (receiver i, sender j), ``shifts [E, 3]`` whole numbers (any dtype that holds them
    exactly), ``structure [E]`` each pair's structure (None: one structure, ``cell64 [1, 3, 3]``)."""
    i, j = edge_index
    vec = positions64.index_select(0, j) - positions64.index_select(0, i)
    s = shifts.to(positions64.device, torch.float64)
    if structure is None:
        vec += s @ cell64[0]
    else:  # one lattice vector at a time: [E, 3] gathers, not an [E, 3, 3] one
        for k in range(3):
            vec.addcmul_(s[:, k : k + 1], cell64[:, k].index_select(0, structure))
    return vec


# The NumPy dtypes of the float dtypes a batch takes: NumPy's casts into a new array cost a few µs less than torch's
# ``.to`` of a wrapped array (the same IEEE rounding; also the calculator's MD positions).
NUMPY_FLOATS = {torch.float32: np.float32, torch.float64: np.float64}


def _as_tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The float64 array ``a`` as a tensor of ``dtype`` (no copy for float64)."""
    np_dtype = NUMPY_FLOATS.get(dtype)
    if np_dtype is None:
        return torch.from_numpy(a).to(dtype)
    return torch.from_numpy(a.astype(np_dtype, copy=False))


def _plain_fields(structures: list) -> tuple | None:
    """numbers, positions, cells, pbcs and atom counts of a list of plain ``ase.Atoms`` read in a few list
    comprehensions (ASE keeps positions [n, 3] and numbers [n]; the shapes are checked below all the same);
    None when some structure is not a plain Atoms, is empty or has mismatched arrays: the one-by-one path then
    reads it and raises the error that names it."""
    if not all(map(_is_plain_atoms, structures)):
        return None
    arrays = [a.arrays for a in structures]
    try:
        numbers = [d["numbers"] for d in arrays]
        positions = [d["positions"] for d in arrays]
    except KeyError:
        return None
    counts = [len(z) for z in numbers]
    if 0 in counts or counts != [len(p) for p in positions] or any(p.ndim != 2 or p.shape[1] != 3 for p in positions):
        return None
    return numbers, positions, [a.cell.array for a in structures], [a.pbc for a in structures], counts


def _fields_one_by_one(structures: list) -> tuple:
    """:func:`_plain_fields` for any structures, through :func:`_arrays_of`; raises on a shape error or an
    empty structure, naming it."""
    numbers, positions, cells, pbcs, counts = [], [], [], [], []
    for k, atoms in enumerate(structures):
        z, pos, cell, pbc = _arrays_of(k, atoms)
        if pos.ndim != 2 or pos.shape[1] != 3 or pos.shape[0] != z.shape[0] or len(z) == 0:
            _validate_structure(k, z, pos, cell, pbc)  # raises: shape or no atoms
        numbers.append(z)
        positions.append(pos)
        cells.append(cell)
        pbcs.append(pbc)
        counts.append(len(z))
    return numbers, positions, cells, pbcs, counts


def _arrays_of(k: int, atoms) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Atomic numbers (int64), positions (float64), cell (float64) and pbc (bool) of structure ``k`` through its
    getters (the path of subclasses, mixed lists and bad input; plain Atoms lists take :func:`_plain_fields`)."""
    if not hasattr(atoms, "get_positions"):
        raise ValueError(f"structure {k} is not an ase.Atoms (got {type(atoms).__name__})")
    pos = np.asarray(atoms.get_positions(), dtype=np.float64)
    z = np.asarray(atoms.get_atomic_numbers(), dtype=np.int64)
    cell = np.asarray(atoms.get_cell().array, dtype=np.float64)
    pbc = np.asarray(atoms.get_pbc(), dtype=bool)
    return z, pos, cell, pbc


def _is_plain_atoms(atoms) -> bool:
    """``atoms`` is exactly ``ase.Atoms`` (a subclass may override the getters)."""
    global _ASE_ATOMS
    if _ASE_ATOMS is None:
        from ase import Atoms

        _ASE_ATOMS = Atoms
    return type(atoms) is _ASE_ATOMS


_ASE_ATOMS = None  # ase.Atoms, imported on first use (ase stays an import-time-optional dependency here)


def _invalid_structures(
    z: np.ndarray, pos: np.ndarray, cell: np.ndarray, pbc: np.ndarray, counts: np.ndarray
) -> int | None:
    """The first structure that :func:`_validate_structure` would reject for its positions, atomic numbers or
    cell (shapes and empty structures are checked before), from checks over the whole batch; None if none."""
    if counts.shape[0] == 1:  # one structure (the calculator's and single-point calls): the same tests, fewer calls
        ok = bool(np.isfinite(pos).all() and np.isfinite(cell).all()) and (
            z.size == 0 or 1 <= z.min() <= z.max() <= 118
        )
        if ok and pbc[0].any():
            vectors = cell[0][pbc[0]]
            ok = float(np.sqrt(max(np.linalg.det(vectors @ vectors.T), 0.0))) >= MIN_VOLUME
        return None if ok else 0
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    bad_atom = ~np.isfinite(pos).all(axis=1) | (z < 1) | (z > 118)
    bad = np.logical_or.reduceat(bad_atom, starts) if bad_atom.any() else np.zeros(len(counts), dtype=bool)
    bad |= ~np.isfinite(cell).reshape(len(counts), 9).all(axis=1)
    periodic = np.flatnonzero(pbc.any(axis=1) & ~bad)
    if periodic.size:
        full = periodic[pbc[periodic].all(axis=1)]
        if full.size:  # three periodic vectors: the volume is |det(cell)|
            vol = np.sqrt(np.maximum(np.linalg.det(cell[full] @ cell[full].transpose(0, 2, 1)), 0.0))
            bad[full[vol < MIN_VOLUME]] = True
        for k in periodic[~pbc[periodic].all(axis=1)]:  # slabs and wires, one by one
            vectors = cell[k][pbc[k]]
            bad[k] = float(np.sqrt(max(np.linalg.det(vectors @ vectors.T), 0.0))) < MIN_VOLUME
    return int(np.argmax(bad)) if bad.any() else None


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
