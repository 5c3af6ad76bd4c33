"""Static-shape buckets: the ladder, and padding that is exactly inert (padded == unpadded)."""

import itertools

import numpy as np
import pytest
import torch
from ase.build import molecule
from helpers import assert_bucket_csr, make_model, random_molecule, silicon_cell, triclinic_cu
from mlff_distiller.kernels import use_backend

from mlff_distiller import AtomsBatch, ForceEngine
from mlff_distiller.buckets import (
    Bucket,
    BucketLadder,
    PaddedGraph,
    fill_molecule_host,
    fill_padded,
    fill_padded_host,
    pad_graph,
)
from mlff_distiller.engine_padded import unpack
from mlff_distiller.neighbors import neighbor_list_batch
from mlff_distiller.neighbors.molecular import molecular_pairs

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# CPU, and CUDA as a gpu-marked case (reported as skipped without a GPU): the padded step there is a CUDA-graph replay.
CSR_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def test_ladder_is_geometric_and_select_is_the_smallest_fit():
    ladder = BucketLadder(min_atoms=16, max_atoms=5000, min_edges=64, max_edges=100_000, growth=1.5, align=8)
    for caps, hi in ((ladder.atom_capacities, 5000), (ladder.edge_capacities, 100_000)):
        assert all(c % 8 == 0 for c in caps) and caps[-1] >= hi
        ratios = [b / a for a, b in itertools.pairwise(caps)]
        assert all(1.0 < r <= 1.5 + 8 / a for r, a in zip(ratios, caps, strict=False))
    for n, e in [(0, 0), (1, 0), (15, 64), (16, 65), (23, 1000), (4998, 99_000)]:
        b = ladder.select(n, e)
        assert b.fits(n, e) and b.atoms >= n + 1  # always at least one padding atom
        smaller_a = [c for c in ladder.atom_capacities if c < b.atoms]
        smaller_e = [c for c in ladder.edge_capacities if c < b.edges]
        assert not smaller_a or smaller_a[-1] < n + 1
        assert not smaller_e or smaller_e[-1] < max(e, 1)
    last_a = ladder.atom_capacities[-1]
    assert ladder.select(last_a - 1, 10) is not None and ladder.select(last_a, 10) is None
    assert ladder.select(10, ladder.edge_capacities[-1] + 1) is None


def test_default_ladder_steps_finer_for_large_buckets():
    """The default ladder steps by 1.25 below 2,048 atoms / 65,536 edges and by 1.03 from there on (stop 62; 1.0625
    before), so a large batch pads by at most ~3 % (4,096 g2 molecules, 21,749 atoms: 22,144 slots, 26,472 at 1.25
    throughout); one ratio when fine_growth = growth."""
    ladder = BucketLadder(max_edges=2**19)
    assert ladder.fine_growth == 1.03
    for caps, fine_from in ((ladder.atom_capacities, 2048), (ladder.edge_capacities, 65536)):
        for a, b in itertools.pairwise(caps):
            assert 1.0 < b / a <= (1.03 if a >= fine_from else 1.25) + 8 / a
    assert ladder.select(21_749, 139_344).atoms == 22_144
    assert ladder.select(3_000, 163_316).atoms == 3_056
    assert ladder.select(3_000, 163_316).edges <= 163_316 * 1.03 + 8
    coarse = BucketLadder(max_edges=2**19, fine_growth=1.25)
    assert coarse.select(21_749, 139_344).atoms == 26_472
    assert [c for c in coarse.atom_capacities if c < 2048] == [c for c in ladder.atom_capacities if c < 2048]
    assert len(ladder.atom_capacities) > len(coarse.atom_capacities)


def test_small_atoms_rungs_come_before_the_ladder_and_leave_it_as_it_was():
    """``small_atoms`` adds capacities below ``min_atoms`` (sorted, duplicates merged); the rungs from min_atoms on
    are the plain ladder's, so a batch above the small rungs gets the bucket it got without them."""
    plain = BucketLadder()
    ladder = BucketLadder(small_atoms=(32, 8, 32))
    assert ladder.small_atoms == (8, 32)
    assert ladder.atom_capacities == (8, 32, *plain.atom_capacities)
    assert ladder.edge_capacities == plain.edge_capacities
    assert ladder.select(7, 50) == Bucket(8, 64)  # 7 real atoms + 1 padding atom
    assert ladder.select(8, 50) == Bucket(32, 64)
    assert ladder.select(12, 132) == Bucket(32, 160)  # benzene
    for n in (32, 63, 192, 5000):
        assert ladder.select(n, 1000) == plain.select(n, 1000)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(small_atoms=(64,)), "small_atoms"),
        (dict(small_atoms=(1,)), "small_atoms"),
        (dict(small_atoms=(16.5,)), "small_atoms"),
        (dict(growth=1.0), "growth"),
        (dict(fine_growth=0.9), "fine_growth"),
        (dict(align=0), "align"),
        (dict(min_atoms=1), "min_atoms"),
        (dict(min_edges=10, max_edges=5), "min_edges"),
    ],
)
def test_bad_ladder_is_a_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BucketLadder(**kwargs)


def test_bad_bucket_and_overfull_graph_are_value_errors():
    with pytest.raises(ValueError, match="atoms"):
        Bucket(1, 10)
    with pytest.raises(ValueError, match="negative"):
        BucketLadder().select(-1, 0)
    batch = AtomsBatch.from_atoms(molecule("C6H6"))
    nl = neighbor_list_batch(batch, 4.0)
    g = PaddedGraph.empty(Bucket(12, 1000), dtype=torch.float64, device="cpu", cutoff=4.0, pad_z=1)
    with pytest.raises(ValueError, match="does not fit"):  # 12 atoms need a 13th, padding slot
        fill_padded(g, batch.numbers, batch.positions, batch.batch, 1, nl.edge_index, nl.shift_vectors)


def _padded(batch, bucket, cutoff=4.0, sender_csr=True):
    nl = neighbor_list_batch(batch, cutoff)
    if not sender_csr:
        dt = batch.positions.dtype
        g = PaddedGraph.empty(bucket, dtype=dt, device="cpu", cutoff=cutoff, pad_z=1, sender_csr=False)
        return nl, fill_padded(
            g, batch.numbers, batch.positions, batch.batch, batch.num_structures, nl.edge_index, nl.shift_vectors
        )
    return nl, pad_graph(
        bucket,
        batch.numbers,
        batch.positions,
        batch.batch,
        batch.num_structures,
        nl.edge_index,
        nl.shift_vectors,
        cutoff=cutoff,
        pad_z=1,
    )


def test_padding_layout_is_inert_and_sorted():
    batch = AtomsBatch.from_atoms([molecule("H2O"), molecule("CH4")])
    nl, g = _padded(batch, Bucket(16, 200))
    n, e = batch.num_atoms, nl.num_edges
    assert g.numbers[n:].eq(1).all() and g.batch[n:].eq(15).all()
    assert g.seed.tolist() == [-1.0, -1.0] + [0.0] * 14
    pad_e = g.edge_index[:, e:]
    assert pad_e[0].eq(pad_e[1]).all() and (pad_e >= n).all()  # padding atoms to themselves only
    assert (torch.diff(g.edge_index[0]) >= 0).all()  # still sorted by receiver
    assert len(set(pad_e[0].tolist())) == 16 - n  # spread over every padding atom
    vec = g.positions[g.edge_index[1, e:]] - g.positions[g.edge_index[0, e:]] + g.shift_vectors[e:]
    assert (vec.norm(dim=1) > 4.0).all()  # beyond the cutoff: exactly zero messages


def test_reused_buffers_forget_previous_content():
    """Filling a big graph, then a small one, into the same buffers equals a fresh pad of the small one."""
    big = AtomsBatch.from_atoms([molecule("C6H6"), molecule("CH4")])
    small = AtomsBatch.from_atoms([molecule("H2O")])
    bucket = Bucket(24, 400)
    _, g = _padded(big, bucket)
    nl = neighbor_list_batch(small, 4.0)
    fill_padded(g, small.numbers, small.positions, small.batch, 1, nl.edge_index, nl.shift_vectors)
    _, fresh = _padded(small, bucket)
    for a, b in zip(g.inputs(), fresh.inputs(), strict=True):
        assert torch.equal(a[: len(b)], b) or torch.equal(a, b)
    assert torch.equal(g.edge_index, fresh.edge_index) and torch.equal(g.seed, fresh.seed)


def _structures():
    rng = np.random.default_rng(3)
    return [
        [molecule("C6H6")],
        [molecule("H2O"), silicon_cell(), molecule("CH4"), triclinic_cu()],
        [random_molecule(int(n), rng) for n in rng.integers(1, 12, size=9)],
    ]


@pytest.mark.parametrize("precision, rtol", [("fp64", 1e-12), ("fp32", 1e-6)])
@pytest.mark.parametrize("case", range(3))
def test_padded_equals_unpadded(precision, rtol, case):
    model = make_model()
    batch = AtomsBatch.from_atoms(_structures()[case])
    ref = ForceEngine(model, device="cpu", precision=precision).compute(batch)
    engine = ForceEngine(model, device="cpu", precision=precision, pad=True)
    out = engine.compute(batch)
    assert engine._graphs, "the padded path must have run"
    for key in ("energy", "atomic_energies", "forces"):
        scale = ref[key].abs().max().clamp_min(1e-3)
        assert ((out[key] - ref[key]).abs().max() / scale) <= rtol, key


def test_padding_content_does_not_leak():
    """Moving the padding atoms and changing their species leaves every real output bit-identical."""
    model = make_model()
    engine = ForceEngine(model, device="cpu", precision="fp32", pad=True)
    batch = AtomsBatch.from_atoms([molecule("C6H6"), molecule("H2O")])
    nl = neighbor_list_batch(batch, model.cutoff)
    bucket = engine.buckets.select(batch.num_atoms, nl.num_edges)
    g = engine._graph(bucket)
    fill_padded(g, batch.numbers, batch.positions.float(), batch.batch, 2, nl.edge_index, nl.shift_vectors.float())
    a = engine._step(*g.inputs()).clone()
    n = batch.num_atoms
    g.positions[n:] = torch.randn_like(g.positions[n:])
    g.numbers[n:] = 8
    b = engine._step(*g.inputs())
    ra, rb = unpack(a, bucket.atoms, n, 2), unpack(b, bucket.atoms, n, 2)
    for key in ("energy", "atomic_energies", "forces"):
        assert torch.equal(ra[key], rb[key]), key


@pytest.mark.parametrize("sender_csr", [True, False], ids=["sender-csr", "symmetric"])
@pytest.mark.parametrize("device", CSR_DEVICES)
def test_fill_padded_keeps_the_csr_in_step_with_the_edges(device, sender_csr):
    """row_ptr / sender_perm / sender_ptr follow every fill: an empty bucket, a graph, a smaller and a larger one
    in the same buffers, the same graph again with the same_topology shortcut, and a fresh pad. Without a sender
    CSR (the engine's symmetric walk) only row_ptr is kept, no sender is sorted, and the lists are symmetric."""
    bucket = Bucket(24, 400)
    g = PaddedGraph.empty(bucket, dtype=torch.float64, device=device, cutoff=4.0, pad_z=1, sender_csr=sender_csr)
    assert_bucket_csr(g)
    storage = [t.data_ptr() for t in (g.row_ptr, g.sender_perm, g.sender_ptr)]
    rng = np.random.default_rng(7)
    graphs = [[molecule("C6H6")], [molecule("H2O")], [random_molecule(9, rng), molecule("CH4")], [molecule("H2O")]]
    for k, structs in enumerate(graphs):
        batch = AtomsBatch.from_atoms(structs, dtype=torch.float64, device=device)
        nl = neighbor_list_batch(batch, 4.0)
        fill_padded(
            g, batch.numbers, batch.positions, batch.batch, batch.num_structures, nl.edge_index, nl.shift_vectors,
            same_topology=k == 3,
        )  # fmt: skip
        assert_bucket_csr(g)
        _, fresh = _padded(batch.to("cpu"), bucket, sender_csr=sender_csr)
        for a, b in zip(g.inputs(), fresh.inputs(), strict=True):
            assert torch.equal(a.cpu(), b)
    # in place: a captured graph keeps reading the same buffers
    assert storage == [t.data_ptr() for t in (g.row_ptr, g.sender_perm, g.sender_ptr)]


@pytest.mark.parametrize("sender_csr", [True, False], ids=["sender-csr", "symmetric"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", CSR_DEVICES)
def test_host_fill_equals_device_fill(device, dtype, sender_csr):
    """fill_padded_host (the whole content made on the host, sender CSR and padding included, sent in two
    transfers) leaves every buffer equal to fill_padded with zero shifts: graphs of several sizes one after the
    other in the same buffers (so stale padding would show), interleaved with device fills, a lone atom (no
    edges), a graph that fills the bucket's atoms, and the buffers stay in place."""
    from mlff_distiller.neighbors.molecular import molecular_pairs

    bucket = Bucket(24, 400)
    g = PaddedGraph.empty(bucket, dtype=dtype, device=device, cutoff=4.0, pad_z=1, sender_csr=sender_csr)
    ref = PaddedGraph.empty(bucket, dtype=dtype, device=device, cutoff=4.0, pad_z=1, sender_csr=sender_csr)
    storage = [t.data_ptr() for t in g.inputs()]
    rng = np.random.default_rng(11)
    graphs = [
        [molecule("C6H6")],
        [molecule("H2O")],
        [random_molecule(9, rng), molecule("CH4")],
        [random_molecule(1, rng)],
        [random_molecule(23, rng, spacing=1.6)],
        [molecule("H2O"), random_molecule(5, rng), molecule("CH4")],
    ]
    for k, structs in enumerate(graphs):
        batch = AtomsBatch.from_atoms(structs, dtype=dtype)
        nl = molecular_pairs(batch.positions, batch.ptr, 4.0)
        args = (batch.numbers, batch.positions, batch.batch, batch.num_structures)
        if k == 2:  # a device fill in between: the host fill must not rely on the mirrors' last content
            dev = [t.to(device) for t in (batch.numbers, batch.positions, batch.batch)]
            fill_padded(g, *dev, batch.num_structures, nl.edge_index.to(device), nl.shift_vectors.to(device))
        else:
            fill_padded_host(g, *(t.numpy() for t in args[:3]), args[3], nl.edge_index.numpy(), nl.row_ptr.numpy())
        dev = [t.to(device) for t in (batch.numbers, batch.positions, batch.batch)]
        fill_padded(ref, *dev, batch.num_structures, nl.edge_index.to(device), nl.shift_vectors.to(device))
        assert (g.n_atoms, g.n_edges, g.n_structures) == (ref.n_atoms, ref.n_edges, ref.n_structures)
        for name, a, b in zip(_INPUT_NAMES, g.inputs(), ref.inputs(), strict=True):
            assert torch.equal(a, b), f"graph {k}: {name} differs"
        assert_bucket_csr(g)
    assert storage == [t.data_ptr() for t in g.inputs()]
    # every field starts 128 bytes into its flat buffer's alignment, as a fresh allocation would (the kernels
    # specialise their loads on it)
    # (the seed, float64 for the energies, over bytes of the float buffer)
    base = {id(t): g._ints.data_ptr() if t.dtype == torch.long else g._floats.data_ptr() for t in g.inputs()}
    assert all((t.data_ptr() - base[id(t)]) % 128 == 0 for t in g.inputs())
    assert g.seed.dtype == torch.float64 and g.seed.shape == (g.bucket.atoms,)
    with pytest.raises(ValueError, match="does not fit"):
        big = AtomsBatch.from_atoms([random_molecule(24, rng)], dtype=dtype)
        nl = molecular_pairs(big.positions, big.ptr, 4.0)
        fill_padded_host(g, big.numbers.numpy(), big.positions.numpy(), big.batch.numpy(), 1, nl.edge_index.numpy(),
                         nl.row_ptr.numpy())  # fmt: skip


@pytest.mark.parametrize("sender_csr", [True, False], ids=["sender-csr", "symmetric"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", CSR_DEVICES)
def test_molecule_fill_equals_the_host_fill_of_no_edges(device, dtype, sender_csr):
    """fill_molecule_host (one molecule without its list, for the dense step) leaves every buffer equal to
    fill_padded_host given no edges: molecules of several atom counts and the same count twice in a row (whose
    edge-free form the mirrors keep), interleaved with fills of real lists in the same buffers (after which that
    form must be written again), a lone atom and a molecule that fills the bucket's atoms."""
    bucket = Bucket(24, 400)
    g = PaddedGraph.empty(bucket, dtype=dtype, device=device, cutoff=4.0, pad_z=1, sender_csr=sender_csr)
    ref = PaddedGraph.empty(bucket, dtype=dtype, device=device, cutoff=4.0, pad_z=1, sender_csr=sender_csr)
    storage = [t.data_ptr() for t in g.inputs()]
    rng = np.random.default_rng(12)
    mols = [molecule("C6H6"), molecule("C6H6"), molecule("H2O"), random_molecule(12, rng), random_molecule(1, rng)]
    mols += [random_molecule(23, rng, spacing=1.6), molecule("CH4"), molecule("CH4")]
    none = np.zeros((2, 0), dtype=np.int64)
    for k, mol in enumerate(mols):
        batch = AtomsBatch.from_atoms([mol], dtype=dtype)
        if k in (3, 7):  # a list in these buffers first: the edge-free form is gone from the mirrors
            other = AtomsBatch.from_atoms([molecule("CH4"), molecule("H2O")], dtype=dtype)
            nl = molecular_pairs(other.positions, other.ptr, 4.0)
            fill_padded_host(g, other.numbers.numpy(), other.positions.numpy(), other.batch.numpy(), 2,
                             nl.edge_index.numpy(), nl.row_ptr.numpy())  # fmt: skip
        fill_molecule_host(g, batch.numbers.numpy(), batch.positions.numpy())
        row_ptr = np.zeros(batch.num_atoms + 1, dtype=np.int64)
        fill_padded_host(ref, batch.numbers.numpy(), batch.positions.numpy(), batch.batch.numpy(), 1, none, row_ptr)
        assert (g.n_atoms, g.n_edges, g.n_structures, g.molecule) == (ref.n_atoms, 0, 1, True)
        for name, a, b in zip(_INPUT_NAMES, g.inputs(), ref.inputs(), strict=True):
            assert torch.equal(a, b), f"molecule {k}: {name} differs"
        assert_bucket_csr(g)
    assert storage == [t.data_ptr() for t in g.inputs()]
    with pytest.raises(ValueError, match="does not fit"):
        fill_molecule_host(g, np.ones(24, dtype=np.int64), np.zeros((24, 3)))
    with pytest.raises(ValueError, match="positions must be"):
        fill_molecule_host(g, np.ones(3, dtype=np.int64), np.zeros((4, 3)))


_INPUT_NAMES = ("numbers", "positions", "edge_index", "shift_vectors", "batch", "seed", "row_ptr", "sender_perm",
                "sender_ptr")  # fmt: skip


def _tiny_model():
    return make_model(hidden=8, layers=2, n_rbf=4)


def _edge_set(graph):
    n = graph.n_edges
    return {tuple(e) for e in graph.edge_index[:, :n].t().tolist()}


@pytest.mark.parametrize("walk", ["symmetric", "sorted"])
@pytest.mark.parametrize("device", CSR_DEVICES)
def test_padded_equals_unpadded_when_the_edges_change_within_a_bucket(device, walk):
    """Same atoms, a different edge list, the same bucket: the kernels (Triton; on the CPU its interpreter) walk
    the bucket's static CSR, which must be the new list's, else the forces are silently wrong. On CUDA the
    padded step is a CUDA-graph replay. ``walk``: the sender backward over the receiver rows of the full list
    (shipped) or over the sender-sorted permutation (the switch off)."""
    import importlib

    mp = importlib.import_module("mlff_distiller.kernels.message_passing")
    model = _tiny_model()
    mode = "cudagraph" if device == "cuda" else "eager"
    with mp._configured(sender_symmetric=walk == "symmetric"):
        engine = ForceEngine(model, device=device, precision="fp64", mode=mode, pad=True)
    assert engine._symmetric == (walk == "symmetric")
    ref = ForceEngine(model, device=device, precision="fp64")
    a = molecule("CH3CH2OH")
    b = a.copy()
    b.positions[:, 0] *= 1.2  # stretched: 66 pairs within the cutoff instead of 70, same atoms and bucket
    seen = []
    with use_backend("triton"):
        for atoms in [a, b, a]:
            batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
            got = engine.compute(batch, to_host=True)
            with use_backend("torch"):
                want = ref.compute(batch, to_host=True)
            np.testing.assert_allclose(got["forces"].numpy(), want["forces"].numpy(), rtol=0, atol=1e-10)
            np.testing.assert_allclose(got["energy"].numpy(), want["energy"].numpy(), rtol=0, atol=1e-10)
            graph = engine._graphs[engine.last_bucket]
            assert_bucket_csr(graph)
            seen.append((engine.last_bucket, _edge_set(graph)))
        assert seen[0][0] == seen[1][0] == seen[2][0], "the test needs one bucket for both edge lists"
        assert seen[0][1] != seen[1][1] and seen[0][1] == seen[2][1]
        # the comparison above is sensitive to the CSR: a stale one changes the forces (the walk's own CSR: the
        # sender permutation, or the receiver rows, which the symmetric walk also reads for the senders)
        graph = engine._graphs[engine.last_bucket]
        assert graph.sender_csr == (walk == "sorted")
        good = engine._step(*graph.inputs()).clone()
        if walk == "sorted":
            graph.sender_perm.copy_(graph.sender_perm.flip(0))
        else:
            graph.row_ptr[1:-1].copy_(graph.row_ptr[2:].clone())  # every row one atom later: the sums read other edges
        assert not torch.allclose(engine._step(*graph.inputs()), good, rtol=0, atol=1e-6)
        graph.refresh_csr()
        # Bit for bit on the CPU. On CUDA the float64 atomics of the position gradient add in any order: two runs
        # of the same step differ by ulps (measured at stop 49: up to 5e-18 eV/Å in 14 of 320 entries, with and
        # without edge_features' zero_in_forward), far below what a stale CSR does (> 1e-6 above).
        exact = 0.0 if device == "cpu" else 1e-12
        torch.testing.assert_close(engine._step(*graph.inputs()), good, rtol=0, atol=exact)


def test_padded_step_does_no_graph_bookkeeping():
    """The padded step (what a CUDA graph captures) reads the bucket's CSR: on the Triton kernels it sorts,
    searches and clones nothing, and never asks the kernels' own CSR builders."""
    import importlib

    mp = importlib.import_module("mlff_distiller.kernels.message_passing")
    engine = ForceEngine(_tiny_model(), device="cpu", precision="fp64", pad=True)
    batch = AtomsBatch.from_atoms(molecule("CH3CH2OH"), dtype=torch.float64)
    with use_backend("triton"):
        engine.compute(batch)
        graph = engine._graphs[engine.last_bucket]

        def forbidden(*args, **kwargs):
            raise AssertionError("the padded step built a CSR itself")

        saved = mp._receiver_csr, mp._sender_csr
        mp._receiver_csr = mp._sender_csr = forbidden
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                engine._step(*graph.inputs())
        finally:
            mp._receiver_csr, mp._sender_csr = saved
    ops = {e.name for e in prof.events()}
    assert not ops & {"aten::sort", "aten::argsort", "aten::searchsorted", "aten::clone"}, sorted(ops)


@pytest.mark.parametrize("pad", [False, True], ids=["eager", "padded"])
def test_the_engine_walks_its_full_lists_without_a_sender_sort(pad):
    """The engine promises its neighbour lists (full lists) to the message backward: on the Triton kernels
    (interpreter) neither the eager nor the padded path sorts the senders (no sender CSR built, none kept in the
    bucket), and energies, forces and stress equal those with the switch off (the sender-sorted walk) and the
    torch kernels'; molecules and periodic cells, one of them triclinic, in one batch."""
    import importlib

    mp = importlib.import_module("mlff_distiller.kernels.message_passing")
    model = _tiny_model()
    batch = AtomsBatch.from_atoms(
        [molecule("CH3CH2OH"), silicon_cell(rattle=0.05), triclinic_cu()], dtype=torch.float64
    )
    kw = dict(device="cpu", precision="fp64", pad=pad, analytic=False)
    sym = ForceEngine(model, **kw)
    with mp._configured(sender_symmetric=False):
        plain = ForceEngine(model, **kw)
    assert sym._symmetric and not plain._symmetric
    assert sym._symmetric_kw == {"symmetric_edges": True} and plain._symmetric_kw == {}
    calls = []
    real = mp._sender_csr
    try:
        mp._sender_csr = lambda *a: calls.append(a) or real(*a)
        with use_backend("triton"):
            got = sym.compute(batch, stress=True, to_host=True)
            assert not calls, "the symmetric walk built a sender CSR"
            want = plain.compute(batch, stress=True, to_host=True)
            assert calls or pad  # the sorted walk builds one (the padded bucket keeps its own)
    finally:
        mp._sender_csr = real
    with use_backend("torch"):
        ref = ForceEngine(model, **kw).compute(batch, stress=True, to_host=True)
    if pad:
        assert not sym._graphs[sym.last_bucket].sender_csr and plain._graphs[plain.last_bucket].sender_csr
        assert_bucket_csr(sym._graphs[sym.last_bucket])
    for key in ("energy", "forces", "stress"):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-11)
        torch.testing.assert_close(got[key], ref[key], rtol=0, atol=1e-10)


def test_a_model_whose_forward_takes_no_promise_runs_as_before():
    """A StudentModel subclass with its own forward (the pre-stop-54 signature) gets no ``symmetric_edges``: the
    eager engine still runs it, with the sender-sorted walk."""
    from mlff_distiller import StudentModel

    class Legacy(StudentModel):
        def forward(self, numbers, positions, edge_index, shift_vectors, batch, num_structures):
            return super().forward(numbers, positions, edge_index, shift_vectors, batch, num_structures)

    base = _tiny_model()
    legacy = Legacy(base.config)
    legacy.load_state_dict(base.state_dict())
    engine = ForceEngine(legacy, device="cpu", precision="fp64", analytic=False)
    assert engine._symmetric and engine._symmetric_kw == {}
    batch = AtomsBatch.from_atoms(molecule("CH3CH2OH"), dtype=torch.float64)
    with use_backend("triton"):
        got = engine.compute(batch, to_host=True)
        want = ForceEngine(base, device="cpu", precision="fp64", analytic=False).compute(batch, to_host=True)
    torch.testing.assert_close(got["forces"], want["forces"], rtol=0, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unpack_reads_the_float64_energies_from_the_packed_step_output(dtype):
    """The padded step's packed output (``engine_padded``: the energies' float64 bytes first, then atomic energies,
    forces, virials): ``unpack`` gives back energies that float32 cannot hold (-1103498.9730123 eV) exactly, and every
    other field at its place, from the tensor and from a NumPy copy of it (the calculator's host path)."""
    from mlff_distiller.engine_padded import _energy_words

    a, n, b = 8, 5, 3
    energy = torch.zeros(a, dtype=torch.float64)
    energy[:b] = torch.tensor([-1103498.9730123, -2.5e-7, 46.123456789012])
    atomic = torch.arange(a, dtype=dtype) + 0.5
    forces = torch.arange(3 * a, dtype=dtype) - 7.0
    virial = torch.arange(9 * a, dtype=dtype) * 0.25
    packed = torch.cat([_energy_words(energy, dtype), atomic, forces, virial])
    assert packed.dtype == dtype and packed.numel() == a * 8 // packed.element_size() + 13 * a
    got = unpack(packed, a, n, b, stress=True)
    assert got["energy"].dtype == torch.float64 and torch.equal(got["energy"], energy[:b])
    assert torch.equal(got["atomic_energies"], atomic[:n])
    assert torch.equal(got["forces"], forces.view(a, 3)[:n])
    assert torch.equal(got["virial"], virial.view(a, 3, 3)[:b])
    host = unpack(packed.numpy().copy(), a, n, b)
    assert host["energy"].dtype == np.float64 and np.array_equal(host["energy"], energy[:b].numpy())
    assert np.array_equal(host["forces"], forces.view(a, 3)[:n].numpy())
    assert np.array_equal(host["atomic_energies"], atomic[:n].numpy())
