"""Neighbour lists vs ``ase.neighborlist.neighbor_list('ijS')``: exact pair sets, batching, edge cases."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.neighborlist import neighbor_list as ase_neighbor_list
from helpers import edge_partners, our_pairs

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
    with warnings.catch_warnings(), pytest.raises(ValueError, match="degenerate"):
        warnings.simplefilter("error", RuntimeWarning)  # a clear error, not NumPy's divide-by-zero warning first
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
