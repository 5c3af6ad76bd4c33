"""Neighbour lists: one function, two backends, a written contract.

Contract::

    from mlff_distiller.neighbors import neighbor_list, neighbor_list_batch, NeighborList, BACKENDS
    nl = neighbor_list(positions, cell, pbc, batch, ptr, cutoff, method="auto")
    nl = neighbor_list_batch(atoms_batch, cutoff, method="auto")
    nl.edge_index     # [2, E] int64: row 0 centre/receiver i, row 1 neighbour j (global indices in the batch)
    nl.shifts         # [E, 3] int64 integer image shifts S
    nl.shift_vectors  # [E, 3] S @ cell[batch[i]] in Å, dtype/device of positions
    nl.row_ptr        # [N + 1] int64 CSR offsets: edges of receiver i are row_ptr[i]:row_ptr[i + 1]
    nl.method         # the backend that ran ("brute", "cell_list" or "vesin")

Semantics are those of ``ase.neighborlist.neighbor_list("ijS", atoms, cutoff)``: the edge vector is
``positions[j] - positions[i] + S @ cell`` (Å) with the positions *as given* (they may lie outside the cell;
they are wrapped internally and ``S`` is reported relative to the original positions, exactly as ASE does),
and a pair is kept iff ``0 < |vector| < cutoff`` (strict). So ``i == j`` with ``S != 0`` is a valid pair
and the self pair never is; unlike ASE, two distinct atoms at the very same position are not paired (a
zero-length edge has no direction). The list is full (both i->j and j->i) and sorted by (i, j, S)
lexicographically. All backends return the same pairs in the same order (``shift_vectors`` equal to rounding:
the Triton cell list computes ``S @ cell`` in its own kernel).

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

Backends (``BACKENDS`` maps name -> supported devices; :func:`available_backends` lists the usable ones):

* ``brute``: O(sum_b n_b^2 M_b) with ``M_b = prod_a (2 ceil(cutoff / h_a) + 1)`` images (``h_a`` the
  lattice-plane spacing of periodic vector ``a``), all structures in one vectorised pass, chunked.
* ``cell_list``: O(N), batched over structures, two implementations chosen by ``cell_list_impl`` (argument,
  else ``$MLFF_DISTILLER_CELL_LIST``, else ``auto``): ``triton`` (:mod:`.cell_list_triton`: fused count/fill
  kernels over fractional bins, receiver-sorted CSR written by a row-sort kernel, one host sync; fully
  periodic batches replay their kernels as a CUDA graph from the second call on the same cells and atom count,
  ``MLFF_DISTILLER_NL_GRAPHS=0`` switches that off; the default on CUDA) and ``torch`` (:mod:`.cell_list`:
  ghost images, Cartesian bins, torch ops; the default on CPU).
  ``triton`` on CPU tensors works only under ``TRITON_INTERPRET=1`` (tests). ``max_candidates`` bounds the
  torch implementation's chunks; the Triton one never materialises candidates.
* ``vesin``: vesin-torch (optional dependency; CPU and CUDA), one call per structure, converted to this
  contract (:mod:`.vesin_backend`). Asking for it without vesin-torch installed is a ``ValueError``.
* ``molecular`` (not selectable by name): :mod:`.molecular`, all pairs per structure in NumPy; ``auto`` takes it
  first for CPU tensors of structures with no periodic direction (at most ``MOLECULAR_MAX_PAIRS`` candidate
  pairs, and no structure of more than ``MOLECULAR_MAX_STRUCTURE_PAIRS``, 724 atoms, where the cell list wins on
  the CPU): same pairs, same order, a fraction of the fixed cost. For such structures on a GPU, the same
  enumeration in torch on that device (``molecular_pairs_device``; three small host reads instead of the general
  backends' ~8).
* ``auto``: ``brute`` when every structure satisfies ``n_b * M_b <= AUTO_BRUTE_MAX[device type]`` (each
  atom meets at most that many candidates, so brute stays O(N): batches of molecules and small cells); else
  ``vesin`` for a single structure of at least ``AUTO_VESIN_MIN_ATOMS[device type]`` atoms when vesin-torch
  is installed (where one large system per call is its strength); else ``cell_list``. ``AUTO_BRUTE_MAX`` is
  128 on CPU (measured crossover, 1-2 threads) and 1024 on CUDA (estimate: brute needs fewer launches);
  ``AUTO_VESIN_MIN_ATOMS`` comes from bench runs on CPU (on CUDA auto never picks vesin: see its comment).

Verlet skin: :class:`VerletNeighborList` (:mod:`.verlet`) builds with ``cutoff + skin`` and reuses the list
until some atom has moved more than ``skin / 2`` (or the cell, pbc, atoms or species changed).
"""

from __future__ import annotations

import os

import torch

from mlff_distiller.neighbors._common import (
    Geometry,
    NeighborList,
    RawPairs,
    cached_host_cells,
    finish,
    host_cells,
    prepare,
)
from mlff_distiller.neighbors.brute import DEFAULT_MAX_CANDIDATES, brute_force
from mlff_distiller.neighbors.cell_list import cell_list
from mlff_distiller.neighbors.cell_list_triton import (
    HAS_TRITON,
    cell_list_triton,
    cell_list_triton_periodic,
    triton_runnable,
)
from mlff_distiller.neighbors.molecular import (
    MOLECULAR_MAX_PAIRS,
    molecular_applicable,
    molecular_device_applicable,
    molecular_pairs,
    molecular_pairs_device,
)
from mlff_distiller.neighbors.verlet import VerletNeighborList
from mlff_distiller.neighbors.vesin_backend import vesin_available, vesin_pairs

__all__ = [
    "AUTO_BRUTE_MAX",
    "AUTO_VESIN_MIN_ATOMS",
    "BACKENDS",
    "CELL_LIST_IMPLS",
    "NeighborList",
    "VerletNeighborList",
    "available_backends",
    "choose_method",
    "neighbor_list",
    "neighbor_list_batch",
    "resolve_cell_list_impl",
]

BACKENDS: dict[str, tuple[str, ...]] = {
    "brute": ("cpu", "cuda"),
    "cell_list": ("cpu", "cuda"),
    "vesin": ("cpu", "cuda"),
}
CELL_LIST_IMPLS = ("auto", "triton", "torch")
_CELL_LIST_ENV = "MLFF_DISTILLER_CELL_LIST"

# Candidates per atom (n_b * M_b) up to which ``auto`` takes ``brute``, per device type. A cell-list atom
# checks 27 bins of >= cutoff^3 each (hundreds of candidates) plus sort/ghost overhead; see the docstring.
AUTO_BRUTE_MAX: dict[str, int] = {"cpu": 128, "cuda": 1024}
# Atoms of a single structure from which ``auto`` takes vesin (when installed), per device type. None on CUDA:
# on an H100 one 24,000-atom water box takes 1.83 ms with our Triton cell list and 4.9 ms with vesin-torch converted
# to this contract (its raw, unsorted list is 0.82 ms; the receiver sort and the re-check cost the rest;
# benchmarks/results/neighbors_h100_run2/), so auto keeps our cell list there.
AUTO_VESIN_MIN_ATOMS: dict[str, int] = {"cpu": 1000}


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends usable on ``device`` in this environment (optional dependencies installed)."""
    kind = torch.device(device).type
    return [m for m, devices in BACKENDS.items() if kind in devices and (m != "vesin" or vesin_available())]


def resolve_cell_list_impl(impl: str | None, device: torch.device) -> str:
    """``"triton"`` or ``"torch"``: the argument, else ``$MLFF_DISTILLER_CELL_LIST``, else ``auto`` (Triton on
    CUDA when it imports, torch elsewhere). Raises ``ValueError`` for an unknown name or an unusable choice."""
    name = impl if impl is not None else (os.environ.get(_CELL_LIST_ENV) or "auto")
    name = name.strip().lower()
    if name not in CELL_LIST_IMPLS:
        raise ValueError(
            f"neighbor_list: unknown cell_list_impl {name!r}; choose one of {CELL_LIST_IMPLS} "
            f"(argument or ${_CELL_LIST_ENV})"
        )
    if name == "auto":
        return "triton" if device.type == "cuda" and HAS_TRITON else "torch"
    if name == "triton" and not triton_runnable(device):
        raise ValueError(
            f"neighbor_list: cell_list_impl='triton' cannot run on {device}: it needs CUDA with Triton, or CPU "
            "tensors under the Triton interpreter (TRITON_INTERPRET=1 before triton is first imported)"
        )
    return name


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
    cell_list_impl: str | None = None,
) -> NeighborList:
    """Full neighbour list of a batch of structures within ``cutoff`` (Å); see the module docstring.

    Args:
        positions: ``[N, 3]`` Cartesian positions, Å (float32 or float64).
        cell: ``[B, 3, 3]`` lattice vectors as rows, Å.
        pbc: ``[B, 3]`` bool periodicity per lattice vector.
        batch: ``[N]`` int64 structure index of each atom.
        ptr: ``[B + 1]`` int64 atom offsets of the structures.
        cutoff: radius, Å (> 0); pairs with ``0 < |r| < cutoff`` are kept.
        method: ``"auto"``, ``"brute"``, ``"cell_list"`` or ``"vesin"``.
        max_candidates: candidate pairs examined per chunk by ``brute`` and the torch cell list, bounds
            transient memory (~120 bytes each).
        cell_list_impl: ``"auto"``, ``"triton"`` or ``"torch"`` for ``cell_list`` (default: the environment
            variable ``MLFF_DISTILLER_CELL_LIST``, else ``auto``).

    Returns:
        :class:`NeighborList` on the device of ``positions``.
    """
    if method != "auto" and method not in BACKENDS:
        raise ValueError(f"neighbor_list: unknown method {method!r}; choose 'auto' or one of {sorted(BACKENDS)}")
    if int(max_candidates) < 1:
        raise ValueError(f"neighbor_list: max_candidates must be >= 1, got {max_candidates}")
    if method == "vesin" and not vesin_available():
        vesin_pairs(None)  # raises the ValueError that explains the missing optional dependency
    if method == "auto" and (
        molecular_applicable(positions, pbc, ptr) or _molecular_on_device(positions, cell, pbc, ptr, cutoff)
    ):
        if not float(cutoff) > 0:
            raise ValueError(f"neighbor_list: cutoff must be > 0 Å, got {cutoff}")
        if batch.shape != positions.shape[:1] or ptr.dim() != 1 or int(ptr[-1]) != positions.shape[0]:
            raise ValueError("neighbor_list: batch must be [N] and ptr [B + 1] ending at N")
        pairs = molecular_pairs if positions.device.type == "cpu" else molecular_pairs_device
        return pairs(positions, ptr, cutoff)
    # Validation and the per-structure geometry on the host (a few tiny copies instead of ~30 launches).
    host = host_cells(positions, cell, pbc, batch, ptr, cutoff)
    if method == "auto":
        method = _choose(host.counts, host.n_images, positions.device.type, positions.shape[0], vesin_available)
    if positions.device.type not in BACKENDS[method]:
        raise ValueError(f"neighbor_list: backend {method!r} supports {BACKENDS[method]}, not {positions.device}")
    if method == "cell_list":
        impl = resolve_cell_list_impl(cell_list_impl, positions.device)
        if impl == "triton":
            if host.all_periodic:
                nl = cell_list_triton_periodic(positions, cell, batch, host)
            else:
                nl = cell_list_triton(prepare(positions, cell, pbc, batch, ptr, cutoff, host=host))
            if nl is not None:
                return nl
        geo = prepare(positions, cell, pbc, batch, ptr, cutoff, host=host)
        return finish(geo, cell_list(geo, int(max_candidates)), method)
    geo = prepare(positions, cell, pbc, batch, ptr, cutoff, host=host)
    raw: RawPairs = (brute_force if method == "brute" else vesin_pairs)(geo, int(max_candidates))
    return finish(geo, raw, method)


def _molecular_on_device(positions, cell, pbc, ptr, cutoff) -> bool:
    """:func:`~mlff_distiller.neighbors.molecular.molecular_device_applicable`, decided from the host geometry of an
    earlier call on these very tensors where there was one (a Verlet list's rebuilds of one box: no device read)."""
    if positions.device.type == "cpu":
        return False
    try:
        known = cached_host_cells(positions, cell, pbc, ptr, cutoff)
    except (TypeError, ValueError, AttributeError):  # not tensors, a bad cutoff: host_cells below names the problem
        known = None
    if known is not None:
        counts = known.counts
        return not bool(known.pbc.any()) and int((counts * counts).sum()) <= MOLECULAR_MAX_PAIRS
    return molecular_device_applicable(positions, pbc, ptr)


def neighbor_list_batch(atoms_batch, cutoff: float, method: str = "auto", **kwargs) -> NeighborList:
    """:func:`neighbor_list` of an :class:`~mlff_distiller.batch.AtomsBatch` (cutoff in Å)."""
    b = atoms_batch
    return neighbor_list(b.positions, b.cell, b.pbc, b.batch, b.ptr, cutoff, method, **kwargs)


def choose_method(geo: Geometry) -> str:
    """The ``auto`` rule (module docstring): ``brute`` for few candidates per atom, ``vesin`` for one large
    structure when installed, else ``cell_list``."""
    return _choose(geo.counts, geo.n_images, geo.positions.device.type, geo.num_atoms, vesin_available)


def _choose(counts: torch.Tensor, n_images: torch.Tensor, kind: str, n_atoms: int, has_vesin) -> str:
    """:func:`choose_method` from atoms per structure and images per axis (host or device tensors)."""
    limit = AUTO_BRUTE_MAX.get(kind, AUTO_BRUTE_MAX["cpu"])
    per_atom = counts * (2 * n_images + 1).prod(dim=1)
    if int(per_atom.max()) <= limit:
        return "brute"
    vesin_min = AUTO_VESIN_MIN_ATOMS.get(kind)
    if vesin_min is not None and counts.shape[0] == 1 and n_atoms >= vesin_min and has_vesin():
        return "vesin"
    return "cell_list"
