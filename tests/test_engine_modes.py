"""ForceEngine modes: eager / padded / torch.compile / CUDA graphs, precisions, OOM splitting, warm-up, cache.

CPU tests use the padded eager path and ``torch.compile(backend="aot_eager")`` (no C++ toolchain needed);
``@pytest.mark.gpu`` tests run the CUDA-graph and Inductor paths against the eager reference.
"""

import os
import warnings

import numpy as np
import pytest
import torch
from ase.build import molecule
from ase.md.verlet import VelocityVerlet
from helpers import make_model, random_molecule, silicon_cell

from mlff_distiller import AtomsBatch, ForceEngine, StudentCalculator, predict_forces
from mlff_distiller.buckets import BucketLadder
from mlff_distiller.engine import AUTO_MAX_EDGES, TOLERANCES, configure_compile_cache
from mlff_distiller.testing import finite_difference_stress

gpu = pytest.mark.gpu


def _mols(n=12, seed=5, lo=1, hi=14):
    rng = np.random.default_rng(seed)
    return [random_molecule(int(k), rng) for k in rng.integers(lo, hi, size=n)]


def _close(out, ref, precision, n_structures):
    """The documented tolerance: |ΔE| ≤ tol_E·max(1, |E|), max|ΔF| ≤ tol_F·max(1, max|F|)."""
    tol_e, tol_f = TOLERANCES[precision]
    e, e_ref = out["energy"].double().cpu(), ref["energy"].double().cpu()
    f, f_ref = out["forces"].double().cpu(), ref["forces"].double().cpu()
    assert e.shape == (n_structures,) and torch.isfinite(e).all() and torch.isfinite(f).all()
    assert ((e - e_ref).abs() <= tol_e * e_ref.abs().clamp_min(1.0)).all(), (
        precision,
        (e - e_ref).abs().max(),
    )
    assert (f - f_ref).abs().max() <= tol_f * max(1.0, float(f_ref.abs().max())), precision


# ------------------------------------------------------------------------------------------------ CPU


def test_bad_mode_arguments(model):
    with pytest.raises(ValueError, match="unknown mode"):
        ForceEngine(model, device="cpu", mode="fast")
    with pytest.raises(ValueError, match="unknown compile_mode"):
        ForceEngine(model, device="cpu", mode="compile", compile_mode="turbo")
    with pytest.raises(ValueError, match="pad=False"):
        ForceEngine(model, device="cpu", mode="compile", compile_backend="aot_eager", pad=False)
    with pytest.raises(ValueError, match="BucketLadder"):
        ForceEngine(model, device="cpu", buckets=(16, 64))
    with pytest.raises(ValueError, match="memory_budget"):
        ForceEngine(model, device="cpu", memory_budget=0)
    with pytest.raises(ValueError, match="unknown precision"):
        ForceEngine(model, device="cpu", precision="int8")


def test_gpu_modes_fall_back_on_cpu_with_a_warning(model):
    for mode in ("cudagraph", "compile"):
        with pytest.warns(RuntimeWarning, match="padded eager path"):
            engine = ForceEngine(model, device="cpu", mode=mode)
        assert engine.mode == "padded-eager" and engine.pad
    assert ForceEngine(model, device="cpu", mode="auto").mode == "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StudentCalculator(model, device="cpu")  # the calculator's default "auto" is silent on a CPU


@pytest.fixture(scope="module")
def precision_case():
    model = make_model(seed=1)
    batch = AtomsBatch.from_atoms([molecule("C6H6"), molecule("CH3CH2OH"), molecule("H2O")])
    return model, batch, ForceEngine(model, device="cpu", precision="fp64").compute(batch)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
def test_precisions_within_documented_tolerance_cpu(precision, precision_case):
    model, batch, ref = precision_case
    for pad in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a CPU without 16-bit matmuls falls back to fp32 (also within tol)
            engine = ForceEngine(model, device="cpu", precision=precision, pad=pad)
        out = engine.compute(batch)
        assert out["forces"].dtype == torch.float32  # forces and energies stay float32
        _close(out, ref, precision, 3)


def test_reduced_precision_leaves_the_users_model_alone(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ForceEngine(model, device="cpu", precision="bf16").compute(AtomsBatch.from_atoms(molecule("H2O")))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(isinstance(m, torch.nn.Linear) for m in model.modules() if "Linear" in type(m).__name__)


def test_compile_no_recompilation_per_batch_cpu(model):
    """One Dynamo compilation per bucket; batches that land in a warmed bucket never recompile."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ladder = BucketLadder(min_atoms=16, max_atoms=64, min_edges=128, max_edges=4096, growth=2.0)
    engine = ForceEngine(model, device="cpu", mode="compile", compile_backend="aot_eager", buckets=ladder)
    eager = ForceEngine(model, device="cpu")
    mols = _mols(8, seed=2, lo=3, hi=9)
    batches = [AtomsBatch.from_atoms([m]) for m in mols]
    engine.warmup(structures=[mols[0]])
    warmed = set(engine._graphs)
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    assert graphs_after_warmup == len(warmed) >= 1
    for batch in batches:
        out = engine.compute(batch)
        _close(out, eager.compute(batch), "fp32", 1)
    new_buckets = set(engine._graphs) - warmed
    assert counters["stats"]["unique_graphs"] == graphs_after_warmup + len(new_buckets)
    assert len(new_buckets) <= 1  # 3-8 atoms, < 128 edges: one or two buckets in all


def test_oversized_batches_use_the_eager_path_with_stress_too(model):
    ladder = BucketLadder(min_atoms=8, max_atoms=16, min_edges=16, max_edges=64, growth=2.0)
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=True, buckets=ladder)
    ref = ForceEngine(model, device="cpu", precision="fp64")
    big = AtomsBatch.from_atoms([molecule("C6H6"), molecule("C6H6")])  # 24 atoms: beyond the ladder
    _close(engine.compute(big), ref.compute(big), "fp64", 2)
    big_cells = AtomsBatch.from_atoms([silicon_cell().repeat((2, 2, 2))] * 3)  # 48 atoms: beyond it
    out = engine.compute(big_cells, stress=True)
    np.testing.assert_allclose(out["stress"], ref.compute(big_cells, stress=True)["stress"], atol=1e-12)
    assert not engine._graphs


def _stress_batches():
    """Periodic cells (cubic, triclinic, a rattled supercell) mixed with molecules, which get no valid stress."""
    from helpers import triclinic_cu

    rattled = silicon_cell().repeat((2, 1, 1))
    rattled.rattle(0.05, seed=4)
    return [
        [silicon_cell()],
        [triclinic_cu(), rattled],
        [molecule("H2O"), silicon_cell(), molecule("CH4"), triclinic_cu()],
    ]


def test_padded_stress_equals_eager(model):
    """Stress in the padded modes: one step with the strain derivative per bucket (its own captured graph on
    CUDA), no eager fallback; energies, forces, stress and its validity mask equal the eager path's in fp64."""
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=True)
    ref = ForceEngine(model, device="cpu", precision="fp64")
    for _ in range(2):  # the second round reuses the buckets
        for mols in _stress_batches():
            batch = AtomsBatch.from_atoms(mols)
            out, want = engine.compute(batch, stress=True), ref.compute(batch, stress=True)
            assert engine.last_bucket is not None and engine.last_bucket in engine._graphs
            assert torch.equal(out["stress_valid"], want["stress_valid"])
            assert out["stress_valid"].sum() == sum(m.pbc.all() for m in mols) > 0
            for key in ("energy", "atomic_energies", "forces", "stress"):
                np.testing.assert_allclose(out[key].numpy(), want[key].numpy(), rtol=1e-10, atol=1e-12, err_msg=key)
            assert out["stress"][out["stress_valid"]].abs().max() > 1e-4  # not vacuous
            # The same engine serves energy + forces from the other step of the same bucket.
            _close(engine.compute(batch), want, "fp64", batch.num_structures)
            np.testing.assert_allclose(engine.compute(batch, stress=True, as_numpy=True)["stress"], want["stress"])


def test_compiled_stress_step_equals_eager(model):
    """mode="compile" (aot_eager on the CPU) with stress: the compiled forward under strained inputs, fp64."""
    engine = ForceEngine(model, device="cpu", precision="fp64", mode="compile", compile_backend="aot_eager")
    ref = ForceEngine(model, device="cpu", precision="fp64")
    for mols in _stress_batches()[:2]:
        batch = AtomsBatch.from_atoms(mols)
        out, want = engine.compute(batch, stress=True), ref.compute(batch, stress=True)
        assert engine.last_bucket is not None
        for key in ("energy", "forces", "stress"):
            np.testing.assert_allclose(out[key].numpy(), want[key].numpy(), rtol=1e-10, atol=1e-12, err_msg=key)
        _close(engine.compute(batch), want, "fp64", batch.num_structures)  # E+F of the same compiled bucket


def test_predict_forces_stress_padded_and_pipelined_equals_eager(model):
    """``predict_forces(stress=True)`` through the padded step and the pipelined loop: the same rows as eager
    (stress only for the periodic structures), in input order."""
    structures = [m for mols in _stress_batches() for m in mols]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cudagraph on a CPU: the padded eager path
        got = predict_forces(
            model,
            structures,
            device="cpu",
            precision="fp64",
            stress=True,
            mode="cudagraph",
            batch_size=3,
            pipeline=True,
        )
    want = predict_forces(model, structures, device="cpu", precision="fp64", stress=True, mode="eager", batch_size=3)
    for atoms, g, w in zip(structures, got, want, strict=True):
        assert ("stress" in g) == ("stress" in w) == bool(atoms.pbc.all())
        assert g["energy"] == pytest.approx(w["energy"], abs=1e-10)
        np.testing.assert_allclose(g["forces"], w["forces"], atol=1e-10)
        if "stress" in g:
            np.testing.assert_allclose(g["stress"], w["stress"], atol=1e-12)


def test_padded_stress_with_edge_compaction(model):
    """A bucket big enough for the in-step edge compaction (which takes no gradient through the shift vectors):
    the stress step must still see the strain of every kept pair."""
    from mlff_distiller.engine_padded import COMPACT_MIN_EDGES

    atoms = silicon_cell().repeat((2, 2, 2))
    atoms.rattle(0.05, seed=6)
    batch = AtomsBatch.from_atoms([atoms] * 4)
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=True, compact_edges=True)
    out = engine.compute(batch, stress=True)
    assert engine.last_bucket.edges >= COMPACT_MIN_EDGES  # the compaction's branch was live
    want = ForceEngine(model, device="cpu", precision="fp64").compute(batch, stress=True)
    np.testing.assert_allclose(out["stress"].numpy(), want["stress"].numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["forces"].numpy(), want["forces"].numpy(), rtol=1e-10, atol=1e-12)


def test_padded_stress_matches_strain_finite_differences(model):
    """The padded stress step's σ against central differences of the padded energies under a symmetric strain."""
    from helpers import triclinic_cu

    atoms = triclinic_cu().repeat((2, 1, 1))
    atoms.rattle(0.03, seed=2)
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=True)
    sigma = engine.compute(AtomsBatch.from_atoms(atoms), stress=True)["stress"][0].numpy()
    fd = finite_difference_stress(atoms, lambda frames: engine.compute(AtomsBatch.from_atoms(frames))["energy"])
    assert np.abs(sigma).max() > 1e-4
    np.testing.assert_allclose(sigma, fd, atol=1e-8)


def test_warmup_with_stress_runs_the_stress_step(model):
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=True)
    calls = {"stress": 0, "plain": 0}
    step, step_stress = engine._step, engine._step_stress
    engine._step = lambda *a: calls.__setitem__("plain", calls["plain"] + 1) or step(*a)
    engine._step_stress = lambda *a: calls.__setitem__("stress", calls["stress"] + 1) or step_stress(*a)
    times = engine.warmup(structures=[[silicon_cell()]], stress=True)
    assert len(times) == 1 and calls == {"stress": 1, "plain": 0}
    engine.warmup(buckets=list(times))
    assert calls == {"stress": 1, "plain": 1}


def test_calculator_stress_runs_padded(model):
    """ASE asking for stress (NPT, cell relaxations) goes through the padded step, not the eager path."""
    from ase.md.nptberendsen import NPTBerendsen

    atoms = silicon_cell().repeat((2, 2, 2))
    atoms.rattle(0.02, seed=1)
    atoms.calc = StudentCalculator(model, device="cpu", precision="fp64", mode="cudagraph")
    check = StudentCalculator(model, device="cpu", precision="fp64", mode="eager")
    engine = atoms.calc.engine
    calls = []
    step = engine._step_stress
    engine._step_stress = lambda *args: calls.append(1) or step(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cudagraph on a CPU: the padded eager path, with a warning
        dyn = NPTBerendsen(atoms, timestep=1.0, temperature_K=300, pressure_au=0.0, compressibility_au=1e-6)
        for _ in range(3):
            dyn.run(2)
            ref = atoms.copy()
            ref.calc = check
            np.testing.assert_allclose(atoms.get_stress(), ref.get_stress(), rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(atoms.get_forces(), ref.get_forces(), rtol=1e-9, atol=1e-12)
    assert len(calls) >= 6  # every stress request of the 6 steps ran the padded stress step


def test_calculator_returns_stress_with_forces_once_asked(model):
    """After the first stress request, a periodic system's forces come with its stress (one step for both): ASE's
    NPTBerendsen asks for both of the same positions in separate calls, and finds the stress cached."""
    from ase.md.nptberendsen import NPTBerendsen

    atoms = silicon_cell().repeat((2, 2, 2))
    atoms.rattle(0.02, seed=1)
    atoms.calc = StudentCalculator(model, device="cpu", precision="fp64")
    engine = atoms.calc.engine
    calls = []
    compute = engine.compute
    engine.compute = lambda batch, **kw: calls.append(kw.get("stress", False)) or compute(batch, **kw)
    atoms.get_forces()
    assert calls == [False]  # nothing asked for stress yet
    dyn = NPTBerendsen(atoms, timestep=1.0, temperature_K=300, pressure_au=0.0, compressibility_au=1e-6)
    dyn.run(1)
    calls.clear()
    dyn.run(5)
    assert len(calls) == 10 and all(calls)  # 2 calls per step (was 3), each with the stress
    fresh = atoms.copy()
    fresh.calc = StudentCalculator(model, device="cpu", precision="fp64", mode="eager")
    np.testing.assert_allclose(atoms.get_stress(), fresh.get_stress(), rtol=1e-9, atol=1e-12)
    assert len(calls) == 10  # the stress of the current positions was already there
    # NVT after that: the stress stops coming with the forces after STRESS_WINDOW calculations.
    from mlff_distiller.calculator import STRESS_WINDOW

    calls.clear()
    VelocityVerlet(atoms, timestep=1.0).run(STRESS_WINDOW + 3)
    assert calls == [True] * STRESS_WINDOW + [False] * 3
    molecule_atoms = molecule("H2O")
    molecule_atoms.calc = atoms.calc
    atoms.get_stress()
    molecule_atoms.get_forces()  # not periodic: no stress computed, no error
    assert calls[-1] is False


def test_oom_splits_and_keeps_order(model, monkeypatch):
    """An injected out-of-memory error for any batch above 20 atoms: batches are halved until they fit,
    nothing is lost and the order is the input order."""
    mols = _mols(17, seed=7)
    ref = predict_forces(model, mols, precision="fp64", batch_size=1)
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=True)
    real = ForceEngine.compute
    sizes = []

    def flaky(self, batch, **kw):
        sizes.append(batch.num_atoms)
        if batch.num_atoms > 20:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return real(self, batch, **kw)

    monkeypatch.setattr(ForceEngine, "compute", flaky)
    out = engine.predict(mols, atom_budget=10_000)
    assert len(out) == len(mols) and engine.oom_splits >= 2
    assert max(sizes) > 20 and engine.atom_budget() <= max(sizes) // 2
    for a, b, atoms in zip(ref, out, mols, strict=True):
        assert b["forces"].shape == (len(atoms), 3)
        assert a["energy"] == pytest.approx(b["energy"], abs=1e-10)
        np.testing.assert_allclose(a["forces"], b["forces"], atol=1e-10)
    with pytest.raises(torch.OutOfMemoryError):  # one structure that does not fit cannot be split
        engine.predict([mols[0] + mols[1] + mols[2] + mols[3]], atom_budget=10_000)


def _rows_equal(got, want, atoms_list, rtol=0.0):
    """Two predict() results: the same rows in input order, bit for bit (``rtol`` 0: the CPU, deterministic) or
    within ``rtol`` (CUDA: its float32 sums of atomics vary from run to run in the last bits)."""
    assert len(got) == len(want) == len(atoms_list)
    for a, b, atoms in zip(want, got, atoms_list, strict=True):
        assert b["forces"].shape == (len(atoms), 3) and b.keys() == a.keys()
        assert a["energy"] == pytest.approx(b["energy"], rel=rtol, abs=0.0)
        for key in ("forces", "energies", "stress"):
            if key in a:
                np.testing.assert_allclose(b[key], a[key], rtol=rtol, atol=rtol * 1e-2)


@pytest.mark.parametrize("pad", [False, True])
def test_pipelined_predict_equals_the_sequential_loop(model, pad):
    """The host/device pipeline (forced on here; on CUDA it is the default) gives the sequential loop's rows, in
    input order, over several batches of different sizes, periodic ones with stress included."""
    mols = _mols(11, seed=21)
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=pad)
    for kw in ({"batch_size": 3}, {"atom_budget": 25}, {"batch_size": 100}):
        want = engine.predict(mols, pipeline=False, **kw)
        _rows_equal(engine.predict(mols, pipeline=True, **kw), want, mols)
    cells = [silicon_cell(), mols[0], silicon_cell()]
    cells[2].rattle(0.05, seed=3)
    want = engine.predict(cells, batch_size=2, stress=True, pipeline=False)
    assert "stress" in want[0] and "stress" not in want[1]
    _rows_equal(engine.predict(cells, batch_size=2, stress=True, pipeline=True), want, cells)


def test_pipelined_oom_keeps_the_batch_in_flight(model, monkeypatch):
    """An out-of-memory error while another batch is in flight: that batch's rows are kept, the failing one is
    split, nothing is lost or duplicated and the order is the input order."""
    mols = _mols(17, seed=7)
    engine = ForceEngine(model, device="cpu", precision="fp64")
    want = engine.predict(mols, batch_size=1, pipeline=False)
    real = ForceEngine.compute
    calls = []

    def flaky(self, batch, **kw):
        calls.append(batch.num_structures)
        if len(calls) == 2:  # the second batch, launched while the first is in flight
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return real(self, batch, **kw)

    monkeypatch.setattr(ForceEngine, "compute", flaky)
    got = engine.predict(mols, batch_size=6, pipeline=True)
    assert engine.oom_splits == 1 and calls[:3] == [6, 6, 3]
    for a, b in zip(want, got, strict=True):
        assert a["energy"] == pytest.approx(b["energy"], abs=1e-10)
        np.testing.assert_allclose(a["forces"], b["forces"], atol=1e-10)
    assert len(got) == len(mols)


def test_memory_budget_batches_small(model):
    mols = _mols(8, seed=9)
    engine = ForceEngine(model, device="cpu", precision="fp64", memory_budget=1)
    assert engine.atom_budget() == 1
    seen = []
    real = engine.compute
    engine.compute = lambda batch, **kw: seen.append(batch.num_structures) or real(batch, **kw)
    out = engine.predict(mols)
    assert seen == [1] * 8
    ref = predict_forces(model, mols, precision="fp64")
    for a, b in zip(ref, out, strict=True):
        np.testing.assert_allclose(a["forces"], b["forces"], atol=1e-10)
    big = ForceEngine(model, device="cpu", memory_budget=10**12)
    assert big.atom_budget() > 10**5 and big.estimate_bytes(10, 100) > big.estimate_bytes(10, 10) > 0


def test_warmup(model):
    engine = ForceEngine(model, device="cpu", pad=True)
    times = engine.warmup(buckets=[(5, 20), (40, 900)], structures=[[molecule("C6H6"), molecule("C6H6")]])
    assert len(times) == 3 and all(t > 0 for t in times.values())
    assert set(times) == set(engine._graphs)
    with pytest.raises(ValueError, match="no bucket"):
        engine.warmup(buckets=[(10**7, 1)])
    with pytest.raises(ValueError, match="padded mode"):
        ForceEngine(model, device="cpu").warmup(buckets=[(5, 20)])


def test_configure_compile_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    path = configure_compile_cache(tmp_path / "cache")
    assert path.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(path))
    assert os.environ["TRITON_CACHE_DIR"].startswith(str(path))


def test_calculator_md_reuses_topology_and_matches_eager(model):
    """MD through the padded path (same atoms every step) equals the eager calculator step by step."""
    atoms = molecule("C6H6")
    atoms.rattle(0.05, seed=1)
    with pytest.warns(RuntimeWarning):
        calc = StudentCalculator(model, device="cpu", precision="fp64", mode="cudagraph")
    ref = StudentCalculator(model, device="cpu", precision="fp64", mode="eager")
    atoms.calc = calc
    dyn = VelocityVerlet(atoms, timestep=1.0)
    for _ in range(4):
        dyn.run(1)
        f = atoms.get_forces()
        check = atoms.copy()
        check.calc = ref
        np.testing.assert_allclose(f, check.get_forces(), atol=1e-10)
        assert atoms.get_potential_energy() == pytest.approx(check.get_potential_energy(), abs=1e-10)
    assert len(calc.engine._graphs) <= 2


# ------------------------------------------------------------------------------------------------ GPU


def _gpu_batches():
    return [
        [molecule("H2")],
        [molecule("C6H6")],
        [molecule("H2O"), molecule("CH4"), molecule("C6H6")],
        _mols(40, seed=11, lo=2, hi=20),
        [silicon_cell()],
    ]


@gpu
@pytest.mark.parametrize("compile_mode", [None, "default"])
def test_cuda_graph_equals_eager(model, compile_mode):
    eager = ForceEngine(model, device="cuda", precision="fp32")
    engine = ForceEngine(model, device="cuda", precision="fp32", mode="cudagraph", compile_mode=compile_mode)
    cases = _gpu_batches() if compile_mode is None else _gpu_batches()[:3]  # compiling costs ~10 s a bucket
    for _ in range(2):  # the second round replays the captured graphs
        for mols in cases:
            batch = AtomsBatch.from_atoms(mols)
            out, ref = engine.compute(batch), eager.compute(batch)
            for key in ("energy", "atomic_energies", "forces"):
                scale = ref[key].abs().max().clamp_min(1e-3)
                assert (out[key] - ref[key]).abs().max() / scale <= 1e-5, key
    assert engine.captured_buckets and len(engine.captured_buckets) == len(engine._graphs)


@gpu
def test_cuda_graph_outputs_survive_the_next_replay(model):
    engine = ForceEngine(model, device="cuda", mode="cudagraph")
    a = engine.compute(AtomsBatch.from_atoms(molecule("C6H6")))
    keep = a["forces"].clone()
    moved = molecule("C6H6")
    moved.rattle(0.1, seed=3)
    b = engine.compute(AtomsBatch.from_atoms(moved))
    assert torch.equal(a["forces"], keep) and not torch.equal(a["forces"], b["forces"])


@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
def test_precisions_within_documented_tolerance_gpu(precision):
    model = make_model(seed=1)
    batch = AtomsBatch.from_atoms([*_mols(30, seed=4, lo=3, hi=20), silicon_cell()])
    ref = ForceEngine(model, device="cuda", precision="fp64").compute(batch)
    for mode in ("eager", "cudagraph"):
        out = ForceEngine(model, device="cuda", precision=precision, mode=mode).compute(batch)
        _close(out, ref, precision, batch.num_structures)


@gpu
@pytest.mark.parametrize("compile_mode", ["default", "reduce-overhead"])
def test_compile_no_recompilation_gpu(model, compile_mode):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    engine = ForceEngine(model, device="cuda", mode="compile", compile_mode=compile_mode)
    eager = ForceEngine(model, device="cuda")
    mols = _mols(10, seed=2, lo=8, hi=12)
    engine.warmup(structures=[mols[0]])
    warmed, n0 = set(engine._graphs), counters["stats"]["unique_graphs"]
    for m in mols:
        batch = AtomsBatch.from_atoms([m])
        _close(engine.compute(batch), eager.compute(batch), "fp32", 1)
    assert counters["stats"]["unique_graphs"] == n0 + len(set(engine._graphs) - warmed)
    assert len(engine._graphs) <= 2


@gpu
def test_calculator_md_on_cuda_replays_graphs(model):
    atoms = molecule("C6H6")
    atoms.calc = StudentCalculator(model, device="cuda")
    assert atoms.calc.engine.mode == "cudagraph"
    ref = StudentCalculator(model, device="cuda", mode="eager")
    dyn = VelocityVerlet(atoms, timestep=0.5)
    for _ in range(5):
        dyn.run(2)
        check = atoms.copy()
        check.calc = ref
        np.testing.assert_allclose(atoms.get_forces(), check.get_forces(), atol=1e-5)
    assert 1 <= len(atoms.calc.engine.captured_buckets) <= 2
    eng = atoms.calc.engine
    assert eng._verlet_fill is not None  # the skin list stays in the static buffers between steps
    assert 1 <= eng.verlet.n_builds < eng.verlet.n_calls


@gpu
@pytest.mark.parametrize("mode", ["eager", "cudagraph"])
def test_pipelined_predict_on_cuda(model, mode):
    """On CUDA the pipeline is the default: its rows (copied back asynchronously through page-locked memory while
    the next batch is launched) equal the sequential loop's, over batches large enough that the copy of one
    overlaps the next step, and small ones that take the host-filled buckets (rows equal to float32 rounding: the
    device's atomic sums differ in the last bits between any two runs)."""
    engine = ForceEngine(model, device="cuda", mode=mode)
    for mols, bs in ((_mols(300, seed=31), 64), (_mols(40, seed=32), 3)):
        want = engine.predict(mols, batch_size=bs, pipeline=False)
        got = engine.predict(mols, batch_size=bs)
        _rows_equal(got, want, mols, rtol=1e-5)


@gpu
def test_oom_split_with_cuda_graphs(model, monkeypatch):
    mols = _mols(20, seed=3)
    ref = predict_forces(model, mols, device="cuda", batch_size=1)
    engine = ForceEngine(model, device="cuda", mode="cudagraph")
    real = ForceEngine._compute_padded

    def flaky(self, batch, to_host):
        if batch.num_atoms > 30:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return real(self, batch, to_host)

    monkeypatch.setattr(ForceEngine, "_compute_padded", flaky)
    out = engine.predict(mols)
    assert engine.oom_splits >= 1 and len(out) == len(mols)
    for a, b in zip(ref, out, strict=True):
        np.testing.assert_allclose(a["forces"], b["forces"], atol=1e-5)


@gpu
def test_probe_memory_gpu(model):
    engine = ForceEngine(model, device="cuda")
    ratio = engine.probe_memory(_mols(50, seed=1))
    assert 0.05 <= ratio < 50
    assert engine.atom_budget() >= 1


def test_auto_mode_ladder_stops_at_auto_max_edges():
    """Mode "auto" pads only batches of up to ~AUTO_MAX_EDGES edges (larger ones run eager, where padding would
    cost more than the replay saves); an explicit padded mode keeps the full default ladder; a ladder the caller
    gives is used as is."""
    model = make_model()
    auto = ForceEngine(model, device="cpu", mode="auto")
    assert auto.buckets.select(100, AUTO_MAX_EDGES) is not None
    assert auto.buckets.select(100, 2 * AUTO_MAX_EDGES) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cudagraph on a CPU: padded eager, with a warning
        graph = ForceEngine(model, device="cpu", mode="cudagraph")
    assert graph.buckets.select(100, 2 * AUTO_MAX_EDGES) is not None
    mine = BucketLadder(max_edges=1024)
    assert ForceEngine(model, device="cpu", mode="auto", buckets=mine).buckets is mine


@gpu
def test_cuda_graph_stress_equals_eager(model):
    """The captured stress step (its own graph per bucket) against the eager path on CUDA, twice (replays)."""
    eager = ForceEngine(model, device="cuda", precision="fp32")
    engine = ForceEngine(model, device="cuda", precision="fp32", mode="cudagraph")
    for _ in range(2):
        for mols in _stress_batches():
            batch = AtomsBatch.from_atoms(mols)
            out, ref = engine.compute(batch, stress=True), eager.compute(batch, stress=True)
            assert torch.equal(out["stress_valid"].cpu(), ref["stress_valid"].cpu())
            for key in ("energy", "forces", "stress"):
                scale = ref[key].abs().max().clamp_min(1e-3)
                assert (out[key] - ref[key]).abs().max() / scale <= 1e-5, key
    assert engine._stress_runners and set(engine._stress_runners) <= set(engine._graphs)
    captured = len(engine._stress_runners)
    engine.compute(AtomsBatch.from_atoms(_stress_batches()[0]), stress=True)
    assert len(engine._stress_runners) == captured  # a replay, not a new capture


@gpu
def test_warmup_captures_the_stress_steps(model):
    engine = ForceEngine(model, device="cuda", mode="cudagraph")
    times = engine.warmup(structures=[[silicon_cell()]], stress=True)
    assert list(times) == list(engine._stress_runners) and not engine._runners
    engine.warmup(buckets=[next(iter(times))])
    assert list(engine._runners) == list(times)  # the energy + forces step of the same bucket
