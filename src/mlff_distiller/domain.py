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

__all__ = ["DISTANCE_TOLERANCE", "NEIGHBOR_TOLERANCE", "DomainEnvelope", "OutOfDomainWarning"]

# A pair is outside when it is shorter than this fraction of the shortest pair of its elements seen in training; an
# atom is outside when it has more than this multiple of the most neighbours seen around its element. Thermal MD of
# the training molecules stays inside (tests/test_domain.py): the envelope comes from MD frames at 300-800 K.
DISTANCE_TOLERANCE = 0.9
NEIGHBOR_TOLERANCE = 1.25
_CHUNK = 256  # frames per neighbour-list call


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
        min_d: dict[tuple[int, int], float] = {}
        max_n: dict[int, int] = {}
        for k in range(0, len(frames), _CHUNK):
            d, pair_z, counts, z = _pairs(frames[k : k + _CHUNK], cutoff)
            for key, value in _min_per_pair(d, pair_z).items():
                min_d[key] = min(value, min_d.get(key, np.inf))
            for key, value in _max_per_element(counts, z).items():
                max_n[key] = max(value, max_n.get(key, 0))
        return cls(float(cutoff), min_d, max_n, len(frames))

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
        d = torch.linalg.vector_norm(vec, dim=1).numpy()
        z = data.numbers.cpu().numpy()
        d, pair_z, counts, z = _pair_stats(d, i.numpy(), j.numpy(), z)
        return cls(float(data.cutoff), _min_per_pair(d, pair_z), _max_per_element(counts, z), n_frames)

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

    # ------------------------------------------------------------------------------------------ checking
    def check(
        self,
        atoms,
        *,
        distance_tolerance: float = DISTANCE_TOLERANCE,
        neighbor_tolerance: float = NEIGHBOR_TOLERANCE,
        limit: int = 5,
    ) -> list[str]:
        """What ``atoms`` has outside the envelope, one sentence per finding (at most ``limit``); empty when inside.

        Findings: a pair of elements never seen within the cutoff; a pair closer than ``distance_tolerance`` times
        the shortest of its elements in the data; an atom with more than ``neighbor_tolerance`` times the most
        neighbours seen around its element."""
        from ase.data import chemical_symbols

        d, pair_z, counts, z = _pairs([atoms], self.cutoff)
        found: list[str] = []
        for (za, zb), shortest in sorted(_min_per_pair(d, pair_z).items(), key=lambda kv: kv[1]):
            name = f"{chemical_symbols[za]}-{chemical_symbols[zb]}"
            seen = self.min_distance.get((za, zb))
            if seen is None:
                found.append(f"{name} pairs within {self.cutoff:g} Å (none in the training data)")
            elif shortest < distance_tolerance * seen:
                found.append(f"a {name} pair at {shortest:.2f} Å (the training data's shortest: {seen:.2f} Å)")
        for zz, most in sorted(_max_per_element(counts, z).items()):
            seen_n = self.max_neighbors.get(zz)
            if seen_n is not None and most > neighbor_tolerance * seen_n:
                found.append(
                    f"a {chemical_symbols[zz]} atom with {most} neighbours within {self.cutoff:g} Å (the training "
                    f"data's most: {seen_n})"
                )
        return found[:limit]

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


def _pairs(frames: Iterable, cutoff: float):
    """Pair distances within ``cutoff`` (each pair once per direction), their element pairs ``[P, 2]`` (sorted),
    the neighbour count of every atom and its element."""
    from mlff_distiller.batch import AtomsBatch
    from mlff_distiller.neighbors import neighbor_list_batch

    batch = AtomsBatch.from_atoms(list(frames), dtype=torch.float64)
    nl = neighbor_list_batch(batch, float(cutoff))
    vec = nl.vectors(batch.positions)
    d = torch.linalg.vector_norm(vec, dim=1).numpy()
    z = batch.numbers.numpy()
    i, j = nl.edge_index.numpy()
    return _pair_stats(d, i, j, z)


def _pair_stats(d: np.ndarray, i: np.ndarray, j: np.ndarray, z: np.ndarray):
    """Distances, their sorted element pairs ``[P, 2]``, each atom's neighbour count and the elements."""
    pair_z = np.sort(np.stack([z[i], z[j]], axis=1), axis=1)
    return d, pair_z, np.bincount(i, minlength=len(z)), z


def _min_per_pair(d: np.ndarray, pair_z: np.ndarray) -> dict[tuple[int, int], float]:
    if d.size == 0:
        return {}
    code = pair_z[:, 0].astype(np.int64) * 128 + pair_z[:, 1]
    uniq, inv = np.unique(code, return_inverse=True)
    best = np.full(len(uniq), np.inf)
    np.minimum.at(best, inv, d)
    return {(int(c // 128), int(c % 128)): float(b) for c, b in zip(uniq, best, strict=True)}


def _max_per_element(counts: np.ndarray, z: np.ndarray) -> dict[int, int]:
    out: dict[int, int] = {}
    for zz in np.unique(z):
        out[int(zz)] = int(counts[z == zz].max())
    return out
