"""``vesin`` backend: vesin-torch's cell list (CPU and CUDA), one structure per call, converted to our contract.

vesin (https://github.com/Luthaf/vesin) is an optional dependency: :func:`vesin_available` says whether
``vesin_torch`` (or the older ``vesin.torch``) imports; asking for ``method="vesin"`` without it raises a
``ValueError`` that says how to install it, and ``auto`` never picks it then.

vesin takes one system per call, so a batch costs one call per structure (plus a host sync for the structure
offsets); it wins for one large system and loses badly for many small ones. Each structure is passed in the
wrapped frame of :func:`._common.prepare` (float64 wrapped positions, the full-rank basis, per-axis
periodicity), and its pairs go through the same ``0 < |r| < cutoff`` float64 filter as our backends (vesin
may keep pairs at exactly the cutoff or coincident atoms) and the same :func:`._common.finish` (caller's frame,
(i, j, S) sort, CSR), so the output is identical to ``brute``/``cell_list``.
"""

from __future__ import annotations

import functools

import torch

from mlff_distiller.neighbors._common import Geometry, RawPairs, empty_pairs

__all__ = ["vesin_available", "vesin_pairs"]

# Relative band around the cutoff (and below which a distance counts as "near zero") inside which vesin's distance
# is re-checked with this package's own float64 formula: far wider than the rounding difference of two float64
# evaluations of the same distance (~1e-15 relative).
_BAND = 1e-9


@functools.cache
def _vesin_class():
    try:
        from vesin_torch import NeighborList
    except ImportError:
        try:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                from vesin.torch import NeighborList
        except ImportError:
            return None
    return NeighborList


def vesin_available() -> bool:
    """Whether vesin-torch imports (the ``vesin`` backend is usable)."""
    return _vesin_class() is not None


def vesin_pairs(geo: Geometry, max_candidates: int = 0) -> RawPairs:
    """All pairs ``(i, j, S')`` with ``0 < |wrapped_j - wrapped_i + S' @ basis| < cutoff`` from vesin-torch,
    one call per structure (``max_candidates`` is unused: vesin manages its own memory)."""
    del max_candidates
    cls = _vesin_class()
    if cls is None:
        raise ValueError(
            "neighbor_list: method='vesin' needs the optional dependency vesin-torch "
            "(pip install vesin-torch); use method='cell_list' or 'auto' instead"
        )
    device = geo.positions.device
    cutoff = float(geo.cutoff)
    calculator = cls(cutoff=cutoff, full_list=True)
    cutoff_sq = cutoff**2
    out_i, out_j, out_s = [], [], []
    for b, (lo, hi) in enumerate(zip(geo.ptr[:-1].tolist(), geo.ptr[1:].tolist(), strict=True)):
        if hi == lo:
            continue
        points = geo.wrapped[lo:hi]
        i, j, s, d = calculator.compute(points, geo.basis[b], geo.pbc[b], "ijSd", copy=True)
        i, j, s = i.long(), j.long(), s.long()
        # vesin's float64 distances decide every pair except those within rounding of the cutoff or of zero,
        # which get this package's own float64 test (the one every backend applies), so the output is the
        # same list as brute/cell_list without recomputing ~all vectors (that tripled the cost on CPU).
        keep = (d > 0) & (d < cutoff)
        near = ((d - cutoff).abs() <= _BAND * cutoff) | (d <= _BAND * cutoff)
        idx = near.nonzero().squeeze(1)
        if idx.numel():
            vec = points[j[idx]] - points[i[idx]] + s[idx].to(torch.float64) @ geo.basis[b]
            d2 = vec.square().sum(dim=1)
            keep[idx] = (d2 > 0) & (d2 < cutoff_sq)
        out_i.append(i[keep] + lo)
        out_j.append(j[keep] + lo)
        out_s.append(s[keep])
    if not out_i:
        return empty_pairs(device)
    return RawPairs(i=torch.cat(out_i), j=torch.cat(out_j), shifts=torch.cat(out_s), is_sorted=False)
