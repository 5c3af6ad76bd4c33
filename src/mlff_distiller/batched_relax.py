"""Relax many structures at once: ASE's FIRE, per structure, with one engine call per step for all of them.

Relaxing thousands of conformers (or rattled crystals) one by one with an ASE optimizer costs one engine call per
structure and step, each a GPU step that small molecules fill poorly. :func:`relax_batch` keeps all positions on the
device, computes every structure's forces in one call per step (the Verlet-skin list of
:func:`~mlff_distiller.batched_md.batch_engine`), and applies ASE's FIRE update to each structure with its own
state (velocity, time step, mixing factor, step count since the power went negative): each structure follows the
path ASE's ``FIRE`` would take on it alone (tested in float64), and stops moving once its largest atomic force is
below ``fmax``, as ASE's optimizer stops. The cell is held fixed.

Structures converge after very different numbers of steps (4,096 rattled g2 molecules: 51 on average, the slowest
162). Once most of a large batch is done, the finished structures leave it (``compact``), so that the steps left
cost what the structures still relaxing cost; each structure's path is the same (tested in float64). With
``max_atoms`` the batch holds at most that many atoms: structures start in input order as finished ones make room, so
that millions of structures stream through a batch that fits the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mlff_distiller import batch as batch_module
from mlff_distiller._fire import _Fire
from mlff_distiller.batch import AtomsBatch
from mlff_distiller.batched_md import batch_engine
from mlff_distiller.batching import recompute_before_retry
from mlff_distiller.frames import FrameTable
from mlff_distiller.model import StudentModel

__all__ = ["COMPACT_MIN_ATOMS", "REFILL_AT", "Relaxed", "relax_arrays", "relax_batch"]

# relax_batch drops its finished structures only from batches of at least this many atoms: a smaller step costs its
# kernel launches, not its atoms, and a new batch shape costs a list build (and on a GPU, a bucket's capture).
COMPACT_MIN_ATOMS = 2048
# With structures waiting (max_atoms), the finished ones are replaced once this fraction of the batch is done: each
# regrouping costs a list build and a capture of FIRE's step (and a new batch shape, a bucket's capture), so not at
# every structure. 16,384 g2 molecules on an H100: 0.1 was 1.3-2.8x slower than 0.5, 0.25 in between
# (benchmarks/results/relax_stream_h100/probe_relax_stream.md).
REFILL_AT = 0.5


@dataclass
class Relaxed:
    """Every structure's end state from :func:`relax_arrays`, as arrays in the input's layout (structure ``k``'s
    atoms are rows ``ptr[k]:ptr[k + 1]``)."""

    numbers: np.ndarray  # [N] atomic numbers
    positions: np.ndarray  # [N, 3] relaxed positions, Å
    cells: np.ndarray  # [B, 3, 3] (held fixed)
    pbc: np.ndarray  # [B, 3]
    ptr: np.ndarray  # [B + 1] atom offsets
    forces: np.ndarray  # [N, 3] eV/Å at the relaxed positions
    energies: np.ndarray  # [N] per-atom energies, eV
    energy: np.ndarray  # [B] eV
    converged: np.ndarray  # [B] bool: the largest atomic force below fmax
    steps: np.ndarray  # [B] FIRE steps taken
    failed: list[int]  # structures whose forces or energy stopped being finite (each stopped there): no result
    too_large: list[int]  # structures that do not fit in the device's memory alone (never computed): no result
    domain: dict[int, str]  # structures that ended outside the student's training envelope: the findings

    def reasons(self) -> dict[int, str]:
        """``{structure: why it has no result}``."""
        why = {k: "reached non-finite forces or energy (stopped there)" for k in self.failed}
        for k in self.too_large:
            n = int(self.ptr[k + 1] - self.ptr[k])
            why[k] = f"does not fit in the device's memory alone ({n} atoms)"
        return why


@torch.no_grad()
def relax_batch(
    model: StudentModel | str | Path,
    structures: Sequence | FrameTable,
    *,
    fmax: float = 0.05,
    steps: int = 1000,
    device: torch.device | str | None = None,
    precision: str = "fp32",
    skin: float = 1.0,
    dt: float = 0.1,
    maxstep: float = 0.2,
    dtmax: float = 1.0,
    n_min: int = 5,
    finc: float = 1.1,
    fdec: float = 0.5,
    astart: float = 0.1,
    fa: float = 0.99,
    mode: str = "auto",
    check_domain: bool = True,
    compact: float = 0.5,
    max_atoms: int | str | None = "auto",
) -> list:
    """Relax every structure's positions with FIRE until its largest atomic force is below ``fmax`` (eV/Å).

    Args:
        model: a :class:`~mlff_distiller.model.StudentModel`, a checkpoint path or ``"builtin:NAME"``.
        structures: ``ase.Atoms`` (not modified; any sizes, molecules or fixed periodic cells), or a
            :class:`~mlff_distiller.batch.FrameTable` of them. ASE constraints are refused: they would not be applied.
        fmax: convergence threshold, eV/Å (ASE's: the largest per-atom force norm). In fp32 the forces carry
            ~1e-5 eV/Å of rounding; below ~1e-3 use ``precision="fp64"``.
        steps: at most this many FIRE steps per structure (ASE's ``run(steps=...)``).
        dt, maxstep, dtmax, n_min, finc, fdec, astart, fa: ASE's FIRE parameters and defaults (``maxstep``: the
            largest move of a structure's whole displacement per step, Å; ``n_min``: ASE's ``Nmin``).
        device, precision, mode, skin: of the engine (:func:`~mlff_distiller.batched_md.batch_engine`). The engine
            is kept for the next call with the same student and settings, in :func:`~mlff_distiller.predict_forces`'s
            cache and under its rules (the same student object with unchanged parameters and buffers;
            :func:`~mlff_distiller.predict.clear_engine_cache` frees it).
        compact: once at most this fraction of the batch's structures are still relaxing, the others leave it, so
            that the remaining steps cost what the structures still relaxing cost (on batches of at least
            ``COMPACT_MIN_ATOMS`` atoms, below which a step costs its launches, not its atoms); 0 keeps every
            structure in the batch to the end. Each structure's path is the same either way.
        max_atoms: at most this many atoms in the batch at once (a memory bound: millions of structures need not
            fit in one step). The structures start in input order as the budget allows, and each one that finishes
            makes room for the next (at least one structure at a time, however large). ``"auto"``: on CUDA the
            atoms :func:`~mlff_distiller.predict_forces` would put in one batch (half the free memory by the
            engine's estimate), elsewhere all at once; None: all at once. On a CUDA out-of-memory error the
            structures beyond half the batch's atoms wait with their state and the budget stays halved; a structure
            that does not fit alone is left out and named (nothing computed is lost).
        check_domain: with a student that stores its training envelope (:mod:`mlff_distiller.domain`), check the
            relaxed structures against it: a relaxation can end where the student never saw data (atoms pressed
            together, where an untrained student may have no repulsion). Those get ``info["domain"]`` (the
            findings) and an :class:`~mlff_distiller.domain.OutOfDomainWarning` names them.

    Returns:
        New ``ase.Atoms`` in input order, at their relaxed positions, each with a ``SinglePointCalculator``
        (``energy``, ``free_energy``, ``forces`` and ``energies`` there) and ``info["relax_converged"]`` (bool),
        ``info["relax_steps"]`` (the FIRE steps it took). :func:`relax_arrays` gives the same as arrays.
    Raises:
        ValueError: bad input (before any step): an unknown element, non-finite positions, a degenerate periodic
            cell, ASE constraints, bad arguments.
        NonFiniteOutputError: some structures' forces stopped being finite, or one does not fit in the device's
            memory alone: its ``results`` hold every other structure relaxed, ``reasons`` say why per structure.
    """
    arguments = dict(locals())  # relax_arrays takes the same arguments
    from ase.calculators.singlepoint import SinglePointCalculator

    if hasattr(structures, "get_positions"):
        structures = [structures]
    table = isinstance(structures, FrameTable)
    if not table:
        structures = list(structures)
    run = relax_arrays(**{**arguments, "structures": structures})
    relaxed = []
    for k in range(len(structures)):
        lo, hi = run.ptr[k], run.ptr[k + 1]
        new = structures[k] if table else structures[k].copy()  # (a FrameTable's item is a new Atoms)
        new.calc = None
        new.positions = run.positions[lo:hi]
        e = float(run.energy[k])
        new.calc = SinglePointCalculator(
            new, energy=e, free_energy=e, forces=run.forces[lo:hi].copy(), energies=run.energies[lo:hi].copy()
        )
        new.info["relax_converged"] = bool(run.converged[k])
        new.info["relax_steps"] = int(run.steps[k])
        if k in run.domain:
            new.info["domain"] = run.domain[k]
        relaxed.append(new)
    if run.domain:
        import warnings

        from mlff_distiller.domain import OutOfDomainWarning

        outside = sorted(run.domain)
        more = f" and {len(outside) - 10} more" if len(outside) > 10 else ""
        warnings.warn(
            OutOfDomainWarning(
                f"relax_batch: structure(s) {outside[:10]}{more} ended outside the student's training data "
                f"(structure {outside[0]}: {run.domain[outside[0]]}); their relaxed geometries are "
                "extrapolations (info['domain'] names what lies outside)"
            ),
            stacklevel=3,  # the caller's line (past torch.no_grad's wrapper)
        )
    if run.failed or run.too_large:
        from mlff_distiller.batching import NonFiniteOutputError

        says = []
        if run.failed:
            says.append(f"structure(s) {run.failed[:20]} reached non-finite forces or energy (each stopped there)")
        if run.too_large:
            says.append(f"structure(s) {run.too_large[:20]} do not fit in the device's memory alone (not relaxed)")
        reasons = run.reasons()
        raise NonFiniteOutputError(
            f"relax_batch: {'; '.join(says)}; the others are relaxed, in this error's results",
            indices=sorted(reasons),
            results=[None if k in reasons else relaxed[k] for k in range(len(relaxed))],
            reasons=reasons,
        )
    return relaxed


@torch.no_grad()
def relax_arrays(
    model: StudentModel | str | Path,
    structures: Sequence | FrameTable,
    *,
    fmax: float = 0.05,
    steps: int = 1000,
    device: torch.device | str | None = None,
    precision: str = "fp32",
    skin: float = 1.0,
    dt: float = 0.1,
    maxstep: float = 0.2,
    dtmax: float = 1.0,
    n_min: int = 5,
    finc: float = 1.1,
    fdec: float = 0.5,
    astart: float = 0.1,
    fa: float = 0.99,
    mode: str = "auto",
    check_domain: bool = True,
    compact: float = 0.5,
    max_atoms: int | str | None = "auto",
) -> Relaxed:
    """:func:`relax_batch` without an ``ase.Atoms`` per result: every structure's end state as arrays in the
    input's layout (:class:`Relaxed`), structures that could not be relaxed named in it rather than raised, and no
    warning for those outside the training envelope (``Relaxed.domain`` names them). Same arguments, same paths.
    ``mlff-distill relax`` writes its extxyz output from these arrays (building and writing an ``Atoms`` per
    structure cost more than its share of the GPU's work)."""
    from mlff_distiller.checkpoint import load_model

    check_relax_args(fmax=fmax, steps=steps, compact=compact, max_atoms=max_atoms, dt=dt, maxstep=maxstep, dtmax=dtmax)
    if hasattr(structures, "get_positions"):
        structures = [structures]
    table = isinstance(structures, FrameTable)
    if not table:
        structures = list(structures)
    if not len(structures):
        raise ValueError("relax_batch needs at least one structure")
    for k, a in enumerate([] if table else structures):  # (a FrameTable holds no constraints)
        if a.constraints:
            names = ", ".join(type(c).__name__ for c in a.constraints)
            raise ValueError(
                f"structure {k} carries ASE constraints ({names}) that relax_batch does not apply; remove them, or "
                "relax that structure with an ASE optimizer and StudentCalculator"
            )
    if not isinstance(model, StudentModel):
        model = load_model(model)
    # The engine is kept for the next call, as predict_forces keeps its own (the same cache, same rules: the same
    # student object, unchanged; clear_engine_cache frees it): a new engine captures its buckets again, most of a
    # call for a few structures.
    from mlff_distiller.predict import _engine_for

    molecular = not bool(structures.pbc.any()) if table else not any(bool(np.any(a.pbc)) for a in structures)
    settings = {"relax": True, "device": device, "precision": precision, "mode": mode, "skin": skin, "mol": molecular}
    engine = _engine_for(
        model,
        settings,
        make=lambda: batch_engine(model, molecular, device=device, precision=precision, mode=mode, skin=skin),
    )
    dev = engine.device
    # Every structure validated (and its elements checked) before the first step: a bad one found later would stop
    # a run whose results so far would be lost. On the host; each part of the batch goes to the device as it starts.
    everything = AtomsBatch.from_atoms(structures, device="cpu", dtype=torch.float64)
    model.check_species(everything.numbers)
    queue = _Queue(everything, dev)
    if max_atoms == "auto":  # the atoms predict_forces would put in one batch (half the free memory, on CUDA)
        max_atoms = engine.atom_budget() if dev.type == "cuda" else None
    limit = everything.num_atoms if max_atoms is None else int(max_atoms)
    kw = dict(steps=steps, fmax=fmax, dt=dt, maxstep=maxstep, dtmax=dtmax, n_min=n_min, finc=finc, fdec=fdec)
    kw |= dict(astart=astart, fa=fa)
    batch = queue.take(limit)
    fire = _Fire(batch, **kw)
    final = _Final(everything.ptr)  # each structure's result, written when it leaves the batch
    ids = torch.arange(batch.num_structures, device=dev)  # the input index of each structure in the batch
    parked: list[tuple[torch.Tensor, AtomsBatch, _Fire]] = []  # structures set aside by an out-of-memory error
    too_large: list[int] = []  # structures that do not fit in the device's memory alone
    checked = None  # the batch object last given float64 pair vectors where it needs them
    while True:
        if batch is not checked:  # a new batch (the first, or regrouped): one device sync, as the regrouping's own
            _exact_pairs_if_far(batch, engine)
            checked = batch
        try:
            out = engine.compute(batch) if batch.num_structures else None
        except torch.OutOfMemoryError as err:
            # One structure alone: once more with the update blocks' recompute (11 % less peak memory), if it helps.
            if batch.num_structures == 1 and recompute_before_retry(engine, batch.num_atoms, err, "relax: a structure"):
                continue
            # The leading structures within half the atoms go on; the others wait with their state (nothing
            # computed is lost). A structure that does not fit alone is left out and named at the end.
            engine._lower_atom_budget(batch.num_atoms)
            limit = max(1, min(limit, batch.num_atoms // 2))
            order = torch.arange(batch.num_structures, device=dev)
            # (at least the first structure, tried alone: it is too large only when it fails alone)
            n_first = 0 if batch.num_structures == 1 else max(1, int((batch.ptr[1:] <= limit).sum()))
            if n_first == 0:
                too_large.append(int(ids[0]))
            keep, wait = order < n_first, order >= max(n_first, 1)
            if bool(wait.any()):
                rest = _subset(batch, wait)
                parked.insert(0, (ids[wait], rest, fire.subset(wait, rest)))
            batch, ids = _subset(batch, keep), ids[keep]
            fire = fire.subset(keep, batch)
            continue
        if out is not None:
            fire.forces.copy_(out["forces"])
            # ASE's FIRE per structure: its first step only accelerates from rest; a converged or failed
            # structure, or one that took `steps` steps, does not move any more.
            fire.step()
        finished = int(fire.done.sum())
        waiting = not queue.empty or bool(parked)
        if finished == batch.num_structures and not waiting:
            break
        if not waiting:
            if finished < (1.0 - compact) * batch.num_structures or batch.num_atoms < COMPACT_MIN_ATOMS:
                continue
            # Most structures are done: those leave the batch (they do not move any more), so that the steps
            # left cost what the structures still relaxing cost. Each structure's path is unchanged (test).
        elif batch.num_structures and finished < max(1.0, REFILL_AT * batch.num_structures):
            continue
        # The finished structures leave; structures set aside or not started yet take their place (max_atoms).
        if out is not None:
            final.keep(ids, batch, fire, out, fire.done)
        keep = ~fire.done
        batch, ids = _subset(batch, keep), ids[keep]
        fire = fire.subset(keep, batch)
        while parked and (batch.num_structures == 0 or batch.num_atoms + parked[0][1].num_atoms <= limit):
            more_ids, more, more_fire = parked.pop(0)
            batch, ids = _concat(batch, more), torch.cat([ids, more_ids])
            fire = fire.merge(more_fire, batch)
        if not parked:
            start = queue.next
            new = queue.take(limit - batch.num_atoms, at_least_one=batch.num_structures == 0)
            if new is not None:
                batch, ids = _concat(batch, new), torch.cat([ids, torch.arange(start, queue.next, device=dev)])
                fire = fire.merge(_Fire(new, **kw), batch)
    if batch.num_structures:
        final.keep(ids, batch, fire, out)
    failed = set(final.failed)
    good = [k for k in range(len(final.energy)) if k not in failed and k not in set(too_large)]
    domain = _domain_findings(model, everything, final.positions, good, dev) if check_domain else {}
    failed |= {k for k in good if not np.isfinite(final.energy[k])}
    return Relaxed(
        numbers=everything.numbers.numpy(),
        positions=final.positions,
        cells=everything.cell.numpy(),
        pbc=everything.pbc.numpy(),
        ptr=final.ptr,
        forces=final.forces,
        energies=final.energies,
        energy=final.energy,
        converged=final.converged,
        steps=final.taken,
        failed=sorted(failed),
        too_large=sorted(set(too_large)),
        domain=domain,
    )


def check_relax_args(*, fmax=0.05, steps=1000, compact=0.5, max_atoms="auto", dt=0.1, maxstep=0.2, dtmax=1.0) -> None:
    """The ``ValueError`` :func:`relax_batch` raises for these arguments, if any (also checked by
    :func:`~mlff_distiller.relax_stream.relax_file` before it opens its output)."""
    if not fmax > 0 or not np.isfinite(fmax):
        raise ValueError(f"fmax must be a finite number of eV/Å > 0, got {fmax}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if not 0 <= compact < 1:
        raise ValueError(f"compact must be a fraction in [0, 1), got {compact}")
    if max_atoms is not None and max_atoms != "auto" and (not isinstance(max_atoms, int | np.integer) or max_atoms < 1):
        raise ValueError(f"max_atoms must be 'auto', None or a number of atoms >= 1, got {max_atoms!r}")
    for name, value in (("dt", dt), ("maxstep", maxstep), ("dtmax", dtmax)):
        if not value > 0 or not np.isfinite(value):
            raise ValueError(f"{name} must be a finite number > 0, got {value}")


def _domain_findings(
    model: StudentModel, everything: AtomsBatch, positions: np.ndarray, ids: list[int], device: torch.device
) -> dict[int, str]:
    """``{structure: findings}`` for the relaxed structures ``ids`` (at ``positions``) outside the student's
    envelope (checked from the arrays: no ``Atoms`` but for those found outside)."""
    from mlff_distiller.domain import DomainEnvelope, _take

    envelope = DomainEnvelope.of_model(model)
    if envelope is None or not ids:
        return {}
    table = FrameTable(
        everything.numbers.numpy(),
        positions,
        everything.cell.numpy(),
        everything.pbc.numpy(),
        everything.counts.numpy(),
    )
    found = envelope.check_many(_take(table, ids), device=device)
    return {k: "; ".join(f) for k, f in zip(ids, found, strict=True) if f}


def _subset(batch: AtomsBatch, keep: torch.Tensor) -> AtomsBatch:
    """The structures ``keep`` (``[B]`` bool, on the batch's device) of ``batch``, in their order."""
    atoms = keep.index_select(0, batch.batch)
    counts = batch.counts[keep]
    ptr = torch.zeros(counts.shape[0] + 1, dtype=torch.long, device=counts.device)
    torch.cumsum(counts, 0, out=ptr[1:])
    owner = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts)
    return AtomsBatch(
        numbers=batch.numbers[atoms],
        positions=batch.positions[atoms],
        cell=batch.cell[keep],
        pbc=batch.pbc[keep],
        batch=owner,
        ptr=ptr,
    )


class _Queue:
    """The structures not started yet: consecutive ranges of the validated host batch, moved to the device as they
    start."""

    def __init__(self, everything: AtomsBatch, device: torch.device) -> None:
        self.all, self.device, self.next = everything, device, 0
        self.ptr = everything.ptr.numpy()

    @property
    def empty(self) -> bool:
        return self.next >= self.all.num_structures

    def take(self, budget: int, at_least_one: bool = True) -> AtomsBatch | None:
        """The next structures whose atoms fit in ``budget`` (at least one if ``at_least_one``), or None."""
        lo, ptr = self.next, self.ptr
        if self.empty:
            return None
        hi = int(np.searchsorted(ptr, ptr[lo] + budget, side="right")) - 1  # ptr[hi] - ptr[lo] <= budget
        hi = min(max(hi, lo + 1 if at_least_one else lo), self.all.num_structures)
        if hi == lo:
            return None
        self.next = hi
        a, b = int(ptr[lo]), int(ptr[hi])
        src, dev = self.all, self.device
        return AtomsBatch(
            numbers=src.numbers[a:b].to(dev),
            # A copy even on the host: FIRE moves these in place, and a FrameTable's batch views the caller's array.
            positions=src.positions[a:b].to(dev, copy=True),
            cell=src.cell[lo:hi].to(dev),
            pbc=src.pbc[lo:hi].to(dev),
            batch=(src.batch[a:b] - lo).to(dev),
            ptr=(src.ptr[lo : hi + 1] - a).to(dev),
        )


def _exact_pairs_if_far(batch: AtomsBatch, engine) -> None:
    """A batch with coordinates of ``PRECISE_PAIRS_FROM`` Å and more (a large box, a molecule far from the origin:
    the positions are in the caller's frame) for an engine below float64: the engine makes its pair vectors from
    the float64 positions that FIRE moves (the same tensors, ``AtomsBatch.positions64``), not from their float32
    rounding (a molecule 10,000 Å away: ~0.016 eV/Å off, a third of the default ``fmax``). On the host the engine
    does this itself (``ForceEngine._exact_float64_batch``); on a GPU it would cost a sync every step, so it is decided
    here once per batch. Relaxations move atoms little: a structure that crosses the threshold during one (its
    float32 error is that of ~100 Å, ~1e-5 of its largest force) is looked at again when its batch regroups."""
    if batch_module.needs_float64_pairs(batch, engine.dtype):
        batch.positions64, batch.cell64 = batch.positions, batch.cell


def _concat(first: AtomsBatch, second: AtomsBatch) -> AtomsBatch:
    """``first``'s structures, then ``second``'s."""
    return AtomsBatch(
        numbers=torch.cat([first.numbers, second.numbers]),
        positions=torch.cat([first.positions, second.positions]),
        cell=torch.cat([first.cell, second.cell]),
        pbc=torch.cat([first.pbc, second.pbc]),
        batch=torch.cat([first.batch, second.batch + first.num_structures]),
        ptr=torch.cat([first.ptr, second.ptr[1:] + first.num_atoms]),
    )


class _Final:
    """Every structure's end state (positions, forces, energies, converged, failed, steps taken) in the input's
    layout on the host, written as structures leave the batch."""

    def __init__(self, ptr: torch.Tensor) -> None:
        self.ptr = ptr.cpu().numpy()  # the input's atom offsets
        self._ptr = None  # on the device, made at the first write
        n, b = int(self.ptr[-1]), len(self.ptr) - 1
        self.positions = np.zeros((n, 3))
        self.forces = np.zeros((n, 3))
        self.energies = np.zeros(n)
        self.energy = np.zeros(b)
        self.converged = np.zeros(b, dtype=bool)
        self.taken = np.zeros(b, dtype=np.int64)
        self.failed: list[int] = []

    def keep(self, ids: torch.Tensor, batch: AtomsBatch, fire: _Fire, out: dict, which: torch.Tensor | None = None):
        """Write the structures ``which`` (``[B]`` bool; None: all) of ``batch``, whose input indices are ``ids``;
        ``out`` is the engine's result at their positions (a structure that is done does not move)."""
        sel = torch.ones_like(fire.done) if which is None else which
        owner = batch.batch
        if self._ptr is None:
            self._ptr = torch.as_tensor(self.ptr, device=owner.device)
        atoms = sel.index_select(0, owner)
        local = torch.arange(batch.num_atoms, device=owner.device) - batch.ptr.index_select(0, owner)
        rows = (self._ptr.index_select(0, ids.index_select(0, owner)) + local)[atoms].cpu().numpy()
        self.positions[rows] = batch.positions[atoms].cpu().numpy()
        self.forces[rows] = out["forces"].detach()[atoms].cpu().numpy()
        self.energies[rows] = out["atomic_energies"].detach()[atoms].cpu().numpy()
        structures = ids[sel].cpu().numpy()
        self.energy[structures] = out["energy"].detach()[sel].cpu().numpy()
        self.converged[structures] = fire.converged[sel].cpu().numpy()
        self.taken[structures] = fire.taken[sel].cpu().numpy()
        self.failed += ids[sel & fire.failed].cpu().tolist()
