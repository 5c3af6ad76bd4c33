"""A PaiNN model's per-atom inputs from the atomic numbers in one launch: species index, embedding, first φ, v = 0.

The model's forward starts with four small torch kernels per step: the species lookup ``z_to_index[numbers]``, the
embedding gather, the zero fill of the vector features v, and (small molecules) the gather of the first layer's φ
rows from the species table (``StudentModel.first_phi_table``). For one molecule each costs a launch of ~1 µs and,
being torch kernels, breaks the chain of programmatic dependent launches between the Triton kernels around them
(benchmarks/results/stop46_gpu/probe_kernel_order.md). With frozen weights (inference) none of them needs a
gradient, so :func:`species_inputs` writes all four outputs in one Triton kernel; :func:`species_inputs_reference`
is the same in torch ops (the specification, and the path everywhere else).

Unknown atomic numbers (``z_to_index`` -1) are the caller's to refuse first (``StudentModel.check_species``, which
``ForceEngine`` runs on every new batch); the kernel reads no table row out of bounds for them, and writes NaN
embedding rows, so that a caller that skipped the check gets a non-finite energy, not a plausible wrong one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._backend import resolve_backend
from ._triton_utils import (
    HAS_TRITON,
    cdiv,
    check_launchable,
    next_pow2,
    pdl_args,
    pdl_prologue,
    tl,
    triton,
    unspecialized,
)

__all__ = ["species_inputs", "species_inputs_fusable", "species_inputs_reference"]

_CONFIG = {"block_a": 16, "num_warps": 4}


def species_inputs_reference(
    numbers: Tensor, z_to_index: Tensor, embedding: Tensor, phi_table: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(idx [N], s [N, F], v [N, 3, F] zeros, φ [N, 3F] or None)``: ``idx = z_to_index[numbers]``, ``s =
    embedding[idx]``, ``φ = phi_table[idx]`` (when given)."""
    idx = z_to_index[numbers]
    s = embedding.index_select(0, idx)
    v = torch.zeros((s.shape[0], 3, s.shape[1]), dtype=s.dtype, device=s.device)
    return idx, s, v, (None if phi_table is None else phi_table.index_select(0, idx))


def species_inputs_fusable(numbers: Tensor, embedding: Tensor, phi_table: Tensor | None = None) -> bool:
    """Whether :func:`species_inputs` runs the kernel: the Triton backend for the device, no gradient wanted for
    the tables (inference), not inside torch.compile, float32 on the GPU (float64 too under the interpreter), the
    tables on the numbers' device."""
    tables = (embedding,) if phi_table is None else (embedding, phi_table)
    if torch.compiler.is_compiling() or embedding.dtype not in (torch.float32, torch.float64):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tables):
        return False
    if any(t.device != numbers.device or t.dtype != embedding.dtype for t in tables):
        return False
    if numbers.is_cuda and embedding.dtype != torch.float32:
        return False
    return resolve_backend(numbers.device) == "triton"


def species_inputs(
    numbers: Tensor, z_to_index: Tensor, embedding: Tensor, phi_table: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """:func:`species_inputs_reference` in one Triton kernel where :func:`species_inputs_fusable`, else in torch."""
    if phi_table is not None and phi_table.shape[1] != 3 * embedding.shape[1]:
        raise ValueError(
            f"species_inputs: phi_table is {list(phi_table.shape)}, not [species, 3 x {embedding.shape[1]}]"
        )
    if not species_inputs_fusable(numbers, embedding, phi_table):
        return species_inputs_reference(numbers, z_to_index, embedding, phi_table)
    n, f = numbers.shape[0], embedding.shape[1]
    dev, dt = numbers.device, embedding.dtype
    idx = torch.empty(n, dtype=z_to_index.dtype, device=dev)
    s = torch.empty((n, f), dtype=dt, device=dev)
    v = torch.empty((n, 3, f), dtype=dt, device=dev)
    phi = None if phi_table is None else torch.empty((n, phi_table.shape[1]), dtype=dt, device=dev)
    if n == 0:
        return idx, s, v.zero_(), phi
    numbers, z_to_index, embedding = numbers.contiguous(), z_to_index.contiguous(), embedding.contiguous()
    table = embedding if phi_table is None else phi_table.contiguous()
    check_launchable(_species_inputs_kernel, numbers)
    block_a = _CONFIG["block_a"]
    _species_inputs_kernel[(cdiv(n, block_a),)](
        numbers, z_to_index, embedding, table, idx, s, v, s if phi is None else phi, n, z_to_index.shape[0],
        F=f, F_PAD=next_pow2(f), HAS_PHI=phi is not None, BLOCK_A=block_a,
        num_warps=_CONFIG["num_warps"], **pdl_args(numbers),
    )  # fmt: skip
    return idx, s, v, phi


if HAS_TRITON:

    @triton.jit(**unspecialized("n", "n_z"))
    def _species_inputs_kernel(
        numbers_ptr, z_ptr, emb_ptr, phi_tab_ptr, idx_ptr, s_ptr, v_ptr, phi_ptr, n, n_z,
        F: tl.constexpr, F_PAD: tl.constexpr, HAS_PHI: tl.constexpr, BLOCK_A: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """BLOCK_A atoms: idx = z_to_index[numbers] (-1 for a number outside the table), s = embedding[idx] (NaN
        rows where idx < 0), v = 0, φ = phi_table[idx] (HAS_PHI)."""
        pdl_prologue(PDL)
        a = tl.program_id(0).to(tl.int64) * BLOCK_A + tl.arange(0, BLOCK_A)
        am = a < n
        z = tl.load(numbers_ptr + a, mask=am, other=0)
        zm = am & (z >= 0) & (z < n_z)
        idx = tl.load(z_ptr + z, mask=zm, other=-1)
        tl.store(idx_ptr + a, idx, mask=am)
        ok = idx >= 0
        row = tl.where(ok, idx, 0).to(tl.int64)
        f = tl.arange(0, F_PAD)
        fm = f < F
        m2 = am[:, None] & fm[None, :]
        s = tl.load(emb_ptr + row[:, None] * F + f[None, :], mask=m2, other=0.0)
        s = tl.where(ok[:, None], s, float("nan"))
        tl.store(s_ptr + a[:, None] * F + f[None, :], s, mask=m2)
        zero = tl.zeros((BLOCK_A, F_PAD), dtype=s.dtype)
        for k in tl.static_range(3):
            tl.store(v_ptr + a[:, None] * (3 * F) + k * F + f[None, :], zero, mask=m2)
            if HAS_PHI:
                p = tl.load(phi_tab_ptr + row[:, None] * (3 * F) + k * F + f[None, :], mask=m2, other=0.0)
                tl.store(phi_ptr + a[:, None] * (3 * F) + k * F + f[None, :], p, mask=m2)
