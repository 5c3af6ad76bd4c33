"""``predict_forces``: the batched, one-call prediction API.

A call keeps its :class:`~mlff_distiller.engine.ForceEngine` for the next call with the same student and settings
(from the same thread): a new engine captures its buckets again, which on an H100 made a call for one benzene take
53 ms instead of 1.25 ms (``benchmarks/results/probe_predict_reuse_h100.md``). An engine is used again while the
student is the same object and its parameters and buffers are the same tensors with the same version counters:
an optimiser step, ``load_state_dict`` or ``model.to(...)`` between calls gives a new engine. An edit through
``.data`` bypasses the version counter and is not seen: call :func:`clear_engine_cache` after one. At most
:data:`ENGINE_CACHE_SIZE` engines (with their device buffers and captured graphs, and their students) are kept;
:func:`clear_engine_cache` frees them. A student given as a checkpoint path is loaded once while its file keeps
its modification time and size.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from mlff_distiller import domain
from mlff_distiller.batch import FrameTable
from mlff_distiller.batching import NonFiniteOutputError
from mlff_distiller.checkpoint import builtin_path, load_model
from mlff_distiller.domain import DomainEnvelope, OutOfDomainWarning
from mlff_distiller.engine import ForceEngine
from mlff_distiller.model import StudentModel

__all__ = ["ENGINE_CACHE_SIZE", "clear_engine_cache", "predict_forces"]

ENGINE_CACHE_SIZE = 2  # engines kept across calls (two: a committee of two students alternating)
_engines: OrderedDict[tuple, tuple] = OrderedDict()  # key -> (weakref to the student, its state, engine)
_models: OrderedDict[tuple, StudentModel] = OrderedDict()  # (path, mtime, size) -> the loaded student
_lock = threading.Lock()


def predict_forces(
    model: StudentModel | str | Path,
    structures: Sequence,
    *,
    device: torch.device | str | None = None,
    batch_size: int | None = None,
    precision: str = "fp32",
    stress: bool = False,
    mode: str = "auto",
    compile_mode: str | None = None,
    memory_budget: int | None = None,
    pipeline: bool | None = None,
    check_domain: bool = False,
) -> list[dict]:
    """Energies and forces for many structures.

    Args:
        model: a :class:`StudentModel` or a checkpoint path (``"builtin:<name>"`` included).
        structures: ``ase.Atoms`` objects (or a single one), or a :class:`~mlff_distiller.batch.FrameTable` of many
            structures held as arrays (no ``Atoms`` built for them).
        device: default CUDA when available.
        batch_size: structures per batch; None batches by an atom budget.
        precision: ``"fp64"``, ``"fp32"``, ``"tf32"``, ``"bf16"`` or ``"fp16"``.
        stress: also return the stress of fully periodic structures.
        mode: ``"auto"`` (default: captured CUDA graphs of padded buckets on CUDA, eager elsewhere and for
            graphs beyond :func:`~mlff_distiller.engine.auto_max_edges`), ``"eager"``, ``"compile"`` or
            ``"cudagraph"`` (see :class:`~mlff_distiller.engine.ForceEngine`). A bucket's first batch runs its
            padded step eagerly and its second one captures it (``capture_after=1``; a capture costs tens of ms
            once the kernels are compiled), while an eager step costs ~14 ms of host time per batch on the GPU
            machine, so "auto" is 2-3x faster with small batches (16,384 g2 molecules in batches of 512: 9.9 vs
            32.0 µs per structure) and about even with batches filled to the default atom budget (6.3 vs 6.5; H100,
            benchmarks/results/bench_host_h100_pipeline.md).
        compile_mode: ``torch.compile`` mode for ``"compile"``.
        memory_budget: bytes one batch may use (default: half the free device memory on CUDA); a batch that
            still runs out of memory is split and retried.
        pipeline: read and launch the next batch on the host while the device computes the current one
            (default: on for CUDA, given more than one batch; :mod:`mlff_distiller.batching`). The same results
            either way.
        check_domain: also check each structure against the student's training envelope
            (:class:`~mlff_distiller.domain.DomainEnvelope`, stored by training since stop 29: element pairs never
            seen, pairs much shorter than the shortest seen, atoms with many more neighbours than seen). Each
            result gets ``domain``, the list of findings (empty: inside), and one
            :class:`~mlff_distiller.domain.OutOfDomainWarning` counts the structures outside. Geometry only: small
            structures are screened together on the host (~17 µs per small molecule on a 2-core CPU,
            ``DomainEnvelope.check_many``); from 1,000 atoms on, each on the engine's GPU.
    Returns:
        One dict per structure, in input order: ``energy`` (float, eV), ``forces`` (ndarray [n, 3], eV/Å),
        ``energies`` (ndarray [n], per-atom eV) and, when ``stress`` and periodic, ``stress`` (ndarray [6],
        eV/Å³, Voigt xx yy zz yz xz xy, ASE sign); with ``check_domain``, ``domain``.
    Raises:
        ValueError: bad input (unknown element, non-finite positions, zero-volume cell, ...), before any compute;
            ``check_domain`` for a student that stores no envelope (trained before envelopes were recorded).
        NonFiniteOutputError: (a ``ValueError``) some structures gave a NaN or inf output, e.g. a float32 overflow
            far outside the training data; every other structure was computed and is in the error's ``results``
            (``None`` at its ``indices``). With ``check_domain`` the computed ones carry ``domain`` there too, and
            the message names the failed structures that lie outside the envelope.
    """
    if hasattr(structures, "get_positions"):
        structures = [structures]
    if not isinstance(structures, FrameTable):  # a FrameTable is cut into batches without an Atoms each
        structures = list(structures)
    if not len(structures):
        return []
    if not isinstance(model, StudentModel):
        model = _loaded(model)
    envelope = required_envelope(model) if check_domain else None
    settings = {
        "device": device,
        "precision": precision,
        "mode": mode,
        "compile_mode": compile_mode,
        "memory_budget": memory_budget,
        # A call meets most of its large buckets once: their steps run eagerly, and those met again (the same
        # structures again, the kept engine) are captured then (see ForceEngine's capture_after).
        "capture_after": 1,
    }
    engine = _engine_for(model, settings)
    try:
        return run_predictions(engine, envelope, structures, batch_size=batch_size, stress=stress, pipeline=pipeline)
    except torch.OutOfMemoryError:
        # Even one structure did not fit beside the other kept engines' buffers: free them and try once more.
        if not _drop_others(engine):
            raise
        return run_predictions(engine, envelope, structures, batch_size=batch_size, stress=stress, pipeline=pipeline)


def clear_engine_cache() -> None:
    """Forget the engines (device buffers, captured graphs) and students that :func:`predict_forces` keeps."""
    with _lock:
        _engines.clear()
        _models.clear()


def _state(model: StudentModel) -> tuple | None:
    """What a kept engine must find unchanged: each parameter's and buffer's identity, storage and version (None
    for inference tensors, which have no version counter: such a student is never kept).

    The modules' own ``_parameters`` / ``_buffers`` / ``_modules`` dicts are walked directly: ``model.parameters()``
    and ``model.buffers()`` (two recursive walks with memo sets) took 106 µs for the shipped 64 x 3 student (47
    modules, 43 tensors) on the GPU host and the development CPU alike, more than ``compute`` of a small molecule's
    dense step end to end (~170 µs, stop 77); this walk 25-40 µs. A tensor or module shared between modules appears
    once per place (the same answer from call to call)."""
    rows: list[tuple] = []
    add = rows.append
    stack = [model]
    try:
        while stack:
            module = stack.pop()
            if module is None:  # a submodule slot set to None
                continue
            for t in module._parameters.values():
                if t is not None:
                    add((id(t), t.data_ptr(), t._version))
            for t in module._buffers.values():
                if t is not None:
                    add((id(t), t.data_ptr(), t._version))
            stack.extend(module._modules.values())
    except RuntimeError:
        return None
    return tuple(rows)


def _engine_for(model: StudentModel, settings: dict, make=None) -> ForceEngine:
    """The kept engine of ``model`` with ``settings`` (from this thread), else a new one, kept:
    ``ForceEngine(model, **settings)`` or ``make()``, whose engine must follow from the same settings (the key)."""
    key = (id(model), threading.get_ident(), *((k, str(v)) for k, v in settings.items()))
    state = _state(model)
    with _lock:
        hit = _engines.get(key)
        if hit is not None and state is not None and hit[0]() is model and hit[1] == state:
            _engines.move_to_end(key)
            return hit[2]
        _engines.pop(key, None)
    engine = ForceEngine(model, **settings) if make is None else make()
    if state is None:
        return engine
    with _lock:
        _engines[key] = (weakref.ref(model), state, engine)  # the reference: a new student at a dead one's id
        while len(_engines) > ENGINE_CACHE_SIZE:
            _engines.popitem(last=False)
    return engine


def _drop_others(engine: ForceEngine) -> bool:
    """Drop every kept engine but ``engine`` and release the memory they held; whether there was any."""
    with _lock:
        others = [k for k, (_, _, e) in _engines.items() if e is not engine]
        for k in others:
            del _engines[k]
    if others and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return bool(others)


def _loaded(spec: str | Path) -> StudentModel:
    """``load_model(spec)``, kept while the checkpoint file keeps its modification time and size."""
    path = builtin_path(spec) if isinstance(spec, str) and spec.startswith("builtin:") else Path(spec)
    try:
        stat = path.stat()
    except (OSError, ValueError):
        return load_model(spec)  # its own clear error for a missing or unknown checkpoint
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    with _lock:
        model = _models.get(key)
        if model is not None:
            _models.move_to_end(key)
            return model
    model = load_model(spec)
    with _lock:
        _models[key] = model
        while len(_models) > ENGINE_CACHE_SIZE:
            _models.popitem(last=False)
    return model


def required_envelope(model: StudentModel) -> DomainEnvelope:
    """The training envelope stored with ``model``, for ``check_domain``; a ``ValueError`` when it stores none."""
    envelope = DomainEnvelope.of_model(model)
    if envelope is None:
        raise ValueError(
            "check_domain: this student stores no training envelope (it was trained before envelopes were "
            "recorded); train or fine-tune it with mlff-distill to record one"
        )
    return envelope


def run_predictions(
    engine: ForceEngine,
    envelope: DomainEnvelope | None,
    structures: list,
    *,
    batch_size: int | None = None,
    stress: bool = False,
    pipeline: bool | None = None,
) -> list[dict]:
    """``engine.predict`` of ``structures``, each result checked against ``envelope`` when one is given (the body
    of :func:`predict_forces`, shared with :func:`~mlff_distiller.predict_stream.predict_file`, which keeps one
    engine for many calls)."""
    if envelope is None:
        return engine.predict(structures, batch_size=batch_size, stress=stress, pipeline=pipeline)
    try:
        results = engine.predict(structures, batch_size=batch_size, stress=stress, pipeline=pipeline)
    except NonFiniteOutputError as exc:
        findings = _check_domain(envelope, structures, exc.results, engine.device)
        outside = [i for i in exc.indices if findings[i]]
        if outside:
            exc.args = (f"{exc.args[0]}; outside the training envelope among them: structures {outside}",)
        raise
    _check_domain(envelope, structures, results, engine.device)
    return results


def _check_domain(
    envelope: DomainEnvelope, structures: list, results: list[dict | None], device: torch.device
) -> list[list[str]]:
    """Each structure's findings, stored as ``domain`` in its result (where there is one): the envelope's, and a
    force component above :data:`~mlff_distiller.domain.FORCE_LIMIT`; warns once when any structure lies outside.
    Large structures are checked on the engine's GPU (``DomainEnvelope.check_device``)."""
    findings = envelope.check_many(structures, device=device)
    for k, result in enumerate(results):
        if result is None:
            continue
        forces = result.get("forces")
        peak = float(np.abs(forces).max()) if forces is not None and len(forces) else 0.0
        if peak > domain.FORCE_LIMIT:  # atoms pressed into one another: nothing the student can describe
            findings[k] = [*findings[k], domain.force_finding(peak)]
        result["domain"] = findings[k]
    outside = sum(1 for found in findings if found)
    if outside:
        first = next(found for found in findings if found)
        warnings.warn(
            f"{outside} of {len(structures)} structures lie outside the student's training envelope (each result's "
            f"'domain' lists why), e.g. {first[0]}",
            OutOfDomainWarning,
            stacklevel=3,
        )
    return findings
