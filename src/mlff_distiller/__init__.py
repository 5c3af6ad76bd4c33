"""mlff-distiller: distil slow teacher force fields into fast PaiNN-class students.

Public API: :class:`StudentModel`, :func:`load_model`, :func:`predict_forces`, :func:`predict_file` (a structures
file to extxyz, resumable), :class:`ForceEngine`, :class:`StudentCalculator`, :class:`AtomsBatch`,
:class:`FrameTable` (many structures as arrays, predicted without an ``ase.Atoms`` each); :class:`BatchedMD`
(many MD trajectories, one engine call per step); :func:`relax_batch` (many FIRE relaxations at once),
:func:`relax_arrays` (the same, its results as arrays), :func:`relax_file` (a structures file relaxed to extxyz,
resumable);
:class:`NonFiniteOutputError` (a NaN or inf output, never returned). Kernel backends:
``MLFF_DISTILLER_KERNELS=auto|triton|torch``.

The names above, and the subpackages, are imported on first use (PEP 562), as SciPy and scikit-learn do:
``import mlff_distiller`` itself imports neither torch nor ASE, so the command line's ``--help`` (0.1 s instead of
4.9 s on the H100 host) and the extxyz worker processes of ``predict_file`` (12 in 0.6 s instead of 7.9 s) start
without it (``benchmarks/results/predict_cli_h100.md``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlff_distiller import _lazy

__version__ = "0.1.0"

# The student that the command line, ``make demo`` and the examples use when none is named: the 64 x 3 student.
# Since stop 85 it is the more accurate of the two shipped students on their held-out frames (force MAE 18.29
# against 18.76 meV/Å, RMSE 32.5 against 36.4; energy MAE 0.572 against 0.559 meV/atom) and the faster one: it meets
# every target of issue 5 (a molecule's dense step serves students of up to 64 features, ``DENSE_MAX_HIDDEN``).
# ``builtin:chno-gfn2`` (128 x 3) stays shipped under its name. A plain string: no import.
DEFAULT_MODEL = "builtin:chno-gfn2-small"

# public name -> the module that defines it
_EXPORTS = {
    "AtomsBatch": "mlff_distiller.batch",
    "BatchedMD": "mlff_distiller.batched_md",
    "FrameTable": "mlff_distiller.frames",
    "NonFiniteOutputError": "mlff_distiller.batching",
    "StudentCalculator": "mlff_distiller.calculator",
    "builtin_models": "mlff_distiller.checkpoint",
    "load_model": "mlff_distiller.checkpoint",
    "ForceEngine": "mlff_distiller.engine",
    "ModelConfig": "mlff_distiller.model",
    "StudentModel": "mlff_distiller.model",
    "predict_forces": "mlff_distiller.predict",
    "predict_file": "mlff_distiller.predict_stream",
    "relax_arrays": "mlff_distiller.batched_relax",
    "relax_batch": "mlff_distiller.batched_relax",
    "relax_file": "mlff_distiller.relax_stream",
}

__all__ = [
    "DEFAULT_MODEL",
    "AtomsBatch",
    "BatchedMD",
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
    "relax_arrays",
    "relax_batch",
    "relax_file",
]


__getattr__, __dir__ = _lazy.attach(__name__, _EXPORTS, __all__)

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, eagerly
    from mlff_distiller.batch import AtomsBatch
    from mlff_distiller.batched_md import BatchedMD
    from mlff_distiller.batched_relax import relax_arrays, relax_batch
    from mlff_distiller.batching import NonFiniteOutputError
    from mlff_distiller.calculator import StudentCalculator
    from mlff_distiller.checkpoint import builtin_models, load_model
    from mlff_distiller.engine import ForceEngine
    from mlff_distiller.frames import FrameTable
    from mlff_distiller.model import ModelConfig, StudentModel
    from mlff_distiller.predict import predict_forces
    from mlff_distiller.predict_stream import predict_file
    from mlff_distiller.relax_stream import relax_file
