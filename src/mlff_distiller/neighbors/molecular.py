"""All-pairs neighbour list of non-periodic structures on the host, in a handful of NumPy operations.

Why not the general backends: for molecules given on the host (one ASE ``Atoms`` or a batch of small ones),
the brute-force/cell-list code costs ~100 torch operations of fixed overhead per call (geometry set-up, image
tables, CSR), i.e. milliseconds for a benzene; on a GPU each of those is a launch and several are
device→host syncs. Without periodic images the list is just the pairs of each structure closer than the cutoff:
the Σ n_b² candidate pairs are enumerated at once, so the cost is tens of µs for a molecule and about a
millisecond for a thousand small ones. ``neighbor_list(method="auto")`` takes this path for CPU tensors of
structures without any periodic direction and at most :data:`MOLECULAR_MAX_PAIRS` candidate pairs; the engine
uses it to build the list on the host before one copy of the edges to the GPU.

Structures whose positions already live on a GPU (:class:`~mlff_distiller.batched_md.BatchedMD`: many molecules,
state on the device) take :func:`molecular_pairs_device`, where the general device backends cost 2-3.5 ms for
1-4,096 g2 molecules on an H100, most of it ~8 device->host syncs (``results/batched_md_h100_rebuild.md``). With the
Triton backend it is ``mlff_distiller.kernels.molecular_pairs``: a count kernel, a cumsum, one host read of the
total, a write kernel, without ever storing the candidates. The same enumeration in torch
(:func:`_molecular_pairs_device_torch`: the torch backend, the fallback, the oracle) measured 0.75-1.5 ms on an H200
at any batch size: ~20 ops, a host read of ``ptr``, two syncs (finiteness, ``nonzero``) and host->device copies.
"""

from __future__ import annotations

import numpy as np
import torch

from mlff_distiller.kernels import resolve_backend
from mlff_distiller.kernels._compile_ahead import dry_run_active
from mlff_distiller.kernels.molecular_pairs import MOLECULAR_TRITON_MAX_ATOMS, molecular_pairs_triton
from mlff_distiller.neighbors._common import NeighborList

__all__ = [
    "MOLECULAR_MAX_PAIRS",
    "MOLECULAR_MAX_STRUCTURE_PAIRS",
    "molecular_applicable",
    "molecular_device_applicable",
    "molecular_pair_count",
    "molecular_pairs",
    "molecular_pairs_device",
]

# Candidate pairs (Σ n_b²) up to which the host all-pairs path is used (~100 MB of transient index arrays).
MOLECULAR_MAX_PAIRS = 4_000_000
# ...and the candidate pairs of any one structure (n_b², here 724 atoms) up to which it is used on the host: one
# molecule's all pairs grow as n², the cell list's work as n. Stop 74, development CPU (2 threads), one water
# cluster, 5 Å: all pairs 6.6 / 26.4 / 64.2 / 84.4 ms at 501 / 999 / 1,500 / 1,998 atoms, the cell list 10.7 / 13.1
# / 23.6 / 28.1 ms; many small molecules stay on the all-pairs path whatever their sum (4,096 / 16,384 g2
# molecules: 11.3 / 40.0 ms against the cell list's 57.0 / 278.5 and brute force's 26.3 / 127.8).
MOLECULAR_MAX_STRUCTURE_PAIRS = 1 << 19


def molecular_applicable(
    positions: torch.Tensor,
    pbc: torch.Tensor,
    ptr: torch.Tensor,
    max_pairs: int = MOLECULAR_MAX_PAIRS,
    max_structure_pairs: int | None = MOLECULAR_MAX_STRUCTURE_PAIRS,
) -> bool:
    """Whether :func:`molecular_pairs` serves this batch: CPU tensors, no periodic direction anywhere, at most
    ``max_pairs`` candidate pairs (Σ n_b²; by default :data:`MOLECULAR_MAX_PAIRS`) and at most
    ``max_structure_pairs`` in any one structure (n_b²; by default :data:`MOLECULAR_MAX_STRUCTURE_PAIRS`; None: no
    such limit)."""
    if positions.device.type != "cpu" or pbc.device.type != "cpu" or ptr.device.type != "cpu":
        return False
    if pbc.numpy().any():  # (NumPy on the same memory: a few µs less than torch's CPU ops, once per list build)
        return False
    counts = np.diff(ptr.numpy()).astype(np.int64)
    squares = counts * counts
    if max_structure_pairs is not None and squares.size and int(squares.max()) > max_structure_pairs:
        return False
    return int(squares.sum()) <= max_pairs


def molecular_device_applicable(positions: torch.Tensor, pbc: torch.Tensor, ptr: torch.Tensor) -> bool:
    """Whether :func:`molecular_pairs_device` serves this batch: positions on a GPU, no periodic direction anywhere,
    and at most :data:`MOLECULAR_MAX_PAIRS` candidate pairs."""
    if positions.device.type == "cpu" or bool(pbc.any()):
        return False
    counts = (ptr[1:] - ptr[:-1]).cpu()
    return int((counts * counts).sum()) <= MOLECULAR_MAX_PAIRS


@torch.no_grad()
def molecular_pairs_device(positions: torch.Tensor, ptr: torch.Tensor, cutoff: float) -> NeighborList:
    """:func:`molecular_pairs` computed where ``positions`` are (any device): the same pairs in the same order, from
    the same float64 differences and test ``0 < |r|² < cutoff²`` (up to the last bit of a squared length at the
    cutoff, which NumPy may sum in another order). ``ptr [B + 1]`` may be on the host (the engine's case: no copy
    back) or on the device.

    The Triton backend (CUDA; the CPU under the interpreter when asked for) runs
    :func:`~mlff_distiller.kernels.molecular_pairs.molecular_pairs_triton`: three launches and one host sync. The
    torch backend, and inputs that path does not take (no structure in ``ptr``, more than
    :data:`~mlff_distiller.kernels.molecular_pairs.MOLECULAR_TRITON_MAX_ATOMS` atoms, tracing by torch.compile, a
    compile-ahead dry run, whose kernels do not run while this reads their counts), take
    :func:`_molecular_pairs_device_torch`."""
    if positions.dim() != 2 or positions.shape[1] != 3:
        raise ValueError(f"molecular_pairs: positions must be [N, 3], got {tuple(positions.shape)}")
    if (
        ptr.shape[0] > 1
        and positions.shape[0] <= MOLECULAR_TRITON_MAX_ATOMS
        and not torch.compiler.is_compiling()
        and resolve_backend(positions.device) == "triton"
        and not dry_run_active()
    ):
        edge_index, row_ptr, shifts, shift_vectors = molecular_pairs_triton(positions, ptr, cutoff)
        return NeighborList(
            edge_index=edge_index,
            shifts=shifts,
            shift_vectors=shift_vectors,
            row_ptr=row_ptr,
            method="molecular",
        )
    return _molecular_pairs_device_torch(positions, ptr, cutoff)


def _molecular_pairs_device_torch(positions: torch.Tensor, ptr: torch.Tensor, cutoff: float) -> NeighborList:
    """:func:`molecular_pairs_device` in torch ops on any device: the Σ n_b² candidates enumerated as
    :func:`molecular_pairs` does, the pairs kept with ``nonzero`` (the torch backend's path and the Triton path's
    oracle)."""
    if positions.dim() != 2 or positions.shape[1] != 3:
        raise ValueError(f"molecular_pairs: positions must be [N, 3], got {tuple(positions.shape)}")
    dev = positions.device
    p = ptr.detach().cpu().numpy().astype(np.int64, copy=False)
    counts = np.diff(p)
    n_pairs = counts * counts
    total = int(n_pairs.sum())
    n = positions.shape[0]
    pos = positions.detach().to(torch.float64)
    if not bool(torch.isfinite(pos).all()):
        raise ValueError("molecular_pairs: positions contain NaN or inf")
    if total == 0:
        i = j = torch.zeros(0, dtype=torch.int64, device=dev)
    else:
        it = torch.int32 if max(total, n) < 2**31 else torch.int64
        to = {"device": dev, "dtype": it}
        struct = torch.repeat_interleave(
            torch.arange(counts.shape[0], **to), torch.as_tensor(n_pairs, **to), output_size=total
        )
        first = torch.as_tensor(np.cumsum(n_pairs) - n_pairs, **to)
        local = torch.arange(total, **to) - first[struct]
        nb = torch.as_tensor(counts, **to)[struct]
        q = torch.div(local, nb, rounding_mode="floor")
        base = torch.as_tensor(p[:-1], **to)[struct]
        i = base + q
        j = base + (local - q * nb)
        d = pos[j] - pos[i]
        r2 = (d * d).sum(dim=1)
        keep = torch.nonzero((r2 > 0.0) & (r2 < float(cutoff) ** 2)).squeeze(1)
        i, j = i[keep].long(), j[keep].long()
    row_ptr = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    torch.cumsum(torch.bincount(i, minlength=n), dim=0, out=row_ptr[1:])
    e = i.shape[0]
    return NeighborList(
        edge_index=torch.stack([i, j]),
        shifts=torch.zeros((e, 3), dtype=torch.int64, device=dev),
        shift_vectors=torch.zeros((e, 3), dtype=positions.dtype, device=dev),
        row_ptr=row_ptr,
        method="molecular",
    )


@torch.no_grad()
def molecular_pairs(positions: torch.Tensor, ptr: torch.Tensor, cutoff: float) -> NeighborList:
    """Pairs ``(i, j)`` of the same structure with ``0 < |r_j - r_i| < cutoff`` (Å, decided in float64), sorted
    by receiver ``i`` and then sender ``j``; zero shifts. Positions ``[N, 3]`` and ``ptr [B + 1]`` on the CPU."""
    if positions.dim() != 2 or positions.shape[1] != 3:
        raise ValueError(f"molecular_pairs: positions must be [N, 3], got {tuple(positions.shape)}")
    pos = positions.detach().numpy().astype(np.float64, copy=False)
    if not np.isfinite(pos).all():
        raise ValueError("molecular_pairs: positions contain NaN or inf")
    p = ptr.numpy().astype(np.int64, copy=False)
    if p.shape[0] == 2 and p[0] == 0 and p[1] == pos.shape[0]:
        return _one_structure(pos, float(cutoff), positions.dtype)
    counts = np.diff(p)
    n_pairs = counts * counts
    total = int(n_pairs.sum())
    # Candidate k of structure b is (i, j) = (p[b] + local // n_b, p[b] + local % n_b) with local = k - Σ_{<b} n².
    # int32 index arithmetic where it fits, one divmod, np.take for the row gathers: 2.4-3.9x faster than int64
    # with separate // and % and fancy indexing (0.68 vs 1.6 ms for 1,024 g2 molecules on the development CPU).
    it = np.int32 if max(total, pos.shape[0]) < 2**31 else np.int64
    local = np.arange(total, dtype=it) - np.repeat((np.cumsum(n_pairs) - n_pairs).astype(it), n_pairs)
    q, r = np.divmod(local, np.repeat(counts.astype(it), n_pairs))
    base = np.repeat(p[:-1].astype(it), n_pairs)
    i = base + q
    j = base + r
    d = np.take(pos, j, axis=0)
    d -= np.take(pos, i, axis=0)
    r2 = np.einsum("ij,ij->i", d, d)
    keep = (r2 > 0.0) & (r2 < float(cutoff) ** 2)
    return _pair_list(i[keep].astype(np.int64), j[keep].astype(np.int64), pos.shape[0], positions.dtype)


def _one_structure(pos: np.ndarray, cutoff: float, dtype: torch.dtype) -> NeighborList:
    """:func:`molecular_pairs` of one structure (the calculator's and single-molecule calls): the n x n
    candidates by broadcasting, in a third of the NumPy calls (the same float64 differences and squared
    lengths, so the same pairs)."""
    n = pos.shape[0]
    i, j = np.nonzero(_within(pos, cutoff))  # row-major: by receiver, then sender
    return _pair_list(i.astype(np.int64, copy=False), j.astype(np.int64, copy=False), n, dtype)


def _within(pos: np.ndarray, cutoff: float) -> np.ndarray:
    """``[n, n]`` whether ``0 < |r_j - r_i| < cutoff`` for the float64 positions ``[n, 3]`` of one structure."""
    n = pos.shape[0]
    d = (pos[None, :, :] - pos[:, None, :]).reshape(n * n, 3)  # row i * n + j: r_j - r_i
    r2 = np.einsum("ij,ij->i", d, d)
    return ((r2 > 0.0) & (r2 < cutoff**2)).reshape(n, n)


def molecular_pair_count(positions: np.ndarray, cutoff: float) -> int:
    """The number of pairs :func:`molecular_pairs` finds in one structure of ``positions [n, 3]`` (a NumPy array on
    the host; decided in float64 by the same arithmetic), without making the list: for a caller that only sizes a
    bucket by it (the engine's dense step, which finds the pairs itself)."""
    pos = np.asarray(positions).astype(np.float64, copy=False)
    if pos.ndim != 2 or pos.shape[1] != 3:
        raise ValueError(f"molecular_pair_count: positions must be [N, 3], got {tuple(pos.shape)}")
    if not np.isfinite(pos).all():
        raise ValueError("molecular_pairs: positions contain NaN or inf")
    return int(np.count_nonzero(_within(pos, float(cutoff))))


def _pair_list(i: np.ndarray, j: np.ndarray, n: int, dtype: torch.dtype) -> NeighborList:
    """The receiver-sorted pairs ``(i, j)`` of ``n`` atoms as a :class:`NeighborList` with zero shifts."""
    row_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(i, minlength=n), out=row_ptr[1:])
    e = i.shape[0]
    return NeighborList(
        edge_index=torch.from_numpy(np.stack([i, j])),
        shifts=torch.zeros((e, 3), dtype=torch.int64),
        shift_vectors=torch.zeros((e, 3), dtype=dtype),
        row_ptr=torch.from_numpy(row_ptr),
        method="molecular",
    )
