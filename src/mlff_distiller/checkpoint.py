"""Checkpoints: ``model.save(path)`` / ``load_model(path)``.

A checkpoint is a plain dict of tensors, numbers and strings written by ``torch.save`` and read back with
``torch.load(..., weights_only=True)``: loading a checkpoint never runs code from it.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import torch

from mlff_distiller.model import ModelConfig, StudentModel

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "builtin_models", "builtin_path", "load_model", "save_checkpoint"]

FORMAT_NAME = "mlff-distiller-student"
FORMAT_VERSION = 1
_REQUIRED = ("format", "format_version", "config", "state_dict", "species", "cutoff")
_BUILTIN_DIR = Path(__file__).parent / "data"


def save_checkpoint(model: StudentModel, path: str | Path, metadata: dict | None = None) -> None:
    """Write ``model`` to ``path`` atomically (a crash mid-write leaves any older file intact)."""
    path = Path(path)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    payload = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "config": model.config_dict(),
        "state_dict": state,
        "species": list(model.config.species),
        "cutoff": float(model.config.cutoff),
        "dtype": str(next(iter(state.values())).dtype).removeprefix("torch."),
        "metadata": dict(metadata or {}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def builtin_models() -> list[str]:
    """Names usable as ``load_model("builtin:<name>")``."""
    return sorted(p.stem for p in _BUILTIN_DIR.glob("*.pt"))


def builtin_path(spec: str) -> Path:
    """The file of a built-in student ``"builtin:<name>"`` (which may not exist)."""
    return _BUILTIN_DIR / f"{spec.split(':', 1)[1]}.pt"


def load_model(path: str | Path, *, device: torch.device | str | None = None) -> StudentModel:
    """Load a student from a checkpoint file or ``"builtin:<name>"``; the model is returned in eval mode.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for a corrupt file, a missing key or a
    format newer than this version of mlff-distiller understands.
    """
    if isinstance(path, str) and path.startswith("builtin:"):
        target = builtin_path(path)
        if not target.exists():
            raise ValueError(f"no built-in model {path.split(':', 1)[1]!r}; available: {builtin_models()}")
        path = target
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, RuntimeError, OSError) as exc:
        raise ValueError(
            f"{path} is not a readable mlff-distiller checkpoint (corrupt or not a checkpoint): {exc}"
        ) from exc
    if not isinstance(payload, dict):
        raise ValueError(f"{path} is not an mlff-distiller checkpoint (top level is {type(payload).__name__})")
    missing = [k for k in _REQUIRED if k not in payload]
    if missing:
        raise ValueError(f"{path} is missing checkpoint key(s) {missing}")
    if payload["format"] != FORMAT_NAME:
        raise ValueError(f"{path} has format {payload['format']!r}, expected {FORMAT_NAME!r}")
    version = int(payload["format_version"])
    if version > FORMAT_VERSION:
        raise ValueError(
            f"{path} has checkpoint format version {version}, newer than this mlff-distiller understands "
            f"({FORMAT_VERSION}); upgrade mlff-distiller"
        )
    try:
        model = StudentModel(ModelConfig(**payload["config"]))
    except TypeError as exc:
        raise ValueError(f"{path} has an invalid model config: {exc}") from exc
    state = payload["state_dict"]
    dtype = next(iter(state.values())).dtype if state else torch.float32
    model = model.to(dtype)
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"{path}: weights do not match the config (missing {result.missing_keys[:5]}, "
            f"unexpected {result.unexpected_keys[:5]})"
        )
    model.metadata = dict(payload.get("metadata", {}))
    model.eval()
    return model if device is None else model.to(device)
