"""Shared pieces of the neighbour-list backends: the result type, input checks, cell geometry, finishing.

Every backend works in the *wrapped frame*: periodic atoms are moved into the cell by an integer image
``k_i`` (so ``wrapped_i = positions_i - k_i @ cell``) and the backend finds triples ``(i, j, S')`` with
``|wrapped_j - wrapped_i + S' @ cell| < cutoff``. :func:`finish` turns them into the caller's frame,
``S = S' - k_j + k_i``, so that the returned shifts satisfy the vector formula with the ORIGINAL positions.
All geometry is done in float64 whatever the input dtype: the pair set must match ASE exactly, and float32
rounding of ``|r|`` near the cutoff would otherwise add or drop pairs.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = [
    "Geometry",
    "HostCells",
    "NeighborList",
    "RawPairs",
    "cell_geometry",
    "finish",
    "host_cells",
    "prepare",
    "structure_bounds",
]

# Periodic lattice vectors spanning less than this (Å, Å² or Å³) make a degenerate cell (as in batch.py).
MIN_VOLUME = 1e-6
# Relative slack on ``cutoff / height`` when counting images and ghosts: a few extra candidates are harmless,
# a missing image because a fractional coordinate rounded to 1.0 - 1e-16 is not.
IMAGE_SLACK = 1e-9


@dataclass(frozen=True)
class NeighborList:
    """A full (both directions) radius graph of a batch, sorted by receiver.

    Attributes:
        edge_index: ``[2, E]`` int64; row 0 the centre/receiver ``i``, row 1 the neighbour ``j`` (global atom
            indices within the batch).
        shifts: ``[E, 3]`` int64 integer image shifts ``S``: the edge vector is
            ``positions[j] - positions[i] + S @ cell[batch[i]]`` (Å), with the positions as given.
        shift_vectors: ``[E, 3]`` ``S @ cell[batch[i]]`` in Å, dtype/device of the positions. Never carries a
            gradient; to differentiate through the cell (stress), recompute it from ``shifts``.
        row_ptr: ``[N + 1]`` int64 CSR offsets: the edges of receiver ``i`` are ``row_ptr[i]:row_ptr[i + 1]``.
        method: the backend that ran (``"brute"`` or ``"cell_list"``), to see what ``"auto"`` chose.
    """

    edge_index: torch.Tensor
    shifts: torch.Tensor
    shift_vectors: torch.Tensor
    row_ptr: torch.Tensor
    method: str

    @property
    def num_edges(self) -> int:
        return self.edge_index.shape[1]

    def vectors(self, positions: torch.Tensor) -> torch.Tensor:
        """``[E, 3]`` edge vectors ``positions[j] - positions[i] + shift_vectors`` in Å (differentiable in
        ``positions``)."""
        i, j = self.edge_index
        return positions[j] - positions[i] + self.shift_vectors.to(positions.dtype)

    def distances(self, positions: torch.Tensor) -> torch.Tensor:
        """``[E]`` edge lengths in Å."""
        return self.vectors(positions).norm(dim=1)


@dataclass(frozen=True)
class Geometry:
    """Everything a backend needs, computed once per call (float64 unless noted; Å and fractional units).

    ``basis [B,3,3]``: the cell with non-periodic (or absent) vectors replaced by orthonormal vectors
    orthogonal to the periodic ones, so it is always invertible; used only for fractional coordinates.
    ``heights [B,3]``: distance between lattice planes of ``basis`` (Å). ``n_images [B,3]`` int64: images
    needed on each side along each periodic vector, 0 along non-periodic ones. ``wrapped [N,3]``, ``frac
    [N,3]`` (wrapped fractional, in [0, 1) along periodic vectors), ``image [N,3]`` int64 ``k``.
    """

    positions: torch.Tensor
    cell: torch.Tensor
    pbc: torch.Tensor
    batch: torch.Tensor
    ptr: torch.Tensor
    counts: torch.Tensor
    cutoff: float
    basis: torch.Tensor
    heights: torch.Tensor
    n_images: torch.Tensor
    wrapped: torch.Tensor
    frac: torch.Tensor
    image: torch.Tensor

    @property
    def num_atoms(self) -> int:
        return self.positions.shape[0]


@dataclass(frozen=True)
class RawPairs:
    """Backend output: receivers ``i``, neighbours ``j`` ``[E]``; wrapped-frame shifts ``S'`` ``[E, 3]``."""

    i: torch.Tensor
    j: torch.Tensor
    shifts: torch.Tensor
    is_sorted: bool


@dataclass(frozen=True)
class HostCells:
    """The per-structure part of the geometry, validated and computed on the host (float64, CPU tensors).

    Small ``[B, ...]`` tensors: computing them with torch ops on the GPU cost ~30 kernel launches per call, more
    than the copies of ``cell``, ``pbc`` and ``ptr`` to the host that replace them. ``basis``, ``inv``, ``heights``
    and ``n_images`` as in :class:`Geometry` and :func:`cell_geometry`; ``volume`` spanned by the full-rank basis
    (Å³ for fully periodic cells); ``counts`` atoms per structure."""

    cutoff: float
    pbc: torch.Tensor
    ptr: torch.Tensor
    counts: torch.Tensor
    basis: torch.Tensor
    inv: torch.Tensor
    heights: torch.Tensor
    n_images: torch.Tensor
    volume: torch.Tensor
    # Per-call-site memo of what backends derive from these cells (e.g. the periodic Triton path's bin tables
    # on the device), kept with the cached HostCells of repeated calls.
    derived: dict = field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def all_periodic(self) -> bool:
        """Every structure periodic along all three axes. Computed once per HostCells (``pbc`` is its own host
        copy, never modified): a cached HostCells serves every list build of an MD run (~4.6 µs a build)."""
        return bool(self.pbc.all())


# Repeated calls on the same cell / pbc / ptr tensors (MD steps, the engine's device-resident topology,
# benchmarks) reuse their HostCells: no device-to-host copies (each one a sync that stalls the host behind the
# GPU) and no per-structure NumPy geometry. Keyed on the tensors' identity and in-place version counters (a
# copy_ or any in-place op bumps them; views share their base's counter), plus cutoff, atom count and device.
# Not seen: writes through raw pointers by custom kernels (none of ours touch cell, pbc or ptr).
_HOST_CACHE: list[tuple[tuple, HostCells]] = []
_HOST_CACHE_SIZE = 8


def _host_key(positions, cell, pbc, ptr, cutoff) -> tuple:
    return (
        positions.shape[0],
        positions.device,
        float(cutoff),
        *((weakref.ref(t), t._version) for t in (cell, pbc, ptr)),
    )


def _same_key(a: tuple, b: tuple) -> bool:
    if a[:3] != b[:3]:
        return False
    for (ra, va), (rb, vb) in zip(a[3:], b[3:], strict=True):
        t = ra()
        if t is None or t is not rb() or va != vb:
            return False
    return True


def cached_host_cells(positions, cell, pbc, ptr, cutoff: float) -> HostCells | None:
    """The :class:`HostCells` that :func:`host_cells` made for these very (unmodified) cell, pbc and ptr tensors, or
    None: a lookup, without validation and without reading anything from the device."""
    key = _host_key(positions, cell, pbc, ptr, float(cutoff))
    for k, cached in _HOST_CACHE:
        if _same_key(k, key):
            return cached
    return None


def host_cells(
    positions: torch.Tensor,
    cell: torch.Tensor,
    pbc: torch.Tensor,
    batch: torch.Tensor,
    ptr: torch.Tensor,
    cutoff: float,
) -> HostCells:
    """Validate the inputs (``ValueError`` on bad input) and compute :class:`HostCells` on the host; a repeated
    call on the same (unmodified) cell, pbc and ptr tensors returns the cached result (see ``_HOST_CACHE``)."""
    cutoff = _check(positions, cell, pbc, batch, ptr, cutoff)
    key = _host_key(positions, cell, pbc, ptr, cutoff)
    for k, cached in _HOST_CACHE:
        if _same_key(k, key):
            return cached
    host = _host_cells(positions, cell, pbc, ptr, cutoff)
    _HOST_CACHE[:] = [e for e in _HOST_CACHE if all(r() is not None for r, _ in e[0][3:])][-(_HOST_CACHE_SIZE - 1) :]
    _HOST_CACHE.append((key, host))
    return host


def _host_cells(positions, cell, pbc, ptr, cutoff: float) -> HostCells:
    cpu = torch.device("cpu")
    # Copies even of CPU tensors: a cached HostCells must not alias the caller's memory.
    pbc_h = pbc.to(cpu, torch.bool, copy=True)
    ptr_h = ptr.to(cpu, torch.long, copy=True)
    cell64 = cell.detach().to(cpu, torch.float64, copy=True)
    if not bool(torch.isfinite(cell64).all()):
        raise ValueError("neighbor_list: non-finite cell (NaN or inf)")
    basis, inv, heights, n_images, volume = cell_geometry(cell64, pbc_h, cutoff)
    bad = pbc_h.any(dim=1) & (volume < MIN_VOLUME)
    n, first, last = positions.shape[0], int(ptr_h[0]), int(ptr_h[-1])
    if first != 0 or last != n:
        raise ValueError(f"neighbor_list: ptr must run from 0 to N={n}, got ptr[0]={first}, ptr[-1]={last}")
    if bool(bad.any()):
        k = int(bad.long().argmax())
        raise ValueError(
            f"neighbor_list: structure {k} has a degenerate cell: its periodic vectors span "
            f"{float(volume[k]):.3g} with pbc={pbc_h[k].tolist()}"
        )
    return HostCells(
        cutoff=cutoff,
        pbc=pbc_h,
        ptr=ptr_h,
        counts=ptr_h[1:] - ptr_h[:-1],
        basis=basis,
        inv=inv,
        heights=heights,
        n_images=n_images,
        volume=volume,
    )


def prepare(
    positions: torch.Tensor,
    cell: torch.Tensor,
    pbc: torch.Tensor,
    batch: torch.Tensor,
    ptr: torch.Tensor,
    cutoff: float,
    host: HostCells | None = None,
) -> Geometry:
    """Validate the inputs and compute the shared cell geometry. Raises ``ValueError`` on bad input.

    ``host``: the :func:`host_cells` of these inputs when the caller has it already (they are not re-validated)."""
    if host is None:
        host = host_cells(positions, cell, pbc, batch, ptr, cutoff)
    device = positions.device
    n_struct = host.pbc.shape[0]
    # One host-to-device copy of the per-structure tables; basis, inv and heights are views of it.
    packed = torch.cat(
        [host.basis.reshape(n_struct, 9), host.inv.reshape(n_struct, 9), host.heights, host.n_images.double()], 1
    ).to(device)
    basis = packed[:, :9].reshape(n_struct, 3, 3)
    inv = packed[:, 9:18].reshape(n_struct, 3, 3)
    pbc = pbc.to(dtype=torch.bool)
    batch, ptr = batch.long(), ptr.long()

    pos64 = positions.to(torch.float64)
    frac = torch.einsum("ni,nij->nj", pos64, inv[batch])
    image = torch.where(pbc[batch], torch.floor(frac), torch.zeros_like(frac))
    wrapped = pos64 - torch.einsum("ni,nij->nj", image, basis[batch])
    return Geometry(
        positions=positions,
        cell=cell,
        pbc=pbc,
        batch=batch,
        ptr=ptr,
        counts=ptr[1:] - ptr[:-1],
        cutoff=host.cutoff,
        basis=basis,
        heights=packed[:, 18:21],
        n_images=packed[:, 21:24].long(),
        wrapped=wrapped,
        frac=frac - image,
        image=image.long(),
    )


def cell_geometry(
    cell64: torch.Tensor, pbc: torch.Tensor, cutoff: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-structure geometry of float64 host cells ``[B,3,3]``: the full-rank ``basis``, its inverse ``inv``
    (fractional coordinate a of x is ``x @ inv[:, a]``), the lattice-plane spacings ``heights [B,3]``, the
    periodic images needed per side ``n_images [B,3]`` int64 and the spanned ``volume [B]`` (CPU tensors).

    Closed-form 3x3 algebra (cross products, adjugate / determinant) in NumPy: ~10 operations on ``[B, 3, 3]``
    arrays cost a few µs each, where torch's CPU ops cost ~10-20 µs each at B = 1,024 (on the GPU, batched
    linalg went through cuSOLVER with its own host syncs)."""
    basis = _full_rank_basis(cell64, pbc)
    # Components as contiguous [B] vectors (r[a][c]: row a, Cartesian c): strided [B, 3] slices cost ~10x more.
    r = np.ascontiguousarray(basis.numpy().transpose(1, 2, 0))
    cof = [_cross(r[1], r[2]), _cross(r[2], r[0]), _cross(r[0], r[1])]  # cof[a]: dual of row a, times det
    det = r[0][0] * cof[0][0] + r[0][1] * cof[0][1] + r[0][2] * cof[0][2]
    volume = np.abs(det)
    # inverse = adjugate / det: column a of inv is cof[a] / det, the dual vector of basis row a.
    scale = 1.0 / np.where(volume >= MIN_VOLUME, det, 1.0)
    inv = np.empty((3, 3, det.shape[0]))  # inv[c][a]
    for a in range(3):
        for c in range(3):
            inv[c][a] = cof[a][c] * scale
    # Fractional coordinate a is x @ inv[:, a]; its gradient has norm 1/h_a, h_a the lattice-plane spacing.
    with np.errstate(divide="ignore"):  # a degenerate cell (caught by the callers' volume checks) has no planes
        heights = 1.0 / np.sqrt(inv[0] ** 2 + inv[1] ** 2 + inv[2] ** 2)  # [3, B]
    ratio = cutoff / heights * (1.0 + IMAGE_SLACK)
    n_images = np.where(pbc.numpy().T, np.ceil(ratio), 0.0).astype(np.int64)
    as_t = torch.from_numpy
    return basis, as_t(inv.transpose(2, 0, 1).copy()), as_t(heights.T.copy()), as_t(n_images.T.copy()), as_t(volume)


def _cross(u: np.ndarray, v: np.ndarray) -> list[np.ndarray]:
    """Cross product of vectors given as three ``[B]`` component arrays."""
    return [u[1] * v[2] - u[2] * v[1], u[2] * v[0] - u[0] * v[2], u[0] * v[1] - u[1] * v[0]]


# Largest packed (i, j, S') sort key (exclusive) that finish() uses; beyond it, two stable sorts (same order).
PACKED_KEY_LIMIT = 2**62


def finish(geo: Geometry, raw: RawPairs, method: str) -> NeighborList:
    """Move wrapped-frame shifts to the caller's frame, sort by (i, j, S) and build ``row_ptr``."""
    i, j, s = raw.i, raw.j, raw.shifts
    n = geo.num_atoms
    if not raw.is_sorted and i.numel() > 0:
        # Lexicographic (i, j, S'); for a fixed (i, j) the order of S' is the order of S, which differs from it
        # by the constant k_i - k_j. (i, j, S') are unique, so one sort of a packed int64 key gives the order
        # when it fits (it halves the cost of two stable sorts and their gathers; reading the span is one host
        # sync, which the unsorted backends already pay); else two stable sorts.
        span = int(s.abs().max()) * 2 + 1
        lo = s + span // 2
        code = (lo[:, 0] * span + lo[:, 1]) * span + lo[:, 2]
        if n * n * span**3 < PACKED_KEY_LIMIT:
            order = torch.sort((i * n + j) * span**3 + code).indices
        else:
            order = torch.sort(code, stable=True).indices
            order = order[torch.sort(i[order] * n + j[order], stable=True).indices]
        i, j, s = i[order], j[order], s[order]
    shifts = s + geo.image[i] - geo.image[j]
    cell = geo.cell.to(geo.positions.dtype)
    if cell.shape[0] == 1:  # one structure: a [E,3] x [3,3] matmul instead of a per-edge gathered cell
        shift_vectors = shifts.to(cell.dtype) @ cell[0]
    else:
        shift_vectors = torch.einsum("ea,eab->eb", shifts.to(cell.dtype), cell[geo.batch[i]])
    row_ptr = torch.zeros(n + 1, dtype=torch.long, device=i.device)
    row_ptr[1:] = torch.cumsum(torch.bincount(i, minlength=n), 0)
    return NeighborList(
        edge_index=torch.stack([i, j]),
        shifts=shifts,
        shift_vectors=shift_vectors,
        row_ptr=row_ptr,
        method=method,
    )


def structure_bounds(
    values: torch.Tensor, struct: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-structure minimum and maximum ``lo, hi [B, 3]`` (float64) of ``values [N, 3]`` (float64) whose rows
    belong to structures ``struct [N]``; zeros for structures without atoms (``counts [B]`` of 0)."""
    idx = struct[:, None].expand(-1, 3)
    inf = torch.full((counts.shape[0], 3), float("inf"), dtype=torch.float64, device=values.device)
    lo = inf.scatter_reduce(0, idx, values, reduce="amin")
    hi = (-inf).scatter_reduce(0, idx, values, reduce="amax")
    empty = (counts == 0)[:, None]
    return torch.where(empty, torch.zeros_like(lo), lo), torch.where(empty, torch.zeros_like(hi), hi)


def empty_pairs(device: torch.device) -> RawPairs:
    z = torch.zeros(0, dtype=torch.long, device=device)
    return RawPairs(i=z, j=z, shifts=torch.zeros(0, 3, dtype=torch.long, device=device), is_sorted=True)


def _full_rank_basis(cell: torch.Tensor, pbc: torch.Tensor) -> torch.Tensor:
    """Replace every non-periodic row of ``cell [B,3,3]`` by a unit vector orthogonal to the periodic rows.

    Closed form per number of periodic rows ``p``: 3 keeps the cell; 2 adds the unit normal of the two periodic
    rows; 1 adds two unit vectors orthogonal to the periodic row ``v`` (``u = v x e``, ``e`` the Cartesian axis
    least aligned with ``v``, then ``v x u``), in that order; 0 uses the identity. Orthogonality keeps the plane
    spacings of the periodic vectors equal to their in-plane (2D/1D) values, so no images are wasted, and makes
    the periodic fractional coordinates independent of which complement is chosen. A zero or parallel periodic
    row gives a zero complement, hence a zero volume, which :func:`prepare` reports as degenerate.
    """
    if cell.device.type == "cpu" and bool(pbc.all()):  # the common case, decided without a device sync
        return cell
    periodic = cell * pbc[..., None]
    r0, r1, r2 = periodic.unbind(dim=1)
    cross = torch.linalg.cross
    # With exactly two periodic rows the third is zero, so only their cross product survives this sum.
    normal = _unit(cross(r0, r1) + cross(r1, r2) + cross(r2, r0))
    v = r0 + r1 + r2  # the periodic row when there is exactly one
    eye = torch.eye(3, dtype=cell.dtype, device=cell.device)
    e = eye[v.abs().argmin(dim=1)]
    u = _unit(cross(v, e))
    w = _unit(cross(v, u))
    n_periodic = pbc.sum(dim=1)
    first = torch.where((n_periodic == 2)[:, None], normal, u)
    second = torch.where((n_periodic == 2)[:, None], normal, w)
    # Rank of each non-periodic row among the non-periodic rows: 0 -> first complement, 1 -> second.
    rank = torch.cumsum((~pbc).long(), dim=1) - 1
    fill = torch.where((rank == 0)[..., None], first[:, None], second[:, None])
    fill = torch.where((n_periodic == 0)[:, None, None], eye.expand_as(cell), fill)
    return torch.where(pbc[..., None], cell, fill)


def _unit(v: torch.Tensor) -> torch.Tensor:
    """Rows of ``v`` normalised; zero rows stay zero (never NaN)."""
    norm = v.norm(dim=-1, keepdim=True)
    return v / norm.clamp_min(1e-300)


def _check(positions, cell, pbc, batch, ptr, cutoff) -> float:
    def fail(msg: str) -> None:
        raise ValueError(f"neighbor_list: {msg}")

    try:
        cutoff = float(cutoff)
    except (TypeError, ValueError):
        fail(f"cutoff must be a number, got {cutoff!r}")
    if not (math.isfinite(cutoff) and cutoff > 0):
        fail(f"cutoff must be a positive finite distance in Å, got {cutoff}")
    tensors = {"positions": positions, "cell": cell, "pbc": pbc, "batch": batch, "ptr": ptr}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if positions.dtype not in (torch.float32, torch.float64):
        fail(f"positions must be float32 or float64, got {positions.dtype}")
    if positions.dim() != 2 or positions.shape[1] != 3:
        fail(f"positions must be [N, 3], got {tuple(positions.shape)}")
    n = positions.shape[0]
    if cell.dim() != 3 or cell.shape[1:] != (3, 3):
        fail(f"cell must be [B, 3, 3], got {tuple(cell.shape)}")
    b = cell.shape[0]
    if b == 0:
        fail("need at least one structure (cell is [0, 3, 3])")
    if not cell.is_floating_point():
        fail(f"cell must be floating point, got {cell.dtype}")
    if tuple(pbc.shape) != (b, 3):
        fail(f"pbc must be [{b}, 3] to match cell [{b}, 3, 3], got {tuple(pbc.shape)}")
    if tuple(batch.shape) != (n,):
        fail(f"batch must be [{n}] to match positions [{n}, 3], got {tuple(batch.shape)}")
    if tuple(ptr.shape) != (b + 1,):
        fail(f"ptr must be [{b + 1}] to match cell [{b}, 3, 3], got {tuple(ptr.shape)}")
    for name in ("batch", "ptr"):
        if tensors[name].is_floating_point() or tensors[name].dtype == torch.bool:
            fail(f"{name} must be an integer tensor, got {tensors[name].dtype}")
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        fail(f"all inputs must be on one device, got {devices}")
    return cutoff
