"""Host-side helpers of the Triton cell list (:mod:`.cell_list_triton`): bin grids and tables, the scratch
capacity rule, buffer carving, the row-sort tile ladder and the long-row fallback's key decoding. No kernels."""

from __future__ import annotations

import math

import numpy as np
import torch

from mlff_distiller.neighbors._common import (
    IMAGE_SLACK,
    Geometry,
    HostCells,
    NeighborList,
    RawPairs,
    structure_bounds,
)

# Bits per shift component in a pair key: wrapped-frame shifts must satisfy |S'_a| < 2^(bits-1).
SHIFT_BITS = 10
SHIFT_BIAS = 1 << (SHIFT_BITS - 1)
# Longest row sorted in registers by _rows_kernel; longer rows (hubs) fall back to the torch sort.
MAX_ROW_SORT = 2048
# One-pass candidate search (periodic batches): longest scratch row, and scratch keys in all (8 bytes each).
SCRATCH_MAX_ROW = 1024
SCRATCH_MAX_KEYS = 1 << 25
# Speculative row sort (periodic batches on CUDA): its outputs hold n * cap pairs, 8 words each (edge_index 2,
# shifts 3, shift_vectors 3), about 2.5x the pairs of a liquid (cap is a power of two >= 2x the mean row). Up
# to this many pairs (512 MiB in float64) the memory buys the overlap; beyond it the row sort waits for the sync.
SPECULATE_MAX_PAIRS = 1 << 23
# Bins per structure at most this many per atom (and at least this many): bounds the dense bin table.
BINS_PER_ATOM = 8
MAX_BINS_PER_AXIS = 1 << 12


def bin_grid(extent: torch.Tensor, heights: torch.Tensor, pbc: torch.Tensor, counts: torch.Tensor, edge: float):
    """Bins per axis ``nb`` (float64, whole numbers) and stencil half-widths ``reach`` (int64), ``[B, 3]``, for
    structures spanning ``extent`` (Å along non-periodic axes; the plane spacing along periodic ones)."""
    nb = torch.floor(extent / edge).clamp(1, MAX_BINS_PER_AXIS)
    # Cap bins per structure (coarser bins are still exact) so the table size is known without a sync.
    cap = BINS_PER_ATOM * counts.clamp_min(1).to(torch.float64)
    factor = (cap / nb.prod(dim=1)).clamp(max=1.0).pow(1.0 / 3.0)
    nb = torch.floor(nb * factor[:, None]).clamp_min(1)
    reach = torch.where(pbc, torch.ceil(edge * nb / heights), torch.ones_like(nb)).long()
    return nb, reach


def bin_atoms(geo: Geometry):
    """Per-structure bin grid and per-atom bin keys (:mod:`.cell_list_triton`, step 1); torch ops, no sync.

    Returns the int64 table ``itab [B, 10]`` of ``_pairs_kernel``, ``bins [N,3]`` int64, ``key [N]`` int64 and
    the host-side bound on the total number of bins.
    """
    n_struct = geo.cell.shape[0]
    edge = geo.cutoff * (1.0 + IMAGE_SLACK)
    pbc, frac, batch = geo.pbc, geo.frac, geo.batch
    # Extent of the atoms along the non-periodic (orthonormal, Å) directions; periodic ones span [0, 1).
    lo, hi = structure_bounds(frac, batch, geo.counts)
    extent = torch.where(pbc, geo.heights, hi - lo)
    nb, reach = bin_grid(extent, geo.heights, pbc, geo.counts, edge)
    width = torch.maximum(extent / nb, torch.full_like(extent, edge))  # Å along non-periodic axes
    origin = torch.where(pbc, torch.zeros_like(lo), lo)
    scale = torch.where(pbc, nb, 1.0 / width)
    nb = nb.long()
    bins = torch.floor((frac - origin[batch]) * scale[batch]).long()
    bins = torch.minimum(bins.clamp_min(0), nb[batch] - 1)
    per = nb.prod(dim=1)
    offset = torch.cumsum(per, 0) - per
    grid = nb[batch]
    key = offset[batch] + (bins[:, 0] * grid[:, 1] + bins[:, 1]) * grid[:, 2] + bins[:, 2]
    bound = BINS_PER_ATOM * (geo.num_atoms + n_struct)
    itab = torch.cat([nb, reach, pbc.long(), offset[:, None]], dim=1).contiguous()
    return itab, bins, key, bound


def periodic_tables(host: HostCells, n: int, device: torch.device):
    """``(itab, ftab, n_bins, cap)`` of :func:`.cell_list_triton.cell_list_triton_periodic` on ``device``, or
    ``None`` when some shift would overflow the pair keys."""
    edge = host.cutoff * (1.0 + IMAGE_SLACK)
    # bin_grid's rule in NumPy (host arrays: torch's CPU ops cost ~10x more per call at B = 1,024).
    heights = host.heights.numpy()
    nb = np.clip(np.floor(heights / edge), 1, MAX_BINS_PER_AXIS)
    factor = np.minimum(BINS_PER_ATOM * np.maximum(host.counts.numpy(), 1) / nb.prod(axis=1), 1.0) ** (1.0 / 3.0)
    nb = np.maximum(np.floor(nb * factor[:, None]), 1)
    reach = np.ceil(edge * nb / heights).astype(np.int64)
    nb = nb.astype(np.int64)
    if int((reach // nb + 1).max()) >= SHIFT_BIAS:
        return None
    per = nb.prod(axis=1)
    n_struct = nb.shape[0]
    itab = np.concatenate([nb, reach, np.ones_like(nb), (np.cumsum(per) - per)[:, None]], axis=1)
    ftab = torch.cat([host.basis.reshape(n_struct, 9), host.inv.reshape(n_struct, 9)], dim=1)
    return torch.from_numpy(itab).to(device), ftab.to(device), int(per.sum()), scratch_cap(host, n)


def scratch_cap(host: HostCells, n_atoms: int) -> int:
    """Scratch-row capacity for the one-pass candidate search of a periodic batch, or 0 (two passes): twice the
    pairs per atom that a uniform density predicts (plus 16), as a power of two, when that stays within
    SCRATCH_MAX_ROW keys per row and SCRATCH_MAX_KEYS in all. Clusters in vacuum exceed it; their rows are
    then redone by the fill pass (correct, one pass more)."""
    density = host.counts.numpy() / np.maximum(host.volume.numpy(), 1e-300)
    expected = float(density.max()) * 4.0 / 3.0 * np.pi * host.cutoff**3
    cap = 1 << max(0, int(np.ceil(2.0 * expected + 16.0)) - 1).bit_length()
    if cap > SCRATCH_MAX_ROW or n_atoms * cap > SCRATCH_MAX_KEYS:
        return 0
    return cap


def carve(device: torch.device, **parts: tuple[tuple[int, ...], torch.dtype]) -> dict[str, torch.Tensor]:
    """Contiguous views ``name -> [shape] dtype`` into one new allocation (one allocator call and one view op
    per part, instead of a ``torch.empty`` each); every view starts on a 16-byte boundary, as Triton's pointer
    specialisation prefers. A view keeps the whole allocation alive."""
    offsets, at = [], 0
    for shape, dtype in parts.values():
        offsets.append(at)
        at += -(-math.prod(shape) * dtype.itemsize // 16) * 16
    buf = torch.empty(max(at, 16), dtype=torch.uint8, device=device)
    typed: dict[torch.dtype, torch.Tensor] = {}
    views = {}
    for (name, (shape, dtype)), off in zip(parts.items(), offsets, strict=True):
        if dtype not in typed:
            typed[dtype] = buf.view(dtype)
        strides = (shape[1], 1) if len(shape) == 2 else (1,)
        views[name] = typed[dtype].as_strided(shape, strides, off // dtype.itemsize)
    return views


def row_block(longest: int) -> int:
    """Register tile of ``_rows_kernel`` for rows of up to ``longest`` pairs: a coarse ladder (64, 128, 256, 1024,
    2048), so that the longest row of an MD list drifting across a power of two does not compile a new kernel
    variant mid-run (each is a JIT compile of ~0.3 s). 128 is on it for liquids at 5 Å (~50 pairs per atom,
    longest rows 70-100): their rows sorted in 256-wide tiles took 165 µs for a 24,000-atom water box
    (benchmarks/results/profile_neighbors_h100.txt)."""
    for block in (64, 128, 256, 1024):
        if longest <= block:
            return block
    return max(MAX_ROW_SORT, 1 << (int(longest) - 1).bit_length())


def decode_keys(keys: torch.Tensor, row_ptr: torch.Tensor, count: torch.Tensor) -> RawPairs:
    """Unsorted wrapped-frame pairs from the pair keys (fallback for rows too long to sort in registers)."""
    n = count.shape[0]
    i = torch.repeat_interleave(torch.arange(n, device=keys.device), count.long(), output_size=keys.shape[0])
    j = keys >> (3 * SHIFT_BITS)
    mask = (1 << SHIFT_BITS) - 1
    s = torch.stack([(keys >> (2 * SHIFT_BITS)) & mask, (keys >> SHIFT_BITS) & mask, keys & mask], dim=1)
    return RawPairs(i=i, j=j, shifts=s - SHIFT_BIAS, is_sorted=False)


def empty_list(n: int, device: torch.device, dtype: torch.dtype) -> NeighborList:
    z = torch.zeros(0, dtype=torch.int64, device=device)
    return NeighborList(
        edge_index=z.reshape(2, 0),
        shifts=z.reshape(0, 3),
        shift_vectors=torch.zeros(0, 3, dtype=dtype, device=device),
        row_ptr=torch.zeros(n + 1, dtype=torch.int64, device=device),
        method="cell_list",
    )
