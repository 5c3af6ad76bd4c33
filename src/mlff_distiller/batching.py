"""Many structures through one :class:`~mlff_distiller.engine.ForceEngine`: batches, the host/device pipeline,
out-of-memory splits and the per-structure result rows (:meth:`ForceEngine.predict` and ``predict_forces``).

A structure whose energy, forces or stress come out non-finite (NaN or inf, e.g. a float32 overflow in a
structure far outside anything the model describes: atoms on top of each other, thousands of neighbours) is never
returned as a number: every other structure is still computed, then :class:`NonFiniteOutputError` names the bad
ones and carries all results (``None`` at the bad indices).

The host work of a batch (reading the ``ase.Atoms``, the molecular neighbour list, the result rows) costs
~5 µs per small molecule on the GPU machine's host, several times the device step (~1.3 µs per g2 molecule on an
H100, benchmarks/results/bench_host_h100_final.md). With ``pipeline`` on, batch k+1 is read and launched while
the device still computes batch k, whose outputs come back through page-locked memory by an asynchronous copy;
batch k's rows are made once its copy has landed. The results are those of the sequential loop, in input order.
"""

from __future__ import annotations

import itertools
import math
import traceback
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from mlff_distiller.batch import AtomsBatch, FrameTable

if TYPE_CHECKING:
    from mlff_distiller.engine import ForceEngine

__all__ = ["NonFiniteOutputError", "all_finite", "chunks", "nonfinite_message", "predict_structures", "result_rows"]


class NonFiniteOutputError(ValueError):
    """The student gave a non-finite energy, force or stress for some structures.

    Attributes:
        indices: the input positions of those structures.
        results: one entry per input structure: its result dict, or ``None`` for the structures in ``indices``
            (nothing else that was computed is lost).
        reasons: why, per index in ``indices``, where the raiser says (``relax_batch`` does); else empty.
    """

    def __init__(self, message: str, indices: list[int], results: list, reasons: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.indices, self.results = indices, results
        self.reasons = dict(reasons or {})


def all_finite(*arrays: np.ndarray) -> bool:
    """No NaN or inf in any of ``arrays``: one float64 sum each (a NaN or inf anywhere makes it non-finite; ~1.5 µs
    for benzene's forces on the development CPU), and the exact test only when the total is not finite (finite
    float64 values near 1e308 can overflow it)."""
    total = 0.0
    for a in arrays:
        total += float(a.sum(dtype=np.float64))
    if math.isfinite(total):
        return True
    return all(bool(np.isfinite(a).all()) for a in arrays)


def nonfinite_message(atoms, cutoff: float, where: str = "structure") -> str:
    """Why a structure's outputs may have overflowed: its closest atom pair and its largest number of neighbours
    within ``cutoff`` (periodic images included), from ASE's neighbour list."""
    from ase.neighborlist import neighbor_list

    msg = f"{where}: the student's energy, forces or stress are not finite (NaN or inf)"
    if atoms.pbc.any():
        volume = abs(float(np.linalg.det(atoms.cell.array))) if atoms.pbc.all() else 0.0
        if volume > 0:
            pairs = len(atoms) ** 2 * (4 / 3) * math.pi * float(cutoff) ** 3 / volume
            if pairs > 5e7:  # ASE's list would take minutes and gigabytes: the density says enough
                return f"{msg}; it has {len(atoms) / volume:.3g} atoms/Å³, ~{pairs / len(atoms):.3g} neighbours each"
    try:
        i, d = neighbor_list("id", atoms, float(cutoff), self_interaction=False)
    except Exception:
        return msg
    if len(d) == 0:
        return msg
    most = int(np.bincount(i, minlength=len(atoms)).max())
    return (
        f"{msg}; its closest atom pair is {float(d.min()):.3g} Å apart and one atom has {most} neighbours within "
        f"{float(cutoff):g} Å (a structure far outside the training data overflows float32; if these numbers are "
        "ordinary, check the model's weights)"
    )


# Calls of at most this many atoms in all are one batch on CUDA without the free-memory query (cudaMemGetInfo: 15-45
# µs of a small molecule's ~0.4-0.8 ms predict_forces on the H200 host, stop 77), unless an out-of-memory error set
# a cap. Any budget from half of a GPU's free memory holds them: the estimate is ~0.34 MB an atom for a 64 x 3 float32
# student, ~0.7 MB for 128 x 3 (under 0.4 GB here); where it would not, the out-of-memory path splits the batch.
SMALL_CALL_ATOMS = 512


def predict_structures(
    engine: ForceEngine,
    structures: Sequence,
    *,
    batch_size: int | None = None,
    stress: bool = False,
    atom_budget: int | None = None,
    pipeline: bool | None = None,
) -> list[dict]:
    """The loop of :meth:`ForceEngine.predict` (see there); ``pipeline`` None: on for a CUDA engine given more
    than one batch (:func:`pipelined`)."""
    if not isinstance(structures, FrameTable):
        structures = list(structures)
    if batch_size is None and not atom_budget:
        # a device query on CUDA: only when batches are sized by atoms, and not for a small call's one batch. The
        # atoms are counted only for few structures (chunks counts them again): more structures than
        # SMALL_CALL_ATOMS are no small call (their count stands in for the sum).
        few = len(structures) <= SMALL_CALL_ATOMS
        atom_budget = engine.atom_budget_for(sum(atom_counts(structures)) if few else len(structures))
    batches = chunks(structures, batch_size, atom_budget or 1)
    if pipeline is None:
        batches = list(batches)  # slices of the input (lists of references, FrameTable views)
        pipeline = pipelined(engine.device, len(batches))
    results: list[dict] = []
    pending: _Launched | None = None
    for chunk in batches:
        if not pipeline:
            results.extend(_predict_chunk(engine, chunk, stress))
            continue
        try:
            launched = _launch(engine, chunk, stress)
        except torch.OutOfMemoryError as err:
            # The batch in flight is finished first (its memory freed, its rows kept), then this one is split.
            if pending is not None:
                results.extend(pending.rows())
                pending = None
            results.extend(_split_after_oom(engine, chunk, stress, err))
            continue
        if pending is not None:
            results.extend(pending.rows())  # the device already computes ``launched`` meanwhile
        pending = launched
    if pending is not None:
        results.extend(pending.rows())
    bad = [k for k, row in enumerate(results) if row is None]
    if bad:
        listed = ", ".join(map(str, bad[:10])) + (f" ... ({len(bad)} in all)" if len(bad) > 10 else "")
        first = nonfinite_message(structures[bad[0]], engine.cutoff, f"structure {bad[0]}")
        raise NonFiniteOutputError(
            f"non-finite outputs for structure(s) {listed}; the other results are in this error's `results`. {first}",
            bad,
            results,
        )
    return results


def pipelined(device: torch.device, n_batches: int) -> bool:
    """Whether :func:`predict_structures` pipelines by default: on CUDA, for more than one batch. One batch has
    nothing to overlap, and the pipeline's per-batch page-locked outputs and event cost more than the engine's
    own copy: ``engine.predict`` of one benzene took 974 µs pipelined against 366 µs not (H200, the 64 x 3 student,
    stop 77, benchmarks/results/stop77_gpu/d/predict_one.txt)."""
    return device.type == "cuda" and n_batches > 1


class _Launched:
    """A batch whose step is queued on the device and whose outputs are on their way to page-locked host memory."""

    def __init__(self, batch: AtomsBatch, out: dict[str, torch.Tensor], stress: bool) -> None:
        self.batch, self.stress = batch, stress
        self.event: torch.cuda.Event | None = None
        device = next((t.device for t in out.values() if t.is_cuda), None)
        if device is not None:
            host = {}
            for k, t in out.items():
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t.detach(), non_blocking=True)
                host[k] = h
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))  # the stream the copies went to, on the engine's GPU
            self.out = host
        else:
            self.out = {k: t.detach().cpu() for k, t in out.items()}

    def rows(self) -> list[dict]:
        if self.event is not None:
            self.event.synchronize()
        return result_rows(self.batch, self.out, self.stress)


def _launch(engine: ForceEngine, chunk: list, stress: bool) -> _Launched:
    batch = AtomsBatch.from_atoms(chunk, dtype=engine.dtype)
    return _Launched(batch, engine.compute(batch, forces=True, stress=stress), stress)


def _predict_chunk(engine: ForceEngine, chunk: list, stress: bool) -> list[dict]:
    """One batch, start to finish (the sequential loop, and the halves of a batch split after an OOM)."""
    try:
        batch = AtomsBatch.from_atoms(chunk, dtype=engine.dtype)
        out = engine.compute(batch, forces=True, stress=stress, to_host=True)
    except torch.OutOfMemoryError as err:
        return _split_after_oom(engine, chunk, stress, err)
    return result_rows(batch, out, stress)


def _split_after_oom(engine: ForceEngine, chunk: list, stress: bool, err: torch.OutOfMemoryError) -> list[dict]:
    """``chunk`` ran out of device memory (``err``): later batches start no larger than half of it, and it runs as
    two halves (each split again if needed). One structure that does not fit is tried once more with the update
    blocks' products made again in their backward (:func:`_recompute_from`), then raises ``err``."""
    if len(chunk) == 1:
        if not recompute_before_retry(engine, atom_counts(chunk)[0], err):
            raise err
        return _predict_chunk(engine, chunk, stress)
    engine.oom_splits += 1
    engine._lower_atom_budget(sum(atom_counts(chunk)))
    half = len(chunk) // 2
    return _predict_chunk(engine, chunk[:half], stress) + _predict_chunk(engine, chunk[half:], stress)


def recompute_before_retry(engine: ForceEngine, n_atoms: int, err: BaseException, what: str = "a structure") -> bool:
    """After ``err``, an out-of-memory error of a batch of ``n_atoms`` atoms that cannot be split (one structure;
    a fixed set of MD replicas): True when the engine freed what it could and the caller should try that batch once
    more, with a warning naming ``what``: the captured graphs of its buckets (:meth:`ForceEngine.release_captures`:
    each keeps a private pool, and an eager step or another bucket's capture may need that memory) and/or the update
    blocks' recompute switched on from ``n_atoms`` atoms (:func:`_recompute_from`); False when neither can help (no
    captured graph, and the torch backend or the recompute already on there), and the caller raises ``err``. Used by
    ``predict_forces``, :class:`StudentCalculator`, :class:`BatchedMD` and ``relax_batch``."""
    released = engine.release_captures()
    recompute = _recompute_helps(engine) and _recompute_from(n_atoms)
    if not (released or recompute):
        return False
    done = []
    if released:
        done.append(f"the captured CUDA graphs of {released} bucket(s) released (captured again when met again)")
    if recompute:
        done.append(
            f"the update blocks' U/V products made again in the backward "
            f"(kernels.painn_update._CONFIG['recompute_uv_min_atoms'] = {n_atoms}, from now on in this process: "
            "~11 % less peak memory, ~2.5 % slower a step for batches of as many atoms)"
        )
    warnings.warn(
        f"{what} of {n_atoms} atoms ran out of GPU memory: trying it again with " + " and ".join(done),
        RuntimeWarning,
        stacklevel=3,
    )
    traceback.clear_frames(err.__traceback__)  # the failed attempt's tensors go before the retry
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()  # and the allocator's cached blocks: the retry allocates in fresh segments
    return True


def _recompute_helps(engine: ForceEngine) -> bool:
    """Whether the engine's update blocks take the fused Triton path, the only one that can make uvvv again."""
    from mlff_distiller.kernels import resolve_backend

    return resolve_backend(engine.device) == "triton"


def _recompute_from(n_atoms: int) -> bool:
    """Lower the atom count from which the fused update blocks make uvvv again in the backward instead of keeping
    it (``kernels.painn_update._CONFIG["recompute_uv_min_atoms"]``) to ``n_atoms``; False where it already applies
    there. Measured on an H200 (stop 49, eager water): the peak 11 % lower (1,000,002 atoms: 51.4 -> 45.5 GB) for
    2.5 % of the step, so it is off until a structure does not fit."""
    import importlib

    # (the module, not the function of the same name that mlff_distiller.kernels exports)
    painn_update = importlib.import_module("mlff_distiller.kernels.painn_update")
    limit = painn_update._CONFIG["recompute_uv_min_atoms"]
    if limit is not None and limit <= n_atoms:
        return False
    painn_update._CONFIG["recompute_uv_min_atoms"] = int(n_atoms)
    return True


def result_rows(batch: AtomsBatch, out: dict[str, torch.Tensor], stress: bool = False) -> list[dict | None]:
    """One dict per structure of ``batch`` from the host outputs ``out`` of :meth:`ForceEngine.compute`: ``energy``
    (float), ``forces`` and ``energies`` (float64 arrays) and, where asked and valid, ``stress``; ``None`` for a
    structure with a non-finite output. One conversion per output, then NumPy slices per structure (torch.split +
    .numpy() per structure cost ~7 µs a structure, 28 ms for 4,096 small molecules, more than their GPU step;
    np.split ~2.5 µs)."""
    ptr = batch.ptr.tolist()
    e_all = out["energy"].double().numpy()
    energy = e_all.tolist()
    f64, e64 = out["forces"].double().numpy(), out["atomic_energies"].double().numpy()
    forces = [f64[a:b] for a, b in itertools.pairwise(ptr)]
    atomic = [e64[a:b] for a, b in itertools.pairwise(ptr)]
    rows = [{"energy": e, "forces": f, "energies": a} for e, f, a in zip(energy, forces, atomic, strict=True)]
    voigt = valid = None
    if stress:
        voigt, valid = out["stress"].double().numpy(), np.flatnonzero(out["stress_valid"].numpy())
        for b in valid:
            rows[b]["stress"] = voigt[b]
    if not all_finite(e_all, f64, *([voigt[valid]] if voigt is not None else [])):
        bad = ~np.isfinite(e_all)
        atom_bad = ~np.isfinite(f64).all(axis=1)
        if atom_bad.any():
            bad[batch.batch.numpy()[atom_bad]] = True
        if voigt is not None:
            bad[valid] |= ~np.isfinite(voigt[valid]).all(axis=1)
        for b in np.flatnonzero(bad):
            rows[b] = None
    return rows


def chunks(structures: Sequence, batch_size: int | None, atom_budget: int) -> Iterator[Sequence]:
    """``structures`` in batches of ``batch_size`` structures, or (``batch_size`` None) of at most ``atom_budget``
    atoms (a structure larger than the budget is a batch of its own). Slices of the input: lists of structures, or
    :class:`~mlff_distiller.batch.FrameTable` views.

    Filled to the budget one after another, the batches would all be full but the last, whose size depends on the
    data: every chunk of a long file (``predict_file``) would end in a batch of its own size, a new padded bucket
    each time (20 buckets in 100,000 g2 molecules, each a capture or a first eager call). So the structures are cut
    into batches of as equal atom counts as whole structures permit (where the running count is nearest to each
    multiple of the mean, the fewest batches the budget allows; a piece that still exceeds it filled greedily),
    unless that makes more batches than filling them one after another."""
    if batch_size is not None:
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for k in range(0, len(structures), int(batch_size)):
            yield structures[k : k + int(batch_size)]
        return
    if int(atom_budget) < 1:
        raise ValueError(f"atom_budget must be >= 1, got {atom_budget}")
    counts = atom_counts(structures)
    if sum(counts) <= int(atom_budget):  # one batch either way (a single small molecule: ~15 µs of NumPy less)
        if len(counts):
            yield structures[0 : len(counts)]
        return
    greedy = _filled(counts, 0, len(counts), int(atom_budget))
    even = _even(counts, int(atom_budget))
    for a, b in even if len(even) <= len(greedy) else greedy:
        yield structures[a:b]


def _filled(counts: Sequence[int], a: int, b: int, budget: int) -> list[tuple[int, int]]:
    """Ranges of ``counts[a:b]`` filled to ``budget`` one after another."""
    out, first, atoms = [], a, 0
    for k in range(a, b):
        n = int(counts[k])
        if k > first and atoms + n > budget:
            out.append((first, k))
            first, atoms = k, 0
        atoms += n
    if first < b:
        out.append((first, b))
    return out


def _even(counts: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """Ranges of ``counts`` of as equal sums as whole entries permit (see :func:`chunks`)."""
    before = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))])  # atoms before entry k
    n, pieces = len(counts), max(1, -(-int(before[-1]) // budget))
    cuts = [0]
    for t in (np.arange(1, pieces) * (before[-1] / pieces)).tolist():
        k = int(np.searchsorted(before, t))  # before[k - 1] < t <= before[k]
        if 0 < k and t - before[k - 1] <= before[k] - t:
            k -= 1
        k = max(k, cuts[-1] + 1)
        if k < n:
            cuts.append(k)
    if n > 0:
        cuts.append(n)
    out = []
    for a, b in itertools.pairwise(cuts):
        out += [(a, b)] if before[b] - before[a] <= budget or b - a == 1 else _filled(counts, a, b, budget)
    return out


def atom_counts(structures: Sequence) -> list[int]:
    """Atoms of each structure (a :class:`~mlff_distiller.batch.FrameTable` without building its ``Atoms``)."""
    if isinstance(structures, FrameTable):
        return structures.atom_counts()
    return [len(s) for s in structures]
