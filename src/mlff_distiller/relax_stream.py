"""``relax_file``: a structures file in, its relaxed structures out as extxyz, in chunks that survive an interrupted
run (``mlff-distill relax``).

A screening run relaxes 10⁵-10⁶ structures for minutes to hours; a Ctrl-C, a job's time limit or a lost node should
not take the finished part with it. So the input is read in chunks, each chunk is relaxed by
:func:`~mlff_distiller.batched_relax.relax_batch` (which keeps its engine, and with it the captured buckets, from
one call to the next) and appended to the output before the next chunk is read, with
``<output>.progress.json`` updated after it: the same record :func:`~mlff_distiller.predict_stream.predict_file`
keeps, and the same rules (started again with the same input, student and settings, the run truncates a chunk
cut off mid-write, skips the finished structures and goes on; a run of other settings is refused; ``restart``
starts over).

Each structure's relaxation does not depend on which others share its batch, so the chunks give the structures
that one call of ``relax_batch`` over the whole file gives. A chunk costs a short tail (its last structures relax
in a batch that has emptied): the default chunk is large for that reason.

Structures that cannot be relaxed do not stop the run: bad input (an element the student does not know, non-finite
positions, ASE constraints), a structure whose forces stop being finite and one too large for the device's memory
alone are left out of the output, every other structure is written, and a ``ValueError`` at the end names them by
their input index with the reason.
"""

from __future__ import annotations

import io
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from mlff_distiller import batched_relax
from mlff_distiller._extxyz_fast import format_plain_frame, parse_frames
from mlff_distiller._extxyz_parallel import _block_text, _read_block, blocks_of, is_extxyz
from mlff_distiller.batching import NonFiniteOutputError
from mlff_distiller.checkpoint import load_model
from mlff_distiller.domain import OutOfDomainWarning
from mlff_distiller.frames import FrameTable
from mlff_distiller.model import StudentModel
from mlff_distiller.predict_stream import (
    PROGRESS_SUFFIX,
    _chunks,
    _read_from,
    _resume_state,
    append_chunk,
    check_paths,
    finish_run,
    input_problem,
    log_interrupted,
    model_fingerprint,
    select,
)

__all__ = ["CHUNK", "relax_file"]

# Structures per chunk: the most an interrupted run loses. Large, because each chunk ends with a tail of slow
# structures in a batch that has emptied (relax_batch compacts it, so the tail costs launches, not atoms).
CHUNK = 8192
_FORMAT = 1


def relax_file(
    model: StudentModel | str | Path,
    input: str | Path,
    output: str | Path,
    *,
    index: str | None = None,
    chunk: int = CHUNK,
    restart: bool = False,
    fmax: float = 0.05,
    steps: int = 1000,
    device: torch.device | str | None = None,
    precision: str = "fp32",
    max_atoms: int | str | None = "auto",
    log: Callable[[str], None] | None = None,
) -> dict:
    """Relax every structure of ``input`` (FIRE, fixed cell) and write them to ``output`` as extxyz in input order,
    chunk by chunk, each with ``info["relax_converged"]``, ``info["relax_steps"]`` and its energy and forces; an
    unfinished run of the same job resumes.

    Args:
        model: a :class:`StudentModel`, a checkpoint path or ``"builtin:<name>"``.
        input: any structures file ASE reads (read lazily where ASE can).
        output: the extxyz file written; ``<output>.progress.json`` sits beside it while the run is unfinished.
        index: ASE's frame selection (``"0:100"``, ``"-1"``): those frames only (read whole).
        chunk: structures read, relaxed and written at a time (the most that a cut-off run loses).
        restart: discard an unfinished run's output and progress instead of resuming it.
        fmax, steps, device, precision, max_atoms: as for :func:`~mlff_distiller.batched_relax.relax_batch`.
        log: called with one line per finished chunk (the CLI prints it to stderr).
    Returns:
        ``structures`` (written), ``converged`` (of those written, in this call and the calls it resumes),
        ``steps_max``, ``seconds`` (this call), ``resumed_from`` (input structures done before this call),
        ``outside_domain`` (written structures outside the student's training envelope), ``output``.
    Raises:
        ValueError: some structures were left out: raised after every other structure is written, naming them;
            an unfinished run of other settings at ``output``; ``chunk < 1``; output = input.
        FileNotFoundError: no ``input``.
    """
    from mlff_distiller.batched_relax import check_relax_args

    input, output = check_paths(input, output, chunk)
    check_relax_args(fmax=fmax, steps=steps, max_atoms=max_atoms)
    if not isinstance(model, StudentModel):
        model = load_model(model)
    job = {
        "format": _FORMAT,
        "kind": "relax",
        "input": str(input.resolve()),
        "index": index,
        "input_size": input.stat().st_size,
        "input_mtime_ns": input.stat().st_mtime_ns,
        "model": model_fingerprint(model),
        "precision": precision,
        "fmax": float(fmax),
        "steps": int(steps),
    }
    progress_path = output.with_name(output.name + PROGRESS_SUFFIX)
    state = {"converged": 0, "steps_max": 0, **_resume_state(job, output, progress_path, restart)}
    resumed_from = state["done"]
    kw = dict(fmax=fmax, steps=steps, device=device, precision=precision, max_atoms=max_atoms)
    output.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(output, "r+b" if state["bytes"] else "wb") as out:
        out.truncate(state["bytes"])  # a chunk cut off mid-write after the last record is dropped here
        out.seek(state["bytes"])
        try:
            for count, text, rows, skipped in _relaxed_chunks(model, input, index, state["done"], chunk, kw):
                state["written"] += len(rows)
                state["converged"] += sum(bool(c) for c, _, _ in rows)
                state["steps_max"] = max([state["steps_max"], *(s for _, s, _ in rows)])
                state["outside_domain"] += sum(1 for _, _, d in rows if d)
                state["skipped"].extend([state["done"] + k, why] for k, why in skipped)
                state["done"] += count
                append_chunk(out, text, state, progress_path, job, log, output, resumed_from, t0)
        except KeyboardInterrupt:
            log_interrupted(log, output, state)
            raise
    seconds = time.perf_counter() - t0
    finish_run(state, output, progress_path, job, f"{state['written']} relaxed structures")
    return {
        "structures": state["written"],
        "converged": state["converged"],
        "steps_max": state["steps_max"],
        "seconds": seconds,
        "resumed_from": resumed_from,
        "outside_domain": state["outside_domain"],
        "output": str(output),
    }


def _relaxed_chunks(model: StudentModel, input: Path, index: str | None, done: int, chunk: int, kw: dict) -> Iterator:
    """``(structures read, extxyz text, (converged, steps, outside the envelope) per structure written, left-out
    (chunk index, reason) pairs)`` for each chunk of ``input`` from structure ``done`` on.

    Plain extxyz frames (what :func:`~mlff_distiller._extxyz_fast.parse_frames` takes: species, positions, cell,
    real columns, calculator results and info strings such as a molecule's name) go
    from the file's text to arrays, through :func:`~mlff_distiller.batched_relax.relax_arrays` and back to text
    without an ``ase.Atoms`` each (read, built, copied and written, those cost 4,096 g2 molecules ~110 µs each on
    the development CPU, about a third of their relaxation on an H100); every other input through ASE's reader,
    :func:`~mlff_distiller.batched_relax.relax_batch` and ASE's writer. Both write the same bytes (tested)."""
    blocks = blocks_of(input, done, chunk) if index is None and is_extxyz(input) else None
    if blocks is None:
        frames_in = select(input, index, done) if index is not None else _read_from(input, done)
        for frames in _chunks(frames_in, chunk):
            yield len(frames), *_relax_atoms(model, frames, kw)
        return
    for (block,) in blocks:
        text = _block_text(str(input), block)
        arrays = parse_frames(text, info=True)
        if arrays is None or len(arrays[4]) != block.count:
            yield block.count, *_relax_atoms(model, _read_block(str(input), block, text), kw)
            continue
        table, kept, infos = FrameTable(*arrays[:5]), arrays[5], arrays[6]
        try:
            with warnings.catch_warnings():  # one warning for the whole file at the end, not one per chunk
                warnings.simplefilter("ignore", OutOfDomainWarning)
                run = batched_relax.relax_arrays(model, table, **kw)
        except ValueError:  # bad input: the Atoms path finds every bad structure and relaxes the others
            yield block.count, *_relax_atoms(model, _read_block(str(input), block, text), kw)
        else:
            yield block.count, *_table_text(run, kept, infos)


def _relax_atoms(model: StudentModel, frames: list, kw: dict) -> tuple[str, list, list]:
    """A chunk of ``Atoms`` relaxed: ``(text, rows, skipped)`` of :func:`_relaxed_chunks`."""
    with warnings.catch_warnings():  # one warning for the whole file at the end, not one per chunk
        warnings.simplefilter("ignore", OutOfDomainWarning)
        relaxed, skipped = _relax_chunk(model, frames, kw)
    written = [a for a in relaxed if a is not None]
    rows = [(a.info["relax_converged"], int(a.info["relax_steps"]), a.info.get("domain")) for a in written]
    return _extxyz_text(written), rows, skipped


def _table_text(run: batched_relax.Relaxed, kept: list, infos: list[dict]) -> tuple[str, list, list]:
    """:func:`relax_arrays`'s result as :func:`_relax_atoms` gives it, for frames read by
    :func:`~mlff_distiller._extxyz_fast.parse_frames` (``kept``: their other columns, ``infos``: their info): the
    text ASE writes for the ``Atoms`` :func:`~mlff_distiller.batched_relax.relax_batch` would return (tested)."""
    reasons = run.reasons()
    out, rows = [], []
    for k in range(len(run.energy)):
        if k in reasons:
            continue
        lo, hi = int(run.ptr[k]), int(run.ptr[k + 1])
        e = float(run.energy[k])
        info = dict(infos[k])  # relax_batch's order: the input's info, then the relaxation's keys
        info["relax_converged"] = bool(run.converged[k])
        info["relax_steps"] = int(run.steps[k])
        if k in run.domain:
            info["domain"] = run.domain[k]
        results = {"energy": e, "free_energy": e, "forces": run.forces[lo:hi], "energies": run.energies[lo:hi]}
        fields = run.numbers[lo:hi], run.positions[lo:hi], run.cells[k], run.pbc[k]
        text = format_plain_frame(*fields, results, info, kept[k])
        if text is None:  # what the fast writer does not take (a column name ASE renames): ASE writes it
            text = _extxyz_text([_atoms(*fields, results, info, kept[k])])
        out.append(text)
        rows.append((info["relax_converged"], info["relax_steps"], info.get("domain")))
    return "".join(out), rows, sorted(reasons.items())


def _atoms(numbers, positions, cell, pbc, results: dict, info: dict, kept: list):
    """The ``Atoms`` relax_batch returns for these fields."""
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator

    atoms = Atoms(numbers=numbers, positions=positions, cell=cell, pbc=pbc, info=info)
    for name, values in kept:
        atoms.new_array(name, values.reshape(len(atoms), -1) if values.shape[1] > 1 else values[:, 0])
    atoms.calc = SinglePointCalculator(atoms, **results)
    return atoms


def _relax_chunk(model: StudentModel, frames: list, kw: dict) -> tuple[list, list[tuple[int, str]]]:
    """The relaxed structures of one chunk (``None`` where left out) and the left-out ones' chunk indices with
    reasons."""
    try:
        return batched_relax.relax_batch(model, frames, **kw), []
    except NonFiniteOutputError as exc:
        reasons = {k: exc.reasons.get(k, "non-finite forces or energy") for k in exc.indices}
        return exc.results, sorted(reasons.items())
    except ValueError:
        # A bad structure stops the whole call before any step: find every bad one, then relax the others.
        problems = {k: why for k, atoms in enumerate(frames) if (why := _input_problem(model, atoms))}
        if not problems:
            raise
        keep = [k for k in range(len(frames)) if k not in problems]
        relaxed = [None] * len(frames)
        if keep:
            sub, sub_problems = _relax_chunk(model, [frames[k] for k in keep], kw)
            for j, k in enumerate(keep):
                relaxed[k] = sub[j]
            problems.update({keep[j]: why for j, why in sub_problems})
        return relaxed, sorted(problems.items())


def _input_problem(model: StudentModel, atoms) -> str | None:
    """Why ``relax_batch`` refuses ``atoms`` (its input checks: predict's, and no ASE constraints), else None."""
    if atoms.constraints:
        return f"carries ASE constraints ({', '.join(type(c).__name__ for c in atoms.constraints)})"
    return input_problem(model, atoms)


def _extxyz_text(frames: list) -> str:
    """``frames`` (with their single-point results) as extxyz text, the bytes ``ase.io.write`` gives: through
    :func:`~mlff_distiller._extxyz_fast.format_md_frame` where it takes the frame (plain info: the relaxation's
    flags; ~4x faster than ASE's writer), else through ASE's writer."""
    from ase.io.extxyz import write_extxyz

    from mlff_distiller._extxyz_fast import format_md_frame

    out = []
    for atoms in frames:
        info = atoms.info
        atoms.info = {}  # format_md_frame takes the info apart from the Atoms
        try:
            text = format_md_frame(atoms, atoms.calc.results, info)
        finally:
            atoms.info = info
        if text is None:
            buf = io.StringIO()
            write_extxyz(buf, [atoms])
            text = buf.getvalue()
        out.append(text)
    return "".join(out)
