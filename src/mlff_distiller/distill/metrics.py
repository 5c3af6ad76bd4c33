"""The student's errors against its teacher's labels: energy MAE/RMSE (meV/atom), force MAE/RMSE (meV/Å), per
element and per group of frames, on labelled frames predicted through :class:`mlff_distiller.ForceEngine` (the
inference path users run). The plots, MD timing and drift checks are in :mod:`.evaluation`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from ase import Atoms, units

from mlff_distiller.distill.dataset import periodic_stress
from mlff_distiller.engine import ForceEngine
from mlff_distiller.model import StudentModel

__all__ = ["error_metrics", "grouped_error_metrics", "predict_frames"]


def predict_frames(
    model: StudentModel,
    frames: Sequence[Atoms],
    *,
    device: torch.device | str | None = None,
    precision: str = "fp64",
    batch_size: int | None = None,
) -> list[dict]:
    """Student predictions (``energy`` eV, ``forces`` eV/Å) for each frame, through ``ForceEngine``; ``stress``
    (Voigt, eV/Å³) too for the fully periodic frames when any frame carries a teacher stress."""
    frames = list(frames)
    engine = ForceEngine(model, device=device, precision=precision)
    return engine.predict(frames, batch_size=batch_size, stress=any(periodic_stress(a) is not None for a in frames))


def error_metrics(frames: Sequence[Atoms], predictions: Sequence[dict]) -> dict:
    """Errors of ``predictions`` against the teacher labels on ``frames`` (their calculators' results).

    Returns ``energy_mae_mev_atom``, ``energy_rmse_mev_atom``, ``force_mae_mev_a``, ``force_rmse_mev_a``,
    ``frames``, ``atoms``, the force errors of each element's atoms (``force_mae_mev_a_by_element``,
    ``force_rmse_mev_a_by_element``: ``{symbol: meV/Å}``) and the raw arrays ``_energy`` ``[F, 2]`` (teacher,
    student; eV/atom) and ``_forces`` ``[3N, 2]`` (eV/Å) for plotting. Where periodic frames carry a teacher stress
    and the predictions a student stress (:func:`predict_frames` asks for it then), also ``stress_mae_mev_a3``,
    ``stress_rmse_mev_a3`` (meV/Å³, over the Voigt components), ``stress_mae_gpa``, ``pressure_mae_gpa``
    (P = -tr σ / 3) and ``stress_frames``.
    """
    frames = list(frames)
    if len(frames) != len(predictions):
        raise ValueError(f"{len(frames)} frames but {len(predictions)} predictions")
    if not frames:
        raise ValueError("no frames to evaluate")
    e_ref, e_pred, f_ref, f_pred, s_ref, s_pred, numbers = [], [], [], [], [], [], []
    for k, (a, p) in enumerate(zip(frames, predictions, strict=True)):
        if a.calc is None or "energy" not in a.calc.results or "forces" not in a.calc.results:
            raise ValueError(f"frame {k} has no teacher energy and forces")
        n = len(a)
        e_ref.append(float(a.calc.results["energy"]) / n)
        e_pred.append(float(p["energy"]) / n)
        f_ref.append(np.asarray(a.calc.results["forces"]).reshape(-1))
        f_pred.append(np.asarray(p["forces"]).reshape(-1))
        numbers.append(a.numbers)
        teacher = periodic_stress(a)
        if teacher is not None and "stress" in p:
            s_ref.append(teacher)
            s_pred.append(np.asarray(p["stress"], dtype=np.float64).reshape(6))
    energy = np.stack([np.array(e_ref), np.array(e_pred)], axis=1)
    forces = np.stack([np.concatenate(f_ref), np.concatenate(f_pred)], axis=1)
    de, df = energy[:, 1] - energy[:, 0], forces[:, 1] - forces[:, 0]
    if not (np.isfinite(de).all() and np.isfinite(df).all()):
        raise ValueError("non-finite student predictions")
    out = {
        "energy_mae_mev_atom": 1000 * float(np.abs(de).mean()),
        "energy_rmse_mev_atom": 1000 * float(np.sqrt((de**2).mean())),
        "force_mae_mev_a": 1000 * float(np.abs(df).mean()),
        "force_rmse_mev_a": 1000 * float(np.sqrt((df**2).mean())),
        "frames": len(frames),
        "atoms": int(sum(len(a) for a in frames)),
        **_force_errors_by_element(np.concatenate(numbers), df.reshape(-1, 3)),
        "_energy": energy,
        "_forces": forces,
    }
    if s_ref:
        ds = np.stack(s_pred) - np.stack(s_ref)
        if not np.isfinite(ds).all():
            raise ValueError("non-finite student stress")
        # Pressure, P = -tr(σ)/3 (what a barostat follows), GPa.
        dp = -ds[:, :3].mean(axis=1)
        out.update(
            pressure_mae_gpa=float(np.abs(dp).mean() / units.GPa),
            stress_mae_mev_a3=1000 * float(np.abs(ds).mean()),
            stress_rmse_mev_a3=1000 * float(np.sqrt((ds**2).mean())),
            stress_mae_gpa=float(np.abs(ds).mean() / units.GPa),
            stress_frames=len(s_ref),
        )
    return out


def _force_errors_by_element(numbers: np.ndarray, df: np.ndarray) -> dict:
    """Force MAE and RMSE (meV/Å, over the components) of each element's atoms, keyed by chemical symbol in order of
    atomic number (nequip and MACE report them per species: a student's H forces are often much better than its
    heavy atoms')."""
    from ase.data import chemical_symbols

    mae, rmse = {}, {}
    for z in np.unique(numbers):
        d = df[numbers == z]
        mae[chemical_symbols[z]] = 1000 * float(np.abs(d).mean())
        rmse[chemical_symbols[z]] = 1000 * float(np.sqrt((d**2).mean()))
    return {"force_mae_mev_a_by_element": mae, "force_rmse_mev_a_by_element": rmse}


def grouped_error_metrics(frames: Sequence[Atoms], predictions: Sequence[dict], key: str) -> dict:
    """:func:`error_metrics` of each group of ``frames`` that share ``info[key]`` (MACE reports its errors per
    ``config_type`` the same way), without the raw arrays: ``{value: metrics}``, values as text in order of first
    appearance. Frames without the key form the group ``"(none)"``; ``key="formula"``, unless the frames carry an
    info key of that name, groups by chemical formula (one molecule's frames, in a set of many)."""
    frames = list(frames)
    if len(frames) != len(predictions):
        raise ValueError(f"{len(frames)} frames but {len(predictions)} predictions")
    groups: dict[str, list[int]] = {}
    by_formula = key == "formula" and not any("formula" in a.info for a in frames)
    for k, atoms in enumerate(frames):
        value = atoms.get_chemical_formula() if by_formula else str(atoms.info.get(key, "(none)"))
        groups.setdefault(value, []).append(k)
    out = {}
    for value, idx in groups.items():
        metrics = error_metrics([frames[k] for k in idx], [predictions[k] for k in idx])
        out[value] = {name: v for name, v in metrics.items() if not name.startswith("_")}
    return out
