"""kernels/molecular_pairs.py: the neighbour list of many isolated molecules on the device, in a count kernel, a
cumsum, one host read and a write kernel.

Three routes must agree exactly (pairs, their order by receiver then sender, the CSR): the Triton kernels (CPU
interpreter, and CUDA when present), the torch enumeration of all candidates they replace
(``_molecular_pairs_device_torch``) and the NumPy host path ``molecular_pairs``. The cases are the ones where a
tiled walk goes wrong: structures of one atom or without any pair, a receiver block spanning many structures, a
molecule wider than a sender tile, coincident atoms (r² = 0 is no pair), pairs at exactly the cutoff.
"""

import importlib
import warnings

import numpy as np
import pytest
import torch
from mlff_distiller.kernels import molecular_pairs_triton, use_backend

from mlff_distiller.neighbors import molecular as molecular_module
from mlff_distiller.neighbors.molecular import (
    _molecular_pairs_device_torch,
    molecular_pairs,
    molecular_pairs_device,
)

CUTOFF = 3.0
# the module (the package attribute of the same name is the launcher)
mp_module = importlib.import_module("mlff_distiller.kernels.molecular_pairs")


def _batch(seed: int, sizes, big: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 positions ``[N, 3]`` and ``ptr`` of random molecules of ``sizes`` atoms (in a 5 Å box: most pairs in
    range), then ``big`` atoms in a 9 Å box (~1/5 of its pairs in range), a molecule of two atoms 4 Å apart (no
    pair), four (atoms N-6..N-3) with a coincident pair, a third atom at exactly the cutoff from both (|r|² = 9 Å²
    exactly) and a fourth just within it from all, and two with a pair at the cutoff along a diagonal (|r|² rounds
    to one side of 9 Å², the same way in every route)."""
    rng = np.random.default_rng(seed)
    mols = [rng.uniform(0, 5, (int(n), 3)) for n in sizes]
    if big:
        mols.append(rng.uniform(0, 9, (big, 3)))
    mols.append(np.array([[0.0, 0.0, 0.0], [4.0, 0.0, 0.0]]))
    mols.append(np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0 + CUTOFF], [1.0, 1.0, 3.999]]))
    mols.append(np.array([[0.1, 0.2, 0.3], [0.1 + 1.8, 0.2 + 2.4, 0.3]]))
    counts = [len(m) for m in mols]
    return torch.tensor(np.concatenate(mols)), torch.tensor(np.concatenate([[0], np.cumsum(counts)]))


def _triton(positions, ptr, cutoff=CUTOFF):
    with use_backend("triton"):
        return molecular_pairs_device(positions, ptr, cutoff)


def _assert_same(got, positions, ptr, cutoff=CUTOFF):
    """``got`` (on positions' device) equals the host path and the torch reference: pairs, order, CSR, zero shifts."""
    host = molecular_pairs(positions.cpu(), ptr.cpu(), cutoff)
    ref = _molecular_pairs_device_torch(positions, ptr, cutoff)
    assert got.method == "molecular"
    for t in (got.edge_index, got.row_ptr, got.shifts, got.shift_vectors):
        assert t.device == positions.device
    assert got.edge_index.dtype == got.row_ptr.dtype == got.shifts.dtype == torch.int64
    assert got.shift_vectors.dtype == positions.dtype
    for want in (host, ref):
        assert torch.equal(got.edge_index.cpu(), want.edge_index.cpu())
        assert torch.equal(got.row_ptr.cpu(), want.row_ptr.cpu())
        assert torch.equal(got.shifts.cpu(), want.shifts.cpu())
        assert torch.equal(got.shift_vectors.cpu(), want.shift_vectors.cpu())
    return host


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ptr_on_host", [True, False])
def test_triton_equals_host_and_reference(triton_device, dtype, ptr_on_host, poison):
    """Molecules of 1-40 atoms, one of 300 (wider than a sender tile on either device), the special pairs; ``ptr``
    on the host (the engine's case) or on the device (``neighbor_list``'s). The outputs are allocated uninitialised:
    poisoned memory shows any slot the kernels miss (the zero shifts included)."""
    sizes = np.random.default_rng(1).integers(1, 41, 25)
    positions, ptr = _batch(2, [1, *sizes, 1, 1], big=300)
    positions = positions.to(triton_device, dtype)
    poison(1 << 20, torch.float64, positions.device)
    got = _triton(positions, ptr if ptr_on_host else ptr.to(triton_device))
    host = _assert_same(got, positions, ptr)
    n_big = int(((host.edge_index[0] >= ptr[-5]) & (host.edge_index[0] < ptr[-4])).sum())
    assert 0.05 * 300 * 299 < n_big < 0.5 * 300 * 299  # many of the big molecule's pairs, not all
    n = positions.shape[0]
    a, b, c, d = n - 6, n - 5, n - 4, n - 3
    quad = {(i, j) for i, j in zip(*host.edge_index.tolist(), strict=True) if i >= a and j >= a and i <= d}
    assert quad == {(a, d), (b, d), (c, d), (d, a), (d, b), (d, c)}  # not r² = 0, not r = cutoff


def test_small_tiles_cross_every_boundary(triton_device, monkeypatch):
    """4 receivers by 8 senders: receiver blocks spanning several structures and molecules spanning several blocks
    and sender tiles."""
    monkeypatch.setattr(mp_module, "_blocks", lambda device: (4, 8))
    positions, ptr = _batch(3, [1, 2, 11, 1, 3, 19, 5])
    positions = positions.to(triton_device)
    _assert_same(_triton(positions, ptr), positions, ptr)


def test_no_pairs_and_empty_input(triton_device):
    """Single atoms only, atoms too far apart, an empty structure between others, no atoms at all."""
    lone = torch.tensor([[0.0, 0, 0], [0.0, 0, 0], [9.0, 0, 0], [0.0, 0, 0]], device=triton_device)
    for ptr in ([0, 1, 2, 3, 4], [0, 1, 1, 3, 4], [0, 0, 2, 4, 4]):
        got = _triton(lone[: ptr[-1]], torch.tensor(ptr))
        _assert_same(got, lone[: ptr[-1]], torch.tensor(ptr))
    got = _triton(lone[:4], torch.tensor([0, 2, 4]))  # coincident pair only: r² = 0 is no pair
    assert got.num_edges == 0 and got.row_ptr.tolist() == [0, 0, 0, 0, 0]
    empty = torch.zeros((0, 3), device=triton_device)
    for ptr in ([0, 0], [0]):  # ([0]: no structure, the torch reference's case)
        got = _triton(empty, torch.tensor(ptr))
        _assert_same(got, empty, torch.tensor(ptr))
        assert got.edge_index.shape == (2, 0) and got.row_ptr.tolist() == [0]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf - inf
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_positions_raise(triton_device, bad):
    """A NaN or inf anywhere (in a 1-atom structure, the middle of a molecule, the last atom) raises as the host path
    does; the count kernel's flag must survive the prefix sum with any number of flagged atoms."""
    positions, ptr = _batch(4, [1, 6, 3])
    for where in ([0], [4], [positions.shape[0] - 1], [0, 4, 5, 6]):
        p = positions.clone()
        p[where, 1] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            _triton(p.to(triton_device), ptr)
        with pytest.raises(ValueError, match="NaN or inf"):
            molecular_pairs(p, ptr, CUTOFF)


def test_backend_dispatch(triton_device, monkeypatch):
    """The torch backend, a compile-ahead dry run and a ptr without structures take the torch reference; the
    Triton backend (CPU: under the interpreter) the kernels."""
    used = []
    real = molecular_module._molecular_pairs_device_torch
    monkeypatch.setattr(molecular_module, "_molecular_pairs_device_torch", lambda *a: used.append("torch") or real(*a))
    real_k = molecular_module.molecular_pairs_triton
    monkeypatch.setattr(molecular_module, "molecular_pairs_triton", lambda *a: used.append("triton") or real_k(*a))
    positions, ptr = _batch(5, [4, 2])
    positions = positions.to(triton_device)
    with use_backend("torch"):
        molecular_pairs_device(positions, ptr, CUTOFF)
    _triton(positions, ptr)
    _triton(positions[:0], torch.tensor([0]))
    monkeypatch.setattr(molecular_module, "dry_run_active", lambda: True)
    _triton(positions, ptr)
    assert used == ["torch", "triton", "torch", "torch"]


def test_launcher_refuses_what_it_cannot_serve():
    positions, ptr = _batch(6, [3])
    with pytest.raises(ValueError, match=r"\[N, 3\]"):
        molecular_pairs_triton(positions[:, :2], ptr, CUTOFF)
    with pytest.raises(ValueError, match="B = 0"):
        molecular_pairs_triton(positions[:0], torch.tensor([0]), CUTOFF)


def _g2_like(n_mols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Molecules of 2-9 atoms (~5.3 on average, as the g2 set) with bonds ~1-1.5 Å."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(2, 10, n_mols)
    pos = np.concatenate([rng.normal(0, 1.0, (int(n), 3)) + 50.0 * k for k, n in enumerate(sizes)])
    return torch.tensor(pos), torch.tensor(np.concatenate([[0], np.cumsum(sizes)]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_batches_on_cuda(dtype):
    """4,096 small molecules and a 2,000-atom one (63 receiver blocks of 32 tiles) equal the host path."""
    positions, ptr = _g2_like(4096, 7)
    _assert_same(_triton(positions.to("cuda", dtype), ptr), positions.to("cuda", dtype), ptr)
    rng = np.random.default_rng(8)
    one = torch.tensor(rng.uniform(0, 22, (2000, 3)), device="cuda", dtype=dtype)
    _assert_same(_triton(one, torch.tensor([0, 2000]), 5.0), one, torch.tensor([0, 2000]), 5.0)


@pytest.mark.gpu
def test_one_host_sync_on_cuda():
    """With ``ptr`` on the host (the engine's call), the only synchronising operation is the read of the total."""
    positions, ptr = _g2_like(256, 9)
    positions = positions.to("cuda")
    _triton(positions, ptr)  # compiled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _triton(positions, ptr)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
