"""Distillation: teachers, sampling, resumable labelling, datasets, force-matching training, evaluation.

Typical flow::

    from mlff_distiller.distill import SamplingConfig, TrainConfig, label, read_frames, split_frames, train
    label(seeds, "gfn2-xtb", "data/run1", SamplingConfig(temperatures=[300, 600]))
    train_frames, val_frames = split_frames(read_frames("data/run1"), 0.1)
    result = train(train_frames, val_frames, TrainConfig(), "runs/run1")
"""

from mlff_distiller.distill.config import from_dict, load_yaml, to_dict
from mlff_distiller.distill.dataset import FrameDataset, LabelledBatch, fit_energy_reference, split_frames
from mlff_distiller.distill.evaluation import (
    error_metrics,
    learning_curve_plot,
    md_step_timing,
    npt_berendsen,
    npt_run,
    nve_drift,
    parity_plot,
    predict_frames,
    pressure_curve,
)
from mlff_distiller.distill.labelling import FrameStore, LabelReport, label, label_parallel, read_frames
from mlff_distiller.distill.sampling import Deduplicator, SamplingConfig, Task, make_tasks, run_task
from mlff_distiller.distill.seeds import g2_chno, load_seeds
from mlff_distiller.distill.stability import StabilityMonitor, stability_run
from mlff_distiller.distill.teachers import TEACHERS, MissingExtraError, get_teacher
from mlff_distiller.distill.training import TrainConfig, TrainResult, evaluate_dataset, student_forward, train

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
    "label",
    "label_parallel",
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
