"""Cell-list backend as fused Triton kernels: O(N), batched, receiver-sorted CSR out, one sizing sync.

Where the torch cell list (:mod:`.cell_list`) spends its time: profiled on CPU (3,000-atom water box, 5 Å,
163K pairs, 180 ms), 80 % goes into materialising ~2M candidate pairs (``index_select``/``index``/``sub``/
``sort``/``searchsorted`` over candidate-sized tensors), and on a GPU every one of its ~100 torch ops is a
kernel launch plus a few host syncs for chunking. Here candidates never touch memory:

1. Bins (torch ops over atoms, no sync). Per structure, bins are cut in *fractional* coordinates along
   periodic vectors (``nb_a = floor(h_a / cutoff)`` of them, ``h_a`` the lattice-plane spacing, so a bin is
   at least ``cutoff`` thick) and in Å along the orthonormal non-periodic directions (over the atoms'
   extent). A neighbour within ``cutoff`` differs by at most ``cutoff / h_a`` in fractional coordinate
   ``a``, so it lies within ``r_a = ceil(cutoff * nb_a / h_a)`` bins (1 unless the cell is thinner than the
   cutoff). Periodic bins wrap: stencil bin ``t`` is bin ``t mod nb_a`` seen through image ``floor(t /
   nb_a)``, so no ghost atoms are made and cells narrower than ``2 * cutoff`` (``nb_a`` of 1 or 2, the same
   bin visited through several images) are exact. Bins per structure are capped at ``8 * max(n_b, 1)`` so
   the dense ``cell_start`` table has a size known on the host (``8 N + 8 B``) without a sync. Atoms are
   sorted by bin (``torch.sort``) and ``cell_start`` is one ``searchsorted``.
2. ``_pairs_kernel`` (one program per receiver, receivers in bin order for cache locality): a
   ``[BLOCK_S stencil bins, BLOCK_K atoms]`` tile of candidates per step, float64 distances, keep
   ``0 < |r| < cutoff``. Launched twice: first to count each receiver's pairs (-> ``row_ptr`` by a cumsum,
   and the one sync that sizes the output), then to write, per receiver, one int64 key per pair,
   ``j << 30 | code(S')`` (10 bits per shift component), at ``row_ptr[i] + rank`` (no atomics).
3. ``_rows_kernel`` (one program per receiver): ``tl.sort`` of the row's keys gives the (j, S) order of the
   contract; it decodes ``j`` and ``S'``, moves ``S'`` to the caller's frame (``S = S' + k_i - k_j``) and
   writes ``edge_index``, ``shifts`` and ``shift_vectors`` directly. Rows longer than ``MAX_ROW_SORT`` (hubs)
   go through the torch sort of :func:`._common.finish` instead. Host-side helpers (tables, capacities, buffer
   carving) live in :mod:`._triton_host`.

Fully periodic batches (the common case: liquids, crystals, many small boxes) take
:func:`cell_list_triton_periodic`: the bin tables of step 1 come from the host geometry
(:func:`._common.host_cells`, memoised per cell tensor), ``_atoms_kernel`` wraps and bins the atoms and counts
them per bin (``cell_start`` is the cumsum of the counts), ``_gather_kernel`` lays them out in bin order (three
launches instead of ~45 torch ops and a radix sort), and step 2 is one pass:
``_pairs_kernel`` counts and stores each row into a scratch row of ``cap`` keys sized from the mean density
(:func:`._triton_host.scratch_cap`), which ``_rows_kernel`` reads in place. On CUDA the row sort is speculative:
``n * cap`` bounds the list when no row outgrows ``cap``, so outputs of that capacity are carved before the sync,
``_rows_kernel`` is queued right after the ``row_ptr`` cumsum (reading ``n_edges = row_ptr[n]`` from device
memory: receivers at ``[e]``, senders at ``[n_edges + e]``, so ``[:2 * n_edges].view(2, n_edges)`` is the
contiguous ``edge_index``), and the one sync reads a 3-word header: the non-finite flag (``_atoms_kernel``), the
longest row that outgrew ``cap`` (``_pairs_kernel``, atomics only for such rows) and ``n_edges`` (copied by
``_rows_kernel``). The host then only slices; when some row did outgrow ``cap`` (clusters in vacuum) the
speculative output is dropped and the fill pass and row sort run as in the general path. The price is memory:
the returned tensors are prefixes of buffers for ``n * cap`` pairs (~2.5x a liquid's list, at most
``SPECULATE_MAX_PAIRS``). Buffers come from two allocations (:func:`._triton_host.carve`), not one each.
Measured on an H100 before speculation (benchmarks/results/neighbors_h100_run4_profile.txt): a 24,000-atom
water box 0.80 ms, of which kernels 0.43 ms; the rest is host time that the sync left exposed. After it: 0.79 ms
for 0.37 ms of kernels, the host's launches and torch ops (~0.4 ms) still not hidden. So on CUDA, repeated calls
on the same cells and atom count (MD, benchmarks) replay everything before the sync as one CUDA graph (see
"CUDA graphs" below :func:`_complete`; switch: :data:`CUDA_GRAPHS` or ``MLFF_DISTILLER_NL_GRAPHS=0``).

On CPU the same kernels run under ``TRITON_INTERPRET=1`` (tests); the production CPU path stays the torch
cell list. Exactness is that of the torch backends: float64 geometry, the same strict cutoff test. The kernels
themselves live in :mod:`._cell_list_kernels`; this module chooses tiles and buffers, launches them, and replays
them as CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
import weakref

import torch

from mlff_distiller.cudagraph import capturing
from mlff_distiller.kernels._triton_utils import cdiv
from mlff_distiller.neighbors._cell_list_kernels import (
    HAS_TRITON,
    _atoms_kernel,
    _gather_kernel,
    _pairs_kernel,
    _rows_kernel,
)
from mlff_distiller.neighbors._common import Geometry, HostCells, NeighborList, finish, prepare
from mlff_distiller.neighbors._triton_host import (
    MAX_ROW_SORT,
    SHIFT_BIAS,
    SHIFT_BITS,
    SPECULATE_MAX_PAIRS,
    bin_atoms,
    carve,
    decode_keys,
    periodic_tables,
    row_block,
)
from mlff_distiller.neighbors._triton_host import empty_list as _empty

try:
    import triton
except ImportError:  # the torch cell list must not depend on Triton
    triton = None

__all__ = [
    "CUDA_GRAPHS",
    "HAS_TRITON",
    "MAX_ROW_SORT",
    "TILES",
    "cell_list_triton",
    "cell_list_triton_periodic",
    "triton_runnable",
]

# Candidate tile (stencil bins, atoms per bin) per device type. On CUDA 32 covers the 27-bin stencil of an
# ordinary cell in one step. The CPU interpreter pays per operation, not per element: wide tiles, few steps.
TILES = {"cuda": (32, 16), "cpu": (512, 32)}


def triton_runnable(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``: CUDA with Triton, or CPU under the interpreter."""
    if not HAS_TRITON:
        return False
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_pairs_kernel, InterpretedFunction)


# Atoms per program of _atoms_kernel and _gather_kernel.
BLOCK_ATOMS = 256


def cell_list_triton(geo: Geometry, max_row_sort: int = MAX_ROW_SORT) -> NeighborList | None:
    """The full :class:`NeighborList` of ``geo`` from the Triton kernels (see the module docstring), or
    ``None`` when some shift exceeds the key's range (then use the torch cell list)."""
    device = geo.positions.device
    n = geo.num_atoms
    if n == 0:
        return _empty(n, device, geo.positions.dtype)
    _check_runnable(device)
    itab, bins, key, bound = bin_atoms(geo)
    sorted_key, order = torch.sort(key, stable=True)
    cell_start = torch.searchsorted(sorted_key, torch.arange(bound + 1, device=device))
    spos = geo.wrapped[order].T.contiguous()
    sbin = bins[order].contiguous()
    sstruct = geo.batch[order].contiguous()
    basis = geo.basis.reshape(-1, 9).contiguous()
    head = torch.zeros(n + 5, dtype=torch.int64, device=device)
    head[0] = ~torch.isfinite(spos).all()  # the non-finite flag, which the periodic path's binning kernel sets
    bufs = dict(hdr=head[:3], row_ptr=head[4:], count=torch.empty(n, dtype=torch.int64, device=device))
    cell9 = geo.cell.to(geo.positions.dtype).reshape(-1, 9).contiguous()
    common = (order, spos[0], spos[1], spos[2], sbin, sstruct, itab, basis, 9, cell_start)
    q = _queue_pairs(common, geo.cutoff, bufs, geo.image, geo.batch, cell9, itab, check_reach=True)
    return _complete(q, lambda: geo, max_row_sort)


def cell_list_triton_periodic(
    positions: torch.Tensor,
    cell: torch.Tensor,
    batch: torch.Tensor,
    host: HostCells,
    max_row_sort: int = MAX_ROW_SORT,
    speculate: bool | None = None,
    graphs: bool | None = None,
) -> NeighborList | None:
    """The Triton cell list of a batch whose structures are periodic along all three axes (``host.all_periodic``;
    inputs already validated by :func:`._common.host_cells`): the bin grid comes from the host tables, and one
    kernel wraps and bins the atoms, so a call costs about 12 launches instead of about 100. ``speculate``: queue
    the row sort before the sync, into outputs of the scratch capacity (default: on CUDA; on CPU the
    interpreter's ``tl.sort`` is slow, and the rows are sorted with torch after the sync). ``graphs``: replay the
    speculative path as a CUDA graph from the second call on the same cells and atom count (default
    :data:`CUDA_GRAPHS`; CUDA only, see "CUDA graphs" below). ``None`` when some shift exceeds the key's range
    (then use the torch cell list)."""
    device = positions.device
    n = positions.shape[0]
    if n == 0:
        return _empty(n, device, positions.dtype)
    _check_runnable(device)
    # The tables depend on the cells only: made once per cached HostCells (repeated calls on the same cell
    # tensors skip the NumPy grid and the host-to-device copies).
    memo = ("triton_periodic", device, positions.dtype)
    tables = host.derived.get(memo, _MISSING)
    if tables is _MISSING:
        tables = periodic_tables(host, n, device)
        tables = host.derived[memo] = tables and (*tables, cell.to(positions.dtype).reshape(-1, 9).contiguous())
    if tables is None:
        return None  # shifts would overflow the 10-bit fields of the pair keys (see cell_list_triton)
    cap = tables[3]
    if speculate is None:
        speculate = device.type == "cuda"
    spec = speculate and 0 < cap <= max_row_sort and n * cap <= SPECULATE_MAX_PAIRS
    if spec and device.type == "cuda" and (CUDA_GRAPHS if graphs is None else graphs):
        nl = _replay_periodic(positions, cell, batch, host, tables, max_row_sort)
        if nl is not _NOT_REPLAYED:
            return nl
    batch = batch.long().contiguous()
    q = _queue_periodic(positions.contiguous(), batch, tables, host.cutoff, spec=spec, rows=spec)
    return _complete(q, _fallback_geometry(q, positions, cell, batch, host), max_row_sort)


_MISSING = object()


def _queue_periodic(positions, batch, tables, cutoff: float, spec: bool, rows: bool) -> _Queued:
    """Allocate and queue the periodic path up to its sync (no sync, no host read of device memory): binning,
    counting sort, the one-pass candidate search and the ``row_ptr`` cumsum, and with ``spec`` and ``rows`` the
    speculative row sort. ``positions`` contiguous, ``batch`` int64 contiguous. Graph-capturable."""
    itab, ftab, n_bins, cap, cell9 = tables
    device = positions.device
    n = positions.shape[0]
    f64, i64 = torch.float64, torch.int64
    # Two allocations: this call's working arrays, and what the list returns. `head` holds the bin counts, the
    # header that the sync reads and row_ptr, in that order, so that one memset zeroes all that needs it.
    ws = carve(
        device, wrapped=((n, 3), f64), frac=((n, 3), f64), image=((n, 3), i64), bins=((n, 3), i64),
        key=((n,), i64), rank=((n,), i64), cell_start=((n_bins + 1,), i64), order=((n,), i64),
        spos=((3, n), f64), sbin=((n, 3), i64), sstruct=((n,), i64), count=((n,), i64),
        scratch=((max(n * cap, 1),), i64),
    )  # fmt: skip
    # The header and row_ptr start on 16-byte boundaries: Triton specialises pointer arguments on that, and a
    # number of bins that changes with the cell (NPT) must not compile new kernel variants.
    h0 = (n_bins + 2) // 2 * 2
    out = dict(head=((h0 + 4 + n + 1,), i64))
    if spec and rows:  # (a graph in "fresh" mode leaves them to each replay)
        c = n * cap
        out.update(ei=((2 * c,), i64), sh=((3 * c,), i64), sv=((3 * c,), cell9.dtype))
    out = carve(device, **out)
    head = out["head"]
    head[: h0 + 5].zero_()
    cnt, hdr, row_ptr = head[: n_bins + 1], head[h0 : h0 + 3], head[h0 + 4 :]
    grid = (cdiv(n, BLOCK_ATOMS),)
    wrapped, frac, image, key, rank = ws["wrapped"], ws["frac"], ws["image"], ws["key"], ws["rank"]
    _atoms_kernel[grid](
        positions, batch, ftab, itab, wrapped, frac, image, ws["bins"], key, rank, cnt, hdr, n, BLOCK=BLOCK_ATOMS
    )
    cell_start = torch.cumsum(cnt, 0, out=ws["cell_start"])
    order, spos, sbin, sstruct = ws["order"], ws["spos"], ws["sbin"], ws["sstruct"]
    _gather_kernel[grid](
        key, rank, cell_start, wrapped, ws["bins"], batch, order, spos, sbin, sstruct, n, BLOCK=BLOCK_ATOMS
    )
    q = _queue_pairs(
        (order, spos[0], spos[1], spos[2], sbin, sstruct, itab, ftab, 18, cell_start), cutoff,
        dict(out, hdr=hdr, row_ptr=row_ptr, count=ws["count"], scratch=ws["scratch"]), image, batch, cell9, itab,
        check_reach=False, cap=cap, spec=spec, rows=rows,
    )  # fmt: skip
    return dataclasses.replace(q, wrapped=wrapped, frac=frac)


def _fallback_geometry(q: _Queued, positions, cell, batch, host: HostCells):
    def geometry() -> Geometry:
        """The full Geometry (for the long-row fallback): the wrapping of this call, which the keys refer to."""
        device = positions.device
        geo = prepare(positions, cell, host.pbc.to(device), batch, host.ptr.to(device), host.cutoff, host=host)
        return dataclasses.replace(geo, wrapped=q.wrapped, frac=q.frac, image=q.image)

    return geometry


@dataclasses.dataclass(frozen=True)
class _Queued:
    """What the host needs after the sync of a queued call (:func:`_queue_pairs`): the pairs kernel's shared
    arguments ``common`` (atoms in bin order, tables, ``cell_start``) and launch constants, the buffers ``bufs``
    (see :func:`_queue_pairs`), per-atom ``image`` and ``batch``, the ``[B, 9]`` output-dtype cells ``cell9``, the
    int table ``itab``; ``wrapped`` and ``frac`` of the periodic path (its long-row fallback's Geometry)."""

    common: tuple
    cutoff_sq: float
    consts: dict
    bufs: dict
    image: torch.Tensor
    batch: torch.Tensor
    cell9: torch.Tensor
    itab: torch.Tensor
    cap: int
    spec: bool
    check_reach: bool
    wrapped: torch.Tensor | None = None
    frac: torch.Tensor | None = None


def _queue_pairs(
    common, cutoff, bufs, image, batch, cell9, itab, check_reach, cap=0, spec=False, rows=True
) -> _Queued:  # fmt: skip
    """Queue step 2 of the module docstring over atoms in bin order (and, with ``spec`` and ``rows``, the
    speculative row sort of step 3); :func:`_complete` does the rest after the one sync. ``common``: the
    ``_pairs_kernel`` arguments before ``cutoff_sq``; ``cell9``: ``[B, 9]`` cells in the output dtype; ``bufs``:
    ``hdr`` ``[3]`` int64 (non-finite flag, set by the caller; longest row that outgrew ``cap``; ``n_edges``), zero
    on entry; ``row_ptr`` ``[N + 1]`` int64, ``[0]`` zero; ``count`` ``[N]`` int64; with ``cap``: ``scratch``
    ``[N * cap]`` int64; with ``spec``: the outputs ``ei``, ``sh``, ``sv`` for ``N * cap`` pairs. ``check_reach``:
    also check that shifts fit the pair keys (else :func:`_complete` gives ``None``). ``cap`` > 0: one candidate
    pass that counts and stores each row into a scratch row of ``cap`` keys (the row sort reads them there), with
    the fill pass only when some row is longer. ``spec``: the row sort runs before the sync, on the speculation
    that no row is longer than ``cap`` (``rows=False``: the caller queues it, see :func:`_replay_periodic`)."""
    order = common[0]
    n = order.shape[0]
    block_s, block_k = TILES.get(order.device.type, TILES["cuda"])
    consts = dict(SHIFT_BITS=SHIFT_BITS, BLOCK_S=block_s, BLOCK_K=block_k, num_warps=4)
    q = _Queued(common, float(cutoff) ** 2, consts, bufs, image, batch, cell9, itab, cap, spec, check_reach)
    count, row_ptr, hdr = bufs["count"], bufs["row_ptr"], bufs["hdr"]
    scratch = bufs.get("scratch", count)  # unused by the count-only pass
    # One pass when the rows fit scratch rows of `cap` keys (counted and stored together); else count, then fill.
    _pairs_kernel[(n,)](*common, q.cutoff_sq, count, row_ptr, scratch, cap, hdr, FILL=2 if cap else 0, **consts)
    torch.cumsum(count, 0, out=row_ptr[1:])
    if spec and rows:
        _launch_rows(q, scratch, cap, bufs["ei"], bufs["sh"], bufs["sv"], n * cap, row_block(cap))
    return q


def _launch_rows(q: _Queued, keys, src_stride, ei, sh, sv, capacity, block_r) -> None:
    n = q.common[0].shape[0]
    _rows_kernel[(n,)](
        keys, q.bufs["row_ptr"], q.image, q.batch, q.cell9, ei, sh, sv, q.bufs["hdr"], n, src_stride, capacity,
        SHIFT_BITS=SHIFT_BITS, BLOCK_R=block_r, num_warps=4 if block_r <= 256 else 8,
    )  # fmt: skip


def _complete(q: _Queued, geometry, max_row_sort: int, clone: bool = False) -> NeighborList | None:
    """The one sync of a queued call (:func:`_queue_pairs`), then what the header asks for: the speculative
    outputs as exact prefixes (``clone``: copied out of the buffers, which a CUDA graph owns), or the fill pass
    and the row sort. ``geometry()`` gives the Geometry of this call when the long-row fallback needs one."""
    bufs, cap, n = q.bufs, q.cap, q.common[0].shape[0]
    hdr, row_ptr, count = bufs["hdr"], bufs["row_ptr"], bufs["count"]
    device, dtype = row_ptr.device, q.cell9.dtype
    # The one sync that sizes the output. Speculative: every kernel is already queued (the GPU is not left idle
    # while the host allocates and launches the row sort), and the header holds all the host needs.
    if q.spec:
        non_finite, longest, n_edges = hdr.tolist()  # longest: 0 unless some row outgrew cap
    else:
        sizes = [row_ptr[-1], count.max(), hdr[0]]
        if q.check_reach:
            sizes.append((q.itab[:, 3:6] // q.itab[:, 0:3] + 1).max())
        n_edges, longest, non_finite, *max_reach = torch.stack(sizes).tolist()
        if max_reach and max_reach[0] >= SHIFT_BIAS:
            # Shifts would overflow the 10-bit fields of the pair keys (a cell ~500x thinner than the cutoff):
            # the caller falls back to the torch cell list, which has no such limit.
            return None
    if non_finite:
        raise ValueError("neighbor_list: non-finite positions (NaN or inf)")
    if n_edges == 0:
        return _empty(n, device, dtype)
    e = n_edges
    if q.spec:
        if not longest:  # the speculation held: the outputs are exact prefixes of the capacity buffers
            # as_strided: one view op per output (slice + view are two, each ~2 µs of host time on the H100 host).
            ei = bufs["ei"].as_strided((2, e), (e, 1))
            sh = bufs["sh"].as_strided((e, 3), (3, 1))
            sv = bufs["sv"].as_strided((e, 3), (3, 1))
            if clone:  # one allocation for the copies, as the plain path's list has
                out = carve(device, ei=((2, e), torch.int64), sh=((e, 3), torch.int64), sv=((e, 3), dtype),
                            row_ptr=((n + 1,), torch.int64))  # fmt: skip
                for name, src in (("ei", ei), ("sh", sh), ("sv", sv), ("row_ptr", row_ptr)):
                    out[name].copy_(src)
                ei, sh, sv, row_ptr = out["ei"], out["sh"], out["sv"], out["row_ptr"]
            return NeighborList(edge_index=ei, shifts=sh, shift_vectors=sv, row_ptr=row_ptr, method="cell_list")
        row_ptr = row_ptr.clone()  # some row outgrew cap: redo below, and let the speculative buffers go
        q = dataclasses.replace(q, bufs=dict(bufs, row_ptr=row_ptr))
    scratch = bufs.get("scratch")
    if cap and longest <= cap:
        keys, src_stride = scratch, cap
    else:  # no scratch, or some row outgrew it: the fill pass writes every row at row_ptr[i]
        keys, src_stride = torch.empty(n_edges, dtype=torch.int64, device=device), 0
        _pairs_kernel[(n,)](*q.common, q.cutoff_sq, count, row_ptr, keys, 0, hdr, FILL=1, **q.consts)

    # Under the CPU interpreter tl.sort is a Python-level bitonic network (seconds per row): sort with torch.
    if longest > max_row_sort or device.type != "cuda":
        if src_stride:  # the scratch rows, compacted in receiver order
            keys = keys.view(n, cap)[torch.arange(cap, device=device) < count[:, None]]
        return finish(geometry(), decode_keys(keys, row_ptr, count), "cell_list")
    edge_index = torch.empty(2, n_edges, dtype=torch.int64, device=device)
    shifts = torch.empty(n_edges, 3, dtype=torch.int64, device=device)
    shift_vectors = torch.empty(n_edges, 3, dtype=dtype, device=device)
    _launch_rows(q, keys, src_stride, edge_index, shifts, shift_vectors, n_edges, row_block(longest))
    return NeighborList(
        edge_index=edge_index, shifts=shifts, shift_vectors=shift_vectors, row_ptr=row_ptr, method="cell_list"
    )


# CUDA graphs of the periodic path. In MD and in benchmarks the list is rebuilt many times for the same cells
# (the same cached HostCells) and atom count, and on the H100 host its ~12 launches and ~40 torch ops cost about
# as much as its kernels (0.79 ms wall for 0.37 ms of kernels, 24,000-atom water box). From the second such call
# everything up to the sync (:func:`_queue_periodic`) is captured once into a torch.cuda.CUDAGraph, memoised in
# ``host.derived`` next to the bin tables; later calls copy the positions (and the batch vector, when it is another
# tensor or was modified) into the graph's static inputs, replay it and read the header as before. The returned
# list never aliases graph-owned memory, which the next replay overwrites:
#   "fresh": the graph stops at the row_ptr cumsum; the row sort is launched after the replay (before the sync,
#            so its launch overlaps the graph on the GPU) into a new allocation of capacity outputs plus a copy of
#            row_ptr; the list is prefixes of it, as on the plain speculative path (same memory price).
#   "clone": the row sort is in the graph too; after the sync the exact prefixes are copied out (one allocation
#            of the list's own size, 4 copies of ~64 bytes per pair after the sync; they are left queued on the
#            caller's stream, so a next call on another stream must be ordered after it by the caller).
# A graph holds its buffers for as long as its HostCells stays cached (at most 8, _common._HOST_CACHE): the
# working arrays (~170 bytes per atom + 8 * cap per atom of scratch rows) and in "clone" mode the capacity
# outputs (64 * cap bytes per atom, at most 64 * SPECULATE_MAX_PAIRS = 512 MiB). Graphs are only made for the
# speculative path (n * cap <= SPECULATE_MAX_PAIRS), and all live graphs together hold at most GRAPH_MAX_BYTES:
# beyond it the oldest graph is dropped and its cells use the plain path from then on (no recapture churn).
# Non-CUDA devices (the CPU interpreter) never get here.
CUDA_GRAPHS = os.environ.get("MLFF_DISTILLER_NL_GRAPHS", "1") != "0"
GRAPH_OUTPUTS = "fresh"  # or "clone"
GRAPH_MAX_BYTES = 1 << 30
_WARM, _OFF = "warm", "off"  # memo states: plain call seen once (kernels compiled); no graph for these cells
_NOT_REPLAYED = object()
_GRAPHS: list[tuple[weakref.ref, tuple, _Replay]] = []  # live graphs, oldest first: (HostCells, memo key, graph)


@dataclasses.dataclass(eq=False)
class _Replay:
    """A captured periodic call: the graph, its static inputs ``pos`` ``[N, 3]`` and ``batch`` ``[N]`` int64, the
    caller's batch tensor whose values ``batch`` holds (weak reference, version), the queued state ``q`` whose
    tensors the graph writes, and the bytes it holds."""

    graph: torch.cuda.CUDAGraph
    pos: torch.Tensor
    batch: torch.Tensor
    batch_seen: tuple
    q: _Queued
    nbytes: int


def graph_key(positions: torch.Tensor, cap: int, mode: str) -> tuple:
    """Memo key (in ``HostCells.derived``) of the graph of a periodic call: with the HostCells entry (cells, pbc,
    ptr, atom count, cutoff, device) it fixes every shape and table the graph holds."""
    return ("triton_periodic_graph", positions.device, positions.dtype, positions.shape[0], cap, mode)


def _replay_periodic(positions, cell, batch, host: HostCells, tables, max_row_sort: int):
    """The speculative periodic call as a graph replay (see above), or ``_NOT_REPLAYED`` (first call for these
    cells, capture failed or graph dropped): then the caller runs the plain path."""
    cap, n, mode = tables[3], positions.shape[0], GRAPH_OUTPUTS
    key = graph_key(positions, cap, mode)
    entry = host.derived.get(key)
    if entry is None:
        host.derived[key] = _WARM  # this call takes the plain path, which compiles every kernel the graph holds
        return _NOT_REPLAYED
    if entry is _OFF:
        return _NOT_REPLAYED
    if entry is _WARM:
        entry = _capture(positions, batch, host, tables, key, mode)
        if entry is None:
            return _NOT_REPLAYED
    else:
        entry.pos.copy_(positions.detach())
        seen, version = entry.batch_seen
        if seen() is not batch or version != batch._version:
            entry.batch.copy_(batch)
            entry.batch_seen = (weakref.ref(batch), batch._version)
    entry.graph.replay()
    q = entry.q
    if mode == "fresh":
        c, i64 = n * cap, torch.int64
        out = carve(
            positions.device, ei=((2 * c,), i64), sh=((3 * c,), i64), sv=((3 * c,), q.cell9.dtype),
            row_ptr=((n + 1,), i64),
        )  # fmt: skip
        out["row_ptr"].copy_(q.bufs["row_ptr"])
        q = dataclasses.replace(q, bufs={**q.bufs, **out})
        _launch_rows(q, q.bufs["scratch"], cap, out["ei"], out["sh"], out["sv"], c, row_block(cap))
    geometry = _fallback_geometry(q, positions, cell, batch, host)
    return _complete(q, geometry, max_row_sort, clone=mode == "clone")


def _capture(positions, batch, host: HostCells, tables, key: tuple, mode: str) -> _Replay | None:
    """Capture the periodic call (:func:`_queue_periodic`) of these cells into a graph, with the current positions
    and batch already in its static inputs, and memoise it; ``None`` (and the plain path from then on for these
    cells) when capture fails. The kernels were compiled by the plain call before it (the ``_WARM`` state)."""
    device = positions.device
    pos = torch.empty(positions.shape, dtype=positions.dtype, device=device)
    pos.copy_(positions.detach())
    sbatch = torch.empty(positions.shape[0], dtype=torch.int64, device=device)
    sbatch.copy_(batch)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.no_grad(), torch.cuda.device(device), capturing(graph, mode="thread_local"):
            q = _queue_periodic(pos, sbatch, tables, host.cutoff, spec=True, rows=mode == "clone")
    except Exception as exc:  # a torch or Triton version that cannot capture these launches: stay on the plain path
        host.derived[key] = _OFF
        warnings.warn(
            f"neighbor_list: CUDA graph capture of the periodic Triton cell list failed ({exc!r}); using the plain "
            "path for these cells",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    held = [pos, sbatch, q.image, q.wrapped, q.frac, *q.common, *q.bufs.values()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held if torch.is_tensor(t)}
    entry = _Replay(graph, pos, sbatch, (weakref.ref(batch), batch._version), q, sum(storages.values()))
    host.derived[key] = entry
    _remember(host, key, entry)
    return entry


def _remember(host: HostCells, key: tuple, entry: _Replay) -> None:
    """Register a new graph; drop the oldest ones while all together hold more than GRAPH_MAX_BYTES."""
    live = []
    for ref, k, e in _GRAPHS:
        h = ref()
        if h is not None and h.derived.get(k) is e:
            live.append((ref, k, e))
    live.append((weakref.ref(host), key, entry))
    while len(live) > 1 and sum(e.nbytes for _, _, e in live) > GRAPH_MAX_BYTES:
        ref, k, _ = live.pop(0)
        h = ref()
        if h is not None:
            h.derived[k] = _OFF
    _GRAPHS[:] = live


def live_graphs() -> list[tuple[tuple, int]]:
    """(memo key, bytes held) of each live graph of the periodic path, oldest first (for tests and benchmarks)."""
    return [(k, e.nbytes) for ref, k, e in _GRAPHS if ref() is not None and ref().derived.get(k) is e]


def _check_runnable(device: torch.device) -> None:
    if not triton_runnable(device):
        raise ValueError(
            f"neighbor_list: the Triton cell list cannot run on {device}: it needs CUDA with Triton, or CPU "
            "tensors under the Triton interpreter (TRITON_INTERPRET=1 set before triton is imported)"
        )
