"""Precision modes of the force engine: the model dtype and TF32 flag per mode, the 16-bit matmul copies of
the model for ``bf16``/``fp16``, capability detection with fallback, and the documented tolerances vs fp64
(see :mod:`mlff_distiller.engine` for what each mode keeps in float32)."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

import torch

from mlff_distiller.kernels._precision import matmul_dtype as kernels_matmul_dtype
from mlff_distiller.model import StudentModel

__all__ = ["AUTOCAST", "PRECISIONS", "TOLERANCES"]

# Model/positions dtype and whether float32 matmuls may use TF32 tensor cores.
PRECISIONS: dict[str, tuple[torch.dtype, bool]] = {
    "fp64": (torch.float64, False),
    "fp32": (torch.float32, False),
    "tf32": (torch.float32, True),
    "bf16": (torch.float32, False),
    "fp16": (torch.float32, False),
}
# Precisions whose MLP matmuls run in a 16-bit type (everything else stays float32).
AUTOCAST: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Accepted deviation from fp64 per precision: (energy, forces) relative to max(1, |E|) and max(1, max|F|),
# i.e. |ΔE| ≤ tol_E·max(1 eV, |E|) and max|ΔF| ≤ tol_F·max(1 eV/Å, max|F|). fp32 is bounded by float32 rounding
# over ~10² accumulations; tf32 keeps 10 mantissa bits in matmul inputs, fp16 10 and bf16 7 (with float32
# accumulation), hence the looser bounds.
TOLERANCES: dict[str, tuple[float, float]] = {
    "fp64": (1e-12, 1e-10),
    "fp32": (1e-5, 1e-4),
    "tf32": (5e-3, 3e-2),
    "bf16": (3e-2, 1.5e-1),
    "fp16": (5e-3, 3e-2),
}


def _resolve_precision(precision: str, device: torch.device) -> str:
    """The precision that can run on ``device``: warns and falls back to fp32 when it cannot."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {sorted(PRECISIONS)}")
    why = None
    if device.type == "cuda" and precision in ("bf16", "tf32"):
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            why = f"{precision} needs compute capability 8.0+ (sm80), this GPU is sm{major}{minor}"
    elif precision in AUTOCAST:
        try:
            one = torch.ones(1, 2, dtype=AUTOCAST[precision], device=device)
            torch.nn.functional.linear(one, torch.ones(2, 2, dtype=one.dtype, device=device))
        except (RuntimeError, NotImplementedError, TypeError):
            why = f"{precision} matmuls are not supported on {device} by this build of torch"
    if why is None:
        return precision
    warnings.warn(f"{why}; falling back to fp32", RuntimeWarning, stacklevel=3)
    return "fp32"


@contextlib.contextmanager
def _matmul_precision(allow_tf32: bool, kernel_matmul_dtype: torch.dtype | None = None) -> Iterator[None]:
    """TF32 on or off for torch's and our float32 dots, and the 16-bit type of the Triton GEMMs (None: float32)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    try:
        with kernels_matmul_dtype(kernel_matmul_dtype):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


class _ReducedLinear(torch.nn.Module):
    """An ``nn.Linear`` whose matmul runs with 16-bit inputs and weights (float32 accumulation in cuBLAS);
    it takes and returns the surrounding float dtype, so feature streams stay float32."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", linear.weight.detach().to(dtype))
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def _reduced_precision_copy(model: StudentModel, dtype: torch.dtype) -> StudentModel:
    """A copy of ``model`` whose MLP/mixing ``nn.Linear`` layers run in ``dtype``. The radial filters (used
    through their ``.weight`` by the message-passing kernel) stay in the model's dtype."""
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and name != "filter":
                setattr(parent, name, _ReducedLinear(child, dtype))
    return model
