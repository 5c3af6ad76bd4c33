"""Host side of the padded static-shape training step: a dataset's tensors with one trailing inert row each
(``_StaticData``) and the integer gather indices that pad one batch to the next capacity of a geometric ladder
(``_StaticBatcher``, capacities from :mod:`mlff_distiller.buckets`).

Padding atoms point at the inert atom row and belong to a dummy structure whose energy is masked out of the loss;
padding edges are self-loops of padding atoms with a shift longer than the cutoff, so every padding message,
force and gradient is exactly 0. The device side is :class:`mlff_distiller.distill.train_steps._StaticStep`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mlff_distiller.buckets import Bucket, BucketLadder
from mlff_distiller.distill.dataset import FrameDataset


def _segment_arange_np(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concat(arange(s, s + c) for s, c in zip(starts, counts))`` without a Python loop."""
    offsets = np.cumsum(counts) - counts
    return np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(starts - offsets, counts)


class _StaticData:
    """A dataset's tensors on its device, each with one trailing inert row that padding entries point at
    (atom: the model's first species at the origin with zero force; frame: zero energy, one atom; edge: a shift
    vector longer than the cutoff), and host copies of the offsets that the batcher needs."""

    def __init__(self, ds: FrameDataset, pad_z: int, cutoff: float) -> None:
        dev = ds.device

        def ext(t: torch.Tensor | None, fill: float) -> torch.Tensor | None:
            if t is None:
                return None
            return torch.cat([t, torch.full((1, *t.shape[1:]), fill, dtype=t.dtype, device=dev)])

        self.n_atoms, self.n_frames = int(ds.atom_ptr[-1]), len(ds)
        self.n_edges = int(ds.edges_local.shape[1])
        self.numbers = ext(ds.numbers, pad_z)
        self.positions = ext(ds.positions, 0.0)
        self.forces = ext(ds.forces, 0.0)
        self.energy = ext(ds.energy, 0.0)
        self.counts = ext(ds.num_atoms.to(ds.dtype), 1.0)
        # Loss weights; the inert row's 0 masks padding atoms and unused structure slots out of every loss term.
        self.weight = ext(ds.weight, 0.0)
        self.hvp_dir, self.hvp = ext(ds.hvp_dir, 0.0), ext(ds.hvp, 0.0)
        # Stress labels as the loss compares them: σ V / n (virial per atom, eV) and the labelled-frame mask.
        if ds.stress is not None:
            scale = (torch.linalg.det(ds.cell).abs() / ds.num_atoms.to(ds.dtype))[:, None]
            self.virial = ext(ds.stress.to(dev, ds.dtype) * scale, 0.0)
            self.stress_mask = ext(ds.stress_mask.to(dev, ds.dtype), 0.0)
        else:
            self.virial = self.stress_mask = None
        edge_counts = ds.edge_ptr[1:] - ds.edge_ptr[:-1]
        edge_frame = torch.repeat_interleave(torch.arange(self.n_frames, device=dev), edge_counts)
        sv = torch.einsum("ei,eij->ej", ds.edge_shifts.to(ds.dtype), ds.cell[edge_frame])
        far = torch.zeros((1, 3), dtype=ds.dtype, device=dev)
        far[0, 0] = 2.0 * float(cutoff) + 1.0  # far outside the cutoff in any precision (as buckets.py)
        self.shift_vectors = torch.cat([sv, far])
        self.atom_ptr = ds.atom_ptr.cpu().numpy()
        self.edge_ptr = ds.edge_ptr.cpu().numpy()
        self.edges_local = ds.edges_local.cpu().numpy()


class _StaticBatcher:
    """Host side of the static step: the padded capacity of a batch and its gather indices, one int64 row
    ``[atom_src A | batch A | receiver C | sender C | edge_src C | frame_src S]`` (S = batch size + 1)."""

    def __init__(self, data: _StaticData, batch_size: int, growth: float) -> None:
        self.data = data
        self.structures = int(batch_size) + 1
        counts = np.sort(data.atom_ptr[1:] - data.atom_ptr[:-1])[::-1]
        ecounts = np.sort(data.edge_ptr[1:] - data.edge_ptr[:-1])[::-1]
        # The largest possible batch bounds the ladder, so every batch has a capacity. One ratio throughout
        # (fine_growth = growth): each bucket here is a captured training step, kept for the whole run.
        ladder = BucketLadder(
            min_atoms=64,
            max_atoms=max(64, int(counts[:batch_size].sum()) + 1),
            min_edges=64,
            max_edges=max(64, int(ecounts[:batch_size].sum())),
            growth=float(growth),
            fine_growth=float(growth),
        )
        self.atom_caps = np.array(ladder.atom_capacities)
        self.edge_caps = np.array(ladder.edge_capacities)

    def bucket(self, n_atoms: int, n_edges: int) -> Bucket:
        a = self.atom_caps[np.searchsorted(self.atom_caps, n_atoms + 1)]
        e = self.edge_caps[np.searchsorted(self.edge_caps, max(n_edges, 1))]
        return Bucket(int(a), int(e))

    def plan(self, idx: Sequence[int]) -> tuple[Bucket, np.ndarray]:
        d = self.data
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size == 0 or idx.size >= self.structures:
            raise ValueError(f"a static batch holds 1..{self.structures - 1} frames, got {idx.size}")
        counts = d.atom_ptr[idx + 1] - d.atom_ptr[idx]
        ecounts = d.edge_ptr[idx + 1] - d.edge_ptr[idx]
        n, e, b, s = int(counts.sum()), int(ecounts.sum()), idx.size, self.structures
        bucket = self.bucket(n, e)
        a, c = bucket.atoms, bucket.edges
        row = np.empty(2 * a + 3 * c + s, dtype=np.int64)
        atom_src, batch, recv, send, edge_src, frame_src = np.split(row, np.cumsum([a, a, c, c, c]))
        atom_src[:n] = _segment_arange_np(d.atom_ptr[idx], counts)
        atom_src[n:] = d.n_atoms
        batch[:n] = np.repeat(np.arange(b, dtype=np.int64), counts)
        batch[n:] = s - 1  # the dummy structure
        esrc = _segment_arange_np(d.edge_ptr[idx], ecounts)
        edge_src[:e] = esrc
        edge_src[e:] = d.n_edges
        offsets = np.repeat(np.cumsum(counts) - counts, ecounts)
        recv[:e] = d.edges_local[0, esrc] + offsets
        send[:e] = d.edges_local[1, esrc] + offsets
        if c > e:
            # Self-loops of padding atoms n .. a-1 in ascending order: the list stays sorted by receiver.
            recv[e:] = n + (np.arange(c - e, dtype=np.int64) * (a - n)) // (c - e)
            send[e:] = recv[e:]
        frame_src[:b] = idx
        frame_src[b:] = d.n_frames
        return bucket, row
