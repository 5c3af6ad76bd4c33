"""Reading and writing extxyz in worker processes for :func:`~mlff_distiller.predict_stream.predict_file`.

ASE's extxyz reader and writer are pure Python: on the H100 host, 100,000 small molecules took 17 s to read and
28 s to write, against 1.4 s to predict (``benchmarks/results/probe_predict_reuse_h100.md``). Both work frame by
frame, so the frames of an input file split into blocks of whole frames that separate processes can read and
write at once. Here the main process only scans the file for where its frames start (the atom-count lines),
predicts on the arrays a worker parsed (a :class:`~mlff_distiller.batch.FrameTable`: no ``ase.Atoms`` is built
for a structure that computes), and writes the text a worker formatted, in input order. A block the fast codec
declined is parsed again by its formatting worker, to get each frame as ASE reads it (``info``, extra arrays), so
for the same results the output is byte for byte what the one-process path writes. On the H100 host the workers
took 100,000 molecules from 53.9 to 14.7 s with ASE's reader and writer (``probe_predict_reuse_h100_run4.md``).

Only plain extxyz / xyz files (a count line, a comment line, one line per atom) take this path, with or without
workers (``workers=0`` runs the same blocks in this process). A block whose frames the fast codec of
:mod:`mlff_distiller._extxyz_fast` takes (species, positions, cell, pbc, other real columns and calculator results)
is read and written there, several times faster than by ASE and to the same arrays and bytes; any other block by
ASE's own reader and writer. The workers fork from a forkserver process, not from the caller, whose CUDA context
and threads a fork would copy (a pool forked from the caller hung on the GPU host).
"""

from __future__ import annotations

import io
import itertools
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlff_distiller._extxyz_fast import format_frames, parse_frames
from mlff_distiller.frames import FrameTable

__all__ = ["Block", "Clock", "auto_workers", "blocks_of", "frames_text", "run_blocks", "start_pool"]

MIN_BYTES = 8 << 20  # inputs below ~20,000 small molecules: the workers' start-up is not worth it
_GRACE_S = 120.0  # how long an interrupted run waits for a block being formatted (a few seconds of work)
_FORMAT_DELAY_S = 0.0  # tests: a slow writer, so that an interrupt finds blocks still being formatted


@dataclass(frozen=True)
class Block:
    """Frames ``first .. first + count - 1`` of the file, in bytes ``start .. end``."""

    first: int
    count: int
    start: int
    end: int


def auto_workers(path: Path) -> int:
    """Worker processes for ``path`` by default: none for small or non-extxyz inputs or hosts of < 4 cores."""
    cores = os.cpu_count() or 1
    if cores < 4 or path.stat().st_size < MIN_BYTES or not is_extxyz(path):
        return 0
    return min(12, cores - 2)


def is_extxyz(path: Path) -> bool:
    from ase.io.formats import filetype

    try:
        return filetype(str(path)) == "extxyz"
    except Exception:  # whatever ASE cannot tell: the one-process path reads it (and reports what is wrong)
        return False


def blocks_of(path: Path, skip: int, size: int, parts: int = 1) -> list[list[Block]] | None:
    """The file's frames from index ``skip`` on in chunks of ``size`` frames, each cut into ``parts`` blocks of
    nearly equal length (the workers' tasks); None when a count line is not a number (not plain extxyz: the
    one-process path reads it). A frame cut short ends the last chunk: its parse fails in a worker, after the
    chunks before it are written."""
    chunks, starts, index = [], [], 0
    with open(path, "rb") as f:
        while True:
            offset = f.tell()
            line = f.readline()
            if not line:
                break
            if not line.strip():  # blank lines between or after frames, as ASE tolerates at the end
                continue
            try:
                n = int(line)
            except ValueError:
                return None
            for _ in range(n + 1):
                if not f.readline():
                    break
            if index >= skip:
                starts.append(offset)
                if len(starts) == size:
                    chunks.append(_split(skip + len(chunks) * size, starts, f.tell(), parts))
                    starts = []
            index += 1
        if starts:
            chunks.append(_split(skip + len(chunks) * size, starts, f.tell(), parts))
    return chunks


def _split(first: int, starts: list[int], end: int, parts: int) -> list[Block]:
    """Frames ``first ..`` starting at byte offsets ``starts`` (the last ending at ``end``) as ``parts`` blocks."""
    bounds = np.linspace(0, len(starts), min(parts, len(starts)) + 1).round().astype(int).tolist()
    offsets = [*starts, end]
    return [Block(first + a, b - a, offsets[a], offsets[b]) for a, b in itertools.pairwise(bounds)]


def frames_text(frames: list, results: list[dict | None]) -> str:
    """extxyz text of the frames that have a result, with it (energy, forces, per-atom energies, stress, and
    ``info["domain"]`` for frames outside the training envelope)."""
    import ase.io
    from ase.calculators.singlepoint import SinglePointCalculator

    written = []
    for atoms, r in zip(frames, results, strict=True):
        if r is None:
            continue
        a = atoms.copy()
        extra = {"stress": np.asarray(r["stress"])} if "stress" in r else {}
        a.calc = SinglePointCalculator(a, energy=r["energy"], forces=r["forces"], energies=r["energies"], **extra)
        if r.get("domain"):
            a.info["domain"] = "; ".join(r["domain"])
        written.append(a)
    if not written:
        return ""
    text = io.StringIO()
    ase.io.write(text, written, format="extxyz")
    return text.getvalue()


def _block_text(path: str, block: Block) -> str:
    with open(path, "rb") as f:
        f.seek(block.start)
        return f.read(block.end - block.start).decode()


def _fast_arrays(text: str, block: Block) -> tuple | None:
    """The block's frames as :func:`~mlff_distiller._extxyz_fast.parse_frames` reads them, or None (ASE reads
    them)."""
    arrays = parse_frames(text, info=True)  # (info strings such as a molecule's name kept in the output)
    return arrays if arrays is not None and len(arrays[4]) == block.count else None


def _read_block(path: str, block: Block, text: str | None = None) -> list:
    import ase.io

    if text is None:
        text = _block_text(path, block)
    try:
        frames = ase.io.read(io.StringIO(text), index=":", format="extxyz")
    except Exception as exc:
        raise ValueError(
            f"{path}: structures {block.first}-{block.first + block.count - 1} could not be read "
            f"({type(exc).__name__}: {exc})"
        ) from None
    if len(frames) != block.count:
        raise ValueError(f"{path}: structures {block.first}-{block.first + block.count - 1} could not be read")
    return frames


def _parse(path: str, block: Block) -> tuple[tuple, tuple | None]:
    """Worker: the block's structures as arrays (numbers, positions, cells, pbc, atom counts), and everything
    :func:`~mlff_distiller._extxyz_fast.format_frames` needs to write them (None: the fast codec declined the
    block, and ASE reads it again to write it)."""
    text = _block_text(path, block)
    arrays = _fast_arrays(text, block)
    if arrays is not None:
        return arrays[:5], arrays
    frames = _read_block(path, block, text)
    counts = np.array([len(a) for a in frames], dtype=np.int64)
    numbers = np.concatenate([a.numbers for a in frames])
    positions = np.concatenate([a.positions for a in frames])
    cells = np.stack([a.cell.array for a in frames])
    pbc = np.stack([a.pbc for a in frames])
    return (numbers, positions, cells, pbc, counts), None


def _format(path: str, block: Block, payload: tuple, parsed: tuple | None, delay_s: float = 0.0) -> str:
    """Worker: the block's output text, with the results of ``payload``: by the fast codec from the arrays it
    read (``parsed``), else by ASE from its frames read again (``info`` and extra arrays included)."""
    if delay_s:
        time.sleep(delay_s)
    if parsed is not None:
        return format_frames(parsed, _unpack(payload))
    return frames_text(_read_block(path, block), _unpack(payload))


def _ignore_interrupts() -> None:
    """Workers leave a Ctrl-C to the main process, which lets them finish the blocks it will still write."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _pack(results: list[dict | None]) -> tuple:
    """Results of a block in a few arrays (quick to send to a worker): which frames have one, energies, forces
    and per-atom energies of those, stress (or None), domain findings."""
    kept = [r for r in results if r is not None]
    has = np.array([r is not None for r in results], dtype=bool)
    energy = np.array([r["energy"] for r in kept], dtype=np.float64)
    forces = np.concatenate([r["forces"] for r in kept]) if kept else np.zeros((0, 3))
    energies = np.concatenate([r["energies"] for r in kept]) if kept else np.zeros(0)
    counts = np.array([len(r["energies"]) for r in kept], dtype=np.int64)
    stress = [r.get("stress") for r in kept]
    domain = [r.get("domain") for r in kept]
    return has, energy, forces, energies, counts, stress, domain


def _unpack(payload: tuple) -> list[dict | None]:
    has, energy, forces, energies, counts, stress, domain = payload
    ends = np.cumsum(counts)
    starts = ends - counts
    rows = []
    for j, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        row = {"energy": float(energy[j]), "forces": forces[a:b], "energies": energies[a:b]}
        if stress[j] is not None:
            row["stress"] = stress[j]
        if domain[j] is not None:
            row["domain"] = domain[j]
        rows.append(row)
    it = iter(rows)
    return [next(it) if h else None for h in has.tolist()]


def run_blocks(
    path: Path,
    chunks: list[list[Block]],
    workers: int,
    predict: Callable[[list], tuple[list[dict | None], list]],
    record: Callable[[int, list[dict | None], list, str], None],
    pool: Executor | None = None,
    seconds: dict[str, float] | None = None,
) -> None:
    """For each chunk in order: its blocks parsed in workers, ``predict(frames)`` here (results, skipped), its
    blocks formatted in workers, then ``record(count, results, skipped, text)`` here. Two chunks are parsed
    ahead and at most two wait formatted, so memory stays a few chunks whatever the file's size. ``pool``: the
    ``workers`` processes already started (:func:`start_pool`; shut down by the caller), else started here.
    ``seconds``: where this process's time went is added to its ``read``, ``predict``, ``format`` and ``write``
    entries (with workers, ``read`` and ``format`` are mostly waits for them)."""
    clock = Clock(seconds)
    own = pool is None
    if own:
        pool = start_pool(workers)
    inline = _InlinePool()

    def executor() -> Executor:
        """The workers once they have started; until then this process reads and writes the blocks itself."""
        ready = getattr(pool, "ready", None)
        return pool if ready is None or ready() else inline

    try:
        src = str(path)
        todo: Iterator[list[Block]] = iter(chunks)
        parsing: deque = deque()  # (blocks, their parse futures)
        formatting: deque = deque()  # (frames, results, skipped, format futures)

        def refill() -> None:
            with clock("read"):
                while len(parsing) < 2:
                    blocks = next(todo, None)
                    if blocks is None:
                        return
                    parsing.append((blocks, [executor().submit(_parse, src, b) for b in blocks]))

        def drain(limit: int) -> None:
            while formatting and (len(formatting) > limit or all(f.done() for f in formatting[0][3])):
                count, results, skipped, futures = formatting.popleft()
                with clock("format"):
                    text = "".join(f.result() for f in futures)
                with clock("write"):
                    record(count, results, skipped, text)

        refill()
        try:
            while parsing:
                blocks, futures = parsing.popleft()
                with clock("read"):
                    parsed = [f.result() for f in futures]
                    frames = FrameTable.concat([FrameTable(*arrays) for arrays, _ in parsed])  # no Atoms built
                refill()
                with clock("predict"):
                    results, skipped = predict(frames)
                with clock("format"):
                    futures, k = [], 0
                    for b, (_, codec) in zip(blocks, parsed, strict=True):
                        payload = _pack(results[k : k + b.count])
                        futures.append(executor().submit(_format, src, b, payload, codec, _FORMAT_DELAY_S))
                        k += b.count
                formatting.append((len(frames), results, skipped, futures))
                drain(1)
        except BaseException:
            # A bad block, an error or a Ctrl-C here (the workers ignore it and finish their tasks): the chunks
            # already computed are written before it goes on, as the one-process path would have written them.
            while formatting:
                count, results, skipped, futures = formatting.popleft()
                try:
                    text = "".join(f.result(timeout=_GRACE_S) for f in futures)
                except BaseException:
                    break
                record(count, results, skipped, text)
            raise
        drain(0)
    finally:
        if own:
            pool.shutdown(wait=False, cancel_futures=True)


def start_pool(workers: int) -> Executor:
    """``workers`` processes for :func:`run_blocks`, started from a thread of their own while the caller goes on
    (:class:`_StartingPool`), or the in-process executor for 0."""
    return _InlinePool() if workers == 0 else _StartingPool(workers)


class _StartingPool(Executor):
    """A process pool whose start runs in a thread: the first process started waits for the forkserver to import
    this module (NumPy and the codec: 12 workers in 0.6 s on the H100 host; 7.6-7.9 s while the package imported
    torch eagerly, ``benchmarks/results/predict_cli_h100.md``), which would otherwise hold up the caller, not run
    beside its own start-up (loading the student, building its engine, scanning the file). Every worker is started
    (a no-op task each); ``submit`` and ``shutdown`` wait for the start, and raise what it raised."""

    def __init__(self, workers: int) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._start, args=(workers,), name="extxyz-pool-start", daemon=True)
        self._thread.start()

    def _start(self, workers: int) -> None:
        try:
            self._pool = ProcessPoolExecutor(workers, mp_context=_context(), initializer=_ignore_interrupts)
            for _ in range(workers):
                self._pool.submit(int)
        except BaseException as exc:  # raised again to the caller by submit / shutdown
            self._error = exc

    def ready(self) -> bool:
        """The start has ended (``submit`` will not wait)."""
        return not self._thread.is_alive()

    def _started(self) -> ProcessPoolExecutor:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._pool is not None
        return self._pool

    def submit(self, fn: Callable, *args) -> Future:
        return self._started().submit(fn, *args)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self._thread.join()
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


class Clock:
    """``with clock(part):`` adds the seconds the block takes to ``seconds[part]`` (nothing when ``seconds`` is
    None)."""

    def __init__(self, seconds: dict[str, float] | None) -> None:
        self.seconds = seconds
        self.part = ""
        self.t0 = 0.0

    def __call__(self, part: str) -> Clock:
        self.part = part
        return self

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if self.seconds is not None:
            self.seconds[self.part] = self.seconds.get(self.part, 0.0) + time.perf_counter() - self.t0


class _InlinePool(Executor):
    """The executor of ``workers=0``: each task runs in this process when it is submitted."""

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as exc:  # raised where the result is asked for, as from a worker
            future.set_exception(exc)
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def _context():
    """Workers forked from a fresh server process where the OS allows (no CUDA context, no threads of the
    calling process are copied into them; the server imports this module once, without torch since the package
    imports its names lazily, and every worker shares it), else spawned. ``concurrent.futures`` reports a worker
    that dies instead of waiting for it."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    return multiprocessing.get_context("spawn")
