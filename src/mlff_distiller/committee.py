"""Is a student trustworthy on these structures? The disagreement of two or more students as a warning light.

A student is accurate near the structures it was distilled on and can be far off elsewhere, without saying so.
Students trained on the same labels agree where the labels constrained them and drift apart where they did not,
so their disagreement flags structures outside the training domain without a call to the teacher. Measured with
the two shipped students (``builtin:chno-gfn2``, 128 x 3, and ``builtin:chno-gfn2-small``, 64 x 3: the same
GFN2-xTB labels and recipe) on GFN2-xTB MD frames at 300-700 K (``benchmarks/probe_domain.py``,
``benchmarks/results/domain_committee_cpu.md``): on six molecules of their training set their forces differed by
4-22 meV/Å (mean absolute), close to the 128 x 3 student's error there (3-24), and no frame of 360 passed 50; on
two molecules outside it, 1,4-benzenediamine and biphenyl, by 432 and 170 meV/Å, where its errors were 254 and 189,
and every frame of 120 passed 50. Over all 61 molecules of the training set (``--all-g2``,
``domain_committee_g2_cpu.md``) 16 of 3,660 frames passed 50 (0.4 %; molecule means 2.8-30.7 meV/Å), and all 180
frames of three molecules outside it (benzonitrile added: 127 meV/Å, error 178). ``DISAGREEMENT_THRESHOLD``
(50 meV/Å) lies between the two groups.

:func:`committee_disagreement` gives the numbers per structure; ``mlff-distill check`` prints them with a verdict;
:class:`CommitteeCalculator` is the committee as one ASE calculator (mean energy and forces, their spread, and a
warning when a calculation leaves the training domain), as MACE's calculator takes a list of models.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from ase.calculators.calculator import all_changes
from ase.calculators.mixing import AverageCalculator

# DEFAULT_COMMITTEE: the two shipped students; DISAGREEMENT_THRESHOLD: 50 meV/Å (in a module without imports, for
# the command line's parser).
from mlff_distiller._committee_defaults import DEFAULT_COMMITTEE, DISAGREEMENT_THRESHOLD
from mlff_distiller.domain import OutOfDomainWarning
from mlff_distiller.model import StudentModel

__all__ = [
    "DEFAULT_COMMITTEE",
    "DISAGREEMENT_THRESHOLD",
    "CommitteeCalculator",
    "OutOfDomainWarning",
    "committee_disagreement",
]


def committee_disagreement(
    models: Sequence[StudentModel | str | Path],
    structures,
    *,
    device=None,
    precision: str = "fp32",
    threshold: float = DISAGREEMENT_THRESHOLD,
) -> list[dict]:
    """How far two or more students' predictions differ, per structure.

    Args:
        models: students (or checkpoint paths, ``"builtin:<name>"`` included) that know the structures' elements.
        structures: ``ase.Atoms`` (or one).
        device, precision: as in :func:`~mlff_distiller.predict_forces`.
        threshold: force disagreement (meV/Å) above which a structure is ``flagged``.
    Returns:
        One dict per structure, in input order, each averaged over the pairs of students:
        ``force_disagreement_mev_a`` (mean absolute difference of their force components),
        ``max_force_disagreement_mev_a`` (the largest difference of one atom's force vectors, any pair: its norm),
        ``energy_disagreement_mev_atom`` (absolute energy difference per atom), and ``flagged``.
    """
    from mlff_distiller.checkpoint import load_model
    from mlff_distiller.predict import predict_forces

    models = list(models)
    if len(models) < 2:
        raise ValueError(f"a committee needs at least two students, got {len(models)}")
    if not float(threshold) > 0:
        raise ValueError(f"threshold must be > 0 meV/Å, got {threshold}")
    models = [m if isinstance(m, StudentModel) else load_model(m) for m in models]
    from ase import Atoms

    structures = [structures] if isinstance(structures, Atoms) else list(structures)  # each student reads them all
    runs = [predict_forces(m, structures, device=device, precision=precision) for m in models]
    out = []
    for per_model in zip(*runs, strict=True):
        spread = _spread([r["forces"] for r in per_model], [r["energy"] for r in per_model])
        out.append({**spread, "flagged": spread["force_disagreement_mev_a"] > float(threshold)})
    return out


def _spread(forces: Sequence[np.ndarray], energies: Sequence[float]) -> dict:
    """The committee's spread, averaged over the pairs of students: the mean absolute difference of their force
    components and the largest difference of one atom's force vectors (meV/Å), the energy difference per atom
    (meV)."""
    n = max(len(forces[0]), 1)
    mae, peak, de = [], 0.0, []
    for (fa, ea), (fb, eb) in itertools.combinations(zip(forces, energies, strict=True), 2):
        diff = np.asarray(fa) - np.asarray(fb)
        mae.append(float(np.abs(diff).mean()) if diff.size else 0.0)
        peak = max(peak, float(np.linalg.norm(diff, axis=-1).max()) if diff.size else 0.0)
        de.append(abs(float(ea) - float(eb)) / n)
    return {
        "force_disagreement_mev_a": 1000 * float(np.mean(mae)),
        "max_force_disagreement_mev_a": 1000 * peak,
        "energy_disagreement_mev_atom": 1000 * float(np.mean(de)),
    }


class CommitteeCalculator(AverageCalculator):
    """Two or more students as one ASE calculator (ASE's :class:`~ase.calculators.mixing.AverageCalculator` of a
    :class:`~mlff_distiller.StudentCalculator` each): energy, forces and per-atom energies are the students' means,
    and every calculation also gives their spread.

    Args:
        models: students or checkpoint paths (default: the two shipped students).
        threshold: force disagreement (meV/Å) above which a calculation counts in ``flagged_calculations`` and, the
            first time, warns with :class:`OutOfDomainWarning`.
        **calculator_kwargs: for each student's :class:`~mlff_distiller.StudentCalculator` (``device``,
            ``precision``, ...).

    Results besides the means: ``force_disagreement`` (meV/Å, as :func:`committee_disagreement`),
    ``max_force_disagreement`` (meV/Å), ``energy_disagreement`` (meV per atom), ``forces_std`` (``[n, 3]`` eV/Å, over
    the students), ``energy_std`` (eV), and ASE's ``energy_contributions`` / ``forces_contributions`` (each
    student's own values). Each calculation runs every student: M times the cost of one.
    """

    def __init__(
        self,
        models: Sequence[StudentModel | str | Path] = DEFAULT_COMMITTEE,
        *,
        threshold: float = DISAGREEMENT_THRESHOLD,
        **calculator_kwargs,
    ) -> None:
        from mlff_distiller.calculator import StudentCalculator

        models = list(models)
        if len(models) < 2:
            raise ValueError(f"a committee needs at least two students, got {len(models)}")
        if not float(threshold) > 0:
            raise ValueError(f"threshold must be > 0 meV/Å, got {threshold}")
        super().__init__([StudentCalculator(m, **calculator_kwargs) for m in models])
        self.threshold = float(threshold)
        self.flagged_calculations = 0

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes) -> None:
        # The spread needs every student's forces, whatever was asked.
        super().calculate(atoms, sorted({*properties, "energy", "forces"}), system_changes)
        forces = [np.asarray(f) for f in self.results["forces_contributions"]]  # each student's own
        energies = [float(e) for e in self.results["energy_contributions"]]
        spread = _spread(forces, energies)
        self.results["force_disagreement"] = spread["force_disagreement_mev_a"]
        self.results["max_force_disagreement"] = spread["max_force_disagreement_mev_a"]
        self.results["energy_disagreement"] = spread["energy_disagreement_mev_atom"]
        self.results["forces_std"] = np.std(np.stack(forces), axis=0)
        self.results["energy_std"] = float(np.std(energies))
        if spread["force_disagreement_mev_a"] > self.threshold:
            self.flagged_calculations += 1
            if self.flagged_calculations == 1:
                warnings.warn(
                    OutOfDomainWarning(
                        f"the committee's students disagree by {spread['force_disagreement_mev_a']:.0f} meV/Å "
                        f"(threshold {self.threshold:g}): this structure is likely outside their training data; "
                        "CommitteeCalculator.flagged_calculations counts such calculations"
                    ),
                    stacklevel=2,
                )
