"""Output buffers a caller hands to the kernels of one step: the engine's packed ``[energy | atomic | forces]``.

A captured step ends with one tensor holding the energies, the atomic energies and the forces, so that the host
reads it in one copy. Made by ``torch.cat`` of the three, that is a torch launch at the very end of the step, after
the last Triton kernel. Inside :func:`step_outputs` the kernels that make the three write them into the caller's
views instead (each taken once, where shape, dtype and device match):

* ``"energy"`` ``[B]`` and ``"atomic"`` ``[N]``: the Triton readout (:func:`.linear.readout`) with the wall added
  into its own outputs (``linear._CONFIG["readout_wall"]``; the separate wall op makes new tensors);
* ``"grad_pos"`` ``[N, 3]``: the buffer that ``edge_basis``'s forward kernel zeroes for its backward's position
  gradient (``edge_features._OPTIONS["zero_in_forward"]``), which autograd then hands back as the forces.

The caller checks by address which of them were written in place (anything else, e.g. another path of the model,
leaves its buffer untouched) and packs the rest itself.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_OUTPUTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("mlff_distiller_step_outputs", default=None)


@contextlib.contextmanager
def step_outputs(**views: torch.Tensor):
    """Hand ``views`` (names above) to the kernels of the step run inside the ``with``."""
    token = _OUTPUTS.set(dict(views))
    try:
        yield
    finally:
        _OUTPUTS.reset(token)


def take(name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
    """The view handed in under ``name`` if it has ``shape`` and ``like``'s dtype and device (then it is taken: a
    second request gets None), else None."""
    views = _OUTPUTS.get()
    if not views:
        return None
    t = views.get(name)
    if t is None or tuple(t.shape) != tuple(shape) or t.dtype != like.dtype or t.device != like.device:
        return None
    if not t.is_contiguous():
        return None
    views[name] = None
    return t
