"""Sampling: where the teacher is asked for labels.

A labelling run is a deterministic list of :class:`Task` s; each task yields numbered frames:

* ``md``: a Langevin trajectory driven by the teacher at one temperature, started from a seed structure with
  Maxwell–Boltzmann velocities; every ``sample_every`` steps the current geometry and the teacher's energy and
  forces (already computed by the integrator) become one frame.
* ``rattle``: the seed with Gaussian displacements (σ = ``rattle_std`` Å), labelled by the teacher.
* ``onpolicy``: a Langevin trajectory driven by the *student*; the teacher relabels the visited geometries, so
  the student learns where it actually goes wrong.
* ``given``: the seed structure itself, labelled by the teacher as it is (``label_seeds``): frames picked elsewhere,
  e.g. by ``mlff-distill harvest`` from the replicas that a student's MD froze or drove out of its data.

Every task owns a random generator seeded from ``(config.seed, task key)``, so re-running a task reproduces
the same frames bit for bit: that is what makes labelling resumable (see :mod:`.labelling`).

Near-duplicate frames are dropped with :class:`Deduplicator`: two frames of the same atoms (same atomic
numbers in the same order) are duplicates when the RMS difference of their interatomic-distance matrices is
below ``dedup_rms`` Å (rotation-, translation-invariant; cheap for molecules).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from ase import Atoms, units
from ase.calculators.calculator import Calculator
from ase.calculators.singlepoint import SinglePointCalculator

from mlff_distiller.ase_compat import maxwell_boltzmann
from mlff_distiller.distill.dataset import periodic_stress

__all__ = ["Deduplicator", "SamplingConfig", "Task", "make_tasks", "run_task"]

# A frame whose closest pair is nearer than this (Å) is unphysical (a collapsed on-policy trajectory).
MIN_PAIR_DISTANCE = 0.5


@dataclass(kw_only=True)
class SamplingConfig:
    """How frames are sampled.

    Attributes:
        temperatures: Langevin temperatures, K.
        md_steps: integration steps per trajectory.
        sample_every: steps between two recorded frames.
        timestep_fs: integration time step, fs.
        friction_per_fs: Langevin friction, 1/fs.
        replicas: independent trajectories per (seed, temperature).
        rattle_per_seed: rattled copies of each seed structure.
        rattle_std: Gaussian displacement σ of a rattle, Å.
        rattle_strain: σ of a random symmetric strain applied to the cell (atoms scaled with it) before a rattle
            of a fully periodic seed; 0 keeps the seed's cell. Strained cells give the stress labels that an NPT
            student needs (``stress_weight``); fixed-cell MD samples them little.
        dedup_rms: near-duplicate threshold, Å (RMS difference of distance matrices; 0 keeps everything).
        max_force: frames with any teacher force component above this (eV/Å) are dropped and end their
            trajectory (the system has left the region worth learning).
        hvp: also label a Hessian-vector product per frame by central finite differences of teacher forces.
        hvp_eps: finite-difference step along the unit direction, Å.
        seed: base random seed.
        label_seeds: also label each seed structure as it is (one ``given`` task per seed, before its MD and
            rattles). With ``md_steps=0`` and ``rattle_per_seed=0`` (``mlff-distill label --as-given``) a run labels
            exactly the structures it is given, each dropped if the teacher finds it unphysical (``max_force``).
        select_disagreement: on-policy rounds with a committee student (``label(..., committee=...)``): label only
            the visited frames where the driving student's and the committee's forces differ by more than this
            (mean absolute, meV/Å; see :mod:`mlff_distiller.committee`), so the teacher is called where the
            students are unsure. 0 labels every visited frame.
    """

    temperatures: list[float] = field(default_factory=lambda: [300.0, 600.0])
    md_steps: int = 200
    sample_every: int = 10
    timestep_fs: float = 0.5
    friction_per_fs: float = 0.01
    replicas: int = 1
    rattle_per_seed: int = 0
    rattle_std: float = 0.05
    rattle_strain: float = 0.0
    dedup_rms: float = 0.0
    max_force: float = 50.0
    hvp: bool = False
    hvp_eps: float = 0.005
    seed: int = 0
    label_seeds: bool = False
    select_disagreement: float = 0.0

    def __post_init__(self) -> None:
        self.temperatures = [float(t) for t in self.temperatures]
        if any(not t > 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be > 0 K, got {self.temperatures}")
        for name in ("md_steps", "replicas", "rattle_per_seed"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if int(self.sample_every) < 1:
            raise ValueError(f"sample_every must be >= 1, got {self.sample_every}")
        for name in ("timestep_fs", "friction_per_fs", "rattle_std", "max_force", "hvp_eps"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if float(self.dedup_rms) < 0:
            raise ValueError(f"dedup_rms must be >= 0 Å, got {self.dedup_rms}")
        if not 0 <= float(self.rattle_strain) < 0.5:
            raise ValueError(f"rattle_strain must be in [0, 0.5), got {self.rattle_strain}")
        if float(self.select_disagreement) < 0:
            raise ValueError(f"select_disagreement must be >= 0 meV/Å, got {self.select_disagreement}")


@dataclass(frozen=True)
class Task:
    """One unit of labelling work; ``key`` is unique and stable across runs."""

    key: str
    kind: str  # "md" | "rattle" | "onpolicy" | "given"
    seed_index: int
    temperature: float = 0.0
    replica: int = 0


def make_tasks(seeds: Sequence[Atoms], config: SamplingConfig, *, on_policy_round: int | None = None) -> list[Task]:
    """The ordered task list for ``seeds``. With ``on_policy_round`` the MD tasks are student-driven."""
    if not seeds:
        raise ValueError("sampling needs at least one seed structure")
    tasks: list[Task] = []
    for s in range(len(seeds)):
        if config.label_seeds and on_policy_round is None:
            tasks.append(Task(f"given/s{s:04d}", "given", s))
        for t in config.temperatures:
            for r in range(int(config.replicas)):
                if int(config.md_steps) < int(config.sample_every):
                    continue
                if on_policy_round is None:
                    tasks.append(Task(f"md/s{s:04d}/T{t:g}/r{r}", "md", s, t, r))
                else:
                    tasks.append(Task(f"onpolicy{on_policy_round}/s{s:04d}/T{t:g}/r{r}", "onpolicy", s, t, r))
        if on_policy_round is None:
            for r in range(int(config.rattle_per_seed)):
                tasks.append(Task(f"rattle/s{s:04d}/r{r}", "rattle", s, 0.0, r))
    return tasks


def task_rng(config: SamplingConfig, key: str) -> np.random.Generator:
    """A generator that depends only on the base seed and the task key (stable across processes)."""
    digest = hashlib.sha256(f"{int(config.seed)}:{key}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _labelled(atoms: Atoms, energy: float, forces: np.ndarray, stress: np.ndarray | None = None) -> Atoms:
    out = Atoms(numbers=atoms.numbers, positions=atoms.positions, cell=atoms.cell, pbc=atoms.pbc)
    results = {"energy": float(energy), "forces": np.array(forces, dtype=np.float64)}
    if stress is not None:
        results["stress"] = stress
    out.calc = SinglePointCalculator(out, **results)
    return out


def _computed_stress(atoms: Atoms, calc: Calculator) -> np.ndarray | None:
    """The stress (Voigt, eV/Å³) the teacher's last calculation of ``atoms`` produced along with the forces, for
    a fully periodic frame; None otherwise. Never a calculation of its own: a teacher that computes stress only
    on request (rarely: SevenNet, GFN2-xTB through tblite and EMT return it with the forces) leaves it out."""
    return periodic_stress(atoms, getattr(calc, "results", None) or {})


def _teacher_label(atoms: Atoms, teacher: Calculator) -> tuple[float, np.ndarray, np.ndarray | None]:
    work = Atoms(numbers=atoms.numbers, positions=atoms.positions, cell=atoms.cell, pbc=atoms.pbc)
    work.calc = teacher
    energy, forces = float(work.get_potential_energy()), np.array(work.get_forces(), dtype=np.float64)
    return energy, forces, _computed_stress(work, teacher)


def _physical(atoms: Atoms, forces: np.ndarray, energy: float, config: SamplingConfig) -> bool:
    if not (np.isfinite(energy) and np.isfinite(forces).all()):
        return False
    if np.abs(forces).max() > config.max_force:
        return False
    if len(atoms) > 1 and not atoms.pbc.any():
        d = atoms.get_all_distances()
        if d[np.triu_indices(len(atoms), 1)].min() < MIN_PAIR_DISTANCE:
            return False
    return True


def _add_hvp(frame: Atoms, teacher: Calculator, config: SamplingConfig, rng: np.random.Generator) -> None:
    """Attach a teacher Hessian-vector product: H·v ≈ −(F(x + εv) − F(x − εv)) / 2ε, v a unit [N,3] vector."""
    v = rng.standard_normal(frame.positions.shape)
    v /= np.linalg.norm(v)
    eps = float(config.hvp_eps)
    forces = []
    for sign in (1.0, -1.0):
        moved = frame.copy()
        moved.positions = frame.positions + sign * eps * v
        forces.append(_teacher_label(moved, teacher)[1])
    frame.arrays["hvp_dir"] = v
    frame.arrays["hvp"] = -(forces[0] - forces[1]) / (2 * eps)


def _frame(atoms, energy, forces, stress, teacher, config, hvp_rng) -> Atoms | None:
    """The labelled frame of ``atoms`` (with its H·v when ``config.hvp``), or None when it is unphysical."""
    if not _physical(atoms, forces, energy, config):
        return None
    frame = _labelled(atoms, energy, forces, stress)
    if config.hvp:
        _add_hvp(frame, teacher, config, hvp_rng)
    return frame


def run_task(
    task: Task,
    seed: Atoms,
    teacher: Calculator,
    config: SamplingConfig,
    *,
    student: Calculator | None = None,
    committee: Calculator | None = None,
    stats: dict | None = None,
) -> Iterator[tuple[int, Atoms]]:
    """Yield ``(frame_index, labelled_atoms)`` for one task, deterministically.

    On-policy tasks with ``config.select_disagreement > 0`` skip, without a teacher call, the visited frames where
    ``student`` and ``committee`` agree within it (counted in ``stats["not_selected"]``); the trajectory itself
    does not change.

    The atoms carry teacher ``energy`` (eV) and ``forces`` (eV/Å) on a ``SinglePointCalculator``, ``stress``
    (Voigt, eV/Å³) too for periodic frames whose teacher computed it with the forces, and, with ``config.hvp``,
    arrays ``hvp_dir`` (unit direction) and ``hvp`` (eV/Å², H·v).
    """
    # ASE's MD and constraints here, not at the top: they import SciPy (~0.5 s), which the command line's parser
    # and the prediction commands, importing SamplingConfig, do not need.
    from ase.constraints import FixCom
    from ase.md.langevin import Langevin
    from ase.md.velocitydistribution import Stationary, ZeroRotation

    rng = task_rng(config, task.key)
    hvp_rng = task_rng(config, task.key + "/hvp")
    if task.kind == "given":
        from ase.calculators.calculator import CalculationFailed

        try:
            energy, forces, stress = _teacher_label(seed, teacher)
        except CalculationFailed:  # a picked geometry the teacher cannot do (tblite: no SCF convergence): skip it
            if stats is not None:
                stats["failed"] = stats.get("failed", 0) + 1
            return
        frame = _frame(seed, energy, forces, stress, teacher, config, hvp_rng)
        if frame is not None:
            yield 0, frame
        return
    if task.kind == "rattle":
        atoms = seed.copy()
        if config.rattle_strain > 0 and seed.pbc.all():
            # Drawn before the displacements, and only when asked: rattles without strain keep their old frames.
            eps = rng.normal(0.0, float(config.rattle_strain), (3, 3))
            atoms.set_cell(seed.cell.array @ (np.eye(3) + 0.5 * (eps + eps.T)), scale_atoms=True)
        atoms.positions = atoms.positions + rng.normal(0.0, float(config.rattle_std), seed.positions.shape)
        frame = _frame(atoms, *_teacher_label(atoms, teacher), teacher, config, hvp_rng)
        if frame is not None:
            yield 0, frame
        return
    if task.kind not in ("md", "onpolicy"):
        raise ValueError(f"unknown task kind {task.kind!r}")
    if task.kind == "onpolicy" and student is None:
        raise ValueError(f"task {task.key} is on-policy and needs a student calculator")
    select = task.kind == "onpolicy" and float(config.select_disagreement) > 0
    if select and committee is None:
        raise ValueError("select_disagreement needs a committee student (label(..., committee=...))")
    atoms = Atoms(numbers=seed.numbers, positions=seed.positions, cell=seed.cell, pbc=seed.pbc)
    atoms.calc = teacher if task.kind == "md" else student
    if not atoms.pbc.any():
        # Langevin's fixcm flag is deprecated (ASE >= 3.28); a FixCom constraint keeps a molecule in place.
        atoms.set_constraint(FixCom())
    maxwell_boltzmann(atoms, task.temperature, rng=rng)
    if not atoms.pbc.any():
        Stationary(atoms)
        # ZeroRotation divides by principal moments, one of which is 0 for a linear molecule (it then
        # selects 0 for that axis; the division only warns).
        with np.errstate(invalid="ignore", divide="ignore"):
            ZeroRotation(atoms)
    dyn = Langevin(
        atoms,
        timestep=float(config.timestep_fs) * units.fs,
        temperature_K=task.temperature,
        friction=float(config.friction_per_fs) / units.fs,
        rng=rng,
        fixcm=False,
    )
    n_frames = int(config.md_steps) // int(config.sample_every)
    for k in range(n_frames):
        dyn.run(int(config.sample_every))
        if task.kind == "md":
            # The integrator has just evaluated the teacher at these positions: reuse its results.
            energy = float(atoms.get_potential_energy())
            forces = np.array(atoms.get_forces(apply_constraint=False), dtype=np.float64)
            stress = _computed_stress(atoms, teacher)
        else:
            if select and _disagreement(atoms, committee) <= float(config.select_disagreement):
                if stats is not None:
                    stats["not_selected"] = stats.get("not_selected", 0) + 1
                continue
            energy, forces, stress = _teacher_label(atoms, teacher)
        frame = _frame(atoms, energy, forces, stress, teacher, config, hvp_rng)
        if frame is None:  # the trajectory has left the region worth learning
            return
        yield k, frame


def _disagreement(atoms: Atoms, committee: Calculator) -> float:
    """The force disagreement (meV/Å, :mod:`mlff_distiller.committee`'s measure) of the driving student at ``atoms``
    (its calculator has just computed them) and the committee student."""
    from mlff_distiller.committee import _spread

    mine = np.asarray(atoms.get_forces(apply_constraint=False), dtype=np.float64)
    other = atoms.copy()
    other.calc = committee
    forces = [mine, np.asarray(other.get_forces(apply_constraint=False))]
    return _spread(forces, [0.0, 0.0])["force_disagreement_mev_a"]


class Deduplicator:
    """Remembers kept frames and reports near-duplicates (same atom order, RMS distance-matrix difference)."""

    def __init__(self, threshold: float) -> None:
        if float(threshold) < 0:
            raise ValueError(f"dedup threshold must be >= 0 Å, got {threshold}")
        self.threshold = float(threshold)
        self._kept: dict[tuple, list[np.ndarray]] = {}

    @staticmethod
    def _descriptor(atoms: Atoms) -> tuple[tuple, np.ndarray]:
        n = len(atoms)
        d = atoms.get_all_distances(mic=bool(atoms.pbc.any()))
        return tuple(atoms.numbers.tolist()), d[np.triu_indices(n, 1)]

    def is_duplicate(self, atoms: Atoms) -> bool:
        if self.threshold == 0 or len(atoms) < 2:
            return False
        key, desc = self._descriptor(atoms)
        kept = self._kept.get(key)
        if not kept:
            return False
        rms = np.sqrt(((np.stack(kept) - desc) ** 2).mean(axis=1))
        return bool(rms.min() < self.threshold)

    def add(self, atoms: Atoms) -> None:
        if self.threshold == 0 or len(atoms) < 2:
            return
        key, desc = self._descriptor(atoms)
        self._kept.setdefault(key, []).append(desc)
