"""Neighbour lists vs ``ase.neighborlist.neighbor_list('ijS')``: exact pair sets, batching, edge cases."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.neighborlist import neighbor_list as ase_neighbor_list
from helpers import edge_partners

from mlff_distiller.batch import AtomsBatch
from mlff_distiller.neighbors import (
    BACKENDS,
    NeighborList,
    VerletNeighborList,
    available_backends,
    neighbor_list,
    neighbor_list_batch,
    vesin_backend,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# vesin is optional: its tests run where vesin-torch is installed (here and on the GPU machine via .whl).
METHODS = ["brute", "cell_list"] + (["vesin"] if vesin_backend.vesin_available() else [])
DTYPES = [torch.float64, torch.float32]
# Distance agreement with ASE (Å): positions are rounded to the dtype first, so only the arithmetic differs.
DIST_ATOL = {torch.float64: 1e-10, torch.float32: 2e-5}
KINDS = ["molecule", "tiny", "triclinic", "slab", "wire", "mixed"]
CUTOFF = 5.0


def random_structure(rng: np.random.Generator, kind: str) -> Atoms:
    """A random structure of ``kind``; periodic ones have a skewed lower-triangular cell and fractional
    coordinates partly outside [0, 1) (unwrapped positions)."""
    if kind == "molecule":
        n = int(rng.integers(1, 13))
        return Atoms(numbers=rng.integers(1, 10, n), positions=rng.uniform(-4.0, 4.0, (n, 3)))
    lo, hi, n_max = (1.5, 3.0, 4) if kind == "tiny" else (3.0, 8.0, 14)
    diag = rng.uniform(lo, hi, 3)
    cell = np.diag(diag) + np.tril(rng.uniform(-0.6, 0.6, (3, 3)) * diag[None, :], k=-1)
    n = int(rng.integers(1, n_max + 1))
    frac = rng.uniform(0.0, 1.0, (n, 3))
    outside = rng.random(n) < 0.3
    frac[outside] += rng.integers(-3, 4, (int(outside.sum()), 3))
    pbc = {
        "tiny": [True, True, True],
        "triclinic": [True, True, True],
        "slab": [True, True, False],
        "wire": [False, False, True],
        "mixed": list(rng.random(3) < 0.5),
    }[kind]
    pbc = np.array(pbc)
    positions = frac @ cell
    if rng.random() < 0.6:
        cell[~pbc] = 0.0  # ASE allows zero non-periodic vectors; the backends must cope
    return Atoms(numbers=rng.integers(1, 10, n), positions=positions, cell=cell, pbc=pbc)


@functools.cache
def structures() -> tuple[Atoms, ...]:
    rng = np.random.default_rng(20240611)
    return tuple(random_structure(rng, KINDS[k % len(KINDS)]) for k in range(60))


def ase_pairs(atoms: Atoms, cutoff: float) -> tuple[list[tuple], np.ndarray]:
    i, j, s, d = ase_neighbor_list("ijSd", atoms, cutoff)
    order = np.lexsort((s[:, 2], s[:, 1], s[:, 0], j, i))
    tuples = [(int(a), int(b), tuple(int(x) for x in c)) for a, b, c in zip(i[order], j[order], s[order], strict=True)]
    return tuples, d[order]


@functools.cache
def reference(dtype: torch.dtype, cutoff: float) -> tuple:
    """ASE pairs of every test structure, computed from positions/cell already rounded to ``dtype``."""
    batch = AtomsBatch.from_atoms(structures(), dtype=dtype)
    return tuple(ase_pairs(atoms, cutoff) for atoms in batch.to_atoms())


def our_pairs(nl: NeighborList, lo: int = 0, hi: int | None = None) -> list[tuple]:
    """Edges whose receiver lies in [lo, hi), with indices relative to ``lo``, as (i, j, S) tuples."""
    i, j = nl.edge_index.cpu().tolist()
    shifts = nl.shifts.cpu().tolist()
    hi = len(nl.row_ptr) - 1 if hi is None else hi
    return [(a - lo, b - lo, tuple(s)) for a, b, s in zip(i, j, shifts, strict=True) if lo <= a < hi]


def check_contract(nl: NeighborList, batch: AtomsBatch) -> None:
    n, e = batch.num_atoms, nl.num_edges
    assert nl.edge_index.shape == (2, e) and nl.edge_index.dtype == torch.long
    assert nl.shifts.shape == (e, 3) and nl.shifts.dtype == torch.long
    assert nl.shift_vectors.shape == (e, 3) and nl.shift_vectors.dtype == batch.dtype
    assert nl.row_ptr.shape == (n + 1,) and nl.row_ptr.dtype == torch.long
    for t in (nl.edge_index, nl.shifts, nl.shift_vectors, nl.row_ptr):
        assert t.device == batch.device
    i = nl.edge_index[0]
    assert torch.equal(nl.row_ptr[1:] - nl.row_ptr[:-1], torch.bincount(i, minlength=n))
    assert int(nl.row_ptr[0]) == 0 and int(nl.row_ptr[-1]) == e
    assert bool((i[1:] >= i[:-1]).all()), "edges must be sorted by receiver"
    # Edges never cross structures, and shift_vectors = S @ cell of the receiver's structure.
    assert torch.equal(batch.batch[i], batch.batch[nl.edge_index[1]])
    expected = torch.einsum("ea,eab->eb", nl.shifts.to(batch.dtype), batch.cell[batch.batch[i]])
    torch.testing.assert_close(nl.shift_vectors, expected)


# ------------------------------------------------------------------------------------------------ vs ASE
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
def test_matches_ase(device, dtype, method):
    """60 random structures (molecules, tiny cells, triclinic, slabs, wires, mixed pbc) in one batch."""
    batch = AtomsBatch.from_atoms(structures(), dtype=dtype, device=device)
    nl = neighbor_list_batch(batch, CUTOFF, method)
    assert nl.method == method
    check_contract(nl, batch)
    dist = nl.distances(batch.positions).cpu().double().numpy()
    ptr = batch.ptr.tolist()
    start = nl.row_ptr[ptr].tolist()
    for k, (ref, ref_d) in enumerate(reference(dtype, CUTOFF)):
        got = our_pairs(nl, ptr[k], ptr[k + 1])
        assert got == ref, f"structure {k} ({KINDS[k % len(KINDS)]}): {len(got)} pairs vs ASE {len(ref)}"
        np.testing.assert_allclose(dist[start[k] : start[k + 1]], ref_d, rtol=0, atol=DIST_ATOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cutoff", [1.3, 3.7])
def test_matches_ase_other_cutoffs(device, method, cutoff):
    batch = AtomsBatch.from_atoms(structures(), device=device)
    nl = neighbor_list_batch(batch, cutoff, method)
    ptr = batch.ptr.tolist()
    for k, (ref, _) in enumerate(reference(torch.float64, cutoff)):
        assert our_pairs(nl, ptr[k], ptr[k + 1]) == ref, f"structure {k}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_far_unwrapped_positions(device, method):
    """Positions many cells away from the origin cell still give ASE's S (relative to the given positions)."""
    rng = np.random.default_rng(7)
    cell = np.array([[3.1, 0.0, 0.0], [1.2, 2.9, 0.0], [-0.8, 0.7, 3.3]])
    frac = rng.uniform(0, 1, (6, 3)) + rng.integers(-40, 40, (6, 3))
    atoms = Atoms("H6", positions=frac @ cell, cell=cell, pbc=[True, False, True])
    batch = AtomsBatch.from_atoms(atoms, device=device)
    nl = neighbor_list_batch(batch, 4.0, method)
    assert our_pairs(nl) == ase_pairs(atoms, 4.0)[0]
    assert nl.shifts[:, 1].abs().sum() == 0, "no shifts along a non-periodic vector"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_larger_systems(device, method):
    """Grids of many bins per axis (cell list) and large chunks: a 13 Å triclinic cell of 160 atoms, a slab
    with vacuum, and a sparse 300-atom molecule, batched."""
    rng = np.random.default_rng(11)
    cell = np.array([[13.0, 0.0, 0.0], [3.5, 12.0, 0.0], [-2.0, 4.0, 12.5]])
    bulk = Atoms("H160", positions=rng.uniform(-0.2, 1.2, (160, 3)) @ cell, cell=cell, pbc=True)
    slab_cell = np.array([[11.0, 0.0, 0.0], [-4.0, 10.0, 0.0], [0.0, 0.0, 0.0]])
    slab_pos = rng.uniform(0, 1, (120, 3)) @ np.array([[11.0, 0, 0], [-4.0, 10.0, 0], [0, 0, 8.0]])
    slab = Atoms("H120", positions=slab_pos, cell=slab_cell, pbc=[True, True, False])
    molecule = Atoms("H300", positions=rng.uniform(-15, 15, (300, 3)))
    picks = [bulk, slab, molecule]
    batch = AtomsBatch.from_atoms(picks, device=device)
    nl = neighbor_list_batch(batch, CUTOFF, method)
    check_contract(nl, batch)
    ptr = batch.ptr.tolist()
    for k, atoms in enumerate(picks):
        assert our_pairs(nl, ptr[k], ptr[k + 1]) == ase_pairs(atoms, CUTOFF)[0], f"structure {k}"


# ------------------------------------------------------------------------------------------------ batching
@pytest.mark.parametrize("device", DEVICES)
def test_batched_equals_single_and_backends_agree(device):
    picks = [structures()[k] for k in (0, 1, 2, 3, 4, 5, 7, 8, 13)]
    batch = AtomsBatch.from_atoms(picks, device=device)
    full = {m: neighbor_list_batch(batch, CUTOFF, m) for m in METHODS}
    # All backends return identical tensors, order included (shift vectors to rounding: the Triton cell
    # list computes S @ cell in its own kernel).
    for m in METHODS[1:]:
        for name in ("edge_index", "shifts", "row_ptr"):
            assert torch.equal(getattr(full["brute"], name), getattr(full[m], name)), (m, name)
        torch.testing.assert_close(full["brute"].shift_vectors, full[m].shift_vectors, rtol=0, atol=1e-12)
    ptr = batch.ptr.tolist()
    for k, atoms in enumerate(picks):
        single = neighbor_list_batch(AtomsBatch.from_atoms(atoms, device=device), CUTOFF, "cell_list")
        lo, hi = full["brute"].row_ptr[[ptr[k], ptr[k + 1]]].tolist()
        assert torch.equal(full["brute"].edge_index[:, lo:hi], single.edge_index + ptr[k])
        assert torch.equal(full["brute"].shifts[lo:hi], single.shifts)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["brute", "cell_list"])
def test_small_chunks_give_same_list(device, method):
    batch = AtomsBatch.from_atoms(structures()[:12], device=device)
    ref = neighbor_list_batch(batch, CUTOFF, method)
    chunked = neighbor_list_batch(batch, CUTOFF, method, max_candidates=97)
    assert torch.equal(ref.edge_index, chunked.edge_index)
    assert torch.equal(ref.shifts, chunked.shifts)


# ------------------------------------------------------------------------------------------------ edge cases
def _empty_cases() -> list[Atoms]:
    return [
        Atoms("H", positions=[[0.3, 0.1, -0.2]]),  # a single-atom molecule
        Atoms("H2", positions=[[0, 0, 0], [0, 0, 6.0]]),  # farther apart than the cutoff
        Atoms("H2", positions=[[0, 0, 0], [0, 0, 5.0]]),  # exactly at the cutoff: strict <
        Atoms("H", positions=[[1, 1, 1]], cell=[[0, 0, 0], [0, 0, 0], [0, 0, 7.0]], pbc=[False, False, True]),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
def test_no_neighbours(device, dtype, method):
    for atoms in [*_empty_cases(), _empty_cases()]:
        batch = AtomsBatch.from_atoms(atoms, dtype=dtype, device=device)
        nl = neighbor_list_batch(batch, 5.0, method)
        assert nl.num_edges == 0
        check_contract(nl, batch)
        assert not nl.row_ptr.any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_self_images_and_coincident_atoms(device, method):
    # One atom in a 2 Å cubic cell: its 80 own images within 5 Å (0 < |S|^2 <= 6; i == j, S != 0), never the
    # S == 0 self pair.
    atoms = Atoms("H", positions=[[0.5, 0.5, 0.5]], cell=np.eye(3) * 2.0, pbc=True)
    nl = neighbor_list_batch(AtomsBatch.from_atoms(atoms, device=device), 5.0, method)
    assert our_pairs(nl) == ase_pairs(atoms, 5.0)[0]
    assert nl.num_edges == 80 and bool(nl.shifts.abs().sum(dim=1).gt(0).all())
    # Two distinct atoms at one position are not paired (0 < |r|; ASE would give a zero-length edge).
    twin = Atoms("H3", positions=[[0, 0, 0], [0, 0, 0], [1, 0, 0]])
    nl = neighbor_list_batch(AtomsBatch.from_atoms(twin, device=device), 2.0, method)
    zero = (0, 0, 0)
    assert sorted(our_pairs(nl)) == [(0, 2, zero), (1, 2, zero), (2, 0, zero), (2, 1, zero)]


@pytest.mark.parametrize("method", ["auto", *METHODS])
def test_no_grad_and_auto(method):
    batch = AtomsBatch.from_atoms(structures()[:6])
    positions = batch.positions.clone().requires_grad_(True)
    cell = batch.cell.clone().requires_grad_(True)
    nl = neighbor_list(positions, cell, batch.pbc, batch.batch, batch.ptr, CUTOFF, method)
    assert not nl.shift_vectors.requires_grad
    assert nl.method in BACKENDS
    with torch.no_grad():
        again = neighbor_list(positions, cell, batch.pbc, batch.batch, batch.ptr, CUTOFF, method)
    assert torch.equal(nl.edge_index, again.edge_index)


def test_auto_rule():
    small = AtomsBatch.from_atoms([Atoms("H3", positions=np.eye(3))] * 4)
    assert neighbor_list_batch(small, CUTOFF).method == "molecular"  # CPU, no periodic direction
    assert neighbor_list_batch(small.to("cpu", torch.float32), CUTOFF, "brute").method == "brute"
    rng = np.random.default_rng(3)
    big = AtomsBatch.from_atoms(Atoms("H400", positions=rng.uniform(0, 16, (400, 3)), cell=[16] * 3, pbc=True))
    assert neighbor_list_batch(big, CUTOFF).method == "cell_list"
    cube = Atoms("H3", positions=np.eye(3), cell=[8.0] * 3, pbc=[True, False, False])
    assert neighbor_list_batch(AtomsBatch.from_atoms([cube] * 4), CUTOFF).method == "brute"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_molecular_path_equals_brute_force(dtype):
    """The host all-pairs path gives exactly the pairs, order and CSR of the brute-force backend: random
    molecules of 1..40 atoms, a coincident pair, and distances straddling the cutoff."""
    rng = np.random.default_rng(11)
    mols = [Atoms(numbers=[1] * n, positions=rng.uniform(0, 7, (n, 3))) for n in rng.integers(1, 40, 30)]
    twin = Atoms("H3", positions=[[0, 0, 0], [0, 0, 0], [0, 0, CUTOFF - 1e-9]])
    edge = Atoms("H2", positions=[[0, 0, 0], [0, 0, CUTOFF]])  # exactly at the cutoff: not a pair
    batch = AtomsBatch.from_atoms([*mols, twin, edge], dtype=dtype)
    got = neighbor_list_batch(batch, CUTOFF)
    want = neighbor_list_batch(batch, CUTOFF, "brute")
    assert got.method == "molecular"
    assert torch.equal(got.edge_index, want.edge_index)
    assert torch.equal(got.row_ptr, want.row_ptr)
    assert torch.equal(got.shifts, want.shifts)
    assert got.shift_vectors.dtype == dtype and not got.shift_vectors.any()
    assert got.num_edges > 1000
    for atoms in [*mols[:5], twin, edge]:  # one structure at a time: the broadcast path of a single structure
        one = AtomsBatch.from_atoms(atoms, dtype=dtype)
        got1, want1 = neighbor_list_batch(one, CUTOFF), neighbor_list_batch(one, CUTOFF, "brute")
        assert got1.method == "molecular"
        assert torch.equal(got1.edge_index, want1.edge_index) and torch.equal(got1.row_ptr, want1.row_ptr)
    with pytest.raises(ValueError, match="NaN"):
        bad = batch.positions.clone()
        bad[3, 1] = float("nan")
        neighbor_list(bad, batch.cell, batch.pbc, batch.batch, batch.ptr, CUTOFF)


def test_a_large_molecule_on_the_cpu_takes_the_cell_list():
    """auto on the CPU: the all-pairs path for molecules of up to 724 atoms (n² <= MOLECULAR_MAX_STRUCTURE_PAIRS:
    it grows as n², the cell list as n; stop 74), the cell list beyond, with the same pairs; many small molecules
    stay on the all-pairs path however many candidates they sum to."""
    from mlff_distiller.neighbors.molecular import MOLECULAR_MAX_STRUCTURE_PAIRS, molecular_pairs

    rng = np.random.default_rng(74)
    side = 22.0  # ~0.07 atoms per Å³: a cluster's density, 60-70 neighbours within 5 Å
    for n, method in ((724, "molecular"), (725, "cell_list")):
        assert (n * n <= MOLECULAR_MAX_STRUCTURE_PAIRS) == (method == "molecular")
        one = AtomsBatch.from_atoms(Atoms(numbers=[1] * n, positions=rng.uniform(0, side, (n, 3))))
        got = neighbor_list_batch(one, 5.0)
        want = molecular_pairs(one.positions, one.ptr, 5.0)
        assert got.method == method and got.num_edges == want.num_edges > 10 * n
        pairs = [set(zip(*nl.edge_index.tolist(), strict=True)) for nl in (got, want)]
        assert pairs[0] == pairs[1] and not got.shifts.any()
    many = [Atoms(numbers=[1] * 24, positions=rng.uniform(0, 6, (24, 3))) for _ in range(1000)]
    batch = AtomsBatch.from_atoms(many)
    assert 1000 * 24 * 24 > MOLECULAR_MAX_STRUCTURE_PAIRS
    assert neighbor_list_batch(batch, 5.0).method == "molecular"


DEVICE_KINDS = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("kind", DEVICE_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_molecular_device_path_equals_the_host_path(kind, dtype):
    """``molecular_pairs_device`` (molecules whose positions live on a GPU; any device here) gives the host path's
    pairs, order, CSR and zero shifts: random molecules, single atoms (no candidates), a coincident pair and a pair
    exactly at the cutoff; on CUDA, ``auto`` takes it."""
    from mlff_distiller.neighbors.molecular import molecular_pairs, molecular_pairs_device

    rng = np.random.default_rng(12)
    mols = [Atoms(numbers=[1] * n, positions=rng.uniform(0, 7, (n, 3))) for n in rng.integers(1, 40, 30)]
    twin = Atoms("H3", positions=[[0, 0, 0], [0, 0, 0], [0, 0, CUTOFF - 1e-9]])
    edge = Atoms("H2", positions=[[0, 0, 0], [0, 0, CUTOFF]])
    batch = AtomsBatch.from_atoms([*mols, twin, edge, Atoms("H")], dtype=dtype)
    want = molecular_pairs(batch.positions, batch.ptr, CUTOFF)
    dev = batch.to(kind)
    got = molecular_pairs_device(dev.positions, dev.ptr, CUTOFF)
    assert got.edge_index.device.type == kind and got.method == "molecular"
    assert torch.equal(got.edge_index.cpu(), want.edge_index)
    assert torch.equal(got.row_ptr.cpu(), want.row_ptr)
    assert torch.equal(got.shifts.cpu(), want.shifts)
    assert got.shift_vectors.dtype == dtype and not got.shift_vectors.any()
    lone = AtomsBatch.from_atoms([Atoms("H"), Atoms("O")], dtype=dtype).to(kind)
    none = molecular_pairs_device(lone.positions, lone.ptr, CUTOFF)
    assert none.num_edges == 0 and none.row_ptr.tolist() == [0, 0, 0]
    bad = dev.positions.clone()
    bad[3, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        molecular_pairs_device(bad, dev.ptr, CUTOFF)
    if kind == "cuda":
        auto = neighbor_list_batch(dev, CUTOFF)
        assert auto.method == "molecular" and torch.equal(auto.edge_index.cpu(), want.edge_index)


# ------------------------------------------------------------------------------------------------ errors
def test_bad_inputs():
    b = AtomsBatch.from_atoms(structures()[:3])
    args = (b.positions, b.cell, b.pbc, b.batch, b.ptr)
    for cutoff in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="cutoff"):
            neighbor_list(*args, cutoff)
    bad = {
        0: b.positions[:, :2],
        1: b.cell[:, :2],
        2: b.pbc[:-1],
        3: b.batch[:-1],
        4: b.ptr[:-1],
    }
    for slot, replacement in bad.items():
        wrong = list(args)
        wrong[slot] = replacement
        with pytest.raises(ValueError, match="must be"):
            neighbor_list(*wrong, CUTOFF)
    with pytest.raises(ValueError, match="ptr must run"):
        neighbor_list(*args[:4], b.ptr - 1, CUTOFF)
    with pytest.raises(ValueError, match="unknown method"):
        neighbor_list(*args, CUTOFF, method="octree")
    with pytest.raises(ValueError, match="float32 or float64"):
        neighbor_list(b.positions.half(), *args[1:], CUTOFF)
    flat = torch.zeros(1, 3, 3, dtype=torch.float64)
    flat[0, 0, 0] = 3.0  # periodic along all three vectors but only one is non-zero
    one = torch.zeros(1, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="degenerate"):
        neighbor_list(
            one,
            flat,
            torch.ones(1, 3, dtype=torch.bool),
            torch.zeros(1, dtype=torch.long),
            torch.tensor([0, 1]),
            CUTOFF,
        )


# ------------------------------------------------------------------------------------------------ Triton cell list
def _triton_ok(device: str) -> bool:
    from mlff_distiller.neighbors.cell_list_triton import triton_runnable

    return triton_runnable(torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_cell_list_matches_ase(device, dtype):
    """The fused-kernel cell list vs ASE: every kind of structure on CUDA; on CPU (Triton interpreter, slow)
    the first 12 (two of each kind)."""
    if not _triton_ok(device):
        pytest.skip("Triton cannot run here")
    picks = structures() if device == "cuda" else structures()[:12]
    batch = AtomsBatch.from_atoms(picks, dtype=dtype, device=device)
    nl = neighbor_list_batch(batch, CUTOFF, "cell_list", cell_list_impl="triton")
    check_contract(nl, batch)
    ptr = batch.ptr.tolist()
    dist = nl.distances(batch.positions).cpu().double().numpy()
    start = nl.row_ptr[ptr].tolist()
    for k, (ref, ref_d) in enumerate(reference(dtype, CUTOFF)[: len(picks)]):
        assert our_pairs(nl, ptr[k], ptr[k + 1]) == ref, f"structure {k} ({KINDS[k % len(KINDS)]})"
        np.testing.assert_allclose(dist[start[k] : start[k + 1]], ref_d, rtol=0, atol=DIST_ATOL[dtype])
    torch_nl = neighbor_list_batch(batch, CUTOFF, "cell_list", cell_list_impl="torch")
    assert torch.equal(nl.edge_index, torch_nl.edge_index) and torch.equal(nl.shifts, torch_nl.shifts)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_cell_list_dense_and_hub(device):
    """A dense periodic box (many bins, several atoms per bin, rows of ~100 pairs) plus a hub: one atom at the
    centre of a 1,100-atom cluster (> 1,000 neighbours, the long-row fallback on CUDA)."""
    if not _triton_ok(device):
        pytest.skip("Triton cannot run here")
    rng = np.random.default_rng(5)
    if device == "cpu":
        box = Atoms("H60", positions=rng.uniform(0, 9.0, (60, 3)), cell=np.eye(3) * 9.0, pbc=True)
        picks = [box]
    else:
        cell = np.array([[22.0, 0, 0], [3.0, 21.0, 0], [-2.0, 1.5, 20.0]])
        box = Atoms("H2000", positions=rng.uniform(-0.1, 1.1, (2000, 3)) @ cell, cell=cell, pbc=True)
        hub = Atoms("H1101", positions=np.vstack([[0.0, 0.0, 0.0], rng.normal(0, 1.2, (1100, 3))]))
        picks = [box, hub]
    batch = AtomsBatch.from_atoms(picks, device=device)
    nl = neighbor_list_batch(batch, CUTOFF, "cell_list", cell_list_impl="triton")
    check_contract(nl, batch)
    ptr = batch.ptr.tolist()
    for k, atoms in enumerate(picks):
        assert our_pairs(nl, ptr[k], ptr[k + 1]) == ase_pairs(atoms, CUTOFF)[0], f"structure {k}"


def test_cell_list_impl_errors(monkeypatch):
    b = AtomsBatch.from_atoms(structures()[:2])
    with pytest.raises(ValueError, match="unknown cell_list_impl"):
        neighbor_list_batch(b, CUTOFF, "cell_list", cell_list_impl="cuda-magic")
    monkeypatch.setenv("MLFF_DISTILLER_CELL_LIST", "nope")
    with pytest.raises(ValueError, match="unknown cell_list_impl"):
        neighbor_list_batch(b, CUTOFF, "cell_list")


# ------------------------------------------------------------------------------------------------ vesin
def test_vesin_missing_is_a_clear_error_and_auto_skips_it(monkeypatch):
    monkeypatch.setattr(vesin_backend, "_vesin_class", lambda: None)
    box = dict(cell=[16.0] * 3, pbc=True)  # periodic: the host all-pairs path does not apply
    b = AtomsBatch.from_atoms(Atoms("H400", positions=np.random.default_rng(3).uniform(0, 16, (400, 3)), **box))
    with pytest.raises(ValueError, match="vesin-torch"):
        neighbor_list_batch(b, CUTOFF, "vesin")
    assert "vesin" not in available_backends("cpu")
    from mlff_distiller import neighbors

    monkeypatch.setitem(neighbors.AUTO_VESIN_MIN_ATOMS, "cpu", 1)
    assert neighbor_list_batch(b, CUTOFF).method == "cell_list"


@pytest.mark.skipif(not vesin_backend.vesin_available(), reason="vesin-torch not installed")
def test_auto_takes_vesin_for_one_large_structure(monkeypatch):
    from mlff_distiller import neighbors

    rng = np.random.default_rng(3)
    box = dict(cell=[16.0] * 3, pbc=True)  # periodic: the host all-pairs path does not apply
    one = AtomsBatch.from_atoms(Atoms("H400", positions=rng.uniform(0, 16, (400, 3)), **box))
    monkeypatch.setitem(neighbors.AUTO_VESIN_MIN_ATOMS, "cpu", 300)
    assert neighbor_list_batch(one, CUTOFF).method == "vesin"
    two = AtomsBatch.from_atoms([Atoms("H400", positions=rng.uniform(0, 16, (400, 3)), **box)] * 2)
    assert neighbor_list_batch(two, CUTOFF).method == "cell_list", "many structures: our batched list"
    # On CUDA auto keeps our Triton cell list even for one large structure (measured faster than vesin once its
    # pairs are converted to the receiver-sorted contract, benchmarks/results/large_h100.md).
    assert "cuda" not in neighbors.AUTO_VESIN_MIN_ATOMS
    if torch.cuda.is_available() and neighbors.vesin_available():
        big = one.to("cuda")
        monkeypatch.setitem(neighbors.AUTO_VESIN_MIN_ATOMS, "cpu", 1)
        assert neighbor_list_batch(big, CUTOFF).method == "cell_list"


# ------------------------------------------------------------------------------------------------ Verlet skin
def _pair_forces(nl: NeighborList, positions: torch.Tensor, cutoff: float) -> torch.Tensor:
    """Forces (eV/Å) of a smooth pair potential ``sum (1 - r/rc)^3 / r`` over the list's edges."""
    pos = positions.detach().clone().requires_grad_(True)
    r = nl.distances(pos)
    energy = ((1 - r / cutoff) ** 3 / r).sum()
    return -torch.autograd.grad(energy, pos)[0]


def test_verlet_skin_md_matches_fresh_list():
    """1,000 steps of EMT copper MD (32 atoms, 7.2 Å cell: narrower than 2 x cutoff) at ~1,000 K: every step
    the skin list equals a fresh list (pairs, shifts, CSR) and gives the same pair-potential forces."""
    from ase.build import bulk
    from ase.calculators.emt import EMT
    from ase.md.verlet import VelocityVerlet
    from ase.units import fs

    from mlff_distiller.ase_compat import maxwell_boltzmann

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((2, 2, 2))
    atoms.rattle(0.05, seed=3)
    maxwell_boltzmann(atoms, 2000, rng=np.random.default_rng(4))
    atoms.calc = EMT()
    cutoff = 4.0
    skin_nl = VerletNeighborList(cutoff, skin=0.4)
    dyn = VelocityVerlet(atoms, timestep=5 * fs)
    checked = []

    def check():
        batch = AtomsBatch.from_atoms(atoms)
        got = skin_nl.update_batch(batch)
        fresh = neighbor_list_batch(batch, cutoff)
        assert torch.equal(got.edge_index, fresh.edge_index), f"step {len(checked)}"
        assert torch.equal(got.shifts, fresh.shifts) and torch.equal(got.row_ptr, fresh.row_ptr)
        torch.testing.assert_close(got.shift_vectors, fresh.shift_vectors, rtol=0, atol=1e-12)
        if len(checked) % 25 == 0:
            torch.testing.assert_close(
                _pair_forces(got, batch.positions, cutoff), _pair_forces(fresh, batch.positions, cutoff)
            )
        checked.append(got.num_edges)

    dyn.attach(check, interval=1)
    dyn.run(1000)
    assert len(checked) == 1001 and skin_nl.n_calls == 1001
    # Atoms drift by ~0.03 Å per step here: a 0.2 Å half-skin lasts a few steps, far fewer builds than steps.
    assert 10 <= skin_nl.n_builds <= 500, skin_nl
    assert min(checked) > 0


def test_verlet_rebuild_triggers_and_padded_mode():
    rng = np.random.default_rng(8)
    cell = np.eye(3) * 7.0
    atoms = Atoms("H20", positions=rng.uniform(0, 7, (20, 3)), cell=cell, pbc=True)
    b = AtomsBatch.from_atoms(atoms)
    vl = VerletNeighborList(3.0, skin=1.0)
    vl(b.positions, b.cell, b.pbc, b.batch, b.ptr)
    vl(b.positions.clone(), b.cell, b.pbc, b.batch, b.ptr)
    assert vl.n_builds == 1
    moved = b.positions.clone()
    moved[0, 0] += 0.45  # < skin / 2: reuse
    vl(moved, b.cell, b.pbc, b.batch, b.ptr)
    assert vl.n_builds == 1
    moved[0, 0] += 0.1  # now 0.55 > skin / 2 from the build
    vl(moved, b.cell, b.pbc, b.batch, b.ptr)
    assert vl.n_builds == 2
    vl(moved, b.cell * 1.01, b.pbc, b.batch, b.ptr)  # a cell 1 % larger: kept under the strain test
    assert vl.n_builds == 2 and vl.cell_updates == 1
    vl(moved, b.cell * 1.2, b.pbc, b.batch, b.ptr)  # 20 %: (3 + 1) x 0.2 Å > skin, rebuilt
    assert vl.n_builds == 3
    vl(moved, b.cell * 1.2, b.pbc, b.batch, b.ptr, numbers=b.numbers)  # numbers now tracked
    assert vl.n_builds == 4
    vl.skin = 0.5  # a new skin rebuilds
    vl(moved, b.cell * 1.2, b.pbc, b.batch, b.ptr, numbers=b.numbers)
    assert vl.n_builds == 5
    zero = VerletNeighborList(3.0, skin=0.0)
    for k in range(3):
        zero(b.positions + 1e-6 * k, b.cell, b.pbc, b.batch, b.ptr)
    assert zero.n_builds == 3, "skin 0 rebuilds whenever anything moved"
    padded = VerletNeighborList(3.0, skin=1.0, filter=False).update_batch(b)
    exact = neighbor_list_batch(b, 3.0)
    assert set(our_pairs(exact)) < set(our_pairs(padded)), "padded list is a strict superset here"
    assert float(padded.distances(b.positions).max()) < 4.0


def _walk(rng: np.random.Generator, positions: torch.Tensor, steps: int, size: float):
    """Positions of a random walk of every atom, ``size`` Å per step and coordinate at most."""
    pos = positions.clone()
    for _ in range(steps):
        pos = pos + torch.from_numpy(rng.uniform(-size, size, tuple(pos.shape))).to(pos.dtype)
        yield pos


@pytest.mark.parametrize("filt", [True, False])
def test_verlet_complete_list_is_kept_and_exact(filt):
    """A list that holds every pair of a non-periodic structure (benzene at 5 Å + skin) is built once, however far
    the atoms walk: the filtered list equals a fresh one at every step (and so do its pair forces), the unfiltered
    one is still every pair, those within the cutoff the fresh list's. ``keep_complete=False`` rebuilds by the
    displacement test."""
    from ase.build import molecule

    b = AtomsBatch.from_atoms(molecule("C6H6"), dtype=torch.float64)
    vl = VerletNeighborList(5.0, skin=0.3, filter=filt)
    plain = VerletNeighborList(5.0, skin=0.3, filter=filt, keep_complete=False)
    rng = np.random.default_rng(11)
    steps = 0
    for pos in _walk(rng, b.positions, 60, 0.08):  # ~0.6 Å drift per 10 steps: far past the half skin
        got, fresh = (
            vl(pos, b.cell, b.pbc, b.batch, b.ptr),
            neighbor_list_batch(dataclasses.replace(b, positions=pos), 5.0),
        )
        plain(pos, b.cell, b.pbc, b.batch, b.ptr)
        if filt:
            assert torch.equal(got.edge_index, fresh.edge_index) and torch.equal(got.row_ptr, fresh.row_ptr)
            torch.testing.assert_close(_pair_forces(got, pos, 5.0), _pair_forces(fresh, pos, 5.0), rtol=0, atol=0)
        else:  # every pair, those within the cutoff the fresh list's
            inside = got.edge_index[:, got.distances(pos) < 5.0]
            assert got.num_edges == 12 * 11 and torch.equal(inside, fresh.edge_index)
        steps += 1
    assert steps == 60 and vl.complete and vl.n_builds == 1, vl
    assert plain.n_builds > 5, "the displacement test rebuilds the same list"
    assert vl(pos, b.cell, b.pbc, b.batch, b.ptr, numbers=b.numbers) is not None and vl.n_builds == 2, "numbers given"


def test_verlet_incomplete_or_periodic_lists_rebuild_by_displacement():
    """Not complete, so rebuilt by the displacement test: a chain longer than cutoff + skin; a batch of a complete
    molecule and such a chain; a periodic box whose list has exactly n (n - 1) pairs (two atoms in a 12 Å box),
    whose atom walks to the face where the other's image comes within the cutoff: the rebuilt list holds it."""
    chain = Atoms("C12", positions=[[1.5 * k, 0.0, 0.0] for k in range(12)])
    small = Atoms("H2", positions=[[0, 0, 0], [0.74, 0, 0]])
    for case in ([chain], [small, chain]):
        b = AtomsBatch.from_atoms(case, dtype=torch.float64)
        vl = VerletNeighborList(5.0, skin=0.3)
        vl(b.positions, b.cell, b.pbc, b.batch, b.ptr)
        assert not vl.complete
        moved = b.positions.clone()
        moved[0, 1] += 0.2  # > skin / 2
        vl(moved, b.cell, b.pbc, b.batch, b.ptr)
        assert vl.n_builds == 2
    one = AtomsBatch.from_atoms(small, dtype=torch.float64)
    vl = VerletNeighborList(5.0, skin=0.3)
    vl(one.positions, one.cell, one.pbc, one.batch, one.ptr)
    assert vl.complete, "a lone H2 holds its one pair both ways"
    box = Atoms("H2", positions=[[6.0, 6.0, 6.0], [8.0, 6.0, 6.0]], cell=np.eye(3) * 12.0, pbc=True)
    b = AtomsBatch.from_atoms(box, dtype=torch.float64)
    vl = VerletNeighborList(5.0, skin=0.3)
    first = vl(b.positions, b.cell, b.pbc, b.batch, b.ptr)
    assert first.num_edges == 2 and not vl.complete, "periodic: images may enter"
    moved = b.positions.clone()
    moved[0, 0] = 0.5  # 7.5 Å from atom 1; its image at 12.5 Å is 4.5 Å from it
    got = vl(moved, b.cell, b.pbc, b.batch, b.ptr)
    fresh = neighbor_list_batch(dataclasses.replace(b, positions=moved), 5.0)
    assert vl.n_builds == 2 and torch.equal(got.edge_index, fresh.edge_index) and torch.equal(got.shifts, fresh.shifts)
    assert got.num_edges == 2 and bool((got.shifts != 0).any()), "the image pair, through the rebuild"


def test_verlet_device_inputs_are_kept_while_the_same_tensors_come():
    """A build on another device copies the caller's cell, pbc, batch and ptr once while the very same tensors come
    unmodified (MD): the same copies again; an in-place change or another tensor gets new copies. (Copies on the
    meta device: the caching alone, on a machine without a GPU.)"""
    b = AtomsBatch.from_atoms(Atoms("H2", positions=[[0, 0, 0], [0.7, 0, 0]], cell=np.eye(3) * 5, pbc=True))
    vl = VerletNeighborList(3.0)
    meta = torch.device("meta")
    inputs = (b.cell, b.pbc, b.batch, b.ptr)
    first = vl._device_inputs(inputs, meta)
    assert all(c.device == meta for c in first)
    assert all(a is c for a, c in zip(vl._device_inputs(inputs, meta), first, strict=True))
    b.cell.mul_(1.0)  # in place: a new version
    again = vl._device_inputs(inputs, meta)
    assert all(a is not c for a, c in zip(again, first, strict=True))
    other = (b.cell.clone(), b.pbc, b.batch, b.ptr)
    assert vl._device_inputs(other, meta)[0] is not again[0]


def test_neighbor_list_decides_a_device_molecule_from_the_cached_host_geometry(monkeypatch):
    """``host_cells`` of the same unmodified tensors is found again without a device read
    (``cached_host_cells``), and the auto rule's test for the device's molecular path reads it when there: periodic
    or not from its pbc, without ``molecular_device_applicable``'s device reads."""
    import mlff_distiller.neighbors as nb
    from mlff_distiller.neighbors._common import cached_host_cells, host_cells

    for pbc in (True, False):
        b = AtomsBatch.from_atoms(Atoms("H2", positions=[[0, 0, 0], [0.7, 0, 0]], cell=np.eye(3) * 5, pbc=pbc))
        args = (b.positions, b.cell, b.pbc, b.ptr, 3.0)
        assert cached_host_cells(*args) is None
        made = host_cells(b.positions, b.cell, b.pbc, b.batch, b.ptr, 3.0)
        assert cached_host_cells(*args) is made
        device_positions = b.positions.to("meta")  # stands for positions on a GPU

        def no_device_read(*a):
            raise AssertionError("read the device")

        monkeypatch.setattr(nb, "cached_host_cells", lambda *a, made=made: made)
        monkeypatch.setattr(nb, "molecular_device_applicable", no_device_read)
        assert nb._molecular_on_device(device_positions, *args[1:]) is (not pbc)
        monkeypatch.undo()
        b.cell.mul_(1.0)
        assert cached_host_cells(*args) is None, "modified in place: not the cached geometry"


def _assert_full_list(nl: NeighborList, positions: torch.Tensor, what: str) -> None:
    """What the engine promises the message backward (``message_passing(symmetric=True)``): every edge
    (i <- j, S) has its partner (j <- i, -S), and the pair's two shift vectors and distances agree (to rounding)."""
    partner = torch.from_numpy(edge_partners(nl.edge_index.cpu().numpy(), nl.shifts.cpu().numpy(), what))
    sv = nl.shift_vectors.cpu()
    torch.testing.assert_close(sv[partner], -sv, rtol=0, atol=1e-12 if sv.dtype == torch.float64 else 2e-5)
    d = nl.distances(positions).cpu()
    torch.testing.assert_close(d[partner], d, rtol=0, atol=1e-12 if d.dtype == torch.float64 else 2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_list_is_full_as_the_engine_promises(device, dtype):
    """The engine hands its lists to the message backward as full lists (its sender walk reads each atom's own
    receiver row for the edges the atom sends): every backend, the molecular path, the Verlet list filtered and
    padded, on all kinds of structures (triclinic, slabs, wires, tiny cells with self-images)."""
    from mlff_distiller.neighbors.molecular import molecular_pairs

    batch = AtomsBatch.from_atoms(structures(), dtype=dtype, device=device)
    for method in METHODS:
        _assert_full_list(neighbor_list_batch(batch, CUTOFF, method), batch.positions, method)
    if device == "cuda" or dtype == torch.float64:  # the Triton cell list: the interpreter on the CPU (slow)
        picks = structures() if device == "cuda" else structures()[:6]
        sub = AtomsBatch.from_atoms(picks, dtype=dtype, device=device)
        if _triton_ok(device):
            nl = neighbor_list_batch(sub, CUTOFF, "cell_list", cell_list_impl="triton")
            _assert_full_list(nl, sub.positions, "triton cell list")
    mols = AtomsBatch.from_atoms([a for a in structures() if not a.pbc.any()], dtype=dtype)
    _assert_full_list(molecular_pairs(mols.positions, mols.ptr, CUTOFF), mols.positions, "molecular")
    for filt in (True, False):
        vl = VerletNeighborList(CUTOFF, skin=0.7, filter=filt)
        _assert_full_list(vl.update_batch(batch), batch.positions, f"verlet filter={filt}")


def test_verlet_bad_input():
    for kwargs, match in [
        ({"cutoff": 0.0}, "cutoff"),
        ({"cutoff": float("nan")}, "cutoff"),
        ({"cutoff": 3.0, "skin": -0.1}, "skin"),
        ({"cutoff": 3.0, "skin": "wide"}, "skin"),
    ]:
        with pytest.raises(ValueError, match=match):
            VerletNeighborList(**kwargs)
    vl = VerletNeighborList(3.0)
    with pytest.raises(ValueError, match="skin"):
        vl.skin = float("inf")


def test_triton_row_block_ladder_is_coarse():
    """The rows kernel's tile comes from a short ladder (an MD list's longest row drifting by a few pairs must
    not JIT-compile a new variant), and always holds the row."""
    from mlff_distiller.neighbors._triton_host import MAX_ROW_SORT
    from mlff_distiller.neighbors._triton_host import row_block as _row_block

    assert {_row_block(n) for n in range(1, 65)} == {64}
    assert {_row_block(n) for n in range(65, 129)} == {128}
    assert {_row_block(n) for n in range(129, 257)} == {256}
    assert _row_block(1000) == 1024 and _row_block(MAX_ROW_SORT) == MAX_ROW_SORT
    assert all(_row_block(n) >= n for n in (1, 63, 64, 65, 255, 257, 1025, 2048, 3000, 5000))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_pairs_within_rounding_of_the_cutoff_match_brute(device, method):
    """Distances exactly at the cutoff and one float64 ulp either side of it, directly and through periodic images:
    every backend keeps exactly brute's pairs (vesin's own distances are re-checked near the cutoff)."""
    c = 5.0
    inside, outside = np.nextafter(c, 0.0), np.nextafter(c, 10.0)
    atoms = Atoms(
        "H4",
        positions=[[0, 0, 0], [c, 0, 0], [0, inside, 0], [0, 0, outside]],
        cell=np.eye(3) * 2 * c,
        pbc=True,
    )
    batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64, device=device)
    got = neighbor_list_batch(batch, c, method)
    want = neighbor_list_batch(batch, c, "brute")
    assert our_pairs(got) == our_pairs(want)
    assert (0, 2, (0, 0, 0)) in our_pairs(want) and (0, 1, (0, 0, 0)) not in our_pairs(want)


@pytest.mark.skipif(not vesin_backend.vesin_available(), reason="vesin-torch not installed")
@pytest.mark.parametrize("rel", [1e-12, -1e-12])
def test_vesin_distances_off_by_rounding_still_give_brute_pairs(monkeypatch, rel):
    """vesin's distances decide pairs only away from the cutoff: distances it rounds differently from this package
    (simulated: scaled by 1 ± 1e-12) must not move a pair across the cutoff."""
    cls = vesin_backend._vesin_class()

    class Rounded:
        def __init__(self, **kw):
            self.inner = cls(**kw)

        def compute(self, *args, **kw):
            i, j, s, d = self.inner.compute(*args, **kw)
            return i, j, s, d * (1 + rel)

    c = 5.0
    atoms = Atoms(
        "H4",
        positions=[[0, 0, 0], [c, 0, 0], [0, np.nextafter(c, 0.0), 0], [0, 0, np.nextafter(c, 10.0)]],
        cell=np.eye(3) * 2 * c,
        pbc=True,
    )
    batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
    want = our_pairs(neighbor_list_batch(batch, c, "brute"))
    monkeypatch.setattr(vesin_backend, "_vesin_class", lambda: Rounded)
    assert our_pairs(neighbor_list_batch(batch, c, "vesin")) == want


def test_verlet_seen_object_shortcut_decides_as_full_compare():
    """An MD step that passes the same cell/pbc/batch/ptr/numbers objects (the shortcut: only positions are
    compared) decides as one that passes an equal but new cell tensor (every input compared), and both follow the
    skin / 2 rule, for displacements on both sides of it, in float32 and float64."""
    rng = np.random.default_rng(11)
    atoms = Atoms("H30", positions=rng.uniform(0, 8, (30, 3)), cell=np.eye(3) * 8.0, pbc=True)
    for dtype in (torch.float32, torch.float64):
        b = AtomsBatch.from_atoms(atoms, dtype=dtype)
        vl = VerletNeighborList(3.0, skin=0.8)
        vl.update_batch(b)
        vl.update_batch(b)  # the cell, pbc, batch, ptr, numbers objects are now "seen"
        for step in range(40):
            moved = b.positions.clone()
            moved[step % 30] += torch.tensor(rng.normal(0, 0.25, 3), dtype=dtype)
            fast = vl.needs_rebuild(moved, b.cell, b.pbc, b.batch, b.ptr, b.numbers)
            slow = vl.needs_rebuild(moved, b.cell.clone(), b.pbc, b.batch, b.ptr, b.numbers)
            far = float((moved.double() - b.positions.double()).square().sum(1).max()) > 0.4**2
            assert fast == slow == far


def test_verlet_host_fast_path_decides_as_the_reference_formula(monkeypatch):
    """Host positions with the very same cell/pbc/batch/ptr/numbers objects take the NumPy fast path (the generic
    compare never runs) and decide exactly as ``(d * d).sum(axis=1).max() > (skin / 2)^2`` in float64, also for
    displacements within rounding of skin / 2; anything else (an in-place edit of the cell, another positions
    dtype, numbers dropped) goes the generic way and rebuilds."""
    rng = np.random.default_rng(12)
    atoms = Atoms("H30", positions=rng.uniform(0, 8, (30, 3)), cell=np.eye(3) * 8.0, pbc=True)
    half = 0.4
    for dtype in (torch.float32, torch.float64):
        for with_numbers in (True, False):
            b = AtomsBatch.from_atoms(atoms, dtype=dtype)
            numbers = b.numbers if with_numbers else None
            vl = VerletNeighborList(3.0, skin=2 * half, strain_reuse=False)  # a changed cell rebuilds
            vl(b.positions, b.cell, b.pbc, b.batch, b.ptr, numbers)
            built = b.positions.clone()
            generic = []
            slow = vl._needs_rebuild
            monkeypatch.setattr(vl, "_needs_rebuild", lambda *a, _slow=slow, _g=generic: _g.append(1) or _slow(*a))
            answers = set()
            for step in range(300):
                moved = built.clone()
                u = rng.normal(size=3)
                r = half * (1 + rng.choice([-1.0, 1.0]) * 10 ** rng.uniform(-17, -3))
                moved[step % 30] += torch.tensor(u / np.linalg.norm(u) * r, dtype=dtype)
                if step % 3 == 0:
                    moved.requires_grad_(True)
                d = moved.detach().numpy().astype(np.float64) - built.numpy()
                want = bool((d * d).sum(axis=1).max() > half**2)
                got = vl.needs_rebuild(moved, b.cell, b.pbc, b.batch, b.ptr, numbers)
                assert got is want, (dtype, step)
                answers.add(got)
            assert answers == {True, False}
            assert not generic, "the fast path decided every call"
            other = torch.float64 if dtype == torch.float32 else torch.float32
            assert vl.needs_rebuild(built.to(other), b.cell, b.pbc, b.batch, b.ptr, numbers)
            if with_numbers:
                assert vl.needs_rebuild(built, b.cell, b.pbc, b.batch, b.ptr)  # numbers no longer given
            assert not vl.needs_rebuild(built, b.cell, b.pbc, b.batch, b.ptr, numbers)
            n_generic = len(generic)
            b.cell.mul_(1.0)  # an in-place op bumps the version: compared again (equal: no rebuild)
            assert not vl.needs_rebuild(built, b.cell, b.pbc, b.batch, b.ptr, numbers)
            assert len(generic) == n_generic + 1
            assert not vl.needs_rebuild(built, b.cell, b.pbc, b.batch, b.ptr, numbers)  # seen again: fast
            assert len(generic) == n_generic + 1
            b.cell[0, 0, 0] += 0.01  # an in-place change of the cell rebuilds
            assert vl.needs_rebuild(built, b.cell, b.pbc, b.batch, b.ptr, numbers)


def test_finish_packed_sort_equals_two_stable_sorts(monkeypatch):
    """The contract's (i, j, S) order is the same from the packed-key sort and from the two-stable-sort fallback
    (taken when the packed key would overflow int64), on shuffled raw pairs with several images per pair."""
    from mlff_distiller.neighbors import _common

    rng = np.random.default_rng(5)
    atoms = Atoms("H40", positions=rng.uniform(0, 5, (40, 3)), cell=np.eye(3) * 5.0, pbc=True)
    b = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
    geo = _common.prepare(b.positions, b.cell, b.pbc, b.batch, b.ptr, 6.0)  # cutoff > cell: many images
    ref = neighbor_list_batch(b, 6.0, "brute")
    wrapped_s = ref.shifts - geo.image[ref.edge_index[0]] + geo.image[ref.edge_index[1]]
    perm = torch.from_numpy(rng.permutation(ref.num_edges))
    raw = _common.RawPairs(
        i=ref.edge_index[0][perm], j=ref.edge_index[1][perm], shifts=wrapped_s[perm], is_sorted=False
    )
    packed = _common.finish(geo, raw, "test")
    monkeypatch.setattr(_common, "PACKED_KEY_LIMIT", 0)
    stable = _common.finish(geo, raw, "test")
    for nl in (packed, stable):
        assert torch.equal(nl.edge_index, ref.edge_index) and torch.equal(nl.shifts, ref.shifts)
        assert torch.equal(nl.row_ptr, ref.row_ptr)
        torch.testing.assert_close(nl.shift_vectors, ref.shift_vectors, rtol=0, atol=1e-12)
