"""Evaluation of a student against its teacher.

* :func:`error_metrics` (and :func:`predict_frames`, :func:`grouped_error_metrics`, from :mod:`.metrics`): the
  student's errors against the teacher's labels.
* :func:`parity_plot`, :func:`learning_curve_plot`: PNG figures.
* :func:`md_step_timing`: seconds per ASE MD step, student and teacher, on the same structure in the same run.
* :func:`nve_drift`: total-energy drift of a velocity-Verlet run with the student.
* :func:`npt_run`: an isotropic Berendsen NPT run with any calculator: density trace and seconds per step.
* :func:`pressure_curve`: pressure against density of isotropically scaled frames for several calculators (the
  equation of state an NPT run follows; its zero-pressure density and bulk modulus).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from ase import Atoms, units
from ase.calculators.calculator import Calculator
from ase.md.velocitydistribution import Stationary, ZeroRotation
from ase.md.verlet import VelocityVerlet

from mlff_distiller.ase_compat import maxwell_boltzmann
from mlff_distiller.calculator import StudentCalculator
from mlff_distiller.distill.metrics import error_metrics, grouped_error_metrics, predict_frames
from mlff_distiller.model import StudentModel

__all__ = [
    "error_metrics",
    "grouped_error_metrics",
    "learning_curve_plot",
    "md_step_timing",
    "npt_berendsen",
    "npt_run",
    "nve_drift",
    "parity_plot",
    "predict_frames",
    "pressure_curve",
]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    return plt


def parity_plot(metrics: dict, path: str | Path, title: str = "student vs teacher") -> Path:
    """Energy (eV/atom) and force (eV/Å) parity plots from :func:`error_metrics` output, as a PNG."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
    for ax, key, unit, mae, scale in (
        (axes[0], "_energy", "eV/atom", metrics["energy_mae_mev_atom"], "meV/atom"),
        (axes[1], "_forces", "eV/Å", metrics["force_mae_mev_a"], "meV/Å"),
    ):
        data = metrics[key]
        ax.scatter(data[:, 0], data[:, 1], s=3, alpha=0.4)
        lo, hi = float(data.min()), float(data.max())
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_xlabel(f"teacher ({unit})")
        ax.set_ylabel(f"student ({unit})")
        ax.set_title(f"{'energy' if key == '_energy' else 'forces'}: MAE {mae:.2f} {scale}")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def learning_curve_plot(history: Sequence[dict], path: str | Path) -> Path:
    """Validation force MAE (meV/Å) and energy MAE (meV/atom) against training step, log scale, as a PNG."""
    if not history:
        raise ValueError("empty training history")
    plt = _pyplot()
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [h["val_force_mae_mev_a"] for h in history], label="val force MAE (meV/Å)")
    ax.plot(steps, [h["val_energy_mae_mev_atom"] for h in history], label="val energy MAE (meV/atom)")
    ax.set_yscale("log")
    ax.set_xlabel("optimiser step")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _init_velocities(atoms: Atoms, temperature: float, seed: int) -> None:
    maxwell_boltzmann(atoms, temperature, rng=np.random.default_rng(seed))
    if not atoms.pbc.any():
        Stationary(atoms)
        ZeroRotation(atoms)


def _stamp(stamps: list[float]) -> None:
    stamps.append(time.perf_counter())


def md_step_timing(
    atoms: Atoms,
    student: Calculator,
    teacher: Calculator,
    *,
    steps: int = 50,
    warmup: int = 5,
    timestep_fs: float = 0.5,
    temperature: float = 300.0,
) -> dict:
    """Seconds per velocity-Verlet step of the student and the teacher on copies of ``atoms``.

    Each step is timed on its own (the student's results reach the host every step, so a step ends when its
    work does). Returns ``student_s_per_step`` and ``teacher_s_per_step`` (medians: the steady cost of long
    MD), ``speedup`` (teacher / student, of the medians), ``*_mean_s_per_step`` and ``*_max_s_per_step`` (a
    mean above the median shows one-off costs inside the timed steps, e.g. a CUDA-graph capture for a new
    bucket after a neighbour-list rebuild), and ``atoms``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    out = {"atoms": len(atoms), "steps": steps}
    for name, calc in (("student", student), ("teacher", teacher)):
        work = atoms.copy()
        work.calc = calc
        _init_velocities(work, temperature, seed=0)
        dyn = VelocityVerlet(work, timestep=timestep_fs * units.fs)
        dyn.run(warmup)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        stamps = [time.perf_counter()]
        dyn.attach(_stamp, 1, stamps)
        dyn.run(steps)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        per_step = np.diff(stamps[-(steps + 1) :])
        out[f"{name}_s_per_step"] = float(np.median(per_step))
        out[f"{name}_mean_s_per_step"] = float(per_step.mean())
        out[f"{name}_max_s_per_step"] = float(per_step.max())
    out["speedup"] = out["teacher_s_per_step"] / out["student_s_per_step"]
    return out


def nve_drift(
    atoms: Atoms,
    model: StudentModel | StudentCalculator,
    *,
    steps: int = 2000,
    timestep_fs: float = 0.25,
    temperature: float = 300.0,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> dict:
    """Velocity-Verlet NVE run with the student in float64; total-energy drift.

    Returns ``drift_mev_atom_per_ps`` (slope of a linear fit of E_total per atom), ``max_abs_dev_mev_atom``
    (largest deviation from the initial total energy), ``simulated_ps`` and ``steps``. Raises
    ``FloatingPointError`` if the run blows up to a non-finite energy.
    """
    calc = model if isinstance(model, StudentCalculator) else StudentCalculator(model, device=device, precision="fp64")
    work = atoms.copy()
    work.calc = calc
    _init_velocities(work, temperature, seed)
    dyn = VelocityVerlet(work, timestep=timestep_fs * units.fs)
    n = len(work)
    energies, times = [], []

    def record() -> None:
        energies.append(work.get_total_energy() / n)
        times.append(dyn.get_time() / (1000 * units.fs))

    dyn.attach(record, interval=max(1, steps // 200))
    record()
    dyn.run(steps)
    e = np.array(energies)
    t = np.array(times)
    if not np.isfinite(e).all():
        raise FloatingPointError("the student's NVE run produced a non-finite total energy (unstable model)")
    return {
        "drift_mev_atom_per_ps": 1000 * float(np.polyfit(t, e, 1)[0]),
        "max_abs_dev_mev_atom": 1000 * float(np.abs(e - e[0]).max()),
        "simulated_ps": steps * timestep_fs / 1000,
        "steps": steps,
    }


def density_g_cm3(atoms: Atoms) -> float:
    """Mass density of a periodic ``atoms``, g/cm³ (ASE's amu is in kg: 1 amu/Å³ = 1.66054 g/cm³)."""
    return float(atoms.get_masses().sum() / atoms.get_volume() * units._amu * 1e27)


def npt_berendsen(
    atoms: Atoms,
    *,
    timestep_fs: float = 0.5,
    temperature: float = 300.0,
    pressure_bar: float = 1.0,
    compressibility_per_bar: float = 4.57e-5,
    taut_fs: float = 100.0,
    taup_fs: float = 500.0,
):
    """ASE's isotropic ``NPTBerendsen`` on ``atoms`` in lab units (fs, K, bar, 1/bar; the defaults are liquid water
    at 300 K and 1 bar): the one place that converts them, for :func:`npt_run`, the CLI and the benchmarks."""
    from ase.md.nptberendsen import NPTBerendsen

    return NPTBerendsen(
        atoms,
        timestep=timestep_fs * units.fs,
        temperature_K=temperature,
        pressure_au=pressure_bar * units.bar,
        compressibility_au=compressibility_per_bar / units.bar,
        taut=taut_fs * units.fs,
        taup=taup_fs * units.fs,
    )


def npt_run(
    atoms: Atoms,
    calc: Calculator,
    *,
    steps: int,
    timestep_fs: float = 0.5,
    temperature: float = 300.0,
    pressure_bar: float = 1.0,
    compressibility_per_bar: float = 4.57e-5,
    taut_fs: float = 100.0,
    taup_fs: float = 500.0,
    record_every: int = 10,
    seed: int = 0,
) -> dict:
    """ASE's isotropic ``NPTBerendsen`` on a copy of a fully periodic ``atoms`` with ``calc`` (the same start and
    velocities for every calculator given the same ``seed``), so a student and its teacher can be run side by side.

    Returns ``density_g_cm3`` (every ``record_every`` steps, the start included), ``mean_density_second_half``,
    ``final_density``, ``s_per_step`` (median of the per-step wall clock), ``mean_s_per_step``, ``steps`` and
    ``simulated_ps``. Raises ``FloatingPointError`` when the run reaches a non-finite energy or volume.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not atoms.pbc.all():
        raise ValueError("npt_run needs a fully periodic structure")
    work = atoms.copy()
    work.calc = calc
    _init_velocities(work, temperature, seed)
    dyn = npt_berendsen(
        work,
        timestep_fs=timestep_fs,
        temperature=temperature,
        pressure_bar=pressure_bar,
        compressibility_per_bar=compressibility_per_bar,
        taut_fs=taut_fs,
        taup_fs=taup_fs,
    )
    # Keyed by step: ASE versions differ on whether observers also run before the first step.
    density = {0: density_g_cm3(work)}
    stamps = {0: time.perf_counter()}
    dyn.attach(lambda: stamps.__setitem__(dyn.nsteps, time.perf_counter()), interval=1)
    dyn.attach(lambda: density.__setitem__(dyn.nsteps, density_g_cm3(work)), interval=record_every)
    dyn.run(steps)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    density = [density[k] for k in sorted(density)]
    if not (np.isfinite(density).all() and np.isfinite(work.get_potential_energy())):
        raise FloatingPointError("the NPT run produced a non-finite volume or energy")
    per_step = np.diff([stamps[k] for k in sorted(stamps)])
    half = np.asarray(density[len(density) // 2 :])
    return {
        "density_g_cm3": [float(x) for x in density],
        "mean_density_second_half": float(half.mean()),
        "final_density": float(density[-1]),
        "s_per_step": float(np.median(per_step)),
        "mean_s_per_step": float(per_step.mean()),
        "steps": steps,
        "simulated_ps": steps * timestep_fs / 1000,
    }


def pressure_curve(
    frames: Sequence[Atoms],
    calculators: dict[str, Calculator],
    volume_ratios: Sequence[float] = (0.94, 0.97, 1.0, 1.03, 1.06),
    *,
    molecules: bool = False,
) -> dict:
    """Pressure against density for each calculator on the same isotropically scaled copies of ``frames``.

    Each fully periodic frame is scaled (cell and atoms) to ``volume_ratios`` of its volume. ``molecules=True``
    scales a molecular liquid as a barostat's equilibrium sees it: each molecule (atoms bonded within 1.2x their
    covalent radii) is made whole across the cell and moved rigidly with its centre of mass, so bond lengths stay
    as they are; the default scales every atom, bonds included (the stress response of a solid). Every calculator
    gives each copy's stress; the pressure ``P = -tr(σ)/3`` is averaged over the frames at each ratio.
    Returns ``volume_ratios``, ``density_g_cm3`` (mean over the frames, per ratio) and per calculator name:

    * ``pressure_gpa``: the mean pressure per ratio;
    * ``zero_pressure_density_g_cm3``: where the least-squares line P(ρ) crosses zero (None when P does not rise
      with ρ); ``extrapolated`` is True when that density lies outside the sampled ones;
    * ``bulk_modulus_gpa``: ρ dP/dρ of that line at the mean density.

    With a teacher and a student among ``calculators`` this compares the equations of state that an NPT run
    of each follows, at a few single points per ratio instead of a long barostatted trajectory.
    """
    frames = [a for a in frames if a.pbc.all()]
    if not frames:
        raise ValueError("pressure_curve needs fully periodic frames")
    ratios = [float(r) for r in volume_ratios]
    if len(ratios) < 2 or any(not r > 0 for r in ratios):
        raise ValueError(f"volume_ratios must be >= 2 positive numbers, got {volume_ratios}")
    scaled = []
    for r in ratios:
        copies = []
        for a in frames:
            copies.append(_scaled_copy(a, r ** (1.0 / 3.0), molecules))
        scaled.append(copies)
    density = [float(np.mean([density_g_cm3(b) for b in c])) for c in scaled]
    out: dict = {"volume_ratios": ratios, "density_g_cm3": density, "frames": len(frames), "molecules": molecules}
    for name, calc in calculators.items():
        pressure = []
        for copies in scaled:
            values = []
            for b in copies:
                b.calc = calc
                values.append(-float(np.mean(b.get_stress(voigt=True)[:3])) / units.GPa)
                b.calc = None
            pressure.append(float(np.mean(values)))
        if not np.isfinite(pressure).all():
            raise ValueError(f"non-finite pressure from {name!r}")
        slope, intercept = np.polyfit(density, pressure, 1)
        rho0 = -intercept / slope if slope > 0 else None
        out[name] = {
            "pressure_gpa": pressure,
            "zero_pressure_density_g_cm3": None if rho0 is None else float(rho0),
            "extrapolated": None if rho0 is None else not min(density) <= rho0 <= max(density),
            "bulk_modulus_gpa": float(slope * np.mean(density)),
        }
    return out


def _scaled_copy(atoms: Atoms, f: float, molecules: bool) -> Atoms:
    """A copy of ``atoms`` (no calculator) with the cell scaled by ``f``: every atom with it, or (``molecules``)
    each whole molecule moved rigidly with its centre of mass."""
    b = atoms.copy()
    b.calc = None
    if not molecules:
        b.set_cell(atoms.cell[:] * f, scale_atoms=True)
        return b
    labels, whole = _whole_molecules(b)
    masses = b.get_masses()
    centres = np.zeros((labels.max() + 1, 3))
    np.add.at(centres, labels, masses[:, None] * whole)
    centres /= np.bincount(labels, weights=masses)[:, None]
    b.set_cell(atoms.cell[:] * f, scale_atoms=False)
    b.positions = whole + (f - 1.0) * centres[labels]
    return b


def _whole_molecules(atoms: Atoms, mult: float = 1.2) -> tuple[np.ndarray, np.ndarray]:
    """Molecule label of each atom (bonded: within ``mult`` times the sum of covalent radii, ASE's natural
    cutoffs) and positions with every molecule made whole: each atom placed at the image bonded to the atom it
    was reached from (breadth-first from each molecule's first atom)."""
    from ase.neighborlist import NeighborList, natural_cutoffs

    nl = NeighborList(natural_cutoffs(atoms, mult=mult), self_interaction=False, bothways=True, skin=0.0)
    nl.update(atoms)
    pos, cell = atoms.positions, atoms.cell.array
    labels = np.full(len(atoms), -1, dtype=np.int64)
    whole = pos.copy()
    count = 0
    for start in range(len(atoms)):
        if labels[start] >= 0:
            continue
        labels[start] = count
        stack = [start]
        while stack:
            i = stack.pop()
            idx, offsets = nl.get_neighbors(i)
            for j, o in zip(idx, offsets, strict=True):
                if labels[j] < 0:
                    labels[j] = count
                    whole[j] = whole[i] + (pos[j] + o @ cell - pos[i])
                    stack.append(j)
        count += 1
    return labels, whole
