"""Labelling to disk, incrementally and resumably.

An output directory holds the store of :mod:`.frame_store` (``frames.db``, ``frames.extxyz``, ``progress.json`` /
``progress.log``) and:

* ``label_config.json``: the sampling config and teacher, checked on resume.
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
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import Calculator

from mlff_distiller.distill.frame_store import (  # noqa: F401 (DB_NAME, PROGRESS_*, XYZ_NAME: re-exported)
    DB_NAME,
    PROGRESS_LOG_NAME,
    PROGRESS_NAME,
    XYZ_NAME,
    FrameStore,
    _atomic_write_text,
    _ProgressRecord,
    read_frames,
)
from mlff_distiller.distill.sampling import Deduplicator, SamplingConfig, make_tasks, run_task
from mlff_distiller.distill.teachers import get_teacher, teacher_name

__all__ = ["FrameStore", "LabelReport", "label", "read_frames"]  # (+ label_parallel, label_watched: __getattr__)

CONFIG_NAME = "label_config.json"
ATTEMPTS_NAME = "attempts.json"
# Starts of one task that ended with its process killed (not by an interrupt) before it is given up.
MAX_ATTEMPTS = 2


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

    The teacher runs in this process. tblite's Fortran runtime aborts its whole process on rare broken geometries,
    beyond any Python handler, which would end the caller too (a notebook's kernel); :func:`label_watched` (and
    :func:`label_parallel`) run the same labelling in processes of their own and get past such a task, as
    ``mlff-distill label`` does. Every frame labelled before an abort is kept either way (a rerun resumes).

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


def __getattr__(name: str):
    """``label_parallel`` and ``label_watched``, which run :func:`label` in processes of their own, from
    :mod:`mlff_distiller.distill.label_processes` (which imports this module)."""
    if name in ("label_parallel", "label_watched"):
        from mlff_distiller.distill import label_processes

        return getattr(label_processes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
