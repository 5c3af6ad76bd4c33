"""Where ForceEngine's molecular neighbour lists are built: on the host up to ``HOST_LIST_MAX_PAIRS`` candidate
pairs, on the device beyond (large molecular batches, a large molecule's Verlet rebuilds), and a molecule's rebuilt
bucket filled on the host: each equal to the other way. Split from ``test_engine_verlet.py``."""

import numpy as np
import pytest
import torch
from ase import units
from ase.build import molecule
from helpers import silicon_cell, skin_and_fresh_engines

from mlff_distiller import ForceEngine
from mlff_distiller.ase_compat import maxwell_boltzmann
from mlff_distiller.batch import AtomsBatch


@pytest.mark.gpu
def test_host_built_molecular_list_equals_device_list_on_cuda(model):
    """Molecules given on the host: the engine builds the list on the host and copies the edges; same results
    as the device-built list (the batch given on the device)."""
    from helpers import random_molecule

    rng = np.random.default_rng(8)
    mols = [random_molecule(int(n), rng) for n in rng.integers(2, 25, 50)]
    host = AtomsBatch.from_atoms(mols, dtype=torch.float64)
    for mode in ("eager", "cudagraph"):
        eng = ForceEngine(model, device="cuda", precision="fp64", mode=mode)
        assert eng._host_molecular_neighbors(host) is not None
        got = eng.compute(host, to_host=True)
        want = eng.compute(host.to("cuda"), to_host=True)
        np.testing.assert_allclose(got["forces"].numpy(), want["forces"].numpy(), rtol=0, atol=1e-10)
        np.testing.assert_allclose(got["energy"].numpy(), want["energy"].numpy(), rtol=0, atol=1e-10)


def _lists_by_receiver_then_sender(nl) -> np.ndarray:
    i, j = nl.edge_index.cpu().numpy()
    return np.stack([i, j])[:, np.lexsort((j, i))]


def test_molecules_beyond_the_host_lists_size_get_the_device_enumeration():
    """Molecules given on the host for a GPU engine: the host list up to ``HOST_LIST_MAX_PAIRS`` candidate pairs
    (Σ n_b²), the device enumeration from there (stop 74: 9.4-12.5 ms on the host against ~1 ms for 4,096 g2
    molecules). Decided on the CPU with a stand-in for the engine's attributes (a CUDA device object, no GPU); the
    device enumeration run on CPU tensors gives the host list's pairs."""
    from types import SimpleNamespace

    from helpers import random_molecule

    import mlff_distiller.engine_eager as eager
    from mlff_distiller.engine_eager import EagerPaths

    def stand_in(**kw):  # the engine's attributes, and the shared test both list paths ask
        engine = SimpleNamespace(**kw)
        engine._host_molecules_for_device = lambda b, **limits: EagerPaths._host_molecules_for_device(
            engine, b, **limits
        )
        return engine

    rng = np.random.default_rng(74)
    fake = stand_in(verlet=None, neighbor_method="auto", device=torch.device("cuda"), cutoff=4.0)
    small = AtomsBatch.from_atoms([random_molecule(int(n), rng) for n in rng.integers(2, 12, 20)])
    counts = np.diff(small.ptr.numpy())
    assert (counts * counts).sum() <= eager.HOST_LIST_MAX_PAIRS
    host = EagerPaths._host_molecular_neighbors(fake, small, to_device=False)
    assert host is not None and host.edge_index.device.type == "cpu"
    assert EagerPaths._device_molecular_neighbors(fake, small, small) is not None  # the padded path asks host first
    # one molecule of 182 atoms: 33,124 candidates, past the host list's limit
    big = AtomsBatch.from_atoms([random_molecule(182, rng)])
    assert 182 * 182 > eager.HOST_LIST_MAX_PAIRS
    assert EagerPaths._host_molecular_neighbors(fake, big, to_device=False) is None
    got = EagerPaths._device_molecular_neighbors(fake, big, big)
    want = eager.molecular_pairs(big.positions, big.ptr, 4.0)
    assert got is not None and got.num_edges == want.num_edges > 0
    np.testing.assert_array_equal(_lists_by_receiver_then_sender(got), _lists_by_receiver_then_sender(want))
    np.testing.assert_array_equal(got.row_ptr.numpy(), want.row_ptr.numpy())
    # periodic structures, a CPU engine, a Verlet list or another method: neither molecular path
    for other in (
        stand_in(verlet=None, neighbor_method="auto", device=torch.device("cpu"), cutoff=4.0),
        stand_in(verlet=object(), neighbor_method="auto", device=torch.device("cuda"), cutoff=4.0),
        stand_in(verlet=None, neighbor_method="brute", device=torch.device("cuda"), cutoff=4.0),
    ):
        assert EagerPaths._device_molecular_neighbors(other, big, big) is None
    periodic = AtomsBatch.from_atoms([silicon_cell()])
    assert EagerPaths._device_molecular_neighbors(fake, periodic, periodic) is None


def test_a_large_molecules_verlet_list_is_built_on_the_device():
    """MD of a molecule past ``HOST_LIST_MAX_PAIRS`` candidate pairs rebuilds its Verlet list on the engine's
    device (the host's all-pairs list grows as n²: 183 ms for 1,500 atoms on the development CPU); smaller ones and
    every batch of a CPU engine on the host (``device=None``). Decided with stand-ins for the engine and its list."""
    from types import SimpleNamespace

    from helpers import random_molecule

    from mlff_distiller.engine_eager import EagerPaths

    asked = []
    verlet = SimpleNamespace(rebuild=lambda *a, device=None: asked.append(device))
    rng = np.random.default_rng(3)
    small = AtomsBatch.from_atoms([random_molecule(100, rng)])
    big = AtomsBatch.from_atoms([random_molecule(182, rng)])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for device, batch in ((cuda, small), (cuda, big), (cpu, big)):
        EagerPaths._rebuild_verlet(SimpleNamespace(verlet=verlet, device=device), batch)
    assert asked == [None, cuda, cpu]


@pytest.mark.gpu
def test_md_of_a_large_molecule_with_its_list_on_the_device_equals_fresh_lists_on_cuda(model):
    """A 200-atom molecule's MD through the padded Verlet path (list built on the device since stop 74) gives a fresh
    list's forces every step, across rebuilds."""
    from helpers import random_molecule

    rng = np.random.default_rng(4)
    atoms = random_molecule(200, rng, species=(1, 6, 8))
    maxwell_boltzmann(atoms, 1500, rng=rng)
    fast, ref = skin_and_fresh_engines(model, "cuda", skin=0.3)
    dt, masses = 1.0 * units.fs, atoms.get_masses()[:, None]
    for _step in range(30):
        batch = AtomsBatch.from_atoms([atoms], dtype=torch.float64)
        got, want = fast.compute(batch, to_host=True), ref.compute(batch, to_host=True)
        np.testing.assert_allclose(got["forces"].numpy(), want["forces"].numpy(), rtol=0, atol=1e-10)
        np.testing.assert_allclose(got["energy"].numpy(), want["energy"].numpy(), rtol=0, atol=1e-9)
        atoms.set_momenta(atoms.get_momenta() + dt * got["forces"].numpy())
        atoms.set_positions(atoms.positions + dt * atoms.get_momenta() / masses)
    assert fast.verlet.last.edge_index.device.type == "cuda" and fast.verlet.n_builds >= 2


@pytest.mark.gpu
def test_large_molecular_batches_from_the_host_equal_the_device_batch_on_cuda(model, monkeypatch):
    """A molecular batch past ``HOST_LIST_MAX_PAIRS`` given on the host takes the device enumeration (spied) in the
    padded path; results equal the same batch given on the device, which takes ``neighbor_list``."""
    from helpers import random_molecule

    import mlff_distiller.engine_eager as eager

    used = []
    real = eager.molecular_pairs_device
    monkeypatch.setattr(eager, "molecular_pairs_device", lambda *a, **k: used.append(1) or real(*a, **k))
    rng = np.random.default_rng(9)
    mols = [random_molecule(int(n), rng) for n in rng.integers(20, 40, 60)]
    host = AtomsBatch.from_atoms(mols, dtype=torch.float64)
    counts = np.diff(host.ptr.numpy())
    assert (counts * counts).sum() > eager.HOST_LIST_MAX_PAIRS
    eng = ForceEngine(model, device="cuda", precision="fp64", mode="cudagraph")
    for _ in range(2):  # the eager first call, then the capture
        got = eng.compute(host, to_host=True)
    assert len(used) == 2 and eng.last_bucket is not None
    want = eng.compute(host.to("cuda"), to_host=True)
    for key in ("energy", "forces", "atomic_energies"):
        np.testing.assert_allclose(got[key].numpy(), want[key].numpy(), rtol=0, atol=1e-10, err_msg=key)


@pytest.mark.gpu
def test_host_filled_buckets_equal_the_device_path_on_cuda(model, monkeypatch):
    """Small molecular batches given on the host go into their bucket through fill_padded_host (one transfer per
    buffer); results equal the device fill's (batch given on the device), call after call in the same engine and
    buckets, alternating with device-side batches, single molecules and batches."""
    from helpers import random_molecule

    import mlff_distiller.engine_padded as engine_mod

    used = []
    real = engine_mod.fill_padded_host
    monkeypatch.setattr(engine_mod, "fill_padded_host", lambda *a, **k: used.append(1) or real(*a, **k))
    rng = np.random.default_rng(21)
    # dense_small=False: the model's step, which reads the list (one molecule would take the dense step without a
    # list since stop 74, fill_molecule_host; tests/test_engine_dense.py covers that)
    eng = ForceEngine(model, device="cuda", precision="fp64", mode="cudagraph", dense_small=False)
    calls = [[molecule("C6H6")], [molecule("H2O")], [random_molecule(int(n), rng) for n in rng.integers(2, 20, 30)]]
    calls += [[random_molecule(int(rng.integers(1, 12)), rng)] for _ in range(6)] + [[molecule("C6H6")]]
    for k, mols in enumerate(calls):
        host = AtomsBatch.from_atoms(mols, dtype=torch.float64)
        before = len(used)
        got = eng.compute(host, to_host=True)
        assert len(used) == before + 1, f"call {k}: the host fill was not used"
        want = eng.compute(host.to("cuda"), to_host=True)
        for key in ("energy", "forces", "atomic_energies"):
            np.testing.assert_allclose(got[key].numpy(), want[key].numpy(), rtol=0, atol=1e-10, err_msg=f"{k} {key}")
    # Results left on the device, calls back to back: each fill waits for the previous one's transfers out of the
    # page-locked mirrors (the event those calls record) before it rewrites them.
    batches = [AtomsBatch.from_atoms(m, dtype=torch.float64) for m in calls[3:8]]
    on_device = [eng.compute(b) for b in batches]
    for k, (b, out) in enumerate(zip(batches, on_device, strict=True)):
        want = eng.compute(b.to("cuda"), to_host=True)
        np.testing.assert_allclose(out["forces"].cpu().numpy(), want["forces"].numpy(), rtol=0, atol=1e-10, err_msg=k)


def test_a_molecules_rebuild_fills_its_bucket_on_the_host(model, monkeypatch):
    """A molecule's Verlet rebuild writes the bucket on the host (``fill_padded_host``, two transfers on a GPU): every
    static buffer equals the device fill's after each call of an MD-like walk with rebuilds, and so do the results;
    a periodic system keeps the device fill."""
    from mlff_distiller import engine_verlet

    used = []
    real = engine_verlet.fill_padded_host
    monkeypatch.setattr(engine_verlet, "fill_padded_host", lambda *a, **k: used.append(1) or real(*a, **k))
    host = ForceEngine(model, device="cpu", precision="fp64", pad=True, neighbor_skin=0.3)
    device = ForceEngine(model, device="cpu", precision="fp64", pad=True, neighbor_skin=0.3)
    atoms = molecule("C6H6")
    rng = np.random.default_rng(4)
    for step in range(12):
        atoms.positions = atoms.positions + rng.normal(0, 0.04, atoms.positions.shape)
        batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
        got = host.compute(batch, to_host=True)
        with monkeypatch.context() as m:
            m.setattr(engine_verlet, "HOST_FILL_MAX_EDGES", 0)  # the device fill
            n_used = len(used)
            want = device.compute(batch, to_host=True)
            assert len(used) == n_used
        for k in ("energy", "forces"):
            np.testing.assert_array_equal(got[k].numpy(), want[k].numpy(), err_msg=k)
        g, w = host._verlet_fill.graph, device._verlet_fill.graph
        for i, (a, b) in enumerate(zip(g.inputs(), w.inputs(), strict=True)):  # numbers, positions, ..., the CSR
            assert torch.equal(a, b), (step, i)
        assert torch.equal(host._verlet_fill.shifts, device._verlet_fill.shifts)
    assert host.verlet.n_builds >= 3 and len(used) == host.verlet.n_builds
    periodic = ForceEngine(model, device="cpu", precision="fp64", pad=True, neighbor_skin=0.3)
    used.clear()
    periodic.compute(AtomsBatch.from_atoms(silicon_cell(rattle=0.05), dtype=torch.float64), to_host=True)
    assert not used
