"""Edge geometry: positions ``[N,3]``, ``edge_index [2,E]``, shift vectors ``[E,3]`` → vectors, distances, unit vectors.

Convention (the same as ``ase.neighborlist.neighbor_list('ijS')``): ``edge_index[0]`` is the centre/receiver i,
``edge_index[1]`` the neighbour/sender j, and ``vec = pos[j] − pos[i] + shift_vector``. At ``vec = 0`` (two
coincident atoms) the distance is 0, the unit vector is 0 and every gradient is finite: no NaN.

This file holds the torch reference; :func:`edge_features` and :func:`edge_basis` (edge features fused with the
radial basis × cutoff) dispatch to Triton when the backend says so.
"""

from __future__ import annotations

import torch

from ._backend import resolve_backend
from .rbf_cutoff import _check_args, rbf_cutoff_reference

__all__ = ["edge_basis", "edge_basis_reference", "edge_features", "edge_features_reference"]

# Squared distance (Å²) below which an edge counts as zero-length.
_TINY2 = 1e-20


def edge_features_reference(
    positions: torch.Tensor, edge_index: torch.Tensor, shift_vectors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference: returns ``vec [E,3]`` (Å), ``dist [E]`` (Å), ``unit [E,3]``."""
    i, j = edge_index[0], edge_index[1]
    vec = positions.index_select(0, j) - positions.index_select(0, i) + shift_vectors
    d2 = (vec * vec).sum(-1)
    nonzero = d2 > _TINY2
    # Double where keeps sqrt'(0) = inf out of the graph.
    dist = torch.where(nonzero, torch.sqrt(torch.where(nonzero, d2, torch.ones_like(d2))), torch.zeros_like(d2))
    unit = vec / torch.where(nonzero, dist, torch.ones_like(dist)).unsqueeze(-1)
    return vec, dist, unit


def edge_basis_reference(
    positions: torch.Tensor,
    edge_index: torch.Tensor,
    shift_vectors: torch.Tensor,
    n_rbf: int,
    cutoff: float,
    basis: str = "bessel",
    envelope: str = "cosine",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of the fused op: ``dist [E]``, ``unit [E,3]``, ``rbf [E,n_rbf]`` (basis × cutoff)."""
    _, dist, unit = edge_features_reference(positions, edge_index, shift_vectors)
    return dist, unit, rbf_cutoff_reference(dist, n_rbf, cutoff, basis, envelope)


def edge_features(
    positions: torch.Tensor, edge_index: torch.Tensor, shift_vectors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Edge vectors ``[E,3]``, distances ``[E]`` and unit vectors ``[E,3]``; differentiable twice."""
    if resolve_backend(positions.device) == "triton":
        return _edge_features_triton(positions, edge_index, shift_vectors)
    return edge_features_reference(positions, edge_index, shift_vectors)


def edge_basis(
    positions: torch.Tensor,
    edge_index: torch.Tensor,
    shift_vectors: torch.Tensor,
    n_rbf: int,
    cutoff: float,
    basis: str = "bessel",
    envelope: str = "cosine",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Edge features fused with the radial basis × cutoff: ``dist [E]``, ``unit [E,3]``, ``rbf [E,n_rbf]``."""
    _check_args(n_rbf, cutoff, basis, envelope)
    if resolve_backend(positions.device) == "triton":
        return _edge_basis_triton(positions, edge_index, shift_vectors, n_rbf, cutoff, basis, envelope)
    return edge_basis_reference(positions, edge_index, shift_vectors, n_rbf, cutoff, basis, envelope)


def _edge_features_triton(positions, edge_index, shift_vectors):  # replaced by the Triton path (issue 3)
    raise RuntimeError("the Triton edge_features kernel is not built yet; use MLFF_DISTILLER_KERNELS=torch")


def _edge_basis_triton(positions, edge_index, shift_vectors, n_rbf, cutoff, basis, envelope):
    raise RuntimeError("the Triton edge_basis kernel is not built yet; use MLFF_DISTILLER_KERNELS=torch")
