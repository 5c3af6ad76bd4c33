"""Graph bookkeeping of the message-passing kernels (:mod:`.message_passing`): the receiver CSR (``row_ptr``, and a
sorting permutation when the edges are not receiver-sorted) and the transposed CSR over senders (``perm``,
``col_ptr``) that the backward needs.

All model layers share one ``edge_index``, so both are cached per edge_index tensor (weak reference + version
counter: a freed or modified tensor never hits a stale entry); under torch.compile nothing is cached. Built with
torch ops only, so a compile-ahead dry run (:mod:`._compile_ahead`) caches real CSRs, not unwritten kernel output.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch import Tensor


@dataclasses.dataclass
class _Graph:
    ref: weakref.ref | None
    version: int
    n_atoms: int
    row_ptr: Tensor | None = None
    edge_index: Tensor | None = None  # receiver-sorted (the input itself when already sorted)
    order: Tensor | None = None  # sorting permutation, None when the input was sorted
    perm: Tensor | None = None  # edges sorted by sender: edge ids
    col_ptr: Tensor | None = None  # [N + 1] CSR offsets over perm


_CACHE: list[_Graph] = []
_CACHE_SIZE = 4


def _graph(edge_index: Tensor, n_atoms: int) -> _Graph:
    if torch.compiler.is_compiling():
        return _Graph(None, 0, n_atoms)
    version = edge_index._version
    for g in _CACHE:
        if g.ref() is edge_index and g.version == version and g.n_atoms == n_atoms:
            return g
    _CACHE[:] = [g for g in _CACHE if g.ref() is not None][-(_CACHE_SIZE - 1) :]
    g = _Graph(weakref.ref(edge_index), version, n_atoms)
    _CACHE.append(g)
    return g


def _offsets(sorted_keys: Tensor, n_atoms: int) -> Tensor:
    """CSR offsets ``[N + 1]`` (int64) of a sorted key vector: first position of each key 0..N."""
    bounds = torch.arange(n_atoms + 1, device=sorted_keys.device, dtype=sorted_keys.dtype)
    return torch.searchsorted(sorted_keys, bounds).to(torch.int64)


def _receiver_csr(edge_index: Tensor, n_atoms: int) -> _Graph:
    g = _graph(edge_index, n_atoms)
    if g.row_ptr is not None:
        return g
    recv, send = edge_index[0], edge_index[1]
    if edge_index.shape[1] == 0:
        g.row_ptr, g.edge_index = (
            torch.zeros(n_atoms + 1, dtype=torch.int64, device=edge_index.device),
            edge_index,
        )
        return g
    # One sync for the range check and the order check together.
    lo, hi, unsorted = torch.stack(
        [edge_index.min(), edge_index.max(), (recv[1:] < recv[:-1]).any().to(edge_index.dtype)]
    ).tolist()
    if lo < 0 or hi >= n_atoms:
        raise ValueError(f"edge_index holds atom indices in [{lo}, {hi}], outside [0, {n_atoms}) (N = {n_atoms})")
    if unsorted:
        g.order = torch.argsort(recv, stable=True)
        g.edge_index = torch.stack([recv[g.order], send[g.order]])
    else:
        g.edge_index = edge_index
    g.row_ptr = _offsets(g.edge_index[0].contiguous(), n_atoms)
    return g


def _sender_order(send: Tensor, n_atoms: int) -> Tensor:
    """Stable argsort of the senders (each sender's edges keep receiver order). On int32 keys when the atom
    indices fit: a CUDA radix sort then makes 4 passes instead of 8 (in a CUDA-graph replay of a 192-atom water
    box the int64 sort was 8 kernels, 44 µs of ~1 ms, benchmarks/results/profile_step_h100_run4.txt)."""
    key = send.to(torch.int32) if n_atoms < 2**31 else send
    return torch.argsort(key, stable=True)


def _sender_csr(edge_index: Tensor, n_atoms: int) -> tuple[Tensor, Tensor]:
    """Edges sorted by sender (stable, so each sender's edges keep receiver order) and their offsets."""
    g = _graph(edge_index, n_atoms)
    if g.perm is None:
        send = edge_index[1]
        g.perm = _sender_order(send, n_atoms)
        g.col_ptr = _offsets(send[g.perm].contiguous(), n_atoms)
    return g.perm, g.col_ptr
