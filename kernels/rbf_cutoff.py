"""Radial basis × smooth cutoff: distances ``[E]`` → ``[E, n_rbf]``.

Bases (``basis``):
  * ``bessel``   b_k(d) = sqrt(2/rc) · sin(k π d / rc) / d,   k = 1..n  (the PaiNN/DimeNet basis; finite at d → 0,
                 where it tends to sqrt(2/rc) · k π / rc; we switch to the Taylor series below ``_SMALL``).
  * ``gaussian`` b_k(d) = exp(-γ (d - μ_k)²),  μ_k = k · rc / (n - 1),  γ = 1 / (2 (rc / (n - 1))²)  (SchNet).
Envelopes (``envelope``), x = d / rc, zero for x ≥ 1:
  * ``cosine``     f(x) = ½ (cos(π x) + 1)  (value and slope vanish at the cutoff)
  * ``polynomial`` f(x) = 1 − (p+1)(p+2)/2 xᵖ + p(p+2) xᵖ⁺¹ − p(p+1)/2 xᵖ⁺²,  p = 6  (nequip/DimeNet; C² at rc)
The op returns b_k(d) · f(d). This file holds the torch reference (the CPU path, the test oracle and the
specification); the Triton kernels plug in through :func:`rbf_cutoff`.
"""

from __future__ import annotations

import math

import torch

from ._backend import resolve_backend

__all__ = ["BASES", "ENVELOPES", "rbf_cutoff", "rbf_cutoff_reference"]

BASES = ("bessel", "gaussian")
ENVELOPES = ("cosine", "polynomial")
POLY_P = 6
# Below this distance (Å) the Bessel basis uses sin(x)/d ≈ k·π/rc · (1 − x²/6); the error there is < 1e-14 relative.
_SMALL = 1e-4


def _check_args(n_rbf: int, cutoff: float, basis: str, envelope: str) -> None:
    if basis not in BASES:
        raise ValueError(f"unknown radial basis {basis!r}; choose one of {BASES}")
    if envelope not in ENVELOPES:
        raise ValueError(f"unknown cutoff envelope {envelope!r}; choose one of {ENVELOPES}")
    if n_rbf < 1:
        raise ValueError(f"n_rbf must be >= 1, got {n_rbf}")
    if not cutoff > 0:
        raise ValueError(f"cutoff must be > 0, got {cutoff}")


def envelope_reference(dist: torch.Tensor, cutoff: float, envelope: str) -> torch.Tensor:
    """The smooth cutoff f(d) ``[E]``; exactly zero for d ≥ cutoff."""
    x = dist / cutoff
    inside = x < 1.0
    if envelope == "cosine":
        f = 0.5 * (torch.cos(math.pi * x) + 1.0)
    else:
        p = POLY_P
        f = 1.0 - (p + 1) * (p + 2) / 2 * x**p + p * (p + 2) * x ** (p + 1) - p * (p + 1) / 2 * x ** (p + 2)
    return torch.where(inside, f, torch.zeros_like(f))


def basis_reference(dist: torch.Tensor, n_rbf: int, cutoff: float, basis: str) -> torch.Tensor:
    """The radial basis without envelope ``[E, n_rbf]``."""
    d = dist.unsqueeze(-1)
    if basis == "bessel":
        k = torch.arange(1, n_rbf + 1, device=dist.device, dtype=dist.dtype) * (math.pi / cutoff)
        norm = math.sqrt(2.0 / cutoff)
        small = d < _SMALL
        # Double where: neither branch sees an input where it would produce inf/NaN (or NaN gradients).
        d_big = torch.where(small, torch.ones_like(d), d)
        d_small = torch.where(small, d, torch.zeros_like(d))
        big_val = torch.sin(k * d_big) / d_big
        small_val = k * (1.0 - (k * d_small) ** 2 / 6.0)
        return norm * torch.where(small, small_val, big_val)
    mu = torch.linspace(0.0, cutoff, n_rbf, device=dist.device, dtype=dist.dtype)
    width = cutoff / max(n_rbf - 1, 1)
    gamma = 0.5 / width**2
    return torch.exp(-gamma * (d - mu) ** 2)


def rbf_cutoff_reference(
    dist: torch.Tensor, n_rbf: int, cutoff: float, basis: str = "bessel", envelope: str = "cosine"
) -> torch.Tensor:
    """Torch reference of :func:`rbf_cutoff`: ``[E]`` distances (Å) → ``[E, n_rbf]``."""
    _check_args(n_rbf, cutoff, basis, envelope)
    return basis_reference(dist, n_rbf, cutoff, basis) * envelope_reference(dist, cutoff, envelope).unsqueeze(-1)


def rbf_cutoff(
    dist: torch.Tensor, n_rbf: int, cutoff: float, basis: str = "bessel", envelope: str = "cosine"
) -> torch.Tensor:
    """Radial basis × smooth cutoff for distances ``dist [E]`` (Å) → ``[E, n_rbf]``; differentiable twice."""
    if resolve_backend(dist.device) == "triton":
        _check_args(n_rbf, cutoff, basis, envelope)
        return _rbf_cutoff_triton(dist, n_rbf, cutoff, basis, envelope)
    return rbf_cutoff_reference(dist, n_rbf, cutoff, basis, envelope)


def _rbf_cutoff_triton(dist, n_rbf, cutoff, basis, envelope):  # replaced by the Triton path (issue 3)
    raise RuntimeError("the Triton rbf_cutoff kernel is not built yet; use MLFF_DISTILLER_KERNELS=torch")
