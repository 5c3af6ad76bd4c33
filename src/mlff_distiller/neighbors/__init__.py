"""Neighbour lists: one function, two backends, a written contract.

Contract::

    from mlff_distiller.neighbors import neighbor_list, neighbor_list_batch, NeighborList, BACKENDS
    nl = neighbor_list(positions, cell, pbc, batch, ptr, cutoff, method="auto")
    nl = neighbor_list_batch(atoms_batch, cutoff, method="auto")
    nl.edge_index     # [2, E] int64: row 0 centre/receiver i, row 1 neighbour j (global indices in the batch)
    nl.shifts         # [E, 3] int64 integer image shifts S
    nl.shift_vectors  # [E, 3] S @ cell[batch[i]] in Å, dtype/device of positions
    nl.row_ptr        # [N + 1] int64 CSR offsets: edges of receiver i are row_ptr[i]:row_ptr[i + 1]
    nl.method         # the backend that ran ("brute" or "cell_list")

Semantics are those of ``ase.neighborlist.neighbor_list("ijS", atoms, cutoff)``: the edge vector is
``positions[j] - positions[i] + S @ cell`` (Å) with the positions *as given* (they may lie outside the cell;
they are wrapped internally and ``S`` is reported relative to the original positions, exactly as ASE does),
and a pair is kept iff ``0 < |vector| < cutoff`` (strict). So ``i == j`` with ``S != 0`` is a valid pair
and the self pair never is; unlike ASE, two distinct atoms at the very same position are not paired (a
zero-length edge has no direction). The list is full (both i->j and j->i) and sorted by (i, j, S)
lexicographically. Both backends return identical tensors.

Inputs: ``positions [N, 3]`` float32/float64 (Å); ``cell [B, 3, 3]`` lattice vectors as rows (Å; all zero for
a molecule; the non-periodic vectors of a slab or wire may be zero); ``pbc [B, 3]`` bool; ``batch [N]`` int64
structure of each atom (atoms of a structure contiguous, as in :class:`~mlff_distiller.batch.AtomsBatch`);
``ptr [B + 1]`` int64 offsets. Internally the non-periodic vectors are replaced by unit vectors orthogonal to
the periodic ones (for fractional coordinates only; nothing is ever wrapped or imaged along them), and all
geometry runs in float64 so the pair set matches ASE exactly even for float32 input. ``ValueError`` for a
non-positive cutoff, mismatched shapes, mixed devices, a degenerate periodic cell or an unknown method.

Output lives on the input device; the only host syncs are allocation sizes and input validation. The call
runs under ``torch.no_grad``: nothing is differentiable; to differentiate through a (strained) cell,
recompute ``shifts @ cell`` yourself.

Backends (``BACKENDS`` maps name -> supported devices):

* ``brute``: O(sum_b n_b^2 M_b) with ``M_b = prod_a (2 ceil(cutoff / h_a) + 1)`` images (``h_a`` the
  lattice-plane spacing of periodic vector ``a``), all structures in one vectorised pass, chunked.
* ``cell_list``: O(N) per structure: ghost images near periodic faces, Cartesian bins >= cutoff, a 27-bin
  search; batched over structures.
* ``auto``: ``brute`` when every structure satisfies ``n_b * M_b <= AUTO_BRUTE_MAX[device type]`` (each
  atom meets at most that many candidates, so brute stays O(N): batches of molecules and small cells), else
  ``cell_list``. The limit is 128 on CPU (measured crossover, 1-2 threads: both cost ~100 ns per candidate,
  and a cell-list atom meets 27 bins' worth, a few hundred, plus ghost/sort overhead) and 1024 on CUDA (an
  estimate: brute needs fewer kernel launches and host syncs, which dominate small GPU calls; not measured).
"""

from __future__ import annotations

import torch

from mlff_distiller.neighbors._common import Geometry, NeighborList, finish, prepare
from mlff_distiller.neighbors.brute import DEFAULT_MAX_CANDIDATES, brute_force
from mlff_distiller.neighbors.cell_list import cell_list

__all__ = [
    "AUTO_BRUTE_MAX",
    "BACKENDS",
    "NeighborList",
    "choose_method",
    "neighbor_list",
    "neighbor_list_batch",
]

BACKENDS: dict[str, tuple[str, ...]] = {"brute": ("cpu", "cuda"), "cell_list": ("cpu", "cuda")}

# Candidates per atom (n_b * M_b) up to which ``auto`` takes ``brute``, per device type. A cell-list atom
# checks 27 bins of >= cutoff^3 each (hundreds of candidates) plus sort/ghost overhead; see the docstring.
AUTO_BRUTE_MAX: dict[str, int] = {"cpu": 128, "cuda": 1024}

_RUNNERS = {"brute": brute_force, "cell_list": cell_list}


@torch.no_grad()
def neighbor_list(
    positions: torch.Tensor,
    cell: torch.Tensor,
    pbc: torch.Tensor,
    batch: torch.Tensor,
    ptr: torch.Tensor,
    cutoff: float,
    method: str = "auto",
    *,
    max_candidates: int = DEFAULT_MAX_CANDIDATES,
) -> NeighborList:
    """Full neighbour list of a batch of structures within ``cutoff`` (Å); see the module docstring.

    Args:
        positions: ``[N, 3]`` Cartesian positions, Å (float32 or float64).
        cell: ``[B, 3, 3]`` lattice vectors as rows, Å.
        pbc: ``[B, 3]`` bool periodicity per lattice vector.
        batch: ``[N]`` int64 structure index of each atom.
        ptr: ``[B + 1]`` int64 atom offsets of the structures.
        cutoff: radius, Å (> 0); pairs with ``0 < |r| < cutoff`` are kept.
        method: ``"auto"``, ``"brute"`` or ``"cell_list"``.
        max_candidates: candidate pairs examined per chunk, bounds transient memory (~120 bytes each).

    Returns:
        :class:`NeighborList` on the device of ``positions``.
    """
    if method != "auto" and method not in BACKENDS:
        raise ValueError(
            f"neighbor_list: unknown method {method!r}; choose 'auto' or one of {sorted(BACKENDS)}"
        )
    if int(max_candidates) < 1:
        raise ValueError(f"neighbor_list: max_candidates must be >= 1, got {max_candidates}")
    geo = prepare(positions, cell, pbc, batch, ptr, cutoff)
    if method == "auto":
        method = choose_method(geo)
    if positions.device.type not in BACKENDS[method]:
        raise ValueError(
            f"neighbor_list: backend {method!r} supports {BACKENDS[method]}, not {positions.device}"
        )
    return finish(geo, _RUNNERS[method](geo, int(max_candidates)), method)


def neighbor_list_batch(atoms_batch, cutoff: float, method: str = "auto", **kwargs) -> NeighborList:
    """:func:`neighbor_list` of an :class:`~mlff_distiller.batch.AtomsBatch` (cutoff in Å)."""
    b = atoms_batch
    return neighbor_list(b.positions, b.cell, b.pbc, b.batch, b.ptr, cutoff, method, **kwargs)


def choose_method(geo: Geometry) -> str:
    """The ``auto`` rule: ``brute`` iff ``max_b n_b * prod_a (2 n_a + 1) <= AUTO_BRUTE_MAX[device type]``."""
    limit = AUTO_BRUTE_MAX.get(geo.positions.device.type, AUTO_BRUTE_MAX["cpu"])
    per_atom = geo.counts * (2 * geo.n_images + 1).prod(dim=1)
    return "brute" if int(per_atom.max()) <= limit else "cell_list"
