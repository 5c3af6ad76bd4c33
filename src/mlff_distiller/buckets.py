"""Static-shape buckets: pad a batch graph to the next capacity of atoms and edges on a geometric ladder.

CUDA graphs and ``torch.compile(dynamic=False)`` need fixed tensor shapes; molecules do not have them. A
:class:`BucketLadder` lists capacities ``A`` (atoms) and ``C`` (edges) growing geometrically, so a few shapes
serve every batch and the padding costs at most ``growth - 1`` of the work. :func:`fill_padded` writes a
batch graph into a :class:`PaddedGraph` of a :class:`Bucket` whose padding is *exactly* inert:

* at least one padding atom always exists (``A >= N + 1``); padding atoms carry the model's first species,
  sit at the origin and belong to one dummy structure, index ``A - 1`` (there are at most ``A - 1`` real
  structures, so it never collides with a real one). ``seed [A]`` is -1 for the real structures only: the
  engine's vector-Jacobian product seeds each structure's energy with it (forces = -∂/∂x Σ_b E_b over the real
  ones), so the dummy structure's energy never reaches a force;
* padding edges join a padding atom to itself with a shift vector longer than the cutoff: the radial basis ×
  cutoff envelope is exactly 0 there (and so is its derivative), the filter has no bias, so every padding
  message is exactly 0, and padding edges never touch a real atom anyway. They are spread over the padding
  atoms in ascending receiver order, so the edge list stays sorted by receiver (the neighbour-list contract)
  and scatter atomics do not all hit one row.

Real atoms, edges and structures keep their indices, so real outputs are the first ``N`` / ``B`` rows.

A :class:`PaddedGraph` also holds the graph bookkeeping of its edge list: the receiver CSR ``row_ptr`` and the
sender CSR ``sender_perm`` / ``sender_ptr`` that the message-passing backward walks. :func:`fill_padded` recomputes
them whenever it writes the edges (outside any captured graph), so a CUDA-graph replay reads them instead of
sorting the senders and searching the offsets again each step, although in MD the edges change only on a
Verlet rebuild. Whoever writes ``edge_index`` must go through :func:`fill_padded` (or call
:meth:`PaddedGraph.refresh_csr`): the CSR is trusted by the kernels, and a stale one gives wrong forces silently.
The engine's buckets keep no sender CSR since stop 54 (``sender_csr=False``): their lists are full neighbour
lists, and the backward walks each atom's receiver row for the edges it sends (``message_passing(symmetric=True)``).
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "HOST_FILL_MAX_EDGES",
    "Bucket",
    "BucketLadder",
    "PaddedGraph",
    "far_shift",
    "fill_molecule_host",
    "fill_padded",
    "fill_padded_host",
    "pad_graph",
]

# Buckets up to this many edge slots may be filled from the host in two transfers (fill_padded_host): the whole
# buffers travel (36 bytes per edge slot in float32, 48 in float64), which beats ~30 small device operations for
# small graphs only.
HOST_FILL_MAX_EDGES = 1 << 15


def far_shift(cutoff: float) -> float:
    """Length (Å) of the padding edges' shift vector: twice the cutoff + 1 Å, far outside it in any precision."""
    return 2.0 * float(cutoff) + 1.0


@dataclass(frozen=True, order=True)
class Bucket:
    """A static shape: ``atoms`` capacity ``A`` (also the structure capacity) and ``edges`` capacity ``C``."""

    atoms: int
    edges: int

    def __post_init__(self) -> None:
        if self.atoms < 2:
            raise ValueError(f"Bucket.atoms must be >= 2 (one real + one padding atom), got {self.atoms}")
        if self.edges < 1:
            raise ValueError(f"Bucket.edges must be >= 1, got {self.edges}")

    @property
    def structures(self) -> int:
        """Structure capacity: ``A`` (at most ``A - 1`` real ones plus the dummy structure ``A - 1``)."""
        return self.atoms

    def fits(self, n_atoms: int, n_edges: int) -> bool:
        return n_atoms + 1 <= self.atoms and n_edges <= self.edges


@functools.lru_cache(maxsize=64)
def _geometric(lo: int, hi: int, growth: float, align: int, fine_from: int, fine_growth: float) -> tuple[int, ...]:
    """The ladder's capacities: steps of ``growth``, of ``fine_growth`` from ``fine_from`` on (cached: a select
    was ~25 µs of host time per call computing them again)."""
    caps, c = [], float(lo)
    while True:
        v = int(math.ceil(c / align) * align)
        if not caps or v > caps[-1]:
            caps.append(v)
        if v >= hi:
            return tuple(caps)
        c = max(c * (fine_growth if v >= fine_from else growth), v + 1)


@dataclass(frozen=True)
class BucketLadder:
    """Geometric capacities for atoms and edges.

    Args:
        min_atoms, max_atoms: smallest and largest atom capacity (the largest is rounded up to the ladder).
        min_edges, max_edges: the same for edges.
        growth: ratio between neighbouring capacities (> 1); padding wastes at most ``growth - 1`` of the work.
        fine_growth, fine_atoms, fine_edges: the ratio (> 1) from ``fine_atoms`` atoms and from ``fine_edges``
            edges on: large buckets, whose steps take milliseconds, pad less (``fine_growth = growth``: one ratio).
        align: capacities are multiples of this (GPU-friendly tile sizes).
        small_atoms: extra atom capacities below ``min_atoms`` (each at least 2), ahead of the geometric ladder:
            one small molecule's own rung, without moving the rungs above it.

    A batch with more than ``max_atoms - 1`` atoms or ``max_edges`` edges has no bucket (:meth:`select`
    returns ``None``) and the engine runs it eagerly, unpadded.
    """

    # 64, not 16: cuBLAS picks pathological fp32 kernels for 16-row GEMMs on the H100 (~53 µs instead of
    # ~5 µs for the 128-wide layers; benchmarks/results/tiny_gemm_h100.md), while 48-128 rows all run in 5-10 µs.
    min_atoms: int = 64
    max_atoms: int = 65536
    min_edges: int = 64
    max_edges: int = 2**21
    # 1.25, not 1.5: the atom-proportional half of a replay (GEMMs, elementwise) scales with the padded atoms. At
    # 1.5 the 6,850 atoms of 1,024 g2 molecules ran in an 8,304-atom bucket (21 % padding; 3.09 ms replay,
    # benchmarks/results/profile_step_h100_run5.txt); 1.25 gives 6,944. Mean padding ~11 % instead of ~20 %, at
    # about twice as many (lazily captured) buckets.
    growth: float = 1.25
    # From 2,048 atoms / 65,536 edges on, steps of 1.0625 (H100, fp32, the shipped student, each against 1.25 in
    # the same run, benchmarks/results/probe_ncu_sweep_h100_run12.md): 4,096 g2 molecules (21,749 atoms) ran in a
    # 26,472-atom bucket, 5.38 -> 4.83 ms per step (1.115x); 3,000-atom water 1.033x; 192-atom water and 1,024 g2
    # molecules, whose buckets already fit within 2 %, 1.00x. Small buckets keep 1.25: there a capture costs more
    # than the padding (a new small molecule end to end is ~0.5 ms), and a run of different molecules would meet
    # ~4x as many of them. A large bucket's step takes milliseconds, and batches of a budget have similar sizes.
    # 1.03 since stop 62 (H200, each against 1.0625 in the same run, benchmarks/results/stop62_gpu/f/): 4,096 g2
    # molecules (21,749 atoms) in 22,144 atoms, not 22,768, 1.016x; 1,024 (5,448 atoms) in 5,520, not 5,648,
    # 1.025x; 3,000-atom water in 3,056, not 3,080, 1.008x (1.04: 1.016, 1.022, 1.002x). About twice as many
    # large capacities, each captured only when met.
    fine_growth: float = 1.03
    fine_atoms: int = 2048
    fine_edges: int = 65536
    align: int = 8
    # The engine's default ladder on the Triton GEMMs (CUDA) adds a 32-atom rung (engine.SMALL_ATOMS_RUNG).
    small_atoms: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        small = tuple(self.small_atoms)
        if any(isinstance(c, bool) or int(c) != c or not 2 <= c < self.min_atoms for c in small):
            raise ValueError(
                f"BucketLadder.small_atoms must be integers in [2, min_atoms={self.min_atoms}), got {small}"
            )
        object.__setattr__(self, "small_atoms", tuple(sorted({int(c) for c in small})))
        if not self.growth > 1.0:
            raise ValueError(f"BucketLadder.growth must be > 1, got {self.growth}")
        if not self.fine_growth > 1.0:
            raise ValueError(f"BucketLadder.fine_growth must be > 1, got {self.fine_growth}")
        if self.align < 1:
            raise ValueError(f"BucketLadder.align must be >= 1, got {self.align}")
        if not 2 <= self.min_atoms <= self.max_atoms:
            raise ValueError(f"BucketLadder needs 2 <= min_atoms <= max_atoms, got {self.min_atoms}, {self.max_atoms}")
        if not 1 <= self.min_edges <= self.max_edges:
            raise ValueError(f"BucketLadder needs 1 <= min_edges <= max_edges, got {self.min_edges}, {self.max_edges}")

    @property
    def atom_capacities(self) -> tuple[int, ...]:
        ladder = _geometric(self.min_atoms, self.max_atoms, self.growth, self.align, self.fine_atoms, self.fine_growth)
        return self.small_atoms + ladder

    @property
    def edge_capacities(self) -> tuple[int, ...]:
        return _geometric(self.min_edges, self.max_edges, self.growth, self.align, self.fine_edges, self.fine_growth)

    def select(self, n_atoms: int, n_edges: int) -> Bucket | None:
        """The smallest bucket holding ``n_atoms`` real atoms (plus one padding atom) and ``n_edges`` edges,
        or ``None`` when the batch is beyond the largest one."""
        if n_atoms < 0 or n_edges < 0:
            raise ValueError(f"negative sizes: n_atoms={n_atoms}, n_edges={n_edges}")
        atoms, edges = self.atom_capacities, self.edge_capacities
        ia = bisect.bisect_left(atoms, n_atoms + 1)
        ie = bisect.bisect_left(edges, max(n_edges, 1))
        return None if ia == len(atoms) or ie == len(edges) else Bucket(atoms[ia], edges[ie])


_SEGMENT_ALIGN = 32  # elements: every field of the flat buffers starts 128 (int64) or 64-128 bytes aligned


def _offsets(sizes) -> list[int]:
    """Start of each segment (and the total) with every start rounded up to ``_SEGMENT_ALIGN`` elements, so a
    field's pointer is as aligned as a fresh allocation's (the kernels' loads are specialised on alignment)."""
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at = -(-(at + n) // _SEGMENT_ALIGN) * _SEGMENT_ALIGN
    return [*out, at]


def _int_layout(a: int, c: int) -> list[int]:
    return _offsets([a, a, 2 * c, a + 1, c, a + 1])


def _float_layout(a: int, c: int, itemsize: int) -> list[int]:
    return _offsets([3 * a, 3 * c, a * 8 // itemsize])  # the seed's float64 entries as entries of the buffer


def _int_views(ints, a: int, c: int) -> dict:
    """The int64 fields of a bucket's graph as views of one flat buffer (or array), in this order."""
    o = _int_layout(a, c)
    return {
        "numbers": ints[o[0] : o[0] + a],
        "batch": ints[o[1] : o[1] + a],
        "edge_index": ints[o[2] : o[2] + 2 * c].reshape(2, c),
        "row_ptr": ints[o[3] : o[3] + a + 1],
        "sender_perm": ints[o[4] : o[4] + c],
        "sender_ptr": ints[o[5] : o[5] + a + 1],
    }


def _float_views(floats, a: int, c: int) -> dict:
    """The floating-point fields of a bucket's graph as views of one flat buffer (or array), in this order; the
    seed as float64 (the energies' dtype) over its bytes."""
    numpy = not isinstance(floats, torch.Tensor)
    itemsize = floats.dtype.itemsize  # (NumPy's and torch's dtypes both say it)
    o = _float_layout(a, c, itemsize)
    return {
        "positions": floats[o[0] : o[0] + 3 * a].reshape(a, 3),
        "shift_vectors": floats[o[1] : o[1] + 3 * c].reshape(c, 3),
        "seed": floats[o[2] : o[2] + a * 8 // itemsize].view("float64" if numpy else torch.float64),
    }


@dataclass
class PaddedGraph:
    """Model inputs of one bucket (preallocated, reused across calls; CUDA graphs read them in place).

    Attributes:
        numbers: ``[A]`` int64 atomic numbers (padding: the model's first species).
        positions: ``[A, 3]`` Å (padding atoms at the origin).
        batch: ``[A]`` int64 structure of each atom (padding atoms: ``A - 1``).
        seed: ``[A]`` float64 (the energies' dtype), -1 for real structures, 0 otherwise: the gradient seed of the
            energies.
        edge_index: ``[2, C]`` int64 receiver, sender (padding edges: a padding atom to itself).
        shift_vectors: ``[C, 3]`` Å (padding edges: longer than the cutoff).
        row_ptr: ``[A + 1]`` int64 receiver CSR offsets of ``edge_index`` (atom i's edges start at ``row_ptr[i]``);
            the padding edges belong to no row (``row_ptr[A] = n_edges``).
        sender_perm: ``[C]`` int64 edge ids in a stable order by sender.
        sender_ptr: ``[A + 1]`` int64 offsets of each sender's run in ``sender_perm`` (also ending at ``n_edges``).
        sender_csr: whether the fills keep ``sender_perm`` and ``sender_ptr`` (False for a step that walks a full
            neighbour list's receiver rows instead, ``message_passing(symmetric=True)``: they then keep their
            zeros, a valid but meaningless content, and the fills sort no senders).
        n_atoms, n_edges, n_structures: the real sizes of the current content.
        molecule: the current content has no periodic images (structures without a cell, or whose pairs all have
            zero shifts, given as real positions): the engine's dense step, which takes every pair within the
            cutoff itself, may compute it (``ForceEngine(dense_small=...)``). Set by the fills.
    """

    bucket: Bucket
    numbers: torch.Tensor
    positions: torch.Tensor
    batch: torch.Tensor
    seed: torch.Tensor
    edge_index: torch.Tensor
    shift_vectors: torch.Tensor
    row_ptr: torch.Tensor | None = None
    sender_perm: torch.Tensor | None = None
    sender_ptr: torch.Tensor | None = None
    sender_csr: bool = True
    n_atoms: int = 0
    n_edges: int = 0
    n_structures: int = 0
    molecule: bool = False
    pad_z: int = 1
    far: float = 1.0

    @classmethod
    def empty(
        cls,
        bucket: Bucket,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        cutoff: float,
        pad_z: int,
        sender_csr: bool = True,
    ) -> PaddedGraph:
        """All-padding content (zero real atoms): a valid input, used to warm up and capture a bucket."""
        a, c = bucket.atoms, bucket.edges
        # Two flat buffers, one per dtype, that the fields view: fill_padded_host writes each in one transfer.
        ints = torch.empty((_int_layout(a, c)[-1],), dtype=torch.long, device=device)
        floats = torch.empty((_float_layout(a, c, dtype.itemsize)[-1],), dtype=dtype, device=device)
        iv = _int_views(ints, a, c)
        fv = _float_views(floats, a, c)
        ints.zero_()  # the gaps between the fields included (never read)
        floats.zero_()
        iv["numbers"].fill_(int(pad_z))
        iv["batch"].fill_(a - 1)
        g = cls(bucket=bucket, **iv, **fv, sender_csr=bool(sender_csr), pad_z=int(pad_z), far=far_shift(cutoff))
        g._ints, g._floats = ints, floats
        g._host = None  # fill_padded_host's page-locked mirrors of the two buffers, its copy event, their views
        g._host_form = None  # fill_molecule_host: the atom count whose edge-free form the mirrors hold
        g._arange = torch.arange(c, dtype=torch.long, device=device)
        # Search keys 0..A for the offsets: int64 for the receivers, int32 for the int32 sender keys.
        g._bounds = torch.arange(a + 1, dtype=torch.long, device=device)
        g._bounds32 = g._bounds.to(torch.int32)
        g._send32 = torch.empty((c,), dtype=torch.int32, device=device)  # sort keys and sorted keys
        g._keys32 = torch.empty((c,), dtype=torch.int32, device=device)
        g._fill_edge_tail(0, 0)
        g.refresh_csr()
        return g

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """``(numbers, positions, edge_index, shift_vectors, batch, seed, row_ptr, sender_perm, sender_ptr)``."""
        return (
            self.numbers,
            self.positions,
            self.edge_index,
            self.shift_vectors,
            self.batch,
            self.seed,
            self.row_ptr,
            self.sender_perm,
            self.sender_ptr,
        )

    def refresh_csr(self) -> None:
        """Recompute ``row_ptr``, ``sender_perm`` and ``sender_ptr`` from ``edge_index`` in place (the buffers
        keep their storage, so captured graphs read the new content). Device work only, no sync: a searchsorted
        for the receivers (the edges are receiver-sorted), a stable sort of the senders on int32 keys (half the
        radix passes of int64; any stable sort gives the same permutation) and a searchsorted over it.

        Both offset arrays stop at the ``n_edges`` real edges: the padding edges (the last ``C - n_edges`` slots,
        also last in the sender order, since their senders are the padding atoms) belong to no CSR row, so the
        message-passing kernels never visit them (they are inert anyway). Without ``sender_csr``, ``row_ptr`` alone."""
        torch.searchsorted(self.edge_index[0], self._bounds, out=self.row_ptr)
        self.row_ptr.clamp_(max=self.n_edges)
        if self.sender_csr:
            self._send32.copy_(self.edge_index[1])
            torch.sort(self._send32, stable=True, out=(self._keys32, self.sender_perm))
            torch.searchsorted(self._keys32, self._bounds32, out=self.sender_ptr)
            self.sender_ptr.clamp_(max=self.n_edges)

    def _fill_edge_tail(self, n_atoms: int, n_edges: int) -> None:
        a, c = self.bucket.atoms, self.bucket.edges
        n_pad_e = c - n_edges
        if n_pad_e <= 0:
            return
        # Ascending receivers N .. A-1, evenly spread: sorted by receiver, few atomics per row.
        recv = n_atoms + torch.div(self._arange[:n_pad_e] * (a - n_atoms), n_pad_e, rounding_mode="floor")
        self.edge_index[:, n_edges:].copy_(recv.expand(2, -1))
        tail = self.shift_vectors[n_edges:]
        tail.zero_()
        tail[:, 0].fill_(self.far)


def fill_padded(
    dst: PaddedGraph,
    numbers: torch.Tensor,
    positions: torch.Tensor,
    batch: torch.Tensor,
    num_structures: int,
    edge_index: torch.Tensor,
    shift_vectors: torch.Tensor,
    *,
    same_topology: bool = False,
    molecule: bool = False,
) -> PaddedGraph:
    """Write a batch graph (``numbers [N]``, ``positions [N,3]`` Å, ``batch [N]``, ``edge_index [2,E]``,
    ``shift_vectors [E,3]`` Å) into ``dst`` in place; see the module docstring for the padding.

    ``same_topology=True`` promises that numbers, batch and the structure count equal those of the previous
    fill (as in MD), which skips rewriting them. The edges and their CSR (``row_ptr``, ``sender_perm``,
    ``sender_ptr``) are rewritten on every call. ``molecule=True`` promises that the structures have no periodic
    images and their positions are the real ones (``PaddedGraph.molecule``).
    """
    n, e = int(numbers.shape[0]), int(edge_index.shape[1])
    if not dst.bucket.fits(n, e):
        raise ValueError(f"a graph of {n} atoms and {e} edges does not fit bucket {dst.bucket}")
    if tuple(positions.shape) != (n, 3) or tuple(batch.shape) != (n,) or tuple(shift_vectors.shape) != (e, 3):
        raise ValueError("fill_padded: positions [N,3], batch [N] and shift_vectors [E,3] must match numbers/edges")
    if not 0 <= num_structures <= n:
        raise ValueError(f"fill_padded: num_structures must be in 0..{n}, got {num_structures}")
    dst.molecule = bool(molecule)
    dst.positions[:n].copy_(positions)
    if n != dst.n_atoms:
        dst.positions[n:].zero_()
    if not (same_topology and n == dst.n_atoms and num_structures == dst.n_structures):
        dst.numbers[:n].copy_(numbers)
        dst.numbers[n:].fill_(dst.pad_z)
        dst.batch[:n].copy_(batch)
        dst.batch[n:].fill_(dst.bucket.atoms - 1)
        dst.seed.zero_()
        dst.seed[:num_structures].fill_(-1)
    if e:
        dst.edge_index[:, :e].copy_(edge_index)
        dst.shift_vectors[:e].copy_(shift_vectors)
    if e != dst.n_edges or n != dst.n_atoms:
        dst._fill_edge_tail(n, e)
    dst.n_atoms, dst.n_edges, dst.n_structures = n, e, int(num_structures)
    # The edges were (re)written: the bookkeeping follows, every time (a stale CSR means wrong forces).
    dst.refresh_csr()
    return dst


def fill_padded_host(
    dst: PaddedGraph,
    numbers: np.ndarray,
    positions: np.ndarray,
    batch: np.ndarray,
    num_structures: int,
    edge_index: np.ndarray,
    row_ptr: np.ndarray,
    *,
    record: bool = True,
) -> PaddedGraph:
    """:func:`fill_padded` for a graph given on the host with zero shifts (molecules: the all-pairs list of
    :mod:`mlff_distiller.neighbors.molecular`, sorted by receiver, and its receiver offsets ``row_ptr [N + 1]``).

    The whole content, padding and the sender CSR included, is written into page-locked mirrors of the bucket's
    two flat buffers with NumPy and sent in two transfers: for a benzene that replaces ~30 small device
    operations and six transfers of the device path (each a launch of host time on a GPU). The result equals
    :func:`fill_padded` with zero shift vectors, buffer for buffer (the stable sort by sender gives the same
    permutation as the device's). For buckets of at most :data:`HOST_FILL_MAX_EDGES` edge slots.

    The next fill waits for these transfers before it rewrites the mirrors (a CUDA event recorded after them).
    ``record=False`` skips that event (``torch.cuda.current_stream()`` and a record, a few µs of host time) for a
    caller that waits for the device anyway before the next fill, e.g. by copying the step's results to the host
    in the same stream."""
    n, e = int(numbers.shape[0]), int(edge_index.shape[1])
    a, c = dst.bucket.atoms, dst.bucket.edges
    if not dst.bucket.fits(n, e):
        raise ValueError(f"a graph of {n} atoms and {e} edges does not fit bucket {dst.bucket}")
    if c > HOST_FILL_MAX_EDGES:
        raise ValueError(f"fill_padded_host: bucket {dst.bucket} has more than {HOST_FILL_MAX_EDGES} edge slots")
    if tuple(positions.shape) != (n, 3) or tuple(batch.shape) != (n,) or tuple(row_ptr.shape) != (n + 1,):
        raise ValueError("fill_padded_host: positions [N,3], batch [N] and row_ptr [N+1] must match numbers")
    if not 0 <= num_structures <= n:
        raise ValueError(f"fill_padded_host: num_structures must be in 0..{n}, got {num_structures}")
    h_ints, h_floats, event, iv, fv = _host_mirrors(dst)
    dst._host_form = None  # the mirrors hold a list now (fill_molecule_host's edge-free form is gone)
    iv["numbers"][:n] = numbers
    iv["numbers"][n:] = dst.pad_z
    iv["batch"][:n] = batch
    iv["batch"][n:] = a - 1
    ei = iv["edge_index"]
    ei[:, :e] = edge_index
    # The padding edges as _fill_edge_tail writes them: ascending receivers N .. A-1, each its own sender.
    ei[:, e:] = n + (np.arange(c - e, dtype=np.int64) * (a - n)) // max(c - e, 1)
    iv["row_ptr"][: n + 1] = row_ptr
    iv["row_ptr"][n + 1 :] = e
    if dst.sender_csr:  # else sender_perm and sender_ptr keep the mirror's zeros
        senders = edge_index[1]
        iv["sender_perm"][:e] = np.argsort(senders, kind="stable")
        iv["sender_perm"][e:] = np.arange(e, c)  # padding senders (>= N) come last, already in ascending order
        sp = iv["sender_ptr"]
        sp[0] = 0
        np.cumsum(np.bincount(senders, minlength=n)[:n], out=sp[1 : n + 1])
        sp[n + 1 :] = e
    fv["positions"][:n] = positions
    fv["positions"][n:] = 0.0
    sv = fv["shift_vectors"]
    sv[:] = 0.0
    sv[e:, 0] = dst.far
    fv["seed"][:] = 0.0
    fv["seed"][:num_structures] = -1.0
    _send_mirrors(dst, h_ints, h_floats, event, record)
    dst.n_atoms, dst.n_edges, dst.n_structures = n, e, int(num_structures)
    dst.molecule = True  # zero shifts: the caller's structures have no periodic images
    return dst


def fill_molecule_host(dst: PaddedGraph, numbers: np.ndarray, positions: np.ndarray, *, record: bool = True):
    """:func:`fill_padded_host` for one molecule without its neighbour list: its atoms as structure 0 and every
    edge slot padding (a valid graph of no edges), for a step that finds the pairs itself (the engine's dense step
    reads only the numbers, positions and ``batch``). The same buffers as :func:`fill_padded_host` given no edges.

    Since that edge-free form depends only on the atom count, the mirrors keep it between calls of the same count
    (``_host_form``) and a call rewrites only the numbers and positions: four NumPy writes and the two transfers,
    against ~25 writes with a list (stop 74)."""
    n = int(numbers.shape[0])
    a, c = dst.bucket.atoms, dst.bucket.edges
    if not dst.bucket.fits(n, 0):
        raise ValueError(f"a molecule of {n} atoms does not fit bucket {dst.bucket}")
    if c > HOST_FILL_MAX_EDGES:
        raise ValueError(f"fill_molecule_host: bucket {dst.bucket} has more than {HOST_FILL_MAX_EDGES} edge slots")
    if tuple(positions.shape) != (n, 3):
        raise ValueError(f"fill_molecule_host: positions must be [{n}, 3], got {tuple(positions.shape)}")
    h_ints, h_floats, event, iv, fv = _host_mirrors(dst)
    if dst._host_form != n:
        iv["numbers"][n:] = dst.pad_z
        iv["batch"][:n] = 0
        iv["batch"][n:] = a - 1
        iv["edge_index"][:] = n + (np.arange(c, dtype=np.int64) * (a - n)) // max(c, 1)  # as _fill_edge_tail
        iv["row_ptr"][:] = 0
        if dst.sender_csr:
            iv["sender_perm"][:] = np.arange(c)
            iv["sender_ptr"][:] = 0
        fv["positions"][n:] = 0.0
        sv = fv["shift_vectors"]
        sv[:] = 0.0
        sv[:, 0] = dst.far
        fv["seed"][:] = 0.0
        fv["seed"][:1] = -1.0
        dst._host_form = n
    iv["numbers"][:n] = numbers
    fv["positions"][:n] = positions
    _send_mirrors(dst, h_ints, h_floats, event, record)
    dst.n_atoms, dst.n_edges, dst.n_structures = n, 0, 1
    dst.molecule = True
    return dst


def _host_mirrors(dst: PaddedGraph) -> tuple:
    """The page-locked (on CUDA) host mirrors of ``dst``'s two flat buffers, their copy event and the fields'
    NumPy views of them (made once per graph), after waiting for the previous transfer out of them."""
    host = dst._host
    if host is None:
        a, c = dst.bucket.atoms, dst.bucket.edges
        pin = dst._ints.is_cuda
        h_ints = torch.zeros(dst._ints.shape, dtype=torch.long, pin_memory=pin)
        h_floats = torch.zeros(dst._floats.shape, dtype=dst._floats.dtype, pin_memory=pin)
        event = torch.cuda.Event() if pin else None
        host = dst._host = (
            h_ints,
            h_floats,
            event,
            _int_views(h_ints.numpy(), a, c),
            _float_views(h_floats.numpy(), a, c),
        )
        dst._host_form = None
    if host[2] is not None:
        host[2].synchronize()  # the previous transfer out of the mirrors has been made
    return host


def _send_mirrors(dst: PaddedGraph, h_ints, h_floats, event, record: bool) -> None:
    """Send both mirrors to ``dst``'s buffers (asynchronous from page-locked memory); ``record``: record the event
    the next fill waits for."""
    dst._ints.copy_(h_ints, non_blocking=True)
    dst._floats.copy_(h_floats, non_blocking=True)
    if event is not None and record:
        event.record()


def pad_graph(
    bucket: Bucket,
    numbers: torch.Tensor,
    positions: torch.Tensor,
    batch: torch.Tensor,
    num_structures: int,
    edge_index: torch.Tensor,
    shift_vectors: torch.Tensor,
    *,
    cutoff: float,
    pad_z: int,
) -> PaddedGraph:
    """A freshly allocated :class:`PaddedGraph` holding the given graph (see :func:`fill_padded`)."""
    dst = PaddedGraph.empty(bucket, dtype=positions.dtype, device=positions.device, cutoff=cutoff, pad_z=pad_z)
    return fill_padded(dst, numbers, positions, batch, num_structures, edge_index, shift_vectors)
