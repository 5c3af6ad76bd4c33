"""Where a student's training data lies, stored with the student, and a test of new structures against it.

A student interpolates its training data. On a structure with two atoms closer than any pair it was trained on, or
an atom more crowded than any it saw, its energy and forces are extrapolations that nothing constrains: water in a
2 Å periodic cell gives E = -1441 eV and forces up to 43,555 eV/Å, all finite, so no error is raised.
:class:`DomainEnvelope` records two things of the training frames:

- the shortest distance seen for each pair of elements within the cutoff;
- the most neighbours within the cutoff seen around an atom of each element.

Training stores the envelope in the checkpoint (``metadata["domain"]``). :meth:`DomainEnvelope.check` then names what
a structure has outside it. ``mlff-distill check --models <one student>`` runs that check, and
:class:`~mlff_distiller.StudentCalculator` runs it on its first calculation and every ``check_domain`` after, with an
:class:`OutOfDomainWarning` the first time something is outside.

The check needs no teacher and no second student (compare :mod:`mlff_distiller.committee`, which needs two). It sees
only geometry, so passing it does not prove a structure is like the data: a committee or the teacher decides that.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mlff_distiller.frames import FrameTable

__all__ = [
    "DISTANCE_TOLERANCE",
    "FORCE_LIMIT",
    "GPU_CHECK_MIN_ATOMS",
    "NEIGHBOR_TOLERANCE",
    "DomainEnvelope",
    "OutOfDomainWarning",
    "force_finding",
]

# A pair is outside when it is shorter than this fraction of the shortest pair of its elements seen in training; an
# atom is outside when it has more than this multiple of the most neighbours seen around its element. Thermal MD of
# the training molecules stays inside (tests/test_domain.py): the envelope comes from MD frames at 300-800 K.
DISTANCE_TOLERANCE = 0.9
NEIGHBOR_TOLERANCE = 1.25
_CHUNK = 256  # frames per neighbour-list call
_SCREEN = 4096  # structures per batched screen of check_many
# From this many atoms a caller's GPU checks faster than the host (water, H100 host: 3,000 atoms 4.5 vs 31 ms, 24,000
# atoms 5.2 vs 192 ms; benchmarks/results/probe_domain_check_h100.md); below it the transfers and launches dominate.
GPU_CHECK_MIN_ATOMS = 1000
# A force component larger than this (eV/Å) means a structure left everything the student can describe: a collision
# pressed atoms into one another until the student's extrapolation (and under it the ZBL wall) answered with forces
# of 1e3 to 1e33 eV/Å, which shoot atoms off to 1e7-1e31 Å while every number stays finite
# (benchmarks/probe_hot_md.py: 2-96 of 976 g2 trajectories in 3 ps at 1,000-2,000 K), so no finiteness check sees
# it. Thermal MD of the training molecules stays below ~20 eV/Å. StudentCalculator and BatchedMD name it.
FORCE_LIMIT = 100.0


def force_finding(force: float, when: str = "") -> str:
    """The finding for a force component of ``force`` eV/Å above :data:`FORCE_LIMIT`."""
    return (
        f"an atom felt a force of {force:.3g} eV/Å{' ' + when if when else ''} (above {FORCE_LIMIT:g} eV/Å: atoms "
        "pressed into one another; a trajectory is not physical from there on)"
    )


class OutOfDomainWarning(UserWarning):
    """A structure is likely outside a student's training data, and its forces likely off by as much: the students
    of a :class:`~mlff_distiller.committee.CommitteeCalculator` disagree beyond its threshold, or the structure of a
    :class:`~mlff_distiller.StudentCalculator` lies outside the envelope stored with its student."""


@dataclass(frozen=True)
class DomainEnvelope:
    """The training frames' shortest pair distances and largest neighbour counts within ``cutoff``.

    Attributes:
        cutoff: the radius the pairs and neighbours were counted in (the student's cutoff), Å.
        min_distance: ``{(Za, Zb): Å}`` with ``Za <= Zb``, for each pair of elements seen within the cutoff.
        max_neighbors: ``{Z: count}``, the most neighbours within the cutoff around an atom of element ``Z``.
        frames: how many frames it was made from.
    """

    cutoff: float
    min_distance: dict[tuple[int, int], float]
    max_neighbors: dict[int, int]
    frames: int

    # ------------------------------------------------------------------------------------------ building
    @classmethod
    def from_frames(cls, frames: Sequence, cutoff: float) -> DomainEnvelope:
        """The envelope of ``frames`` (``ase.Atoms``, periodic or not) within ``cutoff`` Å."""
        frames = list(frames)
        if not frames:
            raise ValueError("DomainEnvelope.from_frames needs at least one frame")
        env = cls(float(cutoff), {}, {}, 0)
        for k in range(0, len(frames), _CHUNK):
            chunk = frames[k : k + _CHUNK]
            env = env.merged(cls(float(cutoff), *_frame_stats(chunk, cutoff), len(chunk)))
        return env

    @classmethod
    def from_dataset(cls, data) -> DomainEnvelope:
        """The envelope of a :class:`~mlff_distiller.distill.FrameDataset`, from the neighbour graphs it holds."""
        ptr, eptr = data.atom_ptr.cpu(), data.edge_ptr.cpu()
        n_frames = len(data)
        frame_of_edge = torch.repeat_interleave(torch.arange(n_frames), eptr[1:] - eptr[:-1])
        offset = ptr[frame_of_edge]
        i = data.edges_local[0].cpu() + offset
        j = data.edges_local[1].cpu() + offset
        pos = data.positions.detach().cpu().double()
        cell = data.cell.detach().cpu().double()[frame_of_edge]
        vec = pos[j] - pos[i] + torch.einsum("ek,ekl->el", data.edge_shifts.cpu().double(), cell)
        d = torch.linalg.vector_norm(vec, dim=1)
        return cls(float(data.cutoff), *_pair_stats(d, i, j, data.numbers.cpu()), n_frames)

    def merged(self, other: DomainEnvelope) -> DomainEnvelope:
        """The envelope of both sets of frames (same cutoff): fine-tuning keeps what the student was trained on."""
        if abs(self.cutoff - other.cutoff) > 1e-9:
            raise ValueError(f"cannot merge envelopes of cutoffs {self.cutoff} and {other.cutoff} Å")
        min_d = dict(self.min_distance)
        for key, value in other.min_distance.items():
            min_d[key] = min(value, min_d.get(key, np.inf))
        max_n = dict(self.max_neighbors)
        for key, value in other.max_neighbors.items():
            max_n[key] = max(value, max_n.get(key, 0))
        return DomainEnvelope(self.cutoff, min_d, max_n, self.frames + other.frames)

    def repulsion_radii(self, species: Sequence[int], fraction: float = DISTANCE_TOLERANCE) -> dict:
        """``{(Za, Zb): r_off}`` for a student of ``species``: where its ZBL wall
        (:mod:`mlff_distiller.kernels.repulsion`) starts, ``fraction`` times the shortest pair of the two elements in
        the data. With the default, the fraction below which :meth:`check` calls a pair outside: a structure inside
        the envelope never feels the wall. A pair of elements never seen within the cutoff gets ``fraction`` times
        0.7 times the sum of their covalent radii (ASE's table; the seen CHNO pairs sit at 0.71-1.0 times theirs)."""
        from ase.data import covalent_radii

        species = sorted({int(z) for z in species})
        radii = {}
        for a, za in enumerate(species):
            for zb in species[a:]:
                seen = self.min_distance.get((za, zb))
                d = seen if seen is not None else 0.7 * float(covalent_radii[za] + covalent_radii[zb])
                radii[(za, zb)] = fraction * d
        return radii

    # ------------------------------------------------------------------------------------------ checking
    def check(
        self,
        atoms,
        *,
        distance_tolerance: float = DISTANCE_TOLERANCE,
        neighbor_tolerance: float = NEIGHBOR_TOLERANCE,
        limit: int = 5,
        device: torch.device | str | None = None,
    ) -> list[str]:
        """What ``atoms`` has outside the envelope, one sentence per finding (at most ``limit``); empty when inside.

        Findings: two atoms at exactly the same position (a duplicated atom: the student's energy then ignores the
        pair, finite and wrong); a pair of elements never seen within the cutoff; a pair closer than
        ``distance_tolerance`` times the shortest of its elements in the data; an atom with more than
        ``neighbor_tolerance`` times the most neighbours seen around its element. ``device``: where the neighbour
        list and its reductions run (default the CPU); on a GPU a 24,000-atom box takes milliseconds instead of a
        second, and only the few per-element numbers come back."""
        from ase.data import chemical_symbols

        batch, d, i, j = _pairs([atoms], self.cutoff, device)
        shortest_seen, most_seen = _pair_stats(d, i, j, batch.numbers)
        found: list[str] = []
        twins = _coincident(batch)
        if len(twins):
            a, b = twins[0].tolist()
            za, zb = batch.numbers[[a, b]].tolist()
            more = f" ({len(twins)} such pairs)" if len(twins) > 1 else ""
            found.append(
                f"atoms {a} and {b} ({chemical_symbols[za]} and {chemical_symbols[zb]}) at the same position{more}: "
                "no neighbour list pairs coincident atoms, so nothing in the student keeps them apart"
            )
        for (za, zb), shortest in sorted(shortest_seen.items(), key=lambda kv: kv[1]):
            name = f"{chemical_symbols[za]}-{chemical_symbols[zb]}"
            seen = self.min_distance.get((za, zb))
            if seen is None:
                found.append(f"{name} pairs within {self.cutoff:g} Å (none in the training data)")
            elif shortest < distance_tolerance * seen:
                found.append(f"a {name} pair at {shortest:.2f} Å (the training data's shortest: {seen:.2f} Å)")
        for zz, most in sorted(most_seen.items()):
            seen_n = self.max_neighbors.get(zz)
            if seen_n is not None and most > neighbor_tolerance * seen_n:
                found.append(
                    f"a {chemical_symbols[zz]} atom with {most} neighbours within {self.cutoff:g} Å (the training "
                    f"data's most: {seen_n})"
                )
        return found[:limit]

    def check_many(
        self,
        structures: Sequence,
        *,
        distance_tolerance: float = DISTANCE_TOLERANCE,
        neighbor_tolerance: float = NEIGHBOR_TOLERANCE,
        limit: int = 5,
        device: torch.device | None = None,
    ) -> list[list[str]]:
        """:meth:`check` of each structure, the same findings, for many structures at once. Structures below
        ``GPU_CHECK_MIN_ATOMS`` atoms are screened together on the host, ``_SCREEN`` at a time (one batched
        neighbour list and a few vectorised comparisons instead of ~0.5 ms of calls per small molecule), and only
        those found outside are checked one by one for their sentences. Larger ones are checked one by one, on
        ``device`` when it is a GPU (:meth:`check_device`). A :class:`~mlff_distiller.batch.FrameTable` is screened
        from its arrays: only the structures checked one by one build their ``ase.Atoms``."""
        table = isinstance(structures, FrameTable)
        if not table:
            structures = list(structures)
        found: list[list[str]] = [[] for _ in range(len(structures))]
        tolerances = {"distance_tolerance": distance_tolerance, "neighbor_tolerance": neighbor_tolerance}
        small = []
        for k, n in enumerate(structures.atom_counts() if table else map(len, structures)):
            if device is not None and self.check_device(n, device) is not None:
                found[k] = self.check(structures[k], limit=limit, device=device, **tolerances)
            else:
                small.append(k)
        for start in range(0, len(small), _SCREEN):
            ids = small[start : start + _SCREEN]
            part = _take(structures, ids) if table else [structures[k] for k in ids]
            outside = self._screen(part, distance_tolerance, neighbor_tolerance)
            for k in np.asarray(ids)[outside].tolist():
                found[k] = self.check(structures[k], limit=limit, **tolerances)
        return found

    def _screen(self, structures: Sequence, distance_tolerance: float, neighbor_tolerance: float) -> np.ndarray:
        """Which of ``structures`` have something outside the envelope (the tests of :meth:`check`, vectorised over
        every pair and atom of one batch on the host)."""
        batch, d, i, j = _pairs(structures, self.cutoff)
        i, j, z = i.long(), j.long(), batch.numbers.long()
        shortest = torch.full((_Z * _Z,), torch.inf, dtype=torch.float64)  # seen in training; inf: never
        for (za, zb), seen_d in self.min_distance.items():
            shortest[za * _Z + zb] = seen_d
        most = torch.full((_Z,), torch.inf, dtype=torch.float64)  # an element never seen: no neighbour finding
        for zz, n in self.max_neighbors.items():
            most[zz] = n
        outside = torch.zeros(len(structures), dtype=torch.bool)
        if i.numel():
            seen = shortest[torch.minimum(z[i], z[j]) * _Z + torch.maximum(z[i], z[j])]
            bad_pair = torch.isinf(seen) | (d < distance_tolerance * seen)
            outside[batch.batch[i[bad_pair]]] = True
        counts = torch.bincount(i, minlength=z.numel()).double()
        outside[batch.batch[counts > neighbor_tolerance * most[z]]] = True
        outside[batch.batch[_coincident(batch)[:, 0]]] = True
        return outside.numpy()

    @staticmethod
    def check_device(n_atoms: int, device: torch.device) -> torch.device | None:
        """Where to check a structure of ``n_atoms`` for a caller computing on ``device``: that GPU from
        ``GPU_CHECK_MIN_ATOMS`` atoms on, else the host (None)."""
        return device if device.type == "cuda" and n_atoms >= GPU_CHECK_MIN_ATOMS else None

    # ------------------------------------------------------------------------------------------ storage
    def to_dict(self) -> dict:
        """JSON-ready form (checkpoint metadata)."""
        return {
            "cutoff": self.cutoff,
            "min_distance": [[za, zb, d] for (za, zb), d in sorted(self.min_distance.items())],
            "max_neighbors": [[zz, n] for zz, n in sorted(self.max_neighbors.items())],
            "frames": self.frames,
        }

    @classmethod
    def from_dict(cls, data: dict) -> DomainEnvelope:
        try:
            return cls(
                float(data["cutoff"]),
                {(int(a), int(b)): float(d) for a, b, d in data["min_distance"]},
                {int(zz): int(n) for zz, n in data["max_neighbors"]},
                int(data["frames"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a domain envelope: {exc}") from None

    @classmethod
    def of_model(cls, model) -> DomainEnvelope | None:
        """The envelope stored with ``model`` (``metadata["domain"]``), or None for a student trained before it
        was recorded or fine-tuned from one without it."""
        data = (getattr(model, "metadata", None) or {}).get("domain")
        return None if data is None else cls.from_dict(data)


def _frame_stats(frames: Iterable, cutoff: float, device: torch.device | str | None = None):
    """The shortest pair per element pair and the most neighbours per element of ``frames`` within ``cutoff``
    (float64 positions; the neighbour list and the reductions on ``device``, default the CPU)."""
    batch, d, i, j = _pairs(frames, cutoff, device)
    return _pair_stats(d, i, j, batch.numbers)


def _pairs(frames: Iterable, cutoff: float, device: torch.device | str | None = None):
    """``(batch, d, i, j)``: ``frames`` as one float64 batch on ``device`` (default the CPU) and its directed pairs
    ``i -> j`` within ``cutoff`` at distances ``d``."""
    from mlff_distiller.batch import AtomsBatch
    from mlff_distiller.neighbors import neighbor_list_batch

    frames = frames if isinstance(frames, FrameTable) else list(frames)  # a FrameTable: no Atoms built
    batch = AtomsBatch.from_atoms(frames, dtype=torch.float64)
    if device is not None:
        batch = batch.to(torch.device(device))
    nl = neighbor_list_batch(batch, float(cutoff))
    d = torch.linalg.vector_norm(nl.vectors(batch.positions), dim=1)
    return batch, d, nl.edge_index[0], nl.edge_index[1]


# Weights of the position key that _coincident sorts by (any irrational-looking numbers), and its grid of
# fractional coordinates in periodic structures.
_KEY_WEIGHTS = (0.7548776662466927, 0.5698402909980532, 0.3247179572447460)
_GRID = float(2**30)


def _coincident(batch) -> torch.Tensor:
    """``[P, 2]`` (CPU, int64, ``a < b``): atoms of one structure at exactly the same position, each with the next
    one found there. No neighbour list pairs them (a zero-length edge has no direction; ``mlff_distiller.neighbors``),
    so the student's energy ignores such a pair: a duplicated atom gives finite, wrong results. One key per atom
    from its position, atoms ordered by (structure, key) with two stable sorts, and the neighbours in that order
    with equal keys compared exactly; on the batch's device (one sync).

    In a fully periodic structure the positions compared are the fractional coordinates wrapped into the cell, on
    a grid of 2^-30 (~5e-9 Å in a 5 Å cell): an atom listed again one lattice vector away (a structure file that
    gives a boundary atom at both fractional 0 and 1) sits at distance 0 from the other's image, which no list
    pairs either. Other structures compare their positions as given."""
    pos = batch.positions.to(torch.float64)
    if pos.shape[0] < 2:
        return torch.zeros((0, 2), dtype=torch.long)
    periodic = batch.pbc.all(dim=1)
    if bool(periodic.any()):
        cell = batch.cell.to(torch.float64)
        inv = torch.linalg.inv(
            torch.where(periodic[:, None, None], cell, torch.eye(3, dtype=cell.dtype, device=cell.device))
        )
        on = periodic[batch.batch]
        frac = torch.einsum("ni,nij->nj", pos[on], inv[batch.batch[on]])
        grid = torch.round((frac - torch.floor(frac)) * _GRID) % _GRID  # [0, 1) on the grid, 1.0 wrapped to 0
        pos = pos.clone()
        pos[on] = grid
    w0, w1, w2 = _KEY_WEIGHTS
    # Elementwise products and sums, not a matmul: equal rows always give equal keys.
    key = pos[:, 0] * w0 + pos[:, 1] * w1 + pos[:, 2] * w2
    order = torch.sort(key, stable=True).indices
    order = order[torch.sort(batch.batch[order], stable=True).indices]  # by structure, then by key
    ks, ss = key[order], batch.batch[order]
    cand = torch.nonzero((ks[1:] == ks[:-1]) & (ss[1:] == ss[:-1])).squeeze(1)
    a, b = order[cand], order[cand + 1]
    same = (pos[a] == pos[b]).all(dim=1)
    return torch.stack([torch.minimum(a, b), torch.maximum(a, b)], dim=1)[same].cpu()


def _take(table: FrameTable, ids: list[int]) -> FrameTable:
    """The structures ``ids`` (ascending) of ``table``, as a table of copies of its rows."""
    keep = np.zeros(len(table), dtype=bool)
    keep[ids] = True
    rows = np.repeat(keep, table.counts)
    return FrameTable(
        table.numbers[rows], table.positions[rows], table.cells[keep], table.pbc[keep], table.counts[keep]
    )


_Z = 128  # element numbers are below this


def _pair_stats(d: torch.Tensor, i: torch.Tensor, j: torch.Tensor, z: torch.Tensor):
    """``({(Za, Zb): shortest d}, {Z: most neighbours})`` of the directed pairs ``i -> j`` at distances ``d`` among
    atoms of elements ``z``: scatter reductions on the tensors' device, then one small copy to the host."""
    z = z.to(device=d.device, dtype=torch.long)
    zi, zj = z[i.long()], z[j.long()]
    code = torch.minimum(zi, zj) * _Z + torch.maximum(zi, zj)
    shortest = torch.full((_Z * _Z,), torch.inf, dtype=d.dtype, device=d.device)
    shortest.scatter_reduce_(0, code, d, "amin")
    counts = torch.bincount(i.long(), minlength=z.numel())
    most = torch.full((_Z,), -1, dtype=torch.long, device=d.device).scatter_reduce_(0, z, counts, "amax")
    shortest, most = shortest.cpu(), most.cpu()
    seen = torch.isfinite(shortest).nonzero().flatten().tolist()
    min_d = {(c // _Z, c % _Z): float(shortest[c]) for c in seen}
    max_n = {zz: int(most[zz]) for zz in (most >= 0).nonzero().flatten().tolist()}
    return min_d, max_n
