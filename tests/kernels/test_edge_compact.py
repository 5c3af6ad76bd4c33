"""kernels/edge_compact.py: dropping the pairs beyond the cutoff from a padded Verlet-skin list, in a static shape.

The oracle is computed on the host by a different route (NumPy boolean selection, argsort, bincount); the Triton
kernels (CPU interpreter, and CUDA when present) and the torch reference must both give exactly that.
"""

import importlib

import numpy as np
import pytest
import torch
from ase import Atoms
from mlff_distiller.kernels import edge_compact, edge_compact_reference, use_backend
from mlff_distiller.kernels.edge_compact import MARGIN

from mlff_distiller import AtomsBatch
from mlff_distiller.buckets import Bucket, pad_graph
from mlff_distiller.neighbors import neighbor_list

CUTOFF, SKIN = 3.0, 1.0
# the module (the package attribute of the same name is the function)
edge_compact_module = importlib.import_module("mlff_distiller.kernels.edge_compact")


def _padded_skin_list(n_atoms: int, seed: int, dtype=torch.float64, periodic: bool = True, spare_edges: int = 37):
    """A random periodic box's list at cutoff + skin, padded like the engine's Verlet path (bucket with spare
    atoms and edges)."""
    rng = np.random.default_rng(seed)
    length = (n_atoms / 0.1) ** (1 / 3)  # ~water's atom density
    atoms = Atoms(
        numbers=rng.choice([1, 8], n_atoms), positions=rng.uniform(0, length, (n_atoms, 3)), cell=[length] * 3
    )
    atoms.pbc = periodic
    b = AtomsBatch.from_atoms([atoms], dtype=dtype)
    nl = neighbor_list(b.positions, b.cell, b.pbc, b.batch, b.ptr, CUTOFF + SKIN, method="brute")
    bucket = Bucket(atoms=n_atoms + 5, edges=nl.num_edges + spare_edges)
    return pad_graph(
        bucket, b.numbers, b.positions, b.batch, 1, nl.edge_index, nl.shift_vectors, cutoff=CUTOFF, pad_z=1
    )


def _oracle(graph, cutoff):
    """The expected compacted list on the host: kept pairs in order, their CSRs."""
    ei = graph.edge_index.cpu().numpy()
    pos = graph.positions.cpu().double().numpy()
    sh = graph.shift_vectors.cpu().double().numpy()
    a, c = graph.bucket.atoms, ei.shape[1]
    d = np.linalg.norm(pos[ei[1]] - pos[ei[0]] + sh, axis=1)
    live = np.arange(c) < graph.row_ptr[-1].item()
    keep = (d < cutoff * (1 + MARGIN)) & live  # the kernels' conservative test
    kept = ei[:, keep]
    recv_ptr = np.concatenate([[0], np.cumsum(np.bincount(kept[0], minlength=a))])
    send_ptr = np.concatenate([[0], np.cumsum(np.bincount(kept[1], minlength=a))])
    perm = np.argsort(kept[1], kind="stable")
    return keep, kept, sh[keep], recv_ptr, send_ptr, perm


def _check(out, graph, cutoff, far):
    ei, shift, row_ptr, perm, sptr = (t.cpu() for t in out)
    keep, kept, kept_shift, recv_ptr, send_ptr, want_perm = _oracle(graph, cutoff)
    k, c, a = kept.shape[1], keep.shape[0], graph.bucket.atoms
    assert 0 < k < c, "the case must drop some pairs and keep some"
    np.testing.assert_array_equal(ei[:, :k].numpy(), kept)
    np.testing.assert_array_equal(shift[:k].double().numpy(), kept_shift)
    # the tail: padding self-pairs spread over the atoms (slot s: atom s mod A), shift (far, 0, 0), in no CSR row
    tail = np.arange(k, c) % a
    np.testing.assert_array_equal(ei[:, k:].numpy(), np.stack([tail, tail]))
    np.testing.assert_array_equal(shift[k:].double().numpy(), np.tile([far, 0.0, 0.0], (c - k, 1)))
    np.testing.assert_array_equal(row_ptr.numpy(), recv_ptr)
    np.testing.assert_array_equal(sptr.numpy(), send_ptr)
    np.testing.assert_array_equal(perm[:k].numpy(), want_perm)
    np.testing.assert_array_equal(perm[k:].numpy(), np.arange(k, c))  # a permutation of all C slots


@pytest.mark.parametrize("n_atoms, seed, block", [(60, 0, None), (190, 1, None), (700, 2, None), (700, 2, 1024)])
def test_edge_compact_triton_matches_oracle(triton_device, n_atoms, seed, block, monkeypatch):
    if block is not None:  # the tile size of lists beyond 65,536 slots, on a smaller one
        monkeypatch.setattr(edge_compact_module, "_block", lambda n: block)
    graph = _padded_skin_list(n_atoms, seed, dtype=torch.float32)
    ins = [t.to(triton_device) for t in (graph.positions, graph.edge_index, graph.shift_vectors, graph.row_ptr)]
    ins += [graph.sender_perm.to(triton_device), graph.sender_ptr.to(triton_device)]
    with use_backend("triton"):
        out = edge_compact(*ins, CUTOFF, graph.far)
    _check(out, graph, CUTOFF, graph.far)
    ref = edge_compact_reference(*ins, CUTOFF, graph.far)
    for got, want in zip(out, ref, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_edge_compact_reference_matches_oracle(dtype):
    graph = _padded_skin_list(150, 3, dtype=dtype)
    with use_backend("torch"):
        out = edge_compact(*graph.inputs()[1:4], graph.row_ptr, graph.sender_perm, graph.sender_ptr, CUTOFF, graph.far)
    _check(out, graph, CUTOFF, graph.far)


def test_edge_compact_drops_dead_edges_past_row_ptr(triton_device):
    """Edges at or past row_ptr[A] (padding that the CSR already excludes) are dropped even when short."""
    graph = _padded_skin_list(80, 4, dtype=torch.float64)
    n_live = int(graph.row_ptr[-1])
    row_ptr = graph.row_ptr.clamp(max=n_live - 10)  # pretend the last 10 real edges are dead too
    ins = [graph.positions, graph.edge_index, graph.shift_vectors, row_ptr, graph.sender_perm, graph.sender_ptr]
    ins = [t.to(triton_device) for t in ins]
    with use_backend("triton"):
        out = edge_compact(*ins, CUTOFF, graph.far)
    ref = edge_compact_reference(*ins, CUTOFF, graph.far)
    for got, want in zip(out, ref, strict=True):
        assert torch.equal(got, want)
    ei = graph.edge_index
    d = (graph.positions[ei[1]] - graph.positions[ei[0]] + graph.shift_vectors).norm(dim=1)
    assert int(out[2][-1]) == int((d[: n_live - 10] < CUTOFF * (1 + MARGIN)).sum())


def test_edge_compact_bad_input():
    graph = _padded_skin_list(40, 5)
    args = [graph.positions, graph.edge_index, graph.shift_vectors, graph.row_ptr, graph.sender_perm, graph.sender_ptr]
    with pytest.raises(ValueError, match="row_ptr"):
        edge_compact(*args[:3], graph.row_ptr[:-1], *args[4:], CUTOFF, graph.far)
    with pytest.raises(ValueError, match="far"):
        edge_compact(*args, CUTOFF, CUTOFF * 0.5)
    with pytest.raises(ValueError, match="shift_vectors"):
        edge_compact(args[0], args[1], args[2][:-1], *args[3:], CUTOFF, graph.far)
