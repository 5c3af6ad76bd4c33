"""How many structures :meth:`ForceEngine.predict <mlff_distiller.engine.ForceEngine.predict>` puts in a batch: the
device memory one step needs, the atom budget it plans for, and that budget after an out-of-memory error (a mixin
of :class:`~mlff_distiller.engine.ForceEngine`, which holds the state these methods use: ``model``, ``dtype``,
``device``, ``memory_budget``, ``_bytes_scale``, ``_atom_budget_cap``, ``_atom_budget_at_oom``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mlff_distiller.batch import AtomsBatch
from mlff_distiller.batching import SMALL_CALL_ATOMS, predict_structures

__all__ = [
    "DEFAULT_ATOM_BUDGET",
    "DEFAULT_MEMORY_FRACTION",
    "EDGES_PER_ATOM_GUESS",
    "OOM_CAP_LIFT",
    "SMALL_CALL_ATOMS",
    "BudgetMixin",
]

# Atoms per chunk when predict() is given no batch_size and no memory budget: keeps the reference path's
# [E, 3F] tensors in memory.
DEFAULT_ATOM_BUDGET = {"cuda": 8192, "cpu": 2048}
# Fraction of the free device memory predict() may plan to use when no memory_budget is given.
DEFAULT_MEMORY_FRACTION = 0.5
# Neighbours per atom assumed before a batch's neighbour list is known (organic molecules, 5 Å: 10-40).
EDGES_PER_ATOM_GUESS = 40
# A batch cap lowered after an out-of-memory error is lifted when the atom budget found later is at least this
# many times the one found at the error (twice: the memory once freed by a dropped kept engine, or another
# process ending; not the noise of the caching allocator between calls).
OOM_CAP_LIFT = 2


class BudgetMixin:
    """Batch sizing and the batched :meth:`predict` of :class:`~mlff_distiller.engine.ForceEngine`."""

    def estimate_bytes(self, n_atoms: int, n_edges: int) -> int:
        """Peak device memory (bytes) of one energy + forces step, from the model's shapes (scaled by
        :meth:`probe_memory` when it ran). Per edge: the reference message step keeps ~ten ``[E, F]`` float
        tensors per layer for the backward; per atom ~twenty ``[N, F]``."""
        c = self.model.config
        item = torch.finfo(self.dtype).bits // 8
        per_edge = (10 * c.hidden * c.layers + 4 * c.n_rbf + 16) * item + 16
        per_atom = (20 * c.hidden * c.layers + 16) * item + 16
        return int(self._bytes_scale * (per_atom * n_atoms + per_edge * n_edges))

    def probe_memory(self, structures: Sequence) -> float:
        """Measure the peak memory of one batch of ``structures`` on CUDA and rescale :meth:`estimate_bytes`
        to it. Returns the measured / estimated ratio (1.0 off CUDA, where nothing is measured)."""
        if self.device.type != "cuda":
            return 1.0
        batch = AtomsBatch.from_atoms(list(structures), dtype=self.dtype)
        dev = batch.to(self.device, self.dtype)
        with torch.no_grad():
            nl = self._neighbors(dev)
        self._sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self._compute_eager(batch, forces=True, stress=False)
        self._sync()
        peak = torch.cuda.max_memory_allocated(self.device) - base
        old = self._bytes_scale
        self._bytes_scale = 1.0
        est = self.estimate_bytes(batch.num_atoms, nl.num_edges)
        self._bytes_scale = max(peak / max(est, 1), 0.05) if peak > 0 else old
        return self._bytes_scale

    def atom_budget(self) -> int:
        """Atoms per batch that :meth:`predict` plans for: from ``memory_budget`` (or, on CUDA, half the free
        memory) and :meth:`estimate_bytes` with ``EDGES_PER_ATOM_GUESS`` neighbours; lowered after an OOM.

        The lowered cap lasts while the memory found stays where it was at the OOM. When a later call finds at
        least ``OOM_CAP_LIFT`` times as much (another process or a dropped engine freed it, or a larger
        ``memory_budget`` was set), the cap is lifted: an engine kept across calls (``predict_forces``) would
        otherwise run small batches for the rest of the process after one transient OOM."""
        atoms = self._uncapped_atom_budget()
        cap = self._atom_budget_cap
        if cap is not None and atoms >= OOM_CAP_LIFT * self._atom_budget_at_oom:
            self._atom_budget_cap = cap = None
        return atoms if cap is None else min(atoms, cap)

    def atom_budget_for(self, n_atoms: int) -> int:
        """:meth:`atom_budget` for a call of ``n_atoms`` atoms in all: without the device query where it cannot
        matter (a CUDA engine sized by free memory, no cap from an out-of-memory error, at most
        ``SMALL_CALL_ATOMS`` atoms: one batch of them)."""
        if (
            n_atoms <= SMALL_CALL_ATOMS
            and self.memory_budget is None
            and self._atom_budget_cap is None
            and self.device.type == "cuda"
        ):
            return max(int(n_atoms), 1)
        return self.atom_budget()

    def _lower_atom_budget(self, n_atoms: int) -> None:
        """A batch of ``n_atoms`` ran out of device memory: later batches start no larger than half of it (see
        :meth:`atom_budget`), remembering the budget found now for when memory frees up."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._atom_budget_cap = max(1, min(self._atom_budget_cap or n_atoms, n_atoms // 2))
        self._atom_budget_at_oom = self._uncapped_atom_budget()

    def _uncapped_atom_budget(self) -> int:
        budget = self.memory_budget
        if budget is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(DEFAULT_MEMORY_FRACTION * free)
        if budget is None:
            atoms = DEFAULT_ATOM_BUDGET.get(self.device.type, DEFAULT_ATOM_BUDGET["cpu"])
        else:
            atoms = max(1, budget // max(1, self.estimate_bytes(1, EDGES_PER_ATOM_GUESS)))
        return atoms

    def predict(
        self,
        structures: Sequence,
        *,
        batch_size: int | None = None,
        stress: bool = False,
        atom_budget: int | None = None,
        pipeline: bool | None = None,
    ) -> list[dict]:
        """Energies, forces (and stress for periodic structures) as one dict per structure, in input order.

        ``batch_size`` is a number of structures per batch; when None, batches are filled up to an atom budget
        (``atom_budget``, else :meth:`atom_budget`). A batch that runs out of device memory is split in halves
        and retried (``oom_splits`` counts it), and later batches start no larger than the half that fit.
        ``pipeline`` (default: on for CUDA, given more than one batch): the next batch is read and launched on the host
        while the device computes the current one (:mod:`mlff_distiller.batching`); the same results either way. A NaN
        or inf output is never returned: :class:`~mlff_distiller.batching.NonFiniteOutputError` comes after all other
        structures are done and carries their results. (:meth:`compute` returns the device tensors unchecked.)
        """
        return predict_structures(
            self, structures, batch_size=batch_size, stress=stress, atom_budget=atom_budget, pipeline=pipeline
        )
