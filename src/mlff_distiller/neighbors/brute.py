"""Brute-force backend: every (i, j, image) triple of every structure, vectorised over the whole batch.

Structure ``b`` with ``n_b`` atoms and ``n_a`` images on each side of periodic vector ``a`` has
``n_b^2 * M_b`` candidates, ``M_b = prod_a (2 n_a + 1)``. All candidates of the batch are numbered by one
flat index, laid out as (structure, i, j, image) with the image index most minor; a chunk of flat indices is
decoded back into triples with integer arithmetic (``searchsorted`` over the per-structure candidate offsets,
then division and remainder). Chunks are taken in order, so the output is already sorted by (i, j, S) and no
sort is needed. Cost is O(sum_b n_b^2 M_b): meant for small structures, many of them at once.
"""

from __future__ import annotations

import torch

from mlff_distiller.neighbors._common import Geometry, RawPairs, empty_pairs

__all__ = ["DEFAULT_MAX_CANDIDATES", "brute_force", "image_table"]

# Candidates decoded at once: about 120 bytes each of transient index and float64 tensors, so ~0.5 GB.
DEFAULT_MAX_CANDIDATES = 1 << 22


def image_table(n_images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All image shifts of every structure, lexicographically ordered.

    Args:
        n_images: ``[B, 3]`` int64 images on each side along each lattice vector.

    Returns:
        ``shifts [sum_b M_b, 3]`` int64 and ``offsets [B + 1]`` int64 (structure ``b`` owns rows
        ``offsets[b]:offsets[b+1]``).
    """
    width = 2 * n_images + 1
    per = width.prod(dim=1)
    offsets = torch.zeros(per.shape[0] + 1, dtype=torch.long, device=per.device)
    offsets[1:] = torch.cumsum(per, 0)
    total = int(offsets[-1])
    owner = torch.repeat_interleave(torch.arange(per.shape[0], device=per.device), per, output_size=total)
    local = torch.arange(total, device=per.device) - offsets[owner]
    return _decode(local, width[owner]) - n_images[owner], offsets


def brute_force(geo: Geometry, max_candidates: int = DEFAULT_MAX_CANDIDATES) -> RawPairs:
    """All pairs ``(i, j, S')`` with ``0 < |wrapped_j - wrapped_i + S' @ cell| < cutoff`` (wrapped frame)."""
    device = geo.positions.device
    counts, n_img = geo.counts, geo.n_images
    shifts, img_offsets = image_table(n_img)
    # Cartesian image vectors (Å) once per structure, so a candidate gathers one row instead of a 3x3 cell.
    owner = torch.repeat_interleave(
        torch.arange(counts.shape[0], device=device),
        img_offsets[1:] - img_offsets[:-1],
        output_size=len(shifts),
    )
    image_vectors = torch.einsum("ma,mab->mb", shifts.to(torch.float64), geo.basis[owner])

    n_per_img = img_offsets[1:] - img_offsets[:-1]
    per_structure = counts * counts * n_per_img
    ends = torch.cumsum(per_structure, 0)
    starts = ends - per_structure
    total = int(ends[-1]) if ends.numel() else 0
    if total == 0:
        return empty_pairs(device)

    # Component-major [3, *] layouts: index_select along a contiguous axis and a reduction over the leading
    # axis are several times faster on CPU than gathering [K, 3] rows and summing their short last axis.
    wrapped_t = geo.wrapped.T.contiguous()
    image_vectors_t = image_vectors.T.contiguous()
    cutoff_sq = geo.cutoff**2
    out_i, out_j, out_s = [], [], []
    for first in range(0, total, max_candidates):
        flat = torch.arange(first, min(first + max_candidates, total), device=device)
        b = torch.searchsorted(ends, flat, right=True)
        local = flat - starts[b]
        del flat
        m = n_per_img[b]
        pair = local // m
        image = local - pair * m + img_offsets[b]
        n = counts[b]
        atom0 = geo.ptr[b]
        i = pair // n
        j = pair - i * n + atom0
        i += atom0
        del local, pair, m, n, atom0, b
        vec = wrapped_t.index_select(1, j) - wrapped_t.index_select(1, i) + image_vectors_t.index_select(1, image)
        dist_sq = vec.square().sum(dim=0)
        # 0 < |r| drops the self pair (i == j, S' == 0), which is exactly zero, and coincident atoms.
        keep = (dist_sq > 0) & (dist_sq < cutoff_sq)
        del vec, dist_sq
        out_i.append(i[keep])
        out_j.append(j[keep])
        out_s.append(shifts[image[keep]])
    return RawPairs(i=torch.cat(out_i), j=torch.cat(out_j), shifts=torch.cat(out_s), is_sorted=True)


def _decode(index: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """Mixed-radix digits ``[K, 3]`` of ``index [K]`` with radices ``width [K, 3]``, last digit most minor."""
    d2 = index % width[:, 2]
    rest = index // width[:, 2]
    return torch.stack([rest // width[:, 1], rest % width[:, 1], d2], dim=1)
