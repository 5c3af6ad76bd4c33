"""``mlff-distill``: label, train, evaluate, predict and run MD from the command line.

Every subcommand is described by a dataclass (``LabelJob``, ``TrainJob``, ...). Values come from, in
rising priority: the dataclass defaults, a YAML file (``--config``), ``--set dotted.key=value`` overrides
(the value is parsed as YAML) and the explicit flags. ``mlff-distill <command> --help`` lists the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mlff_distiller.committee import DEFAULT_COMMITTEE, DISAGREEMENT_THRESHOLD
from mlff_distiller.distill.config import from_dict, load_yaml
from mlff_distiller.distill.sampling import SamplingConfig
from mlff_distiller.distill.training import TrainConfig

__all__ = ["CheckJob", "EvaluateJob", "LabelJob", "MDJob", "PredictJob", "TrainJob", "main"]


@dataclass(kw_only=True)
class LabelJob:
    """``label``: sample with the teacher and write labelled frames to ``out`` (resumable)."""

    teacher: str = "gfn2-xtb"
    teacher_options: dict = field(default_factory=dict)
    seeds: str = "g2-chno"
    out: str = "labels"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    student: str | None = None
    on_policy_round: int | None = None
    committee: str | None = None
    progress: bool = True
    workers: int = 1


@dataclass(kw_only=True)
class TrainJob:
    """``train``: fit a student to labelled frames; writes ``out/best.pt`` and optionally ``export``."""

    data: str = "labels"
    val_data: str | None = None
    val_fraction: float = 0.1
    split_seed: int = 0
    out: str = "runs/student"
    teacher: str = "unknown"
    resume: bool = False
    init_model: str | None = None
    export: str | None = None
    train: TrainConfig = field(default_factory=TrainConfig)


@dataclass(kw_only=True)
class EvaluateJob:
    """``evaluate``: errors vs the teacher labels, parity plot, optional timing and NVE drift."""

    model: str = "builtin:chno-gfn2"
    data: str = "labels"
    out: str = "eval"
    device: str | None = None
    precision: str = "fp64"
    teacher: str | None = None
    timing_steps: int = 0
    nve_steps: int = 0
    nve_timestep_fs: float = 0.25
    nve_temperature: float = 300.0
    history: str | None = None


@dataclass(kw_only=True)
class PredictJob:
    """``predict``: energies and forces of every structure in ``input``, written as extxyz to ``output``."""

    model: str = "builtin:chno-gfn2"
    input: str = ""
    output: str = "predictions.extxyz"
    device: str | None = None
    precision: str = "fp32"
    batch_size: int | None = None


@dataclass(kw_only=True)
class MDJob:
    """``md``: ASE molecular dynamics with the student; trajectory written as extxyz."""

    model: str = "builtin:chno-gfn2"
    input: str = ""
    output: str = "md.extxyz"
    ensemble: str = "langevin"
    steps: int = 1000
    timestep_fs: float = 0.5
    temperature: float = 300.0
    friction_per_fs: float = 0.01
    interval: int = 10
    device: str | None = None
    precision: str = "fp64"
    seed: int = 0
    # npt (ASE's NPTBerendsen, isotropic; a fully periodic input): target pressure, the material's isothermal
    # compressibility (default: water at 300 K) and the thermostat / barostat time constants.
    pressure_bar: float = 1.01325
    compressibility_per_bar: float = 4.57e-5
    taut_fs: float = 100.0
    taup_fs: float = 1000.0


@dataclass(kw_only=True)
class CheckJob:
    """``check``: do two or more students agree on these structures? Flags those outside their training data."""

    input: str = ""
    models: list[str] = field(default_factory=lambda: list(DEFAULT_COMMITTEE))
    threshold: float = DISAGREEMENT_THRESHOLD
    output: str | None = None
    device: str | None = None
    precision: str = "fp32"


JOBS = {
    "label": LabelJob,
    "train": TrainJob,
    "evaluate": EvaluateJob,
    "predict": PredictJob,
    "md": MDJob,
    "check": CheckJob,
}


# ------------------------------------------------------------------------------------------------ parsing
def _set_dotted(data: dict, dotted: str) -> None:
    if "=" not in dotted:
        raise ValueError(f"--set expects key=value, got {dotted!r}")
    key, raw = dotted.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"--set {key}: {p!r} is not a section")
    node[parts[-1]] = yaml.safe_load(raw)


def build_job(command: str, args: argparse.Namespace):
    """The job dataclass of ``command`` from defaults, ``--config``, ``--set`` and explicit flags."""
    data = load_yaml(args.config) if getattr(args, "config", None) else {}
    for item in getattr(args, "set", None) or []:
        _set_dotted(data, item)
    cls = JOBS[command]
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        if value is not None:  # only explicit flags are non-None (argparse defaults are all None)
            data[f.name] = value
    return from_dict(cls, data, where=f"{command} config")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file with this command's settings")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a setting, e.g. --set train.lr=5e-4 (repeatable)",
    )


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlff-distill", description="Distil a slow teacher force field into a fast PaiNN-class student."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("label", help="sample with the teacher and write labelled frames (resumable)")
    _add_common(p)
    p.add_argument("--teacher", help="gfn2-xtb | sevennet-0 | emt")
    p.add_argument("--seeds", help="g2-chno | molecule:NAME[,NAME] | structure file")
    p.add_argument("--out", help="output directory (frames.db + frames.extxyz); an earlier run there resumes")
    p.add_argument("--student", help="student checkpoint for an on-policy round")
    p.add_argument("--on-policy-round", dest="on_policy_round", type=int, help="label student-driven MD")
    p.add_argument(
        "--committee",
        help="a second student: with --set sampling.select_disagreement=50 the on-policy round labels only the "
        "frames where the two students' forces differ by more than 50 meV/Å",
    )
    p.add_argument("--workers", type=int, help="processes, split by seed structure (default 1)")
    p.add_argument("--no-progress", dest="progress", action="store_const", const=False, help="no progress bar")

    p = sub.add_parser("train", help="train a student on labelled frames")
    _add_common(p)
    p.add_argument("--data", help="label directory, .db or extxyz with energies and forces")
    p.add_argument("--val-data", dest="val_data", help="separate validation frames (else split from --data)")
    p.add_argument("--out", help="run directory (best.pt, last.pt, train_state.pt, history.json)")
    p.add_argument("--resume", action="store_const", const=True, help="continue from OUT/train_state.pt")
    p.add_argument(
        "--init-model",
        dest="init_model",
        help="fine-tune this student (checkpoint path or builtin:NAME) instead of training a new one; "
        "--set train.refit_energy_reference=true for labels with another energy zero",
    )
    p.add_argument("--export", help="also copy the best student here")

    p = sub.add_parser("evaluate", help="errors vs teacher labels; plots; optional timing and NVE drift")
    _add_common(p)
    p.add_argument("--model", help="checkpoint path or builtin:NAME")
    p.add_argument("--data", help="held-out labelled frames")
    p.add_argument("--out", help="output directory (metrics.json, parity.png)")
    p.add_argument("--device")
    p.add_argument("--teacher", help="teacher for the MD-step timing comparison")
    p.add_argument("--timing-steps", dest="timing_steps", type=int, help="MD steps timed (0: no timing)")
    p.add_argument("--nve-steps", dest="nve_steps", type=int, help="NVE steps for the drift check (0: none)")
    p.add_argument("--history", help="history.json of a training run, for a learning-curve PNG")

    p = sub.add_parser("predict", help="energies/forces of a structures file, written as extxyz")
    _add_common(p)
    p.add_argument("--model", help="checkpoint path or builtin:NAME")
    p.add_argument("--input", help="structures file (any format ASE reads)")
    p.add_argument("--output", help="output extxyz")
    p.add_argument("--device")
    p.add_argument("--precision", help="fp64 | fp32 | tf32")
    p.add_argument("--batch-size", dest="batch_size", type=int)

    p = sub.add_parser("md", help="molecular dynamics with the student, trajectory as extxyz")
    _add_common(p)
    p.add_argument("--model", help="checkpoint path or builtin:NAME")
    p.add_argument("--input", help="starting structure (first frame of the file)")
    p.add_argument("--output", help="trajectory extxyz")
    p.add_argument("--ensemble", help="langevin | nve | npt (Berendsen; periodic input)")
    p.add_argument("--pressure-bar", dest="pressure_bar", type=float, help="npt: target pressure, bar")
    p.add_argument(
        "--compressibility-per-bar", dest="compressibility_per_bar", type=float, help="npt: 1/bar (water: 4.57e-5)"
    )
    p.add_argument("--taut-fs", dest="taut_fs", type=float, help="npt: thermostat time constant, fs")
    p.add_argument("--taup-fs", dest="taup_fs", type=float, help="npt: barostat time constant, fs")
    p.add_argument("--steps", type=int)
    p.add_argument("--timestep-fs", dest="timestep_fs", type=float)
    p.add_argument("--temperature", type=float, help="K")
    p.add_argument("--interval", type=int, help="steps between written frames")
    p.add_argument("--device")
    p.add_argument("--precision", help="fp64 | fp32 | tf32")

    p = sub.add_parser(
        "check", help="do the students agree on these structures? (flags structures outside their training data)"
    )
    _add_common(p)
    p.add_argument("--input", help="structures file (any format ASE reads)")
    p.add_argument(
        "--models",
        type=lambda text: [m.strip() for m in text.split(",") if m.strip()],
        help=f"two or more comma-separated students (default: {','.join(DEFAULT_COMMITTEE)})",
    )
    p.add_argument(
        "--threshold", type=float, help=f"meV/Å of force disagreement that flags (default {DISAGREEMENT_THRESHOLD:g})"
    )
    p.add_argument("--output", help="also write every structure's numbers here (JSON)")
    p.add_argument("--device")
    p.add_argument("--precision", help="fp64 | fp32 | tf32")

    sub.add_parser("models", help="the built-in students (builtin:NAME): size, elements and measured accuracy")
    return parser


# ------------------------------------------------------------------------------------------------ commands
def run_label(job: LabelJob) -> dict:
    from mlff_distiller.distill.labelling import label
    from mlff_distiller.distill.seeds import load_seeds

    student = committee = None
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
        from mlff_distiller.distill.labelling import label_parallel

        report = label_parallel(
            load_seeds(job.seeds),
            job.teacher,
            job.out,
            job.sampling,
            workers=job.workers,
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


def run_train(job: TrainJob) -> dict:
    import shutil

    from mlff_distiller.checkpoint import load_model
    from mlff_distiller.distill.dataset import split_frames
    from mlff_distiller.distill.labelling import read_frames
    from mlff_distiller.distill.training import train

    frames = read_frames(job.data)
    if job.val_data:
        train_frames, val_frames = frames, read_frames(job.val_data)
    else:
        train_frames, val_frames = split_frames(frames, job.val_fraction, seed=job.split_seed)
        if not val_frames:
            groups = len({a.info.get("task", ("frame", k)) for k, a in enumerate(frames)})
            raise ValueError(
                f"no validation frames: the split keeps each trajectory on one side, and {job.data} holds "
                f"{groups} trajector{'y' if groups == 1 else 'ies'} with val_fraction {job.val_fraction}; label more "
                "(temperatures, replicas or rattles), raise val_fraction, or pass --val-data"
            )
    init = load_model(job.init_model) if job.init_model else None
    meta = {"teacher": job.teacher, "data": str(job.data), "train_frames": len(train_frames)}
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
    metrics = error_metrics(frames, predict_frames(model, frames, device=job.device, precision=job.precision))
    parity_plot(metrics, out / "parity.png", title=f"{job.model} on {job.data}")
    result = {k: v for k, v in metrics.items() if not k.startswith("_")}
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


def _read_structures(path: str):
    import ase.io

    if not path:
        raise ValueError("--input is required")
    if not Path(path).exists():
        raise ValueError(f"input file not found: {path}")
    frames = ase.io.read(path, index=":")
    if not frames:
        raise ValueError(f"{path} holds no structures")
    return frames


def run_predict(job: PredictJob) -> dict:
    import ase.io
    from ase.calculators.singlepoint import SinglePointCalculator

    from mlff_distiller.batching import NonFiniteOutputError
    from mlff_distiller.predict import predict_forces

    frames = _read_structures(job.input)
    t0 = time.perf_counter()
    failure = None
    try:
        preds = predict_forces(job.model, frames, device=job.device, batch_size=job.batch_size, precision=job.precision)
    except NonFiniteOutputError as err:  # the finite results are still written, then the error is reported
        failure, preds = err, err.results
    seconds = time.perf_counter() - t0
    out = []
    for atoms, p in zip(frames, preds, strict=True):
        if p is None:
            continue
        a = atoms.copy()
        a.calc = SinglePointCalculator(a, energy=p["energy"], forces=p["forces"], energies=p["energies"])
        out.append(a)
    Path(job.output).parent.mkdir(parents=True, exist_ok=True)
    ase.io.write(job.output, out, format="extxyz")
    if failure is not None:
        raise ValueError(f"{failure}\n{job.output} holds the other {len(out)} of {len(frames)} structures") from None
    return {"structures": len(out), "seconds": seconds, "output": job.output}


def run_md(job: MDJob) -> dict:
    import ase.io
    import numpy as np
    from ase import units
    from ase.md.langevin import Langevin
    from ase.md.verlet import VelocityVerlet

    from mlff_distiller.ase_compat import maxwell_boltzmann
    from mlff_distiller.calculator import StudentCalculator

    if job.ensemble not in ("langevin", "nve", "npt"):
        raise ValueError(f"ensemble must be 'langevin', 'nve' or 'npt', got {job.ensemble!r}")
    if job.steps < 1 or job.interval < 1:
        raise ValueError("steps and interval must be >= 1")
    atoms = _read_structures(job.input)[0]
    atoms.calc = StudentCalculator(job.model, device=job.device, precision=job.precision)
    rng = np.random.default_rng(job.seed)
    maxwell_boltzmann(atoms, job.temperature, rng=rng)
    dt = job.timestep_fs * units.fs
    if job.ensemble == "npt":
        from mlff_distiller.distill.evaluation import density_g_cm3, npt_berendsen

        if not atoms.pbc.all():
            raise ValueError(f"ensemble 'npt' needs a fully periodic input; {job.input} has pbc={atoms.pbc.tolist()}")
        if job.compressibility_per_bar <= 0 or job.taut_fs <= 0 or job.taup_fs <= 0:
            raise ValueError("npt: compressibility_per_bar, taut_fs and taup_fs must be > 0")
        # The student's stress runs in the padded step (one CUDA graph per bucket on a GPU), the calculator returns
        # it with the forces while it is being asked for, and the Verlet list is kept across small cell changes.
        dyn = npt_berendsen(
            atoms,
            timestep_fs=job.timestep_fs,
            temperature=job.temperature,
            pressure_bar=job.pressure_bar,
            compressibility_per_bar=job.compressibility_per_bar,
            taut_fs=job.taut_fs,
            taup_fs=job.taup_fs,
        )
    elif job.ensemble == "nve":
        dyn = VelocityVerlet(atoms, timestep=dt)
    else:
        if not atoms.pbc.any():
            from ase.constraints import FixCom

            atoms.set_constraint(FixCom())  # replaces Langevin's deprecated fixcm flag for a molecule
        dyn = Langevin(
            atoms,
            timestep=dt,
            temperature_K=job.temperature,
            friction=job.friction_per_fs / units.fs,
            rng=rng,
            fixcm=False,
        )
    Path(job.output).parent.mkdir(parents=True, exist_ok=True)
    Path(job.output).unlink(missing_ok=True)

    def write() -> None:
        frame = atoms.copy()
        frame.calc = atoms.calc
        frame.info["time_fs"] = dyn.get_time() / units.fs
        frame.info["total_energy"] = float(atoms.get_total_energy())
        if job.ensemble == "npt":
            frame.info["volume"] = float(atoms.get_volume())
            frame.info["density_g_cm3"] = density_g_cm3(atoms)
            frame.info["pressure_gpa"] = -float(np.mean(atoms.get_stress()[:3])) / units.GPa  # virial part
        ase.io.write(job.output, frame, format="extxyz", append=True)

    dyn.attach(write, interval=job.interval)
    t0 = time.perf_counter()
    dyn.run(job.steps)
    seconds = time.perf_counter() - t0
    if not np.isfinite(atoms.get_total_energy()):
        raise FloatingPointError("MD blew up: non-finite total energy")
    out = {"steps": job.steps, "seconds": seconds, "s_per_step": seconds / job.steps, "output": job.output}
    if job.ensemble == "npt":
        out["final_density_g_cm3"] = density_g_cm3(atoms)
    verlet = getattr(getattr(atoms.calc, "engine", None), "verlet", None)
    if verlet is not None:  # how often the neighbour list was rebuilt (NPT: kept across small cell changes)
        out["list_builds"] = verlet.n_builds
    return out


def run_check(job: CheckJob) -> dict:
    import numpy as np

    from mlff_distiller.committee import committee_disagreement

    frames = _read_structures(job.input)
    rows = committee_disagreement(
        job.models, frames, device=job.device, precision=job.precision, threshold=job.threshold
    )
    flagged = [k for k, r in enumerate(rows) if r["flagged"]]
    worst = max(range(len(rows)), key=lambda k: rows[k]["force_disagreement_mev_a"])
    if job.output:
        Path(job.output).parent.mkdir(parents=True, exist_ok=True)
        Path(job.output).write_text(json.dumps([{"index": k, **r} for k, r in enumerate(rows)], indent=1))
    if flagged:
        verdict = (
            f"{len(flagged)} of {len(rows)} structures flagged: there the students' forces differ by more than "
            f"{job.threshold:g} meV/Å, and their errors are likely as large. Label such structures with the teacher "
            "and fine-tune (mlff-distill label, then mlff-distill train --init-model)."
        )
    else:
        verdict = (
            f"the students agree on all {len(rows)} structures (forces within {job.threshold:g} meV/Å): they look "
            "like the training data (agreement does not prove accuracy)."
        )
    return {
        "structures": len(rows),
        "models": list(job.models),
        "threshold_mev_a": job.threshold,
        "flagged": len(flagged),
        "flagged_indices": flagged[:1000],
        "median_force_disagreement_mev_a": float(np.median([r["force_disagreement_mev_a"] for r in rows])),
        "worst": {"index": worst, **rows[worst]},
        "verdict": verdict,
        "output": job.output,
    }


def run_models() -> list[dict]:
    """One entry per built-in student: what ``load_model("builtin:<name>")`` gives, from its checkpoint."""
    from mlff_distiller.checkpoint import builtin_models, load_model

    out = []
    for name in builtin_models():
        model = load_model(f"builtin:{name}")
        meta = model.metadata
        out.append(
            {
                "model": f"builtin:{name}",
                "hidden": model.config.hidden,
                "layers": model.config.layers,
                "parameters": sum(p.numel() for p in model.parameters()),
                "elements": model.species_list,
                "cutoff": model.cutoff,
                "teacher": meta.get("teacher"),
                "test_force_mae_mev_a": meta.get("test_force_mae_mev_a"),
                "test_energy_mae_mev_atom": meta.get("test_energy_mae_mev_atom"),
                "description": meta.get("description"),
            }
        )
    return out


RUNNERS = {
    "check": run_check,
    "label": run_label,
    "train": run_train,
    "evaluate": run_evaluate,
    "predict": run_predict,
    "md": run_md,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mlff-distill``; returns the exit status (2 for bad input)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "models":
            result = run_models()
        else:
            job = build_job(args.command, args)
            result = RUNNERS[args.command](job)
    except (ValueError, FileNotFoundError) as exc:
        print(f"mlff-distill {args.command}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
