"""The engine's dense step (``ForceEngine(dense_small=...)``, ``PaddedPaths._dense_of``): one small non-periodic
molecule in a padded bucket computed by :mod:`mlff_distiller.kernels.dense_step` instead of the model's forward and
``autograd.grad``.

On the CPU the dense step runs on the Triton interpreter (forced with ``dense_small=True``; its default is CUDA
only) and the captures are the stand-in ``FakeRunner``; the oracle is the eager engine (the model's own forward and
autograd) in float64. On CUDA (``test_*_on_cuda``) the shipped 64 x 3 student takes it by default.
"""

import numpy as np
import pytest
import torch
from ase.build import bulk, molecule
from helpers import make_model

from mlff_distiller import AtomsBatch, ForceEngine, kernels
from mlff_distiller.ase_compat import maxwell_boltzmann


@pytest.fixture
def cpu_triton():
    """The Triton kernels on the CPU (the interpreter; skipped on a host that runs them on CUDA only, where the
    session does not set TRITON_INTERPRET): the dense step is one of them."""
    if not kernels.triton_available("cpu"):
        pytest.skip("Triton kernels cannot run on the CPU here (it needs TRITON_INTERPRET=1)")
    with kernels.use_backend("triton"):
        yield


WALL = [[1, 6, 1.2], [6, 6, 1.5], [1, 1, 0.9], [6, 8, 1.3]]


@pytest.fixture(scope="module")
def model3():
    """A 3-layer student of the shipped architecture (what the dense step computes), with a ZBL wall."""
    return make_model(seed=2, layers=3, hidden=32, n_rbf=8, cutoff=4.0, repulsion=WALL).eval()


def _counting(engine):
    """Count the dense step's launches of ``engine`` (its ``from_numbers`` wrapped)."""
    calls = []
    inner = engine._dense.from_numbers

    def counted(*args, **kw):
        calls.append(args)
        return inner(*args, **kw)

    engine._dense.from_numbers = counted
    return calls


def _close(got, want, atol=1e-10):
    for key in ("energy", "forces", "atomic_energies"):
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=0, atol=atol, err_msg=key)


def _batch(mols):
    return AtomsBatch.from_atoms(mols, dtype=torch.float64)


def test_one_small_molecule_takes_the_dense_step_and_nothing_else_does(model3, cpu_triton, monkeypatch):
    """Benzene, water, a 16-atom cluster (16 slots), a 17-atom one (32 slots) and a 33-atom one (64 slots), one at
    a time, take the dense step, equal to the model's autograd, with no neighbour list made (since stop 74 the
    bucket gets the atoms alone, ``fill_molecule_host``); two molecules in one batch, a periodic cell and a
    65-atom molecule take the model's step on their list."""
    from mlff_distiller import engine_padded

    ref = ForceEngine(model3, device="cpu", precision="fp64", mode="eager")
    engine = ForceEngine(model3, device="cpu", pad=True, precision="fp64", dense_small=True)
    calls = _counting(engine)
    fills, lists = [], []
    real_fill, real_list = engine_padded.fill_molecule_host, engine._neighbors
    monkeypatch.setattr(engine_padded, "fill_molecule_host", lambda *a, **k: fills.append(1) or real_fill(*a, **k))
    engine._neighbors = lambda *a: lists.append(1) or real_list(*a)
    rng = np.random.default_rng(0)
    cluster = molecule("CH4")
    cluster = cluster + molecule("H2O") + molecule("CH4")  # (a 13-atom template, moved apart below)
    cluster.set_positions(rng.normal(size=(len(cluster), 3)) * 1.6)
    cluster16 = cluster + molecule("CH3")[:3]
    cluster16.set_positions(rng.normal(size=(16, 3)) * 1.7)
    cluster17 = cluster16 + molecule("H2O")[:1]
    cluster17.positions[-1] = [3.0, 0.0, 0.0]
    cluster33 = cluster16 + cluster17
    cluster33.set_positions(rng.normal(size=(33, 3)) * 2.2)
    for k, mol in enumerate([molecule("C6H6"), molecule("H2O"), cluster16, cluster17, cluster33]):
        _close(engine.compute(_batch([mol]), to_host=True), ref.compute(_batch([mol]), to_host=True))
        assert len(calls) == k + 1, mol
    assert [c[3] for c in calls] == [16, 16, 16, 32, 64]  # the slots each took
    assert len(fills) == 5 and not lists
    big = cluster33 + cluster16 + cluster16
    big.set_positions(rng.normal(size=(65, 3)) * 2.8)
    cell = bulk("Si", "diamond", a=5.43, cubic=True)
    for batch in ([molecule("C6H6"), molecule("H2O")], [cell], [big]):
        _close(engine.compute(_batch(batch), to_host=True), ref.compute(_batch(batch), to_host=True))
    assert len(calls) == 5 and len(fills) == 5 and len(lists) == 3


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_float32_engine_takes_it_within_float32s_tolerance(model3, cpu_triton, precision):
    """precision fp32: the dense step in float32 (energy summed in float64) against the float64 eager engine;
    bf16 (the Triton GEMMs' 16-bit roundings, the weights kept float32) takes the same float32 step, so float32's
    tolerance, not bf16's."""
    ref = ForceEngine(model3, device="cpu", precision="fp64", mode="eager")
    engine = ForceEngine(model3, device="cpu", pad=True, precision=precision, dense_small=True)
    assert engine.precision == precision and engine.kernel_matmul_dtype == (
        torch.bfloat16 if precision == "bf16" else None
    )
    calls = _counting(engine)
    mol = [molecule("C6H6")]
    got = engine.compute(AtomsBatch.from_atoms(mol), to_host=True)
    want = ref.compute(_batch(mol), to_host=True)
    assert calls and got["forces"].dtype == torch.float32 and got["energy"].dtype == torch.float64
    np.testing.assert_allclose(got["forces"].double().numpy(), want["forces"].numpy(), rtol=0, atol=1e-4)
    assert abs(float(got["energy"][0]) - float(want["energy"][0])) < 1e-4


def test_a_captured_dense_step_has_its_own_runner(model3, cpu_triton, fake_graphs):
    """In mode cudagraph the dense step is captured in runners of its own (a bucket may hold one molecule now and
    two later, whose step is the model's), released by release_captures with the others; the replays equal the
    eager engine."""
    ref = ForceEngine(model3, device="cpu", precision="fp64", mode="eager")
    engine = ForceEngine(model3, device="cpu", pad=True, precision="fp64", dense_small=True)
    engine.mode = "cudagraph"
    one, two = [molecule("C6H6")], [molecule("H2O"), molecule("CH4")]
    buckets = {}
    for name, mols in (("one", one), ("two", two), ("one", one)):
        _close(engine.compute(_batch(mols), to_host=True), ref.compute(_batch(mols), to_host=True))
        buckets[name] = engine.last_bucket
    assert list(engine._dense_runners[16]) == [buckets["one"]] and list(engine._runners) == [buckets["two"]]
    assert len(fake_graphs) == 2 and engine.captured_buckets == sorted(buckets.values())
    biphenyl = [molecule("biphenyl")]  # 22 atoms: the step of 32 slots, its own runners
    for _ in range(2):
        _close(engine.compute(_batch(biphenyl), to_host=True), ref.compute(_batch(biphenyl), to_host=True))
    assert list(engine._dense_runners[32]) == [engine.last_bucket] and len(fake_graphs) == 3
    assert engine.release_captures() == 3 and not any(engine._dense_runners.values()) and not engine._runners


def test_warmup_captures_the_dense_step_of_its_buckets(model3, cpu_triton, fake_graphs):
    """warmup(buckets=...) captures, beside each bucket's step, the dense step of each slot count the bucket holds
    (16, 32, 64: each compiles kernels of its own), so that a molecule's first call there captures nothing, benzene's
    (16 slots) and biphenyl's (32) alike; warming again captures nothing more; a bucket below 16 atom slots gets
    none, and neither does an engine whose kernels are torch's (where the dense step never runs)."""
    from mlff_distiller.engine_padded import DENSE_SLOTS

    ref = ForceEngine(model3, device="cpu", precision="fp64", mode="eager")
    engine = ForceEngine(model3, device="cpu", pad=True, precision="fp64", dense_small=True)
    engine.mode = "cudagraph"
    mols = [[molecule("C6H6")], [molecule("biphenyl")]]
    probe = ForceEngine(model3, device="cpu", pad=True, precision="fp64", dense_small=False)
    buckets = []
    for mol in mols:  # the buckets they land in
        probe.compute(_batch(mol))
        buckets.append(probe.last_bucket)
    assert buckets[1].atoms >= 32  # (biphenyl's 22 atoms take 32 slots)
    engine.warmup(buckets=buckets)
    for bucket in set(buckets):
        held = [np_ for np_ in DENSE_SLOTS if np_ <= bucket.atoms]
        assert [np_ for np_ in DENSE_SLOTS if bucket in engine._dense_runners[np_]] == held, bucket
    assert set(engine._runners) == set(buckets)
    made = len(fake_graphs)
    calls = _counting(engine)
    for mol, bucket in zip(mols, buckets, strict=True):
        _close(engine.compute(_batch(mol), to_host=True), ref.compute(_batch(mol), to_host=True))
        assert engine.last_bucket == bucket
    assert [c[3] for c in calls] == [16, 32] and len(fake_graphs) == made  # replayed, not captured
    engine.warmup(buckets=buckets)
    assert len(fake_graphs) == made
    small = engine.buckets.select(2, 2)
    if small.atoms < 16:
        engine.warmup(buckets=[small])
        assert not any(small in runners for runners in engine._dense_runners.values())
    other = ForceEngine(model3, device="cpu", pad=True, precision="fp64", dense_small=True)
    other.mode = "cudagraph"
    with kernels.use_backend("torch"):
        other.warmup(buckets=buckets[:1])
    assert not any(other._dense_runners.values()) and list(other._runners) == buckets[:1]


def test_md_through_the_zero_copy_dense_step(model3, cpu_triton, fake_graphs):
    """Velocity Verlet through the engine's zero-copy MD step: the captured step is the dense one, captured once,
    each step equal to the eager engine; switched off mid-run, the atom count's runner is captured again as the
    model's step."""
    from ase import units

    atoms = molecule("CH3CH2OH")
    engine = ForceEngine(model3, device="cpu", pad=True, precision="fp64", neighbor_skin=0.3, dense_small=True)
    engine.mode, engine.zero_copy = "cudagraph", True
    ref = ForceEngine(model3, device="cpu", precision="fp64", mode="eager")
    calls = _counting(engine)
    maxwell_boltzmann(atoms, 1500, rng=np.random.default_rng(1))
    dt, masses = 2.0 * units.fs, atoms.get_masses()[:, None]

    def steps(k):
        for _step in range(k):
            batch = _batch([atoms])
            got, want = engine.compute(batch, as_numpy=True), ref.compute(batch, to_host=True)
            _close(got, {k: v.numpy() for k, v in want.items()})
            atoms.set_momenta(atoms.get_momenta() + dt * got["forces"])
            atoms.set_positions(atoms.positions + dt * atoms.get_momenta() / masses)

    steps(6)
    (md,) = engine._md_runners.values()
    assert md.dense and len(fake_graphs) == 1 and not engine._runners
    assert len(calls) >= 6
    engine.dense_small, seen = False, len(calls)
    steps(2)
    (md,) = engine._md_runners.values()
    assert not md.dense and len(fake_graphs) == 2 and len(calls) == seen


def test_md_of_a_molecule_in_32_slots(model3, cpu_triton, fake_graphs):
    """A 21-atom molecule's MD through the zero-copy step takes the dense step of 32 slots, each step equal to the
    eager engine."""
    rng = np.random.default_rng(3)
    atoms = molecule("CH3CH2OH") + molecule("CH3CH2OH") + molecule("H2O")
    atoms.set_positions(rng.normal(size=(len(atoms), 3)) * 1.9)
    assert len(atoms) == 21
    engine = ForceEngine(model3, device="cpu", pad=True, precision="fp64", neighbor_skin=0.3, dense_small=True)
    engine.mode, engine.zero_copy = "cudagraph", True
    ref = ForceEngine(model3, device="cpu", precision="fp64", mode="eager")
    calls = _counting(engine)
    for _step in range(3):
        batch = _batch([atoms])
        got, want = engine.compute(batch, as_numpy=True), ref.compute(batch, to_host=True)
        _close(got, {k: v.numpy() for k, v in want.items()})
        atoms.positions += 0.01 * got["forces"]
    (md,) = engine._md_runners.values()
    assert md.dense and len(fake_graphs) == 1 and calls and all(c[3] == 32 for c in calls)


def test_the_first_launch_zeros_the_engines_output_without_a_fill(model3, cpu_triton, monkeypatch):
    """``DENSE_ZERO_IN_KERNEL`` (prepared at stop 71, off until timed): the engine's packed output comes from
    ``torch.empty`` (here poisoned with NaN) and the dense step's first launch zeros what no launch writes. Benzene
    (16 slots) and a 17-atom molecule (32): no NaN left in the packed output, results equal to the eager engine."""
    from mlff_distiller import engine_padded

    monkeypatch.setattr(engine_padded, "DENSE_ZERO_IN_KERNEL", True)
    ref = ForceEngine(model3, device="cpu", precision="fp64", mode="eager")
    engine = ForceEngine(model3, device="cpu", pad=True, precision="fp64", dense_small=True)
    inner, packed = engine._dense.from_numbers, []

    def checked(*args):
        inner(*args)
        flat, ranges = args[5]
        packed.append((flat.isnan().any().item(), [flat[lo:hi].abs().max().item() for lo, hi in ranges if hi > lo]))

    engine._dense.from_numbers = checked
    empty = torch.empty

    def poisoned(*args, **kw):
        out = empty(*args, **kw)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    rng = np.random.default_rng(5)
    mol17 = molecule("CH4") + molecule("H2O") + molecule("CH4") + molecule("H2O")[:1]
    mol17.set_positions(rng.normal(size=(14, 3)) * 1.6)
    mol17 = mol17 + molecule("H2O")
    mol17.positions[-3:] += [3.0, 0.0, 0.0]
    assert len(mol17) == 17
    for mol in (molecule("C6H6"), mol17):
        want = ref.compute(_batch([mol]), to_host=True)
        monkeypatch.setattr(torch, "empty", poisoned)
        got = engine.compute(_batch([mol]), to_host=True)
        monkeypatch.setattr(torch, "empty", empty)
        _close(got, want)
    assert [(nan, any(m != 0 for m in maxima)) for nan, maxima in packed] == [(False, False)] * 2
    assert all(maxima for _, maxima in packed)  # (each call had slots to zero: the other structures' energies)


def test_when_the_engine_makes_no_dense_step(model3, cpu_triton):
    assert ForceEngine(model3, device="cpu", pad=True, precision="fp64")._dense is None  # default: CUDA only
    assert ForceEngine(model3, device="cpu", pad=True, precision="fp64", dense_small=False)._dense is None
    odd_width = make_model(layers=3, hidden=48)
    assert ForceEngine(odd_width, device="cpu", pad=True, precision="fp64", dense_small=True)._dense is None
    with kernels.use_backend("torch"):  # bf16 on the torch kernels: the MLP layers a 16-bit copy
        assert ForceEngine(model3, device="cpu", pad=True, precision="bf16", dense_small=True)._dense is None
    hooked = make_model(seed=2, layers=3, hidden=32, n_rbf=8, cutoff=4.0)
    hooked.readout.register_forward_hook(lambda *a: None)
    assert ForceEngine(hooked, device="cpu", pad=True, precision="fp64", dense_small=True)._dense is None
    engine = ForceEngine(model3, device="cpu", pad=True, precision="fp64", dense_small=True)
    assert engine._dense is not None
    engine.dense_small = False  # switched off later: no step takes it
    calls = _counting(engine)
    engine.compute(_batch([molecule("H2O")]), to_host=True)
    with kernels.use_backend("torch"):  # nor where the torch kernels are selected
        engine.dense_small = True
        engine.compute(_batch([molecule("H2O")]), to_host=True)
    assert not calls


def test_a_dense_step_that_cannot_be_prepared_leaves_the_engine_working(model3, cpu_triton, monkeypatch):
    """Preparing the dense step fails (here: a stand-in that raises): the engine warns, runs the model's step and
    gives the eager engine's results."""
    from mlff_distiller.kernels import dense_step

    def refuse(*args, **kw):
        raise RuntimeError("no room")

    monkeypatch.setattr(dense_step, "DenseStep", refuse)
    with pytest.warns(RuntimeWarning, match="dense step for small molecules could not be prepared.*no room"):
        engine = ForceEngine(model3, device="cpu", pad=True, precision="fp64", dense_small=True)
    assert engine._dense is None
    ref = ForceEngine(model3, device="cpu", precision="fp64", mode="eager")
    _close(
        engine.compute(_batch([molecule("H2O")]), to_host=True), ref.compute(_batch([molecule("H2O")]), to_host=True)
    )


@pytest.mark.parametrize("captured", [False, True])
def test_a_dense_step_that_fails_at_its_first_launch_leaves_the_engine_working(
    model3, cpu_triton, fake_graphs, captured
):
    """The dense step's first launch fails (here: a stand-in for a Triton that cannot compile its kernels, as Triton
    3.6 could not compile the float64 step before stop 70): the engine warns, gives it up and runs the model's step,
    eagerly or captured, with the eager engine's results; later steps do not try it again."""
    ref = ForceEngine(model3, device="cpu", precision="fp64", mode="eager")
    engine = ForceEngine(model3, device="cpu", pad=True, precision="fp64", dense_small=True)
    if captured:
        engine.mode = "cudagraph"
    calls = []

    def fail(*args, **kw):
        calls.append(1)
        raise RuntimeError("PassManager::run failed")

    engine._dense.from_numbers = fail
    mol = [molecule("C6H6")]
    with pytest.warns(RuntimeWarning, match="dense step for small molecules failed.*PassManager"):
        got = engine.compute(_batch(mol), to_host=True)
    _close(got, ref.compute(_batch(mol), to_host=True))
    assert engine._dense is None and calls == [1]
    _close(engine.compute(_batch(mol), to_host=True), ref.compute(_batch(mol), to_host=True))
    assert calls == [1]
    if captured:
        assert engine.last_bucket in engine._runners


def test_an_out_of_memory_dense_step_is_raised_as_it_is(model3, cpu_triton):
    """Running out of memory is not a reason to give the dense step up: the engine's batch splitting handles it."""
    engine = ForceEngine(model3, device="cpu", pad=True, precision="fp64", dense_small=True)

    def oom(*args, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")

    engine._dense.from_numbers = oom
    with pytest.raises(torch.OutOfMemoryError):
        engine._dense_step(*engine._graph(engine.buckets.select(16, 240)).inputs())
    assert engine._dense is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "fp64", "bf16"])
def test_the_shipped_small_student_takes_it_on_cuda(precision):
    """The shipped 64 x 3 student on CUDA, mode auto: benzene's step (16 slots), biphenyl's (32) and C60's (64) are
    the captured dense step, within fp32's tolerance of the float64 eager engine; MD through the calculator takes it
    too. bf16 takes the same float32 step (fp32's tolerance)."""
    from ase import units
    from ase.md.verlet import VelocityVerlet

    from mlff_distiller import StudentCalculator, load_model

    model = load_model("builtin:chno-gfn2-small")
    engine = ForceEngine(model, device="cuda", mode="cudagraph", precision=precision)
    ref = ForceEngine(load_model("builtin:chno-gfn2-small"), device="cpu", precision="fp64", mode="eager")
    # benzene: 16 slots, biphenyl (22 atoms): 32, C60: 64; tolerances in eV/Å and eV
    for name, slots, atol, etol in [("C6H6", 16, 1e-4, 1e-4), ("biphenyl", 32, 1e-4, 2e-4), ("C60", 64, 2e-4, 1e-3)]:
        mol = molecule(name)
        for _ in range(2):
            got = engine.compute(AtomsBatch.from_atoms([mol]), to_host=True)
        want = ref.compute(_batch([mol]), to_host=True)
        assert engine._dense is not None and engine.last_bucket in engine._dense_runners[slots], name
        assert not engine._runners, name
        np.testing.assert_allclose(got["forces"].double().numpy(), want["forces"].numpy(), atol=atol, err_msg=name)
        assert abs(float(got["energy"][0]) - float(want["energy"][0])) < etol, name
    atoms = molecule("CH3CH2OH")
    atoms.calc = StudentCalculator(model, device="cuda", precision=precision)
    maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(0))
    VelocityVerlet(atoms, 0.5 * units.fs).run(20)
    eng = atoms.calc.engine
    assert any(md.dense for md in eng._md_runners.values())
    f = atoms.get_forces()
    fr = ref.compute(_batch([atoms]), to_host=True)["forces"].numpy()
    np.testing.assert_allclose(f, fr, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_warmed_dense_steps_replay_on_cuda():
    """warmup(buckets=...) on CUDA captures the dense steps of 16, 32 and 64 slots on the buckets' content before
    any molecule came; benzene, biphenyl and C60 then replay those graphs (no capture at their first call), within
    fp32's tolerance of the float64 eager engine."""
    from mlff_distiller import load_model

    model = load_model("builtin:chno-gfn2-small")
    engine = ForceEngine(model, device="cuda", mode="cudagraph")
    ref = ForceEngine(load_model("builtin:chno-gfn2-small"), device="cpu", precision="fp64", mode="eager")
    probe = ForceEngine(model, device="cuda", mode="eager", pad=True, dense_small=False)
    slots = {"C6H6": 16, "biphenyl": 32, "C60": 64}
    buckets = {}
    for name in slots:
        probe.compute(AtomsBatch.from_atoms([molecule(name)]))
        buckets[name] = probe.last_bucket
    engine.warmup(buckets=list(buckets.values()))
    runners = {np_: dict(held) for np_, held in engine._dense_runners.items()}
    for name, np_ in slots.items():
        assert buckets[name] in runners[np_], name
        mol = molecule(name)
        got = engine.compute(AtomsBatch.from_atoms([mol]), to_host=True)
        want = ref.compute(_batch([mol]), to_host=True)
        assert (
            engine.last_bucket == buckets[name]
            and engine._dense_runners[np_][buckets[name]] is runners[np_][buckets[name]]
        )
        np.testing.assert_allclose(got["forces"].double().numpy(), want["forces"].numpy(), atol=2e-4, err_msg=name)
        assert abs(float(got["energy"][0]) - float(want["energy"][0])) < 1e-3, name
