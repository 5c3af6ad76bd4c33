"""Frames worth a teacher label, picked from a student's own MD: where each trajectory first went wrong.

A student fails where its training data did not reach. ``mlff-distill md --freeze-force`` stops each replica at the
geometry where an atom first felt an unphysical force, and names it in the frames' ``info["frozen"]``; the domain
check names geometries outside the training data's envelope (closer pairs or more neighbours than any training
frame); two students trained alike disagree where their data did not constrain them (:mod:`mlff_distiller.committee`).
:func:`harvest` takes, per trajectory, the first such frame and the few frames written before it (the
approach the student got wrong), which ``mlff-distill label --as-given`` then labels with the teacher and
``mlff-distill train --data OLD --data NEW --init-model STUDENT`` fine-tunes on, with the new frames weighted
below the old in the loss (``--data-weight``: at 0.2 one round on the shipped student's 2,000 K frames cost its
300-800 K accuracy 7-12 % where weight 1 cost 35-41 %, ``benchmarks/results/finetune_weights_h100/``)::

    mlff-distill md      --input many.xyz@: --replicas 16 --temperature 1500 --freeze-force 100 --output hot.extxyz
    mlff-distill harvest --input hot.extxyz --model builtin:chno-gfn2 --output picked.extxyz
    mlff-distill label   --teacher gfn2-xtb --seeds picked.extxyz --as-given --out round1
    mlff-distill train   --data labels --data round1 --data-weight 1 --data-weight 0.2 --init-model builtin:chno-gfn2

The frames of one trajectory are those with the same ``info["replica"]`` (a batched run), in file order; a file
without that key is one trajectory. The geometry is all that is kept: the student's energies and forces are not
labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from ase import Atoms

__all__ = ["HarvestReport", "harvest"]


@dataclass
class HarvestReport:
    """What :func:`harvest` found.

    Attributes:
        frames: the picked frames, in file order of their trajectories' first frame, each with ``info["harvest"]``
            (``"frozen"``, ``"outside"``, ``"disagree"`` or ``"before"``), and ``replica`` / ``time_fs`` when the
            input had them.
        trajectories: trajectories read.
        frozen: trajectories whose first bad frame is a frozen one.
        outside: trajectories whose first bad frame lies outside the envelope (and is not frozen).
        disagree: trajectories whose first bad frame is one where the students disagree (and nothing above).
        nonfinite: trajectories whose first bad frame has non-finite positions (a run without ``freeze_force``);
            only the frames before it are picked.
        reasons: ``{trajectory: why}`` for each trajectory with a bad frame (the first finding).
    """

    frames: list[Atoms]
    trajectories: int
    frozen: int = 0
    outside: int = 0
    disagree: int = 0
    nonfinite: int = 0
    reasons: dict = field(default_factory=dict)


def harvest(
    frames: Sequence[Atoms], *, before: int = 4, envelope=None, disagreement: Sequence[dict] | None = None
) -> HarvestReport:
    """Per trajectory of ``frames`` (see the module), its first frame that went wrong, and up to ``before`` of that
    trajectory's frames written before it. Trajectories that never went wrong give nothing. Wrong, in this order:

    * non-finite positions (that frame itself is not picked);
    * frozen (``info["frozen"]``);
    * outside ``envelope`` (a :class:`~mlff_distiller.domain.DomainEnvelope`);
    * flagged in ``disagreement``: one dict per frame as :func:`~mlff_distiller.committee.committee_disagreement`
      gives them, or None for a frame not checked. There two or more students' forces differ by more than its
      threshold: new chemistry, even where the geometry is not new.
    """
    if int(before) < 0:
        raise ValueError(f"before must be >= 0 frames, got {before}")
    frames = list(frames)
    if disagreement is not None and len(disagreement) != len(frames):
        raise ValueError(f"disagreement has {len(disagreement)} entries for {len(frames)} frames")
    groups: dict[object, list[int]] = {}
    for k, atoms in enumerate(frames):
        groups.setdefault(atoms.info.get("replica"), []).append(k)
    finite = [bool(np.isfinite(a.positions).all()) for a in frames]
    findings: list[list[str]] = [[] for _ in frames]
    if envelope is not None:
        ids = [k for k in range(len(frames)) if finite[k]]
        for k, found in zip(ids, envelope.check_many([frames[k] for k in ids], limit=1), strict=True):
            findings[k] = found
    report = HarvestReport(frames=[], trajectories=len(groups))
    for key, ids in groups.items():
        for n, k in enumerate(ids):
            if not finite[k]:  # a run without freeze_force that blew up: the frames before it are what is left
                kind, why = "nonfinite", "non-finite positions"
            elif frames[k].info.get("frozen"):
                kind, why = "frozen", "frozen"
            elif findings[k]:
                kind, why = "outside", findings[k][0]
            elif disagreement is not None and disagreement[k] is not None and disagreement[k]["flagged"]:
                kind = "disagree"
                why = f"the students' forces differ by {disagreement[k]['force_disagreement_mev_a']:.0f} meV/Å"
            else:
                continue
            setattr(report, kind, getattr(report, kind) + 1)
            report.reasons[key] = why
            for m in ids[max(0, n - int(before)) : n]:
                if finite[k] and np.array_equal(frames[m].positions, frames[k].positions):
                    continue  # written before the freeze was noticed: the frozen frame's own geometry
                report.frames.append(_geometry(frames[m], "before"))
            if finite[k]:
                report.frames.append(_geometry(frames[k], kind))
            break
    return report


def _geometry(atoms: Atoms, tag: str) -> Atoms:
    out = Atoms(numbers=atoms.numbers, positions=atoms.positions, cell=atoms.cell, pbc=atoms.pbc)
    for key in ("replica", "time_fs", "name"):
        if key in atoms.info:
            out.info[key] = atoms.info[key]
    out.info["harvest"] = tag
    return out
