"""mlff-distiller: distil slow teacher force fields into fast PaiNN-class students.

Public API: :class:`StudentModel`, :func:`load_model`, :func:`predict_forces`, :func:`predict_file` (a structures
file to extxyz, resumable), :class:`ForceEngine`, :class:`StudentCalculator`, :class:`AtomsBatch`,
:class:`FrameTable` (many structures as arrays, predicted without an ``ase.Atoms`` each); :class:`NonFiniteOutputError`
(a NaN or inf output, never returned). Kernel backends: ``MLFF_DISTILLER_KERNELS=auto|triton|torch``.
"""

from mlff_distiller.batch import AtomsBatch, FrameTable
from mlff_distiller.batching import NonFiniteOutputError
from mlff_distiller.calculator import StudentCalculator
from mlff_distiller.checkpoint import builtin_models, load_model
from mlff_distiller.engine import ForceEngine
from mlff_distiller.model import ModelConfig, StudentModel
from mlff_distiller.predict import predict_forces
from mlff_distiller.predict_stream import predict_file

__version__ = "0.1.0"


__all__ = [
    "AtomsBatch",
    "ForceEngine",
    "FrameTable",
    "ModelConfig",
    "NonFiniteOutputError",
    "StudentCalculator",
    "StudentModel",
    "__version__",
    "builtin_models",
    "load_model",
    "predict_file",
    "predict_forces",
]
