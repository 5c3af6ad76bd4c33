"""Distillation: teachers, sampling, resumable labelling, datasets, force-matching training, evaluation.

Typical flow::

    from mlff_distiller.distill import SamplingConfig, TrainConfig, label, read_frames, split_frames, train
    label(seeds, "gfn2-xtb", "data/run1", SamplingConfig(temperatures=[300, 600]))
    train_frames, val_frames = split_frames(read_frames("data/run1"), 0.1)
    result = train(train_frames, val_frames, TrainConfig(), "runs/run1")

The names are imported on first use (PEP 562, as in :mod:`mlff_distiller`): the command line imports this
package's configuration without its teachers, labelling and evaluation (ASE's MD and optimisers, SciPy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlff_distiller import _lazy

# public name -> the module that defines it
_EXPORTS = {
    "TEACHERS": "mlff_distiller.distill.teachers",
    "Deduplicator": "mlff_distiller.distill.sampling",
    "FrameDataset": "mlff_distiller.distill.dataset",
    "FrameStore": "mlff_distiller.distill.labelling",
    "LabelReport": "mlff_distiller.distill.labelling",
    "LabelledBatch": "mlff_distiller.distill.dataset",
    "MissingExtraError": "mlff_distiller.distill.teachers",
    "SamplingConfig": "mlff_distiller.distill.sampling",
    "StabilityMonitor": "mlff_distiller.distill.stability",
    "Task": "mlff_distiller.distill.sampling",
    "TrainConfig": "mlff_distiller.distill.training",
    "TrainResult": "mlff_distiller.distill.training",
    "error_metrics": "mlff_distiller.distill.metrics",
    "grouped_error_metrics": "mlff_distiller.distill.metrics",
    "evaluate_dataset": "mlff_distiller.distill.training",
    "fit_energy_reference": "mlff_distiller.distill.dataset",
    "from_dict": "mlff_distiller.distill.config",
    "g2_chno": "mlff_distiller.distill.seeds",
    "get_teacher": "mlff_distiller.distill.teachers",
    "label": "mlff_distiller.distill.labelling",
    "label_parallel": "mlff_distiller.distill.label_processes",
    "label_watched": "mlff_distiller.distill.label_processes",
    "learning_curve_plot": "mlff_distiller.distill.evaluation",
    "load_seeds": "mlff_distiller.distill.seeds",
    "load_yaml": "mlff_distiller.distill.config",
    "make_tasks": "mlff_distiller.distill.sampling",
    "md_step_timing": "mlff_distiller.distill.evaluation",
    "npt_berendsen": "mlff_distiller.distill.evaluation",
    "npt_run": "mlff_distiller.distill.evaluation",
    "nve_drift": "mlff_distiller.distill.evaluation",
    "parity_plot": "mlff_distiller.distill.evaluation",
    "predict_frames": "mlff_distiller.distill.metrics",
    "pressure_curve": "mlff_distiller.distill.evaluation",
    "read_frames": "mlff_distiller.distill.labelling",
    "run_task": "mlff_distiller.distill.sampling",
    "split_frames": "mlff_distiller.distill.dataset",
    "stability_run": "mlff_distiller.distill.stability",
    "student_forward": "mlff_distiller.distill.training",
    "to_dict": "mlff_distiller.distill.config",
    "train": "mlff_distiller.distill.training",
}

__all__ = [
    "TEACHERS",
    "Deduplicator",
    "FrameDataset",
    "FrameStore",
    "LabelReport",
    "LabelledBatch",
    "MissingExtraError",
    "SamplingConfig",
    "StabilityMonitor",
    "Task",
    "TrainConfig",
    "TrainResult",
    "error_metrics",
    "evaluate_dataset",
    "fit_energy_reference",
    "from_dict",
    "g2_chno",
    "get_teacher",
    "grouped_error_metrics",
    "label",
    "label_parallel",
    "label_watched",
    "learning_curve_plot",
    "load_seeds",
    "load_yaml",
    "make_tasks",
    "md_step_timing",
    "npt_berendsen",
    "npt_run",
    "nve_drift",
    "parity_plot",
    "predict_frames",
    "pressure_curve",
    "read_frames",
    "run_task",
    "split_frames",
    "stability_run",
    "student_forward",
    "to_dict",
    "train",
]


__getattr__, __dir__ = _lazy.attach(__name__, _EXPORTS, __all__)

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, eagerly
    from mlff_distiller.distill.config import from_dict, load_yaml, to_dict
    from mlff_distiller.distill.dataset import FrameDataset, LabelledBatch, fit_energy_reference, split_frames
    from mlff_distiller.distill.evaluation import (
        learning_curve_plot,
        md_step_timing,
        npt_berendsen,
        npt_run,
        nve_drift,
        parity_plot,
        pressure_curve,
    )
    from mlff_distiller.distill.label_processes import label_parallel, label_watched
    from mlff_distiller.distill.labelling import FrameStore, LabelReport, label, read_frames
    from mlff_distiller.distill.metrics import error_metrics, grouped_error_metrics, predict_frames
    from mlff_distiller.distill.sampling import Deduplicator, SamplingConfig, Task, make_tasks, run_task
    from mlff_distiller.distill.seeds import g2_chno, load_seeds
    from mlff_distiller.distill.stability import StabilityMonitor, stability_run
    from mlff_distiller.distill.teachers import TEACHERS, MissingExtraError, get_teacher
    from mlff_distiller.distill.training import TrainConfig, TrainResult, evaluate_dataset, student_forward, train
