"""``mlff-distill``: label, train, evaluate, predict, run MD, relax, check (do the students agree?) and harvest (the
frames worth a teacher label) from the command line.

Every subcommand is described by a dataclass (``LabelJob``, ``TrainJob``, ...). Values come from, in
rising priority: the dataclass defaults, a YAML file (``--config``), ``--set dotted.key=value`` overrides
(the value is parsed as YAML) and the explicit flags. ``mlff-distill <command> --help`` lists the flags.
The dataclasses live in :mod:`mlff_distiller.cli_jobs` and are imported once a command runs: parsing the command
line, ``--help`` included, imports neither torch nor ASE (0.1 s instead of 4.9 s on the H100 host).
``from mlff_distiller.cli import TrainJob`` works as before.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from typing import TYPE_CHECKING

import yaml

from mlff_distiller import DEFAULT_MODEL
from mlff_distiller._committee_defaults import DEFAULT_COMMITTEE, DISAGREEMENT_THRESHOLD

__all__ = [
    "CheckJob",
    "EvaluateJob",
    "HarvestJob",
    "LabelJob",
    "MDJob",
    "PredictJob",
    "RelaxJob",
    "TrainJob",
    "main",
]

if TYPE_CHECKING:
    from mlff_distiller.cli_jobs import (
        CheckJob,
        EvaluateJob,
        HarvestJob,
        LabelJob,
        MDJob,
        PredictJob,
        RelaxJob,
        TrainJob,
    )

_JOB_NAMES = (frozenset(__all__) - {"main"}) | {"JOBS"}  # what __getattr__ serves from cli_jobs


def __getattr__(name: str):
    """The job dataclasses (and ``JOBS``), from :mod:`mlff_distiller.cli_jobs` on first use."""
    if name in _JOB_NAMES:
        return getattr(importlib.import_module("mlff_distiller.cli_jobs"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    from mlff_distiller.cli_jobs import JOBS
    from mlff_distiller.distill.config import from_dict, load_yaml

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
    p.add_argument(
        "--as-given",
        dest="as_given",
        action="store_const",
        const=True,
        help="label each seed structure as it is, nothing else (no MD, no rattles): e.g. the frames of "
        "mlff-distill harvest",
    )

    p = sub.add_parser("train", help="train a student on labelled frames")
    _add_common(p)
    p.add_argument(
        "--data",
        action="append",
        help="label directory, .db or extxyz with energies and forces; repeat it to train on several (e.g. the "
        "original labels and a fine-tuning round's)",
    )
    p.add_argument(
        "--data-weight",
        dest="data_weight",
        action="append",
        type=float,
        help="loss weight of each --data source, one per --data in order (default 1.0 each), e.g. 0.2 for a "
        "fine-tuning round's far-from-equilibrium frames; multiplies a frame's own info['config_weight']",
    )
    p.add_argument(
        "--val-data", dest="val_data", action="append", help="separate validation frames (else split from --data)"
    )
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
    p.add_argument("--model", help=f"checkpoint path or builtin:NAME (default: {DEFAULT_MODEL})")
    p.add_argument("--data", help="held-out labelled frames")
    p.add_argument("--out", help="output directory (metrics.json, parity.png)")
    p.add_argument("--device")
    p.add_argument("--teacher", help="teacher for the MD-step timing comparison")
    p.add_argument("--timing-steps", dest="timing_steps", type=int, help="MD steps timed (0: no timing)")
    p.add_argument("--nve-steps", dest="nve_steps", type=int, help="NVE steps for the drift check (0: none)")
    p.add_argument("--history", help="history.json of a training run, for a learning-curve PNG")
    p.add_argument(
        "--by",
        action="append",
        help="also the errors per group of frames sharing this info key (repeatable): kind, temperature, task, "
        "config_type, replica, ...; 'formula' groups by chemical formula",
    )

    p = sub.add_parser(
        "predict", help="energies/forces of a structures file, written as extxyz in chunks (an interrupted run resumes)"
    )
    _add_common(p)
    p.add_argument("--model", help=f"checkpoint path or builtin:NAME (default: {DEFAULT_MODEL})")
    p.add_argument("--input", help="structures file (any format ASE reads; file@INDEX selects frames)")
    p.add_argument("--output", help="output extxyz")
    p.add_argument("--device")
    p.add_argument("--precision", help="fp64 | fp32 | tf32 | bf16 | fp16")
    p.add_argument("--batch-size", dest="batch_size", type=int)
    p.add_argument(
        "--check-domain",
        dest="check_domain",
        action="store_const",
        const=True,
        help="check each structure against the training envelope stored with the student; frames outside carry "
        "'domain' in their info",
    )
    p.add_argument(
        "--stress", action="store_const", const=True, help="also the stress of fully periodic structures (eV/Å³)"
    )
    p.add_argument(
        "--chunk",
        type=int,
        help="structures read, computed and written at a time (default 10000); an interrupted run keeps every "
        "finished chunk, and the same command continues after them",
    )
    p.add_argument(
        "--restart", action="store_const", const=True, help="discard an unfinished run at OUTPUT instead of resuming it"
    )
    p.add_argument(
        "--workers",
        type=int,
        help="processes that read and write the extxyz text (default: up to 12 for extxyz inputs of 8 MB or more on "
        "4+ cores; 0: none)",
    )

    p = sub.add_parser("md", help="molecular dynamics with the student, trajectory as extxyz (or .traj)")
    _add_common(p)
    p.add_argument("--model", help=f"checkpoint path or builtin:NAME (default: {DEFAULT_MODEL})")
    p.add_argument(
        "--input",
        help="starting structure: the first frame of the file, or file@INDEX (file@-1: the last); several frames "
        "(file@0:100, file@:) run as independent trajectories in one batch",
    )
    p.add_argument(
        "--replicas",
        type=int,
        help="independent trajectories from each starting frame, run together in one batch (default 1); their "
        "frames share the output, each naming its trajectory (info 'replica')",
    )
    p.add_argument(
        "--freeze-force",
        dest="freeze_force",
        type=float,
        help="several trajectories: freeze one (it stops where it is, named in the summary and its frames' info "
        "'frozen') once an atom of it feels a force component above this, eV/Å, or a non-finite one; the others "
        "go on (default: a blow-up stops the run)",
    )
    p.add_argument("--output", help="trajectory: extxyz, or ASE's binary trajectory for a .traj name")
    p.add_argument(
        "--velocities", help="maxwell (drawn at --temperature; the default) | input (the input frame's momenta)"
    )
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
    p.add_argument("--friction-per-fs", dest="friction_per_fs", type=float, help="langevin: friction, 1/fs (0.01)")
    p.add_argument("--seed", type=int, help="random seed of the initial velocities and the Langevin forces (0)")
    p.add_argument("--interval", type=int, help="steps between written frames")
    p.add_argument("--device")
    p.add_argument("--precision", help="fp32 (default) | fp64 | tf32 | bf16 | fp16")

    p = sub.add_parser(
        "relax", help="relax every structure of a file (FIRE, fixed cell), in chunks (an interrupted run resumes)"
    )
    _add_common(p)
    p.add_argument("--model", help=f"checkpoint path or builtin:NAME (default: {DEFAULT_MODEL})")
    p.add_argument("--input", help="structures file (any format ASE reads; file@INDEX selects frames)")
    p.add_argument("--output", help="relaxed structures, extxyz (info relax_converged, relax_steps)")
    p.add_argument("--fmax", type=float, help="converged below this largest atomic force, eV/Å (0.05)")
    p.add_argument("--steps", type=int, help="at most this many FIRE steps per structure (1000)")
    p.add_argument(
        "--max-atoms",
        dest="max_atoms",
        type=int,
        help="at most this many atoms in the batch at once; finished structures make room for the next (default: "
        "on a GPU what half its free memory holds by the engine's estimate, else all at once)",
    )
    p.add_argument("--device")
    p.add_argument("--precision", help="fp32 (default) | fp64 (for fmax below ~1e-3) | tf32 | bf16 | fp16")
    p.add_argument(
        "--chunk",
        type=int,
        help="structures relaxed and written at a time (8192): an interrupted run keeps every finished chunk, and "
        "the same command continues after them",
    )
    p.add_argument(
        "--restart", action="store_const", const=True, help="discard an unfinished run at OUTPUT instead of resuming it"
    )

    p = sub.add_parser(
        "check", help="do the students agree on these structures? (flags structures outside their training data)"
    )
    _add_common(p)
    p.add_argument("--input", help="structures file (any format ASE reads)")
    p.add_argument(
        "--models",
        type=lambda text: [m.strip() for m in text.split(",") if m.strip()],
        help=f"two or more comma-separated students (default: {','.join(DEFAULT_COMMITTEE)}); one student: check the "
        "structures against the training envelope stored with it instead",
    )
    p.add_argument(
        "--threshold", type=float, help=f"meV/Å of force disagreement that flags (default {DISAGREEMENT_THRESHOLD:g})"
    )
    p.add_argument("--output", help="also write every structure's numbers here (JSON)")
    p.add_argument("--device")
    p.add_argument("--precision", help="fp64 | fp32 | tf32 | bf16 | fp16")

    p = sub.add_parser(
        "harvest",
        help="frames of a student's MD where each trajectory first went wrong (frozen; with --model also outside its "
        "training data), to label with --as-given and fine-tune on",
    )
    _add_common(p)
    p.add_argument("--input", help="trajectory file of mlff-distill md (several replicas: info 'replica', 'frozen')")
    p.add_argument("--output", help="picked frames, extxyz (info 'harvest': frozen | outside | before)")
    p.add_argument("--before", type=int, help="frames of the same trajectory written before the first bad one (4)")
    p.add_argument("--model", help="also pick the first frame outside this student's training envelope")
    p.add_argument(
        "--committee",
        type=lambda text: [m.strip() for m in text.split(",") if m.strip()],
        help="two or more comma-separated students: also pick the first frame where their forces differ by more "
        f"than --threshold (e.g. {','.join(DEFAULT_COMMITTEE)})",
    )
    p.add_argument(
        "--threshold", type=float, help=f"meV/Å of force disagreement that picks (default {DISAGREEMENT_THRESHOLD:g})"
    )
    p.add_argument("--device", help="where the committee's students run (default: the GPU when there is one)")

    sub.add_parser("models", help="the built-in students (builtin:NAME): size, elements and measured accuracy")
    return parser


# The CUDA caching allocator's setting for the command's processes when the user set none: expandable segments. On an
# H200 (stop 50, benchmarks/results/stop50_gpu/): a 200,001-atom water box's reserved peak 13.6 -> 10.8 GB (what
# decides whether a step fits; 10.5 GB allocated either way), the captured small steps and the eager 24,000-atom step
# unchanged (0.173 / 0.270 / 1.164 ms and 14.17 / 14.18 ms), the capture and mode tests passing with it.
ALLOCATOR_DEFAULT = "expandable_segments:True"


def allocator_default() -> None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` to :data:`ALLOCATOR_DEFAULT` unless the user set it (or torch's newer
    ``PYTORCH_ALLOC_CONF``). Read when CUDA first allocates, so it applies where the command is the first to use the
    GPU (its own process)."""
    import os

    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_DEFAULT


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mlff-distill``; returns the exit status (2 for bad input)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    allocator_default()
    from mlff_distiller.cli_commands import RUNNERS, run_models

    try:
        if args.command == "models":
            result = run_models()
        else:
            job = build_job(args.command, args)
            result = RUNNERS[args.command](job)
    except (ValueError, FileNotFoundError) as exc:
        print(f"mlff-distill {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if not type(exc).__module__.startswith("ase.io"):
            raise  # a bug: its traceback
        # ASE's readers: XYZError, UnknownFileTypeError (an empty file, an unknown extension), ...
        print(f"mlff-distill {args.command}: error: cannot read the input: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mlff-distill {args.command}: interrupted", file=sys.stderr)
        return 130
    print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
