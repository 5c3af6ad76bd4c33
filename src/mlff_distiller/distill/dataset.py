"""Labelled frames as tensors, with neighbour graphs built once, and batches for training.

Positions of a labelled frame never change during training, so each frame's graph is computed once with
:func:`mlff_distiller.neighbors.neighbor_list` and stored; a batch concatenates frames and offsets their
edges. All tensors of a :class:`FrameDataset` may live on the GPU, so collating a batch is a few index ops.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from ase import Atoms

from mlff_distiller.batch import AtomsBatch
from mlff_distiller.neighbors import neighbor_list

__all__ = ["FrameDataset", "LabelledBatch", "config_weight", "fit_energy_reference", "split_frames"]

# Frames per neighbour-list call while building a dataset (bounds transient memory).
_NL_CHUNK = 512


@dataclass(kw_only=True)
class LabelledBatch:
    """A training batch of B frames, N atoms, E edges.

    Attributes:
        atoms: the :class:`AtomsBatch` (numbers, positions Å, cell Å, pbc, batch, ptr).
        edge_index: ``[2, E]`` int64 (receiver, sender), global atom indices.
        shifts: ``[E, 3]`` integer lattice shifts (as the floating dtype), so shift vector = shifts @ cell.
        energy: ``[B]`` teacher energies, eV.
        forces: ``[N, 3]`` teacher forces, eV/Å.
        hvp_dir: ``[N, 3]`` unit direction of each frame's Hessian-vector product, or None.
        hvp: ``[N, 3]`` teacher H·v, eV/Å², or None.
        stress: ``[B, 6]`` teacher stress (Voigt, eV/Å³; zeros where a frame has none), or None when the dataset
            holds no stress labels. stress_mask: ``[B]`` bool, the frames with a stress label.
        weight: ``[B]`` each frame's loss weight (dimensionless, >= 0; :func:`config_weight`), or None for all 1.0.
    """

    atoms: AtomsBatch
    edge_index: torch.Tensor
    shifts: torch.Tensor
    energy: torch.Tensor
    forces: torch.Tensor
    hvp_dir: torch.Tensor | None = None
    hvp: torch.Tensor | None = None
    stress: torch.Tensor | None = None
    stress_mask: torch.Tensor | None = None
    weight: torch.Tensor | None = None

    @property
    def num_structures(self) -> int:
        return self.atoms.num_structures

    def shift_vectors(self, positions_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[E, 3]`` shift vectors, Å."""
        a = self.atoms
        cell = a.cell[a.batch[self.edge_index[0]]]
        return torch.einsum("ei,eij->ej", self.shifts.to(cell.dtype), cell)


def voigt_stress(value) -> np.ndarray | None:
    """A stress given as Voigt ``[6]`` or a 3 x 3 tensor, as finite Voigt ``[6]`` float64 (xx yy zz yz xz xy);
    None for anything else. Labelling, datasets and evaluation read teacher stresses through it."""
    stress = np.asarray(value, dtype=np.float64).reshape(-1)
    if stress.shape == (9,):
        m = stress.reshape(3, 3)
        stress = np.array([m[0, 0], m[1, 1], m[2, 2], m[1, 2], m[0, 2], m[0, 1]])
    return stress if stress.shape == (6,) and np.isfinite(stress).all() else None


def periodic_stress(atoms: Atoms, results: dict | None = None) -> np.ndarray | None:
    """The stress in ``results`` (default: the frame's calculator results) as Voigt ``[6]``, for a fully periodic
    frame; None when there is none, the frame is not periodic or the value is not a finite 6 / 3 x 3 stress."""
    if results is None:
        results = atoms.calc.results if atoms.calc is not None else {}
    value = results.get("stress")
    return None if value is None or not atoms.pbc.all() else voigt_stress(value)


def _stress_label(atoms: Atoms, k: int) -> np.ndarray | None:
    """:func:`periodic_stress`, refusing a malformed stress rather than dropping it (training data)."""
    stress = periodic_stress(atoms)
    value = atoms.calc.results.get("stress")
    if stress is None and value is not None and atoms.pbc.all():
        raise ValueError(f"frame {k}: stress must be 6 (Voigt) or 3 x 3 finite values, got {value!r}")
    return stress


def loss_weight(value, what: str) -> float:
    """``value`` as a loss weight: a finite float >= 0, else a ``ValueError`` naming ``what``."""
    try:
        weight = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, got {value!r}") from None
    if not (np.isfinite(weight) and weight >= 0):
        raise ValueError(f"{what} must be finite and >= 0, got {value!r}")
    return weight


def config_weight(atoms: Atoms, where: str = "frame") -> float:
    """A labelled frame's loss weight: ``atoms.info["config_weight"]`` (the key MACE reads) or 1.0 when it has none;
    a ``ValueError`` naming ``where`` unless it is a finite number >= 0."""
    return loss_weight(atoms.info.get("config_weight", 1.0), f"{where}: config_weight")


def _segment_arange(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(s, s + c)`` over segments."""
    total = int(counts.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=starts.device)
    offsets = torch.cumsum(counts, 0) - counts
    return torch.arange(total, device=starts.device) + torch.repeat_interleave(starts - offsets, counts)


class FrameDataset:
    """Labelled frames stored as flat tensors with precomputed neighbour graphs.

    Args:
        frames: ``ase.Atoms`` with teacher ``energy`` (eV) and ``forces`` (eV/Å) on their calculator; optional
            arrays ``hvp_dir``/``hvp`` (used only if every frame has them), for fully periodic frames an
            optional ``stress`` result (Voigt or 3 x 3, eV/Å³), and an optional ``info["config_weight"]``: the
            frame's weight in the training loss (:func:`config_weight`; ``weight``, default 1.0).
        cutoff: graph cutoff, Å (the student's).
        device, dtype: where and in which float dtype the tensors live.
        neighbor_method: neighbour-list backend.
    """

    def __init__(
        self,
        frames: Sequence[Atoms],
        cutoff: float,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        neighbor_method: str = "auto",
    ) -> None:
        frames = list(frames)
        if not frames:
            raise ValueError("FrameDataset needs at least one labelled frame")
        energies, forces, stresses, weights = [], [], [], []
        for k, a in enumerate(frames):
            calc = a.calc
            if calc is None or "energy" not in calc.results or "forces" not in calc.results:
                raise ValueError(f"frame {k} has no teacher energy and forces")
            f = np.asarray(calc.results["forces"], dtype=np.float64)
            e = float(calc.results["energy"])
            if f.shape != (len(a), 3):
                raise ValueError(f"frame {k}: forces must be [{len(a)}, 3], got {f.shape}")
            if not (np.isfinite(e) and np.isfinite(f).all()):
                raise ValueError(f"frame {k}: non-finite teacher energy or forces")
            energies.append(e)
            forces.append(f)
            stresses.append(_stress_label(a, k))
            weights.append(config_weight(a, f"frame {k}"))
        self.frames_info = [dict(a.info) for a in frames]
        self.device, self.dtype, self.cutoff = torch.device(device), dtype, float(cutoff)
        full = AtomsBatch.from_atoms(frames, dtype=torch.float64)
        self.numbers = full.numbers
        self.positions = full.positions
        self.cell, self.pbc, self.atom_ptr = full.cell, full.pbc, full.ptr
        self.energy = torch.tensor(energies, dtype=torch.float64)
        self.weight = torch.tensor(weights, dtype=torch.float64)
        self.forces = torch.from_numpy(np.concatenate(forces))
        has_hvp = all("hvp" in a.arrays and "hvp_dir" in a.arrays for a in frames)
        self.hvp = torch.from_numpy(np.concatenate([a.arrays["hvp"] for a in frames])) if has_hvp else None
        self.hvp_dir = torch.from_numpy(np.concatenate([a.arrays["hvp_dir"] for a in frames])) if has_hvp else None
        self.stress_mask = torch.tensor([x is not None for x in stresses], dtype=torch.bool)
        self.stress = (
            torch.tensor(np.stack([np.zeros(6) if x is None else x for x in stresses]), dtype=torch.float64)
            if bool(self.stress_mask.any())
            else None
        )
        self._build_graphs(neighbor_method)
        self._to(self.device, dtype)

    def _build_graphs(self, method: str) -> None:
        edges, shifts, counts = [], [], []
        ptr = self.atom_ptr
        for c0 in range(0, len(self), _NL_CHUNK):
            c1 = min(c0 + _NL_CHUNK, len(self))
            a0, a1 = int(ptr[c0]), int(ptr[c1])
            sub_ptr = ptr[c0 : c1 + 1] - a0
            sub_batch = torch.repeat_interleave(torch.arange(c1 - c0), sub_ptr[1:] - sub_ptr[:-1])
            nl = neighbor_list(
                self.positions[a0:a1],
                self.cell[c0:c1],
                self.pbc[c0:c1],
                sub_batch,
                sub_ptr,
                self.cutoff,
                method,
            )
            struct = sub_batch[nl.edge_index[0]]
            # Local (within-frame) indices, so a batch only needs to add its own atom offsets.
            edges.append(nl.edge_index - sub_ptr[struct])
            shifts.append(nl.shifts)
            counts.append(torch.bincount(struct, minlength=c1 - c0))
        self.edges_local = torch.cat(edges, dim=1)
        self.edge_shifts = torch.cat(shifts)
        counts_t = torch.cat(counts)
        self.edge_ptr = torch.zeros(len(self) + 1, dtype=torch.long)
        self.edge_ptr[1:] = torch.cumsum(counts_t, 0)

    def _to(self, device: torch.device, dtype: torch.dtype) -> None:
        for name in ("numbers", "atom_ptr", "pbc", "edges_local", "edge_shifts", "edge_ptr", "stress_mask"):
            setattr(self, name, getattr(self, name).to(device))
        for name in ("positions", "cell", "energy", "forces", "hvp", "hvp_dir", "stress", "weight"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device=device, dtype=dtype))

    # ------------------------------------------------------------------------------------------- access
    def __len__(self) -> int:
        return self.energy.shape[0]

    @property
    def num_atoms(self) -> torch.Tensor:
        """``[F]`` atoms per frame."""
        return self.atom_ptr[1:] - self.atom_ptr[:-1]

    @property
    def has_hvp(self) -> bool:
        return self.hvp is not None

    @property
    def has_stress(self) -> bool:
        """Whether any frame has a teacher stress."""
        return self.stress is not None

    def species(self) -> list[int]:
        return sorted(set(self.numbers.cpu().tolist()))

    def composition(self, species: Sequence[int]) -> np.ndarray:
        """``[F, S]`` count of each species (ordered like ``species``) in each frame."""
        z = self.numbers.cpu().numpy()
        ptr = self.atom_ptr.cpu().numpy()
        out = np.zeros((len(self), len(species)))
        for s, zs in enumerate(species):
            out[:, s] = np.add.reduceat((z == zs).astype(float), ptr[:-1]) if len(z) else 0
        return out

    def batch(self, indices: Sequence[int] | torch.Tensor) -> LabelledBatch:
        """Collate the frames ``indices`` into one :class:`LabelledBatch`."""
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.device)
        if idx.numel() == 0:
            raise ValueError("a batch needs at least one frame")
        counts = self.atom_ptr[idx + 1] - self.atom_ptr[idx]
        atom_idx = _segment_arange(self.atom_ptr[idx], counts)
        ecounts = self.edge_ptr[idx + 1] - self.edge_ptr[idx]
        edge_idx = _segment_arange(self.edge_ptr[idx], ecounts)
        ptr = torch.zeros(idx.numel() + 1, dtype=torch.long, device=self.device)
        ptr[1:] = torch.cumsum(counts, 0)
        b = torch.repeat_interleave(torch.arange(idx.numel(), device=self.device), counts)
        atoms = AtomsBatch(
            numbers=self.numbers[atom_idx],
            positions=self.positions[atom_idx],
            cell=self.cell[idx],
            pbc=self.pbc[idx],
            batch=b,
            ptr=ptr,
        )
        edge_index = self.edges_local[:, edge_idx] + torch.repeat_interleave(ptr[:-1], ecounts)
        return LabelledBatch(
            atoms=atoms,
            edge_index=edge_index,
            shifts=self.edge_shifts[edge_idx],
            energy=self.energy[idx],
            forces=self.forces[atom_idx],
            hvp_dir=None if self.hvp_dir is None else self.hvp_dir[atom_idx],
            hvp=None if self.hvp is None else self.hvp[atom_idx],
            stress=None if self.stress is None else self.stress[idx],
            stress_mask=None if self.stress is None else self.stress_mask[idx],
            weight=self.weight[idx],
        )

    def batches(
        self, batch_size: int, *, shuffle: bool = False, generator: torch.Generator | None = None
    ) -> Iterator[LabelledBatch]:
        """Batches of ``batch_size`` frames (the last may be smaller), shuffled by ``generator`` if asked."""
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        order = torch.randperm(len(self), generator=generator) if shuffle else torch.arange(len(self))
        for k in range(0, len(self), int(batch_size)):
            yield self.batch(order[k : k + int(batch_size)])


def fit_energy_reference(dataset: FrameDataset, species: Sequence[int]) -> np.ndarray:
    """Per-species reference energies μ_z (eV) minimising Σ_frames c (E − Σ_z n_z μ_z)², by least squares, c the
    frames' loss weights (``config_weight``; all 1.0: the plain least squares)."""
    root = np.sqrt(dataset.weight.detach().double().cpu().numpy())
    comp = dataset.composition(species) * root[:, None]
    energy = dataset.energy.detach().double().cpu().numpy() * root
    mu, *_ = np.linalg.lstsq(comp, energy, rcond=None)
    return mu


def split_frames(
    frames: Sequence[Atoms], val_fraction: float, *, seed: int = 0, group_key: str = "task"
) -> tuple[list[Atoms], list[Atoms]]:
    """Split into (train, val), keeping whole groups (frames sharing ``info[group_key]``, e.g. one trajectory)
    on one side so validation frames are not near-copies of training frames. Frames without the key are
    their own group. At least one group goes to each side when there are two or more groups."""
    if not 0 <= float(val_fraction) < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    frames = list(frames)
    groups: dict[object, list[int]] = {}
    for k, a in enumerate(frames):
        groups.setdefault(a.info.get(group_key, ("frame", k)), []).append(k)
    keys = list(groups)
    rng = np.random.default_rng(seed)
    rng.shuffle(keys)
    n_val_groups = round(float(val_fraction) * len(keys))
    if val_fraction > 0 and len(keys) >= 2:
        n_val_groups = min(max(n_val_groups, 1), len(keys) - 1)
    val_idx = {i for key in keys[:n_val_groups] for i in groups[key]}
    train = [a for k, a in enumerate(frames) if k not in val_idx]
    val = [a for k, a in enumerate(frames) if k in val_idx]
    return train, val
