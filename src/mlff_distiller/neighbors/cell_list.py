"""Cell-list backend: O(N) per structure, batched over structures, torch ops only (CPU and CUDA).

1. Ghosts. In the wrapped frame every home atom has fractional coordinates in [0, 1) along periodic vectors.
   A neighbour image ``j + S'`` within ``cutoff`` of a home atom has fractional coordinate within
   ``cutoff / h_a`` of [0, 1) along each periodic vector ``a`` (``h_a``: the lattice-plane spacing), so each
   atom gets exactly the images that satisfy this, per axis an integer range ``[lo_a, hi_a]``. Cells narrower
   than the cutoff simply give wider ranges (many images), so tiny cells stay exact.
2. Bins. Home atoms and ghosts ("points") are binned in Cartesian space, in a per-structure bounding box cut
   into bins no smaller than the cutoff along each axis, keyed by one int64 ``offset_b + bin``. Points are
   sorted by key; only occupied bins cost anything, so a molecule with a huge extent is fine.
3. Search. For every home atom the 27 neighbouring bins are looked up with ``searchsorted``; the candidate
   points are expanded in chunks of bounded size (``repeat_interleave`` + offsets), their distances computed
   in float64 and filtered with ``0 < |r| < cutoff``.
"""

from __future__ import annotations

import itertools

import torch

from mlff_distiller.neighbors._common import IMAGE_SLACK, Geometry, RawPairs, empty_pairs, structure_bounds

__all__ = ["DEFAULT_MAX_CANDIDATES", "cell_list"]

DEFAULT_MAX_CANDIDATES = 1 << 22
# At most this many bins along one axis of one structure: bins stay >= cutoff (larger is still exact), and
# keys stay far from int64 overflow (2^36 bins per structure) even for batches of very sparse structures.
MAX_BINS_PER_AXIS = 1 << 12


def cell_list(geo: Geometry, max_candidates: int = DEFAULT_MAX_CANDIDATES) -> RawPairs:
    """All pairs ``(i, j, S')`` with ``0 < |wrapped_j - wrapped_i + S' @ cell| < cutoff`` (wrapped frame)."""
    device = geo.positions.device
    n_atoms = geo.num_atoms
    if n_atoms == 0:
        return empty_pairs(device)
    point_atom, point_shift, point_pos = _ghosts(geo)
    point_struct = geo.batch[point_atom]

    lo, size, n_bins, offsets = _bin_grid(geo, point_pos, point_struct)
    point_key = _bin_key(point_pos, point_struct, lo, size, n_bins, offsets)
    sorted_key, order = torch.sort(point_key)

    # Bins of the home atoms and their 27 neighbours; a neighbour outside the grid is empty.
    home_bin = _bin_index(geo.wrapped, geo.batch, lo, size, n_bins)
    steps = torch.tensor([-1, 0, 1], device=device)
    stencil = torch.cartesian_prod(steps, steps, steps)  # [27, 3]
    nbr_bin = home_bin[:, None, :] + stencil[None]  # [N, 27, 3]
    grid = n_bins[geo.batch][:, None, :]
    inside = ((nbr_bin >= 0) & (nbr_bin < grid)).all(dim=2)
    nbr_key = (
        offsets[geo.batch][:, None]
        + (nbr_bin[..., 0] * grid[..., 1] + nbr_bin[..., 1]) * grid[..., 2]
        + nbr_bin[..., 2]
    )
    nbr_key = torch.where(inside, nbr_key, torch.full_like(nbr_key, -1))
    first = torch.searchsorted(sorted_key, nbr_key)
    count = torch.searchsorted(sorted_key, nbr_key, right=True) - first
    count = torch.where(inside, count, torch.zeros_like(count))
    del nbr_bin, nbr_key, inside, sorted_key

    # Chunk boundaries over home atoms so each chunk expands to at most ~max_candidates candidates.
    per_atom = torch.cumsum(count.sum(dim=1), 0)
    total = int(per_atom[-1])
    if total == 0:
        return empty_pairs(device)
    marks = torch.arange(max_candidates, max(total, max_candidates), max_candidates, device=device)
    cuts = sorted({0, *torch.searchsorted(per_atom, marks, right=True).tolist(), n_atoms})

    # Component-major [3, *] positions and index_select: several times faster on CPU than gathering [K, 3]
    # rows with advanced indexing and reducing their short last axis.
    point_pos_t = point_pos.T.contiguous()
    home_t = geo.wrapped.T.contiguous()
    cutoff_sq = geo.cutoff**2
    out_i, out_j, out_s = [], [], []
    for a0, a1 in itertools.pairwise(cuts):
        c = count[a0:a1].reshape(-1)
        n_cand = int(c.sum())
        if n_cand == 0:
            continue
        # Candidate k of (atom, bin) slot s is sorted point first[s] + (k - exclusive_cumsum(c)[s]).
        slot = torch.repeat_interleave(torch.arange(c.shape[0], device=device), c, output_size=n_cand)
        jump = first[a0:a1].reshape(-1) - (torch.cumsum(c, 0) - c)
        point = order.index_select(0, jump.index_select(0, slot) + torch.arange(n_cand, device=device))
        i = torch.div(slot, 27, rounding_mode="floor") + a0
        del slot
        dist_sq = (point_pos_t.index_select(1, point) - home_t.index_select(1, i)).square().sum(dim=0)
        # 0 < |r| drops each home atom's own copy (exactly zero) and coincident atoms, as in brute.
        keep = torch.nonzero((dist_sq > 0) & (dist_sq < cutoff_sq)).squeeze(1)
        del dist_sq
        point = point.index_select(0, keep)
        out_i.append(i.index_select(0, keep))
        out_j.append(point_atom.index_select(0, point))
        out_s.append(point_shift.index_select(0, point))
    if not out_i:
        return empty_pairs(device)
    return RawPairs(i=torch.cat(out_i), j=torch.cat(out_j), shifts=torch.cat(out_s), is_sorted=False)


def _ghosts(geo: Geometry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every atom image within ``cutoff`` (perpendicular) of its home cell, the home copies (S' = 0) included.

    Returns ``atom [P]`` int64, ``shift [P, 3]`` int64 (wrapped frame) and ``position [P, 3]`` float64, Å.
    """
    device = geo.positions.device
    reach = (geo.cutoff / geo.heights * (1.0 + IMAGE_SLACK))[geo.batch]  # [N, 3] in fractional units
    periodic = geo.pbc[geo.batch]
    # Image s along a is kept iff frac + s lies in [-reach, 1 + reach] (closed: a boundary extra is harmless).
    lo = torch.ceil(-reach - geo.frac)
    hi = torch.floor(1.0 + reach - geo.frac)
    lo = torch.where(periodic, lo, torch.zeros_like(lo)).long()
    hi = torch.where(periodic, hi, torch.zeros_like(hi)).long()
    width = hi - lo + 1
    per_atom = width.prod(dim=1)
    total = int(per_atom.sum())
    atom = torch.repeat_interleave(torch.arange(geo.num_atoms, device=device), per_atom, output_size=total)
    local = torch.arange(total, device=device) - (torch.cumsum(per_atom, 0) - per_atom)[atom]
    w = width[atom]
    d2 = local % w[:, 2]
    rest = local // w[:, 2]
    shift = torch.stack([rest // w[:, 1], rest % w[:, 1], d2], dim=1) + lo[atom]
    del local, rest, d2, w
    position = geo.wrapped[atom] + torch.einsum("pa,pab->pb", shift.to(torch.float64), geo.basis[geo.batch[atom]])
    return atom, shift, position


def _bin_grid(geo: Geometry, pos: torch.Tensor, struct: torch.Tensor):
    """Per-structure bounding box ``lo [B,3]`` (Å), bin edge ``size [B,3]`` (Å, >= cutoff), ``n_bins [B,3]``
    and key ``offsets [B]`` of each structure's first bin."""
    lo, hi = structure_bounds(pos, struct, geo.counts)
    extent = hi - lo
    # Bins strictly wider than the cutoff (by the slack) so rounding in the bin index can never put a point
    # within the cutoff two bins away.
    edge = geo.cutoff * (1.0 + IMAGE_SLACK)
    n_bins = torch.floor(extent / edge).clamp(1, MAX_BINS_PER_AXIS).long()
    size = torch.maximum(extent / n_bins, torch.full_like(extent, edge))
    per = n_bins.prod(dim=1)
    offsets = torch.cumsum(per, 0) - per
    return lo, size, n_bins, offsets


def _bin_index(pos, struct, lo, size, n_bins) -> torch.Tensor:
    cell = torch.floor((pos - lo[struct]) / size[struct]).long()
    return torch.minimum(cell.clamp_min(0), n_bins[struct] - 1)


def _bin_key(pos, struct, lo, size, n_bins, offsets) -> torch.Tensor:
    b = _bin_index(pos, struct, lo, size, n_bins)
    grid = n_bins[struct]
    return offsets[struct] + (b[:, 0] * grid[:, 1] + b[:, 1]) * grid[:, 2] + b[:, 2]
