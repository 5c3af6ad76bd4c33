"""The MD path of :class:`~mlff_distiller.engine.ForceEngine`: a Verlet-skin list kept in a padded bucket's static
buffers across the steps of one trajectory (``_compute_padded_verlet``), its fill on the host or the device, the
speculative step, the zero-copy step (``_md_launch``) and the step launched ahead for the calculator's predicted
positions (``launch_ahead``).

``VerletPaths`` is a mixin of ``ForceEngine`` beside :class:`~mlff_distiller.engine_padded.PaddedPaths`, whose
bucket, graph and runner helpers it calls (kept in its own module for size since stop 68).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from mlff_distiller._md_chain import MDChain
from mlff_distiller.batch import AtomsBatch, pair_vectors64
from mlff_distiller.buckets import HOST_FILL_MAX_EDGES, Bucket, PaddedGraph, fill_padded, fill_padded_host
from mlff_distiller.cudagraph import (
    HostBuffer,
    copy_bits,
    current_stream_cached,
    host_views_work,
    synchronize_current_stream,
)
from mlff_distiller.engine_padded import _EagerRunner, _verlet_args, _with_stress, exact_pairs, unpack

__all__ = ["VERLET_EDGE_HEADROOM", "ZERO_COPY_COUNTS_PER_BUCKET", "ZERO_COPY_MAX_ATOMS", "VerletPaths"]

# Spare edge slots of a new bucket on the MD (Verlet) path, as a factor of the list's edges.
VERLET_EDGE_HEADROOM = 1.1
# The MD path's zero-copy step (VerletPaths._md_launch) for buckets of at most this many atoms: there the two DMA
# copies are a sizable part of a step (benzene 6 %, 192 water atoms 4.5 %, results/stop66_gpu/b/); a larger step
# is long against them, and its output would cross the bus from one elementwise kernel.
ZERO_COPY_MAX_ATOMS = 4096
# Zero-copy steps per bucket (one per atom count, each a captured graph with its own memory pool): further atom
# counts in the bucket take its plain graph, shared by every count, so that MD over many molecules of one size class
# with one calculator keeps a bounded number of pools.
ZERO_COPY_COUNTS_PER_BUCKET = 2


class _VerletFill(NamedTuple):
    """What the padded Verlet path keeps about the list now in a bucket's static buffers."""

    bucket: Bucket
    graph: PaddedGraph
    builds: int  # the list's build count when it was written
    positions: torch.Tensor  # the real atoms' rows of the static positions
    staging: torch.Tensor | None  # their page-locked host staging buffer (CUDA)
    cell_updates: int  # the list's cell updates when its shift vectors were written
    shifts: torch.Tensor  # [E, 3] integer shifts (engine dtype) on the device, for later cells' shift vectors
    structure: torch.Tensor | None  # [E] each pair's structure (None: one structure)
    cell: torch.Tensor  # [B, 3, 3] the cell on the device
    exact: bool = False  # float64 pair vectors (AtomsBatch.positions64): written as shift vectors every step


class _MDStep(NamedTuple):
    """A Verlet bucket's zero-copy step (:meth:`VerletPaths._md_launch`) for one atom count."""

    runner: object  # GraphRunner, or _EagerRunner where the capture failed
    positions: HostBuffer  # [n, 3] the step's real positions, read by the step
    packed: HostBuffer  # the packed output (as ``_step``'s), written by the step
    dense: bool = False  # the captured step is the dense step (PaddedPaths._dense_of)


class _Launch(NamedTuple):
    """The step launched ahead (``ForceEngine._ahead``): what the next call checks before it takes it."""

    md: _MDStep  # the zero-copy step launched (the bucket's own, or one of an MDChain's two)
    builds: int  # the list's build count at the launch
    cell_updates: int  # and its cell updates
    tested: bool  # the launch ran the displacement test on these positions
    # The launched positions (the calculator's batch hands the same tensor back); None for a chained step kept
    # without the caller's prediction (keep_chained): its positions are the device's, compared after its wait.
    tensor: torch.Tensor | None
    version: int | None  # the tensor's _version at the launch
    parity: int | None = None  # a chained step's (chain_ahead): its positions predicted on the device
    event: object = None  # recorded after it where a chained step was queued behind it (waited for, not the stream)


class _Chained(NamedTuple):
    """The chained step queued in this call (:meth:`VerletPaths.chain_ahead`), until ``launch_ahead`` keeps it."""

    chain: MDChain
    source: _MDStep  # the step it read its forces from (this call must take it)
    parity: int
    call: int  # the engine call it was queued for (``_n_computes`` of that call)


def _same_key(a: tuple, b: tuple) -> bool:
    """Two :meth:`VerletPaths._takeable_key` tuples are the same: their objects by identity (a tensor's ``==`` is
    elementwise), their numbers by value."""
    return a[0] is b[0] and a[1] is b[1] and a[2] is b[2] and a[4] is b[4] and a[3] == b[3] and a[5:] == b[5:]


class VerletPaths:
    def _compute_padded_verlet(
        self, batch: AtomsBatch, to_host: bool, as_numpy: bool = False, stress: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """The padded path with a Verlet-skin list (MD through :class:`StudentCalculator`).

        The displacement test runs on the caller's tensors (host data in MD: no device sync per step). The
        unfiltered ``cutoff + skin`` list goes into the bucket's static buffers only when it was rebuilt: its
        pairs beyond the cutoff contribute exactly zero, like padding edges (the radial basis × envelope and
        its derivative vanish there and the filter has no bias). Between rebuilds a step is one copy of the
        positions into the static buffer, the replay, and one copy of the packed outputs; after a cell change
        that kept the list (NPT: the list's strain-aware test), also one copy of its new shift vectors.
        ``stress``: the stress step (tensors out; ``as_numpy`` is for the energy + forces step). A stress call
        speculates only when its cell is the very tensor of the previous call (NPT's second calculation of a
        step, after the positions moved; its first follows a cell change, and would be discarded). An energy +
        forces call does not speculate on a cell known to be new: another tensor on the host whose values differ
        (the calculator makes a new one on each cell change; NPT's first calculation of a step, which comes
        without the stress since the calculator leaves out stresses that go unread).
        """
        self._verlet_list_order(False)  # the caller's order (a list built sorted by the eager path is dropped)
        v = self.verlet
        exact = batch.positions64 is not None and self.dtype != torch.float64
        fill = self._verlet_fill
        if fill is not None and fill.exact != exact:  # the batch crossed PRECISE_PAIRS_FROM: fill the bucket again
            fill = self._verlet_fill = None
        packed = md = None
        zero_copy = self._zero_copy_for(batch, to_host, stress, exact)
        prev, cell = self._spec_cell, batch.cell
        same_cell = cell is prev
        new_cell = not same_cell and (
            prev is None
            or prev.shape != cell.shape
            or (prev.device.type == "cpu" and cell.device.type == "cpu" and not torch.equal(prev, cell))
        )
        self._spec_cell = cell
        if (
            fill is not None
            and fill.builds == v.n_builds
            and fill.positions.shape[0] == batch.num_atoms
            and (same_cell if stress else not new_cell)
        ):
            if self._speculates(fill, batch):
                # The usual MD step: the list in the buffers is still the current one. Its step is launched now and
                # the displacement test below runs while the device computes; if the test asks for a rebuild (or
                # the batch is another system), this result is discarded and the rebuilt step follows it in stream
                # order. The launch reads only in-range atoms (same atom count), so a stale list is harmless.
                if zero_copy:
                    packed = md = self._take_ahead(fill, batch) or self._md_launch(fill, batch)
                if md is None:
                    self._write_step(fill, batch, to_host)
                    packed = self._run(fill.bucket, fill.graph, stress)
                self.n_speculated += 1
                self._overlap()  # the caller's host work, while the device computes
        # The list's topology: a kept list's shift vectors under a new cell are made below, on the device.
        if self._ahead_tested and md is not None and v.same_inputs(*_verlet_args(batch)):
            # The step launched ahead, taken: its launch ran the displacement test on these very positions (and
            # rebuilt the list there if they crossed the half skin), with these same other inputs.
            v.n_calls += 1
            nl, rebuilt = v.topology, False
        else:
            nl, rebuilt = self._verlet_list(batch, filtered=False, shift_vectors=False)
        n, b, e = batch.num_atoms, batch.num_structures, nl.num_edges
        if packed is not None and fill.cell_updates != v.cell_updates:
            self.n_discarded += 1  # launched with the shift vectors of the previous cell
            packed = md = None
        if rebuilt or fill is None or fill.builds != v.n_builds:
            if packed is not None:
                self.n_discarded += 1
                packed = md = None
            fill = self._fill_verlet(batch, fill, exact)
            if fill is None:
                return None  # beyond the largest bucket: eager fallback
            bucket, graph, kept = fill.bucket, fill.graph, False
        else:
            bucket, graph, kept = fill.bucket, fill.graph, True
            if fill.cell_updates != v.cell_updates:  # the list was kept under a new cell: its shift vectors changed
                self._write_shift_vectors(fill, batch.cell, graph.shift_vectors[:e])
                self._verlet_fill = fill = fill._replace(cell_updates=v.cell_updates)
        if packed is None and zero_copy:
            # (After a discarded speculative launch, this writes the same positions into the buffer that launch may
            # still be reading: the same bytes.)
            packed = md = self._md_launch(fill, batch)
        if md is not None:
            return self._md_results(md, bucket, n, b, as_numpy)
        if packed is None and kept:  # (a rebuild's fill wrote the positions)
            self._write_step(fill, batch, to_host)
        if stress:
            out = self._run_padded(bucket, graph, n, b, to_host, packed=packed, stress=True)
            return _with_stress(out, batch if to_host else batch.to(self.device, self.dtype))
        return self._run_padded(bucket, graph, n, b, to_host, as_numpy, packed=packed)

    def _fill_verlet(self, batch: AtomsBatch, fill: _VerletFill | None, exact: bool) -> _VerletFill | None:
        """Write the Verlet list just built (``verlet.last``) and ``batch`` into a bucket's static buffers; the new
        ``_verlet_fill``, or None where the list fits no bucket (the eager path runs it)."""
        v = self.verlet
        n, b, e = batch.num_atoms, batch.num_structures, v.topology.num_edges
        # MD keeps its bucket while the new list fits (no flip-flop between two captured shapes), and a new one is
        # chosen with VERLET_EDGE_HEADROOM spare edges: the list's length drifts over a trajectory, and each new
        # bucket costs a capture (~2 s once), while spare edge slots cost almost nothing (no CSR row holds them:
        # the message-passing kernels skip them).
        same_atoms = fill is not None and fill.positions.shape[0] == n
        bucket = fill.bucket if same_atoms and fill.bucket.fits(n, e) else None
        if bucket is None:
            bucket = self.buckets.select(n, math.ceil(e * VERLET_EDGE_HEADROOM)) or self.buckets.select(n, e)
        if bucket is None:
            self._verlet_fill = None
            return None
        graph = self._graph(bucket)
        nl = v.last  # with the current cell's shift vectors (made now if a cell is pending)
        shifts, structure = v.shift_basis()
        if (
            nl.method == "molecular"
            and not exact
            and bucket.edges <= HOST_FILL_MAX_EDGES
            and batch.positions.device.type == "cpu"
            and nl.edge_index.device.type == "cpu"
            and batch.positions.dtype == self.dtype
        ):
            # A molecule's list, built on the host (zero shifts): the bucket's whole content made there and sent in
            # two transfers (fill_padded_host, as the plain padded path fills small molecular graphs), instead of the
            # batch's and the list's ~10 copies (each a wait for the device) and the device fill's ~20 operations.
            # Stop 66 measured no gain from it (results/stop66_gpu/j/), in calls whose rebuild waited first for a
            # launched step on the old list. Since a launch ahead rebuilds before it launches (rebuild_ahead),
            # nothing is in flight there: one stream sync a rebuild instead of ten, rebuild steps 0.5-0.6 ms shorter
            # for 24-60-atom molecules on an H200 (results/stop67_gpu/c/, d/).
            fill_padded_host(
                graph,
                batch.numbers.numpy(),
                batch.positions.numpy(),
                batch.batch.numpy(),
                b,
                nl.edge_index.numpy(),
                nl.row_ptr.numpy(),
            )
            shifts = torch.zeros(shifts.shape, dtype=self.dtype, device=self.device)  # (zero by construction)
        else:
            if exact:  # float64 pair vectors as the shift vectors, zero positions (rewritten every step)
                dev = batch.to(self.device, self.dtype)
                with torch.no_grad():  # (a molecule's list is built on the host: its pairs go to the device first)
                    dev, nl = exact_pairs(dev, self._nl_to_device(nl))
                numbers, positions, structures = dev.numbers, dev.positions, dev.batch
            else:
                numbers, structures = self._fill_inputs(batch.numbers, batch.batch)
                wide = batch.positions64 is not None and self.dtype == torch.float64  # (as AtomsBatch.to takes them)
                positions = (batch.positions64 if wide else batch.positions).to(self.device, self.dtype)
            sv = nl.shift_vectors.to(self.dtype)
            molecule = nl.method == "molecular" and not exact  # (exact: zero positions, the pairs in the shifts)
            fill_padded(graph, numbers, positions, structures, b, nl.edge_index, sv, molecule=molecule)
            shifts = shifts.to(self.device, self.dtype)
        self._graph_tokens[bucket] = -1  # the other padded path must rewrite everything in this bucket
        pinned = graph.positions.is_cuda
        self._verlet_fill = fill = _VerletFill(
            bucket=bucket,
            graph=graph,
            builds=v.n_builds,
            positions=graph.positions[:n],
            staging=torch.empty((n, 3), dtype=self.dtype, pin_memory=True) if pinned else None,
            cell_updates=v.cell_updates,
            shifts=shifts,
            structure=structure.to(self.device) if b > 1 else None,
            cell=torch.empty((b, 3, 3), dtype=self.dtype, device=self.device),
            exact=exact,
        )
        return fill

    def _fill_inputs(self, numbers: torch.Tensor, structures: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``numbers`` and ``structures`` (the batch vector) on the engine's device for a Verlet fill, the copies of
        the previous fill while the caller passes the very same tensors, unmodified (MD: a periodic box's rebuild
        then copies its positions alone; each copy of a host tensor is a wait for the device)."""
        return self._verlet_inputs((numbers, structures), self.device)

    def _speculates(self, fill: _VerletFill, batch: AtomsBatch) -> bool:
        """Whether the Verlet path launches ``batch``'s step before its displacement test (``speculative_verlet``;
        None: for a device step and host positions, where a host-side test overlaps the launched step; a
        device-side one would wait for it)."""
        on = self.speculative_verlet
        if on is None:
            on = fill.graph.positions.is_cuda and batch.positions.is_cpu
        return on

    def may_launch_ahead(self) -> bool:
        """Whether :meth:`launch_ahead` may launch at all: a zero-copy step is captured and the Verlet path holds a
        list (a cheap test, before a caller predicts positions)."""
        return bool(self._md_runners) and self._verlet_fill is not None

    def launch_ahead(self, batch: AtomsBatch) -> bool:
        """Launch the MD step on ``batch``, positions the caller predicts for its next call, before that call; True
        if launched. The next :meth:`compute` takes the launched step only if its batch's positions are, byte for
        byte, the ones launched here (the step's input is then the same) and the Verlet list is still the one
        it ran on; any other call throws it away (``n_ahead_missed``), and its own step queues behind it on the
        stream. For the padded Verlet path's zero-copy step (a captured bucket, positions and results on the
        host, the list current): :class:`~mlff_distiller.calculator.StudentCalculator` predicts a
        velocity-Verlet trajectory's next positions with it, so that the device computes while ASE's integrator
        and the calculator's bookkeeping run on the host.

        Where ``batch``'s positions would rebuild the list (``rebuild_ahead``, on by default), the list is rebuilt
        for them now and written into the bucket, and its step launched: the next call on those positions finds
        the list current (built where its atoms are) and takes the step, where it would otherwise throw a step on
        the old list away and rebuild. A prediction that misses leaves a list built at positions near the
        caller's, which the displacement test keeps or rebuilds as any other (exact either way).

        Where :meth:`chain_ahead` queued the step after the one this call took, on the device's own prediction of
        the positions, that step is kept as the launch instead of a new one: the next call takes it where the
        positions it read are ``batch``'s, byte for byte."""
        chained, self._chained = self._chained, None
        launched = self._launch_ahead(batch, chained)
        if chained is not None and (self._ahead is None or self._ahead.parity is None):
            self.n_chain_dropped += 1  # queued on forces this call did not take, or before a rebuild
        return launched

    def _launch_ahead(self, batch: AtomsBatch, chained: _Chained | None) -> bool:
        self._ahead = None
        fill, v = self._verlet_fill, self.verlet
        if fill is None or v is None or fill.builds != v.n_builds or fill.cell_updates != v.cell_updates:
            return False
        n = batch.num_atoms
        if n != fill.positions.shape[0] or batch.cell is not self._spec_cell:
            return False
        if not self._speculates(fill, batch):  # the next call takes it where it launches before its test
            return False
        if not self._zero_copy_for(batch, to_host=True, stress=False, exact=fill.exact):
            return False
        md = self._md_runners.get((fill.bucket, n))
        if md is None:
            return False
        tested, rebuilt = self.rebuild_ahead, False
        if tested and v.needs_rebuild(*_verlet_args(batch)):
            rebuilt = True
            if chained is not None:  # a queued chained step reads the list's buffers: let it finish first
                self._wait(None)
            with torch.no_grad():
                self._rebuild_verlet(batch)
                fill = self._fill_verlet(batch, fill, exact=False)
            self.n_rebuilt_ahead += 1
            if fill is None:
                return False
            md = self._md_runners.get((fill.bucket, n))
        if md is None or md.dense != (self._dense_of(fill.graph) is not None):
            return False
        tensor = batch.positions
        if (
            chained is not None
            and not rebuilt
            and chained.call == self._n_computes
            and self._taken_md is chained.source
            and chained.chain.md is md
        ):
            # The step after the one this call took is queued already (chain_ahead), on the device's prediction of
            # these positions: taken at the next call where the bytes agree (_take_launched, _take_ahead).
            step, k = chained.chain.steps[chained.parity], chained.parity
            self._ahead = _Launch(step, fill.builds, fill.cell_updates, tested, tensor, tensor._version, k)
            self.n_chain_adopted += 1
            return True
        np.copyto(md.positions.array, tensor.numpy())
        md.runner.replay()
        self._ahead = _Launch(md, fill.builds, fill.cell_updates, tested, tensor, tensor._version)
        return True

    def keep_chained(self) -> bool:
        """Keep the step :meth:`chain_ahead` queued in this call as the launch ahead, without positions of the
        caller's: where the calculator would predict the next positions on the host (ASE's velocity Verlet, as the
        device did) only to compare them with the device's, the next call compares its own positions with the
        device's instead (:meth:`_take_launched`, after the wait), and runs the displacement test on them. True if
        kept; else the chained step stays for :meth:`launch_ahead` (a list near its rebuild: the host's prediction
        rebuilds it ahead) or is dropped (not queued behind the step this call took, or the list changed since).

        The same decisions as the host's prediction where the two predictions agree (every step on the H200's
        chained MD): the same step is taken on the same positions, bit for bit; where they would not, the chained
        step is dropped at the take instead of at the launch, and the call computes a fresh step."""
        chained = self._chained
        if chained is None or not self.keep_chained_steps:
            return False
        fill, v = self._verlet_fill, self.verlet
        if fill is not None and v is not None and v.near_rebuild():
            return False  # launch_ahead's host prediction rebuilds the list ahead where its positions need it
        self._chained, self._ahead = None, None
        if (
            fill is None
            or v is None
            or fill.builds != v.n_builds
            or fill.cell_updates != v.cell_updates
            or chained.call != self._n_computes
            or self._taken_md is not chained.source
            or self._md_runners.get((fill.bucket, chained.chain.n)) is not chained.chain.md
        ):
            self.n_chain_dropped += 1
            return False
        k = chained.parity
        self._ahead = _Launch(chained.chain.steps[k], fill.builds, fill.cell_updates, False, None, None, k)
        self.n_chain_adopted += 1
        self.n_chain_kept += 1
        return True

    def chain_ahead(
        self, batch: AtomsBatch, positions: np.ndarray, momenta: np.ndarray, masses: np.ndarray, dt: float
    ) -> bool:
        """Queue the step after the one launched ahead, before this call's ``compute(batch)`` waits for that one:
        the device predicts its positions (ASE's velocity Verlet from the launched step's forces and these float64
        ``positions``, ``momenta``, ``masses [n, 1]`` and time step ``dt``, :mod:`mlff_distiller._md_chain`) and
        runs it, with no host work between the two steps. True if queued. :meth:`launch_ahead`, after the compute,
        keeps it as the launch ahead where the call took the step it chains from (else it is dropped:
        ``n_chain_dropped``), and the next call takes it only on the bytes of the positions the caller predicts.

        Only for the call that takes the very step launched ahead for ``batch`` (:meth:`_take_launched`'s tests),
        with ``chain`` on. The first such call of a bucket and atom count captures the two chained steps and queues
        nothing."""
        stale, self._chained = self._chained, None
        if stale is not None:
            self.n_chain_dropped += 1
        ahead = self._ahead
        if not self.chain or ahead is None or not self.express_take or batch.origin is None:
            return False
        if not self._launch_takeable(batch):
            return False
        self._takeable = self._takeable_key(batch)  # this call's take: tested here already (also where none is queued)
        fill, n = self._verlet_fill, batch.num_atoms
        key = (fill.bucket, n)
        md = self._md_runners.get(key)
        if md is None or md.dense or isinstance(md.runner, _EagerRunner):
            # Not behind the dense step (~50 µs): its MD step is host-bound, and the chain's host work made the
            # 64 x 3 student's benzene step slower, 156-250 against 106-157 µs (results/stop81_gpu/e/).
            return False
        chain, parity = self._md_chains.get(key), ahead.parity
        if chain is None or chain.md is not md:
            if parity is not None or ahead.md is not md:
                return False
            try:
                chain = MDChain(self, md, fill, n, self._dense_of(fill.graph) or self._step)
            except torch.OutOfMemoryError:
                chain = None
            if chain is None or any(isinstance(s.runner, _EagerRunner) for s in chain.steps):
                # Two more captures did not fit, or failed: this engine goes on without chained steps (an eager
                # "chained" step would cost more host time than it saves).
                self.chain = False
                return False
            self._md_chains[key] = chain
            return False  # (its captures waited for the device; chained from the next call on)
        if ahead.md is not (md if parity is None else chain.steps[parity]):
            return False
        if not chain.set_consts(dt, batch.origin, masses, busy=parity is not None):
            return False
        event = None
        if self.device.type == "cuda":
            event = self._chain_event = self._chain_event or torch.cuda.Event()
            event.record(current_stream_cached(self.device))  # the end of the step this call takes
        k = 0 if parity is None else 1 - parity
        chain.queue(k, positions, momenta, source=md if parity is None else None)
        self._ahead = ahead._replace(event=event)
        self._takeable = self._takeable_key(batch)  # (the launch ahead is a new tuple now: its key again)
        self._chained = _Chained(chain, ahead.md, k, self._n_computes + 1)
        self.n_chained += 1
        return True

    def _take_launched(self, batch: AtomsBatch, as_numpy: bool) -> dict | None:
        """The results of the step launched ahead, where ``batch`` is the very batch launched and nothing the step
        depends on has changed since; None where any of that is not known from identities and counters (the general
        path then decides, as before). This is the calculator's steady MD step (``StudentCalculator.reuse_ahead``
        hands the launched batch back): :meth:`_compute`'s path for it would repeat, call by call, what
        :meth:`launch_ahead` established (the species, the float64 test, the path, the fill, the displacement test
        on these positions), ~20 µs of a ~60 µs host step on the development CPU. Every condition the general path
        checks for a taken launch is checked here in its cheapest form (the cell by ``same_inputs``, which takes the
        list's cell, pbc, batch, ptr and numbers by identity and version, as the launch left them), and the same
        counters move (``test_launch_ahead.py``: bit for bit the same trajectory and counters with ``express_take``
        off)."""
        known, self._takeable = self._takeable, None
        if known is None or not _same_key(known, self._takeable_key(batch, self._n_computes - 1)):
            if not self._launch_takeable(batch):
                return None
        md, _, _, _, _, _, parity, event = self._ahead
        if parity is not None:
            # A chained step (chain_ahead): it predicted its positions on the device. Taken only on the bytes of this
            # call's positions (the launched tensor's where the calculator predicted them on the host): the caller's
            # work first, then the wait.
            self._overlap()
            self._wait(event)  # (again in _md_results: a finished event's wait costs ~1 µs)
            if md.positions.array.tobytes() != batch.positions.numpy().tobytes():
                self.n_chain_dropped += 1
                return None  # the general path compares the same bytes: a miss, and a fresh step
        fill, v = self._verlet_fill, self.verlet
        self._check_species(batch.numbers)  # (the very tensor checked before: an identity test)
        self._ahead = None
        self.last_ahead = True
        self._taken_md = md
        self.n_ahead_taken += 1
        self.n_speculated += 1
        v.n_calls += 1
        return self._md_results(md, fill.bucket, batch.num_atoms, batch.num_structures, as_numpy, event)

    def _launch_takeable(self, batch: AtomsBatch) -> bool:
        """Whether :meth:`_take_launched` takes the step launched ahead for ``batch`` (its identity and counter
        tests; for a chained step the bytes of its positions are compared after the wait). A chained step kept
        without the caller's positions (:meth:`keep_chained`) had no displacement test: it runs here, on
        ``batch``'s positions (the general path's test of the call)."""
        _, builds, cell_updates, tested, tensor, version, parity, _ = self._ahead
        fill, v = self._verlet_fill, self.verlet
        # A kept chained step (no tensor): its positions' shape is the current list's, which same_inputs tests.
        if tensor is None:
            same = parity is not None
        else:
            same = tested and batch.positions is tensor and tensor._version == version
        if not (
            same
            and v is not None
            and batch.positions64 is None
            and fill is not None
            and fill.builds == builds == v.n_builds
            and fill.cell_updates == cell_updates == v.cell_updates
            and self._verlet_sorted is False
            and self._speculates(fill, batch)
            and v.same_inputs(*_verlet_args(batch))
        ):
            return False
        # (once per call: chain_ahead keeps its yes for the same call's take, _takeable_key)
        return tensor is not None or not v.moved_far(batch.positions)

    def _takeable_key(self, batch: AtomsBatch, call: int | None = None) -> tuple:
        """What :meth:`_launch_takeable`'s answer for ``batch`` rests on, by identities, versions and counters: the
        launch ahead, the batch and its positions, the list's fill and counters, the engine call. :meth:`chain_ahead`
        keeps it where the answer was yes; the same call's :meth:`_take_launched` then takes the step without asking
        again where nothing of it changed (the calculator's chained MD step: ~2-3 µs of host work on the development
        CPU)."""
        fill, v, pos = self._verlet_fill, self.verlet, batch.positions
        counters = None if fill is None or v is None else (fill.builds, fill.cell_updates, v.n_builds, v.cell_updates)
        call = self._n_computes if call is None else call
        return self._ahead, batch, pos, pos._version, fill, counters, self._verlet_sorted is False, call

    def _wait(self, event) -> None:
        """Wait for ``event`` (a step's end, recorded by :meth:`chain_ahead`), or for the stream where None."""
        if event is not None:
            event.synchronize()
        elif self.device.type == "cuda":
            synchronize_current_stream(self.device)

    def _md_results(self, md: _MDStep, bucket: Bucket, n: int, b: int, as_numpy: bool, event=None) -> dict:
        """The results of the launched zero-copy step ``md``: the caller's host work run while the device computes
        (unless the speculative launch ran it), then the wait and one copy of the packed output (the next step
        writes the buffer again), unpacked as NumPy arrays or CPU tensors. ``event``: recorded right after ``md``
        where a chained step was queued behind it (:meth:`chain_ahead`), waited for instead of the whole stream."""
        self.last_bucket = bucket
        self._overlap()
        if event is not None:
            event.synchronize()  # md's writes into md.packed, visible (the chained step may still run)
        elif self.device.type == "cuda":
            synchronize_current_stream(self.device)  # the step's writes into md.packed, visible
        host = md.packed.array.copy()
        return unpack(host if as_numpy else torch.from_numpy(host), bucket.atoms, n, b)

    def _take_ahead(self, fill, batch: AtomsBatch):
        """The step launched ahead (:meth:`launch_ahead`) if it ran on ``batch``'s positions and ``fill``'s list,
        else None (the launched step thrown away: its results are overwritten by the step launched after it)."""
        ahead, self._ahead = self._ahead, None
        self._ahead_tested = False
        if ahead is None:
            return None
        md, builds, cell_updates, tested, tensor, version, parity, _ = ahead
        same = builds == fill.builds and cell_updates == fill.cell_updates
        if same and parity is not None:
            # A chained step wrote its positions on the device: read them once it has (the stream may hold a chained
            # step queued after it, whose wait is the price of this rare path).
            self._wait(None)
            same = md.positions.array.tobytes() == batch.positions.numpy().tobytes()
        elif same and not (batch.positions is tensor and tensor._version == version):
            # The very tensor launched, unmodified since, is the same input without a look at its bytes (the
            # calculator hands the batch it launched back to the next call, StudentCalculator.reuse_ahead). Any
            # other is compared with what the launched step read: its host buffer, not the launched tensor (whose
            # memory a caller may have written in place since the launch).
            positions = md.positions.array
            pos = batch.positions.numpy()
            same = pos.shape == positions.shape and pos.dtype == positions.dtype
            same = same and pos.tobytes() == positions.tobytes()
        self.last_ahead = same
        if not same:
            self.n_ahead_missed += 1
            return None
        self.n_ahead_taken += 1
        self._ahead_tested = tested
        return md

    def _zero_copy_for(self, batch: AtomsBatch, to_host: bool, stress: bool, exact: bool) -> bool:
        """Whether this Verlet-path call may take the zero-copy step (:meth:`_md_launch`): an energy + forces call
        in graph mode with host positions in the engine's dtype and host results, the pair vectors made from the
        positions on the device (not ``exact``), and ``zero_copy`` on (None: on CUDA, where a round trip through a
        :class:`~mlff_distiller.cudagraph.HostBuffer` checked out once)."""
        on = self.zero_copy
        if on is None:
            on = self.device.type == "cuda"
        if not (on and self.mode == "cudagraph" and to_host and not stress and not exact):
            return False
        pos = batch.positions
        if not pos.is_cpu or pos.dtype != self.dtype or batch.positions64 is not None:
            return False
        if self._zero_copy_works is None:
            self._zero_copy_works = host_views_work(self.device)
        return self._zero_copy_works

    def _md_launch(self, fill: _VerletFill, batch: AtomsBatch) -> _MDStep | None:
        """Launch the Verlet bucket's step with its transfers as zero-copy accesses: the caller's positions go into a
        host buffer that the step's first kernel reads across the bus into the static positions, and its last
        kernel writes the packed output into another (the caller synchronises, then reads it). Returns the
        launched step, or None where the bucket is not captured yet (its first ``capture_after`` calls: the usual
        path runs them eagerly and counts them), exceeds ``ZERO_COPY_MAX_ATOMS``, or holds the zero-copy steps of
        ``ZERO_COPY_COUNTS_PER_BUCKET`` other atom counts (the usual path then runs the count). One captured graph per
        (bucket, atom count), kept with the engine's other captures (``captured_buckets``, ``release_captures``);
        the bucket's plain graph is not captured for it."""
        bucket, n = fill.bucket, batch.num_atoms
        if bucket.atoms > ZERO_COPY_MAX_ATOMS:
            return None
        key = (bucket, n)
        dense = self._dense_of(fill.graph)
        md = self._md_runners.get(key)
        if md is not None and md.dense != (dense is not None):  # the other step kind was captured for this count
            del self._md_runners[key]
            md = None
        if md is None:
            if self._eager_uses.get((bucket, False), 0) < self.capture_after and not self._capture_now:
                return None
            if sum(b == bucket for b, _ in self._md_runners) >= ZERO_COPY_COUNTS_PER_BUCKET:
                return None
            w = bucket.atoms * 8 // self.dtype.itemsize  # the packed output's layout: unpack
            positions = HostBuffer((n, 3), self.dtype, self.device)
            packed = HostBuffer((w + 4 * bucket.atoms,), self.dtype, self.device)
            np.copyto(positions.array, batch.positions.numpy())  # read by the capture's warm-up runs
            step, static = dense or self._step, fill.graph.positions[:n]

            def md_step(*inputs):
                copy_bits(positions.view, static)
                out = step(*inputs)
                copy_bits(out, packed.view)
                return out

            runner = self._capture(md_step, fill.graph, key, self._md_runners)
            md = self._md_runners[key] = _MDStep(runner, positions, packed, dense is not None)
        else:
            np.copyto(md.positions.array, batch.positions.numpy())
        md.runner.replay()
        return md

    def _write_shift_vectors(self, fill: _VerletFill, cell: torch.Tensor, out: torch.Tensor) -> None:
        """A kept Verlet list's shift vectors under the caller's new ``cell`` (NPT), made on the device in ``out``
        (the bucket's static rows): ``shifts[e] @ cell[structure[e]]``, from the integer shifts kept on the device
        since the build, instead of ``[E, 3]`` made on the host and copied over. Products and sums, not a matmul,
        so a global TF32 setting never rounds them. (Sending the nine numbers through page-locked memory, as the
        positions go, bought nothing on the H100 host: this call's cost is its launches,
        results/npt_host_ab_h100_run2.md.)"""
        fill.cell.copy_(cell, non_blocking=True)
        rows = fill.cell[0].unsqueeze(0) if fill.structure is None else fill.cell.index_select(0, fill.structure)
        torch.sum(fill.shifts.unsqueeze(2) * rows, dim=1, out=out)

    def _write_step(self, fill: _VerletFill, batch: AtomsBatch, to_host: bool) -> None:
        """A step's geometry into the Verlet path's bucket: the positions, or with float64 pair vectors
        (``fill.exact``) those vectors as the static shift vectors (the static positions stay zero)."""
        if not fill.exact:  # (a float64 engine given float64 positions beside float32 ones takes those)
            wide = batch.positions64 is not None and self.dtype == torch.float64
            self._write_positions(fill, batch.positions64 if wide else batch.positions, to_host)
            return
        graph = fill.graph
        e = graph.n_edges
        dev = self.device
        vec = pair_vectors64(
            batch.positions64.to(dev), batch.cell64.to(dev), graph.edge_index[:, :e], fill.shifts, fill.structure
        )
        graph.shift_vectors[:e].copy_(vec)

    def _write_positions(self, fill: _VerletFill, positions: torch.Tensor, to_host: bool) -> None:
        """Copy the caller's positions into the static positions of the Verlet path's bucket (``fill``)."""
        staging = fill.staging
        if staging is not None and to_host and positions.device.type == "cpu":
            # Through page-locked memory: an asynchronous DMA instead of the driver's staged copy of a pageable
            # source. Reusing the buffer is safe: this call waits for the device (to_host) before it returns.
            staging.copy_(positions)
            positions = staging
        elif positions.dtype != self.dtype:
            positions = positions.to(self.dtype)
        fill.positions.copy_(positions, non_blocking=True)
