"""PaiNN message step: sender features, radial filter and edge directions → per-receiver scalar/vector updates.

For edge e = (i ← j) with radial basis r_e ``[R]`` (already × cutoff) and unit vector u_e ``[3]``:
    W_e      = filter_weight @ r_e                        ``[3F]`` (no bias, so messages vanish at the cutoff)
    φ_e      = x_j ⊙ W_e  = (a_e, b_e, c_e)               three ``[F]`` blocks
    Δs_i     = Σ_e a_e                                      ``[N, F]``
    Δv_i     = Σ_e b_e ⊙ v_j + c_e ⊗ u_e                   ``[N, 3, F]``
The torch reference materialises ``[E, 3F]``; a fused kernel (issue 7) builds W_e on the fly per receiver.
"""

from __future__ import annotations

import torch

__all__ = ["message_passing", "message_passing_reference"]


def message_passing_reference(
    x: torch.Tensor,
    v: torch.Tensor,
    rbf: torch.Tensor,
    filter_weight: torch.Tensor,
    unit: torch.Tensor,
    edge_index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference. ``x [N,3F]``, ``v [N,3,F]``, ``rbf [E,R]``, ``filter_weight [3F,R]``, ``unit [E,3]``,
    ``edge_index [2,E]`` (row 0 receiver i, row 1 sender j) → ``ds [N,F]``, ``dv [N,3,F]``."""
    n, f = v.shape[0], v.shape[2]
    i, j = edge_index[0], edge_index[1]
    phi = x.index_select(0, j) * (rbf @ filter_weight.t())
    a, b, c = torch.split(phi, f, dim=-1)
    ds = torch.zeros((n, f), dtype=x.dtype, device=x.device).index_add(0, i, a)
    dv_e = b.unsqueeze(1) * v.index_select(0, j) + c.unsqueeze(1) * unit.unsqueeze(-1)
    dv = torch.zeros((n, 3, f), dtype=v.dtype, device=v.device).index_add(0, i, dv_e)
    return ds, dv


def message_passing(
    x: torch.Tensor,
    v: torch.Tensor,
    rbf: torch.Tensor,
    filter_weight: torch.Tensor,
    unit: torch.Tensor,
    edge_index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PaiNN message aggregation (see module docstring); the fused Triton kernel is issue 7."""
    return message_passing_reference(x, v, rbf, filter_weight, unit, edge_index)
