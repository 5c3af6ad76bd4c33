"""What each ``mlff-distill`` subcommand does, given its job (:mod:`mlff_distiller.cli` parses the command line into
the job dataclasses; ``RUNNERS`` maps a subcommand to its function here). The distillation commands (``label``,
``train``, ``evaluate``, ``harvest``) live in :mod:`mlff_distiller.cli_distill`; prediction, MD, relaxation and
the checks here."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlff_distiller.cli import CheckJob, MDJob, PredictJob, RelaxJob

from mlff_distiller.cli_distill import run_evaluate, run_harvest, run_label, run_train

__all__ = ["RUNNERS", "run_models"]


def _split_index(path: str) -> tuple[str, object]:
    """``(file, index)`` of an input given as ``file`` or ``file@INDEX`` (ASE's syntax; index None: all frames)."""
    from ase.io.formats import parse_filename

    return (path, None) if Path(path).exists() else parse_filename(path)


def _file_and_selection(path: str) -> tuple[str, str | None]:
    """``(file, INDEX)`` of ``file`` or ``file@INDEX``, the index as the text ASE reads (``predict_file``'s and
    ``relax_file``'s ``index``); None for the whole file."""
    name, index = _split_index(path)
    return name, None if index is None else str(path).rsplit("@", 1)[1]


def _read_structures(path: str):
    """The frames of ``path``; ``file@INDEX`` (ASE's syntax: ``@-1``, ``@0:10:2``) selects some of them."""
    import ase.io

    if not path:
        raise ValueError("--input is required")
    name, index = _split_index(path)
    if not Path(name).exists():
        raise ValueError(f"input file not found: {name}")
    try:
        frames = ase.io.read(name, index=":" if index is None else index)
        frames = [frames] if hasattr(frames, "get_positions") else frames  # an integer index gives one frame
    except (StopIteration, IndexError) as exc:  # ASE's answer to an index past the last frame
        raise ValueError(f"{name} has no frame {index}") from exc
    except Exception as exc:
        if not (isinstance(exc, ValueError) or type(exc).__module__.startswith("ase.io")):
            raise
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not frames:
        raise ValueError(f"{path} holds no structures")
    return frames


def run_predict(job: PredictJob) -> dict:
    from mlff_distiller.predict_stream import predict_file, stderr_log

    if not job.input:
        raise ValueError("--input is required")
    name, index = _file_and_selection(job.input)
    return predict_file(
        job.model,
        name,
        job.output,
        index=index,
        chunk=job.chunk,
        restart=job.restart,
        device=job.device,
        batch_size=job.batch_size,
        precision=job.precision,
        stress=job.stress,
        check_domain=job.check_domain,
        workers=job.workers,  # None: the automatic choice (the CLI's entry point guards its __main__)
        log=stderr_log,
    )


# The info an MD frame carries (run_md writes them).
_MD_INFO = ("time_fs", "total_energy", "volume", "density_g_cm3", "pressure_gpa")


def run_md(job: MDJob) -> dict:
    import numpy as np
    from ase import units
    from ase.io.extxyz import write_extxyz
    from ase.md.langevin import Langevin
    from ase.md.verlet import VelocityVerlet

    from mlff_distiller._extxyz_fast import format_md_frame
    from mlff_distiller.ase_compat import maxwell_boltzmann
    from mlff_distiller.calculator import StudentCalculator

    if job.ensemble not in ("langevin", "nve", "npt"):
        raise ValueError(f"ensemble must be 'langevin', 'nve' or 'npt', got {job.ensemble!r}")
    if job.steps < 1 or job.interval < 1:
        raise ValueError("steps and interval must be >= 1")
    if job.velocities not in ("maxwell", "input"):
        raise ValueError(f"velocities must be 'maxwell' or 'input', got {job.velocities!r}")
    if job.replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {job.replicas}")
    frames = _read_structures(job.input)
    source, index = _split_index(job.input)
    if Path(job.output).exists() and Path(job.output).resolve() == Path(source).resolve():
        # the trajectory file is rewritten from its first frame: the frames read from it would be lost
        raise ValueError(f"output {job.output} is the input file; write the trajectory to another file")
    if index is None:
        frames = frames[:1]  # a file without an index: its first frame, as before several frames could run
    if len(frames) * job.replicas > 1:
        return _run_md_batched(job, frames)
    if job.freeze_force is not None:
        raise ValueError("freeze_force freezes one of several trajectories: give --replicas or several input frames")
    atoms = frames[0]
    # A run continued from a frame it wrote (its momenta kept) goes on with that frame's clock.
    t_start = float(atoms.info.get("time_fs", 0.0)) if job.velocities == "input" else 0.0
    for key in _MD_INFO:  # what a frame of an earlier run says about that run; this run writes its own
        atoms.info.pop(key, None)
    if job.velocities == "input" and not atoms.has("momenta"):
        raise ValueError(f"velocities 'input': the input frame of {job.input} has no momenta")
    atoms.calc = StudentCalculator(job.model, device=job.device, precision=job.precision)
    rng = np.random.default_rng(job.seed)
    if job.velocities == "maxwell":
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
    # The first forces (the model's load onto the device, its kernels and, on a GPU, the step's capture) are timed
    # apart from the steps: s_per_step is the MD loop's own pace, start-up is reported as startup_s.
    t0 = time.perf_counter()
    atoms.get_forces()
    startup = time.perf_counter() - t0
    traj = Path(job.output).suffix == ".traj"
    # extxyz (text) unless the name asks for ASE's binary trajectory (.traj, what `ase gui` and ase.io.read take
    # by that name); either way a frame is on disk when the next step starts.
    with open(job.output, "wb" if traj else "w") as handle:
        if traj:
            from ase.io.trajectory import TrajectoryWriter

            writer = TrajectoryWriter(handle, "w")

        def write() -> None:
            info = {"time_fs": t_start + dyn.get_time() / units.fs, "total_energy": float(atoms.get_total_energy())}
            if job.ensemble == "npt":
                info["volume"] = float(atoms.get_volume())
                info["density_g_cm3"] = density_g_cm3(atoms)
                info["pressure_gpa"] = -float(np.mean(atoms.get_stress()[:3])) / units.GPa  # virial part
            if traj:
                frame = atoms.copy()
                frame.calc = atoms.calc
                frame.info.update(info)
                writer.write(frame)  # positions, momenta, the calculator's results and the info
                handle.flush()
                return
            # ASE's writer costs ~0.3 ms a frame, as much as a GPU step of a small molecule; the same text from
            # format_md_frame costs a fifth. Flushed frame by frame: an interrupted run keeps what it wrote.
            text = format_md_frame(atoms, atoms.calc.results, info)
            if text is None:  # anything format_md_frame does not write exactly as ASE would
                frame = atoms.copy()
                frame.calc = atoms.calc
                frame.info.update(info)
                write_extxyz(handle, frame)
            else:
                handle.write(text)
            handle.flush()

        dyn.attach(write, interval=job.interval)
        t0 = time.perf_counter()
        dyn.run(job.steps)
        seconds = time.perf_counter() - t0
    if not np.isfinite(atoms.get_total_energy()):
        raise FloatingPointError("MD blew up: non-finite total energy")
    out = {
        "steps": job.steps,
        "seconds": seconds,
        "s_per_step": seconds / job.steps,
        "startup_s": startup,
        "precision": atoms.calc.engine.precision,
        "output": job.output,
    }
    if job.ensemble == "npt":
        out["final_density_g_cm3"] = density_g_cm3(atoms)
    verlet = getattr(getattr(atoms.calc, "engine", None), "verlet", None)
    if verlet is not None:  # how often the neighbour list was rebuilt (NPT: kept across small cell changes)
        out["list_builds"] = verlet.n_builds
    return out


def _run_md_batched(job: MDJob, frames: list) -> dict:
    """``md`` over several trajectories at once (:class:`~mlff_distiller.batched_md.BatchedMD`): every replica of
    every frame in one engine call per step; each written frame names its trajectory (info ``replica``)."""
    import numpy as np
    from ase.io.extxyz import write_extxyz

    from mlff_distiller._extxyz_fast import format_md_frame
    from mlff_distiller.batched_md import BatchedMD

    if job.ensemble == "npt":
        raise ValueError("ensemble 'npt' runs one structure: several frames or --replicas need langevin or nve")
    structures = []
    t_start = []
    for atoms in frames:
        if job.velocities == "input" and not atoms.has("momenta"):
            raise ValueError(f"velocities 'input': a frame of {job.input} has no momenta")
        t = float(atoms.info.get("time_fs", 0.0)) if job.velocities == "input" else 0.0
        for _ in range(job.replicas):
            structures.append(atoms)
            t_start.append(t)
    t0 = time.perf_counter()
    md = BatchedMD(
        job.model,
        structures,
        ensemble=job.ensemble,
        timestep_fs=job.timestep_fs,
        temperature_K=job.temperature,
        friction_per_fs=job.friction_per_fs,
        velocities=job.velocities,
        seed=job.seed,
        device=job.device,
        precision=job.precision,
        freeze_force=job.freeze_force,
    )
    md.potential_energies()  # the first forces: set-up, kernels and capture, timed apart from the steps
    startup = time.perf_counter() - t0
    Path(job.output).parent.mkdir(parents=True, exist_ok=True)
    traj = Path(job.output).suffix == ".traj"
    with open(job.output, "wb" if traj else "w") as handle:
        if traj:
            from ase.io.trajectory import TrajectoryWriter

            writer = TrajectoryWriter(handle, "w")

        def write(md: BatchedMD) -> None:
            kinetic = md.kinetic_energies()
            for k, atoms, results in md.states():
                # A frozen replica's flag as the frame's first info key (where ASE writes the template's own info):
                # the template itself then carries none, and the fast writer takes the frame.
                info = {"frozen": atoms.info.pop("frozen")} if "frozen" in atoms.info else {}
                info["time_fs"] = t_start[k] + md.time_fs
                if "energy" in results:  # none for a replica frozen by a non-finite force
                    info["total_energy"] = results["energy"] + float(kinetic[k])
                info["replica"] = k
                text = None if traj else format_md_frame(atoms, results, info)
                if text is not None:
                    handle.write(text)
                    continue
                from ase.calculators.singlepoint import SinglePointCalculator

                frame = atoms.copy()
                frame.calc = SinglePointCalculator(frame, **results)
                frame.info.update(info)
                if traj:
                    writer.write(frame)
                else:
                    write_extxyz(handle, frame)
            handle.flush()  # an interrupted run keeps every frame written so far

        t0 = time.perf_counter()
        md.run(job.steps, observer=write, interval=job.interval)
        seconds = time.perf_counter() - t0
    temperatures = md.temperatures()
    return {
        "steps": job.steps,
        "replicas": md.n_replicas,
        "seconds": seconds,
        "s_per_step": seconds / job.steps,
        "replica_steps_per_s": md.n_replicas * job.steps / seconds,
        "startup_s": startup,
        "precision": md.engine.precision,
        "output": job.output,
        "list_builds": md.engine.verlet.n_builds,
        "mean_temperature_K": float(np.mean(temperatures)),
        "frozen": md.frozen,
    }


def run_relax(job: RelaxJob) -> dict:
    from mlff_distiller.predict_stream import stderr_log
    from mlff_distiller.relax_stream import relax_file

    if not job.input:
        raise ValueError("--input is required")
    name, index = _file_and_selection(job.input)
    if not Path(name).exists():
        raise ValueError(f"input file not found: {name}")
    return relax_file(
        job.model,
        name,
        job.output,
        index=index,
        chunk=job.chunk,
        restart=job.restart,
        fmax=job.fmax,
        steps=job.steps,
        device=job.device,
        precision=job.precision,
        max_atoms="auto" if job.max_atoms is None else job.max_atoms,
        log=stderr_log,
    )


def run_check(job: CheckJob) -> dict:
    import numpy as np

    from mlff_distiller.committee import committee_disagreement

    frames = _read_structures(job.input)
    if len(job.models) == 1:
        return _run_domain_check(job, frames)
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


def _run_domain_check(job: CheckJob, frames) -> dict:
    """``check`` with one student: its stored training envelope (:mod:`mlff_distiller.domain`), not a committee."""
    from mlff_distiller.checkpoint import load_model
    from mlff_distiller.domain import DomainEnvelope

    name = job.models[0]
    envelope = DomainEnvelope.of_model(load_model(name))
    if envelope is None:
        raise ValueError(
            f"{name} stores no training envelope (students trained before envelopes were recorded, or fine-tuned "
            "from one without it, have none); give two or more students for the committee check instead"
        )
    rows = [{"index": k, "outside": found} for k, found in enumerate(envelope.check_many(frames))]
    flagged = [r["index"] for r in rows if r["outside"]]
    if job.output:
        Path(job.output).parent.mkdir(parents=True, exist_ok=True)
        Path(job.output).write_text(json.dumps(rows, indent=1))
    if flagged:
        verdict = (
            f"{len(flagged)} of {len(rows)} structures lie outside the training data's envelope (closer pairs or more "
            "neighbours than any training frame): the student extrapolates there. Label such structures with the "
            "teacher and fine-tune (mlff-distill label, then mlff-distill train --init-model)."
        )
    else:
        verdict = (
            f"all {len(rows)} structures lie inside the training data's envelope (pair distances and neighbour "
            "counts); geometry alone does not prove they are like the data."
        )
    return {
        "structures": len(rows),
        "models": [name],
        "envelope_frames": envelope.frames,
        "flagged": len(flagged),
        "flagged_indices": flagged[:1000],
        "examples": [r for r in rows if r["outside"]][:5],
        "verdict": verdict,
        "output": job.output,
    }


def run_models() -> list[dict]:
    """One entry per built-in student: what ``load_model("builtin:<name>")`` gives, from its checkpoint."""
    from mlff_distiller import DEFAULT_MODEL
    from mlff_distiller.checkpoint import builtin_models, load_model

    out = []
    for name in builtin_models():
        model = load_model(f"builtin:{name}")
        meta = model.metadata
        out.append(
            {
                "model": f"builtin:{name}",
                # the student the commands use when none is named (mlff_distiller.DEFAULT_MODEL)
                "default": f"builtin:{name}" == DEFAULT_MODEL,
                "hidden": model.config.hidden,
                "layers": model.config.layers,
                "parameters": sum(p.numel() for p in model.parameters()),
                "elements": model.species_list,
                "cutoff": model.cutoff,
                "teacher": meta.get("teacher"),
                "test_force_mae_mev_a": meta.get("test_force_mae_mev_a"),
                "test_energy_mae_mev_atom": meta.get("test_energy_mae_mev_atom"),
                # weights on the TF32 grid: two TF32 MMAs per weight product in fp32 on a GPU (stop 59)
                "tf32_grid": model.on_tf32_grid(),
                "description": meta.get("description"),
            }
        )
    return out


RUNNERS = {
    "check": run_check,
    "harvest": run_harvest,
    "label": run_label,
    "train": run_train,
    "evaluate": run_evaluate,
    "predict": run_predict,
    "md": run_md,
    "relax": run_relax,
}
