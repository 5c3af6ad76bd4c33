"""The eager path of :class:`~mlff_distiller.engine.ForceEngine` (``EagerPaths``, a mixin like
:class:`~mlff_distiller.engine_padded.PaddedPaths`): neighbour list, model and one ``torch.autograd.grad`` on the
batch's own shapes (the written-out backward on a CPU, :mod:`mlff_distiller.model.analytic`), and the neighbour
lists the padded paths share with it (fresh, Verlet-skin, molecules built on the host), with the spatial order of
large batches."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from mlff_distiller import kernels
from mlff_distiller.batch import AtomsBatch
from mlff_distiller.engine_padded import edge_virial, exact_pairs, stress_from_strain_gradient
from mlff_distiller.model import analytic as analytic_path
from mlff_distiller.neighbors import NeighborList, neighbor_list
from mlff_distiller.neighbors.molecular import (
    MOLECULAR_MAX_PAIRS,
    molecular_applicable,
    molecular_pairs,
    molecular_pairs_device,
)
from mlff_distiller.ordering import spatial_order
from mlff_distiller.precision import _matmul_precision

# Candidate pairs (Σ n_b²) up to which molecules given on the host for a GPU engine get their list on the host
# (molecular_pairs); larger batches get it on the device (molecular_pairs_device). Stop 74, H200 host, g2 molecules
# (benchmarks/results/stop74_gpu/a/): the host list took 314-525 µs for 256 molecules (10,545 candidates), 1.58-1.69
# ms for 1,024 (40,464), 9.4-12.5 ms for 4,096 (161,545), the device enumeration 0.73-1.40 ms at every size (its
# launches and waits): the crossover near 20,000-30,000 candidates. One molecule of up to 181 atoms stays on the host.
# Stop 76 (benchmarks/results/stop76_gpu/): the device enumeration is now Triton (kernels/molecular_pairs.py), 175-340
# µs at every size; the host list stays cheaper up to about 256 g2 molecules (9,128 edges: 602 µs host, the engine's
# device list 478 µs, within this host's noise), and limits of 2,048 or 8,192 won nothing clear end to end.
HOST_LIST_MAX_PAIRS = 32_768
# The device enumeration's limits, decided on the host: neighbor_list's on device tensors (Σ n_b² only).
_DEVICE_LIMITS = {"max_pairs": MOLECULAR_MAX_PAIRS, "max_structure_pairs": None}


@contextlib.contextmanager
def _frozen(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """The parameters that require grad stop requiring it, so inference keeps no graph for them; restored
    afterwards. ``params`` is the engine's list of its model's parameters, made once: walking ``parameters()``
    twice cost 61 µs of each eager call on the development CPU (now 12 µs). A parameter the caller put on the
    model later is not in it; it keeps requiring grad, which costs a little graph and changes no result."""
    toggled = [p for p in params if p.requires_grad]
    for p in toggled:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in toggled:
            p.requires_grad_(True)


class EagerPaths:
    """The eager step and the neighbour lists of :class:`~mlff_distiller.engine.ForceEngine` (its attributes are
    set by the engine's ``__init__``)."""

    def _neighbors(self, b: AtomsBatch):
        """A fresh neighbour list of a batch already on the engine's device."""
        return neighbor_list(b.positions, b.cell, b.pbc, b.batch, b.ptr, self.cutoff, self.neighbor_method)

    def _verlet_list(
        self, batch: AtomsBatch, *, filtered: bool, shift_vectors: bool = True
    ) -> tuple[NeighborList, bool]:
        """The Verlet-skin list of ``batch`` as the caller gave it (host data in MD, so the displacement test
        needs no device sync) and whether it was rebuilt. Molecules on the host are built there (all-pairs NumPy
        path), everything else on the engine's device. ``filtered``: cut to the cutoff (eager path: fewer edges);
        else the ``cutoff + skin`` list itself, whose extra pairs contribute exactly zero. ``shift_vectors=False``
        (unfiltered only): the list's ``topology``, whose shift vectors the caller makes for a kept list under a
        new cell (``pending_cell``)."""
        v = self.verlet
        rebuilt = v.needs_rebuild(batch.positions, batch.cell, batch.pbc, batch.batch, batch.ptr, batch.numbers)
        if rebuilt:
            self._rebuild_verlet(batch)
        v.n_calls += 1
        nl = v.last if shift_vectors or filtered else v.topology
        if filtered:
            nl = v.filtered(batch.positions.to(nl.edge_index.device))
        return nl, rebuilt

    def _rebuild_verlet(self, b: AtomsBatch) -> None:
        """Build the Verlet-skin list of batch ``b`` now: molecules of up to :data:`HOST_LIST_MAX_PAIRS` candidate
        pairs on the host there (all-pairs NumPy path), everything else on the engine's device. (Until stop 74 every
        molecule of up to 4M candidates was listed on the host: on the development CPU 3.2 / 20 / 183 ms a rebuild
        for one molecule of 200 / 500 / 1,500 atoms, against ~1 ms for the device enumeration.)"""
        device = None if molecular_applicable(b.positions, b.pbc, b.ptr, HOST_LIST_MAX_PAIRS) else self.device
        self.verlet.rebuild(b.positions, b.cell, b.pbc, b.batch, b.ptr, b.numbers, device=device)

    def _nl_to_device(self, nl: NeighborList) -> NeighborList:
        if nl.edge_index.device == self.device and nl.shift_vectors.dtype == self.dtype:
            return nl
        dev = self.device
        if nl.method == "molecular":
            # Zero shifts by construction: made on the device, not copied (5 MB for 4,096 g2 molecules).
            e = nl.edge_index.shape[1]
            shifts = torch.zeros((e, 3), dtype=nl.shifts.dtype, device=dev)
            shift_vectors = torch.zeros((e, 3), dtype=self.dtype, device=dev)
        else:
            shifts = nl.shifts.to(dev, non_blocking=True)
            shift_vectors = nl.shift_vectors.to(dev, self.dtype, non_blocking=True)
        return NeighborList(
            edge_index=nl.edge_index.to(dev, non_blocking=True),
            shifts=shifts,
            shift_vectors=shift_vectors,
            row_ptr=nl.row_ptr.to(dev, non_blocking=True),
            method=nl.method,
        )

    def _host_molecular_neighbors(self, batch: AtomsBatch, to_device: bool = True) -> NeighborList | None:
        """Molecules given on the host for an engine on another device: the list is built on the host by the
        all-pairs NumPy path (:mod:`mlff_distiller.neighbors.molecular`) and its edges copied over once, instead
        of ~100 small device operations with several device→host syncs (``to_device=False``: the host list
        itself). ``None`` when that does not apply."""
        if not self._host_molecules_for_device(batch, max_pairs=HOST_LIST_MAX_PAIRS):
            return None
        nl = molecular_pairs(batch.positions, batch.ptr, self.cutoff)
        return self._nl_to_device(nl) if to_device else nl

    def _device_molecular_neighbors(self, batch: AtomsBatch, dev: AtomsBatch) -> NeighborList | None:
        """Molecules given on the host for an engine on another device, too many for the host list
        (:data:`HOST_LIST_MAX_PAIRS`): the same enumeration on the device (``molecular_pairs_device``) from ``dev``,
        the batch on the device, with the host's ``ptr`` (no device read to size it; ``neighbor_list`` would first
        read ``pbc`` and ``ptr`` back to decide). ``None`` when that does not apply."""
        if not self._host_molecules_for_device(batch, **_DEVICE_LIMITS):
            return None
        return molecular_pairs_device(dev.positions, batch.ptr, self.cutoff)

    def _host_molecules_for_device(self, batch: AtomsBatch, **limits) -> bool:
        """Whether ``batch`` is molecules given on the host for an engine on another device, with a fresh list
        (no Verlet list, method ``auto``) within ``limits`` (:func:`molecular_applicable`'s)."""
        if self.verlet is not None or self.neighbor_method != "auto" or batch.device.type != "cpu":
            return False
        return self.device.type != "cpu" and molecular_applicable(batch.positions, batch.pbc, batch.ptr, **limits)

    def _compute_eager(self, batch: AtomsBatch, *, forces: bool, stress: bool) -> dict[str, torch.Tensor]:
        inv = None
        with torch.no_grad():
            if self.verlet is not None:
                batch, inv = self._verlet_order(batch)
                self._verlet_list_order(inv is not None)
                given_nl = self._nl_to_device(self._verlet_list(batch, filtered=True)[0])
            else:
                given_nl = self._host_molecular_neighbors(batch)
        batch = batch.to(self.device, self.dtype)
        if given_nl is None:
            batch, inv = self._spatial_order(batch)
        with torch.no_grad():
            nl = given_nl if given_nl is not None else self._neighbors(batch)
            if batch.positions64 is not None:
                batch, nl = exact_pairs(batch, nl)
        need_grad = forces or stress
        if self.device.type == "cuda" and self._eager_dry_run_due(need_grad, stress, batch.num_atoms, nl.num_edges):
            kernels.precompile(self._eager_step, batch, nl, need_grad, stress, device=self.device)
        energy, atomic, grads = self._eager_step(batch, nl, need_grad, stress)
        result = {"energy": energy.detach(), "atomic_energies": _unsort(atomic.detach(), inv)}
        if not need_grad:
            return result
        if forces:
            result["forces"] = -_unsort(grads[0], inv)
        if stress:
            de_deps = edge_virial(
                batch.positions, nl.shift_vectors, grads[1], nl.edge_index, batch.batch, batch.num_structures
            )
            result.update(stress_from_strain_gradient(de_deps, batch.cell, batch.pbc))
        return result

    def _eager_dry_run_due(self, need_grad: bool, stress: bool, n_atoms: int, n_edges: int) -> bool:
        """Whether an eager step compiles its Triton kernels in parallel first, in a dry run
        (kernels/_compile_ahead.py): the first step of each kind and size class (the powers of two of its atoms and
        edges). The kernels' launch configurations (tile sizes, atom or block variant, feature slices) change with
        the sizes, in steps near powers of two; a relaxation whose batch shrinks met new ones after its first step
        and compiled them one after another at their first launch (results/stop41_gpu/
        probe_first_call_compiles_h200.md). A dry run that finds everything compiled costs one step's host work,
        at most once per class. None on the torch kernels: there a dry run would only run the step's work twice."""
        if kernels.resolve_backend(self.device) == "torch":
            return False
        key = (need_grad, stress, int(n_atoms).bit_length(), int(n_edges).bit_length())
        if key in self._eager_compiled_ahead:
            return False
        self._eager_compiled_ahead.add(key)
        return True

    def _eager_step(self, batch: AtomsBatch, nl, need_grad: bool, stress: bool):
        """The model and one ``autograd.grad`` on a device batch and its list: energies, atomic energies and the
        gradients over the positions (and the shift vectors with ``stress``; zeros where unused), or None. On the
        CPU, the backward written out instead (``analytic``, :mod:`mlff_distiller.model.analytic`)."""
        if need_grad and self._analytic_now():
            self.n_analytic += 1
            energy, atomic, g_pos, g_shift = analytic_path.energy_and_gradients(
                self.model,
                batch.numbers,
                batch.positions,
                nl.edge_index,
                nl.shift_vectors,
                batch.batch,
                batch.num_structures,
                params=self._analytic_guard.weights(),
            )
            return energy.to(torch.float64), atomic.to(self.dtype), [g_pos] + ([g_shift] if stress else [])
        precision = _matmul_precision(self.allow_tf32, self.kernel_matmul_dtype)
        with precision, _frozen(self._params), torch.set_grad_enabled(need_grad):
            positions = batch.positions.detach().requires_grad_(need_grad)
            # Stress: the gradient over the shift vectors is the one over every pair vector (see edge_virial).
            shift_vectors = nl.shift_vectors.detach().requires_grad_(stress)
            # nl is a NeighborList, a full list by its contract: the message backward walks it without a sender sort
            out = self.model(
                batch.numbers, positions, nl.edge_index, shift_vectors, batch.batch, batch.num_structures,
                **self._symmetric_kw,
            )  # fmt: skip
            # the energies in float64 as the model sums them (StudentModel.forward)
            energy, atomic = out["energy"].to(torch.float64), out["atomic_energies"].to(self.dtype)
            if not need_grad:
                return energy, atomic, None
            inputs = [positions] + ([shift_vectors] if stress else [])
            grads = torch.autograd.grad(energy.sum(), inputs, allow_unused=True)
        grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs, strict=True)]
        return energy, atomic, grads

    def _analytic_now(self) -> bool:
        """This call takes the written-out backward: the engine allows it (``analytic``), the hot ops run on the
        torch kernels (the Triton backend, which the interpreter runs on CPU tensors, keeps its own kernels and
        their 16-bit GEMMs), the model is still the plain architecture (on the CPU the engine may share the
        caller's model, whose blocks the caller can replace) and no forward hook waits for its own forward
        (:class:`~mlff_distiller.model.analytic.Guard`)."""
        return (
            self.analytic
            and self.kernel_matmul_dtype is None
            and kernels.resolve_backend(self.device) == "torch"
            and self._analytic_guard.applicable()
        )

    def _spatial_order(self, batch: AtomsBatch) -> tuple[AtomsBatch, torch.Tensor | None]:
        """``batch`` with each structure's atoms in Morton order and the inverse permutation (caller's index ->
        sorted index, on the engine's device) when it holds at least ``spatial_sort_min_atoms`` atoms; else
        ``(batch, None)``. Bins of half the cutoff."""
        m = self.spatial_sort_min_atoms
        if m is None or batch.num_atoms < m:
            return batch, None
        perm = spatial_order(batch.positions, batch.batch, batch.num_structures, 0.5 * self.cutoff)
        return _permuted(batch, perm), _inverse(perm).to(self.device)

    def _verlet_list_order(self, sorted_: bool) -> None:
        """The Verlet list is about to be used with the atoms in Morton order (``sorted_``, the eager path of a
        large system) or in the caller's (the padded path, small systems): a list built in the other order is
        dropped first, so that the displacement test never compares positions of two orders."""
        if self._verlet_sorted is not None and self._verlet_sorted != sorted_:
            self.verlet.reset()
            self._verlet_fill = None
        self._verlet_sorted = sorted_

    def _verlet_order(self, batch: AtomsBatch) -> tuple[AtomsBatch, torch.Tensor | None]:
        """:meth:`_spatial_order` for the Verlet path (MD): one permutation per system, made from the first
        frame and kept while the atomic numbers and the structure of each atom stay the same, so that the Verlet
        list, its reference positions and the displacement test all see the atoms in one fixed order (atoms that
        diffuse away from their first-frame neighbours only cost locality, never correctness). The sorted numbers
        and structure indices are made once and handed over as the same tensors every step (the Verlet list's
        same-object shortcut); only the positions are gathered per step. A new system gets a new permutation, and
        its changed numbers or structures make the Verlet list rebuild."""
        m = self.spatial_sort_min_atoms
        if m is None or batch.num_atoms < m:
            return batch, None
        c = self._verlet_perm
        if c is None or not (_equal(c["numbers"], batch.numbers) and _equal(c["batch"], batch.batch)):
            perm = spatial_order(batch.positions, batch.batch, batch.num_structures, 0.5 * self.cutoff)
            c = self._verlet_perm = {
                "numbers": batch.numbers.clone(),
                "batch": batch.batch.clone(),
                "perm": perm,
                "inv": _inverse(perm).to(self.device),
                "sorted": _permuted(batch, perm),
            }
        out = object.__new__(AtomsBatch)  # the sorted batch of the first frame with this frame's positions
        out.__dict__.update(c["sorted"].__dict__)
        out.positions = batch.positions[c["perm"]]
        out.cell, out.pbc, out.ptr = batch.cell, batch.pbc, batch.ptr
        out.positions64, out.cell64 = batch.positions64, batch.cell64
        if batch.positions64 is not None:
            out.positions64 = batch.positions64[c["perm"].to(batch.positions64.device)]
        return out, c["inv"]


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _permuted(batch: AtomsBatch, perm: torch.Tensor) -> AtomsBatch:
    """``batch`` with its atoms in the order ``perm`` (new -> old; structures stay contiguous)."""
    exact = {} if batch.positions64 is None else {"positions64": batch.positions64[perm.to(batch.positions64.device)]}
    return dataclasses.replace(
        batch, numbers=batch.numbers[perm], positions=batch.positions[perm], batch=batch.batch[perm], **exact
    )


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b))


def _unsort(per_atom: torch.Tensor, inv: torch.Tensor | None) -> torch.Tensor:
    """Rows of a per-atom result computed in spatial order, back in the caller's order."""
    return per_atom if inv is None else per_atom.index_select(0, inv)
