"""The periodic fast path of the Triton cell list (host tables + one wrapping/binning kernel) and the host-side
validation that every backend now shares (``_common.host_cells``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ase import Atoms
from test_neighbors import CUTOFF, DIST_ATOL, DTYPES, ase_pairs, check_contract, our_pairs, structures

from mlff_distiller.batch import AtomsBatch
from mlff_distiller.neighbors import _choose, choose_method, neighbor_list, neighbor_list_batch
from mlff_distiller.neighbors._common import host_cells, prepare
from mlff_distiller.neighbors.cell_list_triton import cell_list_triton, cell_list_triton_periodic, triton_runnable
from mlff_distiller.neighbors.vesin_backend import vesin_available

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def periodic_structures(device: str) -> list[Atoms]:
    """Fully periodic test structures: tiny cells (narrower than the cutoff: many images of the same bin), skewed
    triclinic ones, unwrapped positions; fewer on CPU, where the kernels run in the Triton interpreter."""
    picks = [a for a in structures() if a.pbc.all()]
    return picks if device == "cuda" else picks[:6]


def _skip_without_triton(device: str) -> None:
    if not triton_runnable(torch.device(device)):
        pytest.skip("Triton cannot run here")


def _both_paths(batch, cutoff: float = CUTOFF, **kw):
    args = (batch.positions, batch.cell, batch.pbc, batch.batch, batch.ptr, cutoff)
    host = host_cells(*args)
    assert host.all_periodic
    fast = cell_list_triton_periodic(batch.positions, batch.cell, batch.batch, host, **kw)
    general = cell_list_triton(prepare(*args, host=host), **kw)
    return fast, general


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_periodic_fast_path_matches_ase_and_the_general_path(device, dtype):
    """Every fully periodic structure: ASE's pairs and distances, and exactly the general Triton path's list."""
    _skip_without_triton(device)
    picks = periodic_structures(device)
    assert len(picks) >= 6
    batch = AtomsBatch.from_atoms(picks, dtype=dtype, device=device)
    fast, general = _both_paths(batch)
    check_contract(fast, batch)
    ptr = batch.ptr.tolist()
    start = fast.row_ptr[ptr].tolist()
    dist = fast.distances(batch.positions).cpu().double().numpy()
    for k, atoms in enumerate(AtomsBatch.from_atoms(picks, dtype=dtype).to_atoms()):
        ref, ref_d = ase_pairs(atoms, CUTOFF)
        assert our_pairs(fast, ptr[k], ptr[k + 1]) == ref, f"structure {k}"
        np.testing.assert_allclose(dist[start[k] : start[k + 1]], ref_d, rtol=0, atol=DIST_ATOL[dtype])
    for name in ("edge_index", "shifts", "row_ptr"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    torch.testing.assert_close(fast.shift_vectors, general.shift_vectors, rtol=0, atol=1e-12)
    # neighbor_list() takes the fast path for this batch and returns the same list.
    via_api = neighbor_list_batch(batch, CUTOFF, "cell_list", cell_list_impl="triton")
    assert torch.equal(via_api.edge_index, fast.edge_index) and torch.equal(via_api.shifts, fast.shifts)


@pytest.mark.parametrize("device", DEVICES)
def test_periodic_fast_path_long_rows_and_empty_structures(device):
    """Rows longer than max_row_sort take the torch-sort fallback with this call's own wrapping (the same list);
    an empty structure and a structure with no pairs are fine."""
    _skip_without_triton(device)
    rng = np.random.default_rng(3)
    box = Atoms("H40", positions=rng.uniform(-3, 12, (40, 3)), cell=np.eye(3) * 8.5, pbc=True)
    lonely = Atoms("H", positions=[[1.0, 1.0, 1.0]], cell=np.eye(3) * 12.0, pbc=True)
    # AtomsBatch refuses empty structures; neighbor_list's tensors allow them (ptr [0, 40, 40, 41]).
    parts = AtomsBatch.from_atoms([box, lonely], dtype=torch.float64, device=device)
    batch = SimpleNamespace(
        positions=parts.positions,
        cell=torch.stack([parts.cell[0], torch.eye(3, dtype=torch.float64, device=device) * 7.0, parts.cell[1]]),
        pbc=torch.ones(3, 3, dtype=torch.bool, device=device),
        batch=torch.tensor([0] * 40 + [2], device=device),
        ptr=torch.tensor([0, 40, 40, 41], device=device),
    )
    default, _ = _both_paths(batch)
    short, general = _both_paths(batch, max_row_sort=4)
    for nl in (short, general):
        assert torch.equal(nl.edge_index, default.edge_index) and torch.equal(nl.shifts, default.shifts)
    assert our_pairs(default, 0, 40) == ase_pairs(box, CUTOFF)[0]
    assert int(default.row_ptr[-1]) == int(default.row_ptr[40]), "the lonely atom has no neighbour"


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_inputs_are_clear_errors(device):
    atoms = Atoms("H2", positions=[[0, 0, 0], [1.0, 0, 0]], cell=np.eye(3) * 6.0, pbc=True)
    b = AtomsBatch.from_atoms(atoms, dtype=torch.float64, device=device)
    cell = b.cell.clone()
    cell[0, 1, 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite cell"):
        neighbor_list(b.positions, cell, b.pbc, b.batch, b.ptr, CUTOFF, "brute")
    if not triton_runnable(torch.device(device)):
        return
    for bad in (float("nan"), float("inf"), float("-inf")):
        pos = b.positions.clone()
        pos[1, 0] = bad
        with pytest.raises(ValueError, match="non-finite positions"):
            neighbor_list(pos, b.cell, b.pbc, b.batch, b.ptr, CUTOFF, "cell_list", cell_list_impl="triton")
    # The periodic path flags it in its binning kernel (256 atoms per program): also from the second program.
    rng = np.random.default_rng(3)
    many = Atoms("H300", positions=rng.random((300, 3)) * 14.0, cell=np.eye(3) * 14.0, pbc=True)
    bm = AtomsBatch.from_atoms(many, dtype=torch.float32, device=device)
    pos = bm.positions.clone()
    pos[280, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite positions"):
        neighbor_list(pos, bm.cell, bm.pbc, bm.batch, bm.ptr, CUTOFF, "cell_list", cell_list_impl="triton")


def test_auto_rule_from_host_tables_equals_the_device_rule():
    """``auto`` now decides from the host tables: they hold the Geometry's atom and image counts, and the rule on
    them gives the documented rule's answer on the Geometry."""
    for k in range(0, 60, 5):
        b = AtomsBatch.from_atoms(structures()[k : k + 5])
        args = (b.positions, b.cell, b.pbc, b.batch, b.ptr, CUTOFF)
        host, geo = host_cells(*args), prepare(*args)
        assert torch.equal(host.counts, geo.counts) and torch.equal(host.n_images, geo.n_images)
        assert _choose(host.counts, host.n_images, "cpu", b.num_atoms, vesin_available) == choose_method(geo)


@pytest.mark.parametrize("device", DEVICES)
def test_one_pass_scratch_rows_and_their_overflow(device):
    """The periodic path counts and stores rows in one pass into scratch rows sized from the mean density; a
    cluster in a large periodic box outgrows them, and the fill pass redoes those rows (same list as ASE)."""
    _skip_without_triton(device)
    from mlff_distiller.neighbors.cell_list_triton import _scratch_cap

    rng = np.random.default_rng(11)
    cluster = Atoms("H50", positions=rng.uniform(10.0, 13.0, (50, 3)), cell=np.eye(3) * 30.0, pbc=True)
    liquid = Atoms("H40", positions=rng.uniform(0.0, 7.4, (40, 3)), cell=np.eye(3) * 7.4, pbc=True)
    for atoms, overflow in ((cluster, True), (liquid, False)):
        batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64, device=device)
        host = host_cells(batch.positions, batch.cell, batch.pbc, batch.batch, batch.ptr, CUTOFF)
        cap = _scratch_cap(host, batch.num_atoms)
        fast, general = _both_paths(batch)
        longest = int((fast.row_ptr[1:] - fast.row_ptr[:-1]).max())
        assert cap > 0 and (longest > cap) == overflow, (cap, longest)
        assert our_pairs(fast) == ase_pairs(atoms, CUTOFF)[0]
        assert torch.equal(fast.edge_index, general.edge_index) and torch.equal(fast.shifts, general.shifts)


def test_scratch_cap_rule():
    from mlff_distiller.neighbors.cell_list_triton import SCRATCH_MAX_KEYS, _scratch_cap

    water = Atoms("H192", positions=np.zeros((192, 3)), cell=np.eye(3) * 12.42, pbc=True)  # ~0.1 atoms/Å³
    b = AtomsBatch.from_atoms(water)
    host = host_cells(b.positions, b.cell, b.pbc, b.batch, b.ptr, CUTOFF)
    assert _scratch_cap(host, 192) == 128  # 2 x 52 + 16 -> 128
    assert _scratch_cap(host, SCRATCH_MAX_KEYS // 64) == 0  # too many keys in all: two passes


@pytest.mark.parametrize("device", DEVICES)
def test_host_cells_cache_follows_the_cell_tensors(device):
    """Repeated calls on the same cell / pbc / ptr tensors reuse one HostCells (no copies, no NumPy geometry);
    an in-place change of the cell, or other tensors, make a new one, and the list follows the new cell exactly
    (vs ASE)."""
    _skip_without_triton(device)
    atoms = periodic_structures(device)[1]
    batch = AtomsBatch.from_atoms([atoms], dtype=torch.float64, device=device)
    args = (batch.positions, batch.cell, batch.pbc, batch.batch, batch.ptr, CUTOFF)
    first = host_cells(*args)
    assert host_cells(*args) is first  # same tensors, unmodified: cached
    nl_before = neighbor_list(*args, method="cell_list", cell_list_impl="triton")
    other = AtomsBatch.from_atoms([atoms], dtype=torch.float64, device=device)
    fresh = host_cells(other.positions, other.cell, other.pbc, other.batch, other.ptr, CUTOFF)
    assert fresh is not first  # equal values, other tensors: not served from the cache
    torch.testing.assert_close(fresh.basis, first.basis)
    # Stretch the cell in place (positions scaled with it): a new HostCells, and the list of the new geometry.
    batch.cell.mul_(1.07)
    batch.positions.mul_(1.07)
    second = host_cells(*args)
    assert second is not first
    torch.testing.assert_close(second.basis, first.basis * 1.07)
    nl_after = neighbor_list(*args, method="cell_list", cell_list_impl="triton")
    stretched = atoms.copy()
    stretched.set_cell(atoms.cell * 1.07, scale_atoms=True)
    ref, _ = ase_pairs(stretched, CUTOFF)
    assert our_pairs(nl_after, 0, len(atoms)) == ref
    assert nl_after.num_edges < nl_before.num_edges  # the stretched box has fewer pairs within the cutoff
