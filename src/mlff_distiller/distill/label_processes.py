"""Labelling in processes of their own: :func:`label_parallel` (one process per shard of the seeds) and
:func:`label_watched` (one process; ``mlff-distill label`` without ``--workers``).

A teacher may abort its whole process on a rare geometry (tblite's Fortran runtime does, beyond any Python exception
handler). Run from here, such a death ends that process only: it is started again on its directory, where
:func:`~mlff_distiller.distill.labelling.label` resumes and, after ``MAX_ATTEMPTS`` deaths in one task, gives that
task up. An exception that ends a process comes back to the caller as itself.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from ase import Atoms

from mlff_distiller.distill.labelling import ATTEMPTS_NAME, LabelReport, _atomic_write_text, label
from mlff_distiller.distill.sampling import SamplingConfig
from mlff_distiller.distill.teachers import MissingExtraError

__all__ = ["label_parallel", "label_watched"]

# Errors a shard's process sends back to be raised again in the caller as themselves (the rest: RuntimeError).
_SHARD_ERRORS = {
    "ValueError": ValueError,
    "FileNotFoundError": FileNotFoundError,
    "MissingExtraError": MissingExtraError,
}


def _label_shard(kwargs: dict, report_path: str) -> None:
    """One shard of :func:`label_parallel` in its own process; its report goes to ``report_path`` (JSON), or the
    exception that ended it (its type's name and message), to be raised again in the caller."""
    try:
        record = {"report": asdict(label(**kwargs))}
    except Exception as exc:
        record = {"error": type(exc).__name__, "message": str(exc)}
    _atomic_write_text(Path(report_path), json.dumps(record))


def _run_shards(jobs: list[dict], names: list[str] | None = None) -> list[list[LabelReport]]:
    """Each job in a spawned process of its own, all at once; a process that dies inside a task (the teacher
    aborted: ``attempts.json`` names the task) is started again on its shard, which resumes and, after
    ``MAX_ATTEMPTS`` deaths in one task, gives it up. The other shards are not disturbed. Returns each shard's
    reports, one per process. An exception that ends a shard is raised again here (``ValueError``,
    ``FileNotFoundError`` and a missing teacher package as themselves, others as ``RuntimeError``), after the other
    shards have finished; a process that died outside any task is a ``RuntimeError``."""
    import multiprocessing
    from multiprocessing.connection import wait

    ctx = multiprocessing.get_context("spawn")
    reports: list[list[LabelReport]] = [[] for _ in jobs]
    names = names or [f"shard {k}" for k in range(len(jobs))]

    def attempts(k: int) -> dict:
        path = Path(jobs[k]["out_dir"]) / ATTEMPTS_NAME
        return json.loads(path.read_text()) if path.exists() else {}

    def start(k: int):
        path = Path(jobs[k]["out_dir"]) / "report.json.part"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        proc = ctx.Process(target=_label_shard, args=(jobs[k], str(path)), daemon=True)
        before = attempts(k)
        proc.start()
        return proc, path, before

    running = {k: start(k) for k in range(len(jobs))}
    dead, errors = [], []
    while running:
        wait([proc.sentinel for proc, _, _ in running.values()])
        for k, (proc, path, before) in list(running.items()):
            if proc.exitcode is None:
                continue
            proc.join()
            del running[k]
            if proc.exitcode == 0 and path.exists():
                record = json.loads(path.read_text())
                path.unlink()
                if "error" in record:
                    errors.append((record["error"], f"{names[k]}: {record['message']}"))
                else:
                    reports[k].append(LabelReport(**record["report"]))
                continue
            now = attempts(k)
            if now and now != before:  # it died inside a task it had started: each restart moves a task on
                print(f"label: {names[k]} died inside a task (exit code {proc.exitcode}); resuming", file=sys.stderr)
                running[k] = start(k)
            else:  # before any task (or before its start was recorded): starting it again would die the same way
                dead.append(f"{names[k]} (exit code {proc.exitcode})")
    if errors:  # the first, as its own type where the caller expects it (a bad setting is a ValueError)
        name, message = errors[0]
        raise _SHARD_ERRORS.get(name, RuntimeError)(message if name in _SHARD_ERRORS else f"{name}: {message}")
    if dead:
        raise RuntimeError(
            f"labelling processes died outside any task: {', '.join(dead)}; every frame labelled so far is kept, and "
            "running the same command again resumes"
        )
    return reports


def _merged(runs: list[list[LabelReport]], seconds: float) -> LabelReport:
    """One report of every shard's processes (several for a shard started again after its process died): counts
    summed over all of them, the frames in store from each shard's last, the tasks found done from its first."""
    every = [r for shard in runs for r in shard]
    return LabelReport(
        written=sum(r.written for r in every),
        total=sum(shard[-1].total for shard in runs),
        duplicates=sum(r.duplicates for r in every),
        tasks_run=sum(r.tasks_run for r in every),
        tasks_skipped=sum(shard[0].tasks_skipped for shard in runs),
        seconds=seconds,
        not_selected=sum(r.not_selected for r in every),
        failed=sum(r.failed for r in every),
    )


def label_watched(
    seeds: Sequence[Atoms],
    teacher: str,
    out_dir: str | Path,
    config: SamplingConfig | None = None,
    *,
    progress: bool = True,
    teacher_options: dict | None = None,
) -> LabelReport:
    """:func:`label` in one process of its own, watched from this one (``mlff-distill label`` without ``--workers``):
    a teacher that aborts its process (tblite's Fortran runtime, on rare broken geometries) ends that process, not
    the caller, and the run is started again and resumes past the task (``MAX_ATTEMPTS``). The same directory, the
    same frames as :func:`label`. ``teacher`` must be a preset name; an exception comes back as itself."""
    if not isinstance(teacher, str):
        raise ValueError("label_watched needs a preset teacher name (a Calculator cannot be sent to the process)")
    job = dict(
        seeds=list(seeds),
        teacher=teacher,
        out_dir=Path(out_dir),
        config=config,
        progress=progress,
        teacher_options=teacher_options,
    )
    t0 = time.perf_counter()
    return _merged(_run_shards([job], names=["the labelling process"]), time.perf_counter() - t0)


def label_parallel(
    seeds: Sequence[Atoms],
    teacher: str,
    out_dir: str | Path,
    config: SamplingConfig | None = None,
    *,
    workers: int = 2,
    teacher_options: dict | None = None,
) -> LabelReport:
    """:func:`label` split over ``workers`` processes by seed (shard k takes seeds ``k, k + n, ...``).

    Shard k writes ``out_dir/shard-KK-of-NN`` (each resumable on its own); the frames equal those of one
    unsharded run because task keys and random streams use the global seed index and duplicates are only
    ever found among frames of the same atoms. :func:`read_frames` on ``out_dir`` reads all shards.
    """
    if not isinstance(teacher, str):
        raise ValueError("label_parallel needs a preset teacher name (a Calculator cannot be sent to workers)")
    n = int(workers)
    if n < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    out = Path(out_dir)
    # Shards of another worker count would be read together with these (read_frames reads every shard) and
    # hold the same tasks: duplicated frames. Resuming needs the count the labels were started with.
    other = sorted({p.name.rsplit("-of-", 1)[1] for p in out.glob("shard-*-of-*")} - {f"{n:02d}"})
    if other:
        raise ValueError(
            f"{out} already holds labels sharded over {int(other[0])} workers; resume with workers={int(other[0])} "
            f"(not {n}) or use another out_dir"
        )
    jobs = [
        dict(
            seeds=list(seeds),
            teacher=teacher,
            out_dir=out / f"shard-{k:02d}-of-{n:02d}",
            config=config,
            progress=False,
            teacher_options=teacher_options,
            shard=(k, n),
        )
        for k in range(n)
    ]
    t0 = time.perf_counter()
    # Spawned workers inherit the environment: one OpenMP/BLAS thread each, read when their runtimes load.
    limits = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    saved = {k: os.environ.get(k) for k in limits}
    os.environ.update(dict.fromkeys(limits, "1"))
    try:
        runs = _run_shards(jobs)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return _merged(runs, time.perf_counter() - t0)
