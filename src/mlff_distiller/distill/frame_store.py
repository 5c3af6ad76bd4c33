"""The store of a labelling output directory: the labelled frames on disk and the record of finished tasks.

* ``frames.db``: an ASE database (SQLite), the indexed and authoritative copy. Each frame is one row written
  in its own transaction, with key-value pairs ``task`` (the task key), ``frame`` (index within the task),
  ``kind`` and ``temperature`` (K) (and a given structure's ``config_weight``), teacher ``energy`` (eV) and
  ``forces`` (eV/Å), and, when labelled, the Hessian-vector-product arrays ``hvp_dir``/``hvp`` in the row's data.
* ``frames.extxyz``: the same frames as extended XYZ, appended and flushed after every frame.
* ``progress.json``: the keys of completed tasks, and of the tasks given up, written atomically at the start and
  the end of a run; during a run each task that ends is appended to ``progress.log`` (one JSON line), which a resume
  replays and folds into ``progress.json``. Rewriting the whole record after every task cost time quadratic in the
  task count (``_ProgressRecord``).

:func:`read_frames` reads labelled frames back, from such a directory (or its shards), an ASE ``.db`` or any file
ASE reads with energies and forces. The labelling itself (tasks, teacher, resuming) is :mod:`.labelling`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ase.io
import numpy as np
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator

__all__ = ["FrameStore", "read_frames"]

DB_NAME = "frames.db"
XYZ_NAME = "frames.extxyz"
PROGRESS_NAME = "progress.json"
PROGRESS_LOG_NAME = "progress.log"


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
