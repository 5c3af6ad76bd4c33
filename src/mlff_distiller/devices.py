"""Which device to run on: the default, and a check of a requested one that fails with a clear ``ValueError``."""

from __future__ import annotations

import torch

__all__ = ["KeptCopies", "default_device", "resolve_device"]


def default_device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: torch.device | str | None) -> torch.device:
    """The device to run on: ``None`` or ``"auto"`` → :func:`default_device`; else ``"cpu"``, ``"cuda"`` or
    ``"cuda:<index>"``, checked here so that a wrong one is a ``ValueError`` that says what is available, not an
    error from deep inside torch at the first tensor."""
    if device is None or device == "auto":
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:<index>'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: mlff-distiller runs on 'cpu' or 'cuda'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "no CUDA device visible"
            raise ValueError(
                f"device {str(device)!r} requested but CUDA is not available (torch {torch.__version__}: {build}); "
                "use device='cpu', or leave device unset to take CUDA when there is one"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {str(device)!r} requested but only {count} CUDA device(s) are visible")
    return dev


class KeptCopies:
    """Copies of some tensors on a device, made again only for other tensors: the very same tensor objects, not
    modified in place since (identity and ``_version``), get the copies made before. For inputs that MD passes
    unchanged step after step (a box's cell, pbc, atomic numbers), whose copy from the host to a GPU would each time
    be a wait for the device."""

    __slots__ = ("_copies", "_device", "_seen")

    def __init__(self) -> None:
        self._device: torch.device | None = None
        self._seen: tuple = ()
        self._copies: tuple = ()

    def __call__(self, tensors: tuple, device: torch.device) -> tuple:
        seen = self._seen
        if (
            device == self._device
            and len(tensors) == len(seen)
            and all(t is s and t._version == v for t, (s, v) in zip(tensors, seen, strict=True))
        ):
            return self._copies
        self._copies = tuple(t.to(device) for t in tensors)
        self._seen = tuple((t, t._version) for t in tensors)
        self._device = device
        return self._copies
