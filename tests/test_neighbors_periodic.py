"""The periodic fast path of the Triton cell list (host tables + one wrapping/binning kernel) and the host-side
validation that every backend now shares (``_common.host_cells``)."""

from __future__ import annotations

import importlib
import itertools
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

# The module (the package exports a function of the same name).
clt = importlib.import_module("mlff_distiller.neighbors.cell_list_triton")
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
    from mlff_distiller.neighbors._triton_host import scratch_cap as _scratch_cap

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
    from mlff_distiller.neighbors._triton_host import SCRATCH_MAX_KEYS
    from mlff_distiller.neighbors._triton_host import scratch_cap as _scratch_cap

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


def test_host_cells_all_periodic_is_computed_once():
    """``HostCells.all_periodic``: every structure periodic along all three axes, computed at the first use and
    then kept with the (cached) HostCells: no tensor op per list build."""
    rng = np.random.default_rng(4)
    for pbc, want in (([True] * 3, True), ([True, True, False], False), ([False] * 3, False)):
        atoms = Atoms("H8", positions=rng.uniform(0, 6, (8, 3)), cell=np.eye(3) * 6.0, pbc=pbc)
        b = AtomsBatch.from_atoms([atoms, atoms.copy()])
        host = host_cells(b.positions, b.cell, b.pbc, b.batch, b.ptr, CUTOFF)
        assert host.all_periodic is want
        host.pbc.logical_not_()  # (never done by the package: the HostCells' own copy) the cached answer stays
        assert host.all_periodic is want
        assert host_cells(b.positions, b.cell, b.pbc, b.batch, b.ptr, CUTOFF).all_periodic is want
    mixed = [Atoms("H", cell=np.eye(3) * 6.0, pbc=True), Atoms("H", cell=np.eye(3) * 6.0, pbc=[True, False, True])]
    b = AtomsBatch.from_atoms(mixed)
    assert host_cells(b.positions, b.cell, b.pbc, b.batch, b.ptr, CUTOFF).all_periodic is False


# ------------------------------------------------------------------------------------------------ speculative rows
# On CUDA the periodic path queues the row sort before its one sync, into outputs for n * cap pairs, and returns
# exact prefixes of them (cell_list_triton's module docstring). The CPU tests force it with speculate=True; the
# interpreter's tl.sort costs ~0.5 s per atom, so they use few atoms. The reference is the same call with
# speculate=False (row sort after the sync; on CPU the torch sort of finish()).


def _boxes(rng: np.random.Generator, count: int, atoms: int, side: float) -> list[Atoms]:
    """Skewed periodic boxes (``side`` Å, narrower than 2 x the cutoff when side < 10) with unwrapped atoms."""
    out = []
    for _ in range(count):
        cell = np.diag(rng.uniform(0.9, 1.1, 3) * side) + np.tril(rng.uniform(-0.3, 0.3, (3, 3)) * side, k=-1)
        frac = rng.uniform(-0.5, 1.5, (atoms, 3))
        out.append(Atoms(numbers=np.ones(atoms, dtype=int), positions=frac @ cell, cell=cell, pbc=True))
    return out


def _speculative_and_plain(batch, cutoff: float = CUTOFF, **kw):
    args = (batch.positions, batch.cell, batch.pbc, batch.batch, batch.ptr, cutoff)
    host = host_cells(*args)
    spec = cell_list_triton_periodic(batch.positions, batch.cell, batch.batch, host, speculate=True, **kw)
    plain = cell_list_triton_periodic(batch.positions, batch.cell, batch.batch, host, speculate=False, **kw)
    return spec, plain, host


def _same_exact_contiguous(nl, ref) -> None:
    e = ref.num_edges
    assert nl.edge_index.shape == (2, e) and nl.shifts.shape == (e, 3) and nl.shift_vectors.shape == (e, 3)
    for name in ("edge_index", "shifts", "row_ptr", "shift_vectors"):
        assert getattr(nl, name).is_contiguous(), name
    for name in ("edge_index", "shifts", "row_ptr"):
        assert torch.equal(getattr(nl, name), getattr(ref, name)), name
    torch.testing.assert_close(nl.shift_vectors, ref.shift_vectors, rtol=0, atol=1e-12)


def _vs_ase(nl, batch, picks) -> None:
    ptr = batch.ptr.tolist()
    for k, atoms in enumerate(AtomsBatch.from_atoms(picks, dtype=batch.dtype).to_atoms()):
        assert our_pairs(nl, ptr[k], ptr[k + 1]) == ase_pairs(atoms, CUTOFF)[0], f"structure {k}"


@pytest.mark.parametrize("device", DEVICES)
def test_speculative_rows_many_small_triclinic_boxes(device):
    """Boxes narrower than 2 x cutoff (one bin visited through several images), skewed, many per batch: the
    speculative list is ASE's, and exactly the sync path's, with contiguous exactly sized tensors."""
    _skip_without_triton(device)
    rng = np.random.default_rng(21)
    picks = _boxes(rng, 5, 3, 5.0) + _boxes(rng, 1, 2, 3.5) if device == "cpu" else _boxes(rng, 200, 7, 6.0)
    batch = AtomsBatch.from_atoms(picks, dtype=torch.float64, device=device)
    spec, plain, _ = _speculative_and_plain(batch)
    check_contract(spec, batch)
    _same_exact_contiguous(spec, plain)
    _vs_ase(spec, batch, picks)
    # The speculation held: the list is carved from the capacity buffers (row_ptr shares their allocation).
    assert spec.edge_index.untyped_storage().data_ptr() == spec.row_ptr.untyped_storage().data_ptr()


@pytest.mark.parametrize("device", DEVICES)
def test_speculative_rows_fall_back_when_a_row_outgrows_cap(device):
    """A cluster in a large periodic box has rows longer than the scratch rows: the speculative output is
    dropped and the fill pass redoes it (same list as ASE). With isolated atoms alongside, the total still fits
    the capacity (the kernel wrote garbage rows in bounds); alone, it does not (the kernel wrote nothing)."""
    _skip_without_triton(device)
    from mlff_distiller.neighbors._triton_host import scratch_cap

    rng = np.random.default_rng(8)
    cluster = Atoms("H34", positions=rng.uniform(10.0, 12.5, (34, 3)), cell=np.eye(3) * 40.0, pbc=True)
    lonely = Atoms("H12", positions=np.indices((3, 2, 2)).reshape(3, -1).T * 12.0 + 1.0, cell=np.eye(3) * 36.0)
    lonely.pbc = True
    cases = [[cluster, lonely]] if device == "cpu" else [[cluster, lonely], [cluster]]
    for picks in cases:
        batch = AtomsBatch.from_atoms(picks, dtype=torch.float64, device=device)
        spec, plain, host = _speculative_and_plain(batch)
        cap = scratch_cap(host, batch.num_atoms)
        rows = spec.row_ptr[1:] - spec.row_ptr[:-1]
        assert cap == 32 and int(rows.max()) == 33, (cap, int(rows.max()))
        assert (spec.num_edges <= batch.num_atoms * cap) == (len(picks) == 2)
        _same_exact_contiguous(spec, plain)
        _vs_ase(spec, batch, picks)


@pytest.mark.parametrize("device", DEVICES)
def test_speculative_rows_empty_lists_and_non_finite(device):
    """No pairs at all (with an empty structure in the batch) gives the empty list; NaN or inf positions raise
    the same ValueError as the sync path."""
    _skip_without_triton(device)
    pos = torch.tensor([[1.0, 1.0, 1.0], [9.0, 9.0, 9.0], [1.0, 14.0, 1.0]], dtype=torch.float64, device=device)
    cell = torch.eye(3, dtype=torch.float64, device=device).expand(2, 3, 3) * 20.0
    batch = SimpleNamespace(
        positions=pos,
        cell=cell.contiguous(),
        pbc=torch.ones(2, 3, dtype=torch.bool, device=device),
        batch=torch.tensor([1, 1, 1], device=device),
        ptr=torch.tensor([0, 0, 3], device=device),
    )
    spec, plain, _ = _speculative_and_plain(batch)
    assert spec.num_edges == 0 and torch.equal(spec.row_ptr, plain.row_ptr)
    assert spec.edge_index.shape == (2, 0) and spec.shift_vectors.dtype == torch.float64
    for bad in (float("nan"), float("inf")):
        batch.positions = pos.clone()
        batch.positions[2, 1] = bad
        for speculate in (True, False):
            host = host_cells(batch.positions, batch.cell, batch.pbc, batch.batch, batch.ptr, CUTOFF)
            with pytest.raises(ValueError, match="non-finite positions"):
                cell_list_triton_periodic(batch.positions, batch.cell, batch.batch, host, speculate=speculate)


@pytest.mark.gpu
def test_speculative_rows_cuda_water_sized_box_is_the_default_path():
    """A 24,000-atom box at water's atom density (issue 7's case) on CUDA: neighbor_list() takes the speculative
    path by default, and it gives exactly the sync path's list and the torch cell list's pairs, float32 too."""
    rng = np.random.default_rng(4)
    side = (24000 / 0.1) ** (1.0 / 3.0)
    box = Atoms("H24000", positions=rng.uniform(0.0, side, (24000, 3)), cell=np.eye(3) * side, pbc=True)
    for dtype in DTYPES:
        batch = AtomsBatch.from_atoms(box, dtype=dtype, device="cuda")
        spec, plain, _ = _speculative_and_plain(batch)
        _same_exact_contiguous(spec, plain)
        assert spec.edge_index.untyped_storage().data_ptr() == spec.row_ptr.untyped_storage().data_ptr()
        via_api = neighbor_list_batch(batch, CUTOFF, "cell_list", cell_list_impl="triton")
        assert torch.equal(via_api.edge_index, spec.edge_index) and torch.equal(via_api.shifts, spec.shifts)
        torch_nl = neighbor_list_batch(batch, CUTOFF, "cell_list", cell_list_impl="torch")
        assert torch.equal(torch_nl.edge_index, spec.edge_index) and torch.equal(torch_nl.shifts, spec.shifts)


def test_carve_gives_aligned_disjoint_contiguous_views():
    from mlff_distiller.neighbors._triton_host import carve

    parts = dict(a=((5, 3), torch.float64), b=((7,), torch.int32), c=((3, 4), torch.int64), d=((1,), torch.float32))
    views = carve(torch.device("cpu"), **parts)
    spans = []
    for name, (shape, dtype) in parts.items():
        t = views[name]
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous(), name
        assert t.data_ptr() % 16 == 0, name
        spans.append((t.data_ptr(), t.data_ptr() + t.nbytes))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))


# CUDA graphs of the periodic path (cell_list_triton, "CUDA graphs"): from the second call on the same cells and
# atom count, everything before the sync is a graph replay. The reference is the same call with graphs=False.


def _graph_storages(host) -> set[int]:
    ptrs = set()
    for entry in host.derived.values():
        if isinstance(entry, clt._Replay):
            q = entry.q
            for t in (entry.pos, entry.batch, q.image, q.wrapped, *q.common, *q.bufs.values()):
                if torch.is_tensor(t):
                    ptrs.add(t.untyped_storage().data_ptr())
    return ptrs


def _graph_and_plain(pos, cell, pbc, batch, ptr):
    host = host_cells(pos, cell, pbc, batch, ptr, CUTOFF)
    nl = cell_list_triton_periodic(pos, cell, batch, host, graphs=True)
    ref = cell_list_triton_periodic(pos, cell, batch, host, graphs=False)
    return nl, ref, host


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fresh", "clone"])
def test_graph_replay_follows_moving_atoms_exactly(monkeypatch, mode):
    """A liquid-dense box and a batch of 200 small skewed boxes, atoms displaced between calls (in place and as new
    tensors): every graph replay gives exactly the plain path's list, and lists returned earlier stay intact (no
    view of graph-owned memory)."""
    monkeypatch.setattr(clt, "GRAPH_OUTPUTS", mode)
    rng = np.random.default_rng(5)
    side = (3000 / 0.1) ** (1.0 / 3.0)
    liquid = [Atoms("H3000", positions=rng.uniform(0.0, side, (3000, 3)), cell=np.eye(3) * side, pbc=True)]
    for picks in (liquid, _boxes(rng, 200, 7, 6.0)):
        for dtype in DTYPES:
            b = AtomsBatch.from_atoms(picks, dtype=dtype, device="cuda")
            pos = b.positions.clone()
            kept = []
            for step in range(5):
                nl, ref, host = _graph_and_plain(pos, b.cell, b.pbc, b.batch, b.ptr)
                _same_exact_contiguous(nl, ref)
                replayed = step >= 1
                key = clt.graph_key(pos, host.derived[("triton_periodic", pos.device, dtype)][3], mode)
                assert isinstance(host.derived[key], clt._Replay) == replayed, step
                if replayed:
                    graph_mem = _graph_storages(host)
                    for t in (nl.edge_index, nl.shifts, nl.shift_vectors, nl.row_ptr):
                        assert t.untyped_storage().data_ptr() not in graph_mem
                kept.append((nl, [t.clone() for t in (ref.edge_index, ref.shifts, ref.shift_vectors, ref.row_ptr)]))
                noise = torch.as_tensor(rng.normal(0.0, 0.3, tuple(pos.shape)), dtype=dtype, device="cuda")
                if step % 2:
                    pos.add_(noise)
                else:
                    pos = pos + noise
            for nl, (ei, sh, sv, rp) in kept:
                assert torch.equal(nl.edge_index, ei) and torch.equal(nl.shifts, sh) and torch.equal(nl.row_ptr, rp)
                assert torch.equal(nl.shift_vectors, sv)


@pytest.mark.gpu
def test_graph_replay_never_reuses_a_graph_across_keys():
    """Interleaved calls on two cells with the same atom count, another atom count, a cell modified in place and a
    new batch vector: each uses its own graph (through neighbor_list's HostCells cache) and stays exact."""
    rng = np.random.default_rng(9)

    def box(n, side):
        atoms = Atoms(f"H{n}", positions=rng.uniform(0.0, side, (n, 3)), cell=np.eye(3) * side, pbc=True)
        return AtomsBatch.from_atoms([atoms], dtype=torch.float64, device="cuda")

    boxes = [box(1500, 24.0), box(1500, 25.0), box(1505, 24.0)]
    for _ in range(3):
        for b in boxes:
            nl = neighbor_list_batch(b, CUTOFF, "cell_list", cell_list_impl="triton")
            host = host_cells(b.positions, b.cell, b.pbc, b.batch, b.ptr, CUTOFF)
            _same_exact_contiguous(nl, cell_list_triton_periodic(b.positions, b.cell, b.batch, host, graphs=False))
    b = boxes[0]
    b.cell.mul_(1.02)  # new version: new HostCells, so no stale graph (its tables belong to the old cell)
    b.batch = b.batch.clone()
    for _ in range(3):
        nl = neighbor_list_batch(b, CUTOFF, "cell_list", cell_list_impl="triton")
        torch_nl = neighbor_list_batch(b, CUTOFF, "cell_list", cell_list_impl="torch")
        assert torch.equal(nl.edge_index, torch_nl.edge_index) and torch.equal(nl.shifts, torch_nl.shifts)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fresh", "clone"])
def test_graph_replay_overflow_fallback_and_non_finite(monkeypatch, mode):
    """Replays whose rows outgrow cap (atoms moved into a cluster) take the fill pass, exactly as the plain path
    does; NaN positions raise the same ValueError; the graph still serves the calls after them."""
    monkeypatch.setattr(clt, "GRAPH_OUTPUTS", mode)
    rng = np.random.default_rng(8)
    cluster = Atoms("H34", positions=rng.uniform(10.0, 12.5, (34, 3)), cell=np.eye(3) * 40.0, pbc=True)
    lonely = Atoms("H12", positions=np.indices((3, 2, 2)).reshape(3, -1).T * 12.0 + 1.0, cell=np.eye(3) * 36.0)
    lonely.pbc = True
    b = AtomsBatch.from_atoms([cluster, lonely], dtype=torch.float64, device="cuda")
    clustered = b.positions.clone()
    spread = clustered.clone()
    spread[:34] = torch.as_tensor(np.indices((4, 3, 3)).reshape(3, -1).T[:34] * 9.5 + 1.0, device="cuda")
    nan = spread.clone()
    nan[40, 1] = float("nan")
    for pos in (spread, spread, clustered, spread, nan, clustered, spread):
        host = host_cells(pos, b.cell, b.pbc, b.batch, b.ptr, CUTOFF)
        if pos is nan:
            for graphs in (True, False):
                with pytest.raises(ValueError, match="non-finite positions"):
                    cell_list_triton_periodic(pos, b.cell, b.batch, host, graphs=graphs)
            continue
        nl, ref, host = _graph_and_plain(pos, b.cell, b.pbc, b.batch, b.ptr)
        _same_exact_contiguous(nl, ref)
        rows = nl.row_ptr[1:] - nl.row_ptr[:-1]
        assert (int(rows.max()) > 32) == (pos is clustered)
    assert any(isinstance(e, clt._Replay) for e in host.derived.values())


def test_graph_memo_is_cuda_only_and_switchable(device):
    """Off CUDA (the interpreter) the graph path is never entered, whatever the flag; the flag defaults to on
    unless MLFF_DISTILLER_NL_GRAPHS=0."""
    import os

    _skip_without_triton(device)
    assert clt.CUDA_GRAPHS == (os.environ.get("MLFF_DISTILLER_NL_GRAPHS", "1") != "0")
    if device.type == "cuda":
        pytest.skip("the CUDA behaviour is tested by the gpu tests")
    rng = np.random.default_rng(3)
    b = AtomsBatch.from_atoms(_boxes(rng, 2, 3, 5.0), dtype=torch.float64, device=device)
    host = host_cells(b.positions, b.cell, b.pbc, b.batch, b.ptr, CUTOFF)
    lists = [cell_list_triton_periodic(b.positions, b.cell, b.batch, host, graphs=True) for _ in range(2)]
    assert not any(isinstance(k, tuple) and k[0] == "triton_periodic_graph" for k in host.derived)
    _same_exact_contiguous(lists[1], cell_list_triton_periodic(b.positions, b.cell, b.batch, host, graphs=False))


def test_graph_keys_and_memory_budget(monkeypatch):
    """Graph keys separate atom count, dtype, cap and output mode; beyond GRAPH_MAX_BYTES the oldest graphs are
    dropped (their cells use the plain path from then on), the newest always stays, dead cells are forgotten."""
    pos = torch.zeros(4, 3, dtype=torch.float64)
    keys = {
        clt.graph_key(pos, 32, "fresh"),
        clt.graph_key(pos.float(), 32, "fresh"),
        clt.graph_key(torch.zeros(5, 3, dtype=torch.float64), 32, "fresh"),
        clt.graph_key(pos, 64, "fresh"),
        clt.graph_key(pos, 32, "clone"),
    }
    assert len(keys) == 5
    monkeypatch.setattr(clt, "_GRAPHS", [])
    monkeypatch.setattr(clt, "GRAPH_MAX_BYTES", 250)
    hosts = []
    for k in range(4):
        cell = torch.eye(3, dtype=torch.float64)[None] * (10.0 + k)
        h = host_cells(pos, cell, torch.ones(1, 3, dtype=torch.bool), torch.zeros(4, dtype=torch.long),
                       torch.tensor([0, 4]), CUTOFF)  # fmt: skip
        hosts.append(h)
    key = clt.graph_key(pos, 32, "fresh")
    entries = [SimpleNamespace(nbytes=100) for _ in hosts]
    for h, e in zip(hosts[:3], entries, strict=False):
        h.derived[key] = e
        clt._remember(h, key, e)
    assert hosts[0].derived[key] == clt._OFF and hosts[1].derived[key] is entries[1]
    assert [n for _, n in clt.live_graphs()] == [100, 100]
    big = SimpleNamespace(nbytes=1000)
    hosts[3].derived[key] = big
    clt._remember(hosts[3], key, big)
    assert clt.live_graphs() == [(key, 1000)]
    assert hosts[1].derived[key] == clt._OFF and hosts[2].derived[key] == clt._OFF


@pytest.mark.parametrize("mode", ["fresh", "clone"])
def test_graph_path_logic_with_a_stand_in_graph(monkeypatch, mode):
    """The replay path's host logic on the CPU interpreter, with a stand-in for torch.cuda's graph whose capture
    runs the kernels once and whose replay does nothing (so only unchanged positions are valid): the first call is
    left to the plain path, the second captures, later ones replay; each list is exactly the plain path's, and
    the memo and budget registry hold one graph per mode."""
    import contextlib

    _skip_without_triton("cpu")

    class StandIn:
        def replay(self):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandIn)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, **kw: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(clt, "GRAPH_OUTPUTS", mode)
    monkeypatch.setattr(clt, "_GRAPHS", [])
    b = AtomsBatch.from_atoms(_boxes(np.random.default_rng(21), 2, 3, 5.0), dtype=torch.float64, device="cpu")
    host = host_cells(b.positions, b.cell, b.pbc, b.batch, b.ptr, CUTOFF)
    ref = cell_list_triton_periodic(b.positions, b.cell, b.batch, host, speculate=False)
    tables = host.derived[("triton_periodic", b.positions.device, b.positions.dtype)]
    assert clt._replay_periodic(b.positions, b.cell, b.batch, host, tables, 2048) is clt._NOT_REPLAYED
    for _ in range(2):
        nl = clt._replay_periodic(b.positions, b.cell, b.batch, host, tables, 2048)
        _same_exact_contiguous(nl, ref)
        assert nl.edge_index.untyped_storage().data_ptr() not in _graph_storages(host)
    assert [k for k, _ in clt.live_graphs()] == [clt.graph_key(b.positions, tables[3], mode)]
