"""What the distillation subcommands of ``mlff-distill`` do: ``label``, ``train``, ``evaluate`` and ``harvest`` (the
rest: :mod:`mlff_distiller.cli_commands`, whose ``RUNNERS`` maps every subcommand to its function)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlff_distiller.cli import EvaluateJob, HarvestJob, LabelJob, TrainJob

__all__ = ["run_evaluate", "run_harvest", "run_label", "run_train"]


def run_label(job: LabelJob) -> dict:
    from mlff_distiller.distill.labelling import label
    from mlff_distiller.distill.seeds import load_seeds

    student = committee = None
    if job.as_given:
        if job.on_policy_round is not None:
            raise ValueError("--as-given labels the seed structures as they are; an on-policy round runs MD from them")
        job = dataclasses.replace(
            job, sampling=dataclasses.replace(job.sampling, label_seeds=True, md_steps=0, rattle_per_seed=0)
        )
    if job.committee is not None and job.on_policy_round is None:
        raise ValueError("--committee selects the frames of an on-policy round: give --on-policy-round too")
    if job.on_policy_round is not None:
        if job.student is None:
            raise ValueError("an on-policy round (--on-policy-round) needs --student CHECKPOINT")
        from mlff_distiller.calculator import StudentCalculator

        student = StudentCalculator(job.student, precision="fp64")
        if job.sampling.select_disagreement > 0 and job.committee is None:
            raise ValueError("sampling.select_disagreement needs --committee CHECKPOINT (a second student)")
        if job.committee is not None:
            committee = StudentCalculator(job.committee, precision="fp64")
    if job.workers > 1:
        if student is not None:
            raise ValueError("on-policy labelling runs in one process; use workers: 1")
        from mlff_distiller.distill.label_processes import label_parallel

        report = label_parallel(
            load_seeds(job.seeds),
            job.teacher,
            job.out,
            job.sampling,
            workers=job.workers,  # None: the automatic choice (the CLI's entry point guards its __main__)
            teacher_options=job.teacher_options,
        )
        return dataclasses.asdict(report)
    if student is None:
        from mlff_distiller.distill.label_processes import label_watched

        # In a process of its own: a teacher that aborts its process ends that one, and the run resumes past it.
        report = label_watched(
            load_seeds(job.seeds),
            job.teacher,
            job.out,
            job.sampling,
            progress=job.progress,
            teacher_options=job.teacher_options,
        )
        return dataclasses.asdict(report)
    report = label(
        load_seeds(job.seeds),
        job.teacher,
        job.out,
        job.sampling,
        student=student,
        on_policy_round=job.on_policy_round,
        progress=job.progress,
        teacher_options=job.teacher_options,
        committee=committee,
    )
    return dataclasses.asdict(report)


def _source_weights(weights: float | list[float] | None, sources: list[str]) -> list[float] | None:
    """``--data-weight`` checked against the ``--data`` sources: one finite weight >= 0 per source, not all 0.
    None (no weights given) stays None: every source weighs 1.0."""
    from mlff_distiller.distill.dataset import loss_weight

    if weights is None:
        return None
    weights = [weights] if isinstance(weights, int | float) else list(weights)
    if len(weights) != len(sources):
        raise ValueError(
            f"--data-weight (data_weight) given {len(weights)} time(s) for {len(sources)} --data source(s); give one "
            "per --data, in the same order"
        )
    out = [loss_weight(w, f"--data-weight of {source}") for source, w in zip(sources, weights, strict=True)]
    if not any(out):
        raise ValueError("--data-weight: every --data source has weight 0, so there is nothing to train on")
    return out


def _read_labelled(data: str | list[str], weights: float | list[float] | None = None) -> list:
    """The labelled frames of one source or several (``--data A --data B``: e.g. the original labels and a fine-tuning
    round's). With several, each frame's ``task`` is prefixed by its source's position, so that the train/validation
    split, which keeps a task's frames on one side, never joins two sources' tasks of the same name. ``weights``
    (``--data-weight``, one per source) multiply each frame's ``info["config_weight"]`` (default 1.0), the frame's
    weight in the training loss, so the weights travel with the frames through the split."""
    from mlff_distiller.distill.dataset import config_weight
    from mlff_distiller.distill.labelling import read_frames

    sources = [data] if isinstance(data, str) else list(data)
    if not sources:
        raise ValueError("no labelled data given (--data)")
    weights = _source_weights(weights, sources)
    frames = []
    for k, source in enumerate(sources):
        for n, atoms in enumerate(read_frames(source)):
            if len(sources) > 1:
                atoms.info["task"] = f"{k}:{atoms.info.get('task', f'frame{n}')}"
            if weights is not None:
                atoms.info["config_weight"] = weights[k] * config_weight(atoms, f"{source}: frame {n}")
            frames.append(atoms)
    return frames


def run_train(job: TrainJob) -> dict:
    import shutil

    from mlff_distiller.checkpoint import load_model
    from mlff_distiller.distill.dataset import split_frames
    from mlff_distiller.distill.training import train

    data = job.data if isinstance(job.data, str) else ", ".join(job.data)
    frames = _read_labelled(job.data, job.data_weight)
    if job.val_data:
        train_frames, val_frames = frames, _read_labelled(job.val_data)
    else:
        train_frames, val_frames = split_frames(frames, job.val_fraction, seed=job.split_seed)
        if not val_frames:
            groups = len({a.info.get("task", ("frame", k)) for k, a in enumerate(frames)})
            raise ValueError(
                f"no validation frames: the split keeps each trajectory on one side, and {data} holds "
                f"{groups} trajector{'y' if groups == 1 else 'ies'} with val_fraction {job.val_fraction}; label more "
                "(temperatures, replicas or rattles), raise val_fraction, or pass --val-data"
            )
    init = load_model(job.init_model) if job.init_model else None
    meta = {"teacher": job.teacher, "data": data, "train_frames": len(train_frames)}
    if job.data_weight is not None:
        meta["data_weight"] = job.data_weight
    if job.init_model:
        meta["init_model"] = str(job.init_model)
    result = train(train_frames, val_frames, job.train, job.out, model=init, resume=job.resume, metadata=meta)
    if job.export:
        Path(job.export).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(job.out) / "best.pt", job.export)
    return {
        "best_val": result.best_val,
        "steps": result.steps,
        "seconds": result.seconds,
        "stopped": result.stopped,
    }


def run_evaluate(job: EvaluateJob) -> dict:
    from mlff_distiller.checkpoint import load_model
    from mlff_distiller.distill.evaluation import (
        error_metrics,
        grouped_error_metrics,
        learning_curve_plot,
        md_step_timing,
        nve_drift,
        parity_plot,
        predict_frames,
    )
    from mlff_distiller.distill.labelling import read_frames

    model = load_model(job.model)
    frames = read_frames(job.data)
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    predictions = predict_frames(model, frames, device=job.device, precision=job.precision)
    metrics = error_metrics(frames, predictions)
    parity_plot(metrics, out / "parity.png", title=f"{job.model} on {job.data}")
    result = {k: v for k, v in metrics.items() if not k.startswith("_")}
    if job.by:
        keys = [job.by] if isinstance(job.by, str) else list(job.by)
        result["by"] = {key: grouped_error_metrics(frames, predictions, key) for key in keys}
    if job.history:
        learning_curve_plot(json.loads(Path(job.history).read_text()), out / "learning_curve.png")
    if job.timing_steps > 0:
        if not job.teacher:
            raise ValueError("timing needs --teacher")
        from mlff_distiller.calculator import StudentCalculator
        from mlff_distiller.distill.teachers import get_teacher

        student = StudentCalculator(model, device=job.device, precision="fp32")
        result["timing"] = md_step_timing(frames[0], student, get_teacher(job.teacher), steps=job.timing_steps)
    if job.nve_steps > 0:
        result["nve"] = nve_drift(
            frames[0],
            model,
            steps=job.nve_steps,
            timestep_fs=job.nve_timestep_fs,
            temperature=job.nve_temperature,
            device=job.device,
        )
    (out / "metrics.json").write_text(json.dumps(result, indent=1))
    return result


def run_harvest(job: HarvestJob) -> dict:
    import ase.io

    from mlff_distiller.cli_commands import _read_structures, _split_index
    from mlff_distiller.harvest import harvest

    frames = _read_structures(job.input)
    if Path(job.output).exists() and Path(job.output).resolve() == Path(_split_index(job.input)[0]).resolve():
        raise ValueError(f"output {job.output} is the input file; write the picked frames to another file")
    envelope = None
    if job.model:
        from mlff_distiller.checkpoint import load_model
        from mlff_distiller.domain import DomainEnvelope

        envelope = DomainEnvelope.of_model(load_model(job.model))
        if envelope is None:
            raise ValueError(f"{job.model} stores no training envelope; harvest without --model picks frozen frames")
    disagreement = None
    if job.committee is not None:
        import numpy as np

        from mlff_distiller.committee import committee_disagreement

        finite = [k for k, a in enumerate(frames) if np.isfinite(a.positions).all()]
        rows = committee_disagreement(
            job.committee, [frames[k] for k in finite], device=job.device, threshold=job.threshold
        )
        disagreement = [None] * len(frames)
        for k, row in zip(finite, rows, strict=True):
            disagreement[k] = row
    report = harvest(frames, before=job.before, envelope=envelope, disagreement=disagreement)
    Path(job.output).parent.mkdir(parents=True, exist_ok=True)
    ase.io.write(job.output, report.frames, format="extxyz")
    return {
        "frames_read": len(frames),
        "trajectories": report.trajectories,
        "frozen": report.frozen,
        "outside": report.outside,
        "disagree": report.disagree,
        "nonfinite": report.nonfinite,
        "frames_written": len(report.frames),
        "output": job.output,
        "examples": {str(k): why for k, why in list(report.reasons.items())[:5]},  # replica: first bad frame
        "next": f"mlff-distill label --seeds {job.output} --as-given --teacher TEACHER --out ROUND, then mlff-distill "
        "train --data LABELS --data ROUND --data-weight 1 --data-weight 0.2 --init-model STUDENT",
    }
