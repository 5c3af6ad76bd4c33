"""Spatial atom order (mlff_distiller.ordering) and the engine's sorted eager path.

The permutation must keep structures contiguous and in order, follow the Z-order curve, and make neighbours close
in memory; the engine with sorting must give the same energies, forces, atomic energies and stress, in the caller's
atom order, as without (float64, so only the order of sums differs).
"""

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import molecule
from helpers import make_model

from mlff_distiller import AtomsBatch, ForceEngine
from mlff_distiller.neighbors import neighbor_list
from mlff_distiller.ordering import _spread_bits, spatial_order


def shuffled_water(n_mol: int = 64, seed: int = 0) -> Atoms:
    """A periodic water box with its molecules in random order (as a structure generator might number them)."""
    rng = np.random.default_rng(seed)
    per = int(np.ceil(n_mol ** (1 / 3)))
    spacing = 3.1
    sites = np.stack(np.unravel_index(rng.permutation(per**3)[:n_mol], (per,) * 3), axis=1)
    h2o = molecule("H2O")
    pos = (h2o.positions[None] + (sites[:, None, :] + 0.5) * spacing).reshape(-1, 3)
    pos += rng.normal(scale=0.05, size=pos.shape)
    return Atoms(numbers=np.tile(h2o.numbers, n_mol), positions=pos, cell=[per * spacing] * 3, pbc=True)


def test_spread_bits():
    q = torch.tensor([0, 1, 2, 3, 0b1011, 1023], dtype=torch.int64)
    want = [0, 1, 8, 9, 1 + 8 + 0 + 512, int("".join("001" * 10), 2)]
    assert _spread_bits(q).tolist() == want


def test_z_order_of_a_grid():
    """Eight points on the corners of a 2x2x2 grid come out in Z order (x fastest, then y, then z)."""
    corners = torch.tensor([[x, y, z] for z in (0, 1) for y in (0, 1) for x in (0, 1)], dtype=torch.float64)
    shuffled = corners[torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])]
    perm = spatial_order(shuffled, torch.zeros(8, dtype=torch.int64), 1, bin_size=1.0)
    assert torch.equal(shuffled[perm], corners)


def test_structures_stay_contiguous_and_neighbours_come_closer():
    atoms = [shuffled_water(343, seed=1), molecule("C6H6"), shuffled_water(27, seed=2)]
    b = AtomsBatch.from_atoms(atoms)
    perm = spatial_order(b.positions, b.batch, b.num_structures, bin_size=2.5)
    assert torch.equal(torch.sort(perm).values, torch.arange(b.num_atoms))
    assert torch.equal(b.batch[perm], b.batch)  # every structure keeps its slots

    def spread(positions):
        """Median index distance of the 1,029-atom box's neighbour pairs."""
        nl = neighbor_list(positions, b.cell, b.pbc, b.batch, b.ptr, 5.0)
        first = nl.edge_index[0] < int(b.ptr[1])
        return (nl.edge_index[0] - nl.edge_index[1])[first].abs().double().median().item()

    assert spread(b.positions[perm]) < 0.4 * spread(b.positions)  # measured: 61 vs 292


@pytest.mark.parametrize("sizes", [[500], [7, 40, 1, 300]])
def test_spatial_order_equals_the_spread_bits_form(device, sizes):
    """The shipped order (the spread bits from a table, one structure's corner by a reduction, no structure bits
    for one structure) equals the straightforward form: each axis spread with ``_spread_bits``, every corner
    by a scatter-min, the structure index in the key's high bits; boxes far from the origin and each other."""
    gen = torch.Generator().manual_seed(sum(sizes))
    pos = torch.cat([torch.rand(n, 3, generator=gen) * 30 + 100 * i for i, n in enumerate(sizes)]).to(device)
    batch = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).to(device)
    b = len(sizes)
    p64 = pos.double()
    low = torch.full((b, 3), float("inf"), dtype=torch.float64, device=device)
    low = low.scatter_reduce(0, batch[:, None].expand(-1, 3), p64, reduce="amin", include_self=True)
    q = torch.floor((p64 - low[batch]) / 1.7).long().clamp_(0, 1023)
    code = _spread_bits(q[:, 0]) | (_spread_bits(q[:, 1]) << 1) | (_spread_bits(q[:, 2]) << 2)
    want = torch.argsort((batch << 30) | code, stable=True)
    got = spatial_order(pos, batch, b, 1.7)
    assert torch.equal(got, want)
    assert not torch.equal(got, torch.arange(len(got), device=device))


def test_bad_arguments():
    pos, batch = torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="bin_size"):
        spatial_order(pos, batch, 1, 0.0)
    with pytest.raises(ValueError, match="positions"):
        spatial_order(torch.zeros(4, 2), batch, 1, 1.0)
    assert spatial_order(torch.zeros(0, 3), torch.zeros(0, dtype=torch.int64), 1, 1.0).numel() == 0
    for bad in (0, -5, True):
        with pytest.raises(ValueError, match="spatial_sort_min_atoms"):
            ForceEngine(make_model(), device="cpu", spatial_sort_min_atoms=bad)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_engine_sorted_equals_unsorted(backend, device):
    """Energies, forces, atomic energies and stress with the atoms sorted (threshold 1) equal those without
    (threshold None), per atom in the caller's order; the sort did permute the atoms. (CPU "triton": the
    interpreter.)"""
    from mlff_distiller import kernels

    if backend == "triton" and device.type == "cpu":
        # The sort and unsort are the engine's, whatever the kernels: the torch backend checks them on the CPU;
        # the interpreter would add ~20 s of CI for nothing more (and a CUDA machine's run does not use it).
        pytest.skip("the Triton kernels on CPU tensors: covered by the torch backend here, by CUDA on the GPU")
    model = make_model(seed=3).double()
    atoms = [shuffled_water(27, seed=4), molecule("CH4"), shuffled_water(8, seed=5)]
    batch = AtomsBatch.from_atoms(atoms)
    out = []
    with kernels.use_backend(backend):
        for threshold in (None, 1):
            engine = ForceEngine(model, device=device, precision="fp64", spatial_sort_min_atoms=threshold)
            dev = batch.to(engine.device, engine.dtype)
            sorted_batch, inv = engine._spatial_order(dev)
            assert (inv is None) == (threshold is None)
            if inv is not None:
                assert not torch.equal(sorted_batch.positions, dev.positions)
            out.append(engine.compute(batch, stress=True, to_host=True))
    ref, got = out
    for key in ("energy", "atomic_energies", "forces", "stress"):
        torch.testing.assert_close(got[key], ref[key], rtol=1e-10, atol=1e-10, msg=key)
    assert ref["forces"].abs().max() > 1e-3


def test_default_threshold_leaves_small_batches_alone():
    engine = ForceEngine(make_model(), device="cpu")
    b = AtomsBatch.from_atoms(shuffled_water(8))
    assert engine._spatial_order(b)[1] is None
    assert engine.spatial_sort_min_atoms == 10_000


@pytest.mark.parametrize("mode", ["eager", "cudagraph"])
def test_verlet_md_sorted_equals_unsorted(device, mode):
    """An MD-like sequence through Verlet-skin engines (as StudentCalculator builds them): with the spatial order
    (made from the first frame and kept) the forces equal those without, step after step, and the list is reused
    between rebuilds. A padded engine whose buckets hold the list takes the padded path in the caller's order
    instead (stop 51)."""
    if mode == "cudagraph" and device.type == "cpu":
        pytest.skip("CUDA graphs need CUDA")
    model = make_model(seed=5).double()
    atoms = shuffled_water(27, seed=6)
    rng = np.random.default_rng(0)
    engines = [
        ForceEngine(model, device=device, precision="fp64", mode=mode, neighbor_skin=1.0, spatial_sort_min_atoms=t)
        for t in (None, 1)
    ]
    pos = atoms.positions.copy()
    for _ in range(8):
        pos += rng.normal(scale=0.06, size=pos.shape)
        atoms.positions = pos
        b = AtomsBatch.from_atoms(atoms)
        ref, got = (e.compute(b, to_host=True) for e in engines)
        torch.testing.assert_close(got["forces"], ref["forces"], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got["energy"], ref["energy"], rtol=1e-10, atol=1e-10)
    sorted_engine = engines[1]
    if mode == "eager":
        assert sorted_engine._verlet_perm is not None
    else:  # a list that fits the ladder: the padded (captured) path, in the caller's order (stop 51)
        assert sorted_engine._verlet_perm is None and sorted_engine._verlet_fill is not None
    assert 1 <= sorted_engine.verlet.n_builds < 8


@pytest.mark.parametrize("stress", [False, True])
def test_padded_md_of_a_large_system_captures_while_its_list_fits_the_ladder(stress):
    """MD of a system at or above spatial_sort_min_atoms through a padded Verlet engine (StudentCalculator's, mode
    auto on CUDA; "cudagraph" runs the padded step eagerly on a CPU): while its list fits the ladder it takes the
    padded path in the caller's order; when it stops fitting it goes on eagerly in Morton order, and back again
    when it fits, the list rebuilt at each change of order (never tested across two orders). Forces, energies
    (and with ``stress``, as NPT asks, the stress) equal an unsorted eager engine's at every step."""
    import warnings

    from mlff_distiller.buckets import BucketLadder

    model = make_model(seed=5).double()
    atoms = shuffled_water(27, seed=6)
    ref = ForceEngine(model, device="cpu", precision="fp64", neighbor_skin=1.0, spatial_sort_min_atoms=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cudagraph on a CPU: the padded step, eagerly
        engine = ForceEngine(
            model, device="cpu", precision="fp64", mode="cudagraph", neighbor_skin=1.0, spatial_sort_min_atoms=1
        )
    roomy, tight = engine.buckets, BucketLadder(min_atoms=8, max_atoms=128, min_edges=16, max_edges=256)
    rng = np.random.default_rng(1)
    pos = atoms.positions.copy()
    seen = []
    # padded, padded, then the list no longer fits (eager, sorted) for three steps, then padded again
    for step, ladder in enumerate([roomy, roomy, tight, tight, tight, roomy, roomy]):
        engine.buckets = ladder
        pos += rng.normal(scale=0.02, size=pos.shape)
        atoms.positions = pos
        b = AtomsBatch.from_atoms(atoms)
        builds = engine.verlet.n_builds
        got, want = engine.compute(b, stress=stress, to_host=True), ref.compute(b, stress=stress, to_host=True)
        for key in ("forces", "energy") + (("stress",) if stress else ()):
            torch.testing.assert_close(got[key], want[key], rtol=1e-10, atol=1e-10, msg=f"{key}, step {step}")
        if stress:
            assert bool(got["stress_valid"][0]) and float(got["stress"].abs().max()) > 1e-4
        seen.append((engine._verlet_sorted, engine.verlet.n_builds - builds))
    assert [s for s, _ in seen] == [False, False, True, True, True, False, False], seen
    # a build at the start and at each change of order (the first sorted step: the padded path's try in the
    # caller's order, then the sorted list), none between (atoms move 0.02 Å a step: within the 0.5 Å half-skin)
    assert [n for _, n in seen] == [1, 0, 1, 0, 0, 1, 0], seen


def test_verlet_order_follows_a_new_partition_with_the_same_numbers():
    """Two batches with the same atomic numbers in the same order but structures split differently (waters of 27 +
    8 molecules, then 8 + 27): the Verlet path's kept permutation must not be reused across them (it would mix
    structures); forces equal the unsorted engine's for both, and the second call makes a new permutation."""
    model = make_model(seed=7).double()
    first = [shuffled_water(27, seed=8), shuffled_water(8, seed=9)]
    second = [shuffled_water(8, seed=10), shuffled_water(27, seed=11)]
    engines = [
        ForceEngine(model, device="cpu", precision="fp64", neighbor_skin=1.0, spatial_sort_min_atoms=t)
        for t in (None, 1)
    ]
    perms = []
    for atoms in (first, second):
        b = AtomsBatch.from_atoms(atoms)
        ref, got = (e.compute(b, to_host=True) for e in engines)
        torch.testing.assert_close(got["forces"], ref["forces"], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got["energy"], ref["energy"], rtol=1e-10, atol=1e-10)
        perms.append(engines[1]._verlet_perm["perm"])
    assert not torch.equal(perms[0], perms[1])


def test_verlet_order_hands_over_the_same_sorted_tensors_each_step():
    """Between frames of one system only the positions are gathered: the sorted numbers and structure indices are
    the very same tensors (the Verlet list's same-object shortcut), and the positions follow the kept order."""
    engine = ForceEngine(make_model(), device="cpu", neighbor_skin=1.0, spatial_sort_min_atoms=1)
    atoms = shuffled_water(27, seed=12)
    b1 = AtomsBatch.from_atoms(atoms)
    atoms.positions += 0.01
    b2 = AtomsBatch.from_atoms(atoms)
    (s1, inv1), (s2, inv2) = engine._verlet_order(b1), engine._verlet_order(b2)
    assert s1.numbers is s2.numbers and s1.batch is s2.batch and inv1 is inv2
    torch.testing.assert_close(s2.positions[inv2], b2.positions, rtol=0, atol=0)
