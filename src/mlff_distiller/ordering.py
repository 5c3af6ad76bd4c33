"""Spatial atom order: a permutation that puts atoms close in space close in memory.

The message-passing kernels gather the features of every receiver's neighbours. When the atoms of a large box are
numbered in random order (molecules on shuffled lattice sites, a structure generator, a merged trajectory), those
rows lie all over the feature arrays; numbered along a space-filling curve they are few and nearby. Measured on an
H100 (benchmarks/results/probe_locality_h100/, probe_edge_order_h100/): the 24,000-atom water energy + forces step
1.12x faster Morton-sorted, the edge backward 1.21x; nothing at 3,000 atoms, whose features fit in L2 either way.
:class:`~mlff_distiller.engine.ForceEngine` sorts large structures before building their neighbour list and
returns per-atom results in the caller's order.
"""

from __future__ import annotations

import torch

__all__ = ["spatial_order"]

_BITS = 10  # per axis: 1,024 bins of ``bin_size`` each (beyond that the bins clamp; the order stays valid)


def _spread_bits(q: torch.Tensor) -> torch.Tensor:
    """Insert two zero bits after each of the low 10 bits of ``q`` (int64): bit k moves to bit 3k."""
    q = q & 0x3FF
    q = (q | (q << 16)) & 0x030000FF
    q = (q | (q << 8)) & 0x0300F00F
    q = (q | (q << 4)) & 0x030C30C3
    q = (q | (q << 2)) & 0x09249249
    return q


def spatial_order(positions: torch.Tensor, batch: torch.Tensor, num_structures: int, bin_size: float) -> torch.Tensor:
    """Permutation ``perm`` (new index -> old index) sorting each structure's atoms along a Morton (Z-order) curve
    of their positions binned at ``bin_size`` Å from the structure's lowest corner. Structures keep their order and
    stay contiguous (``batch[perm]`` equals ``batch`` when ``batch`` is sorted, as in an AtomsBatch); atoms of one
    bin keep their relative order (a stable sort). Device work only, no host sync.

    Args:
        positions: ``[N, 3]`` Cartesian positions.
        batch: ``[N]`` int64 structure of each atom (non-decreasing).
        num_structures: B.
        bin_size: edge of the cubic bins, Å (> 0); about half the cutoff keeps one receiver's neighbours within a
            few bins.
    """
    if not bin_size > 0:
        raise ValueError(f"bin_size must be positive, got {bin_size}")
    if positions.dim() != 2 or positions.shape[1] != 3 or batch.shape != positions.shape[:1]:
        raise ValueError(f"positions must be [N, 3] and batch [N], got {tuple(positions.shape)}, {tuple(batch.shape)}")
    n = positions.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=positions.device)
    # Few launches: on a GPU each op here is a launch of host time, and this runs per call for large eager batches
    # (the spread bits as 13 ops an axis made ~55 launches, 0.66-0.78 ms on an H200 host at 12,000-100,000 atoms;
    # benchmarks/results/stop64_gpu/h/probe_spatial_order.md). One structure's lowest corner is a plain reduction.
    pos = positions.detach().to(torch.float64)
    if num_structures == 1:
        low = pos.amin(dim=0, keepdim=True)
    else:
        low = torch.full((num_structures, 3), float("inf"), dtype=pos.dtype, device=pos.device)
        low = low.scatter_reduce(0, batch[:, None].expand(-1, 3), pos, reduce="amin", include_self=True)[batch]
    q = torch.floor((pos - low) / bin_size).to(torch.int64).clamp_(0, (1 << _BITS) - 1)
    table, axes = _spread_table(pos.device)
    key = table[q, axes].sum(dim=1)  # axis a's bits at 3k + a: disjoint, so the sum is their OR
    if num_structures > 1:
        key = (batch.to(torch.int64) << (3 * _BITS)) | key
    return torch.argsort(key, stable=True)


_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _spread_table(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T [1024, 3], [0, 1, 2])`` on ``device``: ``T[q, a] = _spread_bits(q) << a``, made once per device."""
    hit = _TABLES.get(device)
    if hit is None:
        axes = torch.arange(3, dtype=torch.int64)
        table = _spread_bits(torch.arange(1 << _BITS, dtype=torch.int64))[:, None] << axes
        hit = _TABLES[device] = (table.to(device), axes.to(device))
    return hit
