"""Kernel backend selection: ``auto | triton | torch``.

The backend is read from ``MLFF_DISTILLER_KERNELS`` (default ``auto``) and may be overridden from Python with
:func:`set_backend` or the :func:`use_backend` context manager. ``auto`` picks Triton for CUDA tensors when Triton
imports, and the torch reference otherwise. ``triton`` on a CPU tensor runs only under the Triton interpreter
(``TRITON_INTERPRET=1``); anywhere else asking for it is a clear error rather than a silent fallback.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

__all__ = ["BACKENDS", "get_backend", "resolve_backend", "set_backend", "triton_available", "use_backend"]

BACKENDS = ("auto", "triton", "torch")
_ENV = "MLFF_DISTILLER_KERNELS"
_override: str | None = None


def _check(name: str) -> str:
    name = name.strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {BACKENDS} (env {_ENV})")
    return name


def get_backend() -> str:
    """The requested backend: the Python override if set, else ``$MLFF_DISTILLER_KERNELS``, else ``auto``."""
    if _override is not None:
        return _override
    return _check(os.environ.get(_ENV, "auto") or "auto")


def set_backend(name: str | None) -> None:
    """Set the backend for this process (``None`` returns control to the environment variable)."""
    global _override
    _override = None if name is None else _check(name)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Temporarily select a backend: ``with use_backend("torch"): ...``."""
    global _override
    old = _override
    _override = _check(name)
    try:
        yield
    finally:
        _override = old


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available(device: torch.device | str) -> bool:
    """Whether Triton kernels can run on tensors of ``device`` in this process."""
    device = torch.device(device)
    if not _triton_importable():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and interpreter_enabled()


# resolve_backend's answers by (requested backend, device type, TRITON_INTERPRET): every kernel call asks, and the
# full rule (device parsing, an import check, environment reads) cost ~15 µs of a ~70 µs forward's host time.
_RESOLVED: dict[tuple, str] = {}


# The environment as os.environ keeps it: on POSIX a dict of bytes that os.environ updates in place on every change
# made through it (os.environ[...] = ..., del, pytest's monkeypatch). os.environ.get encodes the key and decodes the
# value on each call, ~1.5 µs on the GPU host; resolve_backend reads two variables per call (every kernel call, and
# the MD step's dense-step check: results/stop78_gpu/c/). The raw values key the memo instead; elsewhere (no such
# dict, or os.environ itself replaced by another object since import) os.environ.get as before.
_ENVIRON = os.environ
_ENV_BYTES = getattr(_ENVIRON, "_data", None) if os.name == "posix" else None
if not (isinstance(_ENV_BYTES, dict) and isinstance(next(iter(_ENV_BYTES), b""), bytes)):
    _ENV_BYTES = None
_ENV_KEY, _INTERPRET_KEY = _ENV.encode(), b"TRITON_INTERPRET"


def resolve_backend(device: torch.device | str) -> str:
    """The backend that will actually run for tensors on ``device``: ``"triton"`` or ``"torch"``."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    env = _ENV_BYTES
    if env is not None and os.environ is _ENVIRON:
        key = (_override, env.get(_ENV_KEY), kind, env.get(_INTERPRET_KEY))
    else:
        key = (_override, os.environ.get(_ENV), kind, os.environ.get("TRITON_INTERPRET"))
    hit = _RESOLVED.get(key)
    if hit is None:
        hit = _RESOLVED[key] = _resolve(torch.device(kind))  # errors propagate and are not cached
    return hit


# torch.compile traces resolve_backend inside every kernel call. Through the memo, Dynamo guarded on the memo's
# contents: a compile that found its key missing (the first in a fresh process) recompiled at the next call, once the
# key was there (tests/test_engine_modes.py, the recompile counter, failed in a fresh process). Marked as a constant
# result (the attribute torch.compiler.assume_constant_result sets; calling that would import Dynamo at our import),
# the answer is baked into the graph with no guard on the memo. A compiled graph keeps the backend it was traced
# with, as a compiled engine does anyway.
resolve_backend._dynamo_marked_constant = True


def _resolve(device: torch.device) -> str:
    requested = get_backend()
    if requested == "torch":
        return "torch"
    if requested == "auto":
        return "triton" if device.type == "cuda" and triton_available(device) else "torch"
    if not triton_available(device):
        why = (
            "triton is not installed"
            if not _triton_importable()
            else f"Triton kernels need a CUDA device (got {device.type}); on CPU set TRITON_INTERPRET=1"
        )
        raise RuntimeError(f"kernel backend 'triton' was requested but cannot run here: {why}")
    return "triton"
