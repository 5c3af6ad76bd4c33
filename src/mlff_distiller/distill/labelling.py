"""Labelling to disk, incrementally and resumably.

An output directory holds:

* ``frames.db``: an ASE database (SQLite), the indexed and authoritative copy. Each frame is one row written
  in its own transaction, with key-value pairs ``task`` (the task key), ``frame`` (index within the task),
  ``kind`` and ``temperature`` (K), teacher ``energy`` (eV) and ``forces`` (eV/Å), and, when labelled, the
  Hessian-vector-product arrays ``hvp_dir``/``hvp`` in the row's data.
* ``frames.extxyz``: the same frames as extended XYZ, appended and flushed after every frame.
* ``label_config.json``: the sampling config and teacher, checked on resume.
* ``progress.json``: the keys of completed tasks, and of the tasks given up, written atomically at the start and
  the end of a run; during a run each task that ends is appended to ``progress.log`` (one JSON line), which a resume
  replays and folds into ``progress.json``. Rewriting the whole record after every task cost time quadratic in the
  task count (``_ProgressRecord``).
* ``attempts.json``: the tasks started and not finished, with how many times. A task that took its process down
  ``MAX_ATTEMPTS`` times (a teacher that aborts on some geometry: tblite's Fortran runtime does on rare hot,
  broken ones, beyond any Python exception handler) is given up on the next start and counted as failed, so a
  resumed run gets past it. An interrupt (Ctrl-C) or a Python exception does not count as an attempt.

Why a restart after SIGKILL loses and duplicates nothing: tasks are deterministic (:mod:`.sampling`), a frame
is committed to the database atomically and identified by ``(task, frame)``. On restart, completed tasks are
skipped, an interrupted task is re-run from its start and its frames already in the database are skipped,
and ``frames.extxyz`` is rebuilt from the database first (a kill may have cut it mid-frame).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import ase.io
import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import Calculator
from ase.calculators.singlepoint import SinglePointCalculator

from mlff_distiller.distill.sampling import Deduplicator, SamplingConfig, make_tasks, run_task
from mlff_distiller.distill.teachers import get_teacher, teacher_name

__all__ = ["FrameStore", "LabelReport", "label", "read_frames"]  # (+ label_parallel, label_watched: __getattr__)

DB_NAME = "frames.db"
XYZ_NAME = "frames.extxyz"
CONFIG_NAME = "label_config.json"
PROGRESS_NAME = "progress.json"
PROGRESS_LOG_NAME = "progress.log"
ATTEMPTS_NAME = "attempts.json"
# Starts of one task that ended with its process killed (not by an interrupt) before it is given up.
MAX_ATTEMPTS = 2


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class _ProgressRecord:
    """The completed and given-up tasks of a label directory: ``progress.json`` plus the journal ``progress.log``.

    ``mark`` appends one line per task and flushes it (a SIGKILL right after loses nothing: the line is in the
    kernel's buffers); ``compact`` folds the journal into ``progress.json`` (atomic replace) and then removes the
    journal, so a kill between the two only replays lines already folded in. A line cut by a kill mid-write is
    ignored (its task is re-run: tasks are deterministic, and its committed frames are skipped). One append per task
    instead of rewriting the sorted record, whose cost grew with the task count: 15,000 given frames (one task each,
    EMT) took 4.97 ms a frame that way and 3.20 with the journal, 2,000 frames 3.91 and 3.28
    (``benchmarks/results/probe_label_progress.md``).
    """

    def __init__(self, directory: Path):
        self.path = directory / PROGRESS_NAME
        self.log_path = directory / PROGRESS_LOG_NAME
        record = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.done = set(record.get("done", []))
        self.given_up = set(record.get("given_up", []))
        if self.log_path.exists():
            for line in self.log_path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the last line, cut by a kill
                if isinstance(entry, dict) and isinstance(entry.get("done"), str):
                    self.done.add(entry["done"])
                    if entry.get("given_up"):
                        self.given_up.add(entry["done"])
        self._log = None

    def mark(self, key: str, given_up: bool = False) -> None:
        self.done.add(key)
        if given_up:
            self.given_up.add(key)
        if self._log is None:
            self._log = open(self.log_path, "a")  # kept open for the run; closed by compact
        self._log.write(json.dumps({"done": key, "given_up": given_up}) + "\n")
        self._log.flush()

    def compact(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        _atomic_write_text(self.path, json.dumps({"done": sorted(self.done), "given_up": sorted(self.given_up)}))
        self.log_path.unlink(missing_ok=True)


class FrameStore:
    """The labelled frames of one output directory (see the module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        from ase.db import connect

        self.dir = Path(directory)
        if self.dir.exists() and not self.dir.is_dir():
            raise ValueError(f"label output {self.dir} exists and is not a directory")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.db_path = self.dir / DB_NAME
        self.xyz_path = self.dir / XYZ_NAME
        # No ASE lock file: ASE takes it as an O_EXCL file around each write and waits for it forever, so a run
        # killed inside a write left ``frames.db.lock`` behind and its resume hung. SQLite's own locks are enough
        # (one writer per directory; the OS drops them with the process) and each write is one transaction.
        self.db = connect(_ready_db(self.db_path), type="db", append=True, use_lock_file=False)

    def __len__(self) -> int:
        return self.db.count()

    def keys(self) -> set[tuple[str, int]]:
        """``(task, frame)`` of every stored frame."""
        return {(row.task, int(row.frame)) for row in self.db.select(columns=["key_value_pairs"])}

    def frames(self) -> list[Atoms]:
        """All frames in insertion order, with teacher results and ``info`` task/frame/kind/temperature."""
        return _db_frames(self.db)

    def write(
        self, atoms: Atoms, *, task: str, frame: int, kind: str, temperature: float, extra: dict | None = None
    ) -> None:
        """Commit one frame to the database, then append it to the extxyz file. ``extra``: more key-value pairs of
        the row (and info keys of the frame), e.g. a given structure's ``config_weight``."""
        data = {k: np.asarray(atoms.arrays[k]) for k in ("hvp_dir", "hvp") if k in atoms.arrays}
        keys = dict(task=task, frame=int(frame), kind=kind, temperature=float(temperature), **(extra or {}))
        self.db.write(atoms, **keys, data=data)
        self._append_xyz(atoms, keys)

    def _append_xyz(self, atoms: Atoms, keys: dict) -> None:
        out = atoms.copy()
        out.calc = atoms.calc
        out.info.update(keys)
        with open(self.xyz_path, "a") as fh:
            ase.io.write(fh, out, format="extxyz")
            fh.flush()

    def rebuild_xyz(self) -> None:
        """Rewrite ``frames.extxyz`` from the database (atomically)."""
        tmp = self.xyz_path.with_name(self.xyz_path.name + ".tmp")
        with open(tmp, "w") as fh:
            for atoms in self.frames():
                ase.io.write(fh, atoms, format="extxyz")
        os.replace(tmp, self.xyz_path)


def _ready_db(path: Path) -> Path:
    """An initialised ASE database at ``path``, made crash-safe.

    ASE creates its tables lazily and, through Python's sqlite3, each ``CREATE TABLE`` commits on its own
    before the version row is written: a SIGKILL in between leaves a file that ASE can no longer open
    (``TypeError`` reading the version). So a new database is initialised under a temporary name and moved into
    place atomically, and a file left by such an interrupted initialisation (tables, no version, no rows: it
    holds no frames) is replaced. A file with frames is never touched.
    """
    import sqlite3

    from ase.db import connect

    if path.exists():
        con = sqlite3.connect(path)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if "systems" not in tables:
                return path  # empty file: ASE initialises it in one go on first use
            version = None
            if "information" in tables:
                version = con.execute("SELECT value FROM information WHERE name='version'").fetchone()
            if version is not None:
                return path
            if con.execute("SELECT COUNT(*) FROM systems").fetchone()[0]:
                raise ValueError(f"{path}: an ASE database with frames but no version record; inspect it by hand")
        finally:
            con.close()
        path.unlink()  # an interrupted initialisation: no frames in it
    tmp = path.with_name(path.name + ".init")
    tmp.unlink(missing_ok=True)
    connect(tmp, type="db", use_lock_file=False).count()  # the first use creates the tables and the version row
    os.replace(tmp, path)
    return path


def _db_frames(db) -> list[Atoms]:
    out = []
    for row in db.select(sort="id"):
        atoms = row.toatoms()
        if row.get("energy") is None or row.get("forces") is None:
            raise ValueError(f"database row {row.id} has no energy and forces labels")
        results = {"energy": float(row.energy), "forces": np.array(row.forces)}
        if row.get("stress") is not None:
            results["stress"] = np.array(row.stress, dtype=np.float64)
        atoms.calc = SinglePointCalculator(atoms, **results)
        for k, v in row.key_value_pairs.items():
            atoms.info[k] = v
        for k, v in (row.data or {}).items():
            atoms.arrays[k] = np.asarray(v)
        out.append(atoms)
    return out


@dataclass
class LabelReport:
    """What a labelling call did: frames written now, frames in the store, duplicates dropped, seconds."""

    written: int
    total: int
    duplicates: int
    tasks_run: int
    tasks_skipped: int
    seconds: float
    not_selected: int = 0  # on-policy frames the committee agreed on, left unlabelled (select_disagreement)
    # Given structures the teacher could not compute (CalculationFailed: e.g. no SCF convergence), and tasks given up
    # after taking their process down MAX_ATTEMPTS times.
    failed: int = 0


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: fall back to one line per task on stderr
        return None
    return tqdm(total=total, desc=desc, unit="task", file=sys.stderr)


def label(
    seeds: Sequence[Atoms],
    teacher: str | Calculator,
    out_dir: str | Path,
    config: SamplingConfig | None = None,
    *,
    student: Calculator | None = None,
    on_policy_round: int | None = None,
    progress: bool = True,
    teacher_options: dict | None = None,
    shard: tuple[int, int] | None = None,
    committee: Calculator | None = None,
) -> LabelReport:
    """Sample and label frames from ``seeds`` with ``teacher`` into ``out_dir``, resuming an earlier run.

    Args:
        seeds: starting structures (``ase.Atoms``).
        teacher: a preset name (``gfn2-xtb``, ``sevennet-0``, ``emt``) or an ASE Calculator.
        out_dir: output directory (created); an earlier run with the same config is resumed.
        config: sampling settings.
        student: the student calculator, needed for on-policy rounds.
        committee: a second student calculator; with ``config.select_disagreement`` an on-policy round labels only
            the frames where the two students' forces differ by more than that (query by committee).
        on_policy_round: label student-driven trajectories of this round instead of teacher MD and rattles.
        progress: show a progress bar (tqdm when installed).
        teacher_options: keyword arguments for a preset teacher's constructor.
        shard: ``(k, n)`` to run only the tasks of seeds with ``index % n == k`` (see :func:`label_parallel`).
    Raises:
        ValueError when ``out_dir`` holds a run with a different config or teacher.
    """
    config = config or SamplingConfig()
    seeds = list(seeds)
    for k, s in enumerate(seeds):
        if not isinstance(s, Atoms) or len(s) == 0:
            raise ValueError(f"seed {k} must be a non-empty ase.Atoms")
        if config.label_seeds and "config_weight" in s.info:
            from mlff_distiller.distill.dataset import config_weight

            config_weight(s, f"seed {k}")  # a bad weight is refused before any task, not after hours of labelling
    if shard is not None and not (int(shard[1]) >= 1 and 0 <= int(shard[0]) < int(shard[1])):
        raise ValueError(f"shard must be (k, n) with 0 <= k < n, got {shard}")
    store = FrameStore(out_dir)
    fingerprint = {
        "shard": list(shard) if shard is not None else None,
        "teacher": teacher_name(teacher),
        "teacher_options": teacher_options or {},
        "sampling": _sampling_fingerprint(config),
        "seeds": [_seed_fingerprint(s, config) for s in seeds],
    }
    cfg_path = store.dir / CONFIG_NAME
    if cfg_path.exists():
        old = json.loads(cfg_path.read_text())
        if old != json.loads(json.dumps(fingerprint)):
            changed = sorted(k for k in fingerprint if old.get(k) != json.loads(json.dumps(fingerprint[k])))
            raise ValueError(
                f"{store.dir} holds a labelling run with a different {changed}; use a new output directory"
            )
    else:
        _atomic_write_text(cfg_path, json.dumps(fingerprint))
    # The GFN2-xTB preset sets the process's OpenMP threads to one (see teachers._set_openmp_threads); torch's CPU
    # ops share that runtime, so the caller's torch thread count is given back when labelling ends.
    threads = torch.get_num_threads()
    try:
        return _label(
            seeds, teacher, store, config, student, on_policy_round, progress, teacher_options, shard, committee
        )
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _label(
    seeds, teacher, store, config, student, on_policy_round, progress, teacher_options, shard, committee
) -> LabelReport:
    """:func:`label` after its checks and the run's fingerprint."""
    record = _ProgressRecord(store.dir)
    record.compact()  # fold an interrupted run's journal in before this run appends to a new one
    try:
        return _label_tasks(
            seeds, teacher, store, config, student, on_policy_round, progress, teacher_options, shard, committee, record
        )
    finally:
        record.compact()


def _label_tasks(
    seeds, teacher, store, config, student, on_policy_round, progress, teacher_options, shard, committee, record
) -> LabelReport:
    """The task loop of :func:`_label`; ``record``: the run's :class:`_ProgressRecord`."""
    # The teacher is built when the first task needs it: a finished run resumes (e.g. labels carried to a machine
    # without the teacher's package, such as the GPU host without tblite) without constructing it.
    teacher_calc = None
    done = record.done
    attempts_path = store.dir / ATTEMPTS_NAME
    attempts = json.loads(attempts_path.read_text()) if attempts_path.exists() else {}

    existing = store.keys()
    if any(task not in done for task, _ in existing):
        # An interrupted task: the kill may have cut the extxyz mid-frame or before a committed frame.
        store.rebuild_xyz()
    elif existing and not store.xyz_path.exists():
        store.rebuild_xyz()
    elif store.xyz_path.exists():
        store.xyz_path.unlink()  # a kill before the first commit may leave a partial frame behind
    dedup = Deduplicator(config.dedup_rms)
    for atoms in store.frames() if config.dedup_rms > 0 else []:
        dedup.add(atoms)

    tasks = make_tasks(seeds, config, on_policy_round=on_policy_round)
    if shard is not None:
        tasks = [t for t in tasks if t.seed_index % int(shard[1]) == int(shard[0])]
    t0 = time.perf_counter()
    written = duplicates = run = skipped = 0
    stats: dict = {}
    bar = _progress(len(tasks), "label", progress)
    for task in tasks:
        if task.key in done:
            skipped += 1
        elif attempts.get(task.key, 0) >= MAX_ATTEMPTS:
            # Its process died inside it MAX_ATTEMPTS times: give it up (its committed frames stay).
            print(
                f"label: task {task.key} took its process down {attempts[task.key]} times (the teacher aborted?); "
                "given up, counted as failed",
                file=sys.stderr,
            )
            stats["failed"] = stats.get("failed", 0) + 1
            record.mark(task.key, given_up=True)
            del attempts[task.key]
            _atomic_write_text(attempts_path, json.dumps(attempts))
        else:
            run += 1
            if teacher_calc is None:
                teacher_calc = get_teacher(teacher, **(teacher_options or {}))
            attempts[task.key] = attempts.get(task.key, 0) + 1
            _atomic_write_text(attempts_path, json.dumps(attempts))
            try:
                frames = run_task(
                    task,
                    seeds[task.seed_index],
                    teacher_calc,
                    config,
                    student=student,
                    committee=committee,
                    stats=stats,
                )
                for k, frame in frames:
                    if (task.key, k) in existing:
                        continue
                    if dedup.is_duplicate(frame):
                        duplicates += 1
                        continue
                    store.write(
                        frame, task=task.key, frame=k, kind=task.kind, temperature=task.temperature,
                        extra=_given_keys(task, seeds[task.seed_index]),
                    )  # fmt: skip
                    dedup.add(frame)
                    existing.add((task.key, k))
                    written += 1
            except BaseException:  # an interrupt or an exception ends the run where it stands: not an attempt
                attempts[task.key] -= 1
                if not attempts[task.key]:
                    del attempts[task.key]
                _atomic_write_text(attempts_path, json.dumps(attempts))
                raise
            record.mark(task.key)
            del attempts[task.key]
            _atomic_write_text(attempts_path, json.dumps(attempts))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(frames=len(existing))
        elif progress:
            print(f"label: task {task.key} done, {len(existing)} frames", file=sys.stderr)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t0
    return LabelReport(
        written, len(existing), duplicates, run, skipped, elapsed, stats.get("not_selected", 0), stats.get("failed", 0)
    )


def _seed_fingerprint(seed: Atoms, config: SamplingConfig) -> dict:
    """A seed as a run records it: its numbers and positions, and the loss weight that structures labelled as given
    keep (only when set, so that directories labelled before weights existed still resume)."""
    out = {"numbers": seed.numbers.tolist(), "positions": np.round(seed.positions, 6).tolist()}
    if config.label_seeds and "config_weight" in seed.info:
        out["config_weight"] = float(seed.info["config_weight"])
    return out


def _given_keys(task, seed: Atoms) -> dict | None:
    """What a structure labelled as given keeps of its own info: its loss weight ``config_weight`` (MACE's key; a
    harvest's frames weighted by hand keep their weight through ``label --as-given``). Frames sampled from a seed
    (MD, rattles) do not inherit it: they are other structures."""
    if task.kind != "given" or "config_weight" not in seed.info:
        return None
    return {"config_weight": float(seed.info["config_weight"])}


def _sampling_fingerprint(config: SamplingConfig) -> dict:
    """The sampling settings a run is recorded under; options added later are left out at their default value, so
    a directory labelled before they existed still resumes (their default reproduces its frames)."""
    out = asdict(config)
    for name in ("rattle_strain", "select_disagreement", "label_seeds"):
        if out.get(name) == 0.0:  # (False == 0.0)
            del out[name]
    return out


def read_frames(path: str | Path) -> list[Atoms]:
    """Labelled frames from a label directory, an ASE ``.db`` or a file ASE reads with energies and forces."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no labelled data at {path}")
    if path.is_dir():
        if (path / DB_NAME).exists():
            return FrameStore(path).frames()
        shards = sorted(p for p in path.glob("shard-*-of-*") if (p / DB_NAME).exists())
        if not shards:
            raise ValueError(f"{path} is a directory without {DB_NAME} or shards; is it a label output directory?")
        return [atoms for shard in shards for atoms in FrameStore(shard).frames()]
    if path.suffix == ".db":
        from ase.db import connect

        return _db_frames(connect(path, type="db"))
    frames = ase.io.read(path, index=":")
    for k, atoms in enumerate(frames):
        if atoms.calc is None or "energy" not in atoms.calc.results or "forces" not in atoms.calc.results:
            raise ValueError(f"{path}: frame {k} has no energy and forces labels")
    return frames


def __getattr__(name: str):
    """``label_parallel`` and ``label_watched``, which run :func:`label` in processes of their own, from
    :mod:`mlff_distiller.distill.label_processes` (which imports this module)."""
    if name in ("label_parallel", "label_watched"):
        from mlff_distiller.distill import label_processes

        return getattr(label_processes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
