"""Verlet skin: build the list with ``cutoff + skin``, reuse it until some atom has moved more than ``skin / 2``.

Why it is exact: if no atom moved more than ``skin / 2`` since the build, a pair now closer than ``cutoff``
was closer than ``cutoff + skin`` at the build, so it is in the padded list. The shifts ``S`` of the padded
list stay valid as long as the cell is unchanged and the positions move continuously (an atom wrapped back
into the cell by the caller jumps by a lattice vector, which trips the displacement test and rebuilds).

What a call returns (decided here, documented for the engine/calculator): by default (``filter=True``) the
padded list filtered to ``0 < |r| < cutoff`` with distances re-evaluated in float64 from the current
positions: the same pairs, in the same (i, j, S) order, with the same ``shifts``/``shift_vectors`` and CSR
``row_ptr`` as a fresh :func:`~mlff_distiller.neighbors.neighbor_list` at ``cutoff`` (up to pairs within
~1e-12 Å of the cutoff, where float64 rounding of two different formulas may disagree). Filtering costs one
pass over the padded edges and one host sync. With ``filter=False`` the padded list itself is returned
(pairs up to ``cutoff + skin``, no filtering work): correct for a model whose radial functions vanish at and
beyond ``cutoff`` (the student's cosine cutoff does), and cheaper, but the model then processes ~(1 +
skin/cutoff)^3 times more edges.

Rebuild triggers (all checked together with one host sync): first call; ``skin`` changed; a different
number of atoms/structures, device or dtype; any change in ``pbc``, ``batch``, ``ptr`` or ``numbers`` (when
given); any atom displaced by more than ``skin / 2`` (Å) from its position at the last build.

**A complete list** is kept whatever the displacements (``keep_complete``, on by default): when no structure has a
periodic direction and the build found every ordered pair of distinct atoms of each structure (``Σ n_b (n_b - 1)``
pairs: a molecule whose every pair was within ``cutoff + skin``, such as benzene, ethanol or butane at 5 Å), no pair
can be missing from it, so a rebuild could only drop pairs that contribute zero. An MD run of such a molecule then
builds its list once (``complete`` says so), where the displacement test rebuilt it every 10-200 steps (1.3-2.1 ms
each on the GPU path against ~0.19 for a kept step, ``results/stop66_gpu/k/``). The list filtered to ``cutoff``
(``filter=True``) is the fresh list's, as before; the unfiltered one holds the pairs beyond it.

**A changed cell** (NPT, cell relaxations) rebuilds unless the list can be kept under the strain (host data,
every structure fully periodic, ``strain_reuse``). The pair vectors are ``d = (s_j - s_i + S) h`` with
fractional positions ``s`` and cell ``h`` (rows the cell vectors). From the build (``d0``, ``h0``) to now
(``h1``), ``d1 = d0 (1 + ε) + u_j - u_i``, with the strain ``ε = h0⁻¹ (h1 - h0)`` and ``u = (s1 - s0) h1`` the
fractional displacement in today's cell. So ``|d1| >= |d0| (1 - ‖ε‖₂) - 2 max|u|``. A pair missing from the list
(``|d0| >= cutoff + skin``) stays beyond the cutoff as long as ``2 max|u| + (cutoff + skin) ‖ε‖₂ <= skin``, per
structure. That is the test. It reduces to the ``skin / 2`` test when the cell has not changed. When the list is
kept, its shift vectors are recomputed from the integer shifts and the new cell (``cell_updates`` counts that):
:meth:`needs_rebuild` records the new cell when it keeps the list, and the shift vectors are made when ``last``
or :meth:`filtered` is next read. A caller that makes them itself (the engine's padded path does, on the device,
from :meth:`shift_basis`) skips that host work. This is the same skin budget that LAMMPS'
neighbour check shares between atom and box displacements.

Usage (engine / StudentCalculator)::

    nl_cache = VerletNeighborList(cutoff=model.cutoff, skin=1.0)       # once, per calculator
    nl = nl_cache(positions, cell, pbc, batch, ptr, numbers=numbers)   # every step; a NeighborList
    nl_cache.n_builds, nl_cache.n_calls                                # statistics
    nl_cache.skin = 0.5                                                # settable; forces a rebuild
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from mlff_distiller.devices import KeptCopies
from mlff_distiller.neighbors._common import NeighborList

__all__ = ["NEAR_REBUILD_STEPS", "VerletNeighborList"]

# VerletNeighborList.near_rebuild: the list counts as near its rebuild where the largest displacement, grown this
# many more times by its growth between the last two tests, would reach the rebuild distance (skin / 2). A caller
# that prepares the next step without the host's look at its positions (ForceEngine.keep_chained) does so only
# short of that, so that the host's prediction, which rebuilds the list ahead where its positions need it, runs over
# the last steps before a rebuild.
NEAR_REBUILD_STEPS = 3.0


class VerletNeighborList:
    """A neighbour list reused across MD steps with a Verlet skin.

    Args:
        cutoff: interaction cutoff, Å (> 0); the returned lists hold pairs with ``0 < |r| < cutoff``.
        skin: extra radius, Å (>= 0); the list is built at ``cutoff + skin`` and rebuilt once some atom moved
            more than ``skin / 2``. ``0`` rebuilds whenever any atom moved at all.
        method: backend for the builds (``"auto"``, ``"brute"``, ``"cell_list"``, ``"vesin"``).
        filter: return the list filtered to ``cutoff`` (default) or the padded ``cutoff + skin`` list.
        strain_reuse: keep the list across cell changes within the skin (see the module docstring); ``False``
            rebuilds on any cell change.
        keep_complete: keep a complete list (every pair of every structure, none periodic) whatever the
            displacements (see the module docstring); ``False`` rebuilds it by the displacement test as any other.
        **neighbor_kwargs: passed to :func:`~mlff_distiller.neighbors.neighbor_list` (``cell_list_impl``,
            ``max_candidates``).

    Attributes:
        n_builds: lists built so far. ``n_calls``: calls so far. ``complete``: the last build holds every pair of
            every structure, none periodic (kept whatever the displacements, with ``keep_complete``). ``last``: the
            padded list of the last build (its shift vectors those of the current cell). ``cell_updates``: times
            the kept list took a new cell.
            ``pending_cell``: the cell whose shift vectors ``last`` will carry when next read, if not made yet.
    """

    def __init__(
        self,
        cutoff: float,
        skin: float = 1.0,
        method: str = "auto",
        *,
        filter: bool = True,
        strain_reuse: bool = True,
        keep_complete: bool = True,
        **neighbor_kwargs,
    ) -> None:
        cutoff = _distance("cutoff", cutoff)
        if cutoff <= 0:
            raise ValueError(f"VerletNeighborList: cutoff must be > 0 Å, got {cutoff}")
        self._cutoff = cutoff
        self.skin = skin
        self.method = method
        self.filter = bool(filter)
        self.strain_reuse = bool(strain_reuse)
        self.keep_complete = bool(keep_complete)
        self.neighbor_kwargs = neighbor_kwargs
        self.cell_updates = 0
        self._on_device = KeptCopies()  # _device_inputs; kept across reset (keyed by the tensors themselves)
        self.n_builds = 0
        self.n_calls = 0
        self._last: NeighborList | None = None
        self.pending_cell: np.ndarray | None = None

    # -------------------------------------------------------------------------------------------- settings
    @property
    def cutoff(self) -> float:
        """Interaction cutoff, Å (fixed at construction)."""
        return self._cutoff

    @property
    def skin(self) -> float:
        """Verlet skin, Å. Setting it invalidates the cached list (the next call rebuilds)."""
        return self._skin

    @skin.setter
    def skin(self, value: float) -> None:
        value = _distance("skin", value)
        if value < 0:
            raise ValueError(f"VerletNeighborList: skin must be >= 0 Å, got {value}")
        self._skin = value
        self.reset()

    def reset(self) -> None:
        """Forget the cached list; the next call rebuilds."""
        self._ref: dict[str, torch.Tensor] | None = None
        self._seen: dict[str, tuple[torch.Tensor, int]] = {}
        self._host: _HostDisplacement | None = None
        self._strain: _StrainTest | None = None
        self._applied_cell: np.ndarray | None = None
        self.complete = False
        self.last = None

    @property
    def last(self) -> NeighborList | None:
        """The padded list of the last build, with the shift vectors of the current cell (made now if a kept
        list took a new cell since they were last made)."""
        if self.pending_cell is not None:
            self._make_shift_vectors()
        return self._last

    @last.setter
    def last(self, nl: NeighborList | None) -> None:
        self._last, self.pending_cell = nl, None

    @property
    def topology(self) -> NeighborList | None:
        """``last`` without making a pending cell's shift vectors: its pairs, shifts and CSR are current, its
        ``shift_vectors`` those of an earlier cell while ``pending_cell`` is set. For callers that make the shift
        vectors themselves from :meth:`shift_basis` (the engine's padded path, on the device)."""
        return self._last

    def shift_basis(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(shifts [E, 3] float64, structure [E])`` of the padded list on its device: its shift vectors under any
        cell are ``shifts @ cell[structure]`` (row vectors), without reading ``last``."""
        return self._shifts64, self._edge_structure

    def __repr__(self) -> str:
        return (
            f"VerletNeighborList(cutoff={self.cutoff}, skin={self.skin}, method={self.method!r}, "
            f"filter={self.filter}, n_builds={self.n_builds}, n_calls={self.n_calls})"
        )

    # -------------------------------------------------------------------------------------------- calls
    def __call__(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        pbc: torch.Tensor,
        batch: torch.Tensor,
        ptr: torch.Tensor,
        numbers: torch.Tensor | None = None,
    ) -> NeighborList:
        """The neighbour list of the current positions (arguments as in
        :func:`~mlff_distiller.neighbors.neighbor_list`; ``numbers [N]`` optional, a change rebuilds)."""
        self.n_calls += 1
        with torch.no_grad():
            if self.needs_rebuild(positions, cell, pbc, batch, ptr, numbers):
                self._build(positions, cell, pbc, batch, ptr, numbers)
            if not self.filter:
                return self.last
            return self.filtered(positions)

    def update_batch(self, atoms_batch) -> NeighborList:
        """:meth:`__call__` of an :class:`~mlff_distiller.batch.AtomsBatch` (its numbers included)."""
        b = atoms_batch
        return self(b.positions, b.cell, b.pbc, b.batch, b.ptr, b.numbers)

    def needs_rebuild(self, positions, cell, pbc, batch, ptr, numbers=None) -> bool:
        """Whether the next call would rebuild (see the module docstring for the triggers)."""
        ref = self._ref
        if ref is None:
            return True
        # MD through the calculator: host positions, and the very same cell/pbc/batch/ptr/numbers objects as at
        # the last decision (not modified in place since). Only the displacement test is left: ~12 instead of
        # ~60 µs per call for 192 atoms on the 2-core development CPU (no dict / list building, no torch.equal,
        # no grad-mode context).
        if self.same_inputs(positions, cell, pbc, batch, ptr, numbers):
            return self.moved_far(positions)
        with torch.no_grad():
            return self._needs_rebuild(positions, cell, pbc, batch, ptr, numbers)

    def moved_far(self, positions) -> bool:
        """:meth:`needs_rebuild`'s answer for a caller that found :meth:`same_inputs` true of these positions and
        the other inputs: the displacement test alone (none for a complete list)."""
        return not self._keeps_complete() and self._host.moved_far(positions, 0.5 * self.skin)

    def near_rebuild(self, steps: float = NEAR_REBUILD_STEPS) -> bool:
        """Whether the list may rebuild within the next ``steps`` steps: the largest displacement from the build
        that the last displacement test on host positions found, ``d``, plus ``steps`` times its growth since the
        test before (on other positions), reaches half the skin; or fewer than two such tests ran since the build.
        Never for a complete list (kept whatever the motion). A hint for a caller that prepares a step ahead
        (``ForceEngine.keep_chained``); the decision to rebuild is :meth:`needs_rebuild`'s."""
        if self._keeps_complete():
            return False
        host = self._host
        if host is None or not math.isfinite(host.prev_sq):
            return True
        d = math.sqrt(host.last_sq)
        return not d + steps * max(d - math.sqrt(host.prev_sq), 0.0) < 0.5 * self.skin

    def same_inputs(self, positions, cell, pbc, batch, ptr, numbers=None) -> bool:
        """Whether these arguments differ from the last decision's in the positions' values alone: host positions
        of the build's shape and dtype, and the very same cell/pbc/batch/ptr/numbers objects, not modified in place
        since (the calculator's MD steps). Then only the displacement test decides a rebuild (a caller that ran it
        on these very positions may skip it)."""
        host = self._host
        return (
            host is not None
            and self._ref is not None
            and isinstance(positions, torch.Tensor)
            and positions.dtype is host.dtype
            and positions.is_cpu
            and positions.shape == host.shape
            and host.same_inputs(cell, pbc, batch, ptr, numbers)
        )

    def _needs_rebuild(self, positions, cell, pbc, batch, ptr, numbers) -> bool:
        ref = self._ref
        current = {"positions": positions, "cell": cell, "pbc": pbc, "batch": batch, "ptr": ptr}
        if numbers is not None:
            current["numbers"] = numbers
        if current.keys() != ref.keys() - {"shift64"}:
            return True
        # Tensors seen unchanged before (the very same object, not modified in place since) need no compare:
        # a caller that passes the same numbers/cell/pbc/batch/ptr every MD step pays for positions only.
        seen = self._seen
        unseen = [n for n in current if n != "positions" and not _same_object(seen.get(n), current[n])]
        for name in ("positions", *unseen):
            t, old = current[name], ref[name]
            if not isinstance(t, torch.Tensor) or t.shape != old.shape or t.device != old.device:
                return True
            if t.dtype != old.dtype:
                return True
        if positions.device.type == "cpu":
            # Host data (MD through the calculator): NumPy on the same memory, ~10x fewer µs than torch's CPU ops
            # on a few hundred atoms.
            changed = [n for n in unseen if not torch.equal(current[n], ref[n])]
            if changed == ["cell"] and self.strain_reuse and ref["cell"].device.type == "cpu":
                # Only the cell: keep the list if the strain and the displacements fit in the skin together.
                strain = self._strain or _StrainTest.of(ref, self.cutoff + self.skin)
                self._strain = strain
                if strain is None or not strain.fits(positions, cell, self.skin):
                    return True
                self._apply_cell(cell)
                # Not remembered as seen: the next call tests its cell against the build's again (the fast
                # path's plain displacement test is valid only for the build's cell).
                seen.update({n: (current[n], current[n]._version) for n in unseen if n != "cell"})
                seen.pop("cell", None)
                if self._host is not None:
                    self._host.remember(seen, "numbers" in current)
                return False
            rebuild = bool(changed)
            if not rebuild and not self._keeps_complete():
                host = self._host
                if host is not None:
                    rebuild = host.moved_far(positions, 0.5 * self.skin)
                elif positions.shape[0]:
                    d = positions.detach().numpy().astype(np.float64) - ref["positions"].numpy()
                    rebuild = bool((d * d).sum(axis=1).max() > (0.5 * self.skin) ** 2)
            if not rebuild:
                if self._applied_cell is not None:
                    self._apply_cell(cell)  # back to the build's cell
                seen.update({n: (current[n], current[n]._version) for n in unseen})
                if self._host is not None:
                    self._host.remember(seen, "numbers" in current)
            return rebuild
        changed = [(current[n] != ref[n]).any() for n in unseen]
        if self._keeps_complete() or not positions.shape[0]:
            moved_far = torch.zeros((), dtype=torch.bool, device=positions.device)
        else:
            moved = (positions.to(torch.float64) - ref["positions"].to(torch.float64)).square().sum(dim=1)
            moved_far = (moved > (0.5 * self.skin) ** 2).any()
        # One host sync for all triggers together.
        rebuild = bool(torch.stack([*changed, moved_far]).any())
        if not rebuild:
            seen.update({n: (current[n], current[n]._version) for n in unseen})
        return rebuild

    @torch.no_grad()
    def rebuild(self, positions, cell, pbc, batch, ptr, numbers=None, *, device=None) -> NeighborList:
        """Build the padded (``cutoff + skin``) list now and return it (``last``).

        ``device``: build there instead of on the arguments' device (e.g. host data, GPU build); the reference
        positions of the displacement test stay with the arguments, so :meth:`needs_rebuild` on host tensors
        never synchronises with the GPU.
        """
        self._build(positions, cell, pbc, batch, ptr, numbers, device=device)
        return self.last

    def _build(self, positions, cell, pbc, batch, ptr, numbers, device=None) -> None:
        from mlff_distiller.neighbors import neighbor_list

        args = (positions, cell, pbc, batch, ptr)
        if device is not None and torch.device(device) != positions.device:
            args = (positions.to(device), *self._device_inputs((cell, pbc, batch, ptr), torch.device(device)))
        nl = neighbor_list(*args, self.cutoff + self.skin, self.method, **self.neighbor_kwargs)
        ref = {
            "positions": positions.detach().clone(),
            "cell": cell.detach().clone(),
            "pbc": pbc.clone(),
            "batch": batch.clone(),
            "ptr": ptr.clone(),
        }
        if numbers is not None:
            ref["numbers"] = numbers.clone()
        given = {"cell": cell, "pbc": pbc, "batch": batch, "ptr": ptr, "numbers": numbers}
        self._seen = {n: (t, t._version) for n, t in given.items() if t is not None}
        self._host = _HostDisplacement.of(ref["positions"], self._seen, numbers is not None)
        # float64 shift vectors of the padded list for the cutoff test (the returned ones keep the caller's
        # dtype): the fresh list decides in float64 too.
        i = nl.edge_index[0]
        cell64, batch_b = args[1].detach().to(torch.float64), args[3]
        self._edge_structure = batch_b[i]
        self._shifts64 = nl.shifts.to(torch.float64)
        if nl.method == "molecular":  # zero shifts by construction (no periodic direction): no [E, 3, 3] product
            ref["shift64"] = torch.zeros_like(self._shifts64)
        else:
            ref["shift64"] = torch.einsum("ea,eab->eb", self._shifts64, cell64[self._edge_structure])
        self._ref = ref
        self._strain = None
        self._applied_cell = None  # the cell of the current shift vectors when it is not the build's (NPT)
        self.complete = _holds_every_pair(nl, pbc, ptr)  # (the caller's: on the host in MD, no device read)
        self.last = nl
        self.n_builds += 1

    def _device_inputs(self, tensors: tuple, device: torch.device) -> tuple:
        """Copies of the caller's cell, pbc, batch and ptr on ``device`` for a build there, kept while the caller
        passes the very same tensors, unmodified (MD through the calculator): a periodic box's rebuild then
        copies its positions alone, and the list's host geometry (``host_cells``, cached by tensor) is found
        again instead of read back from the device. Each copy of a host tensor is a wait for the device."""
        return self._on_device(tensors, device)

    def _keeps_complete(self) -> bool:
        """The list is kept whatever the displacements: it holds every pair (see the module docstring)."""
        return self.complete and self.keep_complete

    def _apply_cell(self, cell: torch.Tensor) -> None:
        """The kept list takes ``cell``: its shift vectors are made from the integer shifts when ``last`` or
        :meth:`filtered` is next read (``pending_cell``), unless they already are those of ``cell``."""
        values = cell.detach().numpy().astype(np.float64)
        applied = self._applied_cell
        if applied is not None and np.array_equal(applied, values):
            return
        build_cell = self._ref["cell"]
        if applied is None and torch.equal(cell, build_cell):
            return
        self.pending_cell = values
        self._applied_cell = None if torch.equal(cell, build_cell) else values
        self.cell_updates += 1

    def _make_shift_vectors(self) -> None:
        values, nl = self.pending_cell, self._last
        cell64 = torch.from_numpy(values).to(nl.shifts.device)
        if values.shape[0] == 1:  # one structure: one [E, 3] x [3, 3] product
            shift64 = self._shifts64 @ cell64[0]
        else:
            shift64 = torch.einsum("ea,eab->eb", self._shifts64, cell64[self._edge_structure])
        self._ref["shift64"] = shift64
        self.last = replace(nl, shift_vectors=shift64.to(nl.shift_vectors.dtype))  # (clears pending_cell)

    def filtered(self, positions: torch.Tensor) -> NeighborList:
        """The last built list cut down to ``0 < |r| < cutoff`` at ``positions`` (on the list's device)."""
        nl = self.last  # first: it makes a pending cell's shift vectors (and ref["shift64"])
        ref = self._ref
        i, j = nl.edge_index
        pos = positions.detach().to(torch.float64)
        d2 = (pos.index_select(0, j) - pos.index_select(0, i) + ref["shift64"]).square().sum(dim=1)
        keep = (d2 > 0) & (d2 < self.cutoff**2)
        kept = torch.nonzero(keep).squeeze(1)
        # Rows stay contiguous and ordered under filtering; the new offsets are the running kept-counts at
        # the old offsets.
        running = torch.zeros(keep.shape[0] + 1, dtype=torch.int64, device=keep.device)
        torch.cumsum(keep, 0, dtype=torch.int64, out=running[1:])
        return NeighborList(
            edge_index=nl.edge_index.index_select(1, kept),
            shifts=nl.shifts.index_select(0, kept),
            shift_vectors=nl.shift_vectors.index_select(0, kept),
            row_ptr=running[nl.row_ptr],
            method=nl.method,
        )


def _holds_every_pair(nl: NeighborList, pbc: torch.Tensor, ptr: torch.Tensor) -> bool:
    """Whether ``nl`` holds every ordered pair of distinct atoms of each structure, none of them periodic: then no
    pair can be missing from it, whatever the atoms do. A list without duplicates or self-pairs (which the builds
    never make) has ``Σ n_b (n_b - 1)`` pairs exactly then. One small host read where the list is on a GPU, at a
    build (which reads its pair count anyway)."""
    counts = (ptr[1:] - ptr[:-1]).to(torch.int64)
    expected = counts * (counts - 1)
    return not bool(pbc.any()) and nl.num_edges == int(expected.sum())


class _HostDisplacement:
    """The displacement test on host positions (float32 or float64 CPU tensors), in NumPy with preallocated
    float64 buffers: ``|x - x_build|^2 > (skin / 2)^2`` for some atom, the same float64 values and the same
    decision as the generic CPU path (``(d * d).sum(axis=1).max()``; the row sums in the same order,
    ``(dx^2 + dy^2) + dz^2``). Also remembers the other inputs of the last build or no-rebuild decision (identity
    and in-place version), so that a call with those same objects skips straight to the positions."""

    __slots__ = ("cols", "diff", "dtype", "inputs", "last_sq", "prev_sq", "ref", "shape", "sq", "versions")

    @classmethod
    def of(cls, ref_positions: torch.Tensor, seen: dict, has_numbers: bool) -> _HostDisplacement | None:
        if ref_positions.device.type != "cpu" or ref_positions.dtype not in (torch.float32, torch.float64):
            return None
        return cls(ref_positions, seen, has_numbers)

    def __init__(self, ref_positions: torch.Tensor, seen: dict, has_numbers: bool) -> None:
        self.dtype = ref_positions.dtype
        self.shape = ref_positions.shape
        self.ref = ref_positions.numpy().astype(np.float64)  # float32 -> float64 is exact
        self.diff = np.empty_like(self.ref)
        self.cols = (self.diff[:, 0], self.diff[:, 1], self.diff[:, 2]) if self.ref.shape[1:] == (3,) else None
        self.sq = np.empty(self.ref.shape[0])
        # The largest squared displacement the last test found, and the one before on other positions (none: inf).
        self.last_sq = self.prev_sq = math.inf
        self.remember(seen, has_numbers)

    def remember(self, seen: dict, has_numbers: bool) -> None:
        """The cell/pbc/batch/ptr(/numbers) objects now known unchanged (``VerletNeighborList._seen``)."""
        names = ("cell", "pbc", "batch", "ptr", "numbers") if has_numbers else ("cell", "pbc", "batch", "ptr")
        entries = [seen.get(n) for n in names]
        if any(e is None for e in entries):
            self.inputs, self.versions = None, None
            return
        self.inputs = (*(e[0] for e in entries), *((None,) if not has_numbers else ()))
        self.versions = tuple(e[1] for e in entries)

    def same_inputs(self, cell, pbc, batch, ptr, numbers) -> bool:
        k = self.inputs
        if k is None or cell is not k[0] or pbc is not k[1] or batch is not k[2] or ptr is not k[3]:
            return False
        if numbers is not k[4]:
            return False
        if numbers is None:
            return (cell._version, pbc._version, batch._version, ptr._version) == self.versions
        return (cell._version, pbc._version, batch._version, ptr._version, numbers._version) == self.versions

    def moved_far(self, positions: torch.Tensor, half_skin: float) -> bool:
        """Some atom of ``positions`` (shape and dtype of the build's) is further than ``half_skin`` from its
        position at the build. Keeps the largest squared displacement in ``last_sq`` (the one before in
        ``prev_sq``, unless this one is the same: a second test of the same positions)."""
        if not self.shape[0]:
            self.last_sq = self.prev_sq = 0.0
            return False
        p = positions.detach().numpy() if positions.requires_grad else positions.numpy()
        d, s = self.diff, self.sq
        np.subtract(p, self.ref, out=d)
        np.multiply(d, d, out=d)
        if self.cols is None:  # not [N, 3]: the generic row sum
            np.add.reduce(d, axis=1, out=s)
        else:
            x, y, z = self.cols
            np.add(x, y, out=s)
            np.add(s, z, out=s)
        sq = float(np.maximum.reduce(s))
        if sq != self.last_sq:
            self.prev_sq, self.last_sq = self.last_sq, sq
        return sq > half_skin**2


class _StrainTest:
    """The strain-aware reuse test on host data (float64 NumPy): per structure, ``2 max|u| + reach ‖ε‖₂ <= skin``
    with ``ε = h0⁻¹ (h1 - h0)`` and ``u = (s1 - s0) h1`` (see the module docstring; ``reach = cutoff + skin``)."""

    __slots__ = ("batch", "cell0", "frac0", "inv0", "reach", "single")

    @classmethod
    def of(cls, ref: dict, reach: float) -> _StrainTest | None:
        """``None`` (rebuild on any cell change) unless every structure is fully periodic with a regular cell."""
        pbc = ref["pbc"]
        if pbc.device.type != "cpu" or not bool(pbc.all()) or ref["positions"].device.type != "cpu":
            return None
        cell0 = ref["cell"].numpy().astype(np.float64)
        try:
            inv0 = np.linalg.inv(cell0)
        except np.linalg.LinAlgError:
            return None
        return cls(ref, cell0, inv0, reach)

    def __init__(self, ref: dict, cell0: np.ndarray, inv0: np.ndarray, reach: float) -> None:
        self.cell0, self.inv0, self.reach = cell0, inv0, reach
        self.batch = ref["batch"].numpy()
        self.single = cell0.shape[0] == 1
        self.frac0 = self._frac(ref["positions"].numpy().astype(np.float64), inv0)

    def _frac(self, positions: np.ndarray, inv: np.ndarray) -> np.ndarray:
        if self.single:
            return positions @ inv[0]
        return np.einsum("ni,nij->nj", positions, inv[self.batch])

    def fits(self, positions: torch.Tensor, cell: torch.Tensor, skin: float) -> bool:
        cell1 = cell.detach().numpy().astype(np.float64)
        if cell1.shape != self.cell0.shape or not np.isfinite(cell1).all():
            return False
        if self.single:
            return self._fits_one(positions, cell1[0], skin)
        try:
            inv1 = np.linalg.inv(cell1)
        except np.linalg.LinAlgError:
            return False
        eps = np.linalg.norm(self.inv0 @ (cell1 - self.cell0), ord=2, axis=(1, 2))  # [B]
        frac = self._frac(positions.detach().numpy().astype(np.float64), inv1) - self.frac0
        u = frac @ cell1[0] if self.single else np.einsum("ni,nij->nj", frac, cell1[self.batch])
        u2 = (u * u).sum(axis=1)
        worst = np.zeros(eps.shape[0])
        if u2.size:
            np.maximum.at(worst, self.batch, u2)
        return bool(np.all(2.0 * np.sqrt(worst) + self.reach * eps <= skin))

    def _fits_one(self, positions: torch.Tensor, cell1: np.ndarray, skin: float) -> bool:
        """:meth:`fits` for one structure (MD and NPT through the calculator, every call): the 3 x 3 algebra in
        Python floats and ``u = x1 - s0 h1`` (= ``(s1 - s0) h1``, no inverse of ``h1``): no LAPACK call, ~2x
        fewer µs than the batched form on the development CPU (31 vs 63 µs, 192 atoms)."""
        h1 = cell1.tolist()
        if _det3(h1) == 0.0:
            return False  # a singular cell: rebuild (the list's own checks then name the problem)
        h0, inv0 = self.cell0[0].tolist(), self.inv0[0].tolist()
        diff = [[h1[r][k] - h0[r][k] for k in range(3)] for r in range(3)]
        eps = [[sum(inv0[r][m] * diff[m][k] for m in range(3)) for k in range(3)] for r in range(3)]
        x1 = positions.detach().numpy()
        u = x1.astype(np.float64) - self.frac0 @ cell1
        worst = float(np.einsum("ij,ij->i", u, u).max()) if u.shape[0] else 0.0
        return 2.0 * math.sqrt(worst) + self.reach * _spectral_norm3(eps) <= skin


def _det3(m: list[list[float]]) -> float:
    (a, b, c), (d, e, f), (g, h, i) = m
    return a * (e * i - f * h) - b * (d * i - f * g) + c * (d * h - e * g)


def _spectral_norm3(m: list[list[float]]) -> float:
    """‖m‖₂ of a 3 x 3 matrix (Python floats): the square root of the largest eigenvalue of ``mᵀm``, from the
    closed form for symmetric 3 x 3 matrices (Smith 1961), instead of LAPACK's SVD for one tiny matrix."""
    cols = list(zip(*m, strict=True))
    a = [[sum(x * y for x, y in zip(cols[r], cols[k], strict=True)) for k in range(3)] for r in range(3)]  # mᵀm
    p1 = a[0][1] ** 2 + a[0][2] ** 2 + a[1][2] ** 2
    q = (a[0][0] + a[1][1] + a[2][2]) / 3.0
    if p1 == 0.0:
        top = max(a[0][0], a[1][1], a[2][2])
    else:
        p = math.sqrt(((a[0][0] - q) ** 2 + (a[1][1] - q) ** 2 + (a[2][2] - q) ** 2 + 2.0 * p1) / 6.0)
        if p == 0.0:
            top = q
        else:
            r = _det3([[(a[k][j] - (q if k == j else 0.0)) / p for j in range(3)] for k in range(3)]) / 2.0
            top = q + 2.0 * p * math.cos(math.acos(min(1.0, max(-1.0, r))) / 3.0)
    return math.sqrt(max(top, 0.0))


def _same_object(entry: tuple[torch.Tensor, int] | None, t: torch.Tensor) -> bool:
    return entry is not None and entry[0] is t and entry[1] == t._version


def _distance(name: str, value) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"VerletNeighborList: {name} must be a number (Å), got {value!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"VerletNeighborList: {name} must be finite, got {value}")
    return value
