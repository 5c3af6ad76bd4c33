"""Reusable physics checks for any :class:`StudentModel` (used by our tests; usable on your own models).

Each check returns the largest deviation it measured so callers choose their own tolerance.
"""

from __future__ import annotations

import numpy as np

from mlff_distiller.predict import predict_forces

__all__ = [
    "energy_and_forces",
    "finite_difference_forces_error",
    "finite_difference_stress",
    "finite_difference_stress_error",
    "random_rotation",
    "symmetry_errors",
]


def energy_and_forces(model, atoms, *, precision: str = "fp64", device=None, stress: bool = False) -> dict:
    """One structure through :func:`predict_forces` (fp64 by default, for checks)."""
    return predict_forces(model, [atoms], precision=precision, device=device, stress=stress)[0]


def finite_difference_forces_error(model, atoms, *, h: float = 1e-4, device=None, n_atoms: int | None = None):
    """Max |F_autograd − F_central-difference| (eV/Å) over the first ``n_atoms`` atoms, in fp64."""
    ref = energy_and_forces(model, atoms, device=device)["forces"]
    idx = range(len(atoms) if n_atoms is None else min(n_atoms, len(atoms)))
    displaced = []
    for i in idx:
        for a in range(3):
            for sign in (1.0, -1.0):
                x = atoms.copy()
                pos = x.get_positions()
                pos[i, a] += sign * h
                x.set_positions(pos)
                displaced.append(x)
    energies = [r["energy"] for r in predict_forces(model, displaced, precision="fp64", device=device)]
    fd = -(np.array(energies[0::2]) - np.array(energies[1::2])) / (2 * h)
    return float(np.abs(fd - ref[list(idx)].reshape(-1)).max())


def finite_difference_stress(atoms, energies, *, h: float = 1e-5) -> np.ndarray:
    """σ (Voigt, eV/Å³) by central differences of a symmetric strain: ``energies(list of Atoms) -> energies``
    is called once on the 12 strained copies (any energy source: a model, an engine, a teacher)."""
    voigt = ((0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1))
    strained = []
    for a, b in voigt:
        for sign in (1.0, -1.0):
            eps = np.zeros((3, 3))
            eps[a, b] += 0.5 * sign * h
            eps[b, a] += 0.5 * sign * h
            x = atoms.copy()
            x.set_cell(atoms.cell.array @ (np.eye(3) + eps), scale_atoms=True)
            strained.append(x)
    e = np.asarray(energies(strained), dtype=np.float64)
    return (e[0::2] - e[1::2]) / (2 * h) / atoms.get_volume()


def finite_difference_stress_error(model, atoms, *, h: float = 1e-5, device=None) -> float:
    """Max |σ_autograd − σ_fd| (eV/Å³), σ_ab = (1/V) ∂E/∂ε_ab by central differences of a symmetric strain."""
    ref = energy_and_forces(model, atoms, device=device, stress=True)["stress"]

    def energies(frames):
        return [r["energy"] for r in predict_forces(model, frames, precision="fp64", device=device)]

    return float(np.abs(finite_difference_stress(atoms, energies, h=h) - ref).max())


def random_rotation(rng: np.random.Generator) -> np.ndarray:
    """A uniformly random proper rotation matrix (det +1)."""
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    if np.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def symmetry_errors(model, atoms, *, seed: int = 0, device=None) -> dict[str, float]:
    """Energy invariance and force equivariance under rotation, translation and permutation (eV, eV/Å)."""
    rng = np.random.default_rng(seed)
    base = energy_and_forces(model, atoms, device=device)
    rot = random_rotation(rng)
    moved = atoms.copy()
    moved.set_positions(atoms.get_positions() @ rot.T + rng.normal(size=3) * 3.0)
    if atoms.pbc.any():
        moved.set_cell(atoms.cell.array @ rot.T)
    perm = rng.permutation(len(atoms))
    permuted = atoms[perm]
    r_rot, r_perm = predict_forces(model, [moved, permuted], precision="fp64", device=device)
    return {
        "rotation_energy": abs(r_rot["energy"] - base["energy"]),
        "rotation_forces": float(np.abs(r_rot["forces"] - base["forces"] @ rot.T).max()),
        "permutation_energy": abs(r_perm["energy"] - base["energy"]),
        "permutation_forces": float(np.abs(r_perm["forces"] - base["forces"][perm]).max()),
    }
