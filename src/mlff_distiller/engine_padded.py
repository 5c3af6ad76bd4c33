"""The padded (static-shape) paths of :class:`~mlff_distiller.engine.ForceEngine`: a batch filled into a bucket
of the ladder (:mod:`mlff_distiller.buckets`) and its step run, captured and replayed as a CUDA graph
(:mod:`mlff_distiller.cudagraph`) or compiled, for single points and batches (``_compute_padded``) and for MD with a
Verlet-skin list kept in the bucket's static buffers (:mod:`mlff_distiller.engine_verlet`'s ``VerletPaths``, a
mixin beside this one since stop 68).

``PaddedPaths`` is a mixin of ``ForceEngine``, kept in its own module for size: its methods use the engine's state
made in ``ForceEngine.__init__`` (the frozen fast model, the ladder, the per-bucket graphs, runners and page-locked
output buffers, the Verlet fill) and the engine's list and topology helpers.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import warnings

import numpy as np
import torch

from mlff_distiller import kernels
from mlff_distiller.batch import AtomsBatch
from mlff_distiller.buckets import (
    HOST_FILL_MAX_EDGES,
    Bucket,
    PaddedGraph,
    fill_molecule_host,
    fill_padded,
    fill_padded_host,
)
from mlff_distiller.cudagraph import GraphRunner, is_capture_failure
from mlff_distiller.kernels import _compile_ahead
from mlff_distiller.neighbors import NeighborList
from mlff_distiller.neighbors.molecular import molecular_pair_count
from mlff_distiller.precision import _matmul_precision

__all__ = ["COMPACT_MIN_EDGES", "PaddedPaths"]

# Padded buckets with fewer edge slots skip the in-step edge compaction (compact_edges): its three launches cost
# more than a molecule's few pairs beyond the cutoff (a guess: not measured closer).
COMPACT_MIN_EDGES = 1024


# The dense step (kernels/dense_step.py) for one small molecule: its atoms (one program each, in NP = 16, 32 or 64
# slots, DENSE_SLOTS) and the students it measured faster for (H200, 64 x 3, against the captured step in the same
# runs: benzene 56.4 µs against 129-131, biphenyl (22 atoms, 32 slots) 67.6 against 135, benchmarks/results/
# stop71_gpu/d/; C60 (60 atoms, 64 slots) 110.3 against 140.5, e/; 128 x 3: benzene 175 against 157, c/; since
# stop 72's fused reductions benzene 48.8, biphenyl 61.1, C60 106.0 against 129.7-141.7, stop72_gpu/e/).
DENSE_SLOTS = (16, 32, 64)
DENSE_MAX_ATOMS = DENSE_SLOTS[-1]
DENSE_MAX_HIDDEN = 64
# The dense step's first launch zeros the parts of the packed output that no launch writes, so that the step needs no
# fill kernel (a graph node, ~1-2 µs, before its first launch). Prepared at stop 71 (tested on the interpreter,
# compiled for sm_90 on Triton 3.6 and 3.9); timed at stop 72 (stop72_gpu/a/): benzene through the engine 56.5 ->
# 58.3 µs, biphenyl 67.9 -> 66.6: no clear gain, so off.
DENSE_ZERO_IN_KERNEL = False


class PaddedPaths:
    """The padded paths of :class:`~mlff_distiller.engine.ForceEngine` (see the module docstring)."""

    def _make_dense(self, dense_small: bool | None, compiled: bool, frozen):
        """The engine's dense step (:class:`~mlff_distiller.kernels.dense_step.DenseStep`) with the weights of
        ``frozen``, the padded path's frozen copy of the model (packed now; its blocks are not wrapped yet), or
        None where it does not apply: ``dense_small`` False, a
        torch.compile'd step, a student the step does not compute (16-bit MLP layers included: bf16 and fp16 on
        the torch kernels) or one with forward hooks (whoever set them expects the forward to run), by default off
        CUDA (the CPU would run it on the Triton interpreter) or wider than ``DENSE_MAX_HIDDEN``. ``tf32``,
        ``bf16`` and ``fp16`` on float32 weights (the Triton GEMMs round their tiles, the weights stay float32)
        take the step in strict float32: within those precisions' tolerances, and faster than their model step
        (stop 73, H200, 64 x 3, one g2 molecule: 51.7 µs against 116.7 in tf32 and 115.5 in bf16,
        ``benchmarks/results/stop73_gpu/c/``)."""
        from mlff_distiller.kernels import dense_step
        from mlff_distiller.model import analytic

        if (
            dense_small is False
            or compiled
            or self.dtype not in (torch.float32, torch.float64)
            or not dense_step.HAS_TRITON
        ):
            return None
        if dense_small is None and (self.device.type != "cuda" or self.model.config.hidden > DENSE_MAX_HIDDEN):
            return None
        if analytic.hooked(self.model) or dense_step.supports(frozen) is not None:
            return None
        # Off CUDA the step runs only on the Triton interpreter (the tests), which pays per program: the forward's
        # fan (four programs an atom, each computing the atom's head) took ethanol's step from 7.9 to 16.8 s there.
        # CUDA keeps "auto"; the kernel tests run the fan explicitly (tests/kernels/test_dense_step.py).
        fan = "auto" if self.device.type == "cuda" else False
        try:
            return dense_step.DenseStep(frozen, self.dtype, self.device, fan=fan)
        except (ValueError, RuntimeError) as exc:  # an optional path: the engine runs the model's step without it
            warnings.warn(
                f"the dense step for small molecules could not be prepared ({type(exc).__name__}: {exc}); "
                "their steps run the model's forward and autograd",
                RuntimeWarning,
                stacklevel=3,
            )
            return None

    def _dense_on(self) -> bool:
        """Whether the dense step runs at all: prepared, not switched off, the Triton kernels selected."""
        return (
            self._dense is not None
            and self.dense_small is not False
            and kernels.resolve_backend(self.device) == "triton"
        )

    def _dense_slots(self, graph: PaddedGraph) -> int | None:
        """The dense step's slots (NP, one of ``DENSE_SLOTS``) for the current content of ``graph``, or None where
        it does not apply: one structure without periodic images (``graph.molecule``) of at most
        ``DENSE_MAX_ATOMS`` atoms in a bucket of at least NP atom slots, where :meth:`_dense_on`."""
        if not graph.molecule or graph.n_structures != 1 or not self._dense_on():
            return None
        return _slots_for(graph.n_atoms, graph.bucket)

    def _dense_of(self, graph: PaddedGraph):
        """The dense step for the current content of ``graph`` (a callable with :meth:`_step`'s signature and
        packed output, one per slot count: ``functools.partial(self._dense_step, np_=...)``, made once), or None
        (:meth:`_dense_slots`)."""
        np_ = self._dense_slots(graph)
        return None if np_ is None else self._dense_call(np_)

    def _dense_call(self, np_: int):
        """The dense step of ``np_`` slots as a step: :meth:`_step`'s signature and packed output (made once)."""
        call = self._dense_calls.get(np_)
        if call is None:
            call = self._dense_calls[np_] = functools.partial(self._dense_step, np_=np_)
        return call

    def _dense_step(
        self, numbers, positions, edge_index, shift_vectors, batch, seed, *csr, np_: int = DENSE_SLOTS[0]
    ) -> torch.Tensor:
        """:meth:`_step` by the dense step: the same packed output ``[W + A + 3A]`` of structure 0 (its atoms the
        first of ``np_`` slots whose ``batch`` is 0; the edges, the seed and the CSR are not read: the step takes
        every pair within the cutoff). A zero fill and two launches a layer (with ``DENSE_ZERO_IN_KERNEL`` the first
        launch zeros the output's other slots instead of the fill)."""
        dense = self._dense
        if dense is None:  # given up below, by an earlier call of a step captured as this one
            return self._step(numbers, positions, edge_index, shift_vectors, batch, seed, *csr)
        a, dtype = numbers.shape[0], self.dtype
        w = a * 8 // dtype.itemsize
        # DENSE_ZERO_IN_KERNEL: not zero-filled here; the first launch zeros what no launch writes (the other
        # structures' energies, the slots beyond np_), one graph node fewer
        fill = torch.empty if DENSE_ZERO_IN_KERNEL else torch.zeros
        out = fill(w + 4 * a, dtype=dtype, device=positions.device)
        views = (
            out[:w].view(torch.float64)[:1],
            out[w : w + a][:np_].view(1, np_),
            out[w + a :].view(a, 3)[:np_].view(1, np_, 3),
        )
        zero = (out, ((w // a, w), (w + np_, w + a), (w + a + 3 * np_, w + 4 * a))) if DENSE_ZERO_IN_KERNEL else None
        try:
            dense.from_numbers(positions, numbers, batch, np_, views, zero)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            # An optional path: a Triton that cannot compile its kernels (Triton 3.6 failed on the float64 step's
            # geometry before stop 70) must not end the caller's run. Its first call is never inside a capture
            # (the capture's warm-up runs it first), so giving up here leaves no half-captured graph.
            if positions.is_cuda and torch.cuda.is_current_stream_capturing():
                raise
            self._dense = None
            warnings.warn(
                f"the dense step for small molecules failed ({type(exc).__name__}: {str(exc)[:200]}); small "
                "molecules' steps run the model's forward and autograd from now on",
                RuntimeWarning,
                stacklevel=2,
            )
            return self._step(numbers, positions, edge_index, shift_vectors, batch, seed, *csr)
        return out

    def _padded_forward(
        self, numbers, positions, edge_index, shift_vectors, batch, seed, row_ptr, sender_perm, sender_ptr
    ):
        """Energies of a padded bucket (``[A]`` per structure slot, ``[A]`` per atom). ``seed`` is unused here (the
        step seeds the gradient with it); it stays in the signature, which follows ``PaddedGraph.inputs()``.

        ``row_ptr``, ``sender_perm`` and ``sender_ptr`` are the bucket's static CSR buffers, computed by
        ``fill_padded`` whenever it wrote the edges (outside any captured graph): the message-passing kernels
        take them as given, so the step itself sorts and searches nothing, and never consults the kernels'
        per-tensor CSR cache (which a captured graph would bake in while the buffers' content changes)."""
        # The stress step compacts before it makes the shift vectors a leaf (the compaction takes no gradient
        # through them), so a leaf that requires grad is never compacted here.
        if self.compact_edges and edge_index.shape[1] >= COMPACT_MIN_EDGES and not shift_vectors.requires_grad:
            # In-step drop of the pairs beyond the cutoff (a Verlet-skin list holds ~70 % more): the kernels then
            # walk only the pairs within it (exact: the dropped ones contribute exactly zero). It keeps a list
            # symmetric (a pair's two edges have one distance); with the symmetric walk the sender CSR it remaps
            # is the bucket's unwritten one, and nothing reads the result.
            edge_index, shift_vectors, row_ptr, sender_perm, sender_ptr = kernels.edge_compact(
                positions, edge_index, shift_vectors, row_ptr, sender_perm, sender_ptr, self.cutoff, self._far
            )
        self._csr["row_ptr"] = row_ptr
        self._csr["sender"] = (sender_perm, sender_ptr)
        out = self._fast_model(numbers, positions, edge_index, shift_vectors, batch, numbers.shape[0])
        return out["energy"].to(torch.float64), out["atomic_energies"].to(self.dtype)

    def _step(self, numbers, positions, edge_index, shift_vectors, batch, seed, *csr) -> torch.Tensor:
        """The whole padded step on ``PaddedGraph.inputs()`` (``csr``: its ``row_ptr, sender_perm,
        sender_ptr``): ``[W + A + 3A]`` packed (energy, atomic energies, forces), one tensor so that a host copy
        is one transfer. The energies are float64 (``StudentModel.forward``): their bytes take the first W entries
        (2A in a float32 output; ``unpack``)."""
        with torch.enable_grad(), _matmul_precision(self.allow_tf32, self.kernel_matmul_dtype):
            pos = positions.detach().requires_grad_(True)
            energy, atomic = self._forward_impl(numbers, pos, edge_index, shift_vectors, batch, seed, *csr)
            # The gradient of -Σ_b E_b over the real structures as one vector-Jacobian product seeded with the
            # bucket's seed (-1 for them, 0 for the rest): the forces directly (the sign flips exactly through
            # every linear step of the backward), and the dummy structure's energy never reaches them.
            (forces,) = _seeded_grad(energy, seed, (pos,))
        # One torch cat ends the step. The kernels writing the three into the packed output's views instead (a switch
        # and a context handing the views to the kernels, built at stop 48) gained nothing on an H200 at stop 49: a
        # captured step, shipped / variant, with the readout's wall and edge_features' zero_in_forward 1.012 and 1.006
        # on benzene, 1.006 and 1.010 on 192 water atoms (two sweeps), where zero_in_forward with the moments' into_sink
        # alone gave 1.013 and 1.016 (benchmarks/results/stop49_gpu/probe_ncu_sweep_48.md, probe_ncu_sweep_49b.md).
        # Dropped; the code is in benchmarks/results/stop49_gpu/wall_packed_pdl_dropped.diff.
        return torch.cat([_energy_words(energy.detach(), atomic.dtype), atomic.detach(), forces.reshape(-1)])

    def _step_stress(self, numbers, positions, edge_index, shift_vectors, batch, seed, *csr) -> torch.Tensor:
        """:meth:`_step` with the strain derivative too: ``[W + A + 3A + 9A]`` packed (energy, atomic energies,
        forces, then ``-dE/dε`` per structure slot as ``[A, 3, 3]``), from the same single vector-Jacobian product.

        The vector-Jacobian product also returns ``-dE/ds`` for the shift vectors, which is ``-dE/dr_ij`` for every
        pair (``r_ij = pos[j] - pos[i] + s``), and :func:`edge_virial` sums ``r_ij ⊗ -dE/dr_ij`` per structure.
        Padding atoms and edges sit in the dummy slot, whose seed is zero, so their gradients are zero."""
        if self.compact_edges and edge_index.shape[1] >= COMPACT_MIN_EDGES:
            # The in-step drop of the pairs beyond the cutoff, here before the shift vectors become the leaf the
            # gradient is taken over (the forward skips its own compaction for a leaf that requires grad).
            edge_index, shift_vectors, *csr = kernels.edge_compact(
                positions, edge_index, shift_vectors, *csr, self.cutoff, self._far
            )
        with torch.enable_grad(), _matmul_precision(self.allow_tf32, self.kernel_matmul_dtype):
            pos = positions.detach().requires_grad_(True)
            shifts = shift_vectors.detach().requires_grad_(True)
            energy, atomic = self._forward_impl(numbers, pos, edge_index, shifts, batch, seed, *csr)
            forces, pair_grad = _seeded_grad(energy, seed, (pos, shifts))
        virial = edge_virial(positions, shift_vectors, pair_grad, edge_index, batch, numbers.shape[0])
        energy = _energy_words(energy.detach(), atomic.dtype)
        return torch.cat([energy, atomic.detach(), forces.reshape(-1), virial.reshape(-1)])

    def _device_topology(self, batch: AtomsBatch) -> tuple[AtomsBatch, bool]:
        """Move ``batch`` to the device; numbers/batch/ptr/cell/pbc are reused from the previous call when
        unchanged (MD), which also lets the static buffers skip rewriting them. Returns (batch, same)."""
        if batch.device == self.device:
            self._topology = None
            self._topology_token += 1
            return batch.to(dtype=self.dtype), False
        key = (batch.numbers, batch.ptr, batch.cell, batch.pbc)
        cached = self._topology
        same = cached is not None and all(
            a.device == b.device and a.shape == b.shape and torch.equal(a, b)
            for a, b in zip(key, cached[0], strict=True)
        )
        if not same:
            dev = batch.to(self.device, self.dtype)
            self._topology = (tuple(t.clone() for t in key), dev)
            self._topology_token += 1
        dev = self._topology[1]
        positions, exact = batch.positions.to(self.device, self.dtype), {}
        if batch.positions64 is not None and self.dtype == torch.float64:  # a float64 engine takes them as its own
            positions = batch.positions64.to(self.device)
        elif batch.positions64 is not None:
            exact = {"positions64": batch.positions64.to(self.device), "cell64": batch.cell64.to(self.device)}
        return AtomsBatch(
            numbers=dev.numbers, positions=positions, cell=dev.cell, pbc=dev.pbc, batch=dev.batch, ptr=dev.ptr, **exact
        ), same

    def _graph(self, bucket: Bucket) -> PaddedGraph:
        g = self._graphs.get(bucket)
        if g is None:
            g = PaddedGraph.empty(
                bucket,
                dtype=self.dtype,
                device=self.device,
                cutoff=self.cutoff,
                pad_z=self.model.species_list[0],
                sender_csr=not self._symmetric,  # the symmetric walk reads no sender CSR
            )
            self._graphs[bucket] = g
        return g

    def _run(self, bucket: Bucket, graph: PaddedGraph, stress: bool = False, capture: bool = False) -> torch.Tensor:
        """One padded step on the current content of ``graph``; the packed output (static in graph mode).
        ``stress``: the step with the strain derivative (:meth:`_step_stress`; its own graph per bucket).
        ``capture``: capture a new bucket now, whatever ``capture_after`` says (``warmup``)."""
        dense = None if stress else self._dense_of(graph)
        step = self._step_stress if stress else (dense or self._step)
        if self.mode == "cudagraph":
            if stress:
                runners = self._stress_runners
            else:
                runners = self._dense_runners[dense.keywords["np_"]] if dense else self._runners
            runner = runners.get(bucket)
            if runner is None:
                uses = self._eager_uses.get((bucket, stress), 0)
                if uses < self.capture_after and not (capture or self._capture_now):
                    # A bucket seen fewer than capture_after times runs eagerly: a capture costs ~25 steps of a
                    # large bucket, and a stream of varied batches (predict) meets most of its buckets once.
                    self._eager_uses[(bucket, stress)] = uses + 1
                    self._compile_ahead(step, graph, stress)
                    return step(*graph.inputs())
                runner = runners[bucket] = self._capture(step, graph, bucket, runners)
            return runner.replay()
        if self.mode == "compile" and self.compile_mode == "reduce-overhead":
            # Tell torch's CUDA-graph trees a new step begins (the previous outputs were copied already).
            torch.compiler.cudagraph_mark_step_begin()
        return step(*graph.inputs())

    def _compile_ahead(self, step, graph: PaddedGraph, stress: bool) -> None:
        """Before a bucket's first step: a cold process would compile the step's Triton kernels there, one after
        another (15-18 s for the first benzene result on the H100 host), so a dry run first compiles them all in
        parallel (kernels/_compile_ahead.py). Not over a torch.compile'd step, whose own kernels would run on the
        dry run's unwritten outputs. A dry run costs a step's host work even when everything is compiled (~75 ms
        for a bucket of 5,000 g2 molecules), so after ``IDLE_DRY_RUNS`` in a row of this step kind that found
        nothing to compile, the engine stops: a later bucket that still needs a kernel compiles it in its step."""
        if self.compile_mode is not None or self._idle_dry_runs[stress] >= IDLE_DRY_RUNS:
            return
        if kernels.precompile(step, *graph.inputs(), for_capture=self.mode == "cudagraph"):
            last = _compile_ahead.LAST  # what this dry run handed to the compiler
            idle = not (last.get("submitted") or last.get("compiled"))
            self._idle_dry_runs[stress] = self._idle_dry_runs[stress] + 1 if idle else 0

    def _capture(self, step, graph: PaddedGraph, bucket: Bucket, runners: dict) -> GraphRunner | _EagerRunner:
        """The bucket's captured step. A capture that CUDA invalidates is tried once more; a second failure leaves
        the bucket's step eager (the same results, launch-bound), with a warning, instead of ending the caller's
        run. One intermittent invalidation was seen on the H100 (``results/gpu_test_runs.md``, stop 23). An
        out-of-memory error is raised as it is (the batch splitting handles it), unless ``oom_eager``: a caller
        whose batch cannot be split (:class:`~mlff_distiller.batched_md.BatchedMD`, the same replicas every step)
        then gets the bucket's step eager, with a warning; so does a bucket of more than ``oom_eager_edges`` edges
        (the large buckets that mode "auto" ran eagerly before stop 51). The capture's private memory pool comes on
        top of what the allocator already caches; the eager step shares that cache, so it may fit where the capture
        did not. Before either, the first out-of-memory capture of the engine that finds other buckets captured
        releases their graphs (:meth:`release_captures`, with a warning) and tries once more: each captured bucket
        keeps its pool for the engine's life, and a stream of large structures of many sizes would otherwise fill
        the device with them. Once per engine, so that two buckets that do not fit together are not captured in
        turn at every call."""

        self._compile_ahead(step, graph, stress=runners is self._stress_runners)
        failure, invalidated, out_of_memory = None, 0, False
        while invalidated < CAPTURE_ATTEMPTS:
            release = False
            try:
                return GraphRunner(step, graph)
            except torch.OutOfMemoryError:
                runners.pop(bucket, None)
                release = self._may_release_for(bucket)
                if not release:
                    if not (self.oom_eager or bucket.edges > self.oom_eager_edges):
                        raise
                    out_of_memory = True  # handled below, once the traceback (the failed capture's frames) is gone
                    break
            except RuntimeError as exc:  # torch.AcceleratorError is one
                if not is_capture_failure(exc):
                    raise
                failure = exc
                invalidated += 1
                self.capture_failures += 1
            if release:  # outside the except block: the failed capture's frames are gone
                self._released_for_capture = True
                dropped = self.release_captures(keep=bucket)
                warnings.warn(
                    f"CUDA graph capture of the step of {bucket} ran out of GPU memory; released the captured graphs "
                    f"of {dropped} other bucket(s) (captured again when met again) and capturing it once more",
                    RuntimeWarning,
                    stacklevel=4,
                )
        if out_of_memory:
            self.capture_failures += 1
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the failed capture's pool, back to the device
            warnings.warn(
                f"CUDA graph capture of the step of {bucket} ran out of GPU memory; this bucket's step runs eagerly "
                "(the same results, more launches)",
                RuntimeWarning,
                stacklevel=4,
            )
            return _EagerRunner(step, graph)
        warnings.warn(
            f"CUDA graph capture of the step of {bucket} failed {CAPTURE_ATTEMPTS} times ({failure}); "
            "this bucket's step runs eagerly",
            RuntimeWarning,
            stacklevel=4,
        )
        return _EagerRunner(step, graph)

    def _captured(self, keep: Bucket | None = None) -> list[tuple[dict, Bucket]]:
        """(runners dict, bucket) of every bucket but ``keep`` that holds a captured graph (not one left eager),
        energy + forces and stress steps alike."""
        captured = [
            (runners, b)
            for runners in (self._runners, self._stress_runners, *self._dense_runners.values())
            for b, r in runners.items()
            if b != keep and not isinstance(r, _EagerRunner)
        ]
        return captured + [
            (self._md_runners, key)
            for key, md in self._md_runners.items()
            if key[0] != keep and not isinstance(md.runner, _EagerRunner)
        ]

    def _may_release_for(self, bucket: Bucket) -> bool:
        """Whether an out-of-memory capture of ``bucket`` may release the other buckets' captured graphs first:
        the engine's first such release, and some other bucket holds a captured graph."""
        return not self._released_for_capture and bool(self._captured(keep=bucket))

    def release_captures(self, keep: Bucket | None = None) -> int:
        """Drop the captured CUDA graphs (each holds a private memory pool for the engine's life) of every bucket
        but ``keep``, energy + forces and stress steps alike, and return the allocator's cached blocks to the
        device; returns how many were dropped. A bucket met again is captured again. Buckets whose capture failed
        (left eager) stay so. The engine calls it after an out-of-memory error (:meth:`_capture`,
        :func:`~mlff_distiller.batching.recompute_before_retry`); a caller may too, to free device memory."""
        dropped = self._captured(keep)
        for runners, bucket in dropped:
            del runners[bucket]
        self._md_chains = {key: c for key, c in self._md_chains.items() if self._md_runners.get(key) is c.md}
        self.captures_released += len(dropped)
        if dropped and self.device.type == "cuda":
            gc.collect()  # a dropped graph's outputs may still be referenced from a cycle
            torch.cuda.empty_cache()
        return len(dropped)

    def _compute_padded(self, batch: AtomsBatch, to_host: bool, stress: bool = False) -> dict[str, torch.Tensor] | None:
        if not stress and self._dense is not None:
            out = self._compute_dense_molecule(batch, to_host)
            if out is not None:
                return out
        host_nl = self._host_molecular_neighbors(batch, to_device=False)
        if host_nl is not None:
            bucket = self.buckets.select(batch.num_atoms, host_nl.num_edges)
            if bucket is None:
                return None  # beyond the largest bucket: eager fallback
            if bucket.edges <= HOST_FILL_MAX_EDGES and batch.positions64 is None:
                # Small molecular graphs: the whole padded content is made on the host and sent in two transfers
                # (fill_padded_host), instead of the device topology, the list's copies and ~30 device operations.
                graph = self._graph(bucket)
                fill_padded_host(
                    graph,
                    batch.numbers.numpy(),
                    batch.positions.detach().numpy(),
                    batch.batch.numpy(),
                    batch.num_structures,
                    host_nl.edge_index.numpy(),
                    host_nl.row_ptr.numpy(),
                    record=not to_host,  # to_host: this call waits for the device before it returns
                )
                self._graph_tokens[bucket] = -1  # the device path must rewrite everything in this bucket
                self._verlet_fill = None
                out = self._run_padded(bucket, graph, batch.num_atoms, batch.num_structures, to_host, stress=stress)
                return _with_stress(out, batch) if stress else out
            host_nl = self._nl_to_device(host_nl)
        # Not sorted spatially (the eager path sorts batches of spatial_sort_min_atoms atoms or more): a sort per
        # call made the whole call slower here, its ~25 small launches costing more than the step's locality gains
        # (stop 51, H200, mode "auto" capturing 12,000-24,000 water atoms: 64 wide 6.89 / 8.72 / 9.94 ms a call
        # sorted against 5.20 / 7.16 / 9.03 unsorted; 128 wide, 12,000 atoms: 9.54 against 8.55;
        # benchmarks/results/stop51_gpu/probe_auto_capture.md). Again at stop 64 (a switch, padded_sort_min_atoms;
        # stop64_gpu/g/, padded_sort_dropped.diff): 0.76 / 0.86 / 0.88 / 0.95x at 12,000 / 18,000 / 24,000 / 36,000
        # atoms 128 wide, 0.69-0.86x 64 wide, ~1.5-2 ms a call more, where the captured 24,000-atom step alone gains
        # 0.4 ms from the order (stop64_gpu/f/); with the sort itself 3.3x cheaper (its launches, stop64_gpu/i/)
        # still 0.905 / 0.967 / 0.980x at 12,000 / 24,000 / 36,000 atoms 128 wide, 0.85-0.93x 64 wide.
        dev, same = self._device_topology(batch)
        with torch.no_grad():
            nl = host_nl if host_nl is not None else self._device_molecular_neighbors(batch, dev)
            if nl is None:
                nl = self._neighbors(dev)
        n, b, e = dev.num_atoms, dev.num_structures, nl.num_edges
        bucket = self.buckets.select(n, e)
        if bucket is None:
            return None  # beyond the largest bucket: eager fallback
        graph = self._graph(bucket)
        same = same and self._graph_tokens.get(bucket) == self._topology_token
        if dev.positions64 is not None:  # float64 pair vectors as the shift vectors, zero positions
            with torch.no_grad():
                dev, nl = exact_pairs(dev, nl)
        # A molecule for the dense step (asked only where the engine has one): a batch given on the host without a
        # periodic axis (no device sync to ask), with its real positions (not the exact pairs' zeros).
        molecule = (
            self._dense is not None
            and batch.pbc.device.type == "cpu"
            and dev.positions64 is None
            and not bool(batch.pbc.any())
        )
        fill_padded(
            graph,
            dev.numbers,
            dev.positions,
            dev.batch,
            b,
            nl.edge_index,
            nl.shift_vectors.to(self.dtype),
            same_topology=same,
            molecule=molecule,
        )
        self._graph_tokens[bucket] = self._topology_token
        self._verlet_fill = None  # the static buffers no longer hold the Verlet path's list
        out = self._run_padded(bucket, graph, n, b, to_host, stress=stress)
        # The cell from the side the outputs are on: no host-to-device copy that would wait for the step.
        return _with_stress(out, batch if to_host else dev) if stress else out

    def _compute_dense_molecule(self, batch: AtomsBatch, to_host: bool) -> dict[str, torch.Tensor] | None:
        """One molecule given on the host for the dense step, which finds its pairs itself: the pairs are only
        counted (the bucket is chosen by them, as for the list) and the bucket gets the atoms and no edges
        (:func:`~mlff_distiller.buckets.fill_molecule_host`), instead of the host list and its fill (stop 74: 30-66
        and 38-84 µs of a ~250-430 µs call on the H200 host, ``benchmarks/results/stop74_gpu/a/``). None where the
        dense step would not take the molecule (:meth:`_dense_slots`'s conditions, checked before the fill), and
        where it gave up at this call's launch (its stand-in, the model's step, needs the list: the caller's path
        runs the call again with it)."""
        if batch.num_structures != 1 or batch.device.type != "cpu" or batch.positions64 is not None:
            return None
        n = batch.num_atoms
        if n > DENSE_MAX_ATOMS or batch.pbc.numpy().any() or not self._dense_on():
            return None
        positions = batch.positions.detach().numpy()
        bucket = self.buckets.select(n, molecular_pair_count(positions, self.cutoff))
        if bucket is None or _slots_for(n, bucket) is None or bucket.edges > HOST_FILL_MAX_EDGES:
            return None
        graph = self._graph(bucket)
        fill_molecule_host(graph, batch.numbers.numpy(), positions, record=not to_host)
        self._graph_tokens[bucket] = -1  # the device path must rewrite everything in this bucket
        self._verlet_fill = None
        out = self._run_padded(bucket, graph, n, 1, to_host)
        return None if self._dense is None else out

    def _run_padded(
        self,
        bucket: Bucket,
        graph: PaddedGraph,
        n: int,
        b: int,
        to_host: bool,
        as_numpy: bool = False,
        packed: torch.Tensor | None = None,
        stress: bool = False,
    ) -> dict:
        """Run a filled bucket (``packed``: its output, already launched) and unpack the real rows of the packed
        output (``as_numpy``: of its host copy as NumPy views; needs ``to_host``). ``stress``: the stress step,
        whose ``-dE/dε`` rows come back as ``virial`` ``[b, 3, 3]`` (not with ``as_numpy``)."""
        self.last_bucket = bucket
        packed = self._run(bucket, graph, stress) if packed is None else packed
        if to_host:
            if packed.is_cuda:
                # One DMA into this bucket's page-locked buffer (a blocking copy: it waits for the step), then the
                # caller's own copy of it (a few KB): no page-locked allocation and no pageable staging per call.
                host = self._host_out.get((bucket, stress))
                if host is None or host.shape != packed.shape or host.dtype != packed.dtype:
                    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
                    self._host_out[(bucket, stress)] = host
                host.copy_(packed.detach())
                if as_numpy:
                    return unpack(host.numpy().copy(), bucket.atoms, n, b)
                packed = host.clone()
            else:
                packed = packed.cpu()
        elif self.mode == "cudagraph" or self.compile_mode == "reduce-overhead":
            packed = packed.clone()  # the static output is overwritten by the next replay
        if as_numpy:
            return unpack(packed.detach().numpy() if packed.requires_grad else packed.numpy(), bucket.atoms, n, b)
        return unpack(packed, bucket.atoms, n, b, stress=stress)


_VOIGT = ((0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1))
# Captures of one bucket's step before it is left eager (see PaddedPaths._capture).
CAPTURE_ATTEMPTS = 2
# Dry runs in a row (one step kind) that found nothing to compile, after which an engine runs no more of them.
IDLE_DRY_RUNS = 2


try:  # the C++ engine's entry that torch.autograd.grad calls after checking its grad_outputs (torch >= 2.4)
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - a torch without it takes _Seeded
    _engine_run_backward = None


def _slots_for(n_atoms: int, bucket: Bucket) -> int | None:
    """The dense step's slots (the smallest of ``DENSE_SLOTS`` holding ``n_atoms``) where ``bucket`` has that many
    atom slots; None where no slot count holds them or the bucket is smaller."""
    np_ = next((s for s in DENSE_SLOTS if n_atoms <= s), None)
    return None if np_ is None or bucket.atoms < np_ else np_


def _energy_words(energy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float64 energies ``[A]`` as entries of ``dtype`` (their bytes, no conversion: a float32 output holds
    each energy in two entries), for the packed output's one copy to the host."""
    return energy if dtype == torch.float64 else energy.view(dtype)


def unpack(packed, a: int, n: int, b: int, stress: bool = False) -> dict:
    """The real rows of a bucket's packed step output (a tensor, or a NumPy array of its host copy: views either
    way): ``energy [b]`` float64, ``atomic_energies [n]``, ``forces [n, 3]`` and with ``stress`` ``virial [b, 3,
    3]`` (tensors only) in the output's dtype; ``a``: the bucket's atoms, ``n``, ``b``: its real atoms and
    structures."""
    numpy = not isinstance(packed, torch.Tensor)
    w = a * 8 // packed.dtype.itemsize  # entries holding the energies
    energy = packed[:w].view("float64" if numpy else torch.float64)[:b]
    forces = packed[w + a : w + 4 * a]
    out = {
        "energy": energy,
        "atomic_energies": packed[w : w + n],
        "forces": (forces.reshape(a, 3) if numpy else forces.view(a, 3))[:n],
    }
    if stress:
        out["virial"] = packed[w + 4 * a :].view(a, 3, 3)[:b]
    return out


def _seeded_grad(energy: torch.Tensor, seed: torch.Tensor, inputs: tuple[torch.Tensor, ...]):
    """``torch.autograd.grad(energy, inputs, grad_outputs=seed)``: the step's one vector-Jacobian product.

    Straight into autograd's engine with ``seed`` as the root gradient: ``torch.autograd.grad`` would first check
    ``grad_outputs`` in Python, through ``torch.fx.experimental.symbolic_shapes`` (whose first import, sympy, took
    0.8-1.2 s of a process's first result on the H100 host). The old way round that, ``_Seeded`` (kept for a torch
    without the entry), cost a fill kernel per step: autograd's implicit seed 1 of its scalar. The engine still
    checks the seed's shape, dtype and device against ``energy``'s."""
    if _engine_run_backward is None:
        return torch.autograd.grad(_Seeded.apply(energy, seed), inputs)
    return _engine_run_backward((energy,), (seed,), False, False, tuple(inputs), False, accumulate_grad=False)


class _Seeded(torch.autograd.Function):
    """``_Seeded.apply(energy, seed)``: a 0-dim output whose backward gives ``energy`` the gradient ``seed`` (the
    bucket's static seed, -1 for real structures), so ``torch.autograd.grad(out, inputs)`` is the vector-Jacobian
    product ``grad(energy, inputs, grad_outputs=seed)``.

    Why not that call: ``torch.autograd.grad`` with ``grad_outputs`` checks the shapes through
    ``torch.fx.experimental.symbolic_shapes``, whose first import (sympy) took 0.8-1.2 s of a process's first
    result on the H100 host (results/startup_h100_ab.md). Without it, ``autograd.grad`` makes the scalar seed 1
    (one fill kernel, in place of the negation the old seed ``-mask`` cost). The output's value is undefined and
    never read; the backward ignores the incoming gradient, which is that 1."""

    @staticmethod
    def forward(ctx, energy: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(seed)
        return energy.new_empty(())

    @staticmethod
    def backward(ctx, _one: torch.Tensor):
        (seed,) = ctx.saved_tensors
        return seed, None


class _EagerRunner:
    """A bucket whose capture kept failing: ``replay`` runs its step eagerly on the static inputs."""

    def __init__(self, step, graph: PaddedGraph) -> None:
        self.step, self.graph = step, graph

    def replay(self) -> torch.Tensor:
        return self.step(*self.graph.inputs())


def _verlet_args(batch: AtomsBatch) -> tuple:
    """The arguments of ``VerletNeighborList.needs_rebuild`` / ``same_inputs`` for ``batch``."""
    return batch.positions, batch.cell, batch.pbc, batch.batch, batch.ptr, batch.numbers


def exact_pairs(batch: AtomsBatch, nl: NeighborList) -> tuple[AtomsBatch, NeighborList]:
    """A batch with float64 positions beside its own (``AtomsBatch.positions64``) and its list as the model
    takes them: the pair vectors made in float64 and rounded once to the batch's dtype, given as the shift
    vectors, with zero positions. The model and the stress see an edge's geometry only through
    ``pos[j] - pos[i] + shift``, and its gradient over the positions does not depend on their values, so
    forces and stress come out as before, from pair vectors good to their own rounding instead of the
    coordinates' (float32 at 430 Å: 1.5e-5 Å). The eager path and the padded paths' fills take it; the padded
    Verlet path writes the same vectors into its static shift vectors every step (``_write_step``)."""
    vec = batch.pair_vectors64(nl.edge_index, nl.shifts).to(batch.dtype)
    zero = torch.zeros_like(batch.positions)
    return dataclasses.replace(batch, positions=zero), dataclasses.replace(nl, shift_vectors=vec)


def edge_virial(
    positions: torch.Tensor,
    shift_vectors: torch.Tensor,
    pair_grad: torch.Tensor,
    edge_index: torch.Tensor,
    batch: torch.Tensor,
    num_structures: int,
) -> torch.Tensor:
    """The strain derivative ``[B, 3, 3]`` of each structure from the gradient over its pairs: for a symmetric
    strain ε that deforms positions and cell alike (``r -> r (1 + ε)``, so every ``r_ij -> r_ij (1 + ε)``),
    ``dE/dε = sym(Σ_ij r_ij ⊗ dE/dr_ij)`` with ``r_ij = pos[j] - pos[i] + s``. ``pair_grad`` ``[E, 3]`` is the
    gradient over the shift vectors, which equals the one over ``r_ij``; pass ``-dE/ds`` to get ``-dE/dε``.

    This replaces straining the inputs (a zero strain leaf moved through ``bmm`` per atom and per pair): the same
    numbers from the pairs' gradient, which the force backward computes anyway, with no ``[E, 3, 3]`` batched
    products. It is translation invariant term by term (pair vectors, not positions), and differentiable
    (training takes ``create_graph``). The pair terms are summed onto their receiving atom first, then per
    structure: two ``index_add`` with few writers per address instead of every pair of a structure on its 9. The
    per-structure sum accumulates in float64 like the energy's (``kernels.linear.structure_sums``): its terms have
    both signs and a large box has hundreds of thousands of them."""
    r = positions.index_select(0, edge_index[1]) - positions.index_select(0, edge_index[0]) + shift_vectors
    outer = (r.unsqueeze(2) * pair_grad.unsqueeze(1)).reshape(-1, 9)
    per_atom = outer.new_zeros((positions.shape[0], 9)).index_add_(0, edge_index[0], outer)
    w = kernels.linear.structure_sums(per_atom, batch, num_structures).view(num_structures, 3, 3)
    return 0.5 * (w + w.transpose(1, 2))


def stress_from_strain_gradient(de_deps: torch.Tensor, cell: torch.Tensor, pbc: torch.Tensor) -> dict:
    """``stress`` ``[B, 6]`` (eV/Å³, Voigt, ASE sign: σ = (dE/dε) / V) and ``stress_valid`` ``[B]`` (fully periodic
    cells of nonzero volume) from the strain derivative ``de_deps`` ``[B, 3, 3]`` (:func:`edge_virial`); the eager
    and padded paths' and training's."""
    host = de_deps.device.type == "cpu" and cell.device.type == "cpu" and pbc.device.type == "cpu"
    if host and not de_deps.requires_grad:  # (training differentiates through the torch path below)
        # The host results of the padded path (NPT through the calculator, every step): NumPy, ~5x fewer µs
        # than torch's CPU ops on [B, 3, 3].
        d = de_deps.numpy()
        c = cell.detach().numpy().astype(d.dtype, copy=False)
        vol = np.abs(np.linalg.det(c))
        ok = pbc.numpy().all(axis=1) & (vol > 0)
        sigma = d / np.where(ok, vol, 1.0)[:, None, None]
        voigt = np.stack([sigma[:, i, j] for i, j in _VOIGT], axis=1)
        return {"stress": torch.from_numpy(voigt), "stress_valid": torch.from_numpy(ok)}
    cell = cell.to(de_deps.device, de_deps.dtype)
    volume = torch.linalg.det(cell).abs()
    valid = pbc.to(de_deps.device).all(dim=1) & (volume > 0)
    sigma = de_deps / torch.where(valid, volume, torch.ones_like(volume))[:, None, None]
    return {"stress": torch.stack([sigma[:, i, j] for i, j in _VOIGT], dim=1), "stress_valid": valid}


def _with_stress(out: dict, batch: AtomsBatch) -> dict:
    """The padded stress step's ``virial`` (``-dE/dε``) turned into ``stress`` and ``stress_valid``."""
    out.update(stress_from_strain_gradient(-out.pop("virial"), batch.cell, batch.pbc))
    return out
