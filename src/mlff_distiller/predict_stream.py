"""``predict_file``: a structures file in, an extxyz file of energies and forces out, in chunks that survive an
interrupted run (``mlff-distill predict``).

Millions of structures do not fit a list of ``ase.Atoms`` and its results comfortably, and a run of that size
should not lose its finished part to a Ctrl-C, a killed job or a lost node. So the input is read in chunks
(``ase.io.iread``), each chunk runs through one :class:`~mlff_distiller.engine.ForceEngine` kept for the whole
file (its captured buckets are reused), and its frames are appended to the output before the next chunk is read.
extxyz inputs are read and written in blocks of whole frames (:mod:`mlff_distiller._extxyz_parallel`), by a
fast codec where it takes the frames (:mod:`mlff_distiller._extxyz_fast`; ASE's file I/O was 96 % of the command's
time), and for large inputs in worker processes while this process predicts. Other formats go through ASE.

After each chunk the output is flushed to disk, and ``<output>.progress.json`` records how many input structures
are done and how many bytes of the output hold them. Started again with the same input, student and settings, the
run truncates the output to those bytes (a chunk cut off mid-write is dropped), skips the finished structures and
goes on; a run started over other settings is refused rather than mixed in. The progress file is removed when the
whole input is done.

Structures that cannot be computed do not stop the run: bad input (an element the student does not know,
non-finite positions, a zero-volume cell), non-finite outputs and a structure too large for the device's memory on
its own are left out of the output, every other structure is written, and a ``ValueError`` at the end names them
by their input index with the reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from mlff_distiller._extxyz_parallel import (
    Clock,
    auto_workers,
    blocks_of,
    frames_text,
    is_extxyz,
    run_blocks,
    start_pool,
)
from mlff_distiller.batch import AtomsBatch
from mlff_distiller.batching import NonFiniteOutputError
from mlff_distiller.checkpoint import load_model
from mlff_distiller.domain import DomainEnvelope, OutOfDomainWarning
from mlff_distiller.engine import ForceEngine
from mlff_distiller.model import StudentModel
from mlff_distiller.predict import required_envelope, run_predictions

__all__ = ["CHUNK", "PROGRESS_SUFFIX", "predict_file"]

CHUNK = 10_000  # structures per chunk: a few MB of results, and seconds of work per flush at ASE's extxyz speed
PROGRESS_SUFFIX = ".progress.json"
_FORMAT = 1
_LISTED = 20  # skipped structures named in the final error


def predict_file(
    model: StudentModel | str | Path,
    input: str | Path,
    output: str | Path,
    *,
    index: str | None = None,
    chunk: int = CHUNK,
    restart: bool = False,
    device: torch.device | str | None = None,
    batch_size: int | None = None,
    precision: str = "fp32",
    stress: bool = False,
    mode: str = "auto",
    check_domain: bool = False,
    workers: int | None = 0,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Energies and forces (and stress, for periodic structures with ``stress``) of every structure in ``input``,
    written to ``output`` as extxyz in input order, chunk by chunk; an unfinished run of the same job resumes.

    Args:
        model: a :class:`StudentModel`, a checkpoint path or ``"builtin:<name>"``.
        input: any structures file ASE reads (read lazily where ASE can, else whole).
        output: the extxyz file written; ``<output>.progress.json`` sits beside it while the run is unfinished.
        index: ASE's frame selection (``"0:100"``, ``"-1"``; ``mlff-distill predict --input file@INDEX``): those
            frames only, read whole through ASE.
        chunk: structures read, computed and written at a time (the most that a cut-off run loses).
        restart: discard an unfinished run's output and progress instead of resuming it.
        device, batch_size, precision, stress, mode: as for :func:`~mlff_distiller.predict.predict_forces`.
        check_domain: each written frame outside the student's training envelope carries ``info["domain"]``.
        workers: processes that read and write the extxyz text beside the one that predicts
            (:mod:`mlff_distiller._extxyz_parallel`); the output is the same. 0 (default): everything in this
            process. None: up to 12 for extxyz inputs of 8 MB or more on hosts of 4 cores or more, else 0 (what
            ``mlff-distill predict`` does). The workers start as :mod:`multiprocessing` "forkserver" processes, which
            import the calling script's ``__main__`` again: a script that asks for workers must keep its top-level
            code under ``if __name__ == "__main__":``.
        log: called with one line per finished chunk (the CLI prints it to stderr).
    Returns:
        ``structures`` (written), ``skipped`` (0 here: a run with skipped structures raises), ``seconds`` (from the
        first chunk on), ``parts`` (seconds of this process: ``start`` before the first chunk, loading the student
        and building its engine included, then ``read``, ``predict``, ``format`` and ``write``; with workers,
        ``read`` and ``format`` are mostly waits for them), ``resumed_from`` (input structures done before this
        call), ``output``; with ``check_domain``, ``outside_domain``.
    Raises:
        ValueError: some structures were left out (bad input or a non-finite output): raised after every other
            structure is written, naming them; an unfinished run of other settings at ``output``; ``chunk < 1``.
        FileNotFoundError: no ``input``.
    """
    if workers is not None and workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")
    input, output = check_paths(input, output, chunk)
    extxyz = is_extxyz(input) and index is None  # a selection is read through ASE
    if workers is None:
        workers = auto_workers(input)
    # The worker processes start now: their start (a forkserver importing this package, torch with it: ~2 s) runs
    # while this process loads the student, builds its engine and scans the file, instead of before the first chunk.
    pool = start_pool(workers) if extxyz and workers > 0 else None
    try:
        return _predict_file(
            model,
            input,
            output,
            pool,
            extxyz,
            workers,
            index=index,
            chunk=chunk,
            restart=restart,
            device=device,
            batch_size=batch_size,
            precision=precision,
            stress=stress,
            mode=mode,
            check_domain=check_domain,
            log=log,
        )
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _predict_file(
    model,
    input: Path,
    output: Path,
    pool,
    extxyz: bool,
    workers: int,
    *,
    index,
    chunk,
    restart,
    device,
    batch_size,
    precision,
    stress,
    mode,
    check_domain,
    log,
) -> dict:
    """:func:`predict_file` after its arguments are checked (``pool``: the started worker processes, or None)."""
    t_start = time.perf_counter()
    if not isinstance(model, StudentModel):
        model = load_model(model)
    envelope = required_envelope(model) if check_domain else None
    job = {
        "format": _FORMAT,
        "input": str(input.resolve()),
        "input_size": input.stat().st_size,
        "input_mtime_ns": input.stat().st_mtime_ns,
        "model": model_fingerprint(model),
        "precision": precision,
        "stress": bool(stress),
        "index": index,
        "check_domain": bool(check_domain),
    }
    progress_path = output.with_name(output.name + PROGRESS_SUFFIX)
    state = _resume_state(job, output, progress_path, restart)
    resumed_from = state["done"]
    # capture_after=1: chunks of varied structures meet most large buckets once, where a capture costs ~25 steps.
    engine = ForceEngine(model, device=device, precision=precision, mode=mode, capture_after=1)
    # extxyz in blocks of whole frames (in this process with 0 workers), read and written by the fast codec of
    # mlff_distiller._extxyz_fast where it takes the frames; other formats through ase.io.iread.
    blocks = blocks_of(input, state["done"], chunk, max(workers, 1)) if extxyz else None
    output.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    parts = {"start": t0 - t_start, "read": 0.0, "predict": 0.0, "format": 0.0, "write": 0.0}
    clock = Clock(parts)

    def predict(frames: list) -> tuple[list, list]:
        with warnings.catch_warnings():  # one warning for the whole file at the end, not one per chunk
            warnings.simplefilter("ignore", OutOfDomainWarning)
            return _predict_chunk(engine, envelope, frames, batch_size, stress)

    with open(output, "r+b" if state["bytes"] else "wb") as out:
        out.truncate(state["bytes"])  # a chunk cut off mid-write after the last record is dropped here
        out.seek(state["bytes"])

        def record(count: int, results: list, skipped: list, text: str) -> None:
            """A finished chunk: its text on disk, then the progress record that counts it."""
            state["written"] += sum(r is not None for r in results)
            state["outside_domain"] += sum(1 for r in results if r is not None and r.get("domain"))
            state["skipped"].extend([state["done"] + k, why] for k, why in skipped)
            state["done"] += count
            append_chunk(out, text, state, progress_path, job, log, output, resumed_from, t0)

        try:
            if blocks is not None:
                run_blocks(input, blocks, workers, predict, record, pool=pool, seconds=parts)
            else:
                frames_in = _read_from(input, state["done"]) if index is None else select(input, index, state["done"])
                chunks = _chunks(frames_in, chunk)
                while True:
                    with clock("read"):
                        frames = next(chunks, None)
                    if frames is None:
                        break
                    with clock("predict"):
                        results, skipped = predict(frames)
                    with clock("format"):
                        text = frames_text(frames, results)
                    with clock("write"):
                        record(len(frames), results, skipped, text)
        except KeyboardInterrupt:
            log_interrupted(log, output, state)
            raise
    seconds = time.perf_counter() - t0
    finish_run(state, output, progress_path, job, f"{state['done']} structures")
    result = {
        "structures": state["written"],
        "skipped": 0,
        "seconds": seconds,
        "parts": parts,
        "resumed_from": resumed_from,
        "output": str(output),
    }
    if check_domain:
        result["outside_domain"] = state["outside_domain"]
    return result


def append_chunk(out, text: str, state: dict, progress_path: Path, job: dict, log, output, resumed_from, t0) -> None:
    """A finished chunk (already counted in ``state``): its text on disk, flushed and synced, then the progress
    record that counts it, then a line to ``log``."""
    out.write(text.encode())
    out.flush()
    os.fsync(out.fileno())
    state["bytes"] = out.tell()
    _write_progress(progress_path, job, state)
    if log is not None:
        rate = (state["done"] - resumed_from) / max(time.perf_counter() - t0, 1e-9)
        log(f"{state['done']} structures done ({rate:.0f}/s), {state['written']} written to {output}")


def log_interrupted(log, output: Path, state: dict) -> None:
    if log is not None:
        log(
            f"interrupted: {output} holds the first {state['done']} input structures; the same command continues "
            "from there"
        )


def finish_run(state: dict, output: Path, progress_path: Path, job: dict, of: str) -> None:
    """The end of a run: one warning for the frames outside the training envelope (``of``: out of what), the
    error naming the structures left out (the progress record kept until the user has seen it: a rerun resumes
    past the end, writes nothing and says it again), else the progress record removed."""
    if state["outside_domain"]:
        warnings.warn(
            f"{state['outside_domain']} of {of} lie outside the student's training envelope; their frames in "
            f"{output} carry info['domain'] (why)",
            OutOfDomainWarning,
            stacklevel=3,
        )
    if state["skipped"]:
        _write_progress(progress_path, job, state)
        raise ValueError(_skipped_message(state, output))
    progress_path.unlink(missing_ok=True)


def model_fingerprint(model: StudentModel) -> str:
    """SHA-256 of the student's configuration and parameters: the same weights give the same string."""
    digest = hashlib.sha256(json.dumps(model.config_dict(), sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _resume_state(job: dict, output: Path, progress_path: Path, restart: bool) -> dict:
    """Where this run starts: the recorded progress of an unfinished run of the same job, else from scratch."""
    fresh = {"done": 0, "written": 0, "bytes": 0, "outside_domain": 0, "skipped": []}
    if restart or not progress_path.exists():
        progress_path.unlink(missing_ok=True)
        return fresh
    try:
        record = json.loads(progress_path.read_text())
        recorded_job, state = record["job"], record["state"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{progress_path} is unreadable ({exc}); pass restart=True (--restart) to start over"
        ) from None
    changed = [k for k in job if recorded_job.get(k) != job[k]]
    if changed:
        what = ", ".join(f"{k}: was {recorded_job.get(k)!r}, now {job[k]!r}" for k in changed)
        raise ValueError(
            f"{output} holds an unfinished run of another job ({what}); rerun it unchanged to continue it, or pass "
            "restart=True (--restart) to discard it"
        )
    if not output.exists() or output.stat().st_size < state["bytes"]:
        raise ValueError(
            f"{output} is shorter than its progress record ({state['bytes']} bytes); pass restart=True (--restart) "
            "to start over"
        )
    return {**fresh, **state}


def _read_from(path: Path, start: int) -> Iterator:
    """The structures of ``path`` from index ``start`` on: lazily where ASE can iterate the format (extxyz and
    trajectories skip the first ``start`` without parsing them), else the whole file read once."""
    import ase.io

    try:
        frames = ase.io.iread(str(path), index=slice(start, None))
        first = next(frames, None)
    except Exception:  # formats ASE cannot iterate (POSCAR, ...): their parse errors come again from read()
        yield from ase.io.read(str(path), index=":")[start:]
        return
    if first is None:
        return
    yield first
    k = start + 1
    while True:
        try:
            atoms = next(frames)
        except StopIteration:
            return
        except Exception as exc:  # a file cut short or corrupt past its start: the chunks before stay written
            raise ValueError(f"{path}: structure {k} could not be read ({type(exc).__name__}: {exc})") from exc
        yield atoms
        k += 1


def select(path: Path, index: str, start: int) -> Iterator:
    """The frames ``index`` selects in ``path`` (ASE's syntax), from the ``start``-th of them on."""
    import ase.io

    try:
        frames = ase.io.read(str(path), index=index)
    except (StopIteration, IndexError) as exc:  # ASE's answer to an index past the last frame
        raise ValueError(f"{path} has no frame {index}") from exc
    frames = [frames] if hasattr(frames, "get_positions") else list(frames)
    if not frames:
        raise ValueError(f"{path}@{index} selects no structures")
    return iter(frames[start:])


def _chunks(frames: Iterator, size: int) -> Iterator[list]:
    block = []
    for atoms in frames:
        block.append(atoms)
        if len(block) == size:
            yield block
            block = []
    if block:
        yield block


def _predict_chunk(
    engine: ForceEngine, envelope: DomainEnvelope | None, frames: list, batch_size: int | None, stress: bool
) -> tuple[list[dict | None], list[tuple[int, str]]]:
    """Results of one chunk (``None`` where left out) and the left-out structures' chunk indices with reasons."""
    problems = {}
    try:
        rows = run_predictions(engine, envelope, frames, batch_size=batch_size, stress=stress)
    except torch.OutOfMemoryError:
        # The engine splits a batch down to one structure before it gives up: some structure alone does not fit.
        # Halve the chunk until it is found; the others are computed.
        if engine.device.type == "cuda":
            torch.cuda.empty_cache()
        if len(frames) == 1:
            return [None], [(0, f"does not fit in device memory ({len(frames[0])} atoms)")]
        half = len(frames) // 2
        first_rows, first_problems = _predict_chunk(engine, envelope, frames[:half], batch_size, stress)
        rest_rows, rest_problems = _predict_chunk(engine, envelope, frames[half:], batch_size, stress)
        return first_rows + rest_rows, first_problems + [(half + k, why) for k, why in rest_problems]
    except NonFiniteOutputError as exc:
        rows = exc.results
        problems = {k: "non-finite output (" + _reason_of(exc) + ")" for k in exc.indices}
    except ValueError:
        # A bad structure stops the whole call before compute: find every bad one, then run the others.
        problems = {k: why for k, atoms in enumerate(frames) if (why := input_problem(engine.model, atoms))}
        if not problems:
            raise
        keep = [k for k in range(len(frames)) if k not in problems]
        sub, sub_problems = _predict_chunk(engine, envelope, [frames[k] for k in keep], batch_size, stress)
        rows = [None] * len(frames)
        for j, k in enumerate(keep):
            rows[k] = sub[j]
        problems.update({keep[j]: why for j, why in sub_problems})
    return rows, sorted(problems.items())


def _reason_of(exc: NonFiniteOutputError) -> str:
    text = str(exc)
    return text.split(". ", 1)[-1].rstrip(".") if ". " in text else "see the student's range"


def check_paths(input: str | Path, output: str | Path, chunk: int) -> tuple[Path, Path]:
    """The checks a chunked file run (``predict_file``, ``relax_file``) makes before it reads or writes anything."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    input, output = Path(input), Path(output)
    if not input.exists():
        raise FileNotFoundError(f"input file not found: {input}")
    if output.exists() and output.resolve() == input.resolve():
        raise ValueError(f"output {output} is the input file; write the results to another file")
    return input, output


def input_problem(model: StudentModel, atoms) -> str | None:
    """Why ``atoms`` cannot be computed by ``model`` (the ValueError of the input checks), else None."""
    try:
        batch = AtomsBatch.from_atoms([atoms])
        model.check_species(batch.numbers)
    except ValueError as exc:
        return str(exc).removeprefix("structure 0: ").removeprefix("structure 0 ")
    return None


def _write_progress(path: Path, job: dict, state: dict) -> None:
    """The progress record, replaced atomically (a crash leaves the old or the new one, never a torn file)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"job": job, "state": state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _skipped_message(state: dict, output: Path) -> str:
    skipped = state["skipped"]
    listed = "; ".join(f"structure {k}: {why}" for k, why in skipped[:_LISTED])
    more = f"; ... ({len(skipped)} in all)" if len(skipped) > _LISTED else ""
    return (
        f"{len(skipped)} of {state['done']} input structures were left out of {output}, which holds the other "
        f"{state['written']} in input order: {listed}{more}"
    )


def stderr_log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
