"""The job dataclasses of ``mlff-distill``'s subcommands (``LabelJob``, ``TrainJob``, ...), one per subcommand.

:mod:`mlff_distiller.cli` parses the command line (without importing this module, so that ``--help`` does not wait
for torch) and builds the job from the dataclass defaults, a YAML file, ``--set`` overrides and the explicit flags;
:mod:`mlff_distiller.cli_commands` runs it. ``from mlff_distiller.cli import TrainJob`` keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlff_distiller import DEFAULT_MODEL
from mlff_distiller._committee_defaults import DEFAULT_COMMITTEE, DISAGREEMENT_THRESHOLD
from mlff_distiller.distill.sampling import SamplingConfig
from mlff_distiller.distill.training import TrainConfig

__all__ = [
    "JOBS",
    "CheckJob",
    "EvaluateJob",
    "HarvestJob",
    "LabelJob",
    "MDJob",
    "PredictJob",
    "RelaxJob",
    "TrainJob",
]


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
    # Label the seed structures as they are and nothing else (sampling.label_seeds, no MD, no rattles): frames
    # picked by `mlff-distill harvest` or by hand.
    as_given: bool = False


@dataclass(kw_only=True)
class TrainJob:
    """``train``: fit a student to labelled frames; writes ``out/best.pt`` and optionally ``export``."""

    data: str | list[str] = "labels"  # one source or several (`--data A --data B`), read in order
    # The loss weight of each `data` source, in order (`--data-weight`; None: all 1.0); it multiplies each frame's own
    # info["config_weight"].
    data_weight: float | list[float] | None = None
    val_data: str | list[str] | None = None
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

    model: str = DEFAULT_MODEL
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
    # Errors also per group of frames sharing info[KEY] (`--by kind`, `--by temperature`, `--by formula`, ...).
    by: str | list[str] | None = None


@dataclass(kw_only=True)
class PredictJob:
    """``predict``: energies and forces of every structure in ``input``, written as extxyz to ``output`` chunk by
    chunk; an interrupted run continues where it stopped (:mod:`mlff_distiller.predict_stream`)."""

    model: str = DEFAULT_MODEL
    input: str = ""
    output: str = "predictions.extxyz"
    device: str | None = None
    precision: str = "fp32"
    batch_size: int | None = None
    check_domain: bool = False
    stress: bool = False
    chunk: int = 10_000
    restart: bool = False
    workers: int | None = None


@dataclass(kw_only=True)
class MDJob:
    """``md``: ASE molecular dynamics with the student; trajectory written as extxyz."""

    model: str = DEFAULT_MODEL
    input: str = ""
    output: str = "md.extxyz"
    ensemble: str = "langevin"
    steps: int = 1000
    timestep_fs: float = 0.5
    temperature: float = 300.0
    friction_per_fs: float = 0.01
    interval: int = 10
    device: str | None = None
    # fp32, as the calculator and predict: fp64 made each step 1.8-2.6x slower on an H100 (benzene to 3,000 atoms)
    # and kept the energy no better (benchmarks/results/probe_md_precision_h100.md).
    precision: str = "fp32"
    seed: int = 0
    # "maxwell": momenta drawn at `temperature` (seeded); "input": the input frame's own momenta (continue a run
    # from a frame it wrote, e.g. --input md.extxyz@-1).
    velocities: str = "maxwell"
    # Copies of each starting frame, run as independent trajectories together (BatchedMD: one engine call per step
    # for all of them). Several frames (--input file@0:10) also run together; each frame of the output names its
    # trajectory (info "replica").
    replicas: int = 1
    # Several trajectories: freeze one once an atom of it feels a force component above this (eV/Å) or a non-finite
    # one (BatchedMD's freeze_force): it stops where it was and the others go on. None: a blow-up stops the run.
    freeze_force: float | None = None
    # npt (ASE's NPTBerendsen, isotropic; a fully periodic input): target pressure, the material's isothermal
    # compressibility (default: water at 300 K) and the thermostat / barostat time constants.
    pressure_bar: float = 1.01325
    compressibility_per_bar: float = 4.57e-5
    taut_fs: float = 100.0
    taup_fs: float = 1000.0


@dataclass(kw_only=True)
class RelaxJob:
    """``relax``: every structure of ``input`` relaxed (FIRE, fixed cell), written as extxyz with its convergence,
    chunk by chunk; an interrupted run continues where it stopped (:mod:`mlff_distiller.relax_stream`)."""

    model: str = DEFAULT_MODEL
    input: str = ""
    output: str = "relaxed.extxyz"
    fmax: float = 0.05
    steps: int = 1000
    # At most this many atoms in the batch at once (relax_batch's max_atoms): finished structures make room for the
    # next. None: relax_batch's "auto" (on CUDA the engine's memory plan; elsewhere all at once).
    max_atoms: int | None = None
    device: str | None = None
    precision: str = "fp32"
    chunk: int = 8192  # relax_stream.CHUNK
    restart: bool = False


@dataclass(kw_only=True)
class CheckJob:
    """``check``: do two or more students agree on these structures? Flags those outside their training data. With
    one student, the structures are checked against its stored training envelope (:mod:`mlff_distiller.domain`)."""

    input: str = ""
    models: list[str] = field(default_factory=lambda: list(DEFAULT_COMMITTEE))
    threshold: float = DISAGREEMENT_THRESHOLD
    output: str | None = None
    device: str | None = None
    precision: str = "fp32"


@dataclass(kw_only=True)
class HarvestJob:
    """``harvest``: the frames of a student's MD where each trajectory first went wrong (frozen; with ``model``
    outside that student's training envelope; with ``committee`` where the students disagree), and ``before`` frames
    before it, written for ``label --as-given`` (:mod:`mlff_distiller.harvest`)."""

    input: str = ""
    output: str = "harvest.extxyz"
    before: int = 4
    model: str | None = None
    # Two or more students: also pick the first frame where their forces differ by more than `threshold` (meV/Å).
    committee: list[str] | None = None
    threshold: float = DISAGREEMENT_THRESHOLD
    device: str | None = None


JOBS = {
    "label": LabelJob,
    "train": TrainJob,
    "evaluate": EvaluateJob,
    "predict": PredictJob,
    "md": MDJob,
    "relax": RelaxJob,
    "check": CheckJob,
    "harvest": HarvestJob,
}
