"""The padded Verlet path of ForceEngine (MD through StudentCalculator): the unfiltered skin list sits in the
static buffers between rebuilds, the displacement test runs on host data, and results equal a fresh list."""

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.build import molecule
from helpers import assert_bucket_csr, make_model, silicon_cell, skin_and_fresh_engines
from mlff_distiller.kernels import use_backend

from mlff_distiller import ForceEngine
from mlff_distiller.ase_compat import maxwell_boltzmann
from mlff_distiller.batch import AtomsBatch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# CPU, and CUDA as a gpu-marked case (reported as skipped without a GPU): the padded step there is a CUDA-graph replay.
CSR_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("speculative", [None, True], ids=["default", "speculative"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("system", ["benzene", "silicon"])
def test_padded_verlet_md_matches_fresh_list(model, device, system, speculative):
    """MD with the Verlet-skin list in the padded path equals a fresh list every step. ``speculative``: every step
    after the first launches on the current list before the displacement test (the default on CUDA, forced here
    on the CPU too); a step whose test asks for a rebuild discards that result, so the forces still match."""
    atoms = molecule("C6H6") if system == "benzene" else silicon_cell(rattle=0.05)
    maxwell_boltzmann(atoms, 1200, rng=np.random.default_rng(5))
    fast, ref = skin_and_fresh_engines(model, device, skin=0.4)
    fast.speculative_verlet = speculative
    positions_seen = []

    class Calc:  # the smallest ASE-like driver: host positions in, forces out
        def step(self):
            batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
            got = fast.compute(batch, to_host=True)
            want = ref.compute(batch, to_host=True)
            np.testing.assert_allclose(got["forces"].numpy(), want["forces"].numpy(), rtol=0, atol=1e-10)
            assert float(got["energy"][0]) == pytest.approx(float(want["energy"][0]), abs=1e-10)
            positions_seen.append(atoms.positions.copy())
            return got["forces"].numpy()

    c = Calc()
    dt = 2.0 * units.fs
    forces = c.step()
    masses = atoms.get_masses()[:, None]
    for _ in range(40):  # velocity Verlet by hand: positions change every step, the list is reused
        atoms.set_momenta(atoms.get_momenta() + 0.5 * dt * forces)
        atoms.set_positions(atoms.positions + dt * atoms.get_momenta() / masses)
        forces = c.step()
        atoms.set_momenta(atoms.get_momenta() + 0.5 * dt * forces)
    v = fast.verlet
    assert v.n_calls == 41
    assert 1 <= v.n_builds < v.n_calls, v
    speculated = speculative or (speculative is None and device == "cuda")
    # every rebuild after the first fill threw a speculative step away; no other step did
    assert fast.n_discarded == (v.n_builds - 1 if speculated else 0)
    if speculated:
        assert v.n_builds >= 2, "the trajectory must rebuild at least once to test the discarded launch"
    # the static buffers hold the unfiltered skin list: more edges than the fresh list at the cutoff
    _bucket, graph, builds = fast._verlet_fill[:3]
    assert builds == v.n_builds and graph.n_edges == v.last.num_edges
    fresh = ref._neighbors(AtomsBatch.from_atoms(atoms, device=device, dtype=torch.float64))
    assert graph.n_edges >= fresh.num_edges
    # the displacement test ran on the host copies (no device tensors in the reference state)
    assert v._ref["positions"].device.type == "cpu"
    assert np.ptp(np.array(positions_seen), axis=0).max() > 0.2  # the atoms did move


@pytest.mark.parametrize("device", DEVICES)
def test_padded_verlet_md_keeps_a_complete_list(model, device):
    """Ethanol's list at 4 + 0.4 Å holds every pair: MD builds it once (where the displacement test rebuilt it), no
    speculative launch is thrown away, and every step's forces equal a fresh list's."""
    atoms = molecule("CH3CH2OH")
    maxwell_boltzmann(atoms, 1500, rng=np.random.default_rng(6))
    fast, ref = skin_and_fresh_engines(model, device, skin=0.4)
    fast.speculative_verlet = True
    plain = ForceEngine(model, device=device, precision="fp64", mode="eager", pad=True, neighbor_skin=0.4)
    plain.verlet.keep_complete = False
    dt = 2.0 * units.fs
    masses = atoms.get_masses()[:, None]
    forces = None
    start = atoms.positions.copy()
    for _ in range(41):
        if forces is not None:
            atoms.set_momenta(atoms.get_momenta() + 0.5 * dt * forces)
            atoms.set_positions(atoms.positions + dt * atoms.get_momenta() / masses)
        batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
        got, want = fast.compute(batch, to_host=True), ref.compute(batch, to_host=True)
        plain.compute(batch, to_host=True)
        np.testing.assert_allclose(got["forces"].numpy(), want["forces"].numpy(), rtol=0, atol=1e-10)
        assert float(got["energy"][0]) == pytest.approx(float(want["energy"][0]), abs=1e-10)
        forces = got["forces"].numpy()
        atoms.set_momenta(atoms.get_momenta() + 0.5 * dt * forces)
    assert fast.verlet.complete and fast.verlet.n_builds == 1 and fast.n_discarded == 0, fast.verlet
    assert fast._verlet_fill.graph.n_edges == 9 * 8
    assert plain.verlet.n_builds >= 3, "the trajectory crosses the half skin: the displacement test rebuilds"
    assert np.abs(atoms.positions - start).max() > 0.4


@pytest.mark.parametrize("speculative", [None, True], ids=["default", "speculative"])
@pytest.mark.parametrize("device", DEVICES)
def test_padded_verlet_rebuilds_on_new_structure_and_bucket_change(model, device, speculative):
    from helpers import random_molecule

    fast, ref = skin_and_fresh_engines(model, device, skin=0.5)
    fast.speculative_verlet = speculative
    other12 = random_molecule(12, np.random.default_rng(3))  # as many atoms as benzene: a speculative launch, discarded
    for atoms in [molecule("CH4"), molecule("C6H6"), other12, silicon_cell(), molecule("C6H6")]:
        batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
        got = fast.compute(batch, to_host=True)
        want = ref.compute(batch, to_host=True)
        np.testing.assert_allclose(got["forces"].numpy(), want["forces"].numpy(), rtol=0, atol=1e-10)
        np.testing.assert_allclose(got["energy"].numpy(), want["energy"].numpy(), rtol=0, atol=1e-10)
    assert fast.verlet.n_builds == 5  # every change of structure rebuilt
    if speculative or (speculative is None and device == "cuda"):
        assert fast.n_discarded == 1  # benzene -> the other 12-atom molecule
    # a stretched molecule grows past its edge bucket: rebuild into a larger bucket, still exact
    atoms = molecule("C6H6")
    first = fast.compute(AtomsBatch.from_atoms(atoms, dtype=torch.float64), to_host=True)
    small_bucket = fast._verlet_fill[0]
    big = atoms.copy()
    for k in (1, 2):  # a stack of three benzenes 3.5 Å apart: more atoms and many more edges
        layer = atoms.copy()
        layer.translate((0.0, 0.0, 3.5 * k))
        big += layer
    got = fast.compute(AtomsBatch.from_atoms(big, dtype=torch.float64), to_host=True)
    want = ref.compute(AtomsBatch.from_atoms(big, dtype=torch.float64), to_host=True)
    np.testing.assert_allclose(got["forces"].numpy(), want["forces"].numpy(), rtol=0, atol=1e-10)
    assert fast._verlet_fill[0] != small_bucket
    assert np.isfinite(first["forces"].numpy()).all()


def test_padded_verlet_and_plain_padded_path_share_buffers_safely(model):
    """predict() through a Verlet engine and a plain padded engine agree; switching systems never reuses a stale
    edge list from the static buffers."""
    fast, ref = skin_and_fresh_engines(model, "cpu", skin=1.0)
    a, b = molecule("CH3CH2OH"), molecule("CH3CH2OH")
    b.rattle(0.3, seed=4)
    for atoms in [a, b, a, b]:
        batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
        got = fast.compute(batch, to_host=True)["forces"].numpy()
        want = ref.compute(batch, to_host=True)["forces"].numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)


def test_calculator_check_state_shortcut_still_sees_every_change(model):
    from mlff_distiller import StudentCalculator

    atoms = molecule("H2O")
    calc = StudentCalculator(model, device="cpu", precision="fp64")
    atoms.calc = calc
    calls = []
    original = calc.calculate

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    calc.calculate = counting
    f0 = atoms.get_forces().copy()
    atoms.get_potential_energy()
    atoms.get_forces()
    assert len(calls) == 1, "identical atoms: no recalculation"
    atoms.positions[0, 0] += 1e-9
    f1 = atoms.get_forces()
    assert len(calls) == 2 and not np.array_equal(f0, f1)
    atoms.set_initial_charges([0.1, 0.0, 0.0])
    atoms.get_forces()
    assert len(calls) == 3, "a changed per-atom array is a change (ASE's rule)"
    atoms.set_cell([10.0, 10.0, 10.0])
    atoms.get_forces()
    assert len(calls) == 4
    atoms.get_forces()
    assert len(calls) == 4


def test_verlet_same_object_shortcut_still_sees_in_place_changes():
    from mlff_distiller.neighbors import VerletNeighborList

    b = AtomsBatch.from_atoms(silicon_cell(), dtype=torch.float64)
    vl = VerletNeighborList(3.0, skin=1.0, strain_reuse=False)  # any cell change rebuilds (strain: test_verlet_strain)
    vl.update_batch(b)
    vl.update_batch(b)
    assert vl.n_builds == 1
    b.cell[0, 0, 0] += 0.5  # same tensor object, modified in place: must rebuild
    vl.update_batch(b)
    assert vl.n_builds == 2
    b.numbers[0] = 6  # likewise for the species
    vl.update_batch(b)
    assert vl.n_builds == 3
    other = AtomsBatch.from_atoms(silicon_cell(), dtype=torch.float64)  # new objects, equal content but the cell
    vl.update_batch(other)
    assert vl.n_builds == 4


def test_calculator_reuses_its_batch_in_md_and_still_validates(model):
    from mlff_distiller import StudentCalculator

    atoms = molecule("CH3CH2OH")
    calc = StudentCalculator(model, device="cpu", precision="fp64")
    fresh = StudentCalculator(model, device="cpu", precision="fp64", skin=None)
    atoms.calc = calc
    atoms.get_forces()
    first = calc._last_batch
    for k in range(3):
        atoms.positions[k % len(atoms)] += 0.01
        f = atoms.get_forces()
        assert calc._last_batch.numbers is first.numbers  # reused: only the positions are new
        probe = atoms.copy()
        probe.calc = fresh
        np.testing.assert_allclose(f, probe.get_forces(), rtol=0, atol=1e-12)
    atoms.numbers[0] = 7  # a change beyond positions rebuilds the batch (and the neighbour list)
    f = atoms.get_forces()
    assert calc._last_batch.numbers is not first.numbers and int(calc._last_batch.numbers[0]) == 7
    probe = atoms.copy()
    probe.calc = fresh
    np.testing.assert_allclose(f, probe.get_forces(), rtol=0, atol=1e-12)
    atoms.positions[1, 2] = np.nan
    with pytest.raises(ValueError, match=r"finite|NaN|nan"):
        atoms.get_forces()


def test_verlet_md_beyond_the_largest_bucket_reuses_the_list_in_the_eager_fallback(model):
    """A system no bucket holds runs eagerly; the skin list built by the padded path's check is the one the
    eager path uses (no second, device-side rebuild per step), filtered to the cutoff, and results stay exact."""
    from mlff_distiller.buckets import BucketLadder

    ladder = BucketLadder(min_atoms=4, max_atoms=8, min_edges=16, max_edges=64, growth=2.0)
    fast = ForceEngine(model, device="cpu", precision="fp64", mode="eager", pad=True, neighbor_skin=0.5, buckets=ladder)
    ref = ForceEngine(model, device="cpu", precision="fp64", mode="eager")
    atoms = molecule("C6H6")
    rng = np.random.default_rng(2)
    for _ in range(12):
        atoms.positions += rng.normal(scale=0.01, size=atoms.positions.shape)
        batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
        got = fast.compute(batch, to_host=True)
        want = ref.compute(batch, to_host=True)
        np.testing.assert_allclose(got["forces"].numpy(), want["forces"].numpy(), rtol=0, atol=1e-10)
        assert fast.last_bucket is None and fast._verlet_fill is None
    assert fast.verlet.n_builds <= 3, fast.verlet  # ~0.03 Å per step against a 0.25 Å half-skin


def test_warmup_reports_the_bucket_each_structure_ran_in(model):
    eng = ForceEngine(model, device="cpu", precision="fp64", mode="eager", pad=True, neighbor_skin=0.5)
    times = eng.warmup(structures=[molecule("CH4"), molecule("C6H6")])
    assert len(times) >= 1 and all(t >= 0 for t in times.values())
    assert eng.last_bucket in times


def test_calculator_close_matches_ase_equal():
    """``_close`` (check_state's comparison, with the identical-bytes shortcut) gives ASE's ``equal(a, b, atol)``
    answer on the cases that matter: identical, below and above the tolerance, -0.0 vs 0.0, other dtypes with
    equal values, other shapes."""
    from ase.calculators.calculator import equal

    from mlff_distiller.calculator import _close

    a = np.random.default_rng(0).random((5, 3))
    cases = [
        (a, a.copy()),
        (a, a + 1e-17),
        (a, a + 1e-9),
        (np.zeros(3), -np.zeros(3)),
        (np.arange(3), np.arange(3.0)),
        (np.ones((2, 3)), np.ones((3, 2))),
        (np.array([True, False, True]), np.array([True, False, True])),
        (np.array([True, False, True]), np.array([True, True, True])),
        (a, a - 1e-9),
        (np.array([1.0, np.inf]), np.array([1.0, np.inf])),
        (np.array([1.0, np.inf]), np.array([1.0 + 1e-9, np.inf])),
        (np.array([1.0, np.inf]), np.array([1.0, -np.inf])),
        (np.array([1.0, np.inf]), np.array([1.0, 5.0])),
        (np.array([1.0, np.nan]), np.array([1.0, np.nan])),
        (np.array([2.0, np.nan]), np.array([1.0, np.nan])),
        (np.array([1e308, -1e308]), np.array([-1e308, 1e308])),
        (np.zeros((0, 3)), np.zeros((0, 3))),
        (np.float32([1.0, 2.0]), np.float32([1.0, 2.0 + 1e-6])),
    ]
    for x, y in cases:
        assert _close(x, y, 1e-15) == bool(equal(x, y, atol=1e-15)), (x, y)
    memo = {}  # check_state's NaN memo, shared by every case under one name: the same answers, twice over
    for _ in range(2):
        for x, y in cases:
            assert _close(x, y, 1e-15, memo, "k") == bool(equal(x, y, atol=1e-15)), (x, y)


def _approaching_h():
    """Ethanol jiggling in place and an H atom approaching it 0.15 Å per step (``walk()``): with a 0.5 Å skin, a
    rebuild every other step, and the H gains neighbours (72 -> 74 -> 76 edges of the 4.5 Å skin list at a
    4 Å cutoff, all in one 80-edge bucket)."""
    atoms = molecule("CH3CH2OH")
    atoms += Atoms("H", positions=[[atoms.positions[:, 0].max() + 4.8, 0.0, 0.0]])
    rng = np.random.default_rng(11)

    def walk():
        atoms.positions[-1, 0] -= 0.15
        atoms.positions[:-1] += rng.normal(0.0, 0.01, (len(atoms) - 1, 3))

    return atoms, walk


@pytest.mark.parametrize("device", CSR_DEVICES)
def test_padded_verlet_csr_follows_every_rebuild(device):
    """MD across several Verlet rebuilds whose edge lists differ but stay in one bucket, on the Triton kernels
    (the CPU runs its interpreter; on CUDA the padded step is a CUDA-graph replay): every step equals a fresh
    list, so the bucket's static CSR (receiver offsets, sender order) was rewritten with each new list."""
    model = make_model(hidden=8, layers=2, n_rbf=4)
    mode = "cudagraph" if device == "cuda" else "eager"
    fast = ForceEngine(model, device=device, precision="fp64", mode=mode, pad=True, neighbor_skin=0.5)
    ref = ForceEngine(model, device=device, precision="fp64")
    atoms, walk = _approaching_h()
    lists = []
    with use_backend("triton"):
        for _ in range(10):
            walk()
            batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
            got = fast.compute(batch, to_host=True)
            with use_backend("torch"):
                want = ref.compute(batch, to_host=True)
            np.testing.assert_allclose(got["forces"].numpy(), want["forces"].numpy(), rtol=0, atol=1e-9)
            np.testing.assert_allclose(got["energy"].numpy(), want["energy"].numpy(), rtol=0, atol=1e-9)
            bucket, graph, builds = fast._verlet_fill[:3]
            assert_bucket_csr(graph)
            if not lists or lists[-1][0] != builds:
                lists.append((builds, bucket, graph.n_edges))
    assert len(lists) >= 4 and fast.verlet.n_builds < fast.verlet.n_calls  # rebuilds, and reuse between them
    assert len({bucket for _, bucket, _ in lists}) == 1
    assert len({e for _, _, e in lists}) >= 3, lists  # the edge list changed within the bucket


@pytest.mark.gpu
def test_calculator_replays_follow_every_rebuild_on_cuda():
    """The default MD path (StudentCalculator, mode "auto": a CUDA-graph replay of the Verlet bucket) across
    rebuilds that change the edge list within the captured bucket equals a fresh list every step: the replay
    reads the static CSR that each rebuild rewrote."""
    from mlff_distiller import StudentCalculator

    model = make_model()
    calc = StudentCalculator(model, device="cuda", precision="fp64", skin=0.5)
    ref = StudentCalculator(model, device="cuda", precision="fp64", mode="eager", skin=None)
    eng = calc.engine
    assert eng.mode == "cudagraph"
    atoms, walk = _approaching_h()
    atoms.calc = calc
    edges = set()
    for _ in range(10):
        walk()
        forces, energy = atoms.get_forces(), atoms.get_potential_energy()
        check = atoms.copy()
        check.calc = ref
        np.testing.assert_allclose(forces, check.get_forces(), rtol=0, atol=1e-9)
        assert energy == pytest.approx(check.get_potential_energy(), abs=1e-9)
        edges.add(eng._verlet_fill[1].n_edges)
        assert_bucket_csr(eng._verlet_fill[1])
    assert len(eng.captured_buckets) == 1 and len(edges) >= 3
    assert 4 <= eng.verlet.n_builds < eng.verlet.n_calls


def test_compute_as_numpy_equals_the_host_tensors(model):
    """``compute(as_numpy=True)`` returns the ``to_host`` tensors' values as NumPy arrays (bit for bit) on the
    padded Verlet path, the plain padded path and the eager path (stress); the calculator's results are those."""
    from mlff_distiller import StudentCalculator

    atoms = silicon_cell(rattle=0.1)
    for precision in ("fp32", "fp64"):
        engines = [
            ForceEngine(model, device="cpu", precision=precision, mode="eager", pad=True, neighbor_skin=0.5),
            ForceEngine(model, device="cpu", precision=precision, mode="eager", pad=True),
            ForceEngine(model, device="cpu", precision=precision, mode="eager"),
        ]
        for eng in engines:
            for step in range(3):
                atoms.positions[step % len(atoms)] += 0.01
                batch = AtomsBatch.from_atoms(atoms, dtype=eng.dtype)
                for stress in (False, True):
                    want = eng.compute(batch, stress=stress, to_host=True)
                    got = eng.compute(batch, stress=stress, as_numpy=True)
                    assert got.keys() == want.keys()
                    for k, v in want.items():
                        assert isinstance(got[k], np.ndarray) and got[k].dtype == v.numpy().dtype, k
                        np.testing.assert_array_equal(got[k], v.numpy(), err_msg=k)
            assert eng.verlet is None or eng.verlet.n_calls > 0
        calc = StudentCalculator(model, device="cpu", precision=precision)
        atoms.calc = calc
        ref = calc.engine.compute(AtomsBatch.from_atoms(atoms, dtype=calc.engine.dtype), to_host=True)
        forces, energy = atoms.get_forces(), atoms.get_potential_energy()
        assert forces.dtype == np.float64 and energy == float(ref["energy"][0])
        np.testing.assert_array_equal(forces, ref["forces"].numpy().astype(np.float64))
        np.testing.assert_array_equal(atoms.get_potential_energies(), ref["atomic_energies"].numpy())
        stress = atoms.get_stress(voigt=True)
        want = calc.engine.compute(AtomsBatch.from_atoms(atoms, dtype=calc.engine.dtype), stress=True, to_host=True)
        np.testing.assert_array_equal(stress, want["stress"][0].double().numpy())


@pytest.mark.parametrize("device", CSR_DEVICES)
@pytest.mark.parametrize("min_edges", [0, 10**9])
def test_in_step_edge_compaction_equals_the_full_skin_list(device, min_edges, monkeypatch):
    """With a Verlet skin the padded step drops the pairs beyond the cutoff before the message passing
    (kernels.edge_compact): the kernels then see exactly the fresh list's pairs, and energies and forces equal
    those of the same step on the whole cutoff + skin list (compact_edges=False). Buckets with fewer than
    COMPACT_MIN_EDGES edge slots skip it."""
    from mlff_distiller import engine_padded

    monkeypatch.setattr(engine_padded, "COMPACT_MIN_EDGES", min_edges)
    model = make_model(hidden=8, layers=2, n_rbf=4)
    mode = "cudagraph" if device == "cuda" else "eager"
    kw = dict(device=device, precision="fp64", mode=mode, pad=True, neighbor_skin=1.0)
    on, off = ForceEngine(model, **kw), ForceEngine(model, compact_edges=False, **kw)
    ref = ForceEngine(model, device=device, precision="fp64")
    assert on.compact_edges and not off.compact_edges
    assert not ForceEngine(model, device=device, precision="fp64", mode=mode, pad=True).compact_edges
    atoms = silicon_cell(rattle=0.05)
    rng = np.random.default_rng(3)
    with use_backend("triton"):
        for _ in range(4):
            atoms.positions += rng.normal(0.0, 0.03, atoms.positions.shape)
            batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
            got, want = on.compute(batch, to_host=True), off.compute(batch, to_host=True)
            np.testing.assert_allclose(got["forces"].numpy(), want["forces"].numpy(), rtol=0, atol=1e-12)
            np.testing.assert_allclose(got["energy"].numpy(), want["energy"].numpy(), rtol=0, atol=1e-11)
            fresh = ref._neighbors(AtomsBatch.from_atoms(atoms, device=device, dtype=torch.float64))
            graph = on._verlet_fill[1]
            # the kernels' CSR ends at the pairs within the cutoff; the skin list in the buffers has many more
            live = fresh.num_edges if min_edges == 0 else graph.n_edges
            assert int(on._csr["row_ptr"][-1]) == live
            if not on._symmetric:  # the symmetric walk reads no sender CSR (the compaction's is meaningless then)
                assert int(on._csr["sender"][1][-1]) == live
            assert graph.n_edges > 1.3 * fresh.num_edges
    assert 1 <= on.verlet.n_builds < on.verlet.n_calls


@pytest.mark.gpu
@pytest.mark.parametrize("as_numpy", [True, False])
def test_host_results_are_not_overwritten_by_the_next_call_on_cuda(model, as_numpy):
    """The padded path copies its outputs through one page-locked buffer per bucket: the results handed out are
    the caller's own (a later call, which reuses the buffer, leaves them unchanged)."""
    eng = ForceEngine(model, device="cuda", precision="fp64", mode="cudagraph", neighbor_skin=0.5)
    atoms = molecule("C6H6")
    first = eng.compute(AtomsBatch.from_atoms(atoms, dtype=torch.float64), to_host=True, as_numpy=as_numpy)
    kept = {k: np.array(v, copy=True) for k, v in first.items()}
    atoms.positions += np.random.default_rng(0).normal(0.0, 0.05, atoms.positions.shape)  # not a translation
    second = eng.compute(AtomsBatch.from_atoms(atoms, dtype=torch.float64), to_host=True, as_numpy=as_numpy)
    assert not np.allclose(np.asarray(second["forces"]), kept["forces"])
    for k, v in first.items():
        np.testing.assert_array_equal(np.asarray(v), kept[k])


def test_md_bucket_is_kept_while_the_list_fits_and_chosen_with_headroom(model):
    """On the MD path a rebuilt list stays in the bucket it ran in while it fits (no flip-flop between two
    captured shapes), and a new bucket leaves VERLET_EDGE_HEADROOM spare edge slots; results stay exact."""
    from mlff_distiller import engine_verlet

    fast, ref = skin_and_fresh_engines(model, "cpu", skin=0.5)
    fast.verlet.keep_complete = False  # ethanol's list holds every pair: kept whatever the stretch otherwise
    atoms = molecule("CH3CH2OH")
    p0 = atoms.positions.copy()
    center = p0.mean(axis=0)
    buckets = []
    for scale in (1.0, 1.6, 1.0):  # stretched: far fewer pairs within the cutoff + skin
        atoms.positions = center + (p0 - center) * scale
        batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
        got, want = fast.compute(batch, to_host=True), ref.compute(batch, to_host=True)
        np.testing.assert_allclose(got["forces"].numpy(), want["forces"].numpy(), rtol=0, atol=1e-10)
        bucket, graph = fast._verlet_fill[:2]
        buckets.append((bucket, graph.n_edges))
    (b0, e0), (b1, e1), (b2, _) = buckets
    assert e1 < e0 and fast.buckets.select(len(atoms), e1) != b0, "the stretched list must fit a smaller bucket"
    assert b0 == b1 == b2  # kept
    assert b0 == fast.buckets.select(len(atoms), int(np.ceil(e0 * engine_verlet.VERLET_EDGE_HEADROOM)))


@pytest.mark.parametrize("speculative", [False, True])
def test_while_running_runs_once_after_the_launch(model, speculative):
    """``compute(..., while_running=f)`` calls f exactly once per call: on the padded Verlet path with the
    speculative launch right after the step is launched and before the displacement test (the calculator's copy
    of the atoms is made while the device computes), otherwise before the call returns; never when it raises."""
    atoms = molecule("C6H6")
    engine = ForceEngine(model, device="cpu", precision="fp64", mode="eager", pad=True, neighbor_skin=0.5)
    engine.speculative_verlet = speculative
    events = []
    for name in ("_run", "_verlet_list"):
        real = getattr(engine, name)

        def spy(*args, _real=real, _name=name, **kw):
            events.append(_name)
            return _real(*args, **kw)

        setattr(engine, name, spy)
    for step in range(3):
        atoms.positions[0, 0] += 0.01
        events.clear()
        engine.compute(
            AtomsBatch.from_atoms(atoms, dtype=torch.float64), to_host=True, while_running=lambda: events.append("f")
        )
        assert events.count("f") == 1, events
        if speculative and step > 0:  # launched on the kept list, then f, then the displacement test
            assert events[:3] == ["_run", "f", "_verlet_list"], events
        else:
            assert events[-1] == "f", events
    eager = ForceEngine(model, device="cpu", precision="fp64")
    events.clear()
    eager.compute(AtomsBatch.from_atoms(atoms, dtype=torch.float64), while_running=lambda: events.append("f"))
    assert events == ["f"]
    bad = AtomsBatch.from_atoms(molecule("H2O"), dtype=torch.float64)
    bad.numbers[0] = 92  # no uranium in the student's species
    with pytest.raises(ValueError):
        eager.compute(bad, while_running=lambda: events.append("raised"))
    assert "raised" not in events and eager._while_running is None


def test_verlet_fill_inputs_are_kept_while_the_same_tensors_come(model):
    """A Verlet fill's numbers and batch vector on the engine's device are copied once while the very same tensors
    come unmodified (a periodic box's MD rebuilds); an in-place change gets new copies (on the meta device: the
    caching alone, on a machine without a GPU)."""
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=True, neighbor_skin=0.5)
    engine.device = torch.device("meta")
    b = AtomsBatch.from_atoms(molecule("CH4"))
    first = engine._fill_inputs(b.numbers, b.batch)
    assert all(t.device.type == "meta" for t in first)
    second = engine._fill_inputs(b.numbers, b.batch)
    assert second[0] is first[0] and second[1] is first[1]
    b.numbers[0] = 1  # in place
    assert engine._fill_inputs(b.numbers, b.batch)[0] is not first[0]
    assert engine._fill_inputs(b.numbers.clone(), b.batch)[0] is not first[0]
