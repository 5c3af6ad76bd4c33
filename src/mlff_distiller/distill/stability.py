"""Is a student's molecular MD physically stable? A monitor of the closest pair and the bond graph, and a run.

A distilled student can be accurate on its held-out frames and still drive MD into regions it never saw: atoms
that collapse onto each other, bonds that break or form. :class:`StabilityMonitor` checks a molecule every few
steps against the bond graph of its start (bonded: closer than 1.2 × the sum of covalent radii); the run fails at
the first non-finite energy or force, pair closer than ``min_pair_distance``, bond stretched beyond
``bond_factor`` × the sum of covalent radii, or new pair closer than that sum. :func:`stability_run` runs Langevin
MD of a molecule with a student until a simulated time or a wall-clock budget, with the monitor attached.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

__all__ = ["BOND_FACTOR", "MIN_PAIR_DISTANCE", "StabilityMonitor", "stability_run"]

MIN_PAIR_DISTANCE = 0.5  # Å
BOND_FACTOR = 1.5  # a bond is broken beyond this × the sum of covalent radii


class StabilityMonitor:
    """Checks of a molecular MD run: closest pair, bond graph, forces, energies (called every few steps)."""

    def __init__(
        self, atoms, dyn, *, min_pair_distance: float = MIN_PAIR_DISTANCE, bond_factor: float = BOND_FACTOR
    ) -> None:
        from ase.data import covalent_radii

        self.atoms, self.dyn = atoms, dyn
        self.min_pair_distance, self.bond_factor = float(min_pair_distance), float(bond_factor)
        r = covalent_radii[atoms.numbers]
        self.rsum = r[:, None] + r[None, :]
        iu = np.triu_indices(len(atoms), 1)
        self.iu = iu
        d = atoms.get_all_distances()
        self.bonded = (d < 1.2 * self.rsum)[iu]
        self.rows: list[tuple[float, float, float, float, float]] = []  # t (ps), Epot, Ekin/atom T, max|F|, dmin
        self.failure: str | None = None

    def __call__(self) -> None:
        from ase import units

        a = self.atoms
        d = a.get_all_distances()[self.iu]
        rsum = self.rsum[self.iu]
        forces = a.get_forces()
        epot = a.get_potential_energy()
        temp = a.get_kinetic_energy() / (1.5 * units.kB * len(a))
        t_ps = self.dyn.get_time() / (1000 * units.fs)
        fmax = float(np.linalg.norm(forces, axis=1).max())
        self.rows.append((t_ps, float(epot), float(temp), fmax, float(d.min())))
        if self.failure is not None:
            return
        if not (np.isfinite(epot) and np.isfinite(forces).all()):
            self.failure = f"non-finite energy or forces at {t_ps:.3f} ps"
        elif d.min() < self.min_pair_distance:
            self.failure = f"atom pair at {d.min():.3f} Å < {self.min_pair_distance} Å at {t_ps:.3f} ps"
        elif (d[self.bonded] > self.bond_factor * rsum[self.bonded]).any():
            self.failure = f"a bond broke (> {self.bond_factor} × covalent radii) at {t_ps:.3f} ps"
        elif (d[~self.bonded] < rsum[~self.bonded]).any():
            self.failure = f"a new bond formed at {t_ps:.3f} ps"

    def summary(self) -> dict:
        arr = np.array(self.rows) if self.rows else np.zeros((0, 5))
        out = {"stable": self.failure is None and len(self.rows) > 1, "failure": self.failure, "checks": len(self.rows)}
        if len(arr):
            out.update(
                simulated_ps=float(arr[-1, 0]),
                epot_mean_ev=float(arr[:, 1].mean()),
                epot_std_ev=float(arr[:, 1].std()),
                epot_min_ev=float(arr[:, 1].min()),
                epot_max_ev=float(arr[:, 1].max()),
                temperature_mean_k=float(arr[:, 2].mean()),
                max_force_ev_a=float(arr[:, 3].max()),
                min_pair_distance_a=float(arr[:, 4].min()),
            )
        return out

    def plot(self, path: Path, title: str = "student Langevin MD") -> Path | None:
        if len(self.rows) < 2:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        arr = np.array(self.rows)
        fig, axes = plt.subplots(3, 1, figsize=(6.4, 6.4), sharex=True)
        for ax, col, label in ((axes[0], 1, "E_pot (eV)"), (axes[1], 2, "T (K)"), (axes[2], 4, "closest pair (Å)")):
            ax.plot(arr[:, 0], arr[:, col], lw=0.6)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[2].axhline(self.min_pair_distance, color="r", ls=":", lw=0.8)
        axes[2].set_xlabel("time (ps)")
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def stability_run(
    model,
    atoms,
    device: str | None = None,
    *,
    seconds: float,
    max_ps: float,
    temperature: float,
    timestep_fs: float,
    check: int,
    seed: int,
    precision: str = "fp32",
) -> tuple[dict, StabilityMonitor]:
    """Langevin MD (friction 0.01/fs, centre of mass fixed) of the molecule ``atoms`` (a copy) with the student
    until ``max_ps`` of simulated time or ``seconds`` of wall clock, whichever comes first, checked by a
    :class:`StabilityMonitor` every ``check`` steps. Returns its summary with the run's numbers, and the monitor."""
    from ase import units
    from ase.constraints import FixCom
    from ase.md.langevin import Langevin
    from ase.md.velocitydistribution import Stationary, ZeroRotation

    from mlff_distiller.ase_compat import maxwell_boltzmann
    from mlff_distiller.calculator import StudentCalculator

    atoms = atoms.copy()
    atoms.calc = StudentCalculator(model, device=device, precision=precision)
    atoms.set_constraint(FixCom())
    rng = np.random.default_rng(seed)
    maxwell_boltzmann(atoms, temperature, rng=rng)
    Stationary(atoms)
    ZeroRotation(atoms)
    dyn = Langevin(
        atoms,
        timestep=timestep_fs * units.fs,
        temperature_K=temperature,
        friction=0.01 / units.fs,
        rng=rng,
        fixcm=False,
    )
    mon = StabilityMonitor(atoms, dyn)
    dyn.attach(mon, interval=check)
    max_steps = round(max_ps * 1000 / timestep_fs)
    t0 = time.perf_counter()
    done, chunk = 0, check * 20
    while done < max_steps and time.perf_counter() - t0 < seconds and mon.failure is None:
        n = min(chunk, max_steps - done)
        dyn.run(n)
        done += n
    wall = time.perf_counter() - t0
    out = {
        **mon.summary(),
        "steps": done,
        "timestep_fs": timestep_fs,
        "temperature_k": temperature,
        "wall_seconds": wall,
        "s_per_step": wall / max(done, 1),
        "target_ps": max_ps,
    }
    return out, mon
